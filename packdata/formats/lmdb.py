"""LMDB shards: a writer that grows its map on its own, and a fork-safe reader.

A shard is an ordinary LMDB environment directory (``data.mdb``) that
``mdb_stat`` and ``lmdb.open(path, readonly=True)`` open. Keys are 8-byte
big-endian sample indices within the shard (global index minus the shard's
``first_index``), so they sort in sample order, every put uses append mode, and
a shard is self-contained: it can be written by its own task and staged alone;
values are :mod:`packdata.records` records.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from pathlib import Path

import lmdb
import numpy as np

from packdata.errors import CapacityError, PackFormatError
from packdata.manifest import ShardInfo, file_sha256
from packdata.records import Sample, encode_record

__all__ = ["DATA_FILE", "LMDBShardReader", "LMDBShardWriter", "encode_key"]

DATA_FILE = "data.mdb"
MAX_READERS = 2048
_KEY = struct.Struct(">Q")
_INITIAL_MAP = 64 << 20
_MADV_WILLNEED = 3
_libc = ctypes.CDLL(None, use_errno=True)


def encode_key(index: int) -> bytes:
    """The LMDB key of the record at ``index`` within its shard: 8 bytes, big-endian."""
    return _KEY.pack(index)


class LMDBShardWriter:
    """Appends records to one LMDB shard in large transactions.

    The map starts small and doubles before any transaction that might not fit
    it, so a user never meets ``MapFullError`` and a small disk never sees a
    1 TB sparse map. Writes are not synced per commit; :meth:`sync` makes
    everything committed durable (call it before recording a checkpoint).
    """

    def __init__(self, path: str | os.PathLike, *, resume_at: int | None = None) -> None:
        self.path = Path(path)
        self._env = lmdb.open(
            os.fspath(self.path),
            map_size=_INITIAL_MAP,
            subdir=True,
            sync=False,
            metasync=False,
            readahead=False,
            meminit=False,
            max_readers=MAX_READERS,
            lock=True,
        )
        self._map_size = self._env.info()["map_size"]
        self._page = self._env.stat()["psize"]
        if resume_at is not None:
            self._truncate(resume_at)

    @staticmethod
    def shard_name(number: int) -> str:
        """File name of shard ``number`` inside the pack."""
        return f"shard-{number:05d}.lmdb"

    @staticmethod
    def finalize(pack: Path, shards: list[ShardInfo]) -> list[ShardInfo]:
        """LMDB shards keep the names they were written under."""
        return shards

    def _truncate(self, first_dropped: int) -> None:
        """Delete every record at or after index ``first_dropped``."""
        with self._env.begin(write=True) as txn:
            cursor = txn.cursor()
            if cursor.set_range(encode_key(first_dropped)):
                while cursor.delete():
                    pass

    def _used_bytes(self) -> int:
        return (self._env.info()["last_pgno"] + 1) * self._page

    def _grow_to(self, needed: int) -> None:
        size = self._map_size
        while size < needed:
            size *= 2
        if size != self._map_size:
            self._env.set_mapsize(size)
            self._map_size = size

    def write(self, items: list[tuple[int, Sample]]) -> None:
        """Append ``(index in shard, sample)`` pairs in one transaction, growing the map as needed."""
        records = [(index, encode_record(sample)) for index, sample in items]
        payload = sum(len(v) + self._page for _, v in records)  # overflow pages round up
        self._grow_to(self._used_bytes() + 2 * payload + (16 << 20))
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    cursor = txn.cursor()
                    for index, value in records:
                        if not cursor.put(encode_key(index), value, append=True):
                            raise PackFormatError(f"record {index} is out of order", path=self.path)
                return
            except lmdb.MapFullError:
                self._grow_to(self._map_size * 2)
            except lmdb.DiskError as exc:
                raise CapacityError(
                    f"disk error while writing: {exc}", path=self.path, hint="Free space on the destination disk"
                ) from exc

    def sync(self) -> None:
        """Make every committed transaction durable."""
        self._env.sync(True)

    def close(self) -> tuple[int, str]:
        """Sync and close; the shard is complete. Returns its byte size and SHA-256."""
        self.sync()
        self._env.close()
        (self.path / "lock.mdb").unlink(missing_ok=True)
        data = self.path / DATA_FILE
        return data.stat().st_size, file_sha256(data)


_open_envs: dict[str, tuple[int, lmdb.Environment]] = {}


def _shared_env(path: str, readahead: bool) -> lmdb.Environment:
    """One read-only environment per shard per process, reopened after a fork.

    py-lmdb refuses to open an environment twice in one process, and a forked
    child inherits that refusal along with the parent's handle. Sharing the
    handle between datasets in a process, and closing the inherited one in a
    child before reopening, makes both everyday patterns work: two datasets over
    one pack, and ``ds[0]`` in the parent before DataLoader workers fork.
    """
    entry = _open_envs.get(path)
    if entry is not None:
        pid, env = entry
        if pid == os.getpid():
            return env
        env.close()  # the parent's handle, inherited through fork
    env = lmdb.open(
        path,
        readonly=True,
        lock=False,
        readahead=readahead,
        meminit=False,
        max_readers=MAX_READERS,
        subdir=True,
        create=False,
    )
    _open_envs[path] = (os.getpid(), env)
    return env


class LMDBShardReader:
    """Reads records of one shard by their index within the shard.

    Opened lazily in the process that uses it. With ``readahead=False`` (the
    default) the kernel reads no neighbouring pages on a fault, which suits
    random access; each value larger than a page is then prefetched with one
    ``madvise(MADV_WILLNEED)`` over its span, so a cold 90 KB value costs one
    large read instead of twenty-two 4 KB page faults.
    """

    def __init__(self, path: str | os.PathLike, *, readahead: bool = False) -> None:
        self.path = os.fspath(path)
        if not os.path.isfile(os.path.join(self.path, DATA_FILE)):
            raise PackFormatError(
                f"shard is missing its {DATA_FILE}",
                path=self.path,
                hint="The pack is incomplete: convert or stage it again",
            )
        try:
            self._env = _shared_env(self.path, readahead)
        except lmdb.Error as exc:
            raise PackFormatError(f"cannot open LMDB shard: {exc}", path=self.path) from exc
        self._txn = self._env.begin(buffers=True)
        self._prefetch = not readahead

    def get(self, index: int) -> memoryview:
        """The record at ``index`` within the shard, valid until the reader closes."""
        value = self._txn.get(encode_key(index))
        if value is None:
            raise PackFormatError(
                f"record {index} is missing", path=self.path, hint="The shard is damaged: run `packdata verify`"
            )
        if self._prefetch and len(value) > mmap.PAGESIZE:
            _willneed(value)
        return value

    def items(self):
        """Iterate ``(index in shard, record)`` in key order."""
        for key, value in self._txn.cursor():
            yield _KEY.unpack(key)[0], value

    def close(self) -> None:
        """End the read transaction (the shared environment stays open)."""
        self._txn.abort()


def _willneed(view: memoryview) -> None:
    """Ask the kernel to read a value's pages in one request before we touch them."""
    address = np.frombuffer(view, dtype=np.uint8).ctypes.data
    start = address - address % mmap.PAGESIZE
    _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(address + len(view) - start), _MADV_WILLNEED)
