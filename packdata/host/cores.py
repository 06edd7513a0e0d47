"""The one usable-cores rule and the first ``num_workers`` derived from it.

Usable cores are the physical cores this process may run on: the logical CPUs
of its affinity (its cpuset included), counted once per physical core
(hyperthread siblings share one core's decode throughput), then cut to the
cgroup's CPU quota (``cpu.max``), which caps CPU time whatever the cpuset
says. Where the CPU topology cannot be read, the allowed CPUs are divided by
the machine's threads per core. ``doctor``, ``recommend_loader_kwargs``,
``tune`` and ``bench`` all count cores with :func:`usable_cores`.

A first ``num_workers`` is 3/4 of the usable cores (the rest is left to the
main process), cut to what half the usable memory holds at
:data:`WORKER_BYTES` per worker.
"""

from __future__ import annotations

import math
import os

from packdata.errors import ConfigError
from packdata.host.facts import SystemFacts, cpu_counts, gather_facts, read_cgroup_cpu_quota, read_cpus_allowed
from packdata.host.memory import safe_tmpfs_size
from packdata.units import format_size

__all__ = [
    "MAX_WORKERS_PER_CPU",
    "WORKER_BYTES",
    "check_workers",
    "recommend_workers",
    "rule_of_thumb_workers",
    "usable_cores",
    "usable_cpus",
]

WORKER_BYTES = 160 << 20
"""Private memory assumed per DataLoader worker before one is measured (decode buffers, Python heap)."""

MAX_WORKERS_PER_CPU = 8
"""Most DataLoader workers a setting may start per logical CPU this process may run on."""


def usable_cores(facts: SystemFacts | None = None, *, root: str | os.PathLike = "/") -> int:
    """Physical cores this process may use (at least 1); see the module docstring.

    Args:
        facts: from :func:`packdata.host.facts.gather_facts`; gathered from ``root`` when None.
        root: filesystem root holding ``proc/`` and ``sys/`` (tests pass crafted trees).
    """
    if facts is None:
        facts = gather_facts(root, include_gpus=False)
    cores = facts.cores_allowed
    if cores is None:
        allowed = facts.cpus_allowed or facts.cpu_logical
        per_core = max(1, facts.cpu_logical // max(facts.cpu_physical, 1))
        cores = min(facts.cpu_physical, allowed // per_core or 1)
    if facts.cpu_quota is not None:
        cores = min(cores, math.floor(facts.cpu_quota))
    return max(1, cores)


def rule_of_thumb_workers(cores: int | None = None) -> int:
    """About 3/4 of ``cores`` (default :func:`usable_cores`), at least 1: the rest is left to the main process."""
    cores = cores or usable_cores()
    return max(1, (3 * cores) // 4)


def recommend_workers(facts: SystemFacts, *, cores: int | None = None) -> tuple[int, str]:
    """A first ``num_workers``: 3/4 of the usable physical cores, capped by memory.

    Args:
        facts: the machine's facts.
        cores: cores to plan for (default :func:`usable_cores` of ``facts``).

    Returns:
        ``(num_workers, why)``.
    """
    cores = cores or usable_cores(facts)
    by_cpu = rule_of_thumb_workers(cores)
    available = safe_tmpfs_size(facts, reserve=0)  # min(MemAvailable, cgroup headroom)
    by_memory = max(0, (available // 2) // WORKER_BYTES)
    if by_memory < by_cpu:
        return int(by_memory), (
            f"memory caps it: half of {format_size(available)} usable at {format_size(WORKER_BYTES)} per worker "
            f"holds {by_memory} (3/4 of {cores} cores would be {by_cpu})"
        )
    return by_cpu, f"3/4 of {cores} usable physical cores; memory holds {by_memory} workers"


def usable_cpus() -> int:
    """Logical CPUs this process may run on (its affinity), cut to the cgroup's CPU quota rounded up."""
    quota = read_cgroup_cpu_quota()
    return min(_affinity_cpus(), max(1, math.ceil(quota))) if quota is not None else _affinity_cpus()


def _affinity_cpus() -> int:
    """Logical CPUs of this process's affinity, the machine's where that is unknown."""
    return len(read_cpus_allowed() or ()) or cpu_counts()[1]


def check_workers(workers: int, *, name: str) -> None:
    """Refuse more than :data:`MAX_WORKERS_PER_CPU` workers per logical CPU this process may run on.

    Each worker is a process (a typo of 10000 forked 10000). The CPUs are its
    affinity's, the machine's where that is unknown.

    Args:
        workers: the most workers a setting would start.
        name: the keyword argument that gave it, named in the message (``workers``, ``max_workers``).

    Raises:
        ConfigError: ``workers`` is over the bound.
    """
    cpus = _affinity_cpus()
    most = MAX_WORKERS_PER_CPU * cpus
    if workers > most:
        raise ConfigError(
            f"{name} should be at most {most} ({MAX_WORKERS_PER_CPU} per CPU this process may use, {cpus} here), "
            f"but got {name}={workers}",
            hint="Each worker is a process with its own memory: sweep a few per CPU",
        )
