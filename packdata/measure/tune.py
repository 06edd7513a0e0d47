"""``packdata tune``: measured DataLoader settings under a memory budget.

The search starts from the rule of thumb (about 3/4 of the usable physical cores as
workers, batch 64, prefetch factor 2, pinned memory when training on CUDA) and
moves one variable at a time (num_workers, then batch_size, then
prefetch_factor, then pin_memory), stepping further while throughput improves
by at least ``min_gain`` and stopping when it does not. Before a setting is
measured, and again after, its memory is projected:

    num_workers x per-worker private memory
    + batches in flight (num_workers x prefetch_factor, or 1) x batch bytes
    + the same again when pinned (an upper bound on the pinned buffers)

and a setting whose projection exceeds the budget is rejected, never
recommended. The per-worker figure starts from an estimate and is replaced by
the largest one measured (the peak USS of a worker).

:func:`recommend_loader_kwargs` applies the same rules without measuring.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import psutil
import torch
from torch.utils.data import IterableDataset

from packdata.errors import CapacityError, ConfigError, PackdataError
from packdata.host.cores import WORKER_BYTES, check_workers, rule_of_thumb_workers, usable_cores, usable_cpus
from packdata.host.facts import read_cgroup_memory
from packdata.measure.loop import MEASURE_ERRORS, LoaderConfig, check_timing, error_line, measure_loader
from packdata.measure.sources import check_decode, open_source
from packdata.reading.decode import DecodeFn
from packdata.reading.loader import list_collate, worker_init_fn
from packdata.reading.transforms import standard_transform
from packdata.units import format_size

__all__ = [
    "TuneResult",
    "Trial",
    "default_memory_budget",
    "project_memory",
    "recommend_loader_kwargs",
    "run_tune",
]

_WORKER_STEPS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def default_memory_budget() -> tuple[int, str]:
    """Half of the memory available to this process: MemAvailable, capped by the cgroup limit.

    Returns:
        ``(bytes, how it was found)``. Swap is not counted: a loader that swaps is too slow.
    """
    available = psutil.virtual_memory().available
    how = "half of MemAvailable"
    cgroup = _cgroup_headroom()
    if cgroup is not None and cgroup < available:
        available, how = cgroup, "half of the cgroup memory limit's headroom"
    return available // 2, how


def _cgroup_headroom() -> int | None:
    """Bytes the container's cgroup (v2 or v1) may still charge, or None without a limit."""
    return read_cgroup_memory().headroom


def project_memory(config: LoaderConfig, *, per_worker_bytes: int, sample_bytes: int) -> int:
    """Projected extra memory of a DataLoader setting, in bytes (see the module docstring)."""
    batch = config.batch_size * sample_bytes
    in_flight = config.num_workers * config.prefetch_factor if config.num_workers else 1
    pinned = in_flight * batch if config.pin_memory and torch.cuda.is_available() else 0
    return config.num_workers * per_worker_bytes + in_flight * batch + pinned


def _device_type(device: str | torch.device | None) -> str | None:
    """``device``'s type (``"cuda"``, ``"cpu"``...), or ConfigError naming it when torch does not know it."""
    if device is None:
        return None
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(
            f"device should be a torch device such as 'cuda' or 'cpu', but got device={device!r}"
        ) from exc


def _wants_cuda(device: str | torch.device | None) -> bool:
    return _device_type(device) == "cuda" and torch.cuda.is_available()


