"""Naming a full disk: which file system, of what type and size, with how much left.

Every write that runs out of room (a stage's copy, a conversion's shard, keys
spilled past a memory budget, a folder made at a destination) says it in the same
words: ``no space left on MOUNT (FSTYPE of SIZE, FREE free) while writing FILE of
WHAT``; :func:`write_error` gives them for a full disk and
:func:`packdata.errors.unwritable_error` for any other refusal.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from packdata.errors import CapacityError, PackdataError, unwritable_error
from packdata.host.facts import find_mount, read_mounts
from packdata.units import format_size

__all__ = ["FULL_DISK_ERRNOS", "RERUN_HINT", "filesystem_named", "no_space_error", "raise_if_full", "write_error"]

FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
RERUN_HINT = "Free space on that disk, then run again (a conversion: resume=True continues it)"
"""The remedy where the writer is not known: a conversion's, a merge's or an append's, which reword it."""

_TEMPORARY = (".partial", ".tmp", ".part")  # a pack's work folder, atomic_write's, a download's (remote stage)


def filesystem_named(folder: str | os.PathLike) -> str:
    """The file system holding ``folder``, as a full disk is named: ``MOUNT (FSTYPE of SIZE, FREE free)``."""
    try:
        usage = shutil.disk_usage(folder)
    except OSError:  # gone meanwhile: the folder is named alone
        return os.fspath(folder)
    sizes = f"{format_size(usage.total)}, {format_size(usage.free)} free{_no_inodes(folder)}"
    try:
        mount = find_mount(folder, read_mounts())
    except LookupError:
        return f"{os.fspath(folder)} ({sizes})"
    return f"{mount.mountpoint} ({mount.fstype} of {sizes})"


def _no_inodes(folder: str | os.PathLike) -> str:
    """``", no inodes free"`` where the file system of ``folder`` has room for bytes but not for another file."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return ""
    return ", no inodes free" if st.f_files and not st.f_favail else ""


def no_space_error(
    exc: BaseException, path: str | os.PathLike, *, folder: str | os.PathLike, of: str, hint: str
) -> CapacityError:
    """The CapacityError for ``exc`` (a full disk or quota; a C library's short write) raised writing ``path``, a
    file in ``folder``.

    The file is shown relative to ``folder`` (a temporary name as it will be
    named once written), followed by ``of`` (``"of the staged pack"``); ``hint``
    says what to do. Raise it ``from exc``.
    """
    path, folder = Path(path), Path(folder)
    try:
        parts = path.relative_to(folder).parts or (folder.name,)
    except ValueError:
        parts = path.parts
    shown = "/".join(_final_name(part) for part in parts)
    return CapacityError(
        f"no space left on {filesystem_named(_existing(path))} while writing {shown} {of}", path=path, hint=hint
    )


def raise_if_full(exc: OSError, folder: str | os.PathLike, *, of: str, hint: str) -> None:
    """Raise :func:`no_space_error` for ``exc`` if it is a full disk or quota (met writing into ``folder``: its
    file, else ``folder`` itself, is named); else return, for the caller to raise ``exc`` as it is."""
    if exc.errno in FULL_DISK_ERRNOS:
        raise no_space_error(exc, exc.filename or folder, folder=folder, of=of, hint=hint) from exc


def write_error(
    exc: OSError, path: str | os.PathLike, *, folder: str | os.PathLike, of: str, hint: str
) -> PackdataError:
    """The one-line error for ``exc``, raised creating or writing ``path`` (a file or folder in ``folder``).

    A full disk or quota gives :func:`no_space_error` (``of`` and ``hint`` as there); anything
    else (read-only, no permission, a file on the way) gives :func:`packdata.errors.unwritable_error`.
    Raise it ``from exc``.
    """
    if exc.errno in FULL_DISK_ERRNOS:
        return no_space_error(exc, path, folder=folder, of=of, hint=hint)
    return unwritable_error(exc, path)


def _final_name(name: str) -> str:
    """The name a hidden temporary (``.NAME.partial``, ``.NAME.tmp``) takes once written: ``NAME``."""
    for suffix in _TEMPORARY:
        if name.startswith(".") and name.endswith(suffix) and len(name) > len(suffix) + 1:
            return name[1 : -len(suffix)]
    return name


def _existing(path: Path) -> Path:
    """``path`` or the nearest folder above it that exists (a file being created is not there yet)."""
    for candidate in (path, *path.parents):
        if candidate.is_dir():
            return candidate
    return path
