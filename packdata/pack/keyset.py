"""A set of sample keys for a source of any size: its memory stays under a budget, the rest spills to disk.

Conversion refuses a repeated key (a list's rows, a tar's members, a
``PackWriter``'s samples, the packs a merge unites), so it must remember every
key it has seen. A Python ``set`` of ``str`` costs about 100 bytes a key
(a dict naming each key's first row, about 250): 10 to 25 GB for 100 M
samples. :class:`KeySet` keeps each key's 128-bit BLAKE2b digest and one
int64 value (the row, shard or sample that gave it first) in sorted NumPy
arrays: 24 bytes a key, plus recent keys in a dict of at most an eighth of
them, merged in as it fills.

Given a ``spill`` folder, the arrays never grow past a quarter of ``budget``
(256 MiB): once they do they are written to a file there (a sorted run),
and emptied. A lookup searches the recent dict, the arrays,
then each run (4 to 8 KiB of it, read from the file: every 512th digest of a run
is held in memory to find the place). A Bloom filter of at most half the budget (3 bits a
key, 32 filter bits a key while it has room) keeps most new keys from looking
any further: at its full 128 MiB, 10^8 keys pass it wrongly about 1.5% of the
time. The runs are deleted by :meth:`KeySet.close` (or when the set is
collected); the caller removes the folder with what it holds. A run read back
other than it was written (its size; the order of a lookup's page of keys and
the digests held of it) raises :class:`~packdata.errors.PackFormatError` naming it;
a disk that fills while a run is written, :class:`~packdata.errors.CapacityError`
naming the run's file and its file system (callers put their own remedy in its hint).

Two distinct keys with one digest would make the second read as a repeat:
for 10^8 keys the chance is about 10^-23, far below a disk's silent bit flip.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import weakref
from pathlib import Path

import numpy as np

from packdata.errors import PackFormatError
from packdata.host.disks import FULL_DISK_ERRNOS, RERUN_HINT, no_space_error

__all__ = ["KeySet"]

_RERUN = (
    "It is scratch this run wrote, damaged since (check that disk): run again (a conversion: resume=True "
    "continues it); the keys spill anew"
)

_MIN_RECENT = 1 << 16  # recent keys held in a dict before the first merge into the arrays
_BUDGET = 256 << 20  # bytes: a quarter for the arrays (then they spill), half for the filter
_SHIFTS = (0, 40, 80)  # a key's filter bits: its digest's bits from each of these on (at most 40 of them)
_STRIDE = 512  # every this many digests of a run are held in memory, to find a key's page in it


def _digest(key: str) -> bytes:
    # surrogatepass: a key from os.listdir of a name not in UTF-8 still has one digest of its own
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class _Run:
    """One spilled run: ``count`` digests (high, low) and values, sorted by high, in a file read as needed.

    The file holds three columns of ``count`` little-endian 8-byte integers
    (high, low, value); a lookup reads the few KiB where its key would be
    (``pread``: the page cache keeps them, the process holds none).
    """

    def __init__(self, path: Path, high: np.ndarray, low: np.ndarray, values: np.ndarray) -> None:
        with open(path, "wb") as f:  # f.write, not ndarray.tofile: that loses a full disk's ENOSPC on its way out
            for array in (high, low, values.view(np.uint64)):
                f.write(np.ascontiguousarray(array, "<u8").data)
        self.path = path
        self.count = len(high)
        self.fd = os.open(path, os.O_RDONLY)
        self.sparse = np.array(high[::_STRIDE])  # in memory: 8 bytes per _STRIDE keys

    def column(self, number: int, start: int, stop: int) -> np.ndarray:
        """Rows ``start`` to ``stop`` of column ``number`` (0 high, 1 low, 2 values as uint64).

        Raises:
            PackFormatError: the file is not the size it was written, or cannot be read.
        """
        size = (stop - start) * 8
        try:
            found = os.fstat(self.fd).st_size
            data = os.pread(self.fd, size, (number * self.count + start) * 8) if found == self.count * 24 else b""
        except OSError as exc:
            raise self.damaged(f"cannot be read ({exc})") from exc
        if len(data) != size:  # cut short (or grown) under us: never answer from a part of it
            raise self.damaged(f"is {found} bytes, {self.count * 24} were written")
        return np.frombuffer(data, "<u8")

    def damaged(self, problem: str) -> PackFormatError:
        return PackFormatError(f"a run of keys spilled to disk {problem}", path=self.path, hint=_RERUN)

    def find(self, high: np.uint64, low: np.uint64) -> int | None:
        # every row with this high lies past the last sparse entry below it and before the first above it
        start = max(0, int(self.sparse.searchsorted(high, "left")) - 1) * _STRIDE
        stop = min(self.count, int(self.sparse.searchsorted(high, "right")) * _STRIDE)
        highs = self.column(0, start, stop)
        held = self.sparse[start // _STRIDE : start // _STRIDE + len(highs[::_STRIDE])]
        if not (np.array_equal(highs[::_STRIDE], held) and bool(np.all(highs[1:] >= highs[:-1]))):
            raise self.damaged("holds other bytes than were written (its keys are out of order)")
        at = int(highs.searchsorted(high))
        while at < len(highs) and highs[at] == high:
            if self.column(1, start + at, start + at + 1)[0] == low:
                return int(self.column(2, start + at, start + at + 1).view(np.int64)[0])
            at += 1
        return None


def _remove(runs: list[_Run], folder: Path) -> None:
    for run in runs:
        os.close(run.fd)
    runs.clear()
    shutil.rmtree(folder, ignore_errors=True)


class KeySet:
    """Distinct string keys, each with the int value it was first added with.

    Args:
        min_recent: keys held in a dict before they are merged into the sorted arrays.
        spill: a folder for sorted runs once the arrays pass a quarter of ``budget``
            (None: they stay in memory, however many).
        budget: bytes of memory the set aims to stay under (256 MiB).
    """

    def __init__(self, min_recent: int | None = None, *, spill: Path | None = None, budget: int | None = None) -> None:
        self._min_recent = max(1, min_recent or _MIN_RECENT)
        self._merge_at = self._min_recent  # merge the recent keys into the arrays once this many
        self._recent: dict[bytes, int] = {}
        self._high = np.empty(0, np.uint64)  # sorted: the digests' first 8 bytes (little-endian)
        self._low = np.empty(0, np.uint64)  # the digests' last 8 bytes, row for row
        self._values = np.empty(0, np.int64)
        budget = budget or _BUDGET
        self._spill_at = max(1, budget // 4 // 24)  # keys in the arrays
        most = min(8 * max(1, budget // 2), 1 << 40)
        self._max_filter_bits = 1 << (most.bit_length() - 1)  # a power of two
        self._filter = bytearray(1)  # len(_SHIFTS) bits set for each digest in the arrays and runs
        self._mask = 7
        self._runs: list[_Run] = []
        self._spilled = 0
        self._spill = spill
        self._folder: Path | None = None
        self._cleanup: weakref.finalize | None = None

    def __len__(self) -> int:
        return len(self._recent) + len(self._high) + self._spilled

    def __contains__(self, key: str) -> bool:
        return self._find(_digest(key)) is not None

    def __enter__(self) -> KeySet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def runs(self) -> int:
        """How many sorted runs spilled to the folder so far."""
        return len(self._runs)

    def close(self) -> None:
        """Delete the spilled runs (the set is empty of them after: call at the end of its use)."""
        self._spilled = 0
        if self._cleanup is not None:
            self._cleanup()  # closes and deletes the runs, empties the list

    def add(self, key: str, value: int = 0) -> int | None:
        """Add ``key`` with ``value``; None if it is new, else the value it was first added with (kept)."""
        digest = _digest(key)
        first = self._find(digest)
        if first is None:
            self._recent[digest] = value
            if len(self._recent) >= self._merge_at:
                self._merge()
        return first

    def _find(self, digest: bytes) -> int | None:
        value = self._recent.get(digest)
        if value is not None or not (len(self._high) or self._runs):
            return value
        whole, mask, bits = int.from_bytes(digest, "little"), self._mask, self._filter
        for shift in _SHIFTS:  # no key held has one of these bits: new
            bit = (whole >> shift) & mask
            if not bits[bit >> 3] >> (bit & 7) & 1:
                return None
        pair = np.frombuffer(digest, "<u8")  # (first 8 bytes, last 8), as the arrays hold them
        high, low = pair[0], pair[1]
        at = int(self._high.searchsorted(pair[:1])[0])
        while at < len(self._high) and self._high[at] == high:  # more than one row: digests sharing 64 bits
            if self._low[at] == low:
                return int(self._values[at])
            at += 1
        for run in self._runs:
            value = run.find(high, low)
            if value is not None:
                return value
        return None

    def _merge(self) -> None:
        """Move the recent keys into the sorted arrays (a merge: linear in the keys held), then spill if full."""
        pairs = np.frombuffer(b"".join(self._recent), dtype="<u8").reshape(-1, 2)
        values = np.fromiter(self._recent.values(), np.int64, len(self._recent))
        order = np.argsort(pairs[:, 0], kind="stable")
        high, low, values = pairs[order, 0], pairs[order, 1], values[order]
        at = np.searchsorted(self._high, high)
        self._high = np.insert(self._high, at, high)
        self._low = np.insert(self._low, at, low)
        self._values = np.insert(self._values, at, values)
        self._recent = {}
        total = len(self._high) + self._spilled
        if total * 16 > self._mask + 1 and self._mask + 1 < self._max_filter_bits:  # under 16 bits a key
            size = min(1 << (total * 32).bit_length(), self._max_filter_bits)
            self._mask = (1 << (size.bit_length() - 1)) - 1  # a power of two
            self._filter = bytearray((self._mask + 1) // 8)
            for run in self._runs:  # read a piece at a time: the runs are not held in memory
                for start in range(0, run.count, self._spill_at):
                    stop = min(run.count, start + self._spill_at)
                    self._set_bits(run.column(0, start, stop), run.column(1, start, stop))
            high, low = self._high, self._low
        self._set_bits(high, low)
        if self._spill is not None and len(self._high) >= self._spill_at:
            self._spill_run()
        self._merge_at = max(self._min_recent, len(self._high) // 8)

    def _set_bits(self, high: np.ndarray, low: np.ndarray) -> None:
        filter_bytes = np.frombuffer(self._filter, np.uint8)
        mask = np.uint64(self._mask)
        for shift in _SHIFTS:  # bits shift.. of the digest as one 128-bit integer (high holds bits 0 to 63)
            if shift < 64:
                bits = high >> np.uint64(shift)
                if shift:
                    bits = bits | (low << np.uint64(64 - shift))
            else:
                bits = low >> np.uint64(shift - 64)
            bits &= mask
            ones = np.left_shift(np.uint8(1), (bits & np.uint64(7)).astype(np.uint8))
            np.bitwise_or.at(filter_bytes, bits >> np.uint64(3), ones)

    def _spill_run(self) -> None:
        """Write the arrays to a run file in the spill folder, map it, and empty them."""
        assert self._spill is not None  # internal invariant: only called with a spill folder
        path = self._spill
        try:
            if self._folder is None:
                self._spill.mkdir(parents=True, exist_ok=True)
                self._folder = Path(tempfile.mkdtemp(prefix="keys-", dir=self._spill))
                self._cleanup = weakref.finalize(self, _remove, self._runs, self._folder)
            path = self._folder / f"run-{len(self._runs):05d}"
            self._runs.append(_Run(path, self._high, self._low, self._values))
        except OSError as exc:
            if exc.errno not in FULL_DISK_ERRNOS:
                raise
            if path != self._spill:  # the run written in part: its room goes back at once (the keys stay held)
                path.unlink(missing_ok=True)
            of = "(keys spilled past the memory budget)"
            raise no_space_error(exc, path, folder=self._spill.parent, of=of, hint=RERUN_HINT) from exc
        self._spilled += len(self._high)
        self._high = np.empty(0, np.uint64)
        self._low = np.empty(0, np.uint64)
        self._values = np.empty(0, np.int64)
