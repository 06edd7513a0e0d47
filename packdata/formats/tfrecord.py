"""TFRecord shards: standard framing, ``tf.train.Example`` records, an offsets index.

A shard is an ordinary TFRecord file that ``tf.data.TFRecordDataset``, DALI's
TFRecord reader and the ``tfrecord`` package read unchanged. Each record is::

    uint64 length | uint32 masked CRC32C(length) | data[length] | uint32 masked CRC32C(data)

(little-endian; ``masked(c) = ((c >> 15) | (c << 17)) + 0xA282EAD8 mod 2**32``),
and ``data`` is a serialized ``tf.train.Example`` with the feature names image
pipelines already use:

- ``image/encoded`` (bytes): the file's bytes, unchanged unless re-encoded;
  ``text/encoded`` instead for text packs;
- ``image/format`` (bytes, images only): ``b"jpeg"``, ``b"png"``, ... sniffed from
  the magic bytes, else the key's extension;
- ``image/class/label`` (int64): the label, -1 without class folders;
- ``image/filename`` (bytes): the key, UTF-8.

Examples are serialized with protobuf's deterministic map order, so the same
source gives byte-identical shards.

Beside ``NAME-00003-of-00016.tfrecord`` lies ``NAME-00003-of-00016.tfindex``:
the ``tfrecord`` package's text index (the name its ``tfrecord2idx`` tool gives),
one line ``offset length`` per record, where ``offset`` is the record's first byte
in the shard and ``length`` its whole framed size (data + 16). DALI's
``tfrecord2idx`` writes the same layout, so both tools read it as is.

Beside it lies ``NAME-00003-of-00016.tfpayload``, packdata's own record table
(other tools ignore it; layout in :mod:`packdata.formats.tfrecord_tables`):
per record its offset in the shard and its payload's span (``image/encoded``
or ``text/encoded``) inside the record's data, under a header binding it to the
shard's record count, size and SHA-256. The writer leaves the count and
checksum unset until the shard is complete, so a table of an unfinished shard
never validates. Readers map the table (shared by every process through the
page cache), check it whole in numpy, then read a record without the text
index and slice its payload out of the record data (CRCs of the whole record
still checked), taking the label from the pack's sample index instead of
parsing the Example. Without a valid table (a shard written by another tool or
an older packdata, or changed since) they parse the ``.tfindex`` and the
Examples, so the table is an accelerator, never a second source of truth.

Reads never trust an index alone: every record's framing is checked against it,
and CRCs are checked unless asked not to. A damaged record raises
:class:`~packdata.errors.PackFormatError` naming the shard and byte offset.

The format's modules:

- this one: the format as the registry sees it (``NAME``, ``SHARD_WRITER``,
  ``shard_layout``, sample walks with every check, side-table checks, remote reads)
- :mod:`~packdata.formats.tfrecord_writer`: :class:`~packdata.formats.tfrecord_writer.TFRecordShardWriter`
- :mod:`~packdata.formats.tfrecord_reader`: :class:`~packdata.formats.tfrecord_reader.TFRecordShardReader`
  (positioned and mapped reads, chunk checks) and :func:`~packdata.formats.tfrecord_reader.chunk_plan`
- :mod:`~packdata.formats.tfrecord_example`: the ``tf.train.Example`` encoder;
  :mod:`~packdata.formats.tfrecord_parse`: its parser
- :mod:`~packdata.formats.tfrecord_framing`: record framing (length, masked CRC32C) and its checks
- :mod:`~packdata.formats.tfrecord_tables`: file names, the ``.tfindex`` and the ``.tfpayload`` record table
- :mod:`~packdata.formats.tfrecord_remote`: shards read from object storage
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from packdata.errors import PackFormatError, out_of_files_error, too_many_open_files
from packdata.formats import ByteStream, ShardLayout
from packdata.formats.tfrecord_example import FIELDS_FEATURE
from packdata.formats.tfrecord_framing import _HEADER, _U32, _damaged, masked_crc
from packdata.formats.tfrecord_parse import _payload_span, example_fields, parse_example
from packdata.formats.tfrecord_reader import _CHUNK, TFRecordShardReader
from packdata.formats.tfrecord_tables import (
    INDEX_SUFFIX,
    PAYLOAD_SUFFIX,
    SHARD_SUFFIX,
    index_path,
    map_record_table,
    payload_path,
    read_index,
    read_payload_table,
    record_offsets,
)
from packdata.formats.tfrecord_writer import TFRecordShardWriter
from packdata.pack.fields import FieldError, encode_block
from packdata.pack.files import open_regular
from packdata.pack.manifest import Manifest, ShardInfo
from packdata.pack.records import RecordError, Sample

__all__ = [
    "NAME",
    "SHARD_WRITER",
    "check_payload_table",
    "check_side_tables",
    "closed_records",
    "iter_samples",
    "iter_shard_samples",
    "iter_stream_samples",
    "read_remote_payload",
    "record_spans",
    "shard_layout",
    "walk_records",
]


NAME = "tfrecord"


def iter_shard_samples(path: str | os.PathLike, first_index: int) -> Iterator[tuple[int, Sample]]:
    """``(global index, Sample)`` of every record of a shard in file order, fully checked.

    Walks the framing from the first byte (independently of the index), checks
    both CRCs of every record and that the offsets index lists exactly these
    records.

    Raises:
        PackFormatError: naming the shard and the byte offset of the first bad record.
    """
    path = os.fspath(path)
    try:
        most = os.stat(path).st_size // 16  # a record takes 16 bytes at least: the index lists no more
    except OSError:
        most = None  # the open below names what is wrong
    offsets, lengths = read_index(path, count=most)
    try:
        fd = open_regular(path)  # a FIFO in its place would block the read, a device node act when opened
    except OSError as exc:
        if too_many_open_files(exc):
            raise out_of_files_error(path) from exc
        if exc.errno == errno.ENOENT:
            hint = "The pack is incomplete: convert or stage it again"
            raise PackFormatError("the shard file is missing", path=path, hint=hint) from exc
        problem = f"is {exc.strerror}" if exc.errno == errno.EINVAL else f"cannot be opened: {exc.strerror or exc}"
        raise PackFormatError(problem, path=path, hint="Convert the pack again") from exc
    with os.fdopen(fd, "rb", buffering=_CHUNK) as f:
        yield from walk_records(f, os.fstat(f.fileno()).st_size, offsets, lengths, first_index, path)


def walk_records(
    stream: ByteStream,
    size: int,
    offsets: np.ndarray,
    lengths: np.ndarray,
    first_index: int,
    path: str,
    payloads: np.ndarray | None = None,
) -> Iterator[tuple[int, Sample]]:
    """:func:`iter_shard_samples` over any sequential ``stream`` of a shard's ``size`` bytes (a remote shard too).

    With ``payloads`` (the shard's payload table), every row is also checked
    against its record: it must point at the record's payload.

    Raises:
        PackFormatError: naming ``path`` (a file or a URL) and the byte offset of the first bad record.
    """
    pos = number = 0
    while pos < size:
        head = stream.read(12)
        if len(head) < 12:
            raise _damaged(path, pos, f"file ends {size - pos} bytes into a record header (truncated)")
        n, length_crc = _HEADER.unpack(head)
        if masked_crc(head[:8]) != length_crc:
            raise _damaged(path, pos, "CRC32C of the length field does not match")
        if pos + 16 + n > size:
            raise _damaged(path, pos, f"record needs {16 + n} bytes, the file ends after {size - pos} (truncated)")
        if number >= len(offsets) or offsets[number] != pos or lengths[number] != n + 16:
            raise _damaged(path, pos, f"record {number} is not where the offsets index says")
        rest = stream.read(n + 4)
        if len(rest) < n + 4:
            raise _damaged(path, pos, f"record needs {16 + n} bytes, the file ends after {12 + len(rest)} (truncated)")
        data = memoryview(rest)[:n]
        if masked_crc(data) != _U32.unpack_from(rest, n)[0]:
            raise _damaged(path, pos, "CRC32C of the data does not match")
        if payloads is not None and tuple(payloads[number]) != _payload_span(bytes(data)):
            raise PackFormatError(
                f"payload table row {number} does not point at the payload of record {number} (byte offset {pos})",
                path=path,
                hint="Convert the pack again (or delete the table: readers then parse each record)",
            )
        try:
            yield first_index + number, _sample_of(data)
        except (RecordError, FieldError, UnicodeDecodeError) as exc:
            raise _damaged(path, pos, f"not a packdata Example: {exc}") from exc
        pos += n + 16
        number += 1
    if number != len(offsets):
        raise PackFormatError(
            f"offsets index lists {len(offsets)} records, the shard holds {number}",
            path=(path[: -len(SHARD_SUFFIX)] if path.endswith(SHARD_SUFFIX) else path) + INDEX_SUFFIX,
            hint="Convert the pack again",
        )


def _sample_of(data: memoryview) -> Sample:
    """The :class:`Sample` an Example holds (a multi-field one as the field block it was written from)."""
    multi_field_error: RecordError | None = None
    if FIELDS_FEATURE in bytes(data):
        try:
            fields, label, key = example_fields(data)
        except RecordError as exc:
            multi_field_error = exc  # or the marker bytes occur inside some payload: an image or text Example
        else:
            sizes = tuple(sorted((name, len(value)) for name, value in fields.items()))
            return Sample(key, label, encode_block(fields), "fields", sizes)
    try:
        parsed = parse_example(data)
    except RecordError:
        if multi_field_error is not None:  # neither: the multi-field reason says more
            raise multi_field_error from None
        raise
    return Sample(parsed.key.decode("utf-8"), parsed.label, bytes(parsed.data), parsed.kind)


SHARD_WRITER = TFRecordShardWriter


def record_spans(shard: Path, size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``(offsets, lengths)`` of every record of the shard (read-ahead hints), or None.

    From its record table (offsets mapped, lengths their differences), else its ``.tfindex``.
    """
    offsets = record_offsets(shard, size)
    if offsets is not None:
        return offsets, np.diff(offsets, append=size)
    try:
        return read_index(shard, size=size)
    except PackFormatError:
        return None


iter_samples = iter_shard_samples


def shard_layout(name: str) -> ShardLayout:
    """A TFRecord shard is one file, with its ``.tfindex`` (needed) and ``.tfpayload`` tables beside it."""
    index = index_path(name).name
    return ShardLayout(folder=False, data=name, side=(index, payload_path(name).name), needed=(index,))


def closed_records(data: Path) -> int:
    """The records a closed shard holds, from its ``.tfindex`` (checked to tile the shard: read whole, no record).

    Raises:
        PackFormatError: the index is missing, malformed, or does not tile the shard.
    """
    return len(read_index(data, size=os.path.getsize(data))[0])


def check_side_tables(shard: Path, info: ShardInfo) -> None:
    """Check ``.tfpayload`` row by row (the ``.tfindex`` is checked while the records are walked)."""
    check_payload_table(shard, info.num_samples, info.sha256, info.bytes)


def _table_spans(
    shard: str | os.PathLike, info: tuple[int, int, str], offsets: np.ndarray, lengths: np.ndarray, shown: str
) -> np.ndarray | None:
    """The payload spans of a shard's ``.tfpayload`` to compare with its records; None without spans to check.

    A record table must fit the shard (``info``: its count, size and SHA-256)
    and list the records the ``.tfindex`` lists (``offsets``); a version-1
    table must fit the shard. ``shown`` names the table in messages.

    Raises:
        PackFormatError: a table is there that is neither.
    """
    if not payload_path(shard).is_file():
        return None
    count, size, sha256_hex = info
    hint = "Convert the pack again (or delete the table: readers then parse each record)"
    table = map_record_table(shard, count, size, sha256_hex, payloads=True)
    if table is not None:
        bad = np.flatnonzero(table.offsets != offsets) if len(offsets) == count else [min(count, len(offsets))]
        if len(bad):
            k = int(bad[0])
            raise PackFormatError(
                f"record table row {k} does not hold the offset of record {k} the offsets index holds",
                path=shown,
                hint=hint,
            )
        rows = table.rows
        if table.payloads is None and rows is not None and count and (rows[:, 1:] != -1).any():
            k = int(np.flatnonzero((rows[:, 1:] != -1).any(axis=1))[0])
            raise PackFormatError(
                f"record table says its rows hold no payload spans, but row {k} holds one", path=shown, hint=hint
            )
        return table.payloads
    spans = read_payload_table(shard, count, sha256_hex, lengths)
    if spans is None:
        raise PackFormatError(
            "payload table does not belong to this shard (count, size or checksum differ, or a row is out of bounds)",
            path=shown,
            hint=hint,
        )
    return spans


def iter_stream_samples(stream: ByteStream, shard: Path, info: ShardInfo, where: str) -> Iterator[tuple[int, Sample]]:
    """:func:`iter_shard_samples` of a shard read as a sequential ``stream`` (from object storage).

    ``shard`` is where local copies of the shard's ``.tfindex`` and
    ``.tfpayload`` lie (the shard file itself need not); ``where`` names the
    shard in messages. The index must tile the manifest's byte size exactly,
    the record table must list the index's records, and every payload span is
    checked against its record on the way.

    Raises:
        PackFormatError: naming ``where`` and the byte offset of the first bad record, or a bad table.
    """
    offsets, lengths = read_index(shard, size=info.bytes)
    shown = where[: -len(SHARD_SUFFIX)] + PAYLOAD_SUFFIX if where.endswith(SHARD_SUFFIX) else where
    payloads = _table_spans(shard, (info.num_samples, info.bytes, info.sha256), offsets, lengths, shown)
    return walk_records(stream, info.bytes, offsets, lengths, info.first_index, where, payloads)


def read_remote_payload(
    fs: Any, root: str, shown: str, rel: str, shard: Path, info: ShardInfo, j: int, *, opened: Manifest, key: str
) -> tuple[bytes, str, int]:
    """Record ``j`` of a shard in object storage in one ranged read through its offsets index, CRCs checked.

    The pack is ``root`` on ``fs`` (``shown``: its URL without credentials),
    the shard is ``rel`` inside it, and ``shard`` is where a local copy of its
    ``.tfindex`` lies, downloaded with ``opened`` (the pack's manifest): the
    record is read from the shard object's version pinned for it. Returns the
    payload (a multi-field sample's field block), and the key and label the record holds
    (``key``, the sample index's, is not needed: the offsets index finds the record's start).

    Raises:
        PackFormatError: the index or the record is damaged, the request
            failed, or the pack was replaced since ``opened`` was read.
    """
    from packdata.formats.tfrecord_remote import RemoteShardReader

    offsets, lengths = read_index(shard, size=info.bytes)
    if not 0 <= j < len(offsets):
        raise PackFormatError(f"offsets index lists {len(offsets)} records, not record {j}", path=f"{shown}/{rel}")
    reader = RemoteShardReader(fs, f"{root}/{rel}", f"{shown}/{rel}", info.bytes, opened=opened)
    offset = int(offsets[j])
    data = reader.read(offset, int(lengths[j]))
    try:
        sample = _sample_of(data)
    except (RecordError, FieldError, UnicodeDecodeError) as exc:
        raise _damaged(f"{shown}/{rel}", offset, f"not a packdata Example: {exc}") from exc
    return sample.data, sample.key, sample.label


def check_payload_table(shard: str | os.PathLike, count: int, sha256_hex: str, size: int) -> None:
    """Check a shard's ``.tfpayload`` row by row against its records (for ``verify``).

    A missing table is fine (readers parse the ``.tfindex`` and the Examples).

    Raises:
        PackFormatError: the table is stale, foreign, or points anywhere but at a record or its payload.
    """
    path = payload_path(shard)
    offsets, lengths = read_index(shard, count=count)
    table = _table_spans(shard, (count, size, sha256_hex), offsets, lengths, os.fspath(path))
    if table is None:
        return
    reader = TFRecordShardReader(shard)
    try:
        for k, data in enumerate(reader.stream(offsets, lengths, 0, len(offsets))):
            if tuple(table[k]) != _payload_span(bytes(data)):
                raise PackFormatError(
                    f"payload table row {k} does not point at the payload of record {k} "
                    f"(byte offset {int(offsets[k])})",
                    path=path,
                    hint="Convert the pack again (or delete the table: readers then parse each record)",
                )
    finally:
        reader.close()
