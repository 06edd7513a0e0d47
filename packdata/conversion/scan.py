"""What a conversion's SRC is: the source at a path or URL in the layout asked for (or detected), refused
when it is a pack, and walked after the objects a copy from a URL refused."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any, cast

from packdata.conversion.layouts import AnySource, GroupedSource, detect_grouped, scan_grouped
from packdata.conversion.list_rows import LIST_SUFFIXES
from packdata.conversion.lists import scan_list
from packdata.conversion.remote_folder import scan_remote_folder
from packdata.conversion.sources import Skip, Source, listed_class, scan_source, with_classes
from packdata.conversion.tars import is_tar_pattern, scan_tars
from packdata.errors import ConfigError, PackFormatError
from packdata.pack.manifest import MANIFEST_NAME, read_manifest
from packdata.pack.urls import display_url

__all__ = ["REFUSED_OBJECTS", "is_pack", "scan_any", "streams_in_place", "with_refused"]


def streams_in_place(url: str) -> bool:
    """Whether a source URL is read in place (tar shards, a list file), not copied into a work folder first."""
    return is_tar_pattern(url) or os.path.splitext(url.rstrip("/"))[1].lower() in LIST_SUFFIXES


def scan_any(
    src: Path | str,
    kind: str,
    layout: str,
    require: tuple[str, ...],
    path_column: str,
    label_column: str | None,
    storage_options: dict[str, Any] | None = None,
) -> AnySource:
    """The source at ``src`` (a path, or the URL of tar shards or a list) in the layout asked for (or detected)."""
    if layout not in ("auto", "classes", "grouped"):
        raise ConfigError(f"layout should be 'auto', 'classes' or 'grouped', but got layout={layout!r}")
    is_list = os.path.splitext(os.fspath(src).rstrip("/"))[1].lower() in LIST_SUFFIXES
    if isinstance(src, Path):
        is_list = is_list and (src.is_file() or not src.exists())
    if path_column != "path" and not is_list:
        raise ConfigError(
            "path_column=COLUMN is for list files", hint="A folder's files are found by walking it: drop it"
        )
    if is_tar_pattern(os.fspath(src)):
        if require:
            raise ConfigError(
                "require=FIELDS is for grouped files and list files", hint="Drop it: tar samples are kept whole"
            )
        return scan_tars(os.fspath(src), storage_options)
    if isinstance(src, str) and os.path.splitext(src.rstrip("/"))[1].lower() not in LIST_SUFFIXES:
        if require or label_column is not None:
            raise ConfigError(
                "require=FIELDS and label_column=COLUMN are for grouped files and list files", path=display_url(src)
            )
        return scan_remote_folder(src, storage_options, kind, layout)  # a folder at a URL, on Ray
    if isinstance(src, str):
        return scan_list(
            src,
            path_column=path_column,
            label_column=label_column,
            storage_options=storage_options,
            require=require,
        )
    if is_list:
        return scan_list(src, path_column=path_column, label_column=label_column, require=require)
    if label_column is not None:
        raise ConfigError("label_column=COLUMN is for list files", hint="Class folders give labels: drop it")
    if is_pack(src):  # its manifest, index and shards would be packed as samples
        raise ConfigError(
            "is a packdata pack, not a folder of files to pack",
            path=src,
            hint=f"To repack it (another format or shard size), export it first (`packdata export {src} DIR`), "
            "then convert DIR",
        )
    if layout == "grouped" or (layout == "auto" and kind == "auto" and src.is_dir() and detect_grouped(src)):
        return scan_grouped(src, require)
    if require:
        raise ConfigError("require=FIELDS is for grouped files and list files", hint="Pass layout='grouped'")
    return scan_source(src, kind)


def is_pack(folder: Path) -> bool:
    """Whether ``folder`` is a packdata pack: a manifest.json that packdata reads, not just any file of that name."""
    if not (folder / MANIFEST_NAME).is_file():
        return False
    try:
        read_manifest(folder)
    except PackFormatError:
        return False
    return True


REFUSED_OBJECTS: ContextVar[tuple[Path, tuple[Skip, ...]]] = ContextVar(
    "packdata_refused_objects", default=(Path(), ())
)
"""Objects of a source folder at a URL that were not copied into its work folder (that folder, its skips).

Set by :func:`~packdata.conversion.remote_convert.convert_from_url` around the
conversion of the work folder, so every conversion of that folder (also through
an upload or an append) walks them first and they land in the skip report,
counted among the files found.
"""


class _WithSkips:
    """A scanned source whose walk yields some skips first (objects refused before the walk), then its own."""

    def __init__(self, source: AnySource, skips: tuple[Skip, ...]) -> None:
        self._source, self._skips = source, skips

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)

    def walk(self, spill: Path | None = None) -> Iterator[Any]:
        """The refused objects' skips, then the source's walk."""
        yield from self._skips
        yield from self._source.walk(spill)


def with_refused(source: AnySource, src: Path | str) -> AnySource:
    """``source``, walking first the objects refused when ``src`` was copied from a URL (:data:`REFUSED_OBJECTS`)."""
    folder, skips = REFUSED_OBJECTS.get()
    if not skips or not isinstance(src, Path) or src != folder:
        return source
    if isinstance(source, Source):  # a class none of whose objects was copied is still a class of the listing
        listed = {top for skip in skips if skip.reason in _MISSED and (top := listed_class(skip.key, source.kind))}
        source = with_classes(source, listed)
    if isinstance(source, GroupedSource):  # its walk skips a group one of whose objects was not copied whole
        source = dataclasses.replace(source, lost=tuple(skip for skip in skips if skip.reason in _MISSED))
        skips = tuple(skip for skip in skips if skip.reason not in _MISSED)
    return cast(AnySource, _WithSkips(source, skips))


_MISSED = ("changed", "vanished")
"""The reasons of objects listed as they are but not copied: the listing's classes count them."""
