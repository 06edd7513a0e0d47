"""LMDB shards: a writer that grows its map on its own, and a fork-safe reader.

A shard is an ordinary LMDB environment directory (``data.mdb``) that
``mdb_stat`` and ``lmdb.open(path, readonly=True)`` open. Keys are 8-byte
big-endian sample indices within the shard (global index minus the shard's
``first_index``), so they sort in sample order, every put uses append mode, and
a shard is self-contained: it can be written by its own task and staged alone;
values are :mod:`packdata.pack.records` records.

Beside ``data.mdb`` the writer leaves ``records.i64``, a table of int64
triples, little-endian::

    row 0   magic b"PDRLOC02" (as an int64), 2 (version), record count
    row 1   last LMDB transaction id, byte size of data.mdb, first 8 bytes of its SHA-256
    row 2+  per record: byte offset and length of its payload (the file's bytes)
            inside data.mdb, and the payload's CRC32C

The header binds the table to one ``data.mdb``: a reader uses it only when the
count, transaction id and size match the environment it opened and the
SHA-256 prefix matches the manifest's checksum of the shard (counters alone
repeat across shards; the checksum does not), and every row lies inside
``data.mdb``. It then fetches a payload with one ``pread`` instead of a B-tree
lookup through the memory map, checks that it got every byte and (by default)
its CRC32C, about 2 us per 40 KB, a few thousandths of a JPEG decode. That
matters cold: py-lmdb touches every page of a value before returning it, so
with readahead off a 40 KB value costs ten synchronous 4 KB faults, about 4x
slower than reading the same bytes from a folder; one ``pread`` is one I/O
request. Without a valid table (none, a table of an older packdata, a damaged
or foreign one, or any later write to the environment) or on any mismatch the
reader falls back to LMDB's own lookup, where the record's own CRC-32 and its
key and label are checked, so the table is an accelerator, never a second
source of truth. LMDB trusts its file, so before it opens a shard its meta
pages are checked, and before its lookup or cursor walks one, every page they
can reach (:mod:`packdata.formats.lmdb_pages`).
"""

# Over ~500 lines: writer, records.i64 table and the reader that checks it.

from __future__ import annotations

import contextlib
import errno
import os
import struct
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import lmdb
import numpy as np
from fastcrc.crc32 import iscsi as crc32c

from packdata.errors import CapacityError, ConfigError, PackFormatError, destination_error
from packdata.formats import ShardLayout
from packdata.formats.lmdb_pages import check_lmdb_tree, read_lmdb_meta
from packdata.formats.residency import PagedFile, buffer_address
from packdata.pack.files import file_sha256, map_int64, not_a_file, open_pack_file
from packdata.pack.manifest import ShardInfo
from packdata.pack.records import RecordError, Sample, decode_record, encode_record, payload_start

__all__ = [
    "DATA_FILE",
    "NAME",
    "RECORDS_FILE",
    "LMDBShardReader",
    "LMDBShardWriter",
    "check_records_table",
    "check_remote_side_tables",
    "encode_key",
    "location_table",
    "read_remote_payload",
    "SHARD_WRITER",
    "check_side_tables",
    "iter_samples",
    "record_locations",
    "shard_layout",
]

NAME = "lmdb"
DATA_FILE = "data.mdb"
MAX_READERS = 2048
_KEY = struct.Struct(">Q")
_INITIAL_MAP = 64 << 20
_LOCK_BYTES = 64 * MAX_READERS + 4096  # LMDB's lock file: a header and one 64-byte slot per reader
RECORDS_FILE = "records.i64"
_TABLE_MAGIC = int.from_bytes(b"PDRLOC02", "little", signed=True)
_TABLE_VERSION = 2


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
        if resume_at == 0:  # none of it is kept: start afresh, so the shard's bytes are an uninterrupted run's
            for name in (DATA_FILE, RECORDS_FILE):
                with contextlib.suppress(FileNotFoundError):
                    (self.path / name).unlink()
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
                raise CapacityError(
                    f"cannot write the shard ({exc}); {_free(self.path)} free on its disk",
                    path=self.path,
                    hint="Free space on the destination disk and rerun with --resume",
                ) from exc

    def sync(self) -> None:
        """Make every committed transaction durable."""
        self._env.sync(True)

    def close(self) -> tuple[int, str]:
        """Sync and close; the shard is complete. Returns its byte size and SHA-256.

        Every transaction is committed, so the file's bytes are final: the
        checksum pass reads them from the page cache while the sync writes them
        out (both release the GIL), instead of one after the other.
        """
        data = self.path / DATA_FILE
        with ThreadPoolExecutor(1, thread_name_prefix="packdata-shard-sha") as pool:
            hashing = pool.submit(file_sha256, data)
            self.sync()
            digest = hashing.result()
        self._env.close()
        (self.path / "lock.mdb").unlink(missing_ok=True)
        size = data.stat().st_size
        txnid, locations = record_locations(self.path)
        header = [[_TABLE_MAGIC, _TABLE_VERSION, len(locations)], [txnid, size, _sha_prefix(digest)]]
        with open(self.path / RECORDS_FILE, "wb") as f:
            f.write(np.array(header, dtype="<i8").tobytes())
            f.write(locations.astype("<i8").tobytes())
            os.fsync(f.fileno())
        return size, digest


