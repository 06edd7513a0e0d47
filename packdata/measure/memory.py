"""Memory of the main process and every worker, sampled on a thread while a loader runs.

Memory is split the way the kernel sees it (from ``/proc/PID/smaps_rollup``
and ``/proc/PID/status`` on Linux):

- ``uss``: private pages, what this process alone holds (the OOM killer's view);
- ``anon``: anonymous pages (heap, copy-on-write copies, what swap takes);
- ``file``: file-backed resident pages. An mmap'd LMDB shows gigabytes here
  that are only page cache, shared and reclaimable: not a leak;
- ``shmem``: shared-memory pages (batches on their way from workers).

``pss`` sums without counting shared pages twice across processes.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import psutil

from packdata.host.facts import read_cgroup_memory
from packdata.host.processes import process_memory, tree_cpu_seconds, worker_processes

__all__: list[str] = []


class _MemorySampler:
    """Samples the main process and all its descendants every ``interval`` seconds."""

    def __init__(self, interval: float = 0.25) -> None:
        self.interval = interval
        self.main = psutil.Process()
        # (main's memory, each readable descendant's memory, MemAvailable cut to the cgroup's headroom, swap used,
        # descendants seen)
        self.ticks: list[tuple[dict[str, int], list[dict[str, int]], int, int, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.swap_start = psutil.swap_memory().used

    def sample(self) -> None:
        main = process_memory(self.main) or {}
        workers = []
        children = worker_processes(self.main)
        for child in children:
            mem = process_memory(child)
            if mem is not None:
                workers.append(mem)
        available = read_cgroup_memory().available(psutil.virtual_memory().available)  # in a container: its own
        tick = (main, workers, available, psutil.swap_memory().used, len(children))
        with self._lock:
            self.ticks.append(tick)

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the main process and all its descendants so far, ended ones included
        (:func:`packdata.host.processes.tree_cpu_seconds`)."""
        return tree_cpu_seconds(self.main)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> _MemorySampler:
        self.sample()  # once in this thread: every import done before any fork
        self._thread = threading.Thread(target=self._run, name="packdata-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def summary(self) -> dict[str, Any]:
        """Peaks and means over the run, in bytes."""
        with self._lock:
            ticks = list(self.ticks)
        main_uss = [t[0].get("uss", 0) for t in ticks]
        workers_uss = [sum(w["uss"] for w in t[1]) for t in ticks]
        per_worker = [max((w["uss"] for w in t[1]), default=0) for t in ticks]

        def peak(key: str, group: str) -> int:
            values = []
            for main, workers, *_ in ticks:
                if group == "main":
                    values.append(main.get(key, 0))
                elif group == "workers":
                    values.append(sum(w[key] for w in workers))
                else:
                    values.append(main.get(key, 0) + sum(w[key] for w in workers))
            return max(values, default=0)

        total_uss = [m + w for m, w in zip(main_uss, workers_uss, strict=True)]
        return {
            "samples": len(ticks),
            "processes_peak": max((1 + t[4] for t in ticks), default=1),  # a worker whose memory was unreadable counts
            "main": {
                "uss_peak": max(main_uss, default=0),
                "uss_mean": int(np.mean(main_uss)) if ticks else 0,
                "anon_peak": peak("anon", "main"),
                "file_peak": peak("file", "main"),
            },
            "workers": {
                "uss_peak": max(workers_uss, default=0),
                "uss_mean": int(np.mean(workers_uss)) if ticks else 0,
                "per_worker_uss_peak": max(per_worker, default=0),
                "anon_peak": peak("anon", "workers"),
                "file_peak": peak("file", "workers"),
            },
            "total": {
                "uss_peak": max(total_uss, default=0),
                "uss_mean": int(np.mean(total_uss)) if ticks else 0,
                "pss_peak": peak("pss", "total"),
                "anon_peak": peak("anon", "total"),
                "file_peak": peak("file", "total"),
                "shmem_peak": peak("shmem", "total"),
            },
            "mem_available_min": min((t[2] for t in ticks), default=0),
            "swap_growth": max(max((t[3] for t in ticks), default=self.swap_start) - self.swap_start, 0),
        }
