"""The sample index: every sample's key, label and payload size, without records.

Three flat little-endian files in the pack's ``index/`` folder, so a sampler or
``targets`` never reads a record and any tool reads them with ``numpy.fromfile``:

- ``labels.i32``: int32 label per sample (-1: no class folder);
- ``sizes.i64``: int64 payload byte length per sample;
- ``keys.utf8`` + ``key_offsets.i64``: the keys, UTF-8, concatenated; sample
  ``i``'s key is ``keys[offsets[i]:offsets[i + 1]]`` (``num_samples + 1`` offsets).

A pack of multi-field samples adds each sample's fields and their sizes:

- ``field_sizes.i64``: int64 pairs (field number, byte length), the field
  number indexing the manifest's ``fields`` list;
- ``field_offsets.i64``: sample ``i``'s pairs are rows
  ``offsets[i]:offsets[i + 1]`` (``num_samples + 1`` offsets).

:class:`~packdata.pack.index_writer.SampleIndexWriter` appends to them as
samples are packed; this module reads them.

The manifest's ``index.sha256`` records each file's SHA-256 once the index is
final (:func:`index_digests`), so a flipped bit in ``labels.i32`` is named
(:func:`check_index_digests`) instead of read as another label.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import overload

import numpy as np

from packdata.errors import DAMAGED_PACK_HINT, PackFormatError
from packdata.pack.files import file_sha256

__all__ = [
    "ALL_FILES",
    "FIELD_FILES",
    "FIELD_OFFSETS_FILE",
    "FIELD_SIZES_FILE",
    "FILES",
    "INDEX_DIR",
    "KEYS_FILE",
    "KEY_OFFSETS_FILE",
    "LABELS_FILE",
    "SIZES_FILE",
    "KeyList",
    "LabelList",
    "SampleIndex",
    "check_index_digests",
    "damaged_index_file",
    "field_file_problem",
    "field_pairs_problem",
    "index_digests",
    "index_files",
    "labels_out_of_range",
    "unlabelled",
]

INDEX_DIR = "index"
LABELS_FILE, SIZES_FILE, KEYS_FILE, KEY_OFFSETS_FILE = "labels.i32", "sizes.i64", "keys.utf8", "key_offsets.i64"
FIELD_SIZES_FILE, FIELD_OFFSETS_FILE = "field_sizes.i64", "field_offsets.i64"
FILES = (LABELS_FILE, SIZES_FILE, KEYS_FILE, KEY_OFFSETS_FILE)
FIELD_FILES = (FIELD_SIZES_FILE, FIELD_OFFSETS_FILE)
ALL_FILES = FILES + FIELD_FILES
_AGAIN = "Convert the pack again"


def index_files(kind: str) -> tuple[str, ...]:
    """The index files a pack of ``kind`` holds (a fields pack adds the field sizes)."""
    return ALL_FILES if kind == "fields" else FILES


def index_digests(directory: str | os.PathLike, kind: str) -> dict[str, str]:
    """File name -> SHA-256 of each index file in ``directory`` of a pack of ``kind``: the manifest's ``index.sha256``.

    Call once the files are final (closed, never appended to again).
    """
    return {name: file_sha256(Path(directory) / name) for name in index_files(kind)}


def damaged_index_file(path: str | os.PathLike, *, hint: str) -> PackFormatError:
    """The error of an index file whose bytes differ from the SHA-256 the manifest records for it."""
    return PackFormatError(
        f"sample index file {os.path.basename(path)} does not match its SHA-256 in the manifest",
        path=path,
        hint=hint,
    )


def check_index_digests(
    directory: str | os.PathLike, digests: Mapping[str, str], *, shown: str | os.PathLike | None = None
) -> None:
    """Hash each index file ``digests`` names (labels first) and raise at the first that differs.

    Args:
        directory: the index folder.
        digests: the manifest's ``index.sha256`` (empty for a pack written before it: nothing checked).
        shown: the index folder as messages name it (a URL for a downloaded copy); default ``directory``.

    Raises:
        PackFormatError: naming the damaged or unreadable file.
    """
    for name in (n for n in ALL_FILES if n in digests):
        path = Path(directory) / name
        where = f"{shown}/{name}" if shown else path  # a URL keeps its "//"
        try:
            actual = file_sha256(path)
        except OSError as exc:
            raise PackFormatError(
                f"sample index file {name} is unreadable: {exc.strerror}", path=where, hint=_AGAIN
            ) from exc
        if actual != digests[name]:
            raise damaged_index_file(where, hint=_AGAIN)


class KeyList(Sequence[str]):
    """Read-only sequence of keys over the index files (decoded on access).

    With ``digests`` (the manifest's ``index.sha256``), the first key read in a
    process hashes ``keys.utf8`` and ``key_offsets.i64`` against them (a bit
    flipped there would read as another key: a multi-field sample's ``__key__``,
    ``ls``, an error's sample name). Once per process and index, about 1 s a
    2 GB of keys; a forked worker inherits a finished check.
    """

    def __init__(
        self,
        blob: np.ndarray,
        offsets: np.ndarray,
        path: str | os.PathLike | None = None,
        digests: Mapping[str, str] | None = None,
    ) -> None:
        self._blob = blob
        self._offsets = offsets
        self._path = path
        given = digests or {}
        self._unchecked = {name: given[name] for name in (KEY_OFFSETS_FILE, KEYS_FILE) if name in given}

    def check(self) -> None:
        """Raise unless the keys and their offsets match the manifest's digests (hashed once; then nothing).

        Raises:
            PackFormatError: naming ``keys.utf8`` or ``key_offsets.i64``.
        """
        for name, data in ((KEY_OFFSETS_FILE, self._offsets), (KEYS_FILE, self._blob)):
            expected = self._unchecked.get(name)
            if expected is not None and hashlib.sha256(data.data).hexdigest() != expected:
                where = Path(self._path).with_name(name) if self._path is not None else name
                raise damaged_index_file(where, hint=DAMAGED_PACK_HINT)
        self._unchecked = {}

    def __len__(self) -> int:
        return len(self._offsets) - 1

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"key index {i} out of range for {n} samples")
        i %= n
        if self._unchecked:
            self.check()
        try:
            return self._blob[self._offsets[i] : self._offsets[i + 1]].tobytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PackFormatError(
                f"key {i} is not UTF-8 ({exc})", path=self._path, hint="Convert the pack again"
            ) from exc

    def encoded_range(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Keys ``start`` to ``stop`` (in range) as stored: their UTF-8 bytes concatenated (uint8) and their lengths.

        None when the offsets there do not rise inside the keys' file (a damaged index the digests did not cover).
        """
        if self._unchecked:
            self.check()
        offsets = np.asarray(self._offsets[start : stop + 1], dtype=np.int64)
        lengths = np.diff(offsets)
        if len(offsets) != stop - start + 1 or offsets[0] < 0 or offsets[-1] > len(self._blob) or (lengths < 0).any():
            return None
        return np.asarray(self._blob[offsets[0] : offsets[-1]], dtype=np.uint8), lengths

    def encoded(self, i: int) -> bytes:
        """Key ``i`` (``0 <= i < len(self)``) as stored, UTF-8 bytes not decoded: for comparing with a record's key."""
        if self._unchecked:
            self.check()
        return self._blob[self._offsets.item(i) : self._offsets.item(i + 1)].tobytes()


class LabelList(Sequence[int]):
    """Every sample's label as a read-only ``list[int]`` look-alike over the memory-mapped index.

    ``ds.targets[i]`` is an ``int``, a slice a ``list``, ``count``/``index``/
    ``tolist`` run in numpy, and ``numpy.asarray(ds.targets)`` is the int32 map
    without a copy.
    """

    def __init__(self, labels: np.ndarray) -> None:
        self._labels = labels

    def __len__(self) -> int:
        return len(self._labels)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return self._labels[i].tolist()
        return int(self._labels[i])

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        return np.asarray(self._labels, dtype=dtype)  # type: ignore[call-overload]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and list(other) == self.tolist()

    __hash__ = None  # type: ignore[assignment]

    def count(self, value: object) -> int:
        return int(np.count_nonzero(np.asarray(self._labels) == value)) if isinstance(value, int) else 0

    def tolist(self) -> list[int]:
        return np.asarray(self._labels).tolist()

    def __repr__(self) -> str:
        head = ", ".join(map(str, self[:8]))
        return f"LabelList([{head}{', ...' if len(self) > 8 else ''}], {len(self)} labels)"


class SampleIndex:
    """The index of a finished pack, memory-mapped (shared by forked workers)."""

    def __init__(
        self,
        directory: str | os.PathLike,
        num_samples: int,
        fields: list[str] | None = None,
        digests: Mapping[str, str] | None = None,
    ) -> None:
        """Map the index in ``directory``; ``digests`` (``index.sha256``) are checked by :class:`KeyList`."""
        directory = Path(directory)
        self.labels = self._map(directory / LABELS_FILE, "<i4", num_samples)
        self.sizes = self._map(directory / SIZES_FILE, "<i8", num_samples)
        offsets = self._map(directory / KEY_OFFSETS_FILE, "<i8", num_samples + 1)
        _check_offsets(offsets, directory / KEY_OFFSETS_FILE)
        blob = self._map(directory / KEYS_FILE, "u1", int(offsets[-1]))
        self.keys = KeyList(blob, offsets, directory / KEYS_FILE, digests)
        self.field_names = list(fields or [])
        self._field_offsets: np.ndarray | None = None
        self._field_pairs: np.ndarray | None = None
        if fields is not None:
            field_offsets = self._map(directory / FIELD_OFFSETS_FILE, "<i8", num_samples + 1)
            _check_offsets(field_offsets, directory / FIELD_OFFSETS_FILE)
            pairs = self._map(directory / FIELD_SIZES_FILE, "<i8", 2 * int(field_offsets[-1])).reshape(-1, 2)
            problem = field_pairs_problem(pairs, len(fields))
            if problem is not None:
                raise PackFormatError(problem, path=directory / FIELD_SIZES_FILE, hint=_AGAIN)
            self._field_offsets, self._field_pairs = field_offsets, pairs

    def sample_fields(self, index: int) -> dict[str, int]:
        """Field name -> byte length of sample ``index`` (empty for a pack without fields)."""
        if self._field_pairs is None or self._field_offsets is None:
            return {}
        rows = self._field_pairs[self._field_offsets[index] : self._field_offsets[index + 1]]
        return {self.field_names[int(number)]: int(size) for number, size in rows}

    def field_counts(self, chunk: int = 1 << 20) -> dict[str, int]:
        """Field name -> how many samples hold it (a sample names a field once), ``chunk`` rows at a time.

        Empty for a pack without fields. One pass over ``field_sizes.i64``, whose numbers were found in range.
        """
        if self._field_pairs is None:
            return {}
        counts = np.zeros(len(self.field_names), dtype=np.int64)
        for start in range(0, len(self._field_pairs), chunk):
            counts += np.bincount(self._field_pairs[start : start + chunk, 0], minlength=len(counts))
        return dict(zip(self.field_names, counts.tolist(), strict=True))

    def first_lacking(self, name: str, chunk: int = 1 << 20) -> int | None:
        """The first sample that lacks stored field ``name`` (``chunk`` samples at a time), or None when none does."""
        if self._field_pairs is None or self._field_offsets is None:
            return None
        number = self.field_names.index(name)
        for start in range(0, len(self._field_offsets) - 1, chunk):
            span = np.asarray(self._field_offsets[start : start + chunk + 1])
            owners = np.repeat(np.arange(len(span) - 1), np.diff(span))
            holds = np.zeros(len(span) - 1, dtype=bool)
            holds[owners[self._field_pairs[span[0] : span[-1], 0] == number]] = True
            if not holds.all():
                return start + int(np.argmin(holds))
        return None

    def field_sizes(self, name: str) -> np.ndarray:
        """Every sample's byte length of field ``name`` (-1 where a sample lacks it), as int64.

        Raises:
            KeyError: the pack has no field of that name.
        """
        if self._field_pairs is None or self._field_offsets is None or name not in self.field_names:
            raise KeyError(f"the pack has no field {name!r} (fields: {self.field_names})")
        counts = np.diff(np.asarray(self._field_offsets))
        owners = np.repeat(np.arange(len(counts)), counts)
        mask = np.asarray(self._field_pairs[:, 0]) == self.field_names.index(name)
        out = np.full(len(counts), -1, dtype=np.int64)
        out[owners[mask]] = self._field_pairs[mask, 1]
        return out

    @staticmethod
    def _map(path: Path, dtype: str, count: int) -> np.ndarray:
        expected = count * np.dtype(dtype).itemsize
        actual = path.stat().st_size
        if actual != expected:
            raise ValueError(f"{path}: {actual} bytes, expected {expected}")
        if count == 0:
            return np.zeros(0, dtype=dtype)
        # a plain ndarray over the map: np.memmap's Python-level hooks cost microseconds on every slice
        return np.memmap(path, dtype=dtype, mode="r", shape=(count,)).view(np.ndarray)


def field_pairs_problem(pairs: np.ndarray, num_fields: int) -> str | None:
    """What is out of range in ``(field number, byte length)`` rows of ``field_sizes.i64``, or None when nothing is.

    A number must index one of ``num_fields`` fields, a length must not be
    negative. Found with a min and a max per column: no copy of a mapped file.
    """
    if not len(pairs):
        return None
    low, high = int(pairs[:, 0].min()), int(pairs[:, 0].max())
    if low < 0 or high >= num_fields:
        fields = f"{num_fields} field" + ("" if num_fields == 1 else "s")
        return f"field number {low if low < 0 else high} is out of range for {fields}"
    if (shortest := int(pairs[:, 1].min())) < 0:
        return f"field size {shortest} is negative"
    return None


def field_file_problem(path: str | os.PathLike, num_fields: int, chunk: int = 1 << 20) -> str | None:
    """:func:`field_pairs_problem` over a ``field_sizes.i64`` file, ``chunk`` pairs at a time (flat memory)."""
    with open(path, "rb") as f:
        while len(values := np.fromfile(f, dtype="<i8", count=2 * chunk)):
            problem = field_pairs_problem(values[: len(values) // 2 * 2].reshape(-1, 2), num_fields)
            if problem is not None:
                return problem
    return None


def labels_out_of_range(labels: np.ndarray, num_classes: int, chunk: int = 1 << 20) -> tuple[int, int] | None:
    """The first sample whose label lies outside ``[-1, num_classes)`` and how many do, or None when none does.

    Checked in chunks of ``chunk`` labels: memory stays flat whatever count an
    index claims (a mapped file of 2**27 labels is never copied whole).
    """
    return _first_where(labels, lambda part: (part < -1) | (part >= num_classes), chunk)


def unlabelled(labels: np.ndarray, chunk: int = 1 << 20) -> tuple[int, int] | None:
    """The first sample without a label (-1: its ``cls`` field is missing) and how many, or None when every one has."""
    return _first_where(labels, lambda part: part < 0, chunk)


def _first_where(labels: np.ndarray, test: Callable[[np.ndarray], np.ndarray], chunk: int) -> tuple[int, int] | None:
    """The first label ``test`` marks and how many it marks, ``chunk`` labels at a time, or None for none."""
    first, count = -1, 0
    for start in range(0, len(labels), chunk):
        part = labels[start : start + chunk]
        bad = np.flatnonzero(test(part))
        if len(bad):
            first = start + int(bad[0]) if first < 0 else first
            count += len(bad)
    return (first, count) if count else None


def _check_offsets(offsets: np.ndarray, path: Path, chunk: int = 1 << 20) -> None:
    """Key offsets start at 0 and never decrease (checked in chunks: flat memory on huge packs)."""
    if len(offsets) and offsets[0] != 0:
        raise PackFormatError(
            f"the first key offset is {int(offsets[0])}, not 0", path=path, hint="Convert the pack again"
        )
    for start in range(0, len(offsets) - 1, chunk):
        part = np.asarray(offsets[start : start + chunk + 1])
        if (part[1:] < part[:-1]).any():
            raise PackFormatError("key offsets decrease", path=path, hint=_AGAIN)