def _sha_prefix(sha256_hex: str) -> int:
    """The first 8 bytes of a hex SHA-256 as a little-endian int64 (0 when there is none)."""
    if len(sha256_hex) < 16:
        return 0
    try:
        return int.from_bytes(bytes.fromhex(sha256_hex[:16]), "little", signed=True)
    except ValueError:
        return 0


def _free(path: Path) -> str:
    stat = os.statvfs(path)
    return f"{stat.f_bavail * stat.f_frsize / 1e6:.1f} MB"


@dataclass
class _SharedEnv:
    pid: int
    env: lmdb.Environment
    users: int = 1


_open_envs: dict[tuple[int, int], _SharedEnv] = {}
"""Open read-only environments by ``data.mdb``'s (device, inode): pid, handle, readers using it."""
_open_envs_lock = threading.RLock()  # threads may open a shard's first reader at once; a reader's __del__ re-enters


def _new_lock_after_fork() -> None:
    global _open_envs_lock
    _open_envs_lock = threading.RLock()  # one held by another thread at the fork would never be let go in the child


os.register_at_fork(after_in_child=_new_lock_after_fork)


def _identity(path: str) -> tuple[int, int]:
    stat = os.stat(os.path.join(path, DATA_FILE))
    return stat.st_dev, stat.st_ino


def _shared_env(path: str, readahead: bool) -> tuple[tuple[int, int], lmdb.Environment]:
    """One read-only environment per shard file per process, reopened after a fork: its key and handle.

    py-lmdb refuses to open an environment twice in one process, and a forked
    child inherits that refusal along with the parent's handle. Sharing the
    handle between datasets in a process, and closing the inherited one in a
    child before reopening, makes both everyday patterns work: two datasets over
    one pack, and ``ds[0]`` in the parent before DataLoader workers fork. The
    handle is keyed by the ``data.mdb`` file too (device and inode), so a pack
    converted again at the same path is opened afresh, never read through the
    old generation's map. Each call is one more user; :func:`_release_env`
    closes the handle when the last is done, so a process that read a pack
    does not keep its files mapped (and a replaced pack's space taken) after.
    """
    identity = _identity(path)
    with _open_envs_lock:
        entry = _open_envs.get(identity)
        if entry is not None:
            if entry.pid == os.getpid():
                entry.users += 1
                return identity, entry.env  # this file, through this path or another (a merged pack's hard link)
            entry.env.close()  # the parent's handle, inherited through fork
        read_lmdb_meta(os.path.join(path, DATA_FILE))  # LMDB maps the pages its meta says are in use
        env = lmdb.open(
            path,
            map_size=_read_map_size(path),
            readonly=True,
            lock=False,
            readahead=readahead,
            meminit=False,
            max_readers=MAX_READERS,
            subdir=True,
            create=False,
        )
        _open_envs[identity] = _SharedEnv(os.getpid(), env)
        return identity, env


def _read_map_size(path: str) -> int:
    """The map of a read-only environment: ``data.mdb``'s size, not py-lmdb's default 10 MiB.

    In a map larger than the file, a read past its end is a ``SIGBUS`` that
    kills the process. LMDB widens a map to the pages its meta page says are
    in use: :func:`~packdata.formats.lmdb_pages.read_lmdb_meta` refuses a
    file shorter than that before it is opened, and
    :func:`~packdata.formats.lmdb_pages.check_lmdb_tree` every page number,
    node and value that would lead LMDB's lookups and cursors off a page or
    out of the file before they walk it.
    """
    return max(os.path.getsize(os.path.join(path, DATA_FILE)), 1)


