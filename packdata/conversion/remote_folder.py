"""A source folder in object storage (class folders), listed once and read in place through fsspec.

The Ray engine packs a folder at a URL without copying it: the driver lists it
once (:func:`list_folder`) and walks the listing in the order a local walk of
the same tree gives (names sorted at every level, depth first), so the pack
equals the one made from a local copy; each task reads its objects itself. An
object whose name has ``..``, ``.`` or empty parts is never read: it is a skip
(``unsafe name``), walked first, as :func:`~packdata.conversion.download.download_source`
reports it for the local engine. An object read with another size than
listed, or (where the listing gave one) at another version (ETag), was rewritten
since the listing: a skip (``changed``), as one removed since is (``vanished``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packdata.conversion.sources import _EXTENSIONS, RemoteFile, Skip, SourceFile, _is_hidden, listed_class
from packdata.errors import ConfigError, SourceError
from packdata.pack.images import IMAGE_EXTENSIONS
from packdata.pack.urls import (
    conditional_reads,
    display_url,
    object_version,
    open_url,
    precondition_failed,
    read_at_version,
    remote_error,
    retry_transient,
)

__all__ = [
    "RemoteFolder",
    "RemoteSourceFile",
    "list_folder",
    "scan_remote_folder",
    "unsafe_name_skip",
]

_KIND_SAMPLE = 1000  # objects looked at to tell images from text, as for a local folder


def unsafe_name_skip(rel: str) -> Skip:
    """The skip of an object whose name has ``..``, ``.`` or empty parts (never read, never written)."""
    return Skip(rel, "unsafe name", "'..', '.' or empty parts in the object name: not read")


def list_folder(
    url: str, storage_options: dict[str, Any] | None
) -> tuple[Any, str, list[tuple[str, str, int, str]], list[Skip]]:
    """List the objects under ``url`` once: ``(fs, root, [(path, name, size, version)], refused)``.

    ``name`` is the path relative to ``root`` (``cat/1.jpg``); entries are in
    the order a local walk of the same tree gives. ``version`` is what the
    store says changes whenever the object is written (its ETag, else its
    modification time), or ``""`` when it says nothing. Objects with unsafe
    names (``..``, ``.`` or empty parts, or the name of another's folder:
    ``cat/b`` beside ``cat/b/1.jpg``) are left out and returned as skips, sorted;
    empty folder markers (``cat/``, which a store lists as an object) are left
    out, as a local walk has no file there.

    Raises:
        SourceError: the URL cannot be listed or holds no object.
    """
    fs, root = open_url(url, storage_options)
    root = root.rstrip("/")
    shown = display_url(url)
    try:
        listing = retry_transient(lambda: fs.find(root, detail=True))  # a 503 mid-listing starts it again
    except Exception as exc:
        raise remote_error(shown, "cannot list the source", exc) from exc
    if not listing:
        raise SourceError(f"{shown}: no files there", hint="Check the URL")
    objects, refused = [], []
    for path, info in sorted(listing.items()):
        if info.get("type") == "directory" or path.rstrip("/") == root or _folder_marker(path, info):
            continue
        rel = path[len(root) + 1 :] if path.startswith(f"{root}/") else path
        if any(part in ("", ".", "..") for part in rel.split("/")):
            refused.append(unsafe_name_skip(rel))
            continue
        objects.append((path, rel, max(0, int(info.get("size") or 0)), object_version(info)))
    folders = _folders([rel for _, rel, _, _ in objects])
    if any(rel in folders for _, rel, _, _ in objects):  # cat/b beside cat/b/1.jpg: on disk, b is one or the other
        detail = "an object of this name is also the folder of others: a file on disk cannot be both; not read"
        refused += [Skip(rel, "unsafe name", detail) for _, rel, _, _ in objects if rel in folders]
        refused.sort(key=lambda skip: skip.key)
        objects = [item for item in objects if item[1] not in folders]
    objects.sort(key=lambda item: item[1].split("/"))  # depth first, names sorted at every level
    return fs, root, objects, refused


def _folders(names: list[str]) -> set[str]:
    """Every folder that object names imply: ``cat`` and ``cat/b`` for ``cat/b/1.jpg``."""
    folders: set[str] = set()
    for name in names:
        parts = name.split("/")
        folders.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return folders


def _folder_marker(path: str, info: dict[str, Any]) -> bool:
    """Whether an object is an empty ``name/`` that consoles and tools create to show a folder: no file, not listed."""
    return path.endswith("/") and not info.get("size")


@dataclass(frozen=True)
class _ListedObject(RemoteFile):
    """An object of a folder listing, read whole only as listed: one rewritten since is a skip (``changed``).

    With the version the listing gave (its ETag), S3 serves the bytes only
    while the object still has it (``If-Match``: no extra request); another
    store's object is looked up again after the read. One read with another
    size than listed is a skip too.
    """

    size: int = 0
    version: str = ""

    def _fetch(self, key: str) -> bytes | Skip:
        changed = Skip(key, "changed", "its version is not the one listed: rewritten since the listing")
        try:
            data = read_at_version(self.fs, self.path, self.version)
        except Exception as exc:
            if precondition_failed(exc):
                return changed
            raise
        if len(data) != self.size:
            return Skip(key, "changed", f"{len(data)} bytes, {self.size} when listed: rewritten since the listing")
        if self.version and not conditional_reads(self.fs):
            self.fs.invalidate_cache(self.path)
            if object_version(self.fs.info(self.path)) != self.version:
                return changed
        return data


@dataclass(frozen=True)
class RemoteSourceFile(SourceFile):
    """A file of a folder at a URL: read through fsspec (``remote``); ``size`` as listed."""

    remote: RemoteFile | None = None
    size: int = 0


@dataclass
class RemoteFolder:
    """A scanned class-folder source at a URL: its kind, classes, and a fresh walk of its listing on demand."""

    root: str  # the URL, without credentials
    kind: str
    classes: list[str]
    fs: Any = field(repr=False, default=None)
    objects: list[tuple[str, str, int, str]] = field(repr=False, default_factory=list)
    refused: list[Skip] = field(repr=False, default_factory=list)
    codecs: dict[str, str] = field(default_factory=dict)

    def walk(self, spill: Path | None = None) -> Iterator[RemoteSourceFile | Skip]:
        """The refused objects' skips, then every object in walk order: files to pack and skips."""
        yield from self.refused
        extensions = _EXTENSIONS[self.kind]
        labels = {name: number for number, name in enumerate(self.classes)}
        for path, rel, size, version in self.objects:
            if _is_hidden(rel):
                yield Skip(rel, "hidden", problem=False)
                continue
            if os.path.splitext(rel)[1].lower() not in extensions:
                yield Skip(
                    rel, f"not {self.kind}", f"extension is not one of the {self.kind} extensions", problem=False
                )
                continue
            label = labels[rel.split("/", 1)[0]] if "/" in rel else -1
            remote = _ListedObject(self.fs, path, f"{self.root}/{rel}", size, version)
            yield RemoteSourceFile(rel, path, label, remote=remote, size=size)


