"""Memory safety: how much tmpfs fits, and warnings that say what is wrong and what to do.

The memory a tmpfs may safely take is ``min(MemAvailable, cgroup headroom) -
reserve``. The cgroup headroom is its limit minus its usage, less the reclaimable
inactive file cache that ``memory.stat`` reports. The default reserve is
``max(DEFAULT_RESERVE_MIN, DEFAULT_RESERVE_FRACTION x total)`` capped at half the
total, where the total is MemTotal, or the cgroup limit when that is lower.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from packdata.host.facts import SystemFacts
from packdata.units import format_size

__all__ = [
    "DEFAULT_RESERVE_FRACTION",
    "DEFAULT_RESERVE_MIN",
    "SafetyWarning",
    "default_reserve",
    "memory_warnings",
    "safe_tmpfs_size",
]

#: Share of the memory total kept free for the OS, page cache and DataLoader workers.
DEFAULT_RESERVE_FRACTION = 0.10
#: Smallest default reserve in bytes (4 GiB); the reserve never exceeds half the total.
DEFAULT_RESERVE_MIN = 4 << 30


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
    return facts.cgroup.available(facts.memory.mem_available)


def safe_tmpfs_size(facts: SystemFacts, reserve: int | None = None) -> int:
    """Largest tmpfs in bytes that leaves ``reserve`` (default :func:`default_reserve`) free; never negative."""
    return max(0, _available(facts) - (default_reserve(facts) if reserve is None else reserve))


def memory_warnings(
    facts: SystemFacts, *, tmpfs_size: int | None = None, reserve: int | None = None, adding: bool = False
) -> list[SafetyWarning]:
    """Check memory before staging; the warnings come most serious first.

    Args:
        facts: From :func:`gather_facts`.
        tmpfs_size: Bytes of tmpfs about to be requested; None when no tmpfs is involved.
        reserve: Bytes to keep free; None for :func:`default_reserve`.
        adding: ``tmpfs_size`` is what is about to be written into a tmpfs already mounted, not its size.

    Returns:
        Those of ``tmpfs-too-large`` (severity refuse), ``swap-on-tmpfs``, ``oom-near``,
        ``cgroup-limit`` and ``tmpfs-volatile`` that apply.
    """
    mem, fs = facts.memory, format_size
    out: list[SafetyWarning] = []
    if tmpfs_size is not None:
        available, res = _available(facts), default_reserve(facts) if reserve is None else reserve
        if tmpfs_size > (safe := max(0, available - res)):
            what, ask = (
                (f"{fs(tmpfs_size)} more in this tmpfs", f"stage at most {fs(safe)} into it")
                if adding
                else (f"a {fs(tmpfs_size)} tmpfs", f"ask for at most {fs(safe)}")
            )
            msg = (
                f"{what} does not fit in memory: {fs(available)} is available and {fs(res)} "
                f"must stay free for the OS and data-loading workers, leaving {fs(safe)}; {ask}, "
                "free memory first, or stage onto a local NVMe disk instead"
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
