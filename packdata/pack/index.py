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

The writer appends as samples are packed (memory stays flat whatever the
dataset size) and can be cut back to a committed count when a conversion resumes.

The manifest's ``index.sha256`` records each file's SHA-256 once the index is
final (:func:`index_digests`), so a flipped bit in ``labels.i32`` is named
(:func:`check_index_digests`) instead of read as another label.
"""

from __future__ import annotations

import hashlib
import os
import sys
from array import array
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import overload

import numpy as np

from packdata.errors import DAMAGED_PACK_HINT, PackFormatError
from packdata.pack.files import file_sha256, fsync_named

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
    "SampleIndexWriter",
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


def _resume_error(path: Path, what: str) -> PackFormatError:
    return PackFormatError(
        f"the interrupted conversion's sample index is damaged: {what}",
        path=path,
        hint="Start the conversion again with --overwrite",
    )


class SampleIndexWriter:
    """Appends keys, labels and sizes (and with ``fields=True``, field sizes) to the index of a pack being written."""

    def __init__(
        self,
        pack: str | os.PathLike,
        *,
        resume_at: int | None = None,
        fields: bool = False,
        kept: Mapping[str, Sequence[object]] | None = None,
    ) -> None:
        """``kept``: with ``resume_at``, what :meth:`checkpoint` returned at the checkpoint resumed (the files'
        sizes and SHA-256 then: the parts kept must still match them); None for a checkpoint that has none."""
        self.dir = Path(pack) / INDEX_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.count = 0
        self._key_end = 0
        self._field_end = 0
        self._names = FILES + (FIELD_FILES if fields else ())
        self._written = dict.fromkeys(self._names, 0)
        self._digests = {name: hashlib.sha256() for name in self._names}  # of the bytes written, as written
        if resume_at is not None:
            self._truncate(resume_at, fields, kept)
        self._files = {name: open(self.dir / name, "ab") for name in self._names}  # noqa: SIM115 (closed in close())
        self._keys: list[bytes] = []
        self._offsets, self._labels, self._sizes = array("q"), array("i"), array("q")
        self._field_offsets, self._field_sizes = array("q"), array("q")
        if self.count == 0 and self._files[KEY_OFFSETS_FILE].tell() == 0:
            self._offsets.append(0)
            if fields:
                self._field_offsets.append(0)

    def _truncate(self, n: int, fields: bool, kept: Mapping[str, Sequence[object]] | None) -> None:
        """Cut the files back to their first ``n`` samples, each kept part checked against ``kept`` when given."""
        sizes = {LABELS_FILE: 4 * n, SIZES_FILE: 8 * n, KEY_OFFSETS_FILE: 8 * (n + 1)}
        if fields:
            sizes[FIELD_OFFSETS_FILE] = 8 * (n + 1)
        if kept is None:  # a checkpoint of an earlier packdata: the offsets say where keys and field sizes end
            sizes[KEYS_FILE] = self._offset_at(KEY_OFFSETS_FILE, n)
            if fields:
                sizes[FIELD_SIZES_FILE] = 16 * self._offset_at(FIELD_OFFSETS_FILE, n)
        else:
            for name in self._names:
                entry = kept.get(name)
                if not (isinstance(entry, list | tuple) and len(entry) == 2 and type(entry[0]) is int):
                    raise _resume_error(self.dir / name, "the checkpoint does not record its size and SHA-256")
                if sizes.setdefault(name, entry[0]) != entry[0]:
                    raise _resume_error(self.dir / name, f"the checkpoint records {entry[0]} bytes for {n} samples")
        for name in self._names:
            path, size = self.dir / name, sizes[name]
            try:
                with open(path, "rb") as f:
                    while self._written[name] < size and (got := f.read(min(1 << 22, size - self._written[name]))):
                        self._digests[name].update(got)
                        self._written[name] += len(got)
            except FileNotFoundError:
                raise _resume_error(path, "it is missing") from None
            if self._written[name] != size:
                raise _resume_error(path, f"{self._written[name]} bytes, shorter than the {size} its checkpoint kept")
            if kept is not None and self._digests[name].hexdigest() != kept[name][1]:
                raise _resume_error(path, "its first bytes changed since the checkpoint (SHA-256 differs)")
            os.truncate(path, size)
        self._key_end = sizes[KEYS_FILE]
        self._field_end = sizes.get(FIELD_SIZES_FILE, 0) // 16
        self.count = n

    def _offset_at(self, name: str, n: int) -> int:
        path = self.dir / name
        offsets = np.fromfile(path, dtype="<i8") if path.exists() else np.zeros(1, "<i8")
        if len(offsets) < n + 1 or offsets[n] < 0:
            raise _resume_error(path, f"it holds {len(offsets) - 1} samples, or a bad offset: cannot resume at {n}")
        return int(offsets[n])

    def checkpoint(self) -> dict[str, list[object]]:
        """Each file's size and SHA-256 as flushed (a checkpoint records them; a resume checks them)."""
        return {name: [self._written[name], self._digests[name].hexdigest()] for name in self._names}

    def append(self, key: str, label: int, size: int, fields: list[tuple[int, int]] | None = None) -> None:
        """Add one sample's entry (``fields``: its ``(field number, byte length)`` pairs, in a fields index)."""
        if fields is not None:
            for number, length in fields:
                self._field_sizes.extend((number, length))
            self._field_end += len(fields)
            self._field_offsets.append(self._field_end)
        encoded = key.encode("utf-8")
        self._key_end += len(encoded)
        self._keys.append(encoded)
        self._offsets.append(self._key_end)
        self._labels.append(label)
        self._sizes.append(size)
        self.count += 1

    def flush(self) -> None:
        """Push everything appended so far to disk (before a checkpoint)."""
        blobs = [(KEYS_FILE, b"".join(self._keys))]
        columns = [(KEY_OFFSETS_FILE, self._offsets), (LABELS_FILE, self._labels), (SIZES_FILE, self._sizes)]
        if FIELD_SIZES_FILE in self._files:
            columns += [(FIELD_OFFSETS_FILE, self._field_offsets), (FIELD_SIZES_FILE, self._field_sizes)]
        for name, values in columns:
            if sys.byteorder != "little":
                values.byteswap()
            blobs.append((name, values.tobytes()))
            del values[:]
        for name, blob in blobs:
            self._files[name].write(blob)
            self._digests[name].update(blob)
            self._written[name] += len(blob)
        self._keys.clear()
        for f in self._files.values():
            f.flush()
            fsync_named(f.fileno(), f.name)

    def close(self) -> None:
        """Flush and close the files (safe to call twice)."""
        if not self._files[KEYS_FILE].closed:
            self.flush()
            for f in self._files.values():
                f.close()


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
