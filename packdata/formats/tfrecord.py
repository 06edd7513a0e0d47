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
:class:`~packdata.errors.PackFormatError` naming the shard and byte offset."""

# Over ~500 lines: writer and reader of one format; the reader's hot loops are inlined.

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import mmap
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from fastcrc.crc32 import iscsi as crc32c

from packdata.errors import PackFormatError, destination_error
from packdata.formats import ByteStream, ShardLayout
from packdata.formats.tfrecord_example import (
    _HEADER,
    _MASK_DELTA,
    _U32,
    FIELDS_FEATURE,
    _damaged,
    _payload_span,
    _span_ok,
    check_record,
    encode_example,
    example_fields,
    frame_record,
    masked_crc,
    parse_example,
)
from packdata.formats.tfrecord_tables import (
    _HEAD,
    _ROW,
    _TABLE_MAGIC,
    _TABLE_VERSION,
    INDEX_SUFFIX,
    PAYLOAD_SUFFIX,
    SHARD_SUFFIX,
    index_path,
    map_record_table,
    payload_path,
    read_index,
    read_payload_table,
    record_offsets,
    record_table_header,
)
from packdata.pack.fields import FieldError, encode_block
from packdata.pack.files import not_a_file, open_regular
from packdata.pack.manifest import ShardInfo
from packdata.pack.records import RecordError, Sample

__all__ = [
    "NAME",
    "SHARD_SUFFIX",
    "SHARD_WRITER",
    "TFRecordShardReader",
    "TFRecordShardWriter",
    "check_payload_table",
    "check_side_tables",
    "chunk_plan",
    "iter_samples",
    "iter_shard_samples",
    "iter_stream_samples",
    "read_remote_payload",
    "shard_layout",
    "walk_records",
]


NAME = "tfrecord"


_CHUNK = 8 << 20  # bytes per positioned read when streaming a shard


_COPY_MIN_RECORD = 16 << 10  # mean record size from which stream(copy=True) reads record by record


_UNFINISHED = _ROW.pack(_TABLE_MAGIC, _TABLE_VERSION, 0) + _ROW.pack(0, 0, 0)  # a record table being written


class TFRecordShardWriter:
    """Appends framed Examples to one shard, its offsets index and its record table.

    The file bytes are exactly what is written, so the shard's SHA-256 is
    computed as it is written. :meth:`sync` makes data and index durable (call
    it before recording a checkpoint); ``resume_at=k`` cuts both back to their
    first ``k`` records.
    """

    def __init__(self, path: str | os.PathLike, *, resume_at: int | None = None) -> None:
        self.path = Path(path)
        self.index_path = index_path(self.path)
        self.payload_path = payload_path(self.path)
        self._sha = hashlib.sha256()
        self.count = 0
        self.bytes = 0
        self._with_table = True  # False when resuming a shard whose record table is missing
        self._spans = True  # every row holds its payload's span (False once a multi-field record is written)
        if resume_at is not None:
            self._truncate(resume_at)
        else:
            try:
                self.path.write_bytes(b"")
                self.index_path.write_bytes(b"")
                self.payload_path.write_bytes(_UNFINISHED)  # header completed by close()
            except OSError as exc:
                raise destination_error(exc, self.path) from exc
        self._file = open(self.path, "ab", buffering=1 << 20)  # noqa: SIM115 (closed in close())
        self._index = open(self.index_path, "ab")  # noqa: SIM115
        self._table = open(self.payload_path, "ab") if self._with_table else None  # noqa: SIM115

    @staticmethod
    def shard_name(number: int) -> str:
        """Temporary file name of shard ``number``; :meth:`finalize` gives the TF-style name."""
        return f"part-{number:05d}{SHARD_SUFFIX}"

    @staticmethod
    def finalize(pack: Path, shards: list[ShardInfo]) -> list[ShardInfo]:
        """Rename shards (and indexes) to ``NAME-00003-of-00016.tfrecord``.

        ``NAME`` is the pack's name without its suffix (``out.tfrecord`` and
        ``out`` give ``out``), or ``data``; ``pack`` may be the hidden
        ``.NAME.partial`` folder convert writes into. Repeatable: a file already
        under its final name (a run killed while renaming) is left there.
        """
        out = TFRecordShardWriter.final_shards(pack, shards)
        for shard, final in zip(shards, out, strict=True):
            old, new = Path(pack) / shard.file, Path(pack) / final.file
            for source, target, required in (
                (index_path(old), index_path(new), True),
                (payload_path(old), payload_path(new), False),
                (old, new, True),
            ):
                if source.exists() or (required and not target.exists()):
                    os.replace(source, target)
        return out

    @staticmethod
    def final_shards(pack: Path, shards: list[ShardInfo]) -> list[ShardInfo]:
        """``shards`` under the names :meth:`finalize` gives them; no file is touched."""
        name = Path(pack).name
        if name.startswith(".") and name.endswith(".partial"):
            name = name[1 : -len(".partial")]
        name = (name[: -len(Path(name).suffix)] if Path(name).suffix else name) or "data"
        count = len(shards)
        return [
            dataclasses.replace(shard, file=f"{name}-{number:05d}-of-{count:05d}{SHARD_SUFFIX}")
            for number, shard in enumerate(shards)
        ]

    def _truncate(self, keep: int) -> None:
        lines = self.index_path.read_bytes().split(b"\n")
        if len(lines) - 1 < keep:  # the last element follows the last newline
            raise PackFormatError(
                f"offsets index holds {len(lines) - 1} complete records, cannot resume at {keep}",
                path=self.index_path,
                hint="Start the conversion again with --overwrite",
            )
        kept = b"".join(line + b"\n" for line in lines[:keep])
        end = 0
        if keep:
            offset, length = (int(v) for v in lines[keep - 1].split())
            end = offset + length
        if self.path.stat().st_size < end:
            raise PackFormatError(
                f"shard is shorter than its checkpoint ({end} bytes)",
                path=self.path,
                hint="Start the conversion again with --overwrite",
            )
        os.truncate(self.path, end)
        self.index_path.write_bytes(kept)
        table = self.payload_path.read_bytes() if self.payload_path.is_file() else b""
        end_row = _HEAD + _ROW.size * keep
        if len(table) >= end_row and table[:16] == _UNFINISHED[:16]:  # this version's table: header unset until close()
            rows = np.frombuffer(table[_HEAD:end_row], dtype="<i8").reshape(-1, 3)
            self._spans = bool((rows[:, 1] >= 0).all())
            self.payload_path.write_bytes(_UNFINISHED + table[_HEAD:end_row])
        else:  # written without a table (or by an older packdata, or it was lost): the shard is read by parsing
            self.payload_path.unlink(missing_ok=True)
            self._with_table = False
        with open(self.path, "rb") as f:
            while block := f.read(_CHUNK):
                self._sha.update(block)
        self.count, self.bytes = keep, end

    def write(self, items: list[tuple[int, Sample]]) -> None:
        """Append ``(index in shard, sample)`` pairs; indices must continue the shard."""
        lines = []
        rows = []
        for index, sample in items:
            if index != self.count:
                raise PackFormatError(f"record {index} is out of order (expected {self.count})", path=self.path)
            example = encode_example(sample)
            if sample.kind == "fields":  # no one payload: readers parse the Example
                self._spans = False
                rows.append(_ROW.pack(self.bytes, -1, -1))
            else:
                rows.append(_ROW.pack(self.bytes, *_payload_span(example)))
            record = frame_record(example)
            self._file.write(record)
            self._sha.update(record)
            lines.append(f"{self.bytes} {len(record)}\n")
            self.bytes += len(record)
            self.count += 1
        self._index.write("".join(lines).encode("ascii"))
        if self._table is not None:
            self._table.write(b"".join(rows))

    def sync(self) -> None:
        """Make every record written so far durable, data before index."""
        for f in (self._file, self._index, self._table):
            if f is not None:
                f.flush()
                os.fsync(f.fileno())

    def close(self) -> tuple[int, str]:
        """Sync and close; the shard is complete. Returns its byte size and SHA-256."""
        self.sync()
        self._file.close()
        self._index.close()
        digest = self._sha.hexdigest()
        if self._table is not None:
            self._table.close()
            self._table = None
            with open(self.payload_path, "r+b") as f:  # the header makes the table valid
                f.write(record_table_header(self.count, self.bytes, digest, self._spans))
                f.flush()
                os.fsync(f.fileno())
        return self.bytes, digest


class TFRecordShardReader:
    """Positioned reads of one shard's records; the file opens on first use.

    Holds an OS file descriptor, so create one per process (datasets key their
    readers by ``os.getpid()``).
    """

    def __init__(self, path: str | os.PathLike, *, check_crc: bool = True, expected_bytes: int | None = None) -> None:
        self.path = os.fspath(path)
        self.check_crc = check_crc
        self.expected_bytes = expected_bytes
        self._fd = -1

    def open(self) -> TFRecordShardReader:
        """Open the file now (else on first read); a size other than ``expected_bytes`` raises."""
        self._open()
        return self

    def _open(self) -> int:
        if self._fd < 0:
            try:
                fd = open_regular(self.path)  # a FIFO in its place would block a plain open for ever
            except OSError as exc:
                problem = not_a_file(self.path) or f"cannot be opened: {exc.strerror or exc}"
                raise PackFormatError(
                    f"shard file {problem}", path=self.path, hint="Convert or stage the pack again"
                ) from exc
            size = os.fstat(fd).st_size
            if self.expected_bytes is not None and size != self.expected_bytes:
                os.close(fd)
                raise PackFormatError(
                    f"shard is {size} bytes, the manifest read when the dataset was opened says {self.expected_bytes}",
                    path=self.path,
                    hint="The shard is truncated, or the pack was converted or staged again since: "
                    "run `packdata verify`, and recreate the dataset after changing a pack",
                )
            self._fd = fd
        return self._fd

    def _truncated(self, offset: int, needed: int, got: int) -> PackFormatError:
        return PackFormatError(
            f"shard is truncated: the record at byte offset {offset} needs {needed} bytes, "
            f"the file holds {got} from there",
            path=self.path,
            hint="Convert or stage the pack again",
        )

    def read(self, offset: int, length: int) -> memoryview:
        """The data of the record at ``offset`` (``length`` framed bytes), checked."""
        buf = memoryview(os.pread(self._open(), length, offset))
        if len(buf) < length:
            raise self._truncated(offset, length, len(buf))
        return check_record(buf, 0, length, path=self.path, offset=offset, check_crc=self.check_crc)

    def read_payload(self, offset: int, length: int, span: Sequence[int]) -> bytes:
        """The payload of the record at ``offset``, at ``span`` (its payload-table row) in the record's data.

        The record is checked as :meth:`read` checks it, and the span must be
        the value of its ``image/encoded`` or ``text/encoded`` feature (a
        damaged table row is named, never read as other bytes of the record).
        """
        raw = os.pread(self._open(), length, offset)  # read() inlined: one call less per random fetch
        if len(raw) < length:
            raise self._truncated(offset, length, len(raw))
        data = check_record(memoryview(raw), 0, length, path=self.path, offset=offset, check_crc=self.check_crc)
        at, m = span
        if at < 0 or m < 0 or at + m > len(data) or not _span_ok(data, at, m):
            raise _damaged(self.path, offset, "the payload table does not point at the payload")
        return raw[12 + at : 12 + at + m]  # the data starts after the 12-byte length header

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
        """The data of records ``start..stop-1``, mapped ``_CHUNK`` bytes at a time.

        With ``payloads`` (the shard's payload table, see :func:`read_payload_table`)
        each record's payload is yielded instead of its whole data: a slice of the
        data, after the same framing and CRC checks.

        ``copy=True`` (for a caller that copies every record at once anyway)
        reads records of 16 KB and more on average with positioned reads
        instead of mappings: each record is read into process memory and
        checked while it is still in the CPU cache; with ``payloads`` the
        payload is read straight into the ``bytes`` yielded (see
        :meth:`_read_payloads`), so it is never copied again.

        Each chunk of whole records is memory-mapped with ``MAP_POPULATE``: one
        system call maps (and, on a cold cache, reads) it, while the next chunk
        is asked of the kernel (``POSIX_FADV_WILLNEED``), so the disk reads it
        as this one's records are checked and handed out; records are
        views into the page cache, so a record's bytes are copied once, by the
        caller. A view stays valid while it is referenced (it keeps its chunk's
        mapping alive; mapped file pages are page cache, not process memory). The file
        size is checked first, so a truncated shard raises an error instead of
        faulting; a file truncated *while* it is read can still raise SIGBUS.
        """
        fd = self._open()
        size = os.fstat(fd).st_size
        span = int(offsets[stop - 1] + lengths[stop - 1] - offsets[start]) if stop > start else 0
        if stop > start and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, int(offsets[start]), span, os.POSIX_FADV_SEQUENTIAL)
        if copy and stop > start and span >= _COPY_MIN_RECORD * (stop - start):
            yield from self._read_each(fd, offsets, lengths, start, stop, payloads)
            return
        plan = list(chunk_plan(offsets, lengths, start, stop, size))
        for k, (i, j, base, end) in enumerate(plan):
            aligned = base - base % mmap.ALLOCATIONGRANULARITY
            buf = _map(fd, aligned, end - aligned)[base - aligned :] if end > base else memoryview(b"")
            if k + 1 < len(plan) and hasattr(os, "posix_fadvise"):  # the disk reads the next chunk meanwhile
                os.posix_fadvise(fd, plan[k + 1][2], plan[k + 1][3] - plan[k + 1][2], os.POSIX_FADV_WILLNEED)
            yield from self.check_chunk(buf, base, offsets, lengths, i, j, payloads)
            del buf  # the mapping goes when the last view into it does

    def check_chunk(
        self,
        buf: memoryview,
        base: int,
        offsets: np.ndarray,
        lengths: np.ndarray,
        i: int,
        j: int,
        payloads: np.ndarray | None,
    ) -> Iterator[memoryview]:
        """The data (or payloads) of records ``i..j-1`` held in ``buf`` (file bytes from ``base``), checked."""
        check_crc = self.check_crc
        crc, header, u32 = crc32c, _HEADER.unpack_from, _U32.unpack_from
        nbuf = len(buf)
        # plain ints: numpy scalars cost a conversion per access
        starts = (offsets[i:j] - base).tolist()
        sizes = lengths[i:j].tolist()
        spans = payloads[i:j].tolist() if payloads is not None else itertools.repeat(None)
        for pos, length, span in zip(starts, sizes, spans, strict=False):
            if length < 16 or pos + length > nbuf:
                if pos + length > nbuf:
                    raise self._truncated(base + pos, length, max(0, nbuf - pos))
                raise _damaged(self.path, base + pos, f"record of {length} bytes does not fit")
            n, length_crc = header(buf, pos)
            if n != length - 16:
                raise _damaged(self.path, base + pos, f"length field says {n} bytes, the index says {length - 16}")
            first = pos + 12
            if check_crc:
                c = crc(buf[pos : pos + 8])
                if (((c >> 15) | (c << 17)) + _MASK_DELTA) & 0xFFFFFFFF != length_crc:
                    raise _damaged(self.path, base + pos, "CRC32C of the length field does not match")
                c = crc(buf[first : first + n])
                if (((c >> 15) | (c << 17)) + _MASK_DELTA) & 0xFFFFFFFF != u32(buf, first + n)[0]:
                    raise _damaged(self.path, base + pos, "CRC32C of the data does not match")
            if span is None:
                yield buf[first : first + n]
            else:
                at, m = span
                if at < 0 or m < 0 or at + m > n or not _span_ok(buf, first + at, m):
                    raise _damaged(self.path, base + pos, "the payload table does not point at the payload")
                yield buf[first + at : first + at + m]

    def _read_each(
        self, fd: int, offsets: np.ndarray, lengths: np.ndarray, start: int, stop: int, payloads: np.ndarray | None
    ) -> Iterator[memoryview | bytes]:
        """:meth:`stream` with one positioned read per record (see ``copy``)."""
        if payloads is not None:
            yield from self._read_payloads(fd, offsets, lengths, start, stop, payloads)
            return
        check_crc = self.check_crc
        crc, header, u32, pread = crc32c, _HEADER.unpack_from, _U32.unpack_from, os.pread
        for offset, length in zip(offsets[start:stop].tolist(), lengths[start:stop].tolist(), strict=True):
            record = pread(fd, length, offset)
            if len(record) < length:
                raise self._truncated(offset, length, len(record))
            if length < 16:
                raise _damaged(self.path, offset, f"record of {length} bytes does not fit")
            n, length_crc = header(record, 0)
            if n != length - 16:
                raise _damaged(self.path, offset, f"length field says {n} bytes, the index says {length - 16}")
            view = memoryview(record)
            if check_crc:
                c = crc(view[:8])
                if (((c >> 15) | (c << 17)) + _MASK_DELTA) & 0xFFFFFFFF != length_crc:
                    raise _damaged(self.path, offset, "CRC32C of the length field does not match")
                c = crc(view[12 : 12 + n])
                if (((c >> 15) | (c << 17)) + _MASK_DELTA) & 0xFFFFFFFF != u32(record, 12 + n)[0]:
                    raise _damaged(self.path, offset, "CRC32C of the data does not match")
            yield view[12 : 12 + n]

    def _read_payloads(
        self, fd: int, offsets: np.ndarray, lengths: np.ndarray, start: int, stop: int, payloads: np.ndarray
    ) -> Iterator[bytes]:
        """Payloads read straight into ``bytes``; the bytes around them in one read per gap.

        A record is read as its head (header and the Example up to the payload),
        the payload, and its tail (the rest of the Example and the data CRC),
        the tail read together with the next record's head when that record
        follows it: two reads per record, no copy of the payload, and the data
        CRC computed over the three parts in order.
        """
        check_crc = self.check_crc
        crc, header, u32, pread = crc32c, _HEADER.unpack_from, _U32.unpack_from, os.pread
        offs, lens, spans = offsets[start:stop].tolist(), lengths[start:stop].tolist(), payloads[start:stop].tolist()
        last = len(offs) - 1
        pending: bytes | None = None
        for k in range(len(offs)):
            offset, length = offs[k], lens[k]
            at, m = spans[k]
            if length < 16:
                raise _damaged(self.path, offset, f"record of {length} bytes does not fit")
            if at < 0 or m < 0 or at + m > length - 16:
                raise _damaged(self.path, offset, "the payload table points outside the record")
            head = pending if pending is not None else pread(fd, 12 + at, offset)
            if len(head) < 12 + at:
                raise self._truncated(offset, length, len(head))
            n, length_crc = header(head, 0)
            if n != length - 16:
                raise _damaged(self.path, offset, f"length field says {n} bytes, the index says {length - 16}")
            if not _span_ok(head, 12 + at, m):
                raise _damaged(self.path, offset, "the payload table does not point at the payload")
            payload = pread(fd, m, offset + 12 + at)
            if len(payload) < m:
                raise self._truncated(offset, length, 12 + at + len(payload))
            tail_size = length - 12 - at - m
            extra = 12 + spans[k + 1][0] if k < last and offs[k + 1] == offset + length and spans[k + 1][0] >= 0 else 0
            rest = pread(fd, tail_size + extra, offset + 12 + at + m)
            if len(rest) < tail_size:
                raise self._truncated(offset, length, 12 + at + m + len(rest))
            pending = rest[tail_size:] if extra else None
            if check_crc:
                c = crc(memoryview(head)[:8])
                if (((c >> 15) | (c << 17)) + _MASK_DELTA) & 0xFFFFFFFF != length_crc:
                    raise _damaged(self.path, offset, "CRC32C of the length field does not match")
                view = memoryview(rest)
                c = crc(view[: tail_size - 4], crc(payload, crc(memoryview(head)[12:])))
                if (((c >> 15) | (c << 17)) + _MASK_DELTA) & 0xFFFFFFFF != u32(rest, tail_size - 4)[0]:
                    raise _damaged(self.path, offset, "CRC32C of the data does not match")
            yield payload

    def close(self) -> None:
        """Close the file descriptor, if open."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def chunk_plan(
    offsets: np.ndarray, lengths: np.ndarray, start: int, stop: int, size: int, chunk: int = _CHUNK
) -> Iterator[tuple[int, int, int, int]]:
    """``(first record, end record, first byte, end byte)`` of each run of whole records of about ``chunk`` bytes."""
    i = start
    while i < stop:
        base = int(offsets[i])
        j = i + 1 + int(np.searchsorted(offsets[i + 1 : stop], base + chunk, side="left"))
        j = min(max(j - 1, i + 1), stop)  # whole records within one chunk, at least one
        yield i, j, base, min(int(offsets[j - 1] + lengths[j - 1]), size)
        i = j


