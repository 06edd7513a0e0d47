"""One DataLoader setting timed batch by batch: :class:`LoaderConfig`, :func:`measure_loader`, :class:`ConfigResult`."""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from packdata.errors import ConfigError, PackdataError
from packdata.measure.memory import _MemorySampler
from packdata.reading.loader import worker_init_fn

__all__ = [
    "DEFAULT_BATCHES",
    "DEFAULT_MIN_SECONDS",
    "MAX_STEP_MS",
    "MEASURE_ERRORS",
    "ConfigResult",
    "LoaderConfig",
    "check_timing",
    "error_line",
    "measure_loader",
]

DEFAULT_BATCHES = 50
"""Batches timed per setting when neither ``batches`` nor ``seconds`` is given."""
DEFAULT_MIN_SECONDS = 1.0
"""With neither budget given, a setting is timed for :data:`DEFAULT_BATCHES` batches and at least this long:
50 batches of 64 small texts take 16 ms, short enough that one pause of the machine decided a comparison."""
MAX_STEP_MS = 3_600_000
"""The longest simulated training step, in milliseconds (an hour)."""


@dataclass(frozen=True)
class LoaderConfig:
    """One DataLoader setting of a sweep."""

    num_workers: int = 0
    batch_size: int = 64
    pin_memory: bool = False
    prefetch_factor: int = 2
    persistent_workers: bool = False

    def loader_kwargs(self) -> dict[str, Any]:
        """The DataLoader keyword arguments; CUDA-only options are dropped without CUDA."""
        kwargs: dict[str, Any] = {
            "batch_size": self.batch_size,
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory and torch.cuda.is_available(),
        }
        if self.num_workers > 0:
            kwargs["prefetch_factor"] = self.prefetch_factor
            kwargs["persistent_workers"] = self.persistent_workers
            kwargs["worker_init_fn"] = worker_init_fn
        return kwargs


@dataclass
class ConfigResult:
    """One source under one DataLoader setting: throughput, latency and memory."""

    source: str
    kind: str
    num_workers: int
    batch_size: int
    pin_memory: bool
    prefetch_factor: int
    persistent_workers: bool
    pin_memory_effective: bool = False
    batches: int = 0
    samples: int = 0
    seconds: float = 0.0
    samples_per_s: float = 0.0
    mb_per_s: float = 0.0
    first_batch_s: float = 0.0
    wait_p50_ms: float = 0.0
    wait_p95_ms: float = 0.0
    wait_mean_ms: float = 0.0
    cpu_ms_per_sample: float = 0.0
    step_ms: float = 0.0
    data_wait_share: float = 0.0
    vs_ceiling: float | None = None
    memory: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    repeats: int = 1
    samples_per_s_min: float = 0.0  # over the repeats (equal to samples_per_s after one)
    samples_per_s_max: float = 0.0

    @property
    def config(self) -> LoaderConfig:
        return LoaderConfig(
            self.num_workers, self.batch_size, self.pin_memory, self.prefetch_factor, self.persistent_workers
        )


MEASURE_ERRORS = (PackdataError, RuntimeError, OSError, TypeError, ValueError)
"""What a setting that cannot run raises (a worker that crashed or was killed: ``RuntimeError``): bench and tune
record it for that setting and go on."""


def check_timing(
    *, batches: int | None = None, seconds: float | None = None, step_ms: float = 0.0, warmup: int = 0
) -> None:
    """Refuse a timed budget that would never end or mean nothing (NaN or infinite seconds never end).

    Raises:
        ConfigError: ``batches`` under 1, ``seconds`` not positive and finite, ``step_ms`` negative or over
            :data:`MAX_STEP_MS`, or ``warmup`` negative.
    """
    if batches is not None and batches < 1:
        raise ConfigError(f"batches should be at least 1, but got batches={batches}")
    if seconds is not None and not 0 < seconds < math.inf:
        raise ConfigError(f"seconds should be a positive finite number, but got seconds={seconds}")
    if not 0 <= step_ms < math.inf:
        raise ConfigError(f"step_ms should be a finite number from 0 on, but got step_ms={step_ms}")
    if step_ms > MAX_STEP_MS:  # a sleep that long overflows, and a step that long measures nothing
        raise ConfigError(f"step_ms should be at most {MAX_STEP_MS} (an hour), but got step_ms={step_ms}")
    if warmup < 0:
        raise ConfigError(f"warmup should be at least 0, but got warmup={warmup}")


def error_line(exc: BaseException) -> str:
    """``exc`` as one line: an exception a DataLoader worker raised is its last line (without the worker's
    traceback torch puts in its message), and the worker."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 2 and lines[1].startswith("Original Traceback"):
        message = lines[-1].partition(": ")[2] or lines[-1]
        where = lines[0].removeprefix(f"Caught {type(exc).__name__} in ").rstrip(".")
        return f"{type(exc).__name__}: {message} (in {where})"
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


class _Epochs:
    """Batches from a DataLoader, starting a new epoch whenever one ends."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader: DataLoader | None = loader
        self.iterator: Any = iter(loader)

    def next(self) -> Any:
        for _ in range(2):
            try:
                return next(self.iterator)
            except StopIteration:
                self.iterator = iter(self.loader)  # type: ignore[arg-type]
        raise ConfigError("the loader yields no full batch", hint="Use a smaller batch_size=N")

    def close(self) -> None:
        self.iterator = self.loader = None


