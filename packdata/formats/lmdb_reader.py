"""Reading LMDB shards: :class:`LMDBShardReader`, a record in one ``pread``, located without LMDB.

When the shard's ``records.i64`` is bound to it (:mod:`packdata.formats.lmdb_tables`),
the reader fetches a payload with one ``pread`` instead of a B-tree lookup
through the memory map, checks that it got every byte and (by default) its
CRC32C, about 2 us per 40 KB, a few thousandths of a JPEG decode. That
matters cold: py-lmdb touches every page of a value before returning it, so
with readahead off a 40 KB value costs ten synchronous 4 KB faults, about 4x
slower than reading the same bytes from a folder; one ``pread`` is one I/O
request. Without a valid table (none, a table of an older packdata, a damaged
or foreign one, or any later write to the environment), and for whole records
(``get``, ``items``), the reader walks the shard's B-tree itself
(:func:`~packdata.formats.lmdb_pages.value_locations`: every page checked as
it goes) for where each record's value lies, and reads it the same way; the
record's own CRC-32, key and label are checked by the caller. A dataset then
offers the sample index to :meth:`LMDBShardReader.rows_from_headers`: when
every record's key and label in its header are the index's, payloads are
read as through a table, each checked against its header's CRC-32.

So a reader never opens LMDB: the record count and transaction id the table
is bound to come from the meta page packdata reads itself. It holds neither
LMDB's handle (a file) nor its map, and a DataLoader worker forked while
another thread of its parent was reading inherits nothing of LMDB's (py-lmdb
refuses a second handle on a file in one process, and its ``close`` waits for
the calls in flight at the fork, which never end in the child); a user's own
``lmdb.open`` of a shard does not stand in its way.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Iterator
from typing import cast

import numpy as np
from fastcrc.crc32 import iscsi as crc32c
from zlib_ng.zlib_ng import crc32

from packdata.errors import DAMAGED_PACK_HINT, PackFormatError, too_many_open_files
from packdata.formats.lmdb_env import DATA_FILE
from packdata.formats.lmdb_pages import ShardValues, read_lmdb_meta, value_locations
from packdata.formats.lmdb_tables import RECORDS_FILE, _read_table
from packdata.formats.residency import PagedFile
from packdata.pack.files import not_a_file, open_regular, sha256_prefix
from packdata.pack.records import read_headers

__all__ = ["ExpectedRecords", "LMDBShardReader"]

ExpectedRecords = Callable[[int, int], "tuple[np.ndarray, np.ndarray, np.ndarray] | None"]
"""The labels, key bytes (concatenated) and key lengths the sample index gives records ``a`` to ``b`` of a shard;
None when the index cannot tell (see :meth:`LMDBShardReader.rows_from_headers`)."""
_HEADERS_AT_ONCE = 1 << 16  # records whose headers are read in one numpy pass (~10 MB of temporaries)


class LMDBShardReader:
    """Reads records of one shard by their index within the shard.

    Opened lazily in the process that uses it. Payloads are fetched with one
    ``pread`` each through the shard's ``records.i64`` table when it is valid
    for this shard (see the module docstring); whole records through the
    value locations of the shard's own pages, walked on first use.

    Args:
        path: the shard directory.
        check_crc: check each payload's CRC32C (table reads; whole records are checked by their reader).
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
        check_crc: bool = True,
        expected_bytes: int | None = None,
        expected_sha256: str | None = None,
        expected_records: int | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.check_crc = check_crc
        self._pid = os.getpid()
        self._fd = -1
        self._locations: np.ndarray | None = None
        self._rows: memoryview | None = None  # the same table as int64 items: a Python int each, no numpy call
        self._values: memoryview | None = None  # whole records: (offset, length) int64 pairs, walked on first use
        self._walked: ShardValues | None = None  # without a valid table: the walk, until rows_from_headers is offered
        self._crc: Callable[[bytes], int] = crc32c  # of the table's rows (CRC-32 for rows from the headers)
        self._crc_name = "CRC32C"
        self._pages: PagedFile | None = None
        self._bounds = (0, 0)  # where the table's payloads may lie: [first byte, end of data.mdb)
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
            self._open(data, size, expected_sha256, expected_records)
        except BaseException:
            self.close()
            raise

    def _open(self, data: str, size: int, expected_sha256: str | None, expected_records: int | None) -> None:
        self._size = size
        meta = read_lmdb_meta(data)  # the meta page LMDB would use, both checked
        self._entries = meta.entries
        if expected_records is not None and self._entries != expected_records:  # records would shift between shards
            raise PackFormatError(
                f"shard holds {self._entries} records, the manifest read when the dataset was opened says "
                f"{expected_records}",
                path=data,
                hint="The manifest does not describe this shard: run `packdata verify`, and recreate the dataset "
                "after converting or staging a pack again",
            )
        payloads_from = 2 * meta.page_size  # a payload lies past LMDB's two meta pages, inside the file
        found = _read_table(self.path, meta.entries, meta.txnid, size, payloads_from)
        if found is None or expected_sha256 is None or found[0] != sha256_prefix(expected_sha256):
            self._walked = value_locations(data)  # stale or foreign (e.g. a sibling's): the shard's own pages
            self._values = self._walked.locations.ravel().data.cast("B").cast("q")
        else:
            self._locations = found[1].ravel()
            self._rows = self._locations.data.cast("B").cast("q")
            self._bounds = (payloads_from, size)
        self._fd = _open_data(data, size)
        self._pages = PagedFile(self._fd, size)  # map slices when warm, pread when cold

    def _walk_values(self, data: str) -> memoryview:
        """Where every whole record lies, from the shard's pages (walked and checked once per reader)."""
        if self._values is None:  # two threads may both walk: the same table either way
            self._values = value_locations(data).locations.ravel().data.cast("B").cast("q")
        return self._values

    @property
    def entries(self) -> int:
        """The shard's record count."""
        return self._entries

    @property
    def unbound(self) -> bool:
        """Whether the shard has no valid table and :meth:`rows_from_headers` has not been offered yet."""
        return self._walked is not None

    def rows_from_headers(self, expected: ExpectedRecords) -> bool:
        """For a shard without a valid table: payload rows taken from its records' own headers; whether it took them.

        It takes them only if every record's header is sound and its key and
        label are the ones ``expected`` gives (the sample index's). Then
        :meth:`payload` and :meth:`payloads` read as through a table, each
        payload checked against its record's CRC-32. Otherwise nothing
        changes: the caller reads each whole record (:meth:`get`) and checks
        it, which names the first that differs. Offered once; the headers lie
        in the pages the walk read, so this reads nothing more from disk.
        """
        walked, self._walked = self._walked, None
        if walked is None:
            return False
        n = self._entries
        rows = np.empty((n, 3), dtype=np.int64)
        for a in range(0, n, _HEADERS_AT_ONCE):
            b = min(n, a + _HEADERS_AT_ONCE)
            found = read_headers(walked.pages, walked.locations[a:b, 0], walked.locations[a:b, 1])
            given = expected(a, b)
            if found is None or given is None:
                return False
            labels, keys, key_lengths = given
            same = np.array_equal(found.labels, labels) and np.array_equal(found.key_lengths, key_lengths)
            if not (same and np.array_equal(found.keys, keys)):
                return False
            rows[a:b, 0], rows[a:b, 1], rows[a:b, 2] = found.payload_offsets, found.payload_lengths, found.crcs
        self._crc, self._crc_name = crc32, "CRC-32"
        self._locations = rows.ravel()
        self._rows = self._locations.data.cast("B").cast("q")
        self._bounds = (2 * walked.meta.page_size, self._size)
        return True

    def get(self, index: int) -> bytes:
        """The whole record at ``index`` within the shard, in one ``pread`` (or a slice of the resident file).

        Raises:
            PackFormatError: the index is past the shard's records, or fewer bytes could be read than the tree says.
        """
        if not 0 <= index < self._entries:
            raise PackFormatError(
                f"record {index} is missing: the shard holds {self._entries}",
                path=self.path,
                hint="The shard is damaged: run `packdata verify`",
            )
        values = self._values
        if values is None:
            values = self._walk_values(os.path.join(self.path, DATA_FILE))
        offset, length = values[2 * index], values[2 * index + 1]
        assert self._pages is not None  # opened
        data = self._pages.read(offset, length)
        if len(data) != length:
            raise self._damaged(index, offset, length, len(data), "record")
        return data

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
        if self._outside(offset, length):  # the table was checked at open, but is mapped: it may change since
            raise self._table_changed(index, offset, length)
        assert self._pages is not None  # opened with the table
        data = self._pages.read(offset, length)
        if len(data) != length or (self.check_crc and self._crc(data) != crc):
            raise self._damaged(index, offset, length, len(data))
        return data

    def _outside(self, offset: int, length: int) -> bool:
        """Whether a row's payload lies outside where payloads can (see ``_bounds``)."""
        first, end = self._bounds
        return offset < first or length < 0 or offset + length > end

    def _table_changed(self, index: int, offset: int, length: int) -> PackFormatError:
        """``records.i64`` changed in place since it was checked: a row no longer lies where payloads can."""
        return PackFormatError(
            f"record {index}'s row says its payload is {length} bytes at byte offset {offset}, outside the "
            f"payloads of a {self._bounds[1]}-byte data.mdb: the table changed since the shard was opened",
            path=os.path.join(self.path, RECORDS_FILE),
            hint="Recreate the dataset after changing a pack, and run `packdata verify` on it",
        )

    def _damaged(self, index: int, offset: int, length: int, got: int, part: str = "payload") -> PackFormatError:
        what = f"its {self._crc_name} does not match"
        if got != length:
            what = f"only {got} of its {length} bytes could be read"
        return PackFormatError(
            f"record {index} is damaged: the {part} at byte offset {offset}: {what}",
            path=os.path.join(self.path, DATA_FILE),
            hint=DAMAGED_PACK_HINT,
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
            rows = self._locations.reshape(-1, 3)[indices]
        except IndexError:  # past the table: record by record, None where it has no row
            return [self.payload(int(i)) for i in indices]
        first, end = self._bounds
        offsets, lengths, crcs = rows.T.tolist()  # Python ints: checked with no overflow, and faster than
        if offsets and (  # numpy's reductions on a run of a few rows (~5 us each)
            min(offsets) < first or min(lengths) < 0 or max(map(operator.add, offsets, lengths)) > end
        ):
            return [self.payload(int(i)) for i in indices]  # a row changed since the open: the first one raises
        mapped = self._pages.warm_map(len(offsets), sum(lengths))
        if mapped is not None:
            datas = [mapped[offset : offset + length] for offset, length in zip(offsets, lengths, strict=True)]
        else:
            datas = [os.pread(self._fd, length, offset) for offset, length in zip(offsets, lengths, strict=True)]
        check = self.check_crc
        crc = self._crc
        if list(map(len, datas)) != lengths or (check and list(map(crc, datas)) != crcs):  # two C loops
            for index, data, offset, length, want in zip(indices.tolist(), datas, offsets, lengths, crcs, strict=True):
                if len(data) != length or (check and crc(data) != want):
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
        row = int(self._locations[3 * index])  # type: ignore[index]
        if self._outside(row, total):
            raise self._table_changed(index, row, total)
        offset = row + start
        data = self._pages.read(offset, length)  # type: ignore[union-attr]
        return data if len(data) == length else None

    def items(self) -> Iterator[tuple[int, bytes]]:
        """Iterate ``(index in shard, record)`` in key order."""
        for index in range(self._entries):
            yield index, self.get(index)

    def close(self) -> None:
        """Close the file and let go of the tables."""
        self._rows = self._values = self._walked = None
        if self._pages is not None:
            self._pages.close()
            self._pages = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        try:
            if self._pid == os.getpid():
                self.close()
            elif self._fd >= 0:  # a parent's reader, dropped in a forked child: only the descriptor is the child's
                os.close(self._fd)
        except Exception:  # at interpreter exit: nothing left to let go of
            pass


def _open_data(data: str, size: int) -> int:
    """A descriptor of ``data.mdb``, still the regular file of ``size`` bytes its table was checked against.

    The shard was looked at by path; a FIFO swapped in since would block a
    plain open forever, another file of another size would be read against
    the old one's table.

    Raises:
        OSError: out of file descriptors (the caller may raise its limit and retry).
        PackFormatError: it cannot be opened, is no longer a regular file, or changed size.
    """
    try:
        fd = open_regular(data)
    except OSError as exc:
        if too_many_open_files(exc):
            raise
        raise PackFormatError(
            f"the shard's {DATA_FILE} cannot be opened: {exc.strerror or exc}",
            path=data,
            hint="The pack changed while it was opened: run `packdata verify` on it",
        ) from exc
    now = os.fstat(fd).st_size
    if now != size:
        os.close(fd)
        raise PackFormatError(
            f"{DATA_FILE} changed while the shard was opened: {size} bytes, then {now}",
            path=data,
            hint="Recreate the dataset after changing a pack, and run `packdata verify` on it",
        )
    return fd
