"""LMDB packs as the format registry sees them: the shard writer, a shard's files, walks and checks, remote reads.

A shard is an ordinary LMDB environment directory (``data.mdb``) that
``mdb_stat`` and ``lmdb.open(path, readonly=True)`` open. Keys are 8-byte
big-endian sample indices within the shard (global index minus the shard's
``first_index``), so they sort in sample order, every put uses append mode, and
a shard is self-contained: it can be written by its own task and staged alone;
values are :mod:`packdata.pack.records` records. Beside ``data.mdb`` lies
``records.i64``, the table of where each payload is.

The format's modules:

- :mod:`~packdata.formats.lmdb_env`: file names, keys, and the read-only environment a process shares per shard file
- :mod:`~packdata.formats.lmdb_writer`: :class:`~packdata.formats.lmdb_writer.LMDBShardWriter`
- :mod:`~packdata.formats.lmdb_tables`: ``records.i64``, its layout, binding and checks
- :mod:`~packdata.formats.lmdb_reader`: :class:`~packdata.formats.lmdb_reader.LMDBShardReader`: payload and batch reads
- :mod:`~packdata.formats.lmdb_pages`: the page checks made before LMDB opens or walks a ``data.mdb``
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastcrc.crc32 import iscsi as crc32c

from packdata.errors import ConfigError, PackFormatError
from packdata.formats import ShardLayout
from packdata.formats.lmdb_env import DATA_FILE
from packdata.formats.lmdb_reader import LMDBShardReader
from packdata.formats.lmdb_tables import RECORDS_FILE, check_records_table, location_table, record_spans
from packdata.formats.lmdb_writer import LMDBShardWriter
from packdata.pack.manifest import Manifest, ShardInfo
from packdata.pack.records import RECORD_HEADER_BYTES, RecordError, Sample, decode_record

__all__ = [
    "NAME",
    "SHARD_WRITER",
    "check_remote_side_tables",
    "check_side_tables",
    "iter_samples",
    "read_remote_payload",
    "record_spans",  # the registry finds it here (lmdb_tables reads the table)
    "shard_layout",
]

NAME = "lmdb"
SHARD_WRITER = LMDBShardWriter


def shard_layout(name: str) -> ShardLayout:
    """An LMDB shard is a folder: ``data.mdb``, the ``records.i64`` table, and LMDB's ``lock.mdb``."""
    return ShardLayout(folder=True, data=DATA_FILE, side=(RECORDS_FILE,), scratch=("lock.mdb",))


def iter_samples(shard: Path, first_index: int) -> Iterator[tuple[int, Sample]]:
    """``(global index, Sample)`` of every record in key order, record CRCs checked."""
    reader = LMDBShardReader(shard)
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
            hint="Convert the pack again (or delete the table: readers then walk the shard's pages)",
        )


def read_remote_payload(
    fs: Any, root: str, shown: str, rel: str, shard: Path, info: ShardInfo, j: int, *, opened: Manifest, key: str
) -> tuple[bytes, str, int]:
    """Record ``j`` of a shard in object storage, in one ranged read through its ``records.i64``.

    The table's row places the payload; the record's header and key lie just
    before it, ``key`` (the sample index's) giving their length. Returns the
    payload (CRC32C and CRC-32 checked) and the key and label the record
    holds, so a row that points at another record's payload is found out.

    The pack is ``root`` on ``fs`` (``shown``: its URL without credentials),
    the shard's ``data.mdb`` is ``rel`` inside it, and ``shard`` is a local
    folder holding a copy of the shard's table, downloaded with ``opened``
    (the pack's manifest): the payload is read from the shard object's
    version pinned for it (:func:`~packdata.formats.remote_pack.fetch_range`).

    Raises:
        ConfigError: no table fits the shard (the record is then only found by walking the pages of a local file).
        PackFormatError: the bytes read are not the payload the table describes,
            the request failed, or the pack was replaced since ``opened`` was read.
    """
    from packdata.formats.remote_pack import fetch_range

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
    head = RECORD_HEADER_BYTES + len(key.encode("utf-8"))
    start = offset - head
    problem = f"{RECORDS_FILE} places its payload at byte {offset}, before its header and key could fit"
    if start >= 0:
        data = fetch_range(fs, f"{root}/{rel}", where, start, offset + length, opened=opened)
        try:
            if crc32c(data[head:]) != crc:
                raise RecordError("its payload's CRC32C does not match")
            sample = decode_record(data)
            return sample.data, sample.key, sample.label
        except RecordError as exc:
            problem = str(exc)
    raise PackFormatError(
        f"record {info.first_index + j} at byte offset {start} is damaged: {problem}",
        path=where,
        hint="Run `packdata verify` on the pack, then convert it again",
    )
