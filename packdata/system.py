"""Machine facts (memory, cgroup limits, mounts, disks, CPUs, GPUs) and safety warnings.

Every reader of ``/proc`` or ``/sys`` takes ``root``, the filesystem root those
trees live under, so tests can feed crafted files. :func:`gather_facts` collects
everything into :class:`SystemFacts`; :func:`memory_warnings` turns the facts into
:class:`SafetyWarning` objects whose messages say what is wrong and what to do.

The memory a tmpfs may safely take is ``min(MemAvailable, cgroup headroom) -
reserve``. The cgroup headroom is its limit minus its usage, less the reclaimable
inactive file cache that ``memory.stat`` reports. The default reserve is
``max(DEFAULT_RESERVE_MIN, DEFAULT_RESERVE_FRACTION x total)`` capped at half the
total, where the total is MemTotal, or the cgroup limit when that is lower.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal, NamedTuple

import psutil

__all__ = [
    "DEFAULT_RESERVE_FRACTION",
    "DEFAULT_RESERVE_MIN",
    "CgroupMemory",
    "GPUInfo",
    "MemoryInfo",
    "Mount",
    "SafetyWarning",
    "SystemFacts",
    "TmpfsUsage",
    "cpu_counts",
    "default_reserve",
    "disk_free",
    "find_mount",
    "format_size",
    "gather_facts",
    "gpus",
    "is_network_fs",
    "is_rotational",
    "memory_warnings",
    "parse_size",
    "read_cgroup_memory",
    "read_cgroup_memory_limit",
    "read_meminfo",
    "read_mounts",
    "safe_tmpfs_size",
    "tmpfs_usage",
]

#: Share of the memory total kept free for the OS, page cache and DataLoader workers.
DEFAULT_RESERVE_FRACTION = 0.10
#: Smallest default reserve in bytes (4 GiB); the reserve never exceeds half the total.
DEFAULT_RESERVE_MIN = 4 << 30
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
        limit: Smallest limit on the cgroup or an ancestor, in bytes; None when unlimited.
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


def _stat_value(path: Path, key: str) -> int | None:
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None


def read_cgroup_memory(root: str | os.PathLike = "/", proc_self_cgroup: str | None = None) -> CgroupMemory:
    """Find this process's cgroup memory limit and usage, v2 first, then v1.

    v2: the ``0::/path`` line leads to ``sys/fs/cgroup/<path>/memory.max``; v1: the
    ``memory`` line leads to ``sys/fs/cgroup/memory/<path>/memory.limit_in_bytes``.
    Each parent folder is read too and the smallest limit wins; ``max`` and v1 values
    of 2**60 or more mean none. Folders hidden by a cgroup namespace are skipped.

    Args:
        root: Filesystem root holding ``proc/`` and ``sys/``.
        proc_self_cgroup: Text to use instead of ``{root}/proc/self/cgroup``.

    Returns:
        The figures; all None when no memory controller was found.
    """
    text = proc_self_cgroup if proc_self_cgroup is not None else _read(_p(root, "proc/self/cgroup"))
    paths: dict[int, str] = {}
    for line in (text or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            paths[2] = path.strip()
        elif "memory" in controllers.split(","):
            paths[1] = path.strip()
    layouts = (
        (2, "sys/fs/cgroup", "memory.max", "memory.current", "inactive_file"),
        (1, "sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
    )
    for version, base, limit_file, usage_file, inactive_key in layouts:
        if version not in paths:
            continue
        parts = [p for p in paths[version].split("/") if p not in ("", ".", "..")]
        dirs = [_p(root, base).joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
        dirs = [d for d in dirs if (d / limit_file).is_file() or (d / usage_file).is_file()]
        if not dirs:
            continue
        limits = [
            (lim, d) for d in dirs if (lim := _read_int(d / limit_file)) is not None and lim < CGROUP_V1_UNLIMITED
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


@dataclass(frozen=True)
class GPUInfo:
    """One CUDA device and its memory, in bytes."""

    index: int
    name: str
    total_bytes: int
    free_bytes: int


def _gpus_nvml() -> list[GPUInfo] | None:
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
    except Exception:
        return None  # no pynvml or no driver: let torch try
    try:
        found = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name, mem = pynvml.nvmlDeviceGetName(handle), pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
            found.append(GPUInfo(i, name, int(mem.total), int(mem.free)))
        return found
    finally:
        pynvml.nvmlShutdown()


def _gpus_torch() -> list[GPUInfo]:
    import torch

    if not torch.cuda.is_available():
        return []
    found = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        found.append(GPUInfo(i, torch.cuda.get_device_name(i), int(total), int(free)))
    return found


def gpus() -> list[GPUInfo]:
    """CUDA devices via NVML (``pynvml``) if importable, else ``torch.cuda`` (initialises CUDA), else [].

    Never raises.
    """
    for probe in (_gpus_nvml, _gpus_torch):
        with contextlib.suppress(Exception):
            if (found := probe()) is not None:
                return found
    return []


@dataclass
class SystemFacts:
    """What :func:`memory_warnings` and staging need to know about the machine and a path."""

    memory: MemoryInfo
    cgroup: CgroupMemory = field(default_factory=lambda: CgroupMemory(None, None))
    tmpfs: list[TmpfsUsage] = field(default_factory=list)
    cpu_physical: int = 1
    cpu_logical: int = 1
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


@dataclass(frozen=True)
class SafetyWarning:
    """A problem found in the facts; ``refuse`` means the operation must not go ahead."""

    code: str
    message: str
    severity: Literal["warn", "refuse"] = "warn"


def default_reserve(facts: SystemFacts) -> int:
    """``max(DEFAULT_RESERVE_MIN, DEFAULT_RESERVE_FRACTION x total)`` capped at half the total.

    The total is MemTotal, or the cgroup limit when that is lower.
    """
    total = min(facts.memory.mem_total, facts.cgroup.limit or facts.memory.mem_total)
    return min(max(DEFAULT_RESERVE_MIN, int(total * DEFAULT_RESERVE_FRACTION)), total // 2)


def _available(facts: SystemFacts) -> int:
    headroom = facts.cgroup.headroom
    return facts.memory.mem_available if headroom is None else min(facts.memory.mem_available, headroom)


def safe_tmpfs_size(facts: SystemFacts, reserve: int | None = None) -> int:
    """Largest tmpfs in bytes that leaves ``reserve`` (default :func:`default_reserve`) free; never negative."""
    return max(0, _available(facts) - (default_reserve(facts) if reserve is None else reserve))


def memory_warnings(
    facts: SystemFacts, *, tmpfs_size: int | None = None, reserve: int | None = None
) -> list[SafetyWarning]:
    """Check memory before staging; the warnings come most serious first.

    Args:
        facts: From :func:`gather_facts`.
        tmpfs_size: Bytes of tmpfs about to be requested; None when no tmpfs is involved.
        reserve: Bytes to keep free; None for :func:`default_reserve`.

    Returns:
        Those of ``tmpfs-too-large`` (severity refuse), ``swap-on-tmpfs``, ``oom-near``,
        ``cgroup-limit`` and ``tmpfs-volatile`` that apply.
    """
    mem, fs = facts.memory, format_size
    out: list[SafetyWarning] = []
    if tmpfs_size is not None:
        available, res = _available(facts), default_reserve(facts) if reserve is None else reserve
        if tmpfs_size > (safe := max(0, available - res)):
            msg = (
                f"a {fs(tmpfs_size)} tmpfs does not fit in memory: {fs(available)} is available and {fs(res)} "
                f"must stay free for the OS and data-loading workers, leaving {fs(safe)}; ask for at most "
                f"{fs(safe)}, free memory first, or stage onto a local NVMe disk instead"
            )
            out.append(SafetyWarning("tmpfs-too-large", msg, "refuse"))
        if mem.swap_total > 0:
            msg = (
                f"this machine has {fs(mem.swap_total)} of swap, so under memory pressure tmpfs pages are "
                "swapped out and reads run at disk speed; keep the tmpfs well below available memory, "
                "or turn swap off (swapoff -a) if the pack must stay in RAM"
            )
            out.append(SafetyWarning("swap-on-tmpfs", msg))
    used = mem.swap_used
    if used > 0 and (mem.mem_available < mem.mem_total * 0.10 or mem.mem_available < used):
        msg = (
            f"memory is nearly exhausted: {fs(mem.mem_available)} of {fs(mem.mem_total)} available and "
            f"{fs(used)} of swap in use, so the OOM killer may end processes; stop other jobs or use "
            "fewer DataLoader workers before staging or training"
        )
        out.append(SafetyWarning("oom-near", msg))
    if (limit := facts.cgroup.limit) is not None and limit < mem.mem_total:
        msg = (
            f"this process runs in a container (cgroup) limited to {fs(limit)}, less than the host's "
            f"{fs(mem.mem_total)}; the container is killed at its limit even while the host has memory "
            f"free, and tmpfs pages count against it, so size tmpfs and workers against {fs(limit)}"
        )
        out.append(SafetyWarning("cgroup-limit", msg))
    if tmpfs_size is not None:
        msg = (
            "tmpfs lives in RAM and its contents are lost at reboot or unmount; keep the original "
            "pack on persistent storage and stage it again after a restart"
        )
        out.append(SafetyWarning("tmpfs-volatile", msg))
    return out


_UNITS = {"": 1, "b": 1}
_UNITS.update({f"{p}{suffix}": 1024**i for i, p in enumerate("kmgtpe", 1) for suffix in ("", "ib")})
_UNITS.update({f"{p}b": 1000**i for i, p in enumerate("kmgtpe", 1)})
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Parse ``30G``, ``30GB``, ``30GiB``, ``512M``, ``1.5T`` or ``1000`` (bytes) into bytes.

    Case-insensitive. ``KB/MB/GB/TB`` are decimal, ``KiB/MiB/GiB/TiB`` binary, and bare
    ``K/M/G/T`` binary as in tmpfs's ``size=``. Fractions of a unit round down.

    Raises:
        ValueError: Not a non-negative number with a known unit, or a fraction of a byte.
    """
    match = _SIZE_RE.fullmatch(text) if isinstance(text, str) else None
    unit = match[2].lower() if match else ""
    value = Decimal(match[1]) * _UNITS[unit] if match and unit in _UNITS else None
    if value is None or (_UNITS[unit] == 1 and value != value.to_integral_value()):
        raise ValueError(f"invalid size {text!r}: expected a number with an optional unit such as 64MB, 1GiB or 30G")
    return int(value)


def format_size(n: int) -> str:
    """Bytes in binary units with one decimal: ``512 B``, ``1.5 GiB``."""
    if abs(n) < 1024:
        return f"{n} B"
    value, units = float(n), ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    for unit in units[:-1]:
        value /= 1024
        if abs(round(value, 1)) < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} {units[-1]}"
