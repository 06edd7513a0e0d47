"""Memory of one process as the kernel sees it (private, proportional, anonymous, file-backed and shared pages),
and the CPU time of a process tree."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import resource
import time
from collections.abc import Callable, Collection
from pathlib import Path

import psutil

__all__ = [
    "THREADS_READ",
    "open_by_any_process",
    "process_memory",
    "run_queue_seconds",
    "run_queue_waits",
    "tree_cpu_seconds",
    "tree_read_bytes",
    "worker_processes",
]

_ROLLUP = re.compile(rb"^(\w+):\s+(\d+) kB", re.M)


_MP_HELPERS = tuple(
    f"from multiprocessing.{name} import" for name in ("resource_tracker", "forkserver", "semaphore_tracker")
)


def worker_processes(proc: psutil.Process) -> list[psutil.Process]:
    """The descendants of ``proc`` (its DataLoader workers), without multiprocessing's own helpers.

    With the ``spawn`` and ``forkserver`` start methods, multiprocessing starts a
    resource tracker (and a fork server, whose children the workers then are)
    beside the workers: Python processes that are none of them.
    """
    try:
        children = proc.children(recursive=True)
    except psutil.Error:
        return []
    workers = []
    for child in children:
        try:  # a helper is started by proc itself; a fork server's children (same command line) are workers
            helper = child.ppid() == proc.pid and any(arg.startswith(_MP_HELPERS) for arg in child.cmdline())
        except psutil.NoSuchProcess:
            continue
        except psutil.Error:
            helper = False
        if not helper:
            workers.append(child)
    return workers


_READS = 5
"""Walks of the process tree :func:`tree_cpu_seconds` makes at most, while processes are reaped during one."""


def tree_cpu_seconds(proc: psutil.Process) -> float:
    """User + system CPU seconds of ``proc`` and all its descendants so far, the ended ones included.

    Every descendant counts, whatever it runs: DataLoader workers, multiprocessing's helpers (a fork server
    holds its workers' times) and any child the job started (a decoder run as a subprocess is the job's CPU
    use), as the kernel's times of reaped children cannot tell one child from another.

    A descendant still running (or ended and not yet reaped) is read from ``/proc`` (psutil: clock ticks,
    10 ms on most Linux systems), with what its own reaped children spent; one that has been reaped counts
    in its parent's children's times, as the kernel adds it there: this process's from
    ``getrusage(RUSAGE_CHILDREN)`` (microseconds), another's (a fork server's) from its ``/proc`` entry. So a
    worker that ended between two calls counts whole, and no process is told apart by its pid and start time
    (a new process given an ended worker's pid in its start's clock tick is another). A descendant reaped while
    the tree is read would count twice (read live, then in its parent's children's times) or not at all (its
    parent read first, then it gone): the tree is read again while one was (this process's children's times
    changed, or a descendant listed before the reading is gone after it), up to 5 times, then the last reading
    counts. The total never falls between two calls made by the thread that reaps the children.
    """
    return _tree_total(proc, _cpu_seconds, _own_seconds, _reaped_seconds) or 0.0


def tree_read_bytes(proc: psutil.Process) -> int | None:
    """Bytes ``proc`` and all its descendants have had read from storage so far, the ended ones included; None
    where the kernel gives no I/O counters (macOS) or ``proc`` is gone.

    ``read_bytes`` of ``/proc/PID/io``: page cache hits are not in it, and a process's holds what its reaped
    children read (the kernel adds them there, as it adds their CPU times). The descendants that count, and a
    descendant reaped while the tree is read, are as in :func:`tree_cpu_seconds`.
    """
    total = _tree_total(proc, _read_bytes, _own_read_bytes, lambda _: None)
    return None if total is None else int(total)


def _tree_total(
    proc: psutil.Process,
    figure: Callable[[psutil.Process], float],
    own: Callable[[psutil.Process], float | None],
    reaped: Callable[[psutil.Process], float | None],
) -> float | None:
    """``own(proc)`` plus ``figure`` of each descendant, read again while a process was reaped during a reading
    (``reaped(proc)`` changed, or a listed descendant is gone after it); None when ``own`` is unknown."""
    total: float | None = None
    for _ in range(_READS):
        before = reaped(proc)
        try:
            descendants = proc.children(recursive=True)
        except psutil.Error:
            descendants = []
        live = 0.0
        for child in descendants:  # multiprocessing's helpers too: a fork server holds its workers' figures
            try:
                live += figure(child)
            except psutil.Error:  # reaped since: its parent's figure holds it, and the tree is read again
                continue
        mine = own(proc)  # read after the descendants: one reaped in between counts there
        if mine is None:
            return None
        total = live + mine
        try:
            after = {child.pid for child in proc.children(recursive=True)}
        except psutil.Error:
            after = set()
        if reaped(proc) == before and all(child.pid in after for child in descendants):
            break
    return total


def _cpu_seconds(proc: psutil.Process) -> float:
    """``proc``'s CPU seconds and its reaped children's, from ``/proc`` (psutil.Error when it is gone)."""
    times = proc.cpu_times()
    return times.user + times.system + times.children_user + times.children_system


def _read_bytes(proc: psutil.Process) -> float:
    """``read_bytes`` of ``proc``'s ``/proc/PID/io`` (psutil.Error when it is gone or the kernel has none)."""
    try:
        return float(proc.io_counters().read_bytes)
    except AttributeError as exc:  # no I/O counters on macOS
        raise psutil.Error(str(exc)) from exc


