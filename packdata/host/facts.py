"""Machine facts: memory, cgroup limits, mounts, disks, CPUs, and GPUs (read by :mod:`packdata.host.gpus`).

Every reader of ``/proc`` or ``/sys`` takes ``root``, the filesystem root those
trees live under, so tests can feed crafted files. :func:`gather_facts` collects
everything into :class:`SystemFacts`; :mod:`packdata.host.memory` and
:mod:`packdata.host.cores` turn the facts into warnings and worker counts.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import psutil

from packdata.host.gpus import GPUInfo, gpus

__all__ = [
    "CgroupMemory",
    "MemoryInfo",
    "Mount",
    "SystemFacts",
    "TmpfsUsage",
    "count_physical_cores",
    "cpu_counts",
    "disk_free",
    "find_mount",
    "gather_facts",
    "is_network_fs",
    "is_rotational",
    "read_cgroup_cpu_quota",
    "read_cgroup_cpu_usage",
    "read_cgroup_memory",
    "read_cgroup_memory_limit",
    "read_cpus_allowed",
    "read_meminfo",
    "read_mounts",
    "tmpfs_usage",
]

#: cgroup v1 writes "no limit" as a huge page-aligned number; anything this large is none.
CGROUP_V1_UNLIMITED = 1 << 60

_NETWORK_FS = {"nfs", "nfs4", "cifs", "smb", "smb3", "smbfs", "ncpfs", "afs", "lustre", "gpfs", "ceph", "9p"}
_NETWORK_FS |= {"glusterfs", "beegfs", "orangefs", "pvfs2", "wekafs", "panfs", "quobyte", "davfs", "sshfs"}


def _p(root: str | os.PathLike, rel: str) -> Path:
    return Path(root, rel.lstrip("/"))


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="surrogateescape")
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    text = (_read(path) or "").strip()
    return int(text) if text.isdigit() else None


@dataclass(frozen=True)
class MemoryInfo:
    """Figures from ``/proc/meminfo``, in bytes."""

    mem_total: int
    mem_available: int
    swap_total: int = 0
    swap_free: int = 0
    shmem: int = 0
    cached: int = 0

    @property
    def swap_used(self) -> int:
        """Swap in use, in bytes."""
        return max(0, self.swap_total - self.swap_free)


def read_meminfo(root: str | os.PathLike = "/") -> MemoryInfo:
    """Read ``{root}/proc/meminfo``; MemFree + Buffers + Cached stand in for a missing MemAvailable.

    Raises:
        OSError: The file cannot be read.
        ValueError: It has no MemTotal line.
    """
    values: dict[str, int] = {}
    for line in _p(root, "proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    if "MemTotal" not in values:
        raise ValueError(f"{_p(root, 'proc/meminfo')}: no MemTotal line")
    get = values.get
    available = get("MemAvailable", get("MemFree", 0) + get("Buffers", 0) + get("Cached", 0))
    swap = (get("SwapTotal", 0), get("SwapFree", 0))
    return MemoryInfo(values["MemTotal"], available, *swap, get("Shmem", 0), get("Cached", 0))


@dataclass(frozen=True)
class CgroupMemory:
    """Memory limit and usage of the cgroup that binds this process.

    Attributes:
        limit: Smallest limit on the cgroup or an ancestor (v2: ``memory.max`` or ``memory.high``), in bytes;
            None when unlimited.
        usage: Usage of the cgroup holding that limit (page cache included); None when unknown.
        version: 1 or 2; None when no cgroup memory controller was found.
        inactive_file: Reclaimable inactive file cache within ``usage``; None when unknown.
    """

    limit: int | None
    usage: int | None
    version: int | None = None
    inactive_file: int | None = None

    @property
    def headroom(self) -> int | None:
        """Bytes the cgroup can still charge before its limit; None without a limit."""
        if self.limit is None:
            return None
        return max(0, self.limit - max(0, (self.usage or 0) - (self.inactive_file or 0)))

    def available(self, mem_available: int) -> int:
        """``mem_available`` (the machine's MemAvailable) cut to the headroom: what a process in this cgroup may
        still allocate."""
        headroom = self.headroom
        return mem_available if headroom is None else min(mem_available, headroom)


def _stat_value(path: Path, key: str) -> int | None:
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None


def _cgroup_paths(root: str | os.PathLike, proc_self_cgroup: str | None, controller: str) -> dict[int, list[str]]:
    """``{version: path parts}`` of this process's cgroup: v2's ``0::`` line, v1's ``controller`` line."""
    text = proc_self_cgroup if proc_self_cgroup is not None else _read(_p(root, "proc/self/cgroup"))
    paths: dict[int, list[str]] = {}
    for line in (text or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        version = 2 if hierarchy == "0" and not controllers else 1 if controller in controllers.split(",") else 0
        if version:
            paths[version] = [p for p in path.strip().split("/") if p not in ("", ".", "..")]
    return paths


def _cgroup_dirs(base: Path, parts: list[str]) -> list[Path]:
    """The cgroup folder and each of its parents, deepest first."""
    return [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def read_cgroup_memory(root: str | os.PathLike = "/", proc_self_cgroup: str | None = None) -> CgroupMemory:
    """Find this process's cgroup memory limit and usage, v2 first, then v1.

    v2: the ``0::/path`` line leads to ``sys/fs/cgroup/<path>/memory.max`` and
    ``memory.high`` (above it the kernel throttles the cgroup, and tmpfs pages cannot be
    reclaimed without swap: a limit too); v1: the ``memory`` line leads to
    ``sys/fs/cgroup/memory/<path>/memory.limit_in_bytes``. Each parent folder is read
    too and the smallest limit wins; ``max`` and v1 values of 2**60 or more mean none.
    Folders hidden by a cgroup namespace are skipped.

    Args:
        root: Filesystem root holding ``proc/`` and ``sys/``.
        proc_self_cgroup: Text to use instead of ``{root}/proc/self/cgroup``.

    Returns:
        The figures; all None when no memory controller was found.
    """
    paths = _cgroup_paths(root, proc_self_cgroup, "memory")
    layouts = (
        (2, "sys/fs/cgroup", ("memory.max", "memory.high"), "memory.current", "inactive_file"),
        (1, "sys/fs/cgroup/memory", ("memory.limit_in_bytes",), "memory.usage_in_bytes", "total_inactive_file"),
    )
    for version, base, limit_files, usage_file, inactive_key in layouts:
        if version not in paths:
            continue
        dirs = _cgroup_dirs(_p(root, base), paths[version])
        dirs = [d for d in dirs if (d / limit_files[0]).is_file() or (d / usage_file).is_file()]
        if not dirs:
            continue
        limits = [
            (lim, d)
            for d in dirs
            for name in limit_files
            if (lim := _read_int(d / name)) is not None and lim < CGROUP_V1_UNLIMITED
        ]
        limit, where = min(limits, key=lambda item: item[0]) if limits else (None, dirs[0])
        inactive = _stat_value(where / "memory.stat", inactive_key)
        return CgroupMemory(limit, _read_int(where / usage_file), version, inactive)
    return CgroupMemory(None, None)


def read_cgroup_memory_limit(root: str | os.PathLike = "/", proc_self_cgroup: str | None = None) -> int | None:
    """The container's memory limit in bytes, or None; see :func:`read_cgroup_memory`."""
    return read_cgroup_memory(root, proc_self_cgroup).limit


@dataclass(frozen=True)
class Mount:
    """One line of ``/proc/self/mounts``, octal escapes such as ``\\040`` decoded."""

    device: str
    mountpoint: str
    fstype: str
    options: tuple[str, ...] = ()


def read_mounts(root: str | os.PathLike = "/") -> list[Mount]:
    """Parse ``{root}/proc/self/mounts`` (else ``proc/mounts``); an unreadable table gives []."""
    text = _read(_p(root, "proc/self/mounts")) or _read(_p(root, "proc/mounts")) or ""
    mounts = []
    for line in text.splitlines():
        fields = [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), f) for f in line.split()[:4]]
        if len(fields) == 4:
            mounts.append(Mount(fields[0], fields[1], fields[2], tuple(fields[3].split(","))))
    return mounts


def find_mount(path: str | os.PathLike, mounts: list[Mount]) -> Mount:
    """The mount holding ``path``: the longest mountpoint prefix of its realpath (last one if stacked).

    Raises:
        LookupError: No mount covers the path.
    """
    real, best, best_len = os.path.realpath(path), None, -1
    for m in mounts:
        mp = m.mountpoint.rstrip("/") or "/"
        if (mp == "/" or real == mp or real.startswith(mp + "/")) and len(mp) >= best_len:
            best, best_len = m, len(mp)
    if best is None:
        raise LookupError(f"{real}: no mount in the table covers this path")
    return best


def is_network_fs(fstype: str) -> bool:
    """True for network and cluster filesystems (NFS, SMB, Lustre, GPFS, Ceph, any FUSE, ...)."""
    fstype = fstype.lower()
    return fstype in _NETWORK_FS or fstype.startswith(("fuse.", "nfs"))


def _existing(path: str | os.PathLike) -> str:
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return p


def is_rotational(path: str | os.PathLike, root: str | os.PathLike = "/") -> bool | None:
    """Best effort: whether the block device holding ``path`` (or its nearest parent) spins.

    ``os.stat``'s device number leads to ``{root}/sys/dev/block/MAJ:MIN``; a partition
    is resolved to its parent disk, whose ``queue/rotational`` is read.

    Returns:
        True for a spinning disk, False for SSD/NVMe, None when unknown (overlay, tmpfs, NFS).
    """
    try:
        dev = os.stat(_existing(path)).st_dev
        node = Path(os.path.realpath(_p(root, f"sys/dev/block/{os.major(dev)}:{os.minor(dev)}")))
    except (OSError, ValueError):
        return None
    if (node / "partition").exists():
        node = node.parent
    for candidate in (node / "queue/rotational", _p(root, f"sys/block/{node.name}/queue/rotational")):
        if (value := _read_int(candidate)) is not None:
            return value == 1
    return None


class TmpfsUsage(NamedTuple):
    """Size and use of one mounted tmpfs, in bytes."""

    mountpoint: str
    size_bytes: int
    used_bytes: int


def tmpfs_usage(root: str | os.PathLike = "/") -> list[TmpfsUsage]:
    """Every tmpfs in ``{root}/proc/self/mounts``, measured with ``os.statvfs`` (unreachable ones skipped)."""
    out: dict[str, TmpfsUsage] = {}
    for m in read_mounts(root):
        if m.fstype == "tmpfs":
            with contextlib.suppress(OSError):
                st = os.statvfs(m.mountpoint)
                size = st.f_blocks * st.f_frsize
                out[m.mountpoint] = TmpfsUsage(m.mountpoint, size, size - st.f_bfree * st.f_frsize)
    return list(out.values())


def disk_free(path: str | os.PathLike) -> int:
    """Bytes free to unprivileged users on the filesystem of ``path`` or its nearest existing parent."""
    st = os.statvfs(_existing(path))
    return st.f_bavail * st.f_frsize


def cpu_counts() -> tuple[int, int]:
    """``(physical, logical)`` CPU counts; physical falls back to logical when psutil cannot tell."""
    logical = psutil.cpu_count(logical=True) or os.cpu_count() or 1
    return psutil.cpu_count(logical=False) or logical, logical


def _cpu_list(text: str) -> tuple[int, ...] | None:
    """``0-3,8,10-11`` as a sorted tuple of CPU numbers; None when malformed."""
    cpus: set[int] = set()
    for item in text.strip().split(","):
        first, _, last = item.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            return None
        cpus.update(range(int(first), int(last or first) + 1))
    return tuple(sorted(cpus))


def read_cpus_allowed(root: str | os.PathLike = "/") -> tuple[int, ...] | None:
    """The logical CPUs this process may run on (its affinity, within its cpuset).

    Read from ``Cpus_allowed_list`` in ``{root}/proc/self/status``, else
    ``os.sched_getaffinity``; None when neither tells.
    """
    for line in (_read(_p(root, "proc/self/status")) or "").splitlines():
        key, _, value = line.partition(":")
        if key == "Cpus_allowed_list" and (cpus := _cpu_list(value)):
            return cpus
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return None


def count_physical_cores(cpus: tuple[int, ...], root: str | os.PathLike = "/") -> int | None:
    """How many physical cores the logical ``cpus`` sit on (hyperthread siblings count once).

    Each CPU's ``(physical_package_id, core_id)`` comes from
    ``{root}/sys/devices/system/cpu/cpuN/topology``; None when one is unreadable.
    """
    cores = set()
    for cpu in cpus:
        topology = _p(root, f"sys/devices/system/cpu/cpu{cpu}/topology")
        package, core = _read_int(topology / "physical_package_id"), _read_int(topology / "core_id")
        if package is None or core is None:
            return None
        cores.add((package, core))
    return len(cores) or None


def _cgroup_cpu_quotas(root: str | os.PathLike, proc_self_cgroup: str | None) -> list[tuple[float, Path]]:
    """Every CPU quota on this process's cgroup and its parents, in CPUs, with the folder holding it."""
    paths = _cgroup_paths(root, proc_self_cgroup, "cpu")
    quotas: list[tuple[float, Path]] = []
    if 2 in paths:
        for d in _cgroup_dirs(_p(root, "sys/fs/cgroup"), paths[2]):
            quota, _, period = (_read(d / "cpu.max") or "").partition(" ")
            if quota.strip().isdigit() and period.strip().isdigit() and int(period):
                quotas.append((int(quota) / int(period), d))
    if 1 in paths:
        for base in ("sys/fs/cgroup/cpu,cpuacct", "sys/fs/cgroup/cpu"):
            for d in _cgroup_dirs(_p(root, base), paths[1]):
                us, period_us = _read_int(d / "cpu.cfs_quota_us"), _read_int(d / "cpu.cfs_period_us")
                if us and period_us:  # -1 (no quota) does not read as an int
                    quotas.append((us / period_us, d))
    return quotas


def read_cgroup_cpu_quota(root: str | os.PathLike = "/", proc_self_cgroup: str | None = None) -> float | None:
    """CPUs' worth of time this process's cgroup may use (``cpu.max`` of ``200000 100000`` is 2.0).

    v2 reads ``cpu.max``, v1 ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``
    (under ``cpu,cpuacct`` or ``cpu``); each parent folder is read too and the
    smallest quota wins.

    Returns:
        The quota in CPUs; None when there is none (``max``, ``-1``) or no CPU controller.
    """
    return min((quota for quota, _ in _cgroup_cpu_quotas(root, proc_self_cgroup)), default=None)


def read_cgroup_cpu_usage(root: str | os.PathLike = "/", proc_self_cgroup: str | None = None) -> float | None:
    """CPU seconds used so far by the cgroup whose quota binds this process (see :func:`read_cgroup_cpu_quota`).

    v2 reads ``usage_usec`` of its ``cpu.stat``, v1 its ``cpuacct.usage`` (beside the
    quota, or at the same path under ``cpuacct`` when that is mounted apart).

    Returns:
        The seconds; None without a quota or where the usage cannot be read.
    """
    quotas = _cgroup_cpu_quotas(root, proc_self_cgroup)
    if not quotas:
        return None
    _, where = min(quotas, key=lambda item: item[0])
    if (usec := _stat_value(where / "cpu.stat", "usage_usec")) is not None:
        return usec / 1e6
    v1, cpu_apart = [where], _p(root, "sys/fs/cgroup/cpu")
    if where.is_relative_to(cpu_apart):
        v1.append(_p(root, "sys/fs/cgroup/cpuacct") / where.relative_to(cpu_apart))
    for d in v1:
        if (ns := _read_int(d / "cpuacct.usage")) is not None:
            return ns / 1e9
    return None


@dataclass
class SystemFacts:
    """What the memory checks, the cores rule and staging need to know about the machine and a path."""

    memory: MemoryInfo
    cgroup: CgroupMemory = field(default_factory=lambda: CgroupMemory(None, None))
    tmpfs: list[TmpfsUsage] = field(default_factory=list)
    cpu_physical: int = 1
    cpu_logical: int = 1
    cpus_allowed: int | None = None  # logical CPUs this process may run on
    cores_allowed: int | None = None  # physical cores those CPUs sit on, when the topology tells
    cpu_quota: float | None = None  # the cgroup's CPU time limit, in CPUs
    gpus: list[GPUInfo] = field(default_factory=list)
    path: str | None = None
    path_mount: Mount | None = None
    path_network: bool | None = None
    path_rotational: bool | None = None
    path_free: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """Nested dicts, lists and numbers, ready for ``json.dumps``."""
        return asdict(self)


def gather_facts(
    root: str | os.PathLike = "/", path: str | os.PathLike | None = None, *, include_gpus: bool = True
) -> SystemFacts:
    """Collect the machine's facts and, when ``path`` is given, those of the filesystem holding it.

    Memory comes from psutil where ``{root}/proc/meminfo`` cannot be read (not Linux).

    Args:
        root: Filesystem root holding ``proc/`` and ``sys/``.
        path: A pack or staging destination; it need not exist yet (unknown fields stay None).
        include_gpus: Probe GPUs (may import torch and initialise CUDA).
    """
    try:
        memory = read_meminfo(root)
    except (OSError, ValueError):
        vm, sw = psutil.virtual_memory(), psutil.swap_memory()
        memory = MemoryInfo(vm.total, vm.available, sw.total, sw.free, getattr(vm, "shared", 0))
    facts = SystemFacts(memory, read_cgroup_memory(root), tmpfs_usage(root), *cpu_counts())
    allowed = read_cpus_allowed(root)
    if allowed:
        facts.cpus_allowed, facts.cores_allowed = len(allowed), count_physical_cores(allowed, root)
    facts.cpu_quota = read_cgroup_cpu_quota(root)
    facts.gpus = gpus() if include_gpus else []
    if path is not None:
        facts.path = os.path.abspath(path)
        with contextlib.suppress(LookupError):
            facts.path_mount = find_mount(_existing(path), read_mounts(root))
            facts.path_network = is_network_fs(facts.path_mount.fstype)
        facts.path_rotational = is_rotational(path, root)
        with contextlib.suppress(OSError):
            facts.path_free = disk_free(path)
    return facts
