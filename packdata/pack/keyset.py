"""A set of sample keys small enough for a 100 M-sample source: about 40 bytes a key, not 100 to 250.

Conversion refuses a repeated key (a list's rows, a tar's members, a
``PackWriter``'s samples, the packs a merge unites), so it must remember every
key it has seen. A Python ``set`` of ``str`` costs about 100 bytes a key
(a dict naming each key's first row, about 250): 10 to 25 GB for 100 M
samples. :class:`KeySet` keeps each key's 128-bit BLAKE2b digest and one
int64 value (the row, shard or sample that gave it first) in sorted NumPy
arrays: 24 bytes a key, plus recent keys in a dict of at most an eighth of
them, merged in as it fills (amortized: each key is copied about nine times).

Two distinct keys with one digest would make the second read as a repeat:
for 10^8 keys the chance is about 10^-23, far below a disk's silent bit flip.
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["KeySet"]

_MIN_RECENT = 1 << 16  # recent keys held in a dict before the first merge into the arrays


def _digest(key: str) -> bytes:
    # surrogatepass: a key from os.listdir of a name not in UTF-8 still has one digest of its own
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class KeySet:
    """Distinct string keys, each with the int value it was first added with."""

    def __init__(self, min_recent: int | None = None) -> None:
        self._min_recent = max(1, min_recent or _MIN_RECENT)
        self._merge_at = self._min_recent  # merge the recent keys into the arrays once this many
        self._recent: dict[bytes, int] = {}
        self._high = np.empty(0, np.uint64)  # sorted: the digests' first 8 bytes (little-endian)
        self._low = np.empty(0, np.uint64)  # the digests' last 8 bytes, row for row
        self._values = np.empty(0, np.int64)
        self._filter = bytearray(1)  # bit (low & mask) set for each digest in the arrays: most new keys miss it
        self._mask = 7

    def __len__(self) -> int:
        return len(self._recent) + len(self._high)

    def __contains__(self, key: str) -> bool:
        return self._find(_digest(key)) is not None

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
        if value is not None or not len(self._high):
            return value
        bit = int.from_bytes(digest[8:], "little") & self._mask
        if not self._filter[bit >> 3] >> (bit & 7) & 1:  # no key in the arrays has this bit: new
            return None
        pair = np.frombuffer(digest, "<u8")  # (first 8 bytes, last 8), as the arrays hold them
        high, low = pair[0], pair[1]
        at = int(self._high.searchsorted(pair[:1])[0])
        while at < len(self._high) and self._high[at] == high:  # more than one row: digests sharing 64 bits
            if self._low[at] == low:
                return int(self._values[at])
            at += 1
        return None

    def _merge(self) -> None:
        """Move the recent keys into the sorted arrays (a merge: linear in the keys held)."""
        pairs = np.frombuffer(b"".join(self._recent), dtype="<u8").reshape(-1, 2)
        values = np.fromiter(self._recent.values(), np.int64, len(self._recent))
        order = np.argsort(pairs[:, 0], kind="stable")
        high, low, values = pairs[order, 0], pairs[order, 1], values[order]
        at = np.searchsorted(self._high, high)
        self._high = np.insert(self._high, at, high)
        self._low = np.insert(self._low, at, low)
        self._values = np.insert(self._values, at, values)
        self._recent = {}
        self._merge_at = max(self._min_recent, len(self._high) // 8)
        if len(self._high) * 16 > self._mask + 1:  # under 16 bits a key: about 6% of new keys would look further
            self._mask = (1 << (len(self._high) * 32).bit_length()) - 1
            self._filter = bytearray((self._mask + 1) // 8)
            low = self._low
        bits = low & np.uint64(self._mask)
        ones = np.left_shift(np.uint8(1), (bits & np.uint64(7)).astype(np.uint8))
        np.bitwise_or.at(np.frombuffer(self._filter, np.uint8), bits >> np.uint64(3), ones)
