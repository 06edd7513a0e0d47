"""``staged.json``: the marker that says a folder is a pack ``packdata stage`` wrote, and where from.

One writer and one reader: stage writes it, and stage, unstage, status and
doctor read it through :func:`read_marker`, which accepts only a well-formed
marker (a damaged or foreign one reads as no marker).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from packdata._version import __version__
from packdata.errors import ConfigError
from packdata.pack.files import check_visible, open_regular, read_bounded, temporary_owner
from packdata.pack.manifest import STAGED_FILE
from packdata.pack.manifest.schema import MAX_MANIFEST_BYTES
from packdata.staging.copy import LOCK, PARTIAL
from packdata.staging.folder import write_json

__all__ = [
    "STAGED_FILE",
    "check_destination",
    "check_name",
    "is_staged_copy",
    "only_lock_left",
    "read_marker",
    "unreadable_named",
    "write_marker",
]

_TYPES: dict[str, type | tuple[type, ...]] = {
    "origin": str,
    "format": str,
    "staged": list,
    "left": list,
    "bytes_staged": int,
    "bytes_left": int,
    "complete": bool,
}


def write_marker(
    dest: Path,
    *,
    origin: str | os.PathLike,
    format: str,
    staged: Iterable[str],
    left: Iterable[str],
    bytes_staged: int,
    bytes_left: int,
    complete: bool,
    origin_user: str = "",
) -> None:
    """Write ``dest/staged.json``, atomically (``origin_user``: a URL's :func:`~packdata.pack.urls.user_digest`)."""
    write_json(
        dest / STAGED_FILE,
        {
            "origin": os.fspath(origin),
            "origin_user": origin_user,
            "format": format,
            "staged": list(staged),
            "left": list(left),
            "bytes_staged": bytes_staged,
            "bytes_left": bytes_left,
            "complete": complete,
            "staged_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "packdata_version": __version__,
        },
    )


MAX_MARKER_BYTES = MAX_MANIFEST_BYTES
"""The largest ``staged.json`` read: its shard names are a part of the manifest's."""


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The marker of a staged pack at ``folder``, or None when there is none or it is not well-formed.

    Well-formed: a regular file (never a symlink, FIFO or device: one would be followed
    out of the folder, or block the read forever) holding a JSON object with every field
    :func:`write_marker` writes, each of its type; a ``staged.json`` of anything else
    (a project's own file of that name) is no marker, nor is one the folder's owner did not write
    (another user's, dropped into a shared area such as ``/dev/shm``, would make the area a staged pack), nor
    is one over :data:`MAX_MARKER_BYTES` (never read: it names fewer shards than a manifest, which is bounded so).
    """
    try:
        with os.fdopen(open_regular(folder / STAGED_FILE, follow_symlinks=False), "rb") as file:
            if os.fstat(file.fileno()).st_uid != folder.lstat().st_uid:
                return None
            text = read_bounded(file, MAX_MARKER_BYTES)
            if text is None:
                return None
            data = json.loads(text.decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    for name, kind in _TYPES.items():
        if name not in data or not isinstance(data[name], kind) or (kind is int and isinstance(data[name], bool)):
            return None
    return data


def only_lock_left(folder: Path) -> bool:
    """A folder holding a stage's lock and at most the first ``staged.json`` it writes (``.staged.json.partial``).

    What a stage killed before its marker had its name leaves, or what a live one holds for that instant;
    the lock must be the folder's owner's (another user's file of that name in a shared area is not a stage's).
    """
    if not folder.is_dir() or folder.is_symlink():
        return False
    names = {p.name for p in folder.iterdir()}
    if not (LOCK in names and names <= {LOCK, f".{STAGED_FILE}{PARTIAL}"}):
        return False
    with contextlib.suppress(OSError):
        return (folder / LOCK).lstat().st_uid == folder.lstat().st_uid  # the owner's stage, not another user's file
    return False


def is_staged_copy(folder: Path) -> bool:
    """``folder`` is what ``packdata stage`` wrote: a real folder with its marker, or with a killed stage's lock."""
    return folder.is_dir() and not folder.is_symlink() and (read_marker(folder) is not None or only_lock_left(folder))


@contextlib.contextmanager
def unreadable_named(area: Path) -> Iterator[None]:
    """An entry of ``area`` that cannot be looked at (no permission, ``/proc``): one ConfigError naming it."""
    try:
        yield
    except OSError as exc:
        raise ConfigError(
            f"cannot be read ({exc.strerror or exc})",
            path=exc.filename or area,
            hint="Name a staging area or staged pack that you may read",
        ) from exc


def check_name(name: str, *, area: Path, url: str | None = None) -> None:
    """Refuse a staged pack's folder name that is not one plain name, so that the pack lands in ``area`` itself.

    Args:
        name: the folder name, given as ``name=`` or (``url``) taken from the pack's URL.
        area: the staging area or cache folder the pack goes into.
        url: the pack's URL, when ``name`` was taken from it.

    Raises:
        ConfigError: ``name`` is empty, ``.`` or ``..``, or holds a path separator or a control character
            (a newline in a name hid a copy moved aside, ``.NAME.old-PID``, from what recognises one); or it is
            the name of a copy moved aside or a download (``.NAME.old-PID``, ``.NAME.partial``), which unstage
            never takes for a pack.
    """
    separators = {"/", os.sep, os.altsep or "/"}
    plain = name not in ("", ".", "..") and not any(c in separators or ord(c) < 0x20 or c == "\x7f" for c in name)
    owner = temporary_owner(area / name, "old", "partial") if plain else None
    if plain and owner is None:
        return
    why = f": it is how packdata names {owner.name}'s copy moved aside or being downloaded" if owner else ""
    if url is not None:
        raise ConfigError(f"cannot name the staged pack after the URL ({name!r}){why}", path=url, hint="Pass name=NAME")
    if owner is not None:
        raise ConfigError(
            f"the staged pack's name {name!r} cannot be unstaged{why}",
            path=area,
            hint=f"Choose another name=NAME (such as name={owner.name})",
        )
    raise ConfigError(
        f"the staged pack's name should be one plain folder name inside the area, but got {name!r}",
        path=area,
        hint="Pass name=NAME without '/' or control characters (such as name=train.lmdb): the staged pack is AREA/NAME",
    )


def check_destination(source: Path | str, dest: Path, *, user: str = "") -> None:
    """Refuse a staging destination that is the pack, inside it or around it, a foreign folder, or another's copy.

    Args:
        source: the pack's folder, or the URL of a pack in object storage (as ``display_url`` shows it).
        dest: the folder the staged pack goes into, ``AREA/NAME``.
        user: for a URL, its :func:`~packdata.pack.urls.user_digest` (the user part ``source`` does not show).

    Raises:
        ConfigError: ``dest`` must not be written; only an empty folder, one a killed stage left
            holding only its lock, or a staged copy of ``source`` may be, each of this user's own.
    """
    check_visible(dest, what="the staging destination", hint="Give a to=DIR whose folders this user may search")
    if isinstance(source, Path):
        real_source, real_dest = source.resolve(), dest.resolve()
        if real_dest == real_source:
            raise ConfigError("the staging destination is the pack itself", path=dest, hint="Give another to=DIR")
        if real_dest.is_relative_to(real_source):
            raise ConfigError(
                f"the staging destination is inside the pack being staged ({source})",
                path=dest,
                hint="Give a to=DIR outside the pack; stage never writes into its source",
            )
        if real_source.is_relative_to(real_dest):
            raise ConfigError(
                f"the staging destination holds the pack being staged ({source})",
                path=dest,
                hint="Choose a to=DIR or name=NAME that does not contain the pack",
            )
    if dest.exists() and (owner := dest.stat().st_uid) != os.geteuid():  # a tmpfs area is mode 1777
        raise ConfigError(
            f"belongs to another user (uid {owner}), who could swap its files for links while packdata writes there",
            path=dest,
            hint="Choose another to=DIR or name=NAME, or stage it as that user",
        )
    if dest.exists() or dest.is_symlink():
        marker = read_marker(dest)
        if marker is None:
            if dest.is_dir() and (not any(dest.iterdir()) or only_lock_left(dest)):
                return
            raise ConfigError(
                "exists and is not a staged pack",
                path=dest,
                hint="Choose another to=DIR or name=NAME; packdata only writes into packs it staged",
            )
        origin = marker.get("origin")
        same = origin == source if isinstance(source, str) else Path(str(origin)) == source.resolve()
        if origin and not (same and marker.get("origin_user", "") == user):
            shown = origin if not same else f"{origin}, whose URL had another user part, or one not noted then"
            raise ConfigError(
                f"holds a staged copy of another pack ({shown})",
                path=dest,
                hint=f"Unstage it first (packdata unstage {dest}) or choose another name=NAME",
            )


# --------------------------------------------------------------------------- tmpfs