def _release_env(identity: tuple[int, int]) -> None:
    """One user of a shared environment is done; the last one closes it (a parent's, after a fork, is left)."""
    with _open_envs_lock:
        entry = _open_envs.get(identity)
        if entry is None or entry.pid != os.getpid():
            return
        entry.users -= 1
        if entry.users <= 0:
            del _open_envs[identity]
            entry.env.close()


def _map_base(data_file: str, address: int) -> int:
    """Start address of this process's mapping of ``data_file`` that holds ``address`` (from /proc/self/maps).

    By device and inode, not name: a shard opened through a hard link (a
    merged pack) shows in the maps under the name it was first opened by. By
    ``address`` (a value LMDB returned), not the first mapping found: a
    reader's own map of the same file may lie before LMDB's.
    """
    st = os.stat(data_file)
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[4] == str(st.st_ino) and fields[3] == device and fields[2] == "00000000":
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if start <= address < end:
                    return start
    raise OSError(f"{data_file} is not mapped in this process")


def record_locations(path: str | os.PathLike) -> tuple[int, np.ndarray]:
    """The last transaction id, and ``(offset, length, CRC32C)`` of every payload inside ``data.mdb`` in key order.

    Raises:
        PackFormatError: a record is missing or damaged, or LMDB reports the shard damaged.
    """
    check_lmdb_tree(os.path.join(path, DATA_FILE))  # before LMDB's cursor walks it
    try:  # one more user of this process's environment (LMDB opens a file once per process)
        identity, env = _shared_env(os.fspath(path), True)
    except lmdb.Error as exc:
        raise _lmdb_error(path, exc) from exc
    try:
        base = 0
        with env.begin(buffers=True) as txn:
            n = txn.stat()["entries"]
            out = np.empty((n, 3), dtype=np.int64)
            for i, (key, value) in enumerate(txn.cursor()):
                base = base or _map_base(os.path.join(path, DATA_FILE), buffer_address(value))
                if _KEY.unpack(key)[0] != i:
                    raise PackFormatError(f"record {i} is missing", path=path)
                try:
                    start = payload_start(value)
                except RecordError as exc:
                    raise PackFormatError(f"record {i} is damaged: {exc}", path=path) from exc
                out[i] = (buffer_address(value) - base + start, len(value) - start, crc32c(value[start:]))
        txnid = env.info()["last_txnid"]
    except lmdb.Error as exc:
        raise _lmdb_error(path, exc) from exc
    finally:
        _release_env(identity)
    return txnid, out


def _lmdb_error(path: str | os.PathLike, exc: lmdb.Error) -> PackFormatError:
    """An LMDB error (a damaged header or page, a bad map) as one line naming the shard."""
    return PackFormatError(
        f"LMDB cannot read the shard: {type(exc).__name__}: {exc}".rstrip(": "),
        path=path,
        hint="The shard is damaged: run `packdata verify`, then convert or stage the pack again",
    )


def _read_table(path: str, entries: int, txnid: int, size: int) -> tuple[int, np.ndarray] | None:
    """``(sha256 prefix, rows)`` of a current-version ``records.i64`` that fits this environment, else None.

    Fits: the header's count, transaction id and ``data.mdb`` size equal the
    environment's, and every row lies inside ``data.mdb`` (checked once, here).
    """
    table = os.path.join(path, RECORDS_FILE)
    raw = map_int64(table)  # mapped, not read: every worker shares the page cache's copy (24 bytes a record)
    if raw is None or raw.size != 3 * (entries + 2):
        return None  # absent, of an older packdata (pairs), or cut
    rows = raw.reshape(-1, 3)
    if tuple(rows[0]) != (_TABLE_MAGIC, _TABLE_VERSION, entries) or (rows[1, 0], rows[1, 1]) != (txnid, size):
        return None
    body = rows[2:]
    offsets, lengths, crcs = body[:, 0], body[:, 1], body[:, 2]
    if entries and (
        offsets.min() < 0
        or lengths.min() < 0
        or (offsets + lengths).max() > size
        or (offsets > size).any()
        or crcs.min() < 0
        or crcs.max() > 0xFFFFFFFF
    ):
        return None
    return int(rows[1, 2]), body


