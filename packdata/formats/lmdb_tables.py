"""``records.i64``: where each payload of an LMDB shard lies in its ``data.mdb``, bound to that very file.

The writer (:mod:`packdata.formats.lmdb_writer`) leaves it beside ``data.mdb``
on close, a table of int64 triples, little-endian::

    row 0   magic b"PDRLOC02" (as an int64), 2 (version), record count
    row 1   last LMDB transaction id, byte size of data.mdb, first 8 bytes of its SHA-256
    row 2+  per record: byte offset and length of its payload (the file's bytes)
            inside data.mdb, and the payload's CRC32C

The header binds the table to one ``data.mdb``: a reader uses it only when the
count, transaction id and size match the environment it opened and the
SHA-256 prefix matches the manifest's checksum of the shard (counters alone
repeat across shards; the checksum does not), and every row lies inside
``data.mdb``. The table is an accelerator, never a second source of truth:
without a valid one the reader walks the shard's pages for its records
(:mod:`packdata.formats.lmdb_reader`), and ``verify`` checks it row by row
against the records (:func:`check_records_table`).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from fastcrc.crc32 import iscsi as crc32c

from packdata.errors import PackFormatError
from packdata.formats.lmdb_env import DATA_FILE
from packdata.formats.lmdb_pages import value_locations
from packdata.pack.files import map_int64, open_pack_file, sha256_prefix
from packdata.pack.records import RecordError, checked_payload_start

__all__ = [
    "RECORDS_FILE",
    "TABLE_HINT",
    "check_records_table",
    "location_table",
    "record_locations",
    "record_spans",
    "wrong_rows_error",
]

RECORDS_FILE = "records.i64"
TABLE_HINT = "Convert the pack again (or delete the table: readers then walk the shard's pages)"
_TABLE_MAGIC = int.from_bytes(b"PDRLOC02", "little", signed=True)
_TABLE_VERSION = 2


def record_locations(path: str | os.PathLike) -> tuple[int, np.ndarray]:
    """The last transaction id, and ``(offset, length, CRC32C)`` of every payload inside ``data.mdb`` in key order.

    Found by walking the shard's pages (:func:`~packdata.formats.lmdb_pages.value_locations`,
    every page checked as it goes; LMDB is not opened). Each payload must
    match its record's own CRC-32 first, so the table never vouches for bytes
    damaged since they were encoded.

    Raises:
        PackFormatError: a record is missing or damaged, or a page of the shard is.
    """
    data_file = os.path.join(path, DATA_FILE)
    meta, locations, pages = value_locations(data_file)
    view = pages.data
    rows: list[tuple[int, int, int]] = []
    for i, (offset, length) in enumerate(locations.tolist()):
        value = view[offset : offset + length]
        try:  # the table's CRC32C attests these bytes: first, that they are the record's own
            start = checked_payload_start(value)
        except RecordError as exc:
            raise PackFormatError(f"record {i} is damaged: {exc}", path=path) from exc
        rows.append((offset + start, length - start, crc32c(value[start:])))
    return meta.txnid, np.array(rows, dtype=np.int64).reshape(-1, 3)


def _read_table(path: str, entries: int, txnid: int, size: int, first: int = 0) -> tuple[int, np.ndarray] | None:
    """``(sha256 prefix, rows)`` of a current-version ``records.i64`` that fits this environment, else None.

    Fits: the header's count, transaction id and ``data.mdb`` size equal the
    environment's, and every row lies inside ``data.mdb`` from byte ``first``
    on (a reader passes the end of LMDB's two meta pages; checked once, here).
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
        offsets.min() < first
        or lengths.min() < 0
        or lengths.max() > size
        or (offsets > size - lengths).any()  # not offsets + lengths > size: int64 wraps past 2**63
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
    if int(rows[1, 2]) != sha256_prefix(sha256_hex) or not sha256_prefix(sha256_hex):
        return None
    body = rows[2:]
    if count and (
        body[:, 0].min() < 0
        or body[:, 1].min() < 0
        or body[:, 1].max() > size
        or (body[:, 0] > size - body[:, 1]).any()  # not their sum: int64 wraps past 2**63
        or body[:, 2].min() < 0
        or body[:, 2].max() > 0xFFFFFFFF
    ):
        return None
    return body


def check_records_table(path: str | os.PathLike, sha256_hex: str) -> None:
    """Check a shard's ``records.i64`` row by row against the records themselves (for ``verify``).

    A missing table is fine (readers walk the shard's pages); a table of an older
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
        txnid, locations = record_locations(path)
        blob = f.read(24 * (len(locations) + 2) + 1)  # no table of these records is longer: a longer file is not read
        stored = os.fstat(f.fileno()).st_size
    size = os.path.getsize(os.path.join(path, DATA_FILE))
    raw = np.frombuffer(blob[: len(blob) - len(blob) % 8], dtype="<i8")
    hint = TABLE_HINT
    whole = len(blob) == stored  # a longer file is not read whole: it fits no table
    if whole and raw.size == 3 * (len(locations) + 2):
        found = _read_table(path, len(locations), txnid, size)
        if found is None:
            raise PackFormatError(
                f"{RECORDS_FILE} does not fit this shard (count, transaction id, size or a row out of bounds)",
                path=table,
                hint=hint,
            )
        prefix, rows = found
        if prefix != sha256_prefix(sha256_hex):
            raise PackFormatError(f"{RECORDS_FILE} belongs to another shard (checksum differs)", path=table, hint=hint)
        bad = np.flatnonzero((rows != locations).any(axis=1))
    elif whole and raw.size == 2 * (len(locations) + 1) and tuple(raw[:2]) == (txnid, len(locations)):
        bad = np.flatnonzero((raw[2:].reshape(-1, 2) != locations[:, :2]).any(axis=1))
    else:
        raise PackFormatError(
            f"{RECORDS_FILE} is {stored} bytes, which fits no table of {len(locations)} records",
            path=table,
            hint=hint,
        )
    if len(bad):
        raise wrong_rows_error(bad.tolist(), table)


def wrong_rows_error(bad: list[int], table: str) -> PackFormatError:
    """The error naming the first of the ``bad`` rows (sorted) of the location table at ``table``."""
    return PackFormatError(
        f"{RECORDS_FILE} row {bad[0]} does not point at record {bad[0]} ({len(bad)} rows wrong)",
        path=table,
        hint=TABLE_HINT,
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
