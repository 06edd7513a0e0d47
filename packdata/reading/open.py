"""Open the dataset users train with on a pack, whatever its format."""

from __future__ import annotations

import os
from typing import Any

from packdata.errors import ConfigError
from packdata.pack.manifest import read_manifest
from packdata.pack.urls import display_url, is_url, open_url, read_url_manifest
from packdata.reading.datasets import LMDBDataset
from packdata.reading.streaming import TFRecordDataset
from packdata.reading.tfrecord_indexed import TFRecordIndexedDataset

__all__ = ["datasets_for", "open_dataset"]

_MAP_STYLE = {cls.pack_format: cls for cls in (LMDBDataset, TFRecordIndexedDataset)}
_STREAMING = {cls.pack_format: cls for cls in (TFRecordDataset,)}


def datasets_for(fmt: str) -> str:
    """The datasets that read packs of format ``fmt``, as a hint names them (``packdata.LMDBDataset``)."""
    names = [f"packdata.{cls.__name__}" for table in (_MAP_STYLE, _STREAMING) if (cls := table.get(fmt))]
    return " or ".join(names) or f"no dataset of this packdata (format {fmt!r})"


def open_dataset(path: str | os.PathLike, *, streaming: bool = False, **kwargs: Any) -> Any:
    """The dataset over the pack at ``path``, chosen by the pack's format.

    Args:
        path: the pack, or its URL (``s3://bucket/train``; ``storage_options`` in ``kwargs``).
        streaming: prefer the format's streaming (iterable) dataset when it has
            one; otherwise, and by default, the map-style dataset.
        **kwargs: passed to the dataset (``transform``, ``decode``, ...).

    Raises:
        ConfigError: no dataset reads the pack's format, or a URL is given without ``streaming=True``
            or for a format without a streaming dataset.
    """
    shown: str | os.PathLike = path
    if is_url(path):  # as a local path, "s3://b/x" would be the folder s3:/b/x
        fs, root = open_url(os.fspath(path), kwargs.get("storage_options"))
        shown = display_url(os.fspath(path))
        fmt = read_url_manifest(fs, root.rstrip("/"), shown)[0].format
    else:
        fmt = read_manifest(path).format
    cls = (_STREAMING.get(fmt) if streaming else None) or _MAP_STYLE.get(fmt)
    if cls is None:
        raise ConfigError(f"no dataset reads packs of format {fmt!r}", path=shown)
    if is_url(path) and cls not in _STREAMING.values():
        raise ConfigError(
            f"{shown}: a map-style dataset reads local files only",
            hint="Pass streaming=True" if fmt in _STREAMING else "Stage it first: packdata.stage(url, to=DIR)",
        )
    return cls(path, **kwargs)
