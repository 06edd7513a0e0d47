"""``packdata unstage``: remove what ``packdata stage`` wrote (never the originals), and unmount a
tmpfs packdata mounted.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packdata.errors import ConfigError, LockedError
from packdata.pack.files import discard_partial, file_kind, holds_conversion, stale_siblings, temporary_owner
from packdata.pack.lock import convert_lock_path, hold_lock
from packdata.pack.manifest import evicted_mark
from packdata.staging.cache import delete_copy, delete_unread, discard_aside
from packdata.staging.folder import dir_bytes, locked, remove_empty
from packdata.staging.marker import STAGED_FILE, is_staged_copy, unreadable_named
from packdata.staging.tmpfs import TMPFS_SOURCE, made_folders, run_mount, tmpfs_mount_at

__all__ = [
    "UnstageResult",
    "unstage",
]


@dataclass
class UnstageResult:
    """What ``unstage`` removed."""

    removed: list[Path]
    bytes_freed: int
    unmounted: Path | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "removed": [os.fspath(p) for p in self.removed],
            "bytes_freed": self.bytes_freed,
            "unmounted": os.fspath(self.unmounted) if self.unmounted else None,
        }


def unstage(path: str | os.PathLike, *, unmount: bool = False, force: bool = False) -> UnstageResult:
    """Remove a staged pack, or every staged pack in an area; ``unmount`` a tmpfs packdata mounted.

    Only folders holding packdata's ``staged.json`` (well-formed: a project's own
    file of that name is no marker, see :func:`~packdata.staging.marker.read_marker`),
    or nothing but the ``.stage.lock`` of a stage killed before it wrote one, are deleted; the
    originals are never touched. A staged pack that is still read (a dataset
    holds its ``.readers.lock``, or a process visibly has a file of it open:
    :func:`~packdata.staging.remote.delete_unread`) is kept unless ``force``;
    the others in an area are removed. The ``.NAME.old-PID`` copies killed
    unstages, evictions or swaps left aside are removed too, each holding
    ``.NAME.lock`` (a live run holding it keeps its own): beside the staged
    pack NAME, and in an area any that is a staged copy, whoever's NAME it was,
    and the ``.NAME.partial`` download of a stage from a URL that was killed
    (one a live stage still writes is its own: kept). The ``.NAME.evicted`` mark a cache limit's eviction left
    (:func:`~packdata.pack.manifest.evicted_mark`) goes too once no copy stands at NAME, holding its lock: beside
    the staged pack NAME, and in an area every one (an empty regular file; anything else of that name is kept).
    Unmounting removes the
    mount point only where packdata created it, and the folders above it that
    the mount created while each is empty (:func:`~packdata.staging.tmpfs.made_folders`).

    Raises:
        ConfigError: ``path`` is neither a staged pack nor an area holding one, it or an entry of it cannot be
            read, or
            ``unmount`` was asked for a mount packdata did not make.
        LockedError: a ``packdata stage`` is writing the pack (it is named), or
            a staged pack is still read and ``force`` is False.
        ConfigError: a staged pack's ``.readers.lock`` is not a regular file
            (so whether it is read cannot be told) and ``force`` is False: it is kept.
    """
    target = Path(path).absolute()
    with unreadable_named(target):  # a scan that meets an entry it cannot stat: one line
        if target.is_symlink():
            raise ConfigError(
                "is a symlink; unstage the staged pack itself",
                path=target,
                hint=f"Run `packdata unstage {target.resolve()}`",
            )
        if not target.is_dir():
            problem = (
                f"is {file_kind(target.stat().st_mode)}, not a staged pack"
                if target.exists()
                else "no such staged pack"
            )
            raise ConfigError(
                f"{problem} or staging area",
                path=target,
                hint="List staged packs with stage_status() (`packdata stage --status`)",
            )
        owner = temporary_owner(target, "old", "partial")
        if owner is not None and temporary_owner(target, "partial") and holds_conversion(target):
            raise ConfigError(
                f"is an interrupted conversion into {owner.name} (it holds its checkpoint), not a staged pack",
                path=target,
                hint=f"Finish it with resume (`packdata convert ... {owner} --resume`), "
                "or drop it with overwrite (`--overwrite`)",
            )
        if owner is not None and (
            is_staged_copy(target) or temporary_owner(target, "partial")
        ):  # NAME's, under NAME's lock
            raise ConfigError(
                f"is {owner.name}'s copy moved aside or being downloaded, not a staged pack",
                path=target,
                hint=f"Run `packdata unstage {target.parent}`: it removes such copies under {owner.name}'s lock",
            )
        if owner is not None:
            raise ConfigError(
                f"is named as {owner.name} moved aside, but is no staged copy (it holds no {STAGED_FILE}): "
                "not unstage's",
                path=target,
                hint="A killed conversion with overwrite (`packdata convert --overwrite`) leaves its old pack so: "
                f"the next convert into {owner} moves it back or removes it. Otherwise delete it yourself",
            )
        asides: list[Path] = []  # in an area: staged copies killed runs left moved aside, whoever's NAME they were
        downloads: list[Path] = []  # in an area: the .NAME.partial downloads of stages from a URL
        evicted: list[Path] = []  # in an area: the NAMEs whose .NAME.evicted marks are left, no copy there
        if is_staged_copy(target):
            packs, area = [target], target.parent
        else:
            entries = sorted(target.iterdir())
            packs = [d for d in entries if temporary_owner(d, "old", "partial") is None and is_staged_copy(d)]
            asides = [d for d in entries if temporary_owner(d, "old") not in (None, *packs) and is_staged_copy(d)]
            downloads = [  # never an interrupted conversion's partial folder: its work resumes
                d
                for d in entries
                if temporary_owner(d, "partial") and d.is_dir() and not d.is_symlink() and not holds_conversion(d)
            ]
            evicted = [o for d in entries if (o := temporary_owner(d, "evicted")) and not os.path.lexists(o)]
            area = target
            if not packs and not asides and not downloads and not evicted and not unmount:
                raise ConfigError(
                    "is not a staged pack and holds none",
                    path=target,
                    hint="unstage only removes what `packdata stage` wrote (folders with staged.json)",
                )
        mount = None
        if unmount:
            mount = tmpfs_mount_at(area)
            if mount is None or mount.device != TMPFS_SOURCE:
                raise ConfigError(
                    "is not a tmpfs that packdata mounted, so it is not unmounted",
                    path=area,
                    hint="Unmount it yourself with `sudo umount` if you mean to",
                )
            others = [d for d in area.iterdir() if d.is_dir() and d not in (*packs, *asides, *downloads)]
            if others:
                raise ConfigError(
                    f"still holds {len(others)} other entr{'ies' if len(others) != 1 else 'y'} ({others[0].name})",
                    path=area,
                    hint=f"Unstage them, or unstage {area} with unmount=True",
                )
    freed, read, removed = 0, [], list(packs)
    unknown: ConfigError | None = None
    for pack in packs:
        with locked(pack, what="packdata unstage"):  # never under a stage still writing it
            size = dir_bytes(pack)
            try:
                if force:
                    delete_copy(pack)
                    freed += size
                elif delete_unread(pack):
                    freed += size
                else:
                    read.append(pack)
            except ConfigError as exc:  # its .readers.lock is not one a stage made: its readers cannot be told
                unknown = unknown or exc
            freed += _sweep(pack, removed, staged_only=False)
            _drop_mark(pack)
    owners = [temporary_owner(d, "old", "partial") for d in (*asides, *downloads)]
    for owner in dict.fromkeys(filter(None, owners)):
        try:
            with hold_lock(convert_lock_path(owner), what="packdata unstage", target=owner):
                freed += _sweep(owner, removed, staged_only=True)
                download = owner.with_name(f".{owner.name}.partial")
                if download in downloads:  # no live stage holds NAME's lock: a killed stage's download
                    size = dir_bytes(download)
                    with contextlib.suppress(OSError):
                        discard_partial(download)
                        removed.append(download)
                        freed += size
        except (LockedError, ConfigError):
            continue  # a live stage, unstage or convert of NAME holds its lock: what is aside is its own
    for owner in evicted:  # a stage of NAME under way (holding its lock) removes the mark itself
        with (
            contextlib.suppress(LockedError, ConfigError),
            hold_lock(convert_lock_path(owner), what="packdata unstage", target=owner),
        ):
            _drop_mark(owner)
    if read:
        more = f"; {len(read) - 1} more staged packs here are not either" if len(read) > 1 else ""
        raise LockedError(
            f"is still read (a dataset holds it, or a process has its files open), so it is not removed{more}",
            path=read[0],
            hint="Stop its readers and unstage again, or pass force=True (its readers then stop with an error)",
        )
    if unknown is not None:
        raise unknown
    unmounted = None
    if mount is not None:
        if os.geteuid() != 0:
            raise ConfigError("unmounting needs root", path=area, hint=f"Run `sudo umount {area}`")
        made = made_folders(area)
        run_mount(
            ["umount", os.fspath(area)],
            area,
            "A process still has files open there (a dataset or DataLoader workers): stop it and unstage again",
        )
        unmounted = area
        remove_empty(made)  # what packdata created; what the user made stays, as does anything put in it
    return UnstageResult(removed=removed, bytes_freed=freed, unmounted=unmounted)


def _sweep(copy: Path, removed: list[Path], *, staged_only: bool) -> int:
    """Remove the ``.NAME.old-PID`` entries killed runs left beside ``copy``, holding its ``.NAME.lock``; bytes freed.

    The rule a stage of NAME sweeps by (:func:`~packdata.staging.remote.discard_stale_copies`):
    under that lock no live process has one, exact names only, a symlink is
    unlinked, never followed. ``staged_only`` (NAME is no staged pack here)
    keeps what is not a staged copy: the old pack a killed conversion with
    ``overwrite=True`` moved aside, which its next run moves back. Each one removed is added to ``removed``.
    """
    freed = 0
    for aside in stale_siblings(copy, "old"):
        if staged_only and not is_staged_copy(aside):
            continue
        size = 0 if aside.is_symlink() else dir_bytes(aside)
        with contextlib.suppress(OSError):  # one that cannot be removed costs disk, never the unstage
            discard_aside(aside)
            removed.append(aside)
            freed += size
    return freed


def _drop_mark(copy: Path) -> None:
    """Remove :func:`~packdata.pack.manifest.evicted_mark` beside ``copy`` when no copy stands there; call it holding
    ``copy``'s lock. Only the empty regular file an eviction makes: a link (never followed), folder or file with
    content of that name is not packdata's, and is kept; one that cannot be removed costs nothing but the mark."""
    mark = evicted_mark(copy)
    with contextlib.suppress(OSError):
        info = os.lstat(mark)
        if stat.S_ISREG(info.st_mode) and info.st_size == 0 and not os.path.lexists(copy):
            mark.unlink()
