"""A TFRecord shard's side tables: the ``.tfindex`` offsets index (the tfrecord package's
and DALI's) and packdata's ``.tfpayload`` record table, each checked against its shard.

The ``.tfpayload`` record table (version 2) is int64 triples, little-endian::

    row 0   magic b"PDTFREC2" (as an int64), 2 (version), record count
    row 1   byte size of the shard, first 8 bytes of its SHA-256 (an int64), 1 if rows hold payload spans else 0
    row 2+  per record: its byte offset in the shard, then the offset of its payload
            (``image/encoded`` or ``text/encoded``) inside the record's data and its
            length (-1, -1 for a multi-field record, whose Example is parsed)

Records tile the shard, so a record's framed length is the next offset (the
shard's size for the last) minus its own. Readers map the table (every process
shares the page cache's copy) and check it in numpy before using it: header
bound to the manifest's count, size and SHA-256; records tiling the shard (the
first at 0, each at least 16 bytes, the last ending at the size); every span
inside its record's data. A table that fails is ignored and the ``.tfindex``
is parsed and checked instead, so the table is an accelerator, never a second
source of truth. Version 1 (pairs: a header ``(count, SHA-256 prefix)``, then
``(payload offset, payload length)`` rows) is still read, with the ``.tfindex``.
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from packdata.errors import PackFormatError, out_of_files_error, too_many_open_files
from packdata.pack.files import map_int64, read_regular, sha256_prefix

__all__ = [
    "INDEX_SUFFIX",
    "PAYLOAD_SUFFIX",
    "SHARD_SUFFIX",
    "RecordTable",
    "has_record_table",
    "index_path",
    "map_record_table",
    "parse_records",
    "payload_path",
    "read_index",
    "read_payload_table",
    "record_offsets",
    "record_table_header",
    "shard_records",
]


SHARD_SUFFIX = ".tfrecord"
INDEX_SUFFIX = ".tfindex"


PAYLOAD_SUFFIX = ".tfpayload"


_PAIR = struct.Struct("<qq")
_ROW = struct.Struct("<qqq")
_ROW_AND_NEXT = struct.Struct("<qqqq")  # a record table row and the next record's offset
_TABLE_MAGIC = int.from_bytes(b"PDTFREC2", "little", signed=True)
_TABLE_VERSION = 2
_HEAD = 2 * _ROW.size  # bytes of the record table's header
_CHECK_ROWS = 1 << 20  # rows checked at a time: flat memory on huge shards
_INDEX_LINE = 64  # bytes an offsets index line takes at most: two int64s in decimal, their separators, with room


def index_path(shard: str | os.PathLike) -> Path:
    """The offsets index beside a shard: ``x.tfrecord`` -> ``x.tfindex``."""
    shard = Path(shard)
    stem = shard.name[: -len(SHARD_SUFFIX)] if shard.name.endswith(SHARD_SUFFIX) else shard.name
    return shard.with_name(stem + INDEX_SUFFIX)


def payload_path(shard: str | os.PathLike) -> Path:
    """The payload table beside a shard: ``x.tfrecord`` -> ``x.tfpayload``."""
    shard = Path(shard)
    stem = shard.name[: -len(SHARD_SUFFIX)] if shard.name.endswith(SHARD_SUFFIX) else shard.name
    return shard.with_name(stem + PAYLOAD_SUFFIX)


def read_payload_table(
    shard: str | os.PathLike, count: int, sha256_hex: str, lengths: np.ndarray | None = None
) -> np.ndarray | None:
    """``(count, 2)`` int64 array of payload ``(offset in data, length)``, or None if absent or stale.

    Valid only when the header matches ``count`` and the shard's SHA-256 (from
    the manifest) and, given the records' framed ``lengths``, every span lies
    inside its record's data (checked once, here).
    """
    try:
        raw = read_regular(payload_path(shard), _PAIR.size * (count + 1), follow_symlinks=False)  # no more is read
    except OSError:
        return None
    if len(raw) != _PAIR.size * (count + 1) or not sha256_hex or len(sha256_hex) < 16:
        return None
    try:
        if _PAIR.unpack_from(raw, 0) != (count, sha256_prefix(sha256_hex)):
            return None
    except ValueError:
        return None
    table = np.frombuffer(raw, dtype="<i8").reshape(-1, 2)[1:].astype(np.int64)
    if lengths is not None and count:
        at, m = table[:, 0], table[:, 1]
        if len(lengths) != count or at.min() < 0 or m.min() < 0 or lengths.min() < 16:
            return None
        if (at > lengths - 16 - m).any():  # not at + m > lengths - 16: their sum wraps past 2**63 in int64
            return None
    return table


def read_index(
    shard: str | os.PathLike, *, size: int | None = None, count: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets, lengths)`` of every record of a shard, from its ``.tfindex``, as int64 arrays.

    Given the shard's byte ``size``, the records must also tile the file exactly:
    the first at 0, each starting where the previous ends, each at least 16
    bytes, the last ending at ``size`` (checked once, in numpy). ``size`` and
    ``count`` (the most records the index may list: the manifest's count) also bound
    how much of the index is read: an index longer than the lines of that many
    records is refused unread.

    Raises:
        PackFormatError: the index is missing, malformed or too long, or does not fit a shard of ``size`` bytes.
    """
    path = index_path(shard)
    lines = [n for n in (count, None if size is None else size // 16) if n is not None]  # a record is 16 bytes on
    most = _INDEX_LINE * (min(lines) + 1) if lines else None
    too_long = (
        None
        if not lines
        else PackFormatError(
            f"offsets index is longer than the lines of the {min(lines)} records it can list ({most} bytes)",
            path=path,
            hint="The index is damaged or belongs to another shard: convert or stage the pack again",
        )
    )
    try:  # a link could lead out of the pack: never followed
        raw = read_regular(path, most, follow_symlinks=False, too_long=too_long)
    except OSError as exc:
        if too_many_open_files(exc):
            raise out_of_files_error(path) from exc
        why = "it is a symlink, not a regular file of the pack" if exc.errno == errno.ELOOP else exc.strerror or exc
        raise PackFormatError(
            f"cannot read the shard's offsets index: {why}",
            path=path,
            hint="Convert or stage the pack again",
        ) from exc
    try:
        table = np.array(raw.split(), dtype=np.int64).reshape(-1, 2)
    except (ValueError, OverflowError) as exc:
        raise PackFormatError(f"offsets index is malformed: {exc}", path=path, hint="Convert the pack again") from exc
    offsets, lengths = np.ascontiguousarray(table[:, 0]), np.ascontiguousarray(table[:, 1])
    if size is not None:
        ends = np.cumsum(lengths)
        starts = ends - lengths
        # each offset and length inside the file too: then no sum of an offset and a length wraps in int64,
        # so lengths whose sum wraps past 2**63 cannot tile the shard modulo 2**64
        bad = np.flatnonzero((lengths < 16) | (lengths > size) | (offsets < 0) | (offsets > size) | (offsets != starts))
        if len(bad) or (ends[-1] if len(ends) else 0) != size:
            where = f"line {int(bad[0]) + 1} ({int(offsets[bad[0]])} {int(lengths[bad[0]])})" if len(bad) else "its end"
            raise PackFormatError(
                f"offsets index does not tile the {size}-byte shard: {where} is not where the records are",
                path=path,
                hint="The index is damaged or belongs to another shard: convert or stage the pack again",
            )
    return offsets, lengths


class RecordTable:
    """One shard's records: where each lies in the shard, and where its payload lies in its data.

    Either mapped from a ``.tfpayload`` at ``path`` (``mapped``: the whole
    table, a view into the page cache, checked) or parsed from the ``.tfindex``
    (``offsets`` and ``lengths``: private arrays, with a version-1 payload table if any).
    ``payloads`` is None when payloads are not to be sliced out (the records are parsed).
    """

    __slots__ = ("_buf", "_last", "_lengths", "_mapped", "offsets", "path", "payloads", "size")

    def __init__(
        self,
        offsets: np.ndarray,
        size: int,
        *,
        lengths: np.ndarray | None = None,
        payloads: np.ndarray | None = None,
        mapped: np.ndarray | None = None,
        path: Path | None = None,
    ) -> None:
        self.offsets, self.size, self.payloads, self.path = offsets, size, payloads, path
        self._lengths, self._mapped = lengths, mapped
        self._buf = mapped.data if mapped is not None else None  # struct reads: no numpy call per record
        self._last = len(offsets) - 1

    def __len__(self) -> int:
        return len(self.offsets)

    @property
    def rows(self) -> np.ndarray | None:
        """A mapped table's ``(offset, payload offset, payload length)`` rows as stored; None if parsed."""
        return None if self._mapped is None else self._mapped[6:].reshape(-1, 3)

    @property
    def lengths(self) -> np.ndarray:
        """Framed length of every record (of a mapped table: computed, a private array)."""
        if self._lengths is None:
            return np.diff(self.offsets, append=self.size)
        return self._lengths

    def record(self, k: int) -> tuple[int, int, tuple[int, int] | None]:
        """Offset and framed length of record ``k`` (``0 <= k < len(self)``), and its payload span (None: parse it)."""
        if self._buf is not None:  # this row and the next record's offset in one unpack
            if k < self._last:
                offset, at, m, end = _ROW_AND_NEXT.unpack_from(self._buf, _HEAD + _ROW.size * k)
            else:
                (offset, at, m), end = _ROW.unpack_from(self._buf, _HEAD + _ROW.size * k), self.size
            spans = self.payloads is not None
            # checked at open, but mapped: the file may have been rewritten in place since
            if (
                offset < 0
                or end > self.size
                or end - offset < 16
                or (spans and (m < 0 or not 0 <= at <= end - offset - 16 - m))
            ):
                raise self._changed(k, offset, end)
            return offset, end - offset, (at, m) if spans else None
        span = self.payloads[k].tolist() if self.payloads is not None else None
        return int(self.offsets[k]), int(self.lengths[k]), span

    def _changed(self, k: int, offset: int, end: int) -> PackFormatError:
        """The mapped table no longer describes records tiling the shard: it changed since it was checked."""
        return PackFormatError(
            f"record {k}'s row says it spans bytes {offset} to {end} of the {self.size}-byte shard, with its "
            f"payload inside: not a record of it, so the table changed since the shard was opened",
            path=self.path,
            hint="Recreate the dataset after changing a pack, and run `packdata verify` on it",
        )


def record_table_header(count: int, size: int, sha256_hex: str, spans: bool) -> bytes:
    """The two header rows of a complete record table (``sha256_hex``: the shard's SHA-256)."""
    return _ROW.pack(_TABLE_MAGIC, _TABLE_VERSION, count) + _ROW.pack(size, sha256_prefix(sha256_hex), int(spans))


def _bound(head: bytes, count: int, size: int, sha256_hex: str) -> bool:
    """Whether a record table's header rows describe the shard the manifest describes."""
    if len(head) < _HEAD or len(sha256_hex) < 16 or not sha256_prefix(sha256_hex):
        return False
    fields = _ROW.unpack_from(head, 0) + _ROW.unpack_from(head, _ROW.size)
    expected = (_TABLE_MAGIC, _TABLE_VERSION, count, size, sha256_prefix(sha256_hex))
    return fields[:5] == expected and fields[5] in (0, 1)


def has_record_table(shard: str | os.PathLike, count: int, size: int, sha256_hex: str) -> bool:
    """Whether the shard has a record table whose header and size fit it (:func:`map_record_table` checks rows)."""
    raw = map_int64(payload_path(shard), follow_symlinks=False)
    return raw is not None and raw.size == 3 * (count + 2) and _bound(raw[:6].tobytes(), count, size, sha256_hex)


def record_offsets(shard: str | os.PathLike, size: int) -> np.ndarray | None:
    """Every record's offset from the shard's record table, mapped; None without one for a shard of ``size`` bytes.

    Only the header is checked (version, size, row count): for read-ahead
    hints, which never decide what is read. Readers use :func:`map_record_table`.
    """
    raw = map_int64(payload_path(shard), follow_symlinks=False)
    if raw is None or raw.size < 6 or raw.size % 3:
        return None
    if (int(raw[0]), int(raw[1]), int(raw[3])) != (_TABLE_MAGIC, _TABLE_VERSION, size):
        return None
    return raw[6:].reshape(-1, 3)[:, 0] if int(raw[2]) == raw.size // 3 - 2 else None


def map_record_table(
    shard: str | os.PathLike, count: int, size: int, sha256_hex: str, *, payloads: bool
) -> RecordTable | None:
    """The shard's record table, memory-mapped and checked; None if absent, of version 1, foreign or damaged.

    Args:
        shard: the shard file.
        count, size, sha256_hex: the shard's record count, byte size and SHA-256 (the manifest's).
        payloads: also check and return payload spans (None where rows hold none).
    """
    raw = map_int64(
        payload_path(shard), follow_symlinks=False
    )  # mapped, not read: every worker shares the page cache's copy
    if raw is None or raw.size != 3 * (count + 2) or not _bound(raw[:6].tobytes(), count, size, sha256_hex):
        return None
    rows = raw[6:].reshape(-1, 3)
    spans = payloads and int(raw[5]) == 1
    if not _rows_fit(rows, size, spans):
        return None
    return RecordTable(rows[:, 0], size, payloads=rows[:, 1:] if spans else None, mapped=raw, path=payload_path(shard))


def _rows_fit(rows: np.ndarray, size: int, spans: bool) -> bool:
    """Records tile ``size`` bytes exactly, each of 16 bytes or more, and (``spans``) each span lies inside its data."""
    if not len(rows):
        return size == 0
    if rows[0, 0] != 0:
        return False
    for start, stop, nxt in _chunks(rows, size):
        offsets = rows[start:stop, 0]
        if offsets.min() < 0 or offsets.max() > size:  # in range first: the differences cannot overflow
            return False
        room = np.append(offsets[1:], nxt) - offsets - 16  # each record's data bytes
        if room.min() < 0:
            return False
        if spans:
            at, m = rows[start:stop, 1], rows[start:stop, 2]
            if at.min() < 0 or m.min() < 0 or (at > room).any() or (m > room - at).any():
                return False
    return True


def _chunks(rows: np.ndarray, size: int) -> Iterator[tuple[int, int, int]]:
    """``(start, stop, offset after row stop - 1)`` of each run of rows checked together."""
    for start in range(0, len(rows), _CHECK_ROWS):
        stop = min(start + _CHECK_ROWS, len(rows))
        yield start, stop, int(rows[stop, 0]) if stop < len(rows) else size


def parse_records(shard: str | os.PathLike, count: int, size: int, sha256_hex: str, *, payloads: bool) -> RecordTable:
    """The shard's records from its ``.tfindex`` (checked to tile the shard) and a version-1 payload table, if any.

    Raises:
        PackFormatError: the index is missing or malformed, does not tile the shard, or lists another record count.
    """
    offsets, lengths = read_index(shard, size=size, count=count)
    if len(offsets) != count:
        raise PackFormatError(
            f"offsets index lists {len(offsets)} records, the manifest says {count}",
            path=shard,
            hint="Convert or stage the pack again",
        )
    table = read_payload_table(shard, count, sha256_hex, lengths) if payloads else None
    return RecordTable(offsets, size, lengths=lengths, payloads=table)


def shard_records(shard: str | os.PathLike, count: int, size: int, sha256_hex: str, *, payloads: bool) -> RecordTable:
    """The shard's records: its record table mapped where valid, else parsed (:func:`parse_records`).

    Raises:
        PackFormatError: no valid record table, and the ``.tfindex`` is missing or damaged.
    """
    table = map_record_table(shard, count, size, sha256_hex, payloads=payloads)
    return table if table is not None else parse_records(shard, count, size, sha256_hex, payloads=payloads)