def location_table(raw: bytes, count: int, size: int, sha256_hex: str) -> np.ndarray | None:
    """The ``(offset, length, CRC32C)`` rows of a ``records.i64``'s bytes, or None when they do not fit.

    Fit: a current-version table of ``count`` records bound to a ``data.mdb``
    of ``size`` bytes whose SHA-256 is ``sha256_hex`` (the manifest's), every
    row inside the file. Without the environment at hand the transaction id is
    not compared (for reads from object storage): the checksum binding, and
    the CRC32C each payload read is checked against, stand for it.
    """
    if len(raw) != 24 * (count + 2):
        return None
    rows = np.frombuffer(raw, dtype="<i8").reshape(-1, 3)
    if tuple(rows[0]) != (_TABLE_MAGIC, _TABLE_VERSION, count) or int(rows[1, 1]) != size:
        return None
    if int(rows[1, 2]) != _sha_prefix(sha256_hex) or not _sha_prefix(sha256_hex):
        return None
    body = rows[2:]
    if count and (
        body[:, 0].min() < 0
        or body[:, 1].min() < 0
        or (body[:, 0] + body[:, 1]).max() > size
        or body[:, 2].min() < 0
        or body[:, 2].max() > 0xFFFFFFFF
    ):
        return None
    return body


def check_remote_side_tables(shard: Path, info: ShardInfo, where: str) -> None:
    """Check a downloaded ``records.i64`` (``shard`` is a folder holding it) is bound to the shard ``info`` describes.

    Its rows cannot be compared with the records without the shard's file, so
    only the binding is checked: count, size, checksum, rows in bounds.

    Raises:
        PackFormatError: the table belongs to another shard or is damaged (``where`` names it).
    """
    table = shard / RECORDS_FILE
    if not table.is_file():
        return
    if location_table(table.read_bytes(), info.num_samples, info.bytes, info.sha256) is None:
        raise PackFormatError(
            f"{RECORDS_FILE} does not fit this shard (count, size, checksum or a row out of bounds)",
            path=f"{where.rsplit('/', 1)[0]}/{RECORDS_FILE}",
            hint="Convert the pack again (or delete the table: readers then use LMDB's own lookup)",
        )


def read_remote_payload(
    fs: Any, root: str, shown: str, rel: str, shard: Path, info: ShardInfo, j: int
) -> tuple[bytes, str | None, int | None]:
    """The payload of record ``j`` of a shard in object storage, in one ranged read through its ``records.i64``.

    Returns ``(payload, None, None)``: the record's key and label are not read
    (the sample index gives them), only its payload, CRC32C-checked.

    The pack is ``root`` on ``fs`` (``shown``: its URL without credentials),
    the shard's ``data.mdb`` is ``rel`` inside it, and ``shard`` is a local
    folder holding a copy of the shard's table.

    Raises:
        ConfigError: no table fits the shard (the record is then only found by LMDB's lookup, in a local file).
        PackFormatError: the bytes read are not the payload the table describes.
        SourceError: the request failed.
    """
    from packdata.pack.urls import remote_error

    table = shard / RECORDS_FILE
    rows = location_table(table.read_bytes(), info.num_samples, info.bytes, info.sha256) if table.is_file() else None
    where = f"{shown}/{rel}"
    if rows is None or not 0 <= j < len(rows):
        raise ConfigError(
            f"{where}: one LMDB record is read from a URL through the shard's {RECORDS_FILE} table, "
            "and this shard has none that fits",
            hint=f"Stage the pack first (packdata stage {shown} --to DIR), then read the staged copy",
        )
    offset, length, crc = (int(v) for v in rows[j])
    try:
        data = fs.cat_file(f"{root}/{rel}", start=offset, end=offset + length)
    except Exception as exc:
        raise remote_error(where, f"cannot read bytes {offset}-{offset + length}", exc) from exc
    if len(data) != length or crc32c(data) != crc:
        raise PackFormatError(
            f"record {info.first_index + j} at byte offset {offset} is damaged: its payload's CRC32C does not match",
            path=where,
            hint="Run `packdata verify` on the pack, then convert it again",
        )
    return bytes(data), None, None


