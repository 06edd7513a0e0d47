"""Grouped files in folders as multi-field sources, and :data:`AnySource`, a scanned source of any layout.

Grouped files, like list files (CSV, TSV, JSONL; :mod:`packdata.conversion.lists`),
yield :class:`SourceGroup` entries (one per sample) in a deterministic order; the
read pool turns each into one multi-field sample
(:func:`packdata.conversion.load._load`).

- **Grouped files** (WebDataset's rule): files in one folder whose basenames
  share the part before the first dot form one sample, one field per
  remaining extension: ``0001.jpg`` + ``0001.json`` + ``0001.seg.png`` ->
  key ``0001``, fields ``jpg``, ``json``, ``seg.png`` (lower-cased, as
  WebDataset names them: ``0001.JPG`` gives ``jpg`` too). First-level subfolders
  are classes, as in ImageFolder; a ``cls`` file holds an integer label. A
  group with a file left unread (a FIFO, a name not UTF-8 past the key) is
  skipped whole, never packed without that field.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from packdata.conversion.lists import ListSource
from packdata.conversion.remote_folder import RemoteFolder
from packdata.conversion.sources import (
    Skip,
    Source,
    SourceGroup,
    _check_required,
    _is_hidden,
    _is_utf8,
    _printable,
    _utf8_name,
    _walk_files,
    new_class,
    walk_named,
)
from packdata.conversion.tars import TarSource
from packdata.pack.fields import FieldError, check_field_name
from packdata.pack.manifest import first_repeated

__all__ = [
    "AnySource",
    "GroupedSource",
    "detect_grouped",
    "scan_grouped",
]


_Member = tuple[str, str, "str | Skip"]
"""A file of a group: its name, its field, and its path (or the skip that left it unread)."""
_UNREAD_MEMBER = ("not a regular file", "name not UTF-8")
"""The walk's skips of a group's file (a folder's, such as 'unreadable folder', are no file of a group)."""


@dataclass
class GroupedSource:
    """A folder of grouped files (``--layout grouped``)."""

    root: Path
    classes: list[str]
    require: tuple[str, ...] = ()
    kind: str = "fields"
    codecs: dict[str, str] = field(default_factory=dict)
    lost: tuple[Skip, ...] = ()  # files of a folder at a URL not copied into root (changed or vanished): walked here

    def walk(self, spill: Path | None = None) -> Iterator[SourceGroup | Skip]:
        """Yield every group in sorted order, and skips.

        A group's files are contiguous in a sorted walk, except around a subfolder
        whose name starts with the group's key and a dot (``a.bin``, ``a.d/``,
        ``a.json``): the group stays open while that subfolder is walked, and is
        yielded once complete, never as two samples of one key. A file of a
        group left unread (a FIFO, a name not UTF-8 past the key) skips its
        group whole: a sample is never packed without one of its fields.
        """
        class_index = {c: i for i, c in enumerate(self.classes)}
        lost: dict[str, list[Skip]] = {}  # group key -> its files not copied
        for gone in self.lost:
            key = _group_key(gone.key)
            if key is None:
                yield gone
            else:
                lost.setdefault(key, []).append(gone)
        open_groups: list[tuple[str, str, list[_Member]]] = []  # (folder, key, files), deepest last
        for rel, path, skip in walk_named(self.root):
            folder, _, name = rel.rpartition("/")
            key = _group_key(rel)
            if skip is not None and not (key and skip.reason in _UNREAD_MEMBER):
                yield skip
                continue
            if not key:
                yield Skip(rel, "no field", "a grouped file is named KEY.FIELD (e.g. 0001.jpg)", problem=False)
                continue
            while open_groups and not _continues(open_groups[-1][1], folder, key):
                _, done, files = open_groups.pop()
                yield self._group(done, files, class_index, lost.pop(done, []))
            if not open_groups or open_groups[-1][1] != key:
                open_groups.append((folder, key, []))
            field_name = name.partition(".")[2].lower()  # as tars and lists name it
            open_groups[-1][2].append((name, field_name, skip or path))
        while open_groups:
            _, done, files = open_groups.pop()
            yield self._group(done, files, class_index, lost.pop(done, []))
        for skips in lost.values():  # a group none of whose files was copied
            yield from skips

    def _group(
        self, key: str, files: list[_Member], class_index: dict[str, int], lost: list[Skip]
    ) -> SourceGroup | Skip:
        top = key.split("/", 1)[0] if "/" in key else None
        if top is not None and top not in class_index:
            return Skip(key, *new_class(top))
        label = class_index[top] if top is not None else -1
        if lost:  # files left out of the copy: the sample would lack their fields
            gone = ", ".join(f"'{skip.key.rpartition('/')[2]}' ({skip.reason}: {skip.detail})" for skip in lost)
            return Skip(key, lost[0].reason, f"not copied from the source: {gone}; the sample is skipped whole")
        for name, _, read in files:
            if isinstance(read, Skip):  # the sample would lack that field: skipped whole, as a tar's
                what = f" ({read.detail})" if read.detail else ""  # the reason comes first: 'not a regular file: ...'
                detail = f"file '{_printable(name)}'{what} is left unread: the sample is skipped whole"
                return Skip(key, read.reason, detail)
        names = [given for _, given, _ in files]
        twice = first_repeated(names)
        if twice is not None:  # a.jpg and a.JPG: neither is the sample's one jpg
            both = [name for name, given, _ in files if given == twice]
            return Skip(key, "duplicate field", f"files {' and '.join(both)} both give field {twice!r}")
        missing = [name for name in self.require if name not in names]
        if missing:
            return Skip(key, "missing field", f"no {', '.join(missing)} file (required: {', '.join(self.require)})")
        for name, given, _ in files:
            try:
                check_field_name(given)
            except FieldError as exc:
                return Skip(key, "bad field name", f"file {name!r}: {exc}")
        return SourceGroup(key, label, tuple((given, cast("str", path)) for _, given, path in files), walked=True)


def _group_key(rel: str) -> str | None:
    """The key of the group file ``rel`` belongs to (its path up to the name's first dot), or None: no ``KEY.`` name.

    A hidden name has none (it starts with a dot), nor does a key not in UTF-8.
    """
    folder, _, name = rel.rpartition("/")
    stem, dot, _ = name.partition(".")
    key = f"{folder}/{stem}" if folder else stem
    return key if dot and stem and _is_utf8(key) else None


def _continues(key: str, folder: str, next_key: str) -> bool:
    """Whether group ``key`` may still get files once the walk is at ``next_key`` (a file in ``folder``).

    Yes for its own key, and inside a subfolder named ``STEM.*`` beside it, after which its files go on.
    """
    return next_key == key or f"{folder}/".startswith(f"{key}.")


def detect_grouped(root: Path, sample: int = 1000) -> bool:
    """Whether a folder looks grouped: some stem in one folder has files of two or more extensions."""
    seen: dict[str, int] = {}
    for n, (rel, _, problem) in enumerate(_walk_files(root)):
        if problem is not None or _is_hidden(rel):
            continue
        folder, _, name = rel.rpartition("/")
        stem, dot, _ = name.partition(".")
        if dot:
            key = f"{folder}/{stem}"
            seen[key] = seen.get(key, 0) + 1
            if seen[key] >= 2:
                return True
        if n >= sample:
            break
    return False


def scan_grouped(root: Path, require: tuple[str, ...] = ()) -> GroupedSource:
    """A grouped source over ``root``: first-level subfolders are classes (sorted, numbered from 0).

    ``require`` names fields in any case (``JPG`` is ``jpg``): a grouped file's field is its extension lower-cased.
    """
    names = [_utf8_name(e.name) for e in os.scandir(root) if e.is_dir() and not e.name.startswith(".")]
    classes = sorted(name for name in names if _is_utf8(name))
    _check_required(require)
    return GroupedSource(root=root, classes=classes, require=tuple(name.lower() for name in require))


AnySource = Source | GroupedSource | ListSource | TarSource | RemoteFolder
"""A scanned source of any layout: a walk of entries, classes, kind and field codecs."""
