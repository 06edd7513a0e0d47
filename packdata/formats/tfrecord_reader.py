"""The TFRecord shard reader: positioned reads, mapped chunks of records, and their framing and CRC checks.

Every record read is checked against the offsets index (its length field) and,
unless asked not to, both its CRC32Cs; with a record table row, the payload is
sliced out of the checked record. The loops that check records are inlined on
purpose: they are the hot path of every TFRecord read.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
from collections.abc import Iterator, Sequence

import numpy as np
from fastcrc.crc32 import iscsi as crc32c

from packdata.errors import PackFormatError
from packdata.formats.tfrecord_example import _span_ok
from packdata.formats.tfrecord_framing import _HEADER, _MASK_DELTA, _U32, _damaged, check_record
from packdata.formats.tfrecord_tables import payload_path
from packdata.pack.files import not_a_file, open_regular

__all__ = ["TFRecordShardReader", "chunk_plan"]


_CHUNK = 8 << 20  # bytes per positioned read when streaming a shard


_NOT_AT_PAYLOAD = "the payload table does not point at the payload"

_COPY_MIN_RECORD = 16 << 10  # mean record size from which stream(copy=True) reads record by record


class TFRecordShardReader:
    """Positioned reads of one shard's records; the file opens on first use.

    Holds an OS file descriptor, so create one per process (datasets key their
    readers by ``os.getpid()``). ``table``: the payload table whose rows are
    passed in, named when a row misses its sound record's payload (default: the
    ``.tfpayload`` beside the shard).
    """

    TABLE_HINT = "Convert or stage the pack again to rebuild the table (or delete it: readers then parse each record)"

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        check_crc: bool = True,
        expected_bytes: int | None = None,
        table: str | os.PathLike | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.check_crc = check_crc
        self.expected_bytes = expected_bytes
        self.table: str | None = os.fspath(table if table is not None else payload_path(self.path))
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

    def _misplaced(self, offset: int, framed: bytes | memoryview, problem: str) -> PackFormatError:
        """A payload-table row that does not fit the record at ``offset`` (``framed``: its bytes, framing included).

        Only on this error path are the record's CRC32Cs checked, whatever
        ``check_crc``: a damaged record is the shard's damage; a sound one
        means the table's row, not the shard, is wrong.
        """
        try:
            check_record(memoryview(framed), 0, len(framed), path=self.path, offset=offset, check_crc=True)
        except PackFormatError as exc:
            return exc
        if self.table is None:  # not known: the shard is named
            return _damaged(self.path, offset, problem)
        return PackFormatError(
            f"{problem} of the record at byte offset {offset} of {os.path.basename(self.path)}, and the record "
            "is sound (its CRC32Cs match): the table is damaged, not the shard",
            path=self.table,
            hint=self.TABLE_HINT,
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
            raise self._misplaced(offset, raw, _NOT_AT_PAYLOAD)
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
                    raise self._misplaced(base + pos, buf[pos : pos + length], _NOT_AT_PAYLOAD)
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
                raise self._misplaced(offset, pread(fd, length, offset), "the payload table points outside the record")
            head = pending if pending is not None else pread(fd, 12 + at, offset)
            if len(head) < 12 + at:
                raise self._truncated(offset, length, len(head))
            n, length_crc = header(head, 0)
            if n != length - 16:
                raise _damaged(self.path, offset, f"length field says {n} bytes, the index says {length - 16}")
            if not _span_ok(head, 12 + at, m):
                raise self._misplaced(offset, pread(fd, length, offset), _NOT_AT_PAYLOAD)
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

    def __del__(self) -> None:
        # a reader let go of while still read (ShardReaders) closes here, when its last user drops it; a parent's,
        # dropped in a forked child, closes the child's copy of the descriptor (held there for nothing otherwise)
        with contextlib.suppress(Exception):  # at interpreter exit: nothing left to let go of
            self.close()


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
