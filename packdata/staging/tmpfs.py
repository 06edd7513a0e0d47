"""tmpfs staging areas: mount, reuse or resize one after the host's memory checks."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packdata.errors import CapacityError, ConfigError
from packdata.host.facts import Mount, find_mount, gather_facts, read_mounts
from packdata.host.memory import SafetyWarning, memory_warnings
from packdata.pack.lock import convert_lock_path, wait_for_lock
from packdata.staging.folder import missing_folders, removed_if_refused
from packdata.units import exact_size, format_size

_PAGE = os.sysconf("SC_PAGE_SIZE")  # tmpfs sizes are whole pages

__all__ = [
    "DEFAULT_AREA",
    "MADE_FILE",
    "TMPFS_SOURCE",
    "TmpfsArea",
    "made_folders",
    "mount_of",
    "prepare_tmpfs",
    "run_mount",
    "tmpfs_mount_at",
]

DEFAULT_AREA = Path("/mnt/packdata")
"""Where ``stage(tmpfs=...)`` mounts its tmpfs, and where ``stage(pack)`` stages by default."""

TMPFS_SOURCE = "packdata"
"""The device name of tmpfs mounts packdata makes (``/proc/mounts`` column 1): only these are unmounted."""

MADE_FILE = ".packdata-made-mount-point"
"""In the root of a tmpfs packdata mounted on a folder it created: unmounting it removes that folder.

JSON ``{"above": [...]}``: the folders above the mount point that the same
mount created, deepest first, which unmounting removes too while each is empty.
It lives in the tmpfs, so it goes with the mount; a folder that was there before keeps none and stays.
"""


@dataclass
class TmpfsArea:
    """A tmpfs staging area: mounted now, reused, or resized."""

    path: Path
    size: int
    used: int
    free: int
    action: str  # "mounted", "reused", "resized"
    mounted_by_packdata: bool
    warnings: list[SafetyWarning] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["path"] = os.fspath(self.path)
        return data


def mount_of(path: str | os.PathLike, mounts: list[Mount]) -> Mount | None:
    try:
        return find_mount(path, mounts)
    except LookupError:
        return None


def tmpfs_mount_at(path: Path, root: str = "/") -> Mount | None:
    """The filesystem mounted exactly at ``path``, if any."""
    mount = mount_of(path, read_mounts(root)) if path.exists() else None
    return mount if mount is not None and Path(mount.mountpoint) == path.resolve() else None


def made_folders(path: Path) -> list[Path]:
    """The folders packdata made for the tmpfs mounted at ``path``, deepest first; empty where it made none.

    ``path`` itself when the tmpfs holds a root-owned :data:`MADE_FILE`, then
    the folders above it that file lists, as far as they are ``path``'s nearest
    parents (anything else it names is ignored).
    """
    try:
        fd = os.open(path / MADE_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != 0:  # mode=1777: another user may write there, not as root
            return []
        raw = file.read(1 << 16)
    try:
        listed = json.loads(raw)["above"] if raw.strip() else []
    except (ValueError, KeyError, TypeError):
        listed = []
    named = {Path(p) for p in listed if isinstance(p, str)} if isinstance(listed, list) else set()
    made = [path]
    for parent in path.parents:
        if parent not in named:
            break
        made.append(parent)
    return made


def _mark_made(path: Path, above: Sequence[Path]) -> None:
    """Write :data:`MADE_FILE` into the tmpfs just mounted at ``path``, listing the folders ``above`` it made."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path / MADE_FILE, flags, 0o644)
    except FileExistsError:  # another user's file there first: not root's, so nothing is removed
        return
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        json.dump({"above": [os.fspath(p) for p in above]}, file)