def measure_loader(
    dataset: Dataset,
    config: LoaderConfig,
    *,
    batches: int | None = None,
    seconds: float | None = None,
    warmup: int = 2,
    step_ms: float = 0.0,
    collate_fn: Callable[[Any], Any] | None = None,
    multiprocessing_context: str | None = None,
    mean_bytes: float = 0.0,
    sample_interval: float = 0.25,
    source: str = "",
    kind: str = "",
) -> ConfigResult:
    """Time ``DataLoader(dataset, **config)`` batch by batch and sample its memory.

    The loader shuffles (map-style datasets) and drops the last partial batch,
    so every timed batch is full; epochs restart as needed (with their worker
    start-up cost, unless ``persistent_workers``). After ``warmup`` batches it
    times ``batches`` batches or ``seconds`` seconds, whichever ends first
    (default: 50 batches and at least one second). With ``step_ms`` the main process sleeps that long
    after each batch, as a training step would occupy it, and
    ``data_wait_share`` is the share of the timed wall clock spent waiting for data.
    ``cpu_ms_per_sample`` is the CPU time (user + system) the main process and
    all its descendants spent per timed sample, workers that ended in the window
    (an epoch's end) included, their start-up too (approximate with workers: batches
    prefetched at either edge of the timed window shift it): unlike samples/s it
    hardly moves when other work shares the machine, so compare routes with it there.

    Raises:
        ConfigError: the dataset holds fewer samples than one batch, or the budget is invalid (:func:`check_timing`).
    """
    check_timing(batches=batches, seconds=seconds, step_ms=step_ms, warmup=warmup)
    least = 0.0
    if batches is None and seconds is None:
        batches, least = DEFAULT_BATCHES, DEFAULT_MIN_SECONDS
    result = ConfigResult(source, kind, **asdict(config))
    iterable = isinstance(dataset, IterableDataset)
    if not iterable and len(dataset) < config.batch_size:  # type: ignore[arg-type]
        raise ConfigError(
            f"the source holds {len(dataset)} samples, fewer than batch_size={config.batch_size}",  # type: ignore[arg-type]
            hint="Use a smaller batch_size=N",
        )
    kwargs = config.loader_kwargs()
    result.pin_memory_effective = kwargs["pin_memory"]
    if multiprocessing_context and config.num_workers > 0:
        kwargs["multiprocessing_context"] = multiprocessing_context
    loader = DataLoader(dataset, shuffle=not iterable, drop_last=True, collate_fn=collate_fn, **kwargs)
    waits: list[float] = []
    with _MemorySampler(sample_interval) as sampler:
        started = time.perf_counter()
        epochs = _Epochs(loader)
        del loader  # the epochs hold the only reference: closing them shuts the workers down
        first: float | None = None
        try:
            for _ in range(warmup):
                epochs.next()
                if first is None:
                    first = time.perf_counter() - started
                    sampler.sample()  # every worker is started now: a short run's ticks may all miss one alive
                if step_ms:
                    time.sleep(step_ms / 1000)
            timed_start = time.perf_counter()
            cpu_start = sampler.cpu_seconds()
            while True:
                elapsed = time.perf_counter() - timed_start
                if batches is not None and result.batches >= batches and elapsed >= least:
                    break
                if seconds is not None and elapsed >= seconds and result.batches:  # one batch at least: a rate
                    break
                before = time.perf_counter()
                batch = epochs.next()
                now = time.perf_counter()
                first = now - started if first is None else first
                waits.append(now - before)
                result.batches += 1
                result.samples += config.batch_size  # drop_last: every batch is whole, whatever the collate made of it
                del batch
                if step_ms:
                    time.sleep(step_ms / 1000)
            result.seconds = time.perf_counter() - timed_start
            cpu = sampler.cpu_seconds() - cpu_start
            result.cpu_ms_per_sample = 1000 * cpu / result.samples if result.samples else 0.0
            sampler.sample()
        except BaseException as exc:
            # the loader's frames in the traceback hold its iterator in a cycle (torch's reraise): cleared,
            # closing the epochs shuts the workers down now, not at some later garbage collection
            traceback.clear_frames(exc.__traceback__)
            raise
        finally:
            epochs.close()
    result.first_batch_s = first or 0.0
    result.samples_per_s = result.samples / result.seconds if result.seconds > 0 else 0.0
    result.mb_per_s = result.samples_per_s * mean_bytes / 1e6
    if waits:
        ms = np.asarray(waits) * 1000
        result.wait_p50_ms = float(np.percentile(ms, 50))
        result.wait_p95_ms = float(np.percentile(ms, 95))
        result.wait_mean_ms = float(ms.mean())
    result.step_ms = step_ms
    result.data_wait_share = float(sum(waits) / result.seconds) if result.seconds > 0 else 0.0
    result.memory = sampler.summary()
    return result
