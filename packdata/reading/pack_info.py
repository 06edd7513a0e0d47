"""What every pack dataset shares about its pack: the manifest, classes, the sample index and the pack's generation.

:class:`PackInfo` reads the manifest and memory-maps the index lazily in each
process, holds a staged copy's readers' lock, and tells a reader when the pack
was replaced since the dataset opened it.
"""

from __future__ import annotations

import hashlib
import os
import weakref
from pathlib import Path
from typing import Any

from packdata.errors import DAMAGED_PACK_HINT, PackFormatError
from packdata.pack.files import file_sha256
from packdata.pack.index import (
    FIELD_FILES,
    LABELS_FILE,
    SampleIndex,
    damaged_index_file,
    labels_out_of_range,
)
from packdata.pack.lock import copy_evicted, hold_readers_lock
from packdata.pack.manifest import MANIFEST_NAME, Manifest, check_field_counts, read_manifest

__all__ = ["PackInfo"]


class PackInfo:
    """What every pack dataset shares: the manifest, classes and the sample index.

    The index (labels, keys, sizes) is memory-mapped on first use in each
    process and dropped when pickled, so workers share its pages with the page
    cache instead of each holding a copy.

    The pack generation is pinned at construction: the identity of the
    ``manifest.json`` read (device, inode, size, mtime). Convert and stage
    replace the manifest whenever they replace a pack, so
    :meth:`check_unchanged`, called by readers after they open a shard, tells a
    reader that would read a newer pack than its manifest and index describe.

    A staged copy is locked against eviction, unstage and replacement for as
    long as this object lives: a shared ``flock`` on its ``.readers.lock`` taken here, in
    the process that opens the dataset, inherited by forked workers, and taken
    again lazily (at the first shard a reader opens) in a ``spawn``-ed one; the
    descriptor is dropped when pickled and closed when the object is garbage
    collected. A pack without that file, or whose file cannot be opened or
    locked, is read unlocked as before and nothing is created in it (see
    :func:`packdata.pack.lock.hold_readers_lock`).
    """

    def __init__(self, path: str | os.PathLike, expected_format: str | None = None) -> None:
        self.path = Path(path)
        self._generation = _manifest_identity(self.path)
        self.manifest: Manifest = read_manifest(self.path)
        self._locked_in = -1  # the pid that took (or tried) the readers' lock; forked children inherit it
        self._staged = self._hold_readers_lock()
        if _manifest_identity(self.path) != self._generation:
            raise PackFormatError("pack was replaced while it was being opened", path=self.path, hint="Open it again")
        if expected_format and self.manifest.format != expected_format:
            from packdata.reading.open import datasets_for  # imported here: open.py imports the datasets

            raise PackFormatError(
                f"pack is in {self.manifest.format} format, not {expected_format}",
                path=self.path,
                hint=f"Open it with {datasets_for(self.manifest.format)}, or with packdata.open_dataset, "
                "which picks the dataset by the pack's format",
            )
        self.classes: list[str] = list(self.manifest.classes)
        self.class_to_idx: dict[str, int] = {c: i for i, c in enumerate(self.classes)}
        self._index: SampleIndex | None = None

    def _hold_readers_lock(self) -> bool:
        """Take this process's shared lock on a staged copy's ``.readers.lock``; whether there is one to hold."""
        self._locked_in = os.getpid()
        fd = hold_readers_lock(self.path)
        if fd is None:
            return False
        weakref.finalize(self, os.close, fd)  # released with the last process holding this descriptor
        return True

    def check_unchanged(self) -> None:
        """Raise if the pack's manifest is no longer the one this object read (the pack changed).

        In a ``spawn``-ed worker of a staged copy, the first call takes the worker's readers' lock.

        Raises:
            PackFormatError: the pack was converted or staged again since, or its staged copy was evicted.
        """
        if self._staged and self._locked_in == -1:
            self._hold_readers_lock()
        identity = _manifest_identity(self.path)
        if identity is None and self._staged:
            raise copy_evicted(self.path)
        if identity != self._generation and self._grown_by_append():
            self._generation = identity  # an append kept every shard and index file this dataset reads
        if identity != self._generation:
            raise PackFormatError(
                "pack changed since the dataset was opened (its manifest was replaced); "
                "reading on would mix two generations of the pack",
                path=self.path / MANIFEST_NAME,
                hint="Recreate the dataset (and its DataLoader) after converting or staging a pack again",
            )

    def _grown_by_append(self) -> bool:
        """Whether the pack's current manifest is this one's with shards appended (this one's index kept)."""
        try:
            current = read_manifest(self.path)
        except PackFormatError:
            return False
        mine = self.manifest
        return (
            current.shards[: len(mine.shards)] == mine.shards
            and mine.index_dir in (current.index_dir, current.index.get("previous"))
            and current.format == mine.format
        )

    def check_labels(self) -> None:
        """Raise unless ``labels.i32`` matches its SHA-256 in the manifest and each label is in ``[-1, len(classes))``.

        One pass over the mapped labels (4 bytes a sample), in the process that
        opens the dataset: a flipped bit would otherwise read as another label.
        A pack written before the manifest recorded index digests is checked for range only.

        Raises:
            PackFormatError: naming ``labels.i32`` when it is damaged, or the
                first sample whose label is out of range.
        """
        labels = self.index.labels
        path = self.path / self.manifest.index_dir / LABELS_FILE
        expected = self.manifest.index_sha256.get(LABELS_FILE)
        if expected is not None and hashlib.sha256(labels.data).hexdigest() != expected:
            hint = f"The sample index is damaged. {DAMAGED_PACK_HINT}"
            raise damaged_index_file(path, hint=hint)
        bad = labels_out_of_range(labels, len(self.classes))
        if bad is not None:
            i, count = bad
            raise PackFormatError(
                f"sample {i} has label {int(labels[i])}, outside [-1, {len(self.classes)}) for "
                f"{len(self.classes)} classes ({count} samples out of range)",
                path=path,
                hint="The sample index is damaged or does not belong to this manifest: convert the pack again",
            )

    def field_counts(self) -> dict[str, int]:
        """Field name -> how many samples hold it, by the sample index (one pass over its field pairs).

        Raises:
            PackFormatError: the manifest's ``field_counts`` (when it has them)
                are not the index's: naming a damaged index file, else the manifest.
        """
        counts = self.index.field_counts()
        if self.manifest.field_counts and counts != self.manifest.field_counts:
            for name in FIELD_FILES:  # a damaged index is named as itself, not as a lying manifest
                self.check_index_file(name)
            check_field_counts(self.manifest, counts, self.path / MANIFEST_NAME)
        return counts

    def check_index_file(self, name: str) -> None:
        """Raise unless index file ``name`` (``sizes.i64``, ``field_sizes.i64``, ...) matches its manifest SHA-256.

        One pass over the file, for what reads it whole (a sampler's sample
        sizes): a flipped bit would otherwise read as another size. A pack
        written before the manifest recorded index digests is not checked.

        Raises:
            PackFormatError: naming the file.
        """
        expected = self.manifest.index_sha256.get(name)
        path = self.path / self.manifest.index_dir / name
        try:
            matches = expected is None or file_sha256(path) == expected
        except OSError as exc:
            raise PackFormatError(f"sample index file {name} is unreadable: {exc.strerror}", path=path) from exc
        if not matches:
            raise damaged_index_file(path, hint="The sample index is damaged: run `packdata verify` on the pack")

    @property
    def index(self) -> SampleIndex:
        """The memory-mapped sample index of this pack."""
        if self._index is None:
            directory = self.path / self.manifest.index_dir
            try:
                fields = self.manifest.fields if self.manifest.kind == "fields" else None
                self._index = SampleIndex(directory, self.manifest.num_samples, fields, self.manifest.index_sha256)
            except (OSError, ValueError) as exc:
                raise PackFormatError(
                    f"sample index is missing or damaged: {exc}", path=directory, hint="Convert the pack again"
                ) from exc
        return self._index

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_index"] = None
        state["_locked_in"] = -1  # the process that unpickles it takes its own readers' lock
        return state


def _manifest_identity(pack: Path) -> tuple[int, int, int, int] | None:
    """Device, inode, size and mtime of a pack's manifest: which generation of the pack is there."""
    try:
        st = os.stat(pack / MANIFEST_NAME)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns
