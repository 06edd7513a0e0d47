"""Walk a source folder deterministically into the files to pack.

ImageFolder rules, as torchvision applies them: every first-level subfolder is a
class, classes are sorted by name and numbered from 0, and files directly under
the root get label -1. Files are visited in sorted order at every level, so the
same folder always gives the same sample order. The walk is a generator: a
folder of 100 M files is never held in memory as one list. Names are read as
UTF-8 whatever the locale, so a folder gives the same keys and classes on every machine.
"""

from __future__ import annotations

import codecs
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from packdata.errors import ConfigError, SourceError
from packdata.pack.fields import FieldError, check_field_name
from packdata.pack.files import file_kind
from packdata.pack.images import IMAGE_EXTENSIONS
from packdata.pack.records import MAX_SAMPLE_BYTES
from packdata.pack.urls import remote_error, retry_transient

__all__ = [
    "FREE_CLASSES",
    "IMAGE_EXTENSIONS",
    "TEXT_EXTENSIONS",
    "RemoteFile",
    "Skip",
    "Source",
    "SourceFile",
    "SourceGroup",
    "listed_class",
    "new_class",
    "scan_source",
    "walk_named",
    "walk_record",
    "with_classes",
]

TEXT_EXTENSIONS = frozenset(
    {".txt", ".json", ".jsonl", ".md", ".csv", ".tsv", ".xml", ".html", ".yaml", ".yml", ".rst", ".text"}
)
_EXTENSIONS = {"image": IMAGE_EXTENSIONS, "text": TEXT_EXTENSIONS}

FREE_CLASSES = 1 << 20
"""Integer labels name classes 0..N, one manifest entry each, so a label claims memory: a label a source
gives as a number (a ``cls`` file or tar member, a list's label column) may reach this many classes (a
list's: or as many as it has rows); a larger one is a "bad label" skip."""


@dataclass(frozen=True)
class SourceFile:
    """One file to pack: its key (relative POSIX path), absolute path and label."""

    key: str
    path: str
    label: int


@dataclass(frozen=True)
class RemoteFile:
    """A file in object storage that a list at a URL names, read in the read pool through fsspec."""

    fs: Any
    path: str  # on fs
    shown: str  # its URL without credentials, for messages

    def read(self, key: str) -> bytes | Skip:
        """The object's bytes, or why sample ``key`` is skipped (no such object, a folder, access denied).

        A transient failure (a dropped connection, a timeout, a 5xx reply) is
        tried again with backoff (:func:`~packdata.pack.urls.retry_transient`).

        Raises:
            SourceError: any other failure of the request (resumable: a rerun
                with ``resume`` continues, rather than skip a file on a transient failure).
        """
        try:
            return retry_transient(partial(self._fetch, key))
        except FileNotFoundError:
            return Skip(key, "vanished", "no such object: removed since the list named it, or never there")
        except IsADirectoryError:
            return Skip(key, "not a regular file", "a folder, not an object")
        except PermissionError:
            return Skip(key, "unreadable", "access denied (PermissionError)")
        except Exception as exc:
            raise remote_error(self.shown, "cannot read the file; rerun with resume", exc, resumable=True) from exc

    def _fetch(self, key: str) -> bytes | Skip:
        """The object's bytes, or why sample ``key`` is skipped: one try."""
        return bytes(self.fs.cat_file(self.path))


@dataclass(frozen=True)
class SourceGroup:
    """One multi-field sample to read: key, label (-1: none), fields from files and fields given inline."""

    key: str
    label: int
    files: tuple[tuple[str, str | RemoteFile], ...]
    values: tuple[tuple[str, bytes], ...] = ()  # fields already in memory (list columns, tar members)
    origin: str | RemoteFile = ""  # the tar its members were read from ("" elsewhere): a resume probes it
    walked: bool = False  # its files were found regular by a folder's walk (a list's rows were not: stat before open)


@dataclass(frozen=True)
class Skip:
    """A file left out: its key, the reason (a short category) and details.

    ``problem`` is False only for files the walk leaves out by rule (hidden
    names, other extensions, names that are not UTF-8); a problem (a file that
    cannot be read, a FIFO, an unlistable folder, a link loop) is listed in
    ``skip_examples`` and stops a conversion run with ``on_error="fail"``.
    """

    key: str
    reason: str
    detail: str = ""
    problem: bool = True


def too_large(size: int) -> tuple[str, str]:
    """The skip reason and detail of a sample of ``size`` bytes, over :data:`MAX_SAMPLE_BYTES`."""
    return "too large", f"{size} bytes; a sample holds at most {MAX_SAMPLE_BYTES} (2 GiB less 1 MiB)"


def new_class(folder: str) -> tuple[str, str]:
    """The skip reason and detail of a file under ``folder``, a first-level folder that was no class when scanned.

    A folder made (or given its first file to pack) after the scan, while the
    walk ran: it has no class number, and is never given another class's.
    """
    detail = f"folder {folder!r} was not there, or held no file to pack, when the classes were read"
    return "not a class", f"{detail}: convert again to pack it"


@dataclass
class Source:
    """A scanned source folder: its kind, classes, and a fresh walk on demand."""

    root: Path
    kind: str
    classes: list[str]
    codecs: dict[str, str] = field(default_factory=dict)  # single-field sources name no field codecs
    _class_to_idx: dict[str, int] = field(repr=False, default_factory=dict)

    def walk(self, spill: Path | None = None) -> Iterator[SourceFile | Skip]:
        """Yield every entry under the root in sorted order: files to pack and skips."""
        extensions = _EXTENSIONS[self.kind]
        for rel, path, skip in walk_named(self.root):
            if skip is not None:
                yield skip
                continue
            if _extension(rel) not in extensions:
                yield Skip(
                    rel, f"not {self.kind}", f"extension is not one of the {self.kind} extensions", problem=False
                )
                continue
            top = rel.split("/", 1)[0] if "/" in rel else None
            if top is not None and top not in self._class_to_idx:
                yield Skip(rel, *new_class(top))
                continue
            yield SourceFile(rel, path, self._class_to_idx[top] if top is not None else -1)


def _printable(rel: str) -> str:
    """A name with bytes that are not UTF-8, each such byte written ``\\xNN``: findable, as `ls -b` prints it."""
    return rel.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


_UTF8_NAMES = codecs.lookup(sys.getfilesystemencoding()).name == "utf-8"


def _utf8_name(name: str) -> str:
    """A file name as its bytes read in UTF-8, as on a machine whose locale is UTF-8 (the key: the same everywhere).

    Python decodes names in the locale's encoding: under ASCII (``LC_ALL=C``
    with ``PYTHONUTF8=0``) ``café.jpg`` read as a name not in UTF-8, and under
    Latin-1 as ``cafÃ©.jpg``. Bytes that are not UTF-8 stay surrogates.
    """
    return name if _UTF8_NAMES else os.fsencode(name).decode("utf-8", "surrogateescape")


def _os_path(text: str) -> str:
    """The path to open for ``text``, a path a list names in UTF-8: its bytes as the locale decodes them."""
    return text if _UTF8_NAMES else os.fsdecode(text.encode("utf-8"))


def _is_utf8(name: str) -> bool:
    """False for a name with bytes that are not UTF-8 (decoded by the OS as surrogates)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_hidden(rel: str) -> bool:
    """True when a part of ``rel`` starts with a dot."""
    return rel.startswith(".") or "/." in rel


def listed_class(rel: str, kind: str) -> str | None:
    """The class folder a listed file ``rel`` gives a class-folder source of ``kind``, or None where it gives none."""
    top, _, rest = rel.partition("/")
    if not rest or top.startswith(".") or _is_hidden(rest) or _extension(rest) not in _EXTENSIONS[kind]:
        return None
    return top


def _extension(rel: str) -> str:
    """The lowercased extension of ``rel``'s last part, as ``os.path.splitext`` finds it."""
    name = rel[rel.rfind("/") + 1 :].lstrip(".")
    dot = name.rfind(".")
    return name[dot:].lower() if dot > 0 else ""