def recommend_loader_kwargs(
    dataset: Any = None,
    *,
    batch_size: int = 64,
    device: str | torch.device | None = None,
    memory_budget: int | None = None,
    sample_bytes: int = 3 * 224 * 224,
    per_worker_bytes: int = WORKER_BYTES,
    cores: int | None = None,
    root: str | os.PathLike = "/",
) -> dict[str, Any]:
    """DataLoader keyword arguments by the rules ``tune`` starts from, without measuring.

    ``DataLoader(dataset, **packdata.recommend_loader_kwargs(dataset, device="cuda"))``.
    Workers are about 3/4 of the usable physical cores, cut to what the memory budget
    holds, to what ``/dev/shm`` holds of the batches in flight and the two the loop holds (workers
    hand batches over through it; a container's is 64 MiB unless raised) and to the number of batches an epoch
    has; ``pin_memory`` only when ``device`` is CUDA and CUDA is there; ``persistent_workers`` and
    :func:`packdata.worker_init_fn` whenever there are workers.

    Args:
        dataset: the dataset (its length caps the workers), or None.
        batch_size: the batch size you train with.
        device: where batches go (``"cuda"`` turns pinning on when available).
        memory_budget: bytes the loader may use; default :func:`default_memory_budget`.
        sample_bytes: bytes of one transformed sample (default a 224x224 uint8 RGB image).
        per_worker_bytes: private memory per worker (measure it with ``packdata bench``).
        cores: physical cores to plan for (default :func:`packdata.host.cores.usable_cores`).
        root: filesystem root holding ``proc/`` and ``sys/`` for counting cores (tests pass crafted trees).

    Raises:
        ConfigError: batch_size is under 1.
        CapacityError: not even one batch without workers fits the budget.
    """
    if batch_size < 1:  # a ConfigError (a ValueError too): the CLI says it in one line
        raise ConfigError(f"batch_size should be at least 1, but got batch_size={batch_size}")
    budget = memory_budget if memory_budget is not None else default_memory_budget()[0]
    workers = rule_of_thumb_workers(cores or usable_cores(root=root))
    if dataset is not None and not isinstance(dataset, IterableDataset):
        with contextlib.suppress(TypeError):
            workers = min(workers, max(len(dataset) // batch_size, 1))
    config = LoaderConfig(workers, batch_size, _wants_cuda(device), 2, workers > 0)
    shm = _shm_free()
    while config.num_workers > 0 and (
        project_memory(config, per_worker_bytes=per_worker_bytes, sample_bytes=sample_bytes) > budget
        or (shm is not None and (config.num_workers * config.prefetch_factor + 2) * batch_size * sample_bytes > shm)
    ):
        config = replace(config, num_workers=config.num_workers - 1)
    if project_memory(config, per_worker_bytes=per_worker_bytes, sample_bytes=sample_bytes) > budget:
        raise CapacityError(
            f"one batch of {batch_size} samples ({batch_size * sample_bytes} bytes) exceeds the memory budget "
            f"of {budget} bytes",
            hint="Lower the batch size or raise the memory budget",
        )
    return _kwargs(replace(config, persistent_workers=config.num_workers > 0))


def _shm_free() -> int | None:
    """Bytes free in ``/dev/shm``, where DataLoader workers put the batches they hand over; None without one."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _kwargs(config: LoaderConfig) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "batch_size": config.batch_size,
        "num_workers": config.num_workers,
        "pin_memory": config.pin_memory,
    }
    if config.num_workers > 0:
        kwargs.update(
            prefetch_factor=config.prefetch_factor,
            persistent_workers=config.persistent_workers,
            worker_init_fn=worker_init_fn,
        )
    return kwargs


@dataclass
class Trial:
    """One setting tried: measured, or rejected on its memory projection."""

    config: dict[str, Any]
    projected_bytes: int
    samples_per_s: float | None = None
    memory_peak_bytes: int | None = None
    per_worker_bytes: int | None = None
    rejected: str | None = None
    step: str = ""

    @property
    def accepted(self) -> bool:
        return self.rejected is None and self.samples_per_s is not None


@dataclass
class TuneResult:
    """The recommended DataLoader setting, the runner-up, and every trial."""

    source: str
    recommended: Trial
    runner_up: Trial | None
    trials: list[Trial]
    memory_budget: int
    budget_source: str
    device: str
    warnings: list[str] = field(default_factory=list)
    min_gain: float = 0.05  # what a step had to gain to be taken: closer settings are within noise

    def kwargs(self, trial: Trial | None = None) -> dict[str, Any]:
        """DataLoader keyword arguments of a trial (default the recommended one)."""
        return _kwargs(LoaderConfig(**(trial or self.recommended).config))

    def python(self, trial: Trial | None = None) -> str:
        """The setting as Python source: ``DataLoader(dataset, ...)``."""
        lines = ["DataLoader(", "    dataset,"]
        for key, value in self.kwargs(trial).items():
            text = "packdata.worker_init_fn" if key == "worker_init_fn" else repr(value)
            lines.append(f"    {key}={text},")
        lines.append(")")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``worker_init_fn`` named as ``"packdata.worker_init_fn"``)."""

        def plain(trial: Trial | None) -> dict[str, Any] | None:
            if trial is None:
                return None
            kwargs = {
                k: ("packdata.worker_init_fn" if k == "worker_init_fn" else v) for k, v in self.kwargs(trial).items()
            }
            return {**asdict(trial), "kwargs": kwargs}

        return {
            "source": self.source,
            "recommended": plain(self.recommended),
            "runner_up": plain(self.runner_up),
            "trials": [asdict(t) for t in self.trials],
            "memory_budget": self.memory_budget,
            "budget_source": self.budget_source,
            "device": self.device,
            "warnings": self.warnings,
            "min_gain": self.min_gain,
        }


class _Search:
    def __init__(
        self,
        dataset: Any,
        measure: Callable[[LoaderConfig], Any],
        budget: int,
        sample_bytes: int,
        min_gain: float,
        progress: Callable[[str], None] | None,
    ) -> None:
        self.dataset = dataset
        self.measure = measure
        self.budget = budget
        self.sample_bytes = sample_bytes
        self.min_gain = min_gain
        self.progress = progress
        self.per_worker = WORKER_BYTES
        self.trials: dict[LoaderConfig, Trial] = {}
        self.failure: Exception | None = None  # the first measurement that failed (not a memory rejection)

    def project(self, config: LoaderConfig) -> int:
        return project_memory(config, per_worker_bytes=self.per_worker, sample_bytes=self.sample_bytes)

    def run(self, config: LoaderConfig, step: str) -> Trial:
        if config in self.trials:
            return self.trials[config]
        trial = Trial(asdict(config), self.project(config), step=step)
        self.trials[config] = trial
        if trial.projected_bytes > self.budget:
            trial.rejected = f"projected {trial.projected_bytes} bytes > budget {self.budget}"
            return trial
        if self.progress:
            self.progress(f"tune {step}: {config}")
        try:
            result = self.measure(config)
        except MEASURE_ERRORS as exc:  # a worker that crashed or was killed (RuntimeError) included
            trial.rejected = error_line(exc)
            self.failure = self.failure or exc
            return trial
        trial.samples_per_s = result.samples_per_s
        trial.memory_peak_bytes = result.memory["total"]["uss_peak"]
        if config.num_workers:
            trial.per_worker_bytes = result.memory["workers"]["per_worker_uss_peak"]
            if self.per_worker == WORKER_BYTES:
                self.per_worker = trial.per_worker_bytes
            else:
                self.per_worker = max(self.per_worker, trial.per_worker_bytes)
            trial.projected_bytes = self.project(config)
            if trial.projected_bytes > self.budget:
                trial.rejected = f"measured projection {trial.projected_bytes} bytes > budget {self.budget}"
        return trial

    def climb(self, base: LoaderConfig, name: str, values: Sequence[Any]) -> LoaderConfig:
        """Best value of one field, stepping up then down from the base value while it pays."""
        values = sorted(set(values) | {getattr(base, name)})
        start = values.index(getattr(base, name))
        tried: list[tuple[int, Trial]] = []

        def at(i: int) -> Trial:
            trial = self.run(replace(base, **{name: values[i]}), name)
            tried.append((i, trial))
            return trial

        best_i = start
        first = at(start)
        while not first.accepted and best_i > 0:  # the start is over budget: step down until one fits
            best_i -= 1
            first = at(best_i)
        if not first.accepted:
            return base
        best = first.samples_per_s or 0.0
        went_up = False
        for i in range(best_i + 1, len(values)):
            trial = at(i)
            if not trial.accepted or (trial.samples_per_s or 0.0) < best * (1 + self.min_gain):
                break
            best_i, best, went_up = i, trial.samples_per_s or 0.0, True
        if not went_up:
            for i in range(best_i - 1, -1, -1):
                trial = at(i)
                # a smaller value that is as fast (within min_gain) costs less: take it
                if not trial.accepted or (trial.samples_per_s or 0.0) < best * (1 - self.min_gain):
                    break
                best_i, best = i, max(best, trial.samples_per_s or 0.0)
        return replace(base, **{name: values[best_i]})


def _with_or_without_workers(search: _Search, base: LoaderConfig, workers: list[int]) -> LoaderConfig:
    """``base``, or the main process alone (0 workers) when that is as fast, within ``min_gain``.

    The climb stops where one more or one fewer worker does not pay, but 0
    workers is off the curve it follows: no batch crosses between processes.
    Samples that cost microseconds (small texts) go several times faster
    without workers, while 2 workers still beat 1, so a climb that went up
    never tried it.
    """
    if not base.num_workers or 0 not in workers:
        return base
    alone = search.run(replace(base, num_workers=0), "num_workers")
    chosen = search.trials.get(base)
    best = chosen.samples_per_s if chosen is not None and chosen.accepted else None
    if alone.accepted and best is not None and (alone.samples_per_s or 0.0) >= best * (1 - search.min_gain):
        return replace(base, num_workers=0)
    return base


def _feasible_start(search: _Search, base: LoaderConfig, workers: list[int], batch_sizes: list[int]) -> LoaderConfig:
    """The rule-of-thumb start, with fewer workers, then smaller batches, until its projection fits."""
    while search.project(base) > search.budget:
        fewer = [w for w in workers if w < base.num_workers]
        smaller = [b for b in batch_sizes if b < base.batch_size]
        if fewer:
            base = replace(base, num_workers=fewer[-1])
        elif smaller:
            base = replace(base, batch_size=smaller[-1])
        else:
            break
    return base


def run_tune(
    source: str | os.PathLike,
    *,
    memory_budget: int | None = None,
    device: str | torch.device | None = None,
    batch_sizes: Sequence[int] = (64,),
    prefetch_factors: Sequence[int] = (2, 4, 8),
    max_workers: int | None = None,
    decode: str | DecodeFn = "pil",
    transform: str | Callable[[Any], Any] | None = "standard",
    size: int = 224,
    batches: int | None = None,
    seconds: float | None = None,
    warmup: int = 2,
    min_gain: float = 0.05,
    sample_interval: float = 0.25,
    progress: Callable[[str], None] | None = None,
) -> TuneResult:
    """Search DataLoader settings for ``source`` one variable at a time, within a memory budget.

    Args:
        source: a pack or a raw folder.
        memory_budget: bytes the loader may use (default :func:`default_memory_budget`).
        device: where batches go; ``"cuda"`` adds pinned memory to the search when CUDA is there.
        batch_sizes: your training batch size, kept as it is; several values are
            searched (starting from 64, or the nearest).
        prefetch_factors: prefetch factors to search (from 2).
        max_workers: most workers to try (default: the logical CPUs this process may
            use, cut to the cgroup's CPU quota; see :func:`~packdata.host.cores.usable_cpus`); at most
            :data:`~packdata.host.cores.MAX_WORKERS_PER_CPU` per CPU this process may use.
        decode, transform, size: as for :func:`packdata.run_bench`.
        batches, seconds, warmup: the timed budget of each trial (default: 50 batches and at least one second).
        min_gain: the relative throughput gain a larger value must bring to be taken.
        sample_interval: seconds between memory samples.
        progress: called with a line of text before each measurement.

    Returns:
        A :class:`TuneResult`; ``print(result.python())`` gives the DataLoader call.

    Raises:
        ConfigError: an option value is invalid (``max_workers`` over the bound included).
        CapacityError: no setting fits the memory budget.
        PackdataError: the source cannot be opened, or no setting that fits could be
            measured (the first such error, e.g. fewer samples than a batch).
    """
    if not batch_sizes or not prefetch_factors:
        raise ConfigError("batch_sizes and prefetch_factors should not be empty")
    if max_workers is not None:
        check_workers(max_workers, name="max_workers")
    check_decode(decode)
    check_timing(batches=batches, seconds=seconds, warmup=warmup)
    _device_type(device)
    budget, how = (memory_budget, "given") if memory_budget is not None else default_memory_budget()
    if isinstance(transform, str):
        if transform != "standard":
            raise ConfigError(f"transform should be 'standard', None or a callable, but got transform={transform!r}")
        transform = standard_transform(size, crop=decode != "crop")  # DecodeCrop crops as it decodes
    dataset, facts = open_source(source, decode=decode, transform=transform, size=size)
    collate = list_collate if transform is None or decode == "bytes" or facts["kind"] != "image" else None
    sample_bytes = 3 * size * size if collate is None else max(int(facts["mean_bytes"]), 1)
    warnings: list[str] = []
    available = read_cgroup_memory().available(psutil.virtual_memory().available)
    if budget > available:  # the user's word, kept: but settings within it can be OOM-killed
        warnings.append(
            f"memory_budget={format_size(budget)} is more than the {format_size(available)} this process may still "
            "allocate (MemAvailable, or the cgroup limit's headroom): a setting within it can be OOM-killed"
        )
    cuda = _wants_cuda(device)
    if _device_type(device) == "cuda" and not cuda:
        warnings.append("CUDA is not available: pin_memory is left off and not searched")

    def measure(config: LoaderConfig) -> Any:
        return measure_loader(
            dataset,
            config,
            batches=batches,
            seconds=seconds,
            warmup=warmup,
            collate_fn=collate,
            mean_bytes=facts["mean_bytes"],
            sample_interval=sample_interval,
            source=os.fspath(source),
            kind=facts["format"],
        )

    search = _Search(dataset, measure, budget, sample_bytes, min_gain, progress)
    limit = max_workers if max_workers is not None else usable_cpus()
    workers = [w for w in _WORKER_STEPS if w <= limit]
    start_batch = min(batch_sizes, key=lambda b: (abs(b - 64), b))
    base = LoaderConfig(min(rule_of_thumb_workers(), limit), start_batch, cuda, 2, True)
    base = _feasible_start(search, base, workers, sorted(batch_sizes))
    base = _with_or_without_workers(search, search.climb(base, "num_workers", workers), workers)
    base = search.climb(base, "batch_size", batch_sizes)
    if base.num_workers > 0:
        base = search.climb(base, "prefetch_factor", prefetch_factors)
    if cuda:
        base = search.climb(base, "pin_memory", [False, True])
    trials = list(search.trials.values())
    for config, trial in search.trials.items():  # re-check with the largest worker measured
        if trial.accepted and config.num_workers:
            trial.projected_bytes = search.project(config)
            if trial.projected_bytes > budget:
                trial.rejected = f"measured projection {trial.projected_bytes} bytes > budget {budget}"
    ranked = sorted((t for t in trials if t.accepted), key=lambda t: -(t.samples_per_s or 0.0))
    if not ranked:
        smallest = min(t.projected_bytes for t in trials)
        failure = search.failure
        if failure is not None and smallest <= budget:  # a setting fitted, and failed for another reason
            if not isinstance(failure, PackdataError) or "\n" in str(failure):  # a worker's: its traceback in it
                raise PackdataError(error_line(failure)) from failure
            raise failure
        raise CapacityError(
            f"no DataLoader setting fits the memory budget of {budget} bytes (the smallest projection is "
            f"{smallest} bytes)",
            path=source,
            hint="Raise memory_budget=SIZE or search smaller batch sizes",
        )
    chosen = search.trials.get(base)
    recommended = chosen if chosen is not None and chosen.accepted else ranked[0]
    runner_up = next((t for t in ranked if t is not recommended), None)
    return TuneResult(
        os.fspath(source),
        recommended,
        runner_up,
        trials,
        budget,
        how,
        "cuda" if cuda else "cpu",
        warnings,
        min_gain=min_gain,
    )
