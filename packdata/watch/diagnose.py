"""The bottleneck, named from measurements, with the concrete next step (pure functions: no I/O).

The rules follow the Linux data-loading guide this project follows, first match wins:

1. **memory**: MemAvailable under 10% of the memory total (or the cgroup limit),
   swap in use above what is still available, or the job's private memory
   above 90% of the memory budget it was given: the OOM killer is near ->
   fewer workers or ``pin_memory=False``.
2. **compute-bound**: the training step waits for data less than 10% of the
   time: the loader is not the bottleneck.
   **start-up**: it waits 10% or more, but under 10% after the first batch:
   the wait is the loader's start (workers starting, files opening), which
   recurs each epoch unless the workers persist -> ``persistent_workers=True``.
3. **I/O-bound**: the step waits, and iowait is 20% or more of CPU time ->
   stage the pack onto NVMe or a tmpfs; but when the job read nothing from
   storage meanwhile (its pages were cached), the iowait is another process's ->
   find it (staging would not help).
4. **main-process-bound**: the step waits, the loader has workers, and the
   training process's own thread was runnable (computing, or waiting for its
   CPU) through half of that wait or more (a collate, transform or copy run
   after the workers hand a batch over) ->
   move that work into the workers; more workers would not help.
5. **data-bound, CPU saturated**: the step waits and the CPUs are 85% busy
   or more -> cheaper decoding (reduced-size JPEG decode, a pack re-encoded
   with ``--max-side``) or more CPUs; but when the job's own processes used
   under a quarter of a CPU per worker, its workers wait on something else and
   other processes keep the CPUs busy -> find them; but when they also waited
   for a CPU under half a CPU per worker (their run-queue wait in
   ``/proc/PID/task/TID/schedstat``, every thread's) and read 1 MiB or more
   from storage, they wait on the disk (iowait does not show it: it counts
   idle CPUs' time only) ->
   **I/O-bound**, stage the pack.
6. **data-bound, CPUs idle**: the step waits and CPUs are free -> more
   workers, as many as the free cores and the memory allow.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from packdata.units import format_size

__all__ = ["Diagnosis", "Measurements", "diagnose"]

MEMORY_LOW = 0.10
WAIT_LOW = 0.10
IOWAIT_HIGH = 0.20
CPU_SATURATED = 0.85
OTHERS_HOLD = 0.25
"""A job whose processes use under this many CPUs' worth per worker (its main process without workers) is not
decoding: on busy CPUs, other processes are the ones busy."""
MAIN_BUSY = 0.5
"""A loop whose own thread was runnable through this share of its wait after the first batch or more is held up
by work done in the training process, not by its workers."""
CPU_KEPT = 0.5
"""Workers that waited for a CPU this much per worker or more (their run-queue wait) are kept from their CPUs: ones
using under OTHERS_HOLD of a CPU and kept from it wait for it most of the time; ones waiting under this are asleep
on something else most of the time."""
_STAGE = "stage the pack onto fast local storage: packdata stage PACK --to /nvme/cache (or --tmpfs SIZE)"
DISK_READ = 1 << 20
"""What a job whose processes neither ran nor waited for a CPU has read from storage for its wait to be the disk's."""


@dataclass(frozen=True)
class Measurements:
    """What one period (or an epoch) measured."""

    wait_share: float  # share of the loop's time spent waiting in next()
    cpu_busy: float  # share of the job's CPU time busy (its CPUs, or its cgroup's CPU quota)
    iowait: float  # share of CPU time waiting for I/O
    num_workers: int
    cores: int  # usable cores
    mem_available: int
    mem_total: int
    swap_used: int
    worker_private: int = 0  # the largest worker's private memory (bytes)
    cgroup_limit: int | None = None
    job_private: int = 0  # private memory of the training process and its workers together
    memory_budget: int | None = None  # what the job may use, when the user gave one
    read_bytes: int | None = None  # what the job read from storage (page cache hits not counted); None: unknown
    startup_share: float = 0.0  # share of the loop's time spent waiting for its first batch (part of wait_share)
    persistent_workers: bool = False  # the loader keeps its workers from one epoch to the next
    job_cores: float | None = None  # CPUs' worth of time the job's own processes used; None: unknown
    cpu_wait: float | None = None  # CPUs' worth of time the job's processes waited for a CPU; None: unknown
    main_busy: float = 0.0  # share of the wait after the first batch the loop's own thread was runnable


