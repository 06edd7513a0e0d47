"""Writing LMDB shards: :class:`LMDBShardWriter` appends records and leaves ``records.i64`` beside ``data.mdb``."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lmdb
import numpy as np

from packdata.errors import ConfigError, PackdataError, PackFormatError
from packdata.formats.lmdb_env import DATA_FILE, MAX_READERS, encode_key
from packdata.formats.lmdb_pages import check_lmdb_tree
from packdata.formats.lmdb_tables import _TABLE_MAGIC, _TABLE_VERSION, RECORDS_FILE, record_locations
from packdata.host.disks import FULL_DISK_ERRNOS, RERUN_HINT, filesystem_named, no_space_error, write_error
from packdata.pack.files import file_sha256, fsync_named, open_regular, sha256_prefix
from packdata.pack.manifest import ShardInfo
from packdata.pack.records import Sample, encode_record

__all__ = ["LMDBShardWriter"]

_INITIAL_MAP = 64 << 20
_LOCK_BYTES = 64 * MAX_READERS + 4096  # LMDB's lock file: a header and one 64-byte slot per reader


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
    except OSError as exc:  # a full disk named as any full disk a pack is written to
        of = "(an LMDB shard's lock file, allocated before LMDB maps it)"
        where = lock if shard.is_dir() else shard
        raise write_error(exc, where, folder=shard.parent, of=of, hint=RERUN_HINT) from exc


class LMDBShardWriter:
    """Appends records to one LMDB shard in large transactions.

    The map starts small and doubles before any transaction that might not fit
    it, so a user never meets ``MapFullError`` and a small disk never sees a
    1 TB sparse map. Writes are not synced per commit; :meth:`sync` makes
    everything committed durable (call it before recording a checkpoint).
    """

    def __init__(self, path: str | os.PathLike, *, resume_at: int | None = None) -> None:
        self.path = Path(path)
        if resume_at == 0:  # none of it is kept: start afresh, so the shard's bytes are an uninterrupted run's
            for name in (DATA_FILE, RECORDS_FILE):
                with contextlib.suppress(FileNotFoundError):
                    (self.path / name).unlink()
        data = self.path / DATA_FILE
        try:
            self._fresh = os.lstat(data).st_size == 0  # LMDB writes every page of the file in this process
        except OSError:  # none there (or no folder: creating it next says why)
            self._fresh = True
        if resume_at and self._fresh:
            raise PackFormatError(
                f"the interrupted conversion's shard is gone: its checkpoint keeps {resume_at} records of it",
                path=data,
                hint="Convert again with overwrite=True",
            )
        if not self._fresh:  # an interrupted run's shard: LMDB trusts its file (a cut one is a SIGBUS)
            try:
                check_lmdb_tree(data)
            except PackFormatError as exc:
                raise PackFormatError(
                    f"the interrupted conversion's shard is damaged: {exc.message}",
                    path=exc.path,
                    hint="Convert again with overwrite=True",
                ) from exc
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
        self._located: tuple[int, np.ndarray] | None = None  # set by seal()
        self._map_size = self._env.info()["map_size"]
        self._page = self._env.stat()["psize"]
        if resume_at:
            self._truncate(resume_at)

    @staticmethod
    def shard_name(number: int) -> str:
        """File name of shard ``number`` inside the pack."""
        return f"shard-{number:05d}.lmdb"

    @staticmethod
    def finalize(pack: Path, shards: list[ShardInfo]) -> list[ShardInfo]:
        """LMDB shards keep the names they were written under."""
        return shards

    @staticmethod
    def final_shards(pack: Path, shards: list[ShardInfo]) -> list[ShardInfo]:
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
                    # one call for the batch: fewer trips for the GIL while reader threads run
                    _, added = txn.cursor().putmulti(
                        [(encode_key(index), value) for index, value in records], append=True
                    )
                    if added != len(records):
                        raise PackFormatError(
                            f"record {records[added][0]} is out of order or already written", path=self.path
                        )
                return
            except lmdb.MapFullError:
                self._grow_to(self._map_size * 2)
            except lmdb.Error as exc:  # a short write on a full disk surfaces as EIO or ENOSPC
                raise _write_failed(exc, self.path, 2 * payload) from exc

    def sync(self) -> None:
        """Make every committed transaction durable."""
        if self._located is not None:  # sealed: LMDB is closed, its pages are the file's
            fd = open_regular(self.path / DATA_FILE)
            try:
                fsync_named(fd, self.path / DATA_FILE)
            finally:
                os.close(fd)
        else:
            self._env.sync(True)

    def seal(self) -> None:
        """End the writes and build the location table in memory (call it in the writing thread).

        This is the Python-heavy part of closing, a walk over every record
        (about 5 us each); :meth:`close`, the I/O that lets go of the GIL (sync,
        checksum, table write), can then run in another thread without
        taking the GIL from the thread that fills the next shard.
        """
        if self._located is None:
            self._env.close()
            (self.path / "lock.mdb").unlink(missing_ok=True)
            try:
                self._located = record_locations(self.path)
            except PackFormatError as exc:
                if self._fresh:
                    raise
                raise PackFormatError(  # a record kept from the interrupted run
                    f"the interrupted conversion's shard is damaged: {exc.message}",
                    path=exc.path,
                    hint="Convert again with overwrite=True",
                ) from exc

    def close(self) -> tuple[int, str]:
        """Seal, sync and close; the shard is complete. Returns its byte size and SHA-256.

        Every transaction is committed, so the file's bytes are final: the
        checksum pass reads them from the page cache while the sync writes them
        out (both release the GIL), instead of one after the other.
        """
        self.seal()
        assert self._located is not None
        data = self.path / DATA_FILE
        with ThreadPoolExecutor(1, thread_name_prefix="packdata-shard-sha") as pool:
            hashing = pool.submit(file_sha256, data)
            self.sync()
            digest = hashing.result()
        size = data.stat().st_size
        txnid, locations = self._located
        header = [[_TABLE_MAGIC, _TABLE_VERSION, len(locations)], [txnid, size, sha256_prefix(digest)]]
        with open(self.path / RECORDS_FILE, "wb") as f:
            f.write(np.array(header, dtype="<i8").tobytes())
            f.write(locations.astype("<i8").tobytes())
            fsync_named(f.fileno(), f.name)
        return size, digest


def _write_failed(exc: lmdb.Error, shard: Path, needed: int) -> PackdataError:
    """The error for LMDB's refusal ``exc`` to commit about ``needed`` bytes into ``shard``.

    LMDB reports a short write (a full disk) as EIO, and its errors carry no errno: with less
    than ``needed`` free at that moment (or LMDB's words a full disk's or quota's), the disk is
    named as any full disk a pack is written to. With room, it is no capacity problem (a failing
    device, a volume shut down or turned read-only): a ConfigError in LMDB's words, the disk named.
    """
    full = any(os.strerror(code) in str(exc) for code in FULL_DISK_ERRNOS)
    if full or shutil.disk_usage(shard).free < needed:
        return no_space_error(exc, shard / DATA_FILE, folder=shard.parent, of=f"(LMDB: {exc})", hint=RERUN_HINT)
    return ConfigError(
        f"cannot write the shard (LMDB: {exc}) on {filesystem_named(shard)}, which has room for it",
        path=shard,
        hint="Check that disk (a failing device, a volume shut down or turned read-only), or write to another "
        "file system, then run again (a conversion: resume=True continues it)",
    )
