"""LMDB shards: a writer that grows its map on its own, and a fork-safe reader.

A shard is an ordinary LMDB environment directory (``data.mdb``) that
``mdb_stat`` and ``lmdb.open(path, readonly=True)`` open. Keys are 8-byte
big-endian sample indices within the shard (global index minus the shard's
``first_index``), so they sort in sample order, every put uses append mode, and
a shard is self-contained: it can be written by its own task and staged alone;
values are :mod:`packdata.records` records.

Beside ``data.mdb`` the writer leaves ``records.i64``: int64 pairs, little-
endian, first ``(last LMDB transaction id, record count)``, then the byte offset
and length of each record's payload (the file's bytes) inside ``data.mdb`` (LMDB
ignores other files in its directory; any later write to the environment changes
its transaction id and retires the table). The reader uses it to fetch a payload
with one ``pread`` instead of a B-tree lookup through the memory map. That
matters cold: py-lmdb touches every page of a value before returning it, so with
readahead off a 40 KB value costs ten synchronous 4 KB faults, about 4x slower
than reading the same bytes from a folder; one ``pread`` is one I/O request.
Without the table (or once the environment was written to) the reader falls back to
LMDB's own lookup, so the table is an accelerator, never a second source of
truth.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from pathlib import Path

import lmdb
import numpy as np

from packdata.errors import CapacityError, PackFormatError, destination_error
from packdata.manifest import ShardInfo, file_sha256
from packdata.records import Sample, encode_record, payload_start

__all__ = ["DATA_FILE", "RECORDS_FILE", "LMDBShardReader", "LMDBShardWriter", "encode_key", "record_locations"]

DATA_FILE = "data.mdb"
MAX_READERS = 2048
_KEY = struct.Struct(">Q")
_INITIAL_MAP = 64 << 20
_LOCK_BYTES = 64 * MAX_READERS + 4096  # LMDB's lock file: a header and one 64-byte slot per reader
RECORDS_FILE = "records.i64"


def encode_key(index: int) -> bytes:
    """The LMDB key of the record at ``index`` within its shard: 8 bytes, big-endian."""
    return _KEY.pack(index)


def _reserve_lock_file(shard: Path) -> None:
    """Create the shard folder and allocate its ``lock.mdb`` before LMDB maps it.

    LMDB grows the lock file with ``ftruncate`` and writes it through a shared
    map; on a full tmpfs that write is a ``SIGBUS`` that kills the process.
    Allocating the blocks first turns a full disk into an ``ENOSPC`` here.

    Raises:
        CapacityError: the disk is full.
        ConfigError: the folder or file cannot be created.
    """
    lock = shard / "lock.mdb"
    try:
        shard.mkdir(exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.posix_fallocate(fd, 0, _LOCK_BYTES)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # no fallocate here: LMDB allocates as usual
                raise
        finally:
            os.close(fd)
    except OSError as exc:
        raise destination_error(exc, lock if shard.is_dir() else shard) from exc


class LMDBShardWriter:
    """Appends records to one LMDB shard in large transactions.

    The map starts small and doubles before any transaction that might not fit
    it, so a user never meets ``MapFullError`` and a small disk never sees a
    1 TB sparse map. Writes are not synced per commit; :meth:`sync` makes
    everything committed durable (call it before recording a checkpoint).
    """

    def __init__(self, path: str | os.PathLike, *, resume_at: int | None = None) -> None:
        self.path = Path(path)
        _reserve_lock_file(self.path)
        self._env = lmdb.open(
            os.fspath(self.path),
            map_size=_INITIAL_MAP,
            subdir=True,
            sync=False,
            metasync=False,
            readahead=False,
            meminit=True,  # zero unused page bytes: the same source gives a byte-identical data.mdb
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
            except lmdb.Error as exc:  # a short write on a full disk surfaces as EIO or ENOSPC
                raise CapacityError(
                    f"cannot write the shard ({exc}); {_free(self.path)} free on its disk",
                    path=self.path,
                    hint="Free space on the destination disk and rerun with --resume",
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
        txnid, locations = record_locations(self.path)
        with open(self.path / RECORDS_FILE, "wb") as f:
            f.write(np.array([txnid, len(locations)], dtype="<i8").tobytes())
            f.write(locations.astype("<i8").tobytes())
            os.fsync(f.fileno())
        return data.stat().st_size, file_sha256(data)


def _free(path: Path) -> str:
    stat = os.statvfs(path)
    return f"{stat.f_bavail * stat.f_frsize / 1e6:.1f} MB"


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


class _PyBuffer(ctypes.Structure):
    _fields_ = [
        ("buf", ctypes.c_void_p), ("obj", ctypes.py_object), ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p),
    ]  # fmt: skip


def _address(view: memoryview) -> int:
    """The memory address of a (read-only) buffer."""
    buffer = _PyBuffer()
    ctypes.pythonapi.PyObject_GetBuffer(ctypes.py_object(view), ctypes.byref(buffer), 0)
    try:
        return int(buffer.buf)
    finally:
        ctypes.pythonapi.PyBuffer_Release(ctypes.byref(buffer))


def _map_base(data_file: str) -> int:
    """Start address of this process's mapping of ``data_file`` (from /proc/self/maps)."""
    real = os.path.realpath(data_file)
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") == real and fields[2] == "00000000":
                return int(fields[0].split("-")[0], 16)
    raise OSError(f"{real} is not mapped in this process")


