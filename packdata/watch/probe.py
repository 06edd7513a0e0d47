"""What the machine and a training process are doing now: memory, swap, cgroup, CPU, iowait, DataLoader workers.

Every figure comes from ``/proc`` (and the cgroup files) through :mod:`packdata.host`
and :func:`packdata.host.processes.process_memory`; the CPU and iowait shares are
the deltas of ``/proc/stat`` between two samples, over the CPUs the process may run on;
under a cgroup CPU quota (``cpu.max``) the busy share is also the cgroup's CPU time
against that quota, and the larger of the two counts (a container held to 2 CPUs of 64
is saturated when it uses its 2, while the machine looks idle). The workers' run-queue wait
(``/proc/PID/task/TID/schedstat``, summed over each process's threads, at most 256 of them)
tells a worker kept from its CPU from one asleep on storage, which iowait misses on busy
CPUs (it counts idle CPUs' time only); the kernel's per-process block I/O
delay (``delayacct_blkio_ticks``) would be direct, but it is off unless ``kernel.task_delayacct``
is set, so it is not read.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

from packdata.host.cores import usable_cores
from packdata.host.facts import (
    count_physical_cores,
    gather_facts,
    read_cgroup_cpu_quota,
    read_cgroup_cpu_usage,
    read_cgroup_memory,
    read_meminfo,
)
from packdata.host.gpus import nvml_gpus
from packdata.host.processes import (
    process_memory,
    run_queue_waits,
    tree_cpu_seconds,
    tree_read_bytes,
    worker_processes,
)
from packdata.pack.manifest import STAGED_FILE

__all__ = ["ProcessMemory", "Snapshot", "SystemProbe", "packs_in_use"]


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
    mem_available: int  # MemAvailable, cut to the headroom under the job's cgroup memory limit
    swap_used: int
    cgroup_limit: int | None
    cpu_busy: float  # share of the job's CPUs (or of its cgroup's CPU quota) busy since the previous sample
    iowait: float  # share of CPU time waiting for I/O since the previous sample
    cores: int  # the job's usable cores (its CPUs, cut to its cgroup's CPU quota)
    processes: list[ProcessMemory] = field(default_factory=list)
    gpus: list[dict[str, Any]] = field(default_factory=list)  # index, name, utilization, used and total bytes
    packs: list[dict[str, Any]] = field(default_factory=list)  # packs the job has open: path, staged, origin
    read_bytes: int | None = None  # what the job's process tree read from storage since the previous sample
    job_cores: float | None = None  # CPUs' worth of time the job's own processes used since the previous sample
    cpu_wait: float | None = None  # CPUs' worth of time its workers (or main process) waited for a CPU since then

    @property
    def workers(self) -> list[ProcessMemory]:
        return [p for p in self.processes if p.role == "worker"]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cpu_times(root: str, cpus: Collection[int] | None = None) -> tuple[int, int, int]:
    """``(total, idle, iowait)`` jiffies of ``/proc/stat``: its aggregate line, or the lines of ``cpus`` only.

    A job confined to some CPUs (a cpuset: SLURM, ``docker --cpuset-cpus``, ``taskset``) that saturates them
    leaves the machine's aggregate mostly idle: its own CPUs are the ones that tell.
    """
    total = idle = iowait = 0
    with open(os.path.join(root, "proc/stat"), encoding="ascii") as f:
        for line in f:
            name, *values = line.split()
            if not name.startswith("cpu"):
                break
            if (name != "cpu") if cpus is None else (name == "cpu" or int(name[3:]) not in cpus):
                continue
            fields = [int(v) for v in values]
            total += sum(fields[:8])
            idle += fields[3]
            iowait += fields[4] if len(fields) > 4 else 0
    return total, idle, iowait


def _worker_like(proc: psutil.Process) -> bool:
    """A child that is a Python process: DataLoader workers are (compiler or shell children are not)."""
    try:
        return "python" in proc.name().lower() or "python" in " ".join(proc.cmdline()[:1]).lower()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def packs_in_use(pids: list[int], root: str = "/") -> list[dict[str, Any]]:
    """The packs the processes hold open or mapped: each pack's folder, and where a staged one came from.

    A pack is found from a file's path: the nearest of its three parent folders
    holding a ``manifest.json``; a ``staged.json`` beside it marks a staged copy.
    """
    seen: dict[str, dict[str, Any]] = {}
    for pid in pids:
        paths: set[str] = set()
        maps = os.path.join(root, f"proc/{pid}/maps")
        with contextlib.suppress(OSError), open(maps, encoding="utf-8", errors="replace") as f:
            paths.update(line.split(maxsplit=5)[5].strip() for line in f if len(line.split(maxsplit=5)) == 6)
        with contextlib.suppress(OSError):
            fd_dir = os.path.join(root, f"proc/{pid}/fd")
            for fd in os.listdir(fd_dir):
                with contextlib.suppress(OSError):
                    paths.add(os.readlink(os.path.join(fd_dir, fd)))
        for path in paths:
            folder = os.path.dirname(path) if path.startswith("/") else ""
            for _ in range(3):
                if not folder or folder == "/":
                    break
                if folder in seen or os.path.isfile(os.path.join(folder, "manifest.json")):
                    if folder not in seen:
                        seen[folder] = _pack_entry(folder)
                    break
                folder = os.path.dirname(folder)
    return sorted(seen.values(), key=lambda p: p["path"])


def _pack_entry(folder: str) -> dict[str, Any]:
    entry: dict[str, Any] = {"path": folder, "staged": False, "origin": None}
    with contextlib.suppress(OSError, ValueError), open(os.path.join(folder, STAGED_FILE), encoding="utf-8") as f:
        marker = json.load(f)
        entry["staged"], entry["origin"] = True, marker.get("origin") if isinstance(marker, dict) else None
    return entry


class SystemProbe:
    """Samples the system and one process tree (the training process and its children).

    Args:
        pid: the training process (default: this one).
        root: the filesystem root to read ``/proc`` from (tests pass a fake tree).
        gpus: sample GPUs through NVML (never through torch: that would initialise CUDA here).
        packs: list the packs the processes have open or mapped.
        cpus: the CPUs whose busy share counts (default: the process's affinity, the CPUs it may run on).
    """

    def __init__(
        self,
        pid: int | None = None,
        root: str = "/",
        *,
        gpus: bool = True,
        packs: bool = True,
        cpus: Collection[int] | None = None,
    ) -> None:
        self.pid = pid or os.getpid()
        self._gpus, self._packs = gpus, packs
        self.root = root
        self.process = psutil.Process(self.pid)
        if cpus is None:
            with contextlib.suppress(psutil.Error, AttributeError):  # no affinity on macOS
                cpus = self.process.cpu_affinity()
        self._cpus = frozenset(cpus) if cpus else None
        self._last = _cpu_times(root, self._cpus)
        self._shares = (0.0, 0.0)  # CPU busy and iowait shares of the last interval that had clock ticks
        try:  # the watched process's cgroup, not this one's: packdata monitor may run outside the job's container
            with open(os.path.join(root, f"proc/{self.pid}/cgroup"), encoding="utf-8", errors="replace") as f:
                self._cgroup = f.read()
        except OSError:
            self._cgroup = ""
        self._quota = read_cgroup_cpu_quota(root, self._cgroup)
        self._usage = (time.monotonic(), read_cgroup_cpu_usage(root, self._cgroup))
        facts = gather_facts(root, include_gpus=False)
        if self._cpus:
            facts.cpus_allowed = len(self._cpus)
            facts.cores_allowed = count_physical_cores(tuple(sorted(self._cpus)), root)
        facts.cpu_quota = self._quota
        self._cores = usable_cores(facts)
        job = self._processes()
        self._read = tree_read_bytes(self.process)  # the job's reads from storage so far, the ended workers' too
        self._queued: dict[int, dict[int, float]] = {}  # the loading processes' run-queue waits, by thread
        self._latest: dict[int, dict[int, float]] = {}  # their waits read again since (note_run_queue)
        self._queued = self._baseline(self._run_queue(job))
        self._job_cpu = (time.monotonic(), tree_cpu_seconds(self.process))

    def _processes(self) -> list[tuple[str, psutil.Process]]:
        children = [c for c in worker_processes(self.process) if _worker_like(c)]
        return [("main", self.process), *(("worker", c) for c in children)]

    def _run_queue(self, job: list[tuple[str, psutil.Process]]) -> dict[int, dict[int, float] | None]:
        """Each loading process's run-queue wait by thread: the workers', or the main process's when it has none."""
        loading = [p for role, p in job if role == "worker"] or [p for _, p in job]
        return {p.pid: run_queue_waits(p.pid, self.root) for p in loading}

    def _baseline(self, queued: dict[int, dict[int, float] | None]) -> dict[int, dict[int, float]]:
        """The readings the next sample counts from: a process unreadable now keeps its last one."""
        return {pid: waits or self._latest.get(pid) or self._queued.get(pid, {}) for pid, waits in queued.items()}

    def note_run_queue(self) -> None:
        """Read the loading processes of the last sample again, for the next sample: a worker that ends before it
        (a DataLoader's workers exit as its epoch ends) counts what it had waited by then. A few file reads."""
        for pid in self._queued:
            waits = run_queue_waits(pid, self.root)
            if waits is not None:
                self._latest[pid] = waits

    def _waited(self, queued: dict[int, dict[int, float] | None]) -> float | None:
        """Seconds the loading processes waited for a CPU since the previous sample, or None when unknown.

        A process or thread new since counts all its wait. One that ended counts to its last reading, the previous
        sample's or :meth:`note_run_queue`'s (the kernel adds a reaped child's or an ended thread's wait nowhere);
        a worker that ended unread since the previous sample leaves the figure unknown. The main process does not
        count once it has workers (they load the data)."""
        waited = 0.0
        for pid in set(self._queued) | set(queued):
            if pid == self.pid and not (pid in queued and pid in self._queued):
                continue  # the main process, not the loading one throughout: its workers were
            before = self._queued.get(pid, {})
            now = queued.get(pid) or self._latest.get(pid)  # ended (or unreadable): its last reading
            if now is None:
                return None
            last = {**self._latest.get(pid, {}), **now}  # a thread ended since note_run_queue: its reading then
            waited += sum(max(0.0, n - before.get(tid, 0.0)) for tid, n in last.items())
        return waited

    def sample(self) -> Snapshot:
        """Measure now (CPU shares cover the time since the previous sample or construction)."""
        total, idle, iowait = _cpu_times(self.root, self._cpus)
        d_total = total - self._last[0]
        if d_total > 0:  # else no clock tick (10 ms) since the previous sample: its shares stand
            self._shares = (
                1.0 - (idle - self._last[1] + iowait - self._last[2]) / d_total,
                (iowait - self._last[2]) / d_total,
            )
            self._last = (total, idle, iowait)
        busy, wait = self._shares
        now, usage = time.monotonic(), read_cgroup_cpu_usage(self.root, self._cgroup)
        (then, used), self._usage = self._usage, (now, usage)
        if self._quota and usage is not None and used is not None and now > then:
            busy = max(busy, (usage - used) / (self._quota * (now - then)))
        (since, spent), self._job_cpu = self._job_cpu, (now, tree_cpu_seconds(self.process))
        job_cores = (self._job_cpu[1] - spent) / (now - since) if now > since else None
        mem = read_meminfo(self.root)
        cgroup = read_cgroup_memory(self.root, self._cgroup)
        processes = []
        job = self._processes()
        read, self._read = self._read, tree_read_bytes(self.process)
        read_bytes = None if read is None or self._read is None else max(0, self._read - read)
        queued = self._run_queue(job)
        waited = self._waited(queued)
        cpu_wait = waited / (now - since) if waited is not None and now > since else None
        self._queued = self._baseline(queued)
        self._latest = {}
        for role, proc in job:
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
            cgroup.available(mem.mem_available),
            mem.swap_used,
            cgroup.limit,
            max(0.0, min(1.0, busy)),
            max(0.0, min(1.0, wait)),
            self._cores,
            processes,
            [asdict(g) for g in (nvml_gpus() or [])] if self._gpus else [],
            packs_in_use([p.pid for p in processes], self.root) if self._packs else [],
            read_bytes,
            None if job_cores is None else max(0.0, job_cores),
            cpu_wait,
        )