def _map(fd: int, offset: int, length: int) -> memoryview:
    """A read-only view of ``length`` bytes of ``fd`` from ``offset`` (a multiple of the granularity)."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return memoryview(mmap.mmap(fd, length, flags=flags, prot=mmap.PROT_READ, offset=offset))


def iter_shard_samples(path: str | os.PathLike, first_index: int) -> Iterator[tuple[int, Sample]]:
    """``(global index, Sample)`` of every record of a shard in file order, fully checked.

    Walks the framing from the first byte (independently of the index), checks
    both CRCs of every record and that the offsets index lists exactly these
    records.

    Raises:
        PackFormatError: naming the shard and the byte offset of the first bad record.
    """
    path = os.fspath(path)
    offsets, lengths = read_index(path)
    with open(path, "rb", buffering=_CHUNK) as f:
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
    """A TFRecord shard is one file, with its ``.tfindex`` and ``.tfpayload`` tables beside it."""
    return ShardLayout(folder=False, data=name, side=(index_path(name).name, payload_path(name).name))


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
    fs: Any, root: str, shown: str, rel: str, shard: Path, info: ShardInfo, j: int
) -> tuple[bytes, str | None, int | None]:
    """Record ``j`` of a shard in object storage in one ranged read through its offsets index, CRCs checked.

    The pack is ``root`` on ``fs`` (``shown``: its URL without credentials),
    the shard is ``rel`` inside it, and ``shard`` is where a local copy of its
    ``.tfindex`` lies. Returns the payload (a multi-field sample's field
    block), and the key and label the record holds.

    Raises:
        PackFormatError: the index or the record is damaged.
        SourceError: the request failed.
    """
    from packdata.formats.tfrecord_remote import RemoteShardReader

    offsets, lengths = read_index(shard, size=info.bytes)
    if not 0 <= j < len(offsets):
        raise PackFormatError(f"offsets index lists {len(offsets)} records, not record {j}", path=f"{shown}/{rel}")
    reader = RemoteShardReader(fs, f"{root}/{rel}", f"{shown}/{rel}", info.bytes)
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
    offsets, lengths = read_index(shard)
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
