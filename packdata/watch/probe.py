"""What the machine and a training process are doing now: memory, swap, cgroup, CPU, iowait, DataLoader workers.

Every figure comes from ``/proc`` (and the cgroup files) through :mod:`packdata.host`
and :func:`packdata.host.processes.process_memory`; the CPU and iowait shares are
the deltas of ``/proc/stat`` between two samples.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

from packdata.host.cores import usable_cores
from packdata.host.facts import read_cgroup_memory, read_meminfo
from packdata.host.processes import process_memory

__all__ = ["ProcessMemory", "Snapshot", "SystemProbe"]


@dataclass
class ProcessMemory:
    """One process of the job: its pid, role (``main`` or ``worker``) and memory in bytes."""

    pid: int
    role: str
    private: int  # USS: pages this process alone holds (the OOM killer's view)
    file_backed: int  # page cache mapped in (an mmap'd pack): shared and reclaimable
    cmdline: str = ""


@dataclass
class Snapshot:
    """One sample: system memory, CPU and the job's processes."""

    time: float
    mem_total: int
    mem_available: int
    swap_used: int
    cgroup_limit: int | None
    cpu_busy: float  # share of all usable CPUs busy since the previous sample
    iowait: float  # share of CPU time waiting for I/O since the previous sample
    cores: int
    processes: list[ProcessMemory] = field(default_factory=list)

    @property
    def workers(self) -> list[ProcessMemory]:
        return [p for p in self.processes if p.role == "worker"]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cpu_times(root: str) -> tuple[int, int, int]:
    """``(total, idle, iowait)`` jiffies from the aggregate line of ``/proc/stat``."""
    with open(os.path.join(root, "proc/stat"), encoding="ascii") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle, iowait = fields[3], fields[4] if len(fields) > 4 else 0
    return sum(fields[:8]), idle, iowait


def _worker_like(proc: psutil.Process) -> bool:
    """A child that is a Python process: DataLoader workers are (compiler or shell children are not)."""
    try:
        return "python" in proc.name().lower() or "python" in " ".join(proc.cmdline()[:1]).lower()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


class SystemProbe:
    """Samples the system and one process tree (the training process and its children).

    Args:
        pid: the training process (default: this one).
        root: the filesystem root to read ``/proc`` from (tests pass a fake tree).
    """

    def __init__(self, pid: int | None = None, root: str = "/") -> None:
        self.pid = pid or os.getpid()
        self.root = root
        self._process = psutil.Process(self.pid)
        self._last = _cpu_times(root)
        self._cores = usable_cores()

    def sample(self) -> Snapshot:
        """Measure now (CPU shares cover the time since the previous sample or construction)."""
        total, idle, iowait = _cpu_times(self.root)
        d_total = max(total - self._last[0], 1)
        busy = 1.0 - (idle - self._last[1] + iowait - self._last[2]) / d_total
        wait = (iowait - self._last[2]) / d_total
        self._last = (total, idle, iowait)
        mem = read_meminfo(self.root)
        cgroup = read_cgroup_memory(self.root)
        processes = []
        try:
            children = [c for c in self._process.children(recursive=True) if _worker_like(c)]
        except psutil.NoSuchProcess:
            children = []
        for role, proc in [("main", self._process), *(("worker", c) for c in children)]:
            figures = process_memory(proc)
            if figures is None:
                continue
            try:
                cmd = " ".join(proc.cmdline())[:120]
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                cmd = ""
            processes.append(ProcessMemory(proc.pid, role, figures["uss"], figures["file"], cmd))
        return Snapshot(
            time.time(),
            mem.mem_total,
            mem.mem_available,
            mem.swap_used,
            cgroup.limit,
            max(0.0, min(1.0, busy)),
            max(0.0, min(1.0, wait)),
            self._cores,
            processes,
        )