def run_mount(args: list[str], path: Path, hint: str) -> None:
    try:
        subprocess.run(args, check=True, capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise ConfigError(f"the `{args[0]}` command is not installed", path=path) from exc
    except subprocess.CalledProcessError as exc:
        lines = [line.strip() for line in (exc.stderr or "").splitlines() if line.strip()]  # one line: a message's
        detail = "; ".join(lines).rstrip(".") or f"exit status {exc.returncode}"
        raise ConfigError(f"`{' '.join(args)}` failed: {detail}", path=path, hint=hint) from exc


def _not_root_error(size: int, path: Path) -> ConfigError:
    return ConfigError(
        "mounting a tmpfs needs root",
        path=path,
        hint=f"Run `sudo packdata stage --tmpfs {exact_size(size)} --mount {path}` once, "
        f"or stage into RAM without mounting: `packdata stage PACK --to /dev/shm`",
    )


def prepare_tmpfs(
    size: int,
    *,
    mount: str | os.PathLike = DEFAULT_AREA,
    resize: bool = False,
    force: bool = False,
    reserve: int | None = None,
) -> TmpfsArea:
    """Mount a tmpfs of ``size`` bytes at ``mount``, or reuse (``resize``: remount) the one there.

    Args:
        size: the tmpfs size in bytes (tmpfs only takes RAM for what it holds).
        mount: the mount point: a tmpfs there, an empty folder, or a path to create
            (default :data:`DEFAULT_AREA`; one created is marked with :data:`MADE_FILE`,
            so unmounting removes it and the folders made above it). A refused or
            failed mount removes the folders it made.
        resize: remount an existing tmpfs with the new size.
        force: mount or resize even when the memory checks refuse the size.
        reserve: memory kept for training (default: see :func:`packdata.host.memory.memory_warnings`).

    Raises:
        CapacityError: the size is unsafe for this machine's memory (without ``force``).
        ConfigError: not root, something other than a tmpfs is mounted at ``mount``, or
            nothing is and ``mount`` is not an empty folder (a mount would hide what it holds).
    """
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size < 2**63:  # 0, or 2**64 wrapped: no limit
        raise ConfigError(
            f"size should be a byte count from 1 to 2**63 - 1, but got size={size!r}",
            hint="tmpfs reads size=0 (and a size that wraps to it past 2**64) as no limit at all: give the size",
        )
    path = Path(mount).absolute()
    if os.geteuid() != 0:  # nothing is mounted without root (it is said below): no lock to take
        return _prepare(size, path, resize=resize, force=force, reserve=reserve)
    above = missing_folders(path.parent)  # the folders above the mount point that this call creates
    with removed_if_refused(above):  # a refused or failed mount leaves none of them (_prepare: nor the mount point)
        path.parent.mkdir(parents=True, exist_ok=True)
        with wait_for_lock(convert_lock_path(path), what="packdata stage --tmpfs", target=path):
            return _prepare(size, path, resize=resize, force=force, reserve=reserve, above=above)  # one mounts


def _prepare(
    size: int, path: Path, *, resize: bool, force: bool, reserve: int | None, above: Sequence[Path] = ()
) -> TmpfsArea:
    """:func:`prepare_tmpfs` once no other process is mounting at ``path``; ``above``: the parents it made."""
    existing = tmpfs_mount_at(path)
    if existing is not None and existing.fstype != "tmpfs":
        raise ConfigError(
            f"a {existing.fstype} filesystem is mounted here, not a tmpfs",
            path=path,
            hint="Choose another mount=DIR, or stage onto it with to=DIR",
        )
    if existing is None and os.path.lexists(path) and (not path.is_dir() or any(path.iterdir())):
        raise ConfigError(
            "is not an empty folder: a tmpfs mounted here would hide what it holds",
            path=path,
            hint="Choose a new or empty mount=DIR (the default is /mnt/packdata)",
        )
    facts = gather_facts(include_gpus=False)
    current = shutil.disk_usage(path) if existing is not None else None
    growth = size - (current.total if current else 0) if existing is None or resize else 0
    warnings = memory_warnings(
        facts, tmpfs_size=max(growth, 0) if existing is None or resize else None, reserve=reserve
    )
    if existing is not None and not resize:
        warnings = [w for w in warnings if w.code != "tmpfs-too-large"]
        if current is not None and abs(current.total - size) >= _PAGE:
            raise ConfigError(
                f"a tmpfs of {format_size(current.total)} is mounted here, not the {format_size(size)} asked for",
                path=path,
                hint=f"Pass resize=True to remount it at {format_size(size)} after the memory checks, "
                f"or ask for {format_size(current.total)}",
            )
    refused = [w for w in warnings if w.severity == "refuse"]
    if refused and not force:
        raise CapacityError(
            refused[0].message, path=path, hint="Choose a smaller size, or pass force=True to mount it anyway"
        )
    if existing is None or resize:
        if os.geteuid() != 0:
            raise _not_root_error(size, path)
        if existing is None:
            made = not os.path.lexists(path)
            with removed_if_refused([path] if made else []):
                path.mkdir(parents=True, exist_ok=True)
                run_mount(
                    ["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", TMPFS_SOURCE, os.fspath(path)],
                    path,
                    "Check the mount point, or stage into /dev/shm with to=/dev/shm",
                )
            if made:  # unmounting removes the folder then (and those above it made); one the user made stays
                _mark_made(path, above)
            action = "mounted"
        else:
            run_mount(
                ["mount", "-o", f"remount,size={size}", os.fspath(path)],
                path,
                "A tmpfs cannot shrink below what it holds: unstage packs first",
            )
            action = "resized"
    else:
        action = "reused"
    usage = shutil.disk_usage(path)
    own = tmpfs_mount_at(path)
    return TmpfsArea(
        path=path,
        size=usage.total,
        used=usage.used,
        free=usage.free,
        action=action,
        mounted_by_packdata=own is not None and own.device == TMPFS_SOURCE,
        warnings=warnings,
    )
