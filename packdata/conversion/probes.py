"""Resume probes: what a checkpoint records of a few files packed, for a resume to find them rewritten since.

A probe is ``[absolute path, size, mtime_ns]`` of a local file (a resume stats
it, never opens it), or ``[URL, size, version]`` of an object a list at a URL
names (a resume asks the store for it, through the source's filesystem).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from packdata.conversion.publish import is_count
from packdata.conversion.remote_folder import RemoteSourceFile
from packdata.conversion.sources import RemoteFile, Skip, SourceFile, SourceGroup
from packdata.errors import SourceError
from packdata.pack.urls import is_url, remote_object

__all__ = [
    "REWRITTEN",
    "check_probes",
    "is_probe",
    "probe_path",
    "probe_place",
    "refuse_changed",
    "refuse_copied_again",
    "remote_lookup",
    "stat_probe",
]

Lookup = Callable[[str], "tuple[int, str] | None"]
"""An object's ``(size, version)`` now, by its URL (None: no such object)."""

_HINT = "Restore it as it was and resume, or start again with overwrite=True"
REWRITTEN = "an object packed before the interruption was rewritten at the URL since ({})"
"""The refusal of an object packed and rewritten since, with what differs."""


def probe_path(entry: SourceFile | SourceGroup | Skip) -> str | RemoteFile | None:
    """What a probe of ``entry`` looks at: its local file (a group's first, a tar member's tar) or a list's object.

    None for an object of a folder at a URL (read in place by the Ray engine:
    its task's fingerprint holds its version) and for a skip.
    """
    if isinstance(entry, SourceFile) and not isinstance(entry, RemoteSourceFile):
        return entry.path
    if isinstance(entry, SourceGroup):
        return next((source for _, source in entry.files), entry.origin or None)
    return None


def probe_place(path: str | RemoteFile) -> str:
    """What a probe of ``path`` names: the file's absolute path, or the object's URL."""
    return path.shown if isinstance(path, RemoteFile) else os.path.abspath(path)


def stat_probe(path: str | RemoteFile) -> list[Any] | None:
    """The probe of ``path`` as it is now (see the module docstring), or None where it is gone or cannot be asked."""
    if isinstance(path, RemoteFile):
        try:
            found = remote_object(path.fs, path.path, path.shown)
        except Exception:  # a probe never stops a conversion: the read of the object says what failed
            return None
        return None if found is None else [probe_place(path), *found]
    try:
        st = os.stat(path)
    except OSError:  # the walk, or the skip report, will say
        return None
    return [probe_place(path), st.st_size, st.st_mtime_ns]


def remote_lookup(source: Any) -> Lookup | None:
    """How to look up the objects a list at a URL names, by URL (None: ``source`` reads no list at a URL)."""
    fs, root, base = getattr(source, "fs", None), getattr(source, "root", None), getattr(source, "base", "")
    if fs is None or not isinstance(root, str) or not base:
        return None

    def lookup(url: str) -> tuple[int, str] | None:
        if not url.startswith(f"{root}/"):  # another source's: not this one's object
            return None
        path = f"{base}/{url[len(root) + 1 :]}"
        fs.invalidate_cache(path)
        return remote_object(fs, path, url)

    return lookup


def check_probes(probes: list[list[Any]], what: str = "a file packed", lookup: Lookup | None = None) -> None:
    """Refuse a resume where a file or object of ``probes`` changed since (its size, time or version).

    ``lookup`` (:func:`remote_lookup`) asks the store for the objects' probes.

    Raises:
        SourceError: naming the first such file or object (resumable: the partial is kept).
    """
    for place, size, then in probes:
        if isinstance(then, str):  # an object's version
            found = lookup(place) if lookup is not None else None
            if found != (size, then):
                gone = "gone now" if found is None else f"{found[0]} bytes at {found[1]!r} now"
                detail = f"{size} bytes at version {then!r} when packed, {gone}"
                refuse_changed(place, REWRITTEN.format(detail))
            continue
        try:
            st = os.stat(place)
            now = None if (st.st_size, st.st_mtime_ns) == (size, then) else f"{st.st_size} bytes now"
        except OSError as exc:
            now = f"now {exc.strerror or exc}"
        if now is not None:
            detail = f"{size} bytes then, {now}; or its modification time differs"
            refuse_changed(place, f"{what} before the interruption changed since ({detail})")


def refuse_changed(place: str, message: str) -> None:
    """Raise the resumable :class:`~packdata.errors.SourceError` of a file or object packed and changed since."""
    error = SourceError(message, path=place, hint=_HINT)
    error.resumable = True  # the partial is kept
    raise error


def is_probe(probe: object) -> bool:
    """Whether ``probe`` is ``[absolute path, size, mtime_ns]`` or ``[URL, size, version]`` (see the module)."""
    if not (isinstance(probe, list) and len(probe) == 3 and isinstance(probe[0], str) and is_count(probe[1])):
        return False
    place, then = probe[0], probe[2]
    if isinstance(then, str):
        return is_url(place)
    return os.path.isabs(place) and "\0" not in place and isinstance(then, int) and not isinstance(then, bool)


def refuse_copied_again(entry: SourceFile | SourceGroup | Skip, again: dict[str, str], folder: Path, url: str) -> None:
    """Refuse a resume where ``entry``, packed, is a file of ``folder`` downloaded again from ``url`` as another object.

    Raises:
        SourceError: naming the object's URL (resumable: the partial is kept).
    """
    if isinstance(entry, SourceFile):
        paths = [entry.path]
    elif isinstance(entry, SourceGroup):
        paths = [path for _, path in entry.files if isinstance(path, str)]
    else:
        return
    for path in paths:
        name = Path(os.path.relpath(path, folder)).as_posix()
        if name in again:
            refuse_changed(f"{url}/{name}", REWRITTEN.format(again[name]))
