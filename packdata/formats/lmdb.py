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

import numpy as np
from fastcrc.crc32 import iscsi as crc32c

from packdata.errors import DAMAGED_PACK_HINT, ConfigError, PackFormatError
from packdata.formats import ByteStream, ShardLayout
from packdata.formats.lmdb_env import DATA_FILE
from packdata.formats.lmdb_pages import read_lmdb_meta
from packdata.formats.lmdb_reader import LMDBShardReader
from packdata.formats.lmdb_tables import (
    RECORDS_FILE,
    TABLE_HINT,
    check_records_table,
    location_table,
    record_spans,
    wrong_rows_error,
)
from packdata.formats.lmdb_writer import LMDBShardWriter
from packdata.pack.index import SampleIndex
from packdata.pack.manifest import Manifest, ShardInfo
from packdata.pack.records import RECORD_HEADER_BYTES, RecordError, Sample, decode_record

__all__ = [
    "NAME",
    "SHARD_WRITER",
    "check_remote_side_tables",
    "check_side_tables",
    "closed_records",
    "iter_samples",
    "read_remote_payload",
    "record_spans",  # the registry finds it here (lmdb_tables reads the table)
    "shard_layout",
]

NAME = "lmdb"
SHARD_WRITER = LMDBShardWriter
_SKIP_BLOCK = 1 << 20  # the most bytes held while a remote verify skips the bytes between records


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


def closed_records(data: Path) -> int:
    """The records a closed shard holds, from its ``data.mdb``'s meta page (two pages read).

    Raises:
        PackFormatError: the file is not an LMDB environment packdata writes.
    """
    return read_lmdb_meta(data).entries


def check_side_tables(shard: Path, info: ShardInfo) -> None:
    """Check ``records.i64`` row by row against the shard."""
    check_records_table(shard, info.sha256)


def check_remote_side_tables(
    stream: ByteStream, shard: Path, info: ShardInfo, index: SampleIndex, where: str
) -> int | None:
    """Check a downloaded ``records.i64`` (``shard`` is a folder holding it) row by row against the shard's bytes.

    The table's header must bind it to the shard ``info`` describes (count,
    size, checksum, rows in bounds). Then every row is read from ``stream``
    (the shard's ``data.mdb`` front to back, holding one record's bytes at a
    time), in file order: it must place the payload of its own record, the
    bytes before it a record header and the key the sample index gives that
    record, its label and size the index's, its CRC-32 the record's and its
    CRC32C the row's. So rows swapped or pointing at another record are found
    as a local verify finds them (:func:`~packdata.formats.lmdb_tables.check_records_table`).

    Returns:
        The records checked (every one of the shard), or None for a shard without the table (nothing checked).

    Raises:
        PackFormatError: the table belongs to another shard, is damaged, or a row is wrong (``where`` names it).
    """
    table = shard / RECORDS_FILE
    if not table.is_file():
        return None
    shown = f"{where.rsplit('/', 1)[0]}/{RECORDS_FILE}"
    rows = location_table(table.read_bytes(), info.num_samples, info.bytes, info.sha256)
    if rows is None:
        raise PackFormatError(
            f"{RECORDS_FILE} does not fit this shard (count, size, checksum or a row out of bounds)",
            path=shown,
            hint=TABLE_HINT,
        )
    bad = _wrong_rows(stream, rows, info.first_index, index)
    if bad:
        raise wrong_rows_error(bad, shown)
    return len(rows)


def _wrong_rows(stream: ByteStream, rows: np.ndarray, first: int, index: SampleIndex) -> list[int]:
    """The rows of a location table not placing their own record in ``stream`` (:func:`check_remote_side_tables`)."""
    keys = [index.keys[first + j].encode("utf-8") for j in range(len(rows))]
    starts = rows[:, 0] - RECORD_HEADER_BYTES - np.array([len(k) for k in keys], dtype=np.int64)
    bad: list[int] = []
    held, held_at = b"", 0  # the stream's bytes from held_at on, read already
    for j in np.argsort(starts, kind="stable").tolist():
        start, length, crc = int(starts[j]), int(rows[j, 1]), int(rows[j, 2])
        if start < 0 or length != int(index.sizes[first + j]):
            bad.append(j)
            continue
        while held_at + len(held) < start:  # skipped a block at a time: a gap never held whole
            held_at += len(held)
            held = stream.read(min(start - held_at, _SKIP_BLOCK))
            if not held:
                break
        held = held[start - held_at :]
        held_at = start
        end = int(rows[j, 0]) + length
        if held_at + len(held) < end:
            held += stream.read(end - held_at - len(held))
        try:
            sample = decode_record(held[: end - start])  # its CRC-32 checked
        except RecordError:
            bad.append(j)
            continue
        if (
            sample.key != keys[j].decode("utf-8")
            or sample.label != int(index.labels[first + j])
            or crc32c(sample.data) != crc
        ):
            bad.append(j)
    return sorted(bad)


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
    version pinned for it (:func:`~packdata.formats.remote_reads.fetch_range`).

    Raises:
        ConfigError: no table fits the shard (the record is then only found by walking the pages of a local file).
        PackFormatError: the bytes read are not the payload the table describes,
            the request failed, or the pack was replaced since ``opened`` was read.
    """
    from packdata.formats.remote_reads import fetch_range

    table = shard / RECORDS_FILE
    rows = location_table(table.read_bytes(), info.num_samples, info.bytes, info.sha256) if table.is_file() else None
    where = f"{shown}/{rel}"
    if rows is None or not 0 <= j < len(rows):
        raise ConfigError(
            f"{where}: one LMDB record is read from a URL through the shard's {RECORDS_FILE} table, "
            "and this shard has none that fits",
            hint=f"Stage the pack first (packdata.stage({shown!r}, to=DIR); `packdata stage {shown} --to DIR`), "
            "then read the staged copy",
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
        hint=DAMAGED_PACK_HINT,
    )