def walk_named(root: Path) -> Iterator[tuple[str, str, Skip | None]]:
    """Every entry under ``root`` in sorted order as ``(rel, path, skip)``.

    ``skip`` is None for a file to read, else why it is left out: hidden, name not UTF-8, or unreadable
    (``"not a regular file"`` for a file; a folder's own reasons for a folder).
    """
    for rel, path, problem in _walk_files(root):
        if _is_hidden(rel):
            yield rel, path, Skip(rel, "hidden", problem=False)
        elif not _is_utf8(rel):
            yield rel, path, Skip(_printable(rel), "name not UTF-8", problem=False)
        else:
            yield rel, path, None if problem is None else Skip(rel, *problem)


def _walk_files(root: Path) -> Iterator[tuple[str, str, tuple[str, str] | None]]:
    """Yield ``(relative POSIX path, absolute path, problem)`` of every entry, sorted, depth first.

    ``problem`` is None for a regular file (or a link to one) and otherwise a
    ``(reason, detail)`` pair: a FIFO, device or socket (never opened), a
    subfolder that cannot be listed, or a second path to a folder
    already walked (a link to it, or a link loop). A link to a folder inside
    ``root`` is never walked (the folder is, at its real path); links leading
    outside ``root`` are followed, and each folder is walked once.

    Raises:
        SourceError: ``root`` itself cannot be listed.
    """
    seen: dict[tuple[int, int], str] = {}
    path_to: set[tuple[int, int]] = set()  # the folders from the root down to the one being walked
    folders: list[tuple[Iterator[os.DirEntry[str]], str, tuple[int, int]]] = []  # a stack, not recursion: any depth

    def enter(directory: str, prefix: str) -> tuple[str, str, tuple[str, str]] | None:
        """Start walking a folder (its entries sorted), or the entry that says why it is not walked."""
        try:
            st = os.stat(directory)
            with os.scandir(directory) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            if not prefix:
                raise SourceError(
                    f"cannot list the folder: {exc.strerror or exc}", path=directory, hint="Check its permissions"
                ) from exc
            return prefix.rstrip("/"), directory, ("unreadable folder", exc.strerror or str(exc))
        ident = (st.st_dev, st.st_ino)
        if ident in seen:
            first = seen[ident] or "."
            if ident in path_to:
                return prefix.rstrip("/"), directory, ("symlink loop", f"leads back to folder {first!r}")
            return prefix.rstrip("/"), directory, ("duplicate folder", f"same folder as {first!r}, walked once")
        seen[ident] = prefix.rstrip("/")
        path_to.add(ident)
        folders.append((iter(entries), prefix, ident))
        return None

    real_root = os.path.realpath(root)
    enter(os.fspath(root), "")
    while folders:
        entries, prefix, ident = folders[-1]
        for entry in entries:
            rel = prefix + _utf8_name(entry.name)
            try:
                is_dir = entry.is_dir()
                is_file = not is_dir and entry.is_file()
            except OSError:
                is_dir = is_file = False
            if is_dir and entry.is_symlink():
                target = os.path.realpath(entry.path)
                if target == real_root or target.startswith(real_root.rstrip(os.sep) + os.sep):
                    st = os.stat(target)
                    reason = "symlink loop" if (st.st_dev, st.st_ino) in path_to else "duplicate folder"
                    inside = os.path.relpath(target, real_root)
                    yield rel, entry.path, (reason, f"link to the source's folder {inside!r}, walked there")
                    continue
            if is_dir:
                problem = enter(entry.path, rel + "/")
                if problem is None:
                    break  # into the subfolder; this folder's walk goes on after it
                yield problem
            elif is_file or (entry.is_symlink() and not os.path.exists(entry.path)):
                yield rel, entry.path, None  # a broken link is left to the read, which reports it unreadable
            else:
                yield rel, entry.path, ("not a regular file", _file_type(entry.path))
        else:  # this folder is done
            folders.pop()
            path_to.discard(ident)


def _file_type(path: str) -> str:
    """What a non-regular entry is, in words (from ``stat``; never opens it)."""
    try:
        return file_kind(os.stat(path).st_mode)
    except OSError as exc:
        return exc.strerror or str(exc)


