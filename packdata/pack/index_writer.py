"""The sample index's writer: keys, labels and sizes appended as samples are packed (:mod:`packdata.pack.index`).

Memory stays flat whatever the dataset size: each :meth:`SampleIndexWriter.flush`
appends what was added since to the files, whose sizes and SHA-256s
:meth:`~SampleIndexWriter.checkpoint` reports; a resumed conversion cuts them back
to a committed count, the kept bytes checked against the checkpoint's digests.
"""

from __future__ import annotations

import hashlib
import os
import sys
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from packdata.errors import PackFormatError
from packdata.pack.files import fsync_named
from packdata.pack.index import (
    FIELD_FILES,
    FIELD_OFFSETS_FILE,
    FIELD_SIZES_FILE,
    FILES,
    INDEX_DIR,
    KEY_OFFSETS_FILE,
    KEYS_FILE,
    LABELS_FILE,
    SIZES_FILE,
)

__all__ = ["SampleIndexWriter"]


def _resume_error(path: Path, what: str) -> PackFormatError:
    return PackFormatError(
        f"the interrupted conversion's sample index is damaged: {what}",
        path=path,
        hint="Start the conversion again with overwrite=True",
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