def check_records_table(path: str | os.PathLike, sha256_hex: str) -> None:
    """Check a shard's ``records.i64`` row by row against the records themselves (for ``verify``).

    A missing table is fine (readers use LMDB's lookup); a table of an older
    packdata (pairs, no checksum binding) is checked row by row too.

    Raises:
        PackFormatError: the table does not describe this shard exactly.
    """
    path = os.fspath(path)
    table = os.path.join(path, RECORDS_FILE)
    try:
        fd = open_pack_file(table)  # a symlink leading out of the pack, or a FIFO, is refused, never read
    except FileNotFoundError:
        return
    with os.fdopen(fd, "rb") as f:
        blob = f.read()
    txnid, locations = record_locations(path)
    size = os.path.getsize(os.path.join(path, DATA_FILE))
    raw = np.frombuffer(blob[: len(blob) - len(blob) % 8], dtype="<i8")
    hint = "Convert the pack again (or delete the table: readers then use LMDB's own lookup)"
    if raw.size == 3 * (len(locations) + 2):
        found = _read_table(path, len(locations), txnid, size)
        if found is None:
            raise PackFormatError(
                f"{RECORDS_FILE} does not fit this shard (count, transaction id, size or a row out of bounds)",
                path=table,
                hint=hint,
            )
        prefix, rows = found
        if prefix != _sha_prefix(sha256_hex):
            raise PackFormatError(f"{RECORDS_FILE} belongs to another shard (checksum differs)", path=table, hint=hint)
        bad = np.flatnonzero((rows != locations).any(axis=1))
    elif raw.size == 2 * (len(locations) + 1) and tuple(raw[:2]) == (txnid, len(locations)):
        bad = np.flatnonzero((raw[2:].reshape(-1, 2) != locations[:, :2]).any(axis=1))
    else:
        raise PackFormatError(
            f"{RECORDS_FILE} is {raw.size * 8} bytes, which fits no table of {len(locations)} records",
            path=table,
            hint=hint,
        )
    if len(bad):
        raise PackFormatError(
            f"{RECORDS_FILE} row {int(bad[0])} does not point at record {int(bad[0])} ({len(bad)} rows wrong)",
            path=table,
            hint=hint,
        )