def scan_remote_folder(
    url: str, storage_options: dict[str, Any] | None, kind: str = "auto", layout: str = "auto"
) -> RemoteFolder:
    """List the class folders at ``url`` once and read their classes, as ``scan_source`` does for a local folder.

    Raises:
        SourceError: the URL cannot be listed, or holds no file of the kind.
        ConfigError: ``kind`` is unknown, or the folder holds grouped files (``layout``).
    """
    shown = display_url(url).rstrip("/")
    if layout == "grouped":
        raise _grouped_error(shown, "layout='grouped'")
    fs, _, objects, refused = list_folder(url, storage_options)
    names = [rel for _, rel, _, _ in objects]
    if layout == "auto" and kind == "auto":
        _refuse_grouped(names[: _KIND_SAMPLE + 1], shown)
    if kind == "auto":
        kind = _detect_kind(names, shown)
    elif kind not in _EXTENSIONS:
        raise ConfigError(f"kind should be 'image', 'text' or 'auto', but got kind={kind!r}")
    classes = sorted({top for _, rel, _, _ in objects if (top := listed_class(rel, kind)) is not None})
    return RemoteFolder(root=shown, kind=kind, classes=classes, fs=fs, objects=objects, refused=refused)


def _detect_kind(names: list[str], shown: str) -> str:
    """'image' if the first objects listed are images, 'text' if text (the local walk's rule)."""
    counts = {"image": 0, "text": 0}
    for n, name in enumerate(names):
        ext = os.path.splitext(name)[1].lower()
        for kind, extensions in _EXTENSIONS.items():
            counts[kind] += ext in extensions
        if n >= _KIND_SAMPLE and max(counts.values()) > 0:
            break
    if not any(counts.values()):
        raise SourceError(
            f"{shown}: no image or text files found",
            hint=f"Images are {', '.join(sorted(IMAGE_EXTENSIONS))}; text is {', '.join(sorted(_EXTENSIONS['text']))}",
        )
    return max(counts, key=lambda k: counts[k])


def _refuse_grouped(names: list[str], shown: str) -> None:
    """Refuse a folder that looks grouped (a stem with several files), as a local walk would detect it."""
    seen: set[str] = set()
    for name in names:
        if _is_hidden(name):
            continue
        folder, _, base = name.rpartition("/")
        stem, dot, _ = base.partition(".")
        if dot and f"{folder}/{stem}" in seen:
            raise _grouped_error(shown, f"{folder + '/' if folder else ''}{stem}.* are grouped files")
        if dot:
            seen.add(f"{folder}/{stem}")


def _grouped_error(shown: str, found: str) -> ConfigError:
    return ConfigError(
        f"{shown}: {found}; the Ray engine reads class folders at a URL in place, not grouped files",
        hint="Pass engine='local' (it copies the folder first), or layout='classes'",
    )