def _own_read_bytes(proc: psutil.Process) -> float | None:
    try:
        return _read_bytes(proc)
    except psutil.Error:
        return None


def _reaped_seconds(proc: psutil.Process) -> float | None:
    """What this process's reaped children spent (``getrusage``), when ``proc`` is this process; else None."""
    if proc.pid != os.getpid():
        return None
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return reaped.ru_utime + reaped.ru_stime


def _own_seconds(proc: psutil.Process) -> float | None:
    """``proc``'s own CPU seconds and its reaped children's, or None when it is gone."""
    reaped = _reaped_seconds(proc)
    if reaped is not None:
        return time.process_time() + reaped
    try:
        return _cpu_seconds(proc)
    except psutil.Error:
        return None


THREADS_READ = 256
"""Threads of one process whose run-queue wait :func:`run_queue_waits` reads at most: the oldest ones (the kernel
lists a process's threads in the order they started), so a process of 10,000 threads costs a sample 256 file
reads, not 10,000; the wait of its later threads is not counted."""


def run_queue_waits(pid: int, root: str = "/") -> dict[int, float] | None:
    """Seconds each thread of process ``pid`` has spent runnable but waiting for a CPU (its run-queue wait, the
    second field of ``/proc/PID/task/TID/schedstat``), by thread id; None when the process is gone or the kernel
    does not keep it.

    ``/proc/PID/schedstat`` is the process's first thread's alone: a worker's or the training process's other
    threads (torch's intra-op threads, a pin-memory or prefetch thread) wait in their own. At most
    :data:`THREADS_READ` threads are read. A thread that has ended is in no reading: what it waited is lost (the
    kernel adds it nowhere), so a caller counts it to its last reading.
    """
    task = os.path.join(root, f"proc/{pid}/task")
    waits: dict[int, float] = {}
    try:
        with os.scandir(task) as entries:  # stopped early: a process's 10,000 threads are never all listed
            tids = [int(e.name) for e in itertools.islice(entries, THREADS_READ) if e.name.isdigit()]
    except (OSError, ValueError):
        return None
    for tid in tids:
        try:
            with open(os.path.join(task, str(tid), "schedstat"), encoding="ascii") as f:
                waits[tid] = int(f.read().split()[1]) / 1e9
        except FileNotFoundError:  # the thread ended since the listing
            continue
        except (OSError, ValueError, IndexError):
            return None
    return waits or None


def run_queue_seconds(pid: int, root: str = "/") -> float | None:
    """Seconds the threads of process ``pid`` have spent runnable but waiting for a CPU (their run-queue wait,
    summed over at most :data:`THREADS_READ` threads, see :func:`run_queue_waits`), or None when it is gone or the
    kernel does not keep it.

    A process that uses little CPU either waits for one (other processes hold them: this grows) or waits on
    something else, storage, the network or a lock, asleep (this does not)."""
    waits = run_queue_waits(pid, root)
    return None if waits is None else sum(waits.values())


def process_memory(proc: psutil.Process) -> dict[str, int] | None:
    """uss, pss, anon, file and shmem bytes of one process, or None if it is gone."""
    try:
        with open(f"/proc/{proc.pid}/smaps_rollup", "rb") as f:
            rollup = {k.decode(): int(v) * 1024 for k, v in _ROLLUP.findall(f.read())}
        with open(f"/proc/{proc.pid}/status", "rb") as f:
            status = {k.decode(): int(v) * 1024 for k, v in _ROLLUP.findall(f.read())}
        return {
            "uss": rollup.get("Private_Clean", 0) + rollup.get("Private_Dirty", 0),
            "pss": rollup.get("Pss", 0),
            "anon": status.get("RssAnon", rollup.get("Anonymous", 0)),
            "file": status.get("RssFile", 0),
            "shmem": status.get("RssShmem", 0),
        }
    except FileNotFoundError:
        if not Path("/proc/self/smaps_rollup").exists():
            return _psutil_memory(proc)
        return None
    except (ProcessLookupError, PermissionError, OSError):
        return None


def _psutil_memory(proc: psutil.Process) -> dict[str, int] | None:
    try:
        info = proc.memory_full_info()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    uss = getattr(info, "uss", info.rss)
    return {
        "uss": uss,
        "pss": getattr(info, "pss", uss),
        "anon": info.rss - getattr(info, "shared", 0),
        "file": getattr(info, "shared", 0),
        "shmem": 0,
    }


def open_by_any_process(folder: str | Path, root: str = "/", *, ignore: Collection[str] = ()) -> int | None:
    """The pid of a process that has a file under ``folder`` open or memory-mapped, or None.

    Reads every ``/proc/PID/maps`` and ``/proc/PID/fd`` this process may read;
    a process it may not inspect is taken as not using the folder. Open files
    named in ``ignore`` (lock files, the caller's own among them) do not count.
    """
    prefix = os.path.realpath(folder).rstrip(os.sep) + os.sep
    proc = Path(root) / "proc"
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            with open(Path(entry.path) / "maps", encoding="utf-8", errors="replace") as f:
                if any(prefix in line for line in f):
                    return int(entry.name)
            for fd in os.listdir(Path(entry.path) / "fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(Path(entry.path) / "fd" / fd)
                    if target.startswith(prefix) and os.path.basename(target) not in ignore:
                        return int(entry.name)
        except OSError:
            continue
    return None
