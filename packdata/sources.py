"""Walk a source folder deterministically into the files to pack.

ImageFolder rules, as torchvision applies them: every first-level subfolder is a
class, classes are sorted by name and numbered from 0, and files directly under
the root get label -1. Files are visited in sorted order at every level, so the
same folder always gives the same sample order. The walk is a generator: a
folder of 100 M files is never held in memory as one list.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from packdata.errors import SourceError

__all__ = [
    "IMAGE_EXTENSIONS",
    "TEXT_EXTENSIONS",
    "Skip",
    "Source",
    "SourceFile",
    "scan_source",
]

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"})
TEXT_EXTENSIONS = frozenset(
    {".txt", ".json", ".jsonl", ".md", ".csv", ".tsv", ".xml", ".html", ".yaml", ".yml", ".rst", ".text"}
)
_EXTENSIONS = {"image": IMAGE_EXTENSIONS, "text": TEXT_EXTENSIONS}


@dataclass(frozen=True)
class SourceFile:
    """One file to pack: its key (relative POSIX path), absolute path and label."""

    key: str
    path: str
    label: int


@dataclass(frozen=True)
class Skip:
    """A file left out: its key, the reason (a short category) and details."""

    key: str
    reason: str
    detail: str = ""


@dataclass
class Source:
    """A scanned source folder: its kind, classes, and a fresh walk on demand."""

    root: Path
    kind: str
    classes: list[str]
    _class_to_idx: dict[str, int] = field(repr=False, default_factory=dict)

    def walk(self) -> Iterator[SourceFile | Skip]:
        """Yield every entry under the root in sorted order: files to pack and skips."""
        extensions = _EXTENSIONS[self.kind]
        for rel, path in _walk_files(self.root):
            name = rel.rsplit("/", 1)[-1]
            if _is_hidden(rel):
                yield Skip(rel, "hidden")
                continue
            try:
                rel.encode("utf-8")
            except UnicodeEncodeError:
                yield Skip(_printable(rel), "name not UTF-8")
                continue
            if os.path.splitext(name)[1].lower() not in extensions:
                yield Skip(rel, f"not {self.kind}", f"extension is not one of the {self.kind} extensions")
                continue
            top = rel.split("/", 1)[0] if "/" in rel else None
            yield SourceFile(rel, path, self._class_to_idx[top] if top is not None else -1)


def _printable(rel: str) -> str:
    return rel.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _is_hidden(rel: str) -> bool:
    return any(part.startswith(".") for part in rel.split("/"))


def _walk_files(root: Path) -> Iterator[tuple[str, str]]:
    """Yield ``(relative POSIX path, absolute path)`` of every file, sorted, depth first."""
    seen: set[tuple[int, int]] = set()

    def visit(directory: str, prefix: str) -> Iterator[tuple[str, str]]:
        st = os.stat(directory)
        if (st.st_dev, st.st_ino) in seen:  # a symlink loop
            return
        seen.add((st.st_dev, st.st_ino))
        with os.scandir(directory) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            rel = prefix + entry.name
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False
            if is_dir:
                yield from visit(entry.path, rel + "/")
            else:
                yield rel, entry.path

    yield from visit(os.fspath(root), "")


def _detect_kind(root: Path) -> str:
    """'image' if the first files found are images, 'text' if text (sampling the walk)."""
    counts = {"image": 0, "text": 0}
    for n, (rel, _) in enumerate(_walk_files(root)):
        ext = os.path.splitext(rel)[1].lower()
        for kind, extensions in _EXTENSIONS.items():
            counts[kind] += ext in extensions
        if n >= 1000 and max(counts.values()) > 0:
            break
    if not any(counts.values()):
        raise SourceError(
            "no image or text files found",
            path=root,
            hint=f"Images are {', '.join(sorted(IMAGE_EXTENSIONS))}; text is {', '.join(sorted(TEXT_EXTENSIONS))}",
        )
    return max(counts, key=lambda k: counts[k])


def scan_source(root: str | os.PathLike, kind: str = "auto") -> Source:
    """Check a source folder and read its classes.

    Args:
        root: the folder to pack.
        kind: ``"image"``, ``"text"`` or ``"auto"`` (by the extensions found first).

    Raises:
        SourceError: the folder is missing, not a folder, unreadable or holds no
            file of the kind.
    """
    root = Path(root)
    if not root.exists():
        raise SourceError("no such folder", path=root, hint="Check the path")
    if not root.is_dir():
        raise SourceError("not a folder", path=root, hint="Pass the folder that holds the files")
    if not os.access(root, os.R_OK | os.X_OK):
        raise SourceError("folder is not readable", path=root, hint="Check its permissions")
    if kind == "auto":
        kind = _detect_kind(root)
    elif kind not in _EXTENSIONS:
        raise ValueError(f"kind should be 'image', 'text' or 'auto', but got kind={kind!r}")
    classes = sorted(
        entry.name
        for entry in os.scandir(root)
        if entry.is_dir() and not entry.name.startswith(".") and _has_candidate(Path(entry.path), kind)
    )
    return Source(root=root, kind=kind, classes=classes, _class_to_idx={c: i for i, c in enumerate(classes)})


def _has_candidate(directory: Path, kind: str) -> bool:
    extensions = _EXTENSIONS[kind]
    return any(
        os.path.splitext(rel)[1].lower() in extensions and not _is_hidden(rel) for rel, _ in _walk_files(directory)
    )
