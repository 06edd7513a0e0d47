"""``packdata.monitor(loader)``: watch the training loop's data loading from inside it.

Wrap any iterable loader; the loop runs unchanged::

    for batch in packdata.monitor(loader, every="10s", log="loader.jsonl"):
        train_step(batch)

Per step it times how long ``next()`` blocks (waiting for data) against the
rest of the loop (the training step). Every period it samples the machine and
the DataLoader's worker processes (:mod:`packdata.watch.probe`), writes one
plain line to stderr and one JSON record to ``log``; when the loader is
exhausted it writes an epoch summary with the diagnosis
(:mod:`packdata.watch.diagnose`). The cost is two ``perf_counter`` calls and
two reads of this thread's ``/proc/thread-self/schedstat`` per step, one sample
per period, and at an epoch's last batch a reading of the workers' run-queue
wait (so the workers that exit as it ends count).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from packdata.errors import ConfigError
from packdata.units import format_size, parse_size
from packdata.watch.diagnose import Diagnosis, Measurements, diagnose
from packdata.watch.probe import Snapshot, SystemProbe

__all__ = ["EpochSummary", "monitor"]


def _seconds(every: float | str) -> float:
    text = str(every).strip().lower()
    try:
        value = float(text[:-1]) * 60 if text.endswith("m") else float(text.rstrip("s"))
    except ValueError:
        raise ConfigError(f"every should be seconds such as 10 or '10s', but got every={every!r}") from None
    if not 0 < value < math.inf:
        raise ConfigError(f"every should be a positive number of seconds, but got every={every!r}")
    return value


def _known_mean(figures: list[tuple[float, float | None]]) -> float | None:
    """The weighted mean of the figures known (a worker that ended in a sample's span leaves its figure unknown)."""
    known = [(w, f) for w, f in figures if f is not None]
    total = sum(w for w, _ in known)
    return sum(w * f for w, f in known) / total if known and total > 0 else None


def _is_sample(value: Any) -> bool:
    """What a collated column never is: one string, number, image or 0-d tensor (so it is one sample)."""
    if isinstance(value, (str, bytes, bytearray)) or getattr(value, "ndim", None) == 0:
        return True
    return not hasattr(value, "__len__")


def _batch_len(batch: Any) -> int:
    """Samples in ``batch``: a list of samples (``collate_fn=list``), or the first column of a collated one.

    A list whose items are tuples, strings, images, numbers or dicts of them is a list of samples: the
    default collate gives a list of columns (tensors, lists), never of those, and a list of strings for
    string samples. A list of tensors stays ambiguous and is read as columns.
    """
    if isinstance(batch, list) and batch:
        first = batch[0]
        if isinstance(first, dict) and first:
            first = next(iter(first.values()))
        if isinstance(batch[0], tuple) or _is_sample(first):
            return len(batch)
    if isinstance(batch, (tuple, list)) and batch:
        batch = batch[0]
    if isinstance(batch, dict) and batch:
        batch = next(iter(batch.values()))
    try:
        return len(batch)
    except TypeError:
        return 1


class _RunnableClock:
    """Seconds this thread has been runnable, on a CPU or waiting for one (``/proc/thread-self/schedstat``, kept
    open: a loop computing on a busy machine waits for its CPU too), or its CPU seconds where there is none."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def seconds(self) -> float:
        if self._fd is not None:
            with contextlib.suppress(OSError, ValueError, IndexError):
                ran, waited = os.pread(self._fd, 128, 0).split()[:2]
                return (int(ran) + int(waited)) / 1e9
            self.close()  # unreadable: CPU seconds from now on (the steps measured across the switch are off once)
        return time.thread_time()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass
class EpochSummary:
    """What one pass over the loader measured, and the diagnosis."""

    steps: int = 0
    samples: int = 0
    seconds: float = 0.0
    wait_seconds: float = 0.0
    first_wait: float = 0.0  # of wait_seconds, the wait for the epoch's first batch (the loader starting)
    main_runnable: float = 0.0  # seconds this thread was runnable inside next() after the first batch (_RunnableClock)
    diagnosis: Diagnosis | None = None
    snapshots: list[Snapshot] = field(default_factory=list)

    @property
    def wait_share(self) -> float:
        return self.wait_seconds / self.seconds if self.seconds else 0.0


class _Monitor:
    def __init__(
        self, loader: Iterable[Any], every: float, log: Path | None, stream: TextIO, memory_budget: int | None = None
    ) -> None:
        self.loader, self.every, self.log, self.stream = loader, every, log, stream
        self.memory_budget = memory_budget
        self.summaries: list[EpochSummary] = []
        self.num_workers = int(getattr(loader, "num_workers", 0) or 0)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        probe = SystemProbe()
        started = time.time()  # the probe's first CPU share counts from here
        summary = EpochSummary()
        period = EpochSummary()
        start = period_start = time.perf_counter()
        it = iter(self.loader)
        try:  # the last batch: the workers' run-queue wait is read then, before they exit
            batches = len(self.loader)  # type: ignore[arg-type]
        except (TypeError, NotImplementedError):
            batches = 0
        clock = _RunnableClock()
        try:
            while True:
                before, computed = time.perf_counter(), clock.seconds()
                try:
                    batch = next(it)
                except StopIteration:
                    break
                after, computed = time.perf_counter(), clock.seconds() - computed
                if self.num_workers and not summary.steps:  # the workers, while they run: they exit as the epoch ends
                    summary.snapshots.append(probe.sample())
                n = _batch_len(batch)
                if not summary.steps:
                    summary.first_wait = period.first_wait = after - before
                for s in (summary, period):
                    s.wait_seconds += after - before
                    s.main_runnable += computed if summary.steps else 0.0
                    s.steps += 1
                    s.samples += n
                if after - period_start >= self.every:
                    period.seconds = after - period_start
                    self._report(probe.sample(), period, summary, final=False)
                    period, period_start = EpochSummary(), after
                if self.num_workers and 0 < batches <= summary.steps:  # the last batch (or past a wrong len)
                    probe.note_run_queue()
                yield batch
        finally:
            clock.close()
        end = time.perf_counter()
        summary.seconds = end - start
        period.seconds = end - period_start
        self._report(probe.sample(), summary, summary, final=True, started=started)
        self.summaries.append(summary)

    def _measurements(self, snap: Snapshot, part: EpochSummary) -> Measurements:
        workers = snap.workers
        later = part.wait_seconds - part.first_wait
        return Measurements(
            wait_share=part.wait_share,
            startup_share=part.first_wait / part.seconds if part.seconds else 0.0,
            main_busy=min(1.0, part.main_runnable / later) if later > 0 else 0.0,
            persistent_workers=bool(getattr(self.loader, "persistent_workers", False)),
            cpu_busy=snap.cpu_busy,
            iowait=snap.iowait,
            num_workers=self.num_workers or len(workers),
            cores=snap.cores,
            mem_available=snap.mem_available,
            mem_total=snap.mem_total,
            swap_used=snap.swap_used,
            worker_private=max((w.private for w in workers), default=0),
            cgroup_limit=snap.cgroup_limit,
            job_private=sum(p.private for p in snap.processes),
            memory_budget=self.memory_budget,
            read_bytes=snap.read_bytes,
            job_cores=snap.job_cores,
            cpu_wait=snap.cpu_wait,
        )

    def _report(
        self, snap: Snapshot, part: EpochSummary, epoch: EpochSummary, *, final: bool, started: float = 0.0
    ) -> None:
        epoch.snapshots.append(snap)
        if final:  # the epoch's CPU and iowait: the mean of its samples, each weighted by the time it covers
            snaps = epoch.snapshots
            spans = [max(s.time - t, 0.0) for s, t in zip(snaps, [started] + [s.time for s in snaps[:-1]], strict=True)]
            total = sum(spans)
            weights = [w / total for w in spans] if total > 0 else [1 / len(snaps)] * len(snaps)
            snap = Snapshot(
                snap.time,
                snap.mem_total,
                min(s.mem_available for s in snaps),
                max(s.swap_used for s in snaps),
                snap.cgroup_limit,
                sum(w * s.cpu_busy for w, s in zip(weights, snaps, strict=True)),
                sum(w * s.iowait for w, s in zip(weights, snaps, strict=True)),
                snap.cores,
                max(snaps, key=lambda s: len(s.workers)).processes,  # the workers exit as the epoch ends
                read_bytes=None if any(s.read_bytes is None for s in snaps) else sum(s.read_bytes or 0 for s in snaps),
                job_cores=None
                if any(s.job_cores is None for s in snaps)
                else sum(w * (s.job_cores or 0.0) for w, s in zip(weights, snaps, strict=True)),
                cpu_wait=_known_mean([(w, s.cpu_wait) for w, s in zip(weights, snaps, strict=True)]),
            )
        diagnosis = diagnose(self._measurements(snap, part))
        if final:
            epoch.diagnosis = diagnosis
        rate = part.samples / part.seconds if part.seconds else 0.0
        private = sum(p.private for p in snap.processes)
        line = (
            f"{'epoch' if final else 'loader'}: {part.steps} steps, {rate:,.0f} samples/s, waits "
            f"{100 * part.wait_share:.0f}%, CPU {100 * snap.cpu_busy:.0f}% (iowait {100 * snap.iowait:.0f}%), "
            f"{len(snap.workers)} worker{'s' * (len(snap.workers) != 1)}, private {format_size(private)}, "
            f"available {format_size(snap.mem_available)}"
        )
        print(line + (f"\n  diagnosis: {diagnosis.line()}" if final else ""), file=self.stream, flush=True)
        if self.log is not None:
            record = {
                "type": "epoch" if final else "period",
                "time": snap.time,
                "steps": part.steps,
                "samples": part.samples,
                "seconds": part.seconds,
                "samples_per_s": rate,
                "wait_share": part.wait_share,
                "snapshot": snap.to_dict(),
                "diagnosis": diagnosis.to_dict(),
            }
            try:
                with open(self.log, "a", encoding="utf-8") as f:
                    f.write(json.dumps(record) + "\n")
            except OSError as exc:  # the training goes on: say so once and stop logging
                print(f"monitor: could not write {self.log} ({exc}): logging stopped", file=self.stream, flush=True)
                self.log = None


def monitor(
    loader: Iterable[Any],
    *,
    every: float | str = "10s",
    log: str | Path | None = None,
    stream: TextIO | None = None,
    memory_budget: int | str | None = None,
) -> _Monitor:
    """Wrap ``loader`` to watch its data loading (see the module docstring); iterate it like the loader.

    Args:
        loader: any iterable of batches (a ``DataLoader``, usually).
        every: seconds between reports (``10``, ``"10s"``, ``"1m"``).
        log: a JSONL file to append one record per period and one per epoch to.
        stream: where report lines go (stderr).
        memory_budget: bytes (or ``"8G"``) the job may use: above 90% of it the diagnosis is ``memory``.

    Returns:
        An iterable whose ``summaries`` list one :class:`EpochSummary` per finished pass.

    Raises:
        ConfigError: ``every`` or ``memory_budget`` is not positive, or ``log`` cannot be written.
    """
    budget = parse_size(memory_budget) if isinstance(memory_budget, str) else memory_budget
    if budget is not None and budget <= 0:
        raise ConfigError(f"memory_budget should be a positive size, but got memory_budget={memory_budget!r}")
    path = Path(log) if log is not None else None
    if path is not None:  # now, not at the first report minutes into the training
        try:
            open(path, "a", encoding="utf-8").close()
        except OSError as exc:
            raise ConfigError(
                f"cannot write the log: {exc.strerror}", path=path, hint="Pass log= a writable file"
            ) from exc
    return _Monitor(loader, _seconds(every), path, stream or sys.stderr, budget)
