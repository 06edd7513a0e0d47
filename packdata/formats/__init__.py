"""Storage formats: one writer and one reader per format, no torch."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from packdata.pack.manifest import ShardInfo
    from packdata.pack.records import Sample

__all__ = ["FORMATS", "ShardWriter", "format_from_path", "shard_writer"]

FORMATS = ("lmdb", "tfrecord")


def format_from_path(path: str) -> str | None:
    """The format a destination's suffix names (``out.lmdb`` -> ``"lmdb"``), or None."""
    lowered = path.rstrip("/").lower()
    if lowered.endswith(".lmdb"):
        return "lmdb"
    if lowered.endswith((".tfrecord", ".tfrecords")):
        return "tfrecord"
    return None


class ShardWriter(Protocol):
    """What convert needs of a format's shard writer (see :func:`shard_writer`)."""

    def __init__(self, path: str | os.PathLike, *, resume_at: int | None = None) -> None: ...
    def write(self, items: list[tuple[int, Sample]]) -> None: ...
    def sync(self) -> None: ...
    def close(self) -> tuple[int, str]: ...
    @staticmethod
    def shard_name(number: int) -> str: ...
    @staticmethod
    def finalize(pack: Path, shards: list[ShardInfo]) -> list[ShardInfo]: ...


def shard_writer(fmt: str) -> type[ShardWriter]:
    """The shard writer class of format ``fmt``.

    A writer is constructed as ``cls(path, resume_at=None)``, takes batches of
    ``(index within the shard, Sample)`` in :meth:`write` (``resume_at`` is the
    index within the shard of the first record to drop), makes them durable in
    :meth:`sync` and returns ``(bytes, sha256)`` from :meth:`close`. Its static
    ``shard_name(number)`` names shard files and ``finalize(pack, shards)``
    gives them their final names once the shard count is known.
    """
    if fmt == "lmdb":
        from packdata.formats.lmdb import LMDBShardWriter

        return LMDBShardWriter
    if fmt == "tfrecord":
        from packdata.formats.tfrecord import TFRecordShardWriter

        return TFRecordShardWriter
    raise ValueError(f"format should be one of {', '.join(FORMATS)}, but got format={fmt!r}")