def record_locations(path: str | os.PathLike) -> tuple[int, np.ndarray]:
    """The last transaction id, and ``(offset, length)`` of every payload inside ``data.mdb`` in key order."""
    env = lmdb.open(os.fspath(path), readonly=True, lock=False, readahead=True, subdir=True, create=False)
    try:
        base = _map_base(os.path.join(path, DATA_FILE))
        with env.begin(buffers=True) as txn:
            n = txn.stat()["entries"]
            out = np.empty((n, 2), dtype=np.int64)
            for i, (key, value) in enumerate(txn.cursor()):
                if _KEY.unpack(key)[0] != i:
                    raise PackFormatError(f"record {i} is missing", path=path)
                start = payload_start(value)
                out[i] = (_address(value) - base + start, len(value) - start)
        txnid = env.info()["last_txnid"]
    finally:
        env.close()
    return txnid, out


class LMDBShardReader:
    """Reads records of one shard by their index within the shard.

    Opened lazily in the process that uses it. Records are fetched with one
    ``pread`` each through the shard's ``records.i64`` table when it is there
    (see the module docstring), else through LMDB's lookup; ``readahead``
    applies to the LMDB map only.
    """

    def __init__(self, path: str | os.PathLike, *, readahead: bool = False) -> None:
        self.path = os.fspath(path)
        data = os.path.join(self.path, DATA_FILE)
        if not os.path.isfile(data):
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
        self._entries = self._txn.stat()["entries"]
        self._locations: np.ndarray | None = None
        self._fd = -1
        table = os.path.join(self.path, RECORDS_FILE)
        if os.path.isfile(table) and os.path.getsize(table) == 16 * (self._entries + 1):
            rows = np.fromfile(table, dtype="<i8").reshape(-1, 2)
            if tuple(rows[0]) == (self._env.info()["last_txnid"], self._entries):
                self._locations = rows[1:].ravel()
        if self._locations is not None:
            self._fd = os.open(data, os.O_RDONLY | os.O_CLOEXEC)

    def get(self, index: int) -> memoryview:
        """The whole record at ``index`` within the shard, valid until :meth:`close`."""
        value = self._txn.get(encode_key(index))
        if value is None:
            raise PackFormatError(
                f"record {index} is missing", path=self.path, hint="The shard is damaged: run `packdata verify`"
            )
        return value

    def payload(self, index: int) -> bytes | None:
        """The payload of the record at ``index`` in one ``pread``, or None without a location table."""
        if self._locations is None or not 0 <= index < self._entries:
            return None
        return os.pread(self._fd, self._locations.item(2 * index + 1), self._locations.item(2 * index))

    def items(self):
        """Iterate ``(index in shard, record)`` in key order."""
        for key, value in self._txn.cursor():
            yield _KEY.unpack(key)[0], value

    def close(self) -> None:
        """End the read transaction and close the file (the shared environment stays open)."""
        self._txn.abort()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
