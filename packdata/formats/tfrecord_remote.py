"""TFRecord shards read straight from object storage: byte ranges fetched ahead, every record checked.

:class:`RemoteShardReader` streams a run of records of one shard the way the
local reader does (whole records in chunks of about 8 MB, the same framing and
CRC checks on each, see :meth:`TFRecordShardReader.check_chunk`), fetching the
chunks with ranged requests two ahead of the one being checked, in a
background thread. A request that fails (a dropped connection, a throttled
read) is retried with backoff; a chunk that still cannot be read raises one
:class:`~packdata.errors.PackFormatError` naming the shard's URL and byte range,
so an epoch never skips or repeats a record silently.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from packdata.errors import ConfigError, PackFormatError
from packdata.formats.remote_pack import fetch_pack_skeleton, fetch_range
from packdata.formats.tfrecord import NAME, TFRecordShardReader, chunk_plan
from packdata.formats.tfrecord_example import check_record
from packdata.formats.tfrecord_tables import index_path
from packdata.pack.urls import display_url

__all__ = ["RemoteShardReader", "fetch_skeleton"]


class RemoteShardReader(TFRecordShardReader):
    """Reads records of one remote shard (see the module docstring).

    ``BACKOFF`` (0.5 s) is the first retry's delay; four tries wait 0.5 + 1 + 2 s in all.

    Args:
        fs: the fsspec filesystem.
        remote_path: the shard's path on ``fs``.
        shown: the shard's URL without credentials (for messages).
        size: the shard's byte size from the manifest.
        check_crc: check both CRC32Cs of every record.
        retries: tries per chunk before giving up.
        backoff: seconds before the first retry, doubling (default :attr:`BACKOFF`).
        ahead: chunks fetched ahead of the one being checked.
    """

    def __init__(
        self,
        fs: Any,
        remote_path: str,
        shown: str,
        size: int,
        *,
        check_crc: bool = True,
        retries: int = 4,
        backoff: float | None = None,
        ahead: int = 2,
    ) -> None:
        super().__init__(shown, check_crc=check_crc, expected_bytes=size)
        self.fs, self.remote_path, self.size = fs, remote_path, size
        self.retries, self.ahead = retries, ahead
        self.backoff = self.BACKOFF if backoff is None else backoff

    BACKOFF = 0.5

    def open(self) -> RemoteShardReader:
        """Nothing to open: every chunk is its own request."""
        return self

    def _fetch(self, base: int, end: int) -> bytes:
        return fetch_range(self.fs, self.remote_path, self.path, base, end, retries=self.retries, backoff=self.backoff)

    def stream(
        self,
        offsets: np.ndarray,
        lengths: np.ndarray,
        start: int,
        stop: int,
        payloads: np.ndarray | None = None,
        *,
        copy: bool = False,
    ) -> Iterator[memoryview | bytes]:
        """The data (or payloads) of records ``start..stop-1``, checked, chunks fetched ahead."""
        plan = list(chunk_plan(offsets, lengths, start, stop, self.size))
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="packdata-readahead") as pool:
            pending: deque[Future[bytes]] = deque()
            for _, _, first_byte, end_byte in plan[: self.ahead + 1]:
                pending.append(pool.submit(self._fetch, first_byte, end_byte))
            for k, (i, j, base, _) in enumerate(plan):
                data = pending.popleft().result()
                if k + self.ahead + 1 < len(plan):
                    _, _, nbase, nend = plan[k + self.ahead + 1]
                    pending.append(pool.submit(self._fetch, nbase, nend))
                yield from self.check_chunk(memoryview(data), base, offsets, lengths, i, j, payloads)

    def read(self, offset: int, length: int) -> memoryview:
        """One record (random access): a single ranged request, checked."""
        data = memoryview(self._fetch(offset, offset + length))
        return check_record(data, 0, length, path=self.path, offset=offset, check_crc=self.check_crc)

    def close(self) -> None:
        """Nothing to close."""


def fetch_skeleton(url: str, storage_options: dict[str, Any] | None, cache_dir: str | os.PathLike | None) -> Path:
    """A local copy of a remote TFRecord pack without its shards: manifest, sample index, shard side tables.

    A reader streams the shards from ``url`` and reads everything else from
    this copy (``cache_dir``, default the system's temporary folder), which is
    reused while the remote manifest is the same and replaced atomically when
    not (:func:`~packdata.formats.remote_pack.fetch_pack_skeleton`).

    Raises:
        PackFormatError: not a pack, or a file it needs is missing.
        ConfigError: not a TFRecord pack (LMDB reads through local files: stage it).
    """
    shown = display_url(url)
    dest, manifest, _, _ = fetch_pack_skeleton(url, storage_options, cache_dir)
    if manifest.format != NAME:
        raise ConfigError(
            f"{shown}: a {manifest.format} pack is read through local files",
            hint=f"Stage it first: packdata.stage({shown!r}, to='/nvme/cache'), then open the staged copy",
        )
    for shard in manifest.shards:
        if not index_path(dest / shard.file).is_file():
            name = index_path(shard.file).as_posix()
            raise PackFormatError(f"{shown}: {name} is missing", hint="The pack is incomplete")
    return dest