@dataclass(frozen=True)
class Diagnosis:
    """The bottleneck (``memory``, ``compute-bound``, ``start-up``, ``io-bound``, ``main-process-bound``,
    ``data-bound``), why, what to do."""

    kind: str
    message: str
    next_step: str
    num_workers: int | None = None  # the worker count the next step names, if it names one

    def line(self) -> str:
        return f"{self.kind}: {self.message} -> {self.next_step}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def diagnose(m: Measurements) -> Diagnosis:
    """Name the bottleneck of ``m`` by the rules in the module docstring."""
    total = min(m.mem_total, m.cgroup_limit or m.mem_total)
    w = m.num_workers
    over_budget = m.memory_budget is not None and m.job_private > 0.9 * m.memory_budget
    if m.mem_available < MEMORY_LOW * total or (m.swap_used and m.mem_available < m.swap_used) or over_budget:
        fewer = max(0, w // 2)
        budget = (
            f", the job holds {format_size(m.job_private)} of its {format_size(m.memory_budget)} budget"
            if m.memory_budget is not None
            else ""
        )
        return Diagnosis(
            "memory",
            f"available {format_size(m.mem_available)} of {format_size(total)}, swap {format_size(m.swap_used)} "
            f"in use{budget}: OOM risk",
            f"num_workers {w} -> {fewer} or pin_memory=False (each worker holds {format_size(m.worker_private)})",
            fewer,
        )
    waiting = f"the step waits {100 * m.wait_share:.0f}% of the time"
    if m.wait_share < WAIT_LOW:
        return Diagnosis("compute-bound", waiting, "the loader is not the bottleneck: nothing to change")
    after = max(0.0, m.wait_share - m.startup_share)
    if after < WAIT_LOW:
        return Diagnosis(
            "start-up",
            f"{waiting}, {100 * m.startup_share:.0f}% for the first batch and {100 * after:.0f}% after it: the "
            "loader's start (workers starting, the dataset opening its files) is the wait",
            "keep the workers from one epoch to the next: DataLoader(..., persistent_workers=True)"
            if m.num_workers and not m.persistent_workers
            else "the steps after the first do not wait: nothing to change per step (longer epochs amortise it)",
        )
    if m.iowait >= IOWAIT_HIGH and m.read_bytes == 0:
        return Diagnosis(
            "io-bound",
            f"{waiting}, iowait {100 * m.iowait:.0f}% of CPU time, but the job read nothing from storage: the I/O is "
            "another process's (or a network filesystem's, which the kernel does not count per process)",
            "find the process doing the I/O (iotop, pidstat -d): staging this job's pack would not help",
        )
    if m.iowait >= IOWAIT_HIGH:
        return Diagnosis(
            "io-bound",
            f"{waiting}, iowait {100 * m.iowait:.0f}% of CPU time: the pack's storage cannot keep up",
            _STAGE,
        )
    if w and m.main_busy >= MAIN_BUSY:
        return Diagnosis(
            "main-process-bound",
            f"{waiting}, and the training process was busy itself (computing, or waiting for its CPU) through "
            f"{100 * m.main_busy:.0f}% of that wait: work done in it after the workers hand a batch over (a collate, "
            "a transform, a copy) is the limit",
            "move that work into the workers (the dataset's __getitem__ or the DataLoader's collate_fn): more "
            "workers, or decoding less in them, would not help",
        )
    busy = f"CPUs {100 * m.cpu_busy:.0f}% busy"
    hold = OTHERS_HOLD * max(1, min(w, m.cores))
    idle_job = m.job_cores is not None and m.job_cores < hold
    kept = CPU_KEPT * max(1, min(w, m.cores))
    on_disk = m.cpu_wait is not None and m.cpu_wait < kept and (m.read_bytes or 0) >= DISK_READ
    if m.cpu_busy >= CPU_SATURATED and idle_job and on_disk:
        return Diagnosis(
            "io-bound",
            f"{waiting} while {busy}, but the job's own processes used {m.job_cores:.2f} CPUs' worth, waited for a "
            f"CPU {m.cpu_wait:.2f} CPUs' worth and read {format_size(m.read_bytes or 0)} from storage: its workers "
            "wait on the disk (iowait does not show it while other processes keep the CPUs busy)",
            _STAGE,
        )
    if m.cpu_busy >= CPU_SATURATED and idle_job:
        return Diagnosis(
            "data-bound",
            f"{waiting} while {busy}, but the job's own processes used {m.job_cores:.2f} CPUs' worth: other "
            "processes keep the CPUs busy, and its workers wait on something else than their CPU (storage, the "
            "network, a lock)",
            "find what else runs on the job's CPUs (top, pidstat -u) and move it or give the job CPUs of its own; "
            "decoding less would not help",
        )
    if m.cpu_busy >= CPU_SATURATED:
        return Diagnosis(
            "data-bound",
            f"{waiting} while {busy}: decoding is the limit",
            "decode less: packdata.DecodeJPEG(224) (reduced-size JPEG decode), a pack converted with --max-side, "
            "or more CPUs",
        )
    spare = max(1, math.floor(m.cores * (1 - m.cpu_busy)))
    by_memory = (m.mem_available - MEMORY_LOW * total) // m.worker_private if m.worker_private else None
    target = w + spare if by_memory is None else w + max(0, min(spare, int(by_memory)))
    allows = f" (memory allows {w + int(by_memory)})" if by_memory is not None else ""
    return Diagnosis(
        "data-bound",
        f"{waiting} while {w} worker{'s' * (w != 1)} keep{'s' * (w == 1)} {busy} of {m.cores} cores",
        f"num_workers={target}{allows}" if target > w else "no memory for more workers: decode less",
        target if target > w else None,
    )