def _detect_kind(root: Path) -> str:
    """'image' if the first files found are images, 'text' if text (sampling the walk)."""
    counts = {"image": 0, "text": 0}
    unlisted, first = 0, ""  # folders that could not be listed, which may hold the files, and the first of them
    for n, (rel, _, problem) in enumerate(_walk_files(root)):
        if problem is not None:
            if problem[0] == "unreadable folder":
                unlisted, first = unlisted + 1, first or f"{rel!r}: {problem[1]}"
            continue
        ext = os.path.splitext(rel)[1].lower()
        for kind, extensions in _EXTENSIONS.items():
            counts[kind] += ext in extensions
        if n >= 1000 and max(counts.values()) > 0:
            break
    if not any(counts.values()) and unlisted:
        folders = f"{unlisted:,} folders" if unlisted > 1 else "1 folder"
        raise SourceError(
            f"no image or text files found, and {folders} could not be listed ({first})",
            path=root,
            hint="Check the folders' permissions, or convert as a user who may read them",
        )
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
        raise SourceError(
            f"is {_file_type(os.fspath(root))}, not a folder",
            path=root,
            hint="Pass the folder that holds the files, a list file (.csv, .tsv or .jsonl) or WebDataset tar shards "
            "(.tar, .tar.gz or .tgz)",
        )
    if not os.access(root, os.R_OK | os.X_OK):
        raise SourceError("folder is not readable", path=root, hint="Check its permissions")
    if kind == "auto":
        kind = _detect_kind(root)
    elif kind not in _EXTENSIONS:
        raise ConfigError(f"kind should be 'image', 'text' or 'auto', but got kind={kind!r}")
    classes = sorted(  # a folder whose name is not UTF-8 is no class: the walk skips its files by name
        _utf8_name(entry.name)
        for entry in os.scandir(root)
        if entry.is_dir()
        and not entry.name.startswith(".")
        and _is_utf8(_utf8_name(entry.name))
        and _has_candidate(Path(entry.path), kind)
    )
    return Source(root=root, kind=kind, classes=classes, _class_to_idx={c: i for i, c in enumerate(classes)})


def with_classes(source: Source, listed: set[str]) -> Source:
    """``source``, its classes united with ``listed`` (classes whose files all went missing keep their labels)."""
    classes = sorted({*source.classes, *listed})
    return Source(source.root, source.kind, classes, source.codecs, {c: i for i, c in enumerate(classes)})


def _has_candidate(directory: Path, kind: str) -> bool:
    extensions = _EXTENSIONS[kind]
    try:
        return any(
            os.path.splitext(rel)[1].lower() in extensions and not _is_hidden(rel) and problem is None
            for rel, _, problem in _walk_files(directory)
        )
    except SourceError:  # the class folder cannot be listed: the walk reports it
        return False


def walk_record(entry: SourceFile | SourceGroup | Skip) -> bytes:
    """What a resume compares of one walked entry: its key, the label the walk gave it, a group's fields.

    The label is a list's column (a class folder's is in the key); a group's
    fields are the names of its files and the values a list gives inline. A
    source edited after an interruption (a row relabelled among the same
    classes, a caption changed, a field file added) no longer matches what the
    packed part of the walk was. Every part is length-prefixed: no two walks give the same bytes.
    """
    parts = [entry.key.encode("utf-8", "surrogateescape")]
    if not isinstance(entry, Skip):
        parts.append(b"%d" % entry.label)
    if isinstance(entry, SourceGroup):
        parts.append(b"%d" % len(entry.files))
        parts += [name.encode("utf-8", "surrogateescape") for name, _ in entry.files]
        for name, value in entry.values:
            parts += [name.encode("utf-8", "surrogateescape"), value]
    return b"".join(b"%d:%s" % (len(part), part) for part in parts) + b"\n"


def _check_required(require: tuple[str, ...]) -> None:
    """Refuse a name in ``require`` that cannot name a field (a raw FieldError reached the CLI).

    Raises:
        ConfigError: naming it.
    """
    for name in require:
        try:
            check_field_name(name)
        except FieldError as exc:
            raise ConfigError(
                f"require=FIELDS names no field: {exc}", hint="Name fields as file names end: jpg,json"
            ) from exc
