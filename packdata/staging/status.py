"""``packdata stage --status``: the staging areas, the packs staged in each (read from their
``staged.json``), their space, and the memory facts that matter for tmpfs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packdata.errors import ConfigError, PackdataError
from packdata.formats import get_format
from packdata.host.facts import Mount, gather_facts, read_mounts
from packdata.host.memory import SafetyWarning, memory_warnings
from packdata.pack.manifest import MANIFEST_NAME, Manifest, read_manifest
from packdata.pack.urls import is_url
from packdata.staging.marker import is_staged_copy, read_marker, unreadable_named
from packdata.staging.tmpfs import DEFAULT_AREA, TMPFS_SOURCE, mount_of

__all__ = [
    "AreaStatus",
    "StageStatus",
    "StagedPack",
    "damaged_shards",
    "outdated",
    "stage_status",
]


@dataclass
class StagedPack:
    """A staged pack found in an area."""

    path: Path
    origin: str
    format: str
    shards_staged: int
    shards_left: int
    bytes_staged: int
    bytes_left: int
    complete: bool
    staged_at: str
    damaged: list[str] = field(default_factory=list)  # staged shards changed since (see damaged_shards)
    outdated: bool = False  # its origin was converted again since: it reads the pack as it was (see outdated)


@dataclass
class AreaStatus:
    """One staging area: its filesystem, space, and the packs staged in it."""

    path: Path
    fstype: str
    size: int
    used: int
    free: int
    mounted_by_packdata: bool
    packs: list[StagedPack]  # the staged packs packdata wrote here: real folders, never reached through a link
    links: dict[str, str] = field(default_factory=dict)  # name -> target: links to staged packs that live elsewhere


@dataclass
class StageStatus:
    """``packdata stage --status``: areas, packs, and the memory facts that matter for tmpfs."""

    areas: list[AreaStatus]
    memory: dict[str, Any]
    warnings: list[SafetyWarning]

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self), default=os.fspath))


def damaged_shards(pack: Path, manifest: Manifest) -> list[str]:
    """The shards staged in ``pack`` whose data file is missing or not the manifest's size, each with what is wrong.

    One stat per shard, no read: it shows a copy truncated, deleted or replaced since it was staged.
    """
    layout_of = get_format(manifest.format).shard_layout
    damaged = []
    for info in manifest.shards:
        if os.path.isabs(info.file):  # left at its origin
            continue
        data = layout_of(info.file).data_path(pack / info.file)
        try:
            found = data.lstat()
        except FileNotFoundError:
            damaged.append(f"{info.file} is missing")
            continue
        if not stat.S_ISREG(found.st_mode) or found.st_size != info.bytes:
            damaged.append(f"{info.file} is {found.st_size} bytes, the manifest says {info.bytes}")
    return damaged


def outdated(manifest: Manifest) -> bool:
    """Whether the staged pack of ``manifest`` is of its origin as it was: the origin was converted again since.

    Its shards and sample index are compared with the origin's manifest's (checksums, sizes, names); an
    origin that cannot be read is not told outdated (opening the staged pack names why, where it matters).
    """
    if manifest.staged_from is None or is_url(manifest.staged_from):  # a URL's copy: no request for a status
        return False
    try:
        origin = read_manifest(manifest.staged_from)
    except PackdataError:
        return False

    def shards(m: Manifest) -> list[tuple[str, str, int]]:
        return [(os.path.basename(s.file), s.sha256, s.bytes) for s in m.shards]

    return shards(origin) != shards(manifest) or origin.index_sha256 != manifest.index_sha256


def _read_marker(path: Path) -> StagedPack | None:
    data = read_marker(path)
    if data is None:
        return None
    damaged: list[str] = []
    old = False
    if (path / MANIFEST_NAME).is_file():
        try:
            manifest = read_manifest(path)
            damaged, old = damaged_shards(path, manifest), outdated(manifest)
        except PackdataError as exc:
            damaged = [f"its manifest cannot be read: {exc}"]
    return StagedPack(
        path=path,
        origin=str(data.get("origin", "")),
        format=str(data.get("format", "")),
        shards_staged=len(data.get("staged", [])),
        shards_left=len(data.get("left", [])),
        bytes_staged=int(data.get("bytes_staged", 0)),
        bytes_left=int(data.get("bytes_left", 0)),
        complete=bool(data.get("complete")) and (path / MANIFEST_NAME).is_file(),
        staged_at=str(data.get("staged_at", "")),
        damaged=damaged,
        outdated=old,
    )


def _area_status(path: Path, mounts: list[Mount]) -> AreaStatus:
    usage = shutil.disk_usage(path)
    mount = mount_of(path, mounts)
    entries = sorted(path.iterdir())
    packs = [p for p in (_read_marker(d) for d in entries if is_staged_copy(d)) if p is not None]
    targets = {d.name: Path(os.path.realpath(d)) for d in entries if d.is_symlink()}  # a loop: itself, no pack
    links = {name: os.fspath(target) for name, target in targets.items() if is_staged_copy(target)}
    own = _read_marker(path) if not path.is_symlink() else None
    if own is not None:
        packs.insert(0, own)
    return AreaStatus(
        path=path,
        fstype=mount.fstype if mount else "",
        size=usage.total,
        used=usage.used,
        free=usage.free,
        mounted_by_packdata=mount is not None and mount.device == TMPFS_SOURCE and Path(mount.mountpoint) == path,
        packs=packs,
        links=links,
    )


def stage_status(area: str | os.PathLike | None = None) -> StageStatus:
    """Staging areas with their staged packs, sizes and free space, and the memory facts.

    Only what ``packdata stage`` wrote in an area is one of its packs: a link there to a
    staged pack elsewhere is listed apart (:attr:`AreaStatus.links`), as unstage never
    deletes through one; ``area`` given as a link is reported where it leads.

    Args:
        area: one area (or staged pack) to report; default :data:`DEFAULT_AREA`
            and every tmpfs packdata mounted.

    Raises:
        ConfigError: ``area`` is no folder, or it or an entry of an area cannot be read (named).
    """
    mounts = read_mounts()
    if area is not None:
        paths = [Path(area).absolute()]
        with unreadable_named(paths[0]):
            if paths[0].is_symlink():  # reported where it leads, as unstage names it
                paths = [paths[0].resolve()]
            if not paths[0].is_dir():
                raise ConfigError("no such staging area", path=paths[0])
    else:
        paths = [DEFAULT_AREA] if DEFAULT_AREA.is_dir() else []
        paths += [Path(m.mountpoint) for m in mounts if m.device == TMPFS_SOURCE and Path(m.mountpoint) not in paths]
    areas = []
    for path in paths:
        with unreadable_named(path):
            areas.append(_area_status(path, mounts))
    facts = gather_facts(include_gpus=False)
    return StageStatus(
        areas=areas,
        memory={**facts.to_dict()["memory"], "swap_used": facts.memory.swap_used, "cgroup": facts.to_dict()["cgroup"]},
        warnings=memory_warnings(facts),
    )