def record_spans(shard: Path, size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``(offsets, lengths)`` of every payload in ``data.mdb``, memory-mapped from ``records.i64`` (read-ahead hints).

    None when the table is absent, of another version, or does not fit a
    ``data.mdb`` of ``size`` bytes by its header; its rows are not checked here.
    """
    table = shard / RECORDS_FILE
    raw = map_int64(table)
    if raw is None or raw.size % 3:
        return None
    rows = raw.reshape(-1, 3)
    if len(rows) < 2 or tuple(rows[0, :2]) != (_TABLE_MAGIC, _TABLE_VERSION) or rows[1, 1] != size:
        return None
    if rows[0, 2] != len(rows) - 2:
        return None
    return rows[2:, 0], rows[2:, 1]


class LMDBShardReader:
    """Reads records of one shard by their index within the shard.

    Opened lazily in the process that uses it. Records are fetched with one
    ``pread`` each through the shard's ``records.i64`` table when it is valid
    for this shard (see the module docstring), else through LMDB's lookup;
    ``readahead`` applies to the LMDB map only.

    Args:
        path: the shard directory.
        readahead: let the kernel read ahead on the LMDB map.
        check_crc: check each payload's CRC (table reads: CRC32C; LMDB lookups: the record's CRC-32).
        expected_bytes, expected_sha256, expected_records: the shard's size,
            SHA-256 and record count from the manifest the caller read. A
            ``data.mdb`` of another size or count raises; a table is used only
            when bound to this checksum.

    Raises:
        PackFormatError: the shard is missing, truncated, replaced, or LMDB finds it damaged.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        readahead: bool = False,
        check_crc: bool = True,
        expected_bytes: int | None = None,
        expected_sha256: str | None = None,
        expected_records: int | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.check_crc = check_crc
        self._pid = os.getpid()
        self._fd = -1
        self._held: tuple[int, int] | None = None  # the shared environment this reader is a user of
        self._in_txn = False
        self._locations: np.ndarray | None = None
        self._rows: memoryview | None = None  # the same table as int64 items: a Python int each, no numpy call
        self._pages: PagedFile | None = None
        self._tree_checked = False  # LMDB's lookups and cursor walk the B-tree only once it is checked
        data = os.path.join(self.path, DATA_FILE)
        problem = not_a_file(data)
        if problem:
            raise PackFormatError(
                f"the shard's {DATA_FILE} {problem}",
                path=data,
                hint="The pack is incomplete: convert or stage it again",
            )
        size = os.path.getsize(data)
        if expected_bytes is not None and size != expected_bytes:
            raise PackFormatError(
                f"{DATA_FILE} is {size} bytes, the manifest read when the dataset was opened says {expected_bytes}",
                path=data,
                hint="The shard is truncated, or the pack was converted or staged again since: "
                "run `packdata verify`, and recreate the dataset after changing a pack",
            )
        try:
            self._open(data, size, readahead, expected_sha256, expected_records)
        except BaseException:
            self.close()  # lets go of the environment too
            raise

    def _open(
        self, data: str, size: int, readahead: bool, expected_sha256: str | None, expected_records: int | None
    ) -> None:
        try:
            self._held, self._env = _shared_env(self.path, readahead)  # its meta pages checked first
            info = self._env.info()
            self._txn = self._env.begin(buffers=True)
            self._in_txn = True
            self._entries = self._txn.stat()["entries"]
        except lmdb.Error as exc:
            raise _lmdb_error(self.path, exc) from exc
        if expected_records is not None and self._entries != expected_records:  # records would shift between shards
            raise PackFormatError(
                f"shard holds {self._entries} records, the manifest read when the dataset was opened says "
                f"{expected_records}",
                path=data,
                hint="The manifest does not describe this shard: run `packdata verify`, and recreate the dataset "
                "after converting or staging a pack again",
            )
        found = _read_table(self.path, self._entries, info["last_txnid"], size)
        if found is not None and expected_sha256 is not None and found[0] == _sha_prefix(expected_sha256):
            self._locations = found[1].ravel()  # else stale or foreign (e.g. a sibling's): LMDB lookups
            self._rows = self._locations.data.cast("B").cast("q")
        if self._locations is not None:
            self._fd = os.open(data, os.O_RDONLY | os.O_CLOEXEC)
            self._pages = PagedFile(self._fd, size)  # map slices when warm, pread when cold

    def get(self, index: int) -> memoryview:
        """The whole record at ``index`` within the shard, valid until :meth:`close`."""
        self._check_tree()
        try:
            value = self._txn.get(encode_key(index))
        except lmdb.Error as exc:
            raise _lmdb_error(self.path, exc) from exc
        if value is None:
            raise PackFormatError(
                f"record {index} is missing", path=self.path, hint="The shard is damaged: run `packdata verify`"
            )
        return value

    def payload(self, index: int) -> bytes | None:
        """The payload of the record at ``index`` in one ``pread``, complete and CRC-checked.

        None without a valid location table (the caller then reads the record
        through :meth:`get`, which has its own checks).

        Raises:
            PackFormatError: the bytes read are not the ones the table describes
                (short, or another CRC32C). The table is bound to this very
                file (its size and checksum), so the file is damaged: it is
                named, never walked by LMDB's lookup, whose damaged pages could
                lead it past its map.
        """
        rows = self._rows
        if rows is None or not 0 <= index < self._entries:
            return None
        at = 3 * index
        offset, length, crc = rows[at], rows[at + 1], rows[at + 2]
        assert self._pages is not None  # opened with the table
        data = self._pages.read(offset, length)
        if len(data) != length or (self.check_crc and crc32c(data) != crc):
            raise self._damaged(index, offset, length, len(data))
        return data

    def _damaged(self, index: int, offset: int, length: int, got: int) -> PackFormatError:
        what = f"only {got} of its {length} bytes could be read" if got != length else "its CRC32C does not match"
        return PackFormatError(
            f"record {index} is damaged: the payload at byte offset {offset}: {what}",
            path=os.path.join(self.path, DATA_FILE),
            hint="Run `packdata verify` on the pack, then convert it again",
        )

    def payloads(self, indices: np.ndarray) -> list[bytes | None]:
        """:meth:`payload` of several records, the table rows looked up at once (a batch read).

        Raises:
            PackFormatError: as :meth:`payload`, for the first damaged payload.

        ``indices`` is an int64 array of record numbers, none negative (a batch
        read is the hot path: one past the table is caught by numpy's bounds check).
        """
        if self._locations is None or self._pages is None:
            return [None] * len(indices)
        try:
            offsets, lengths, crcs = self._locations.reshape(-1, 3)[indices].T.tolist()
        except IndexError:  # past the table: record by record, None where it has no row
            return [self.payload(int(i)) for i in indices]
        mapped = self._pages.warm_map(len(offsets), sum(lengths))
        if mapped is not None:
            datas = [mapped[offset : offset + length] for offset, length in zip(offsets, lengths, strict=True)]
        else:
            datas = [os.pread(self._fd, length, offset) for offset, length in zip(offsets, lengths, strict=True)]
        check = self.check_crc
        if list(map(len, datas)) != lengths or (check and list(map(crc32c, datas)) != crcs):  # two C loops
            for index, data, offset, length, crc in zip(indices.tolist(), datas, offsets, lengths, crcs, strict=True):
                if len(data) != length or (check and crc32c(data) != crc):
                    raise self._damaged(index, offset, length, len(data))
        return cast(list[bytes | None], datas)

    def payload_length(self, index: int) -> int | None:
        """The payload length of the record at ``index`` from the location table, or None without one."""
        if self._locations is None or not 0 <= index < self._entries:
            return None
        return int(self._locations[3 * index + 1])

    def payload_span(self, index: int, start: int, length: int) -> bytes | None:
        """``length`` bytes at ``start`` inside the payload of the record at ``index``, in one ``pread``.

        Not CRC-checked (the caller checks the part it asked for); None without
        a valid table, when the span does not lie inside the payload, or on a short read.
        """
        total = self.payload_length(index)
        if total is None or start < 0 or length < 0 or start + length > total:
            return None
        offset = int(self._locations[3 * index]) + start  # type: ignore[index]
        data = self._pages.read(offset, length)  # type: ignore[union-attr]
        return data if len(data) == length else None

    def items(self):
        """Iterate ``(index in shard, record)`` in key order."""
        self._check_tree()
        try:
            for key, value in self._txn.cursor():
                yield _KEY.unpack(key)[0], value
        except lmdb.Error as exc:
            raise _lmdb_error(self.path, exc) from exc

    def _check_tree(self) -> None:
        """Check every page LMDB's lookups and cursor can reach (once per file per process) before they walk it.

        Raises:
            PackFormatError: a page number, node or value would lead LMDB off a page or out of ``data.mdb``.
        """
        if not self._tree_checked:
            check_lmdb_tree(os.path.join(self.path, DATA_FILE))
            self._tree_checked = True

    def close(self) -> None:
        """End the read transaction, close the file, and let go of the shared environment.

        The environment (LMDB's map of ``data.mdb``) closes with its last user in this process.
        """
        if self._in_txn:
            self._txn.abort()
            self._in_txn = False
        self._rows = None
        if self._pages is not None:
            self._pages.close()
            self._pages = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._held is not None:
            identity, self._held = self._held, None
            _release_env(identity)

    def __del__(self) -> None:
        try:
            if self._pid == os.getpid():
                self.close()
            elif self._fd >= 0:  # a parent's reader, dropped in a forked child: only the descriptor is the child's
                os.close(self._fd)
        except Exception:  # at interpreter exit: nothing left to let go of
            pass


SHARD_WRITER = LMDBShardWriter


def shard_layout(name: str) -> ShardLayout:
    """An LMDB shard is a folder: ``data.mdb``, the ``records.i64`` table, and LMDB's ``lock.mdb``."""
    return ShardLayout(folder=True, data=DATA_FILE, side=(RECORDS_FILE,), scratch=("lock.mdb",))


def iter_samples(shard: Path, first_index: int) -> Iterator[tuple[int, Sample]]:
    """``(global index, Sample)`` of every record in key order, record CRCs checked."""
    reader = LMDBShardReader(shard, readahead=True)
    try:
        for local, value in reader.items():
            i = first_index + local
            try:
                yield i, decode_record(value, check_crc=True)
            except RecordError as exc:
                raise PackFormatError(f"record {i} is damaged: {exc}", path=shard) from exc
    finally:
        reader.close()


def check_side_tables(shard: Path, info: ShardInfo) -> None:
    """Check ``records.i64`` row by row against the shard."""
    check_records_table(shard, info.sha256)
