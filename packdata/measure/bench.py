"""``packdata bench``: DataLoader throughput and memory, measured the way you train.

Each source (a pack or a raw folder) goes through the real
``torch.utils.data.DataLoader`` and the real dataset classes, for every
combination of the swept settings. Batches are timed one by one after a
warm-up (:mod:`packdata.measure.loop`); a background thread samples the memory
of the main process and every worker (:mod:`packdata.measure.memory`). Next to
the sources, the **ceiling** is always measured: the same decode and transform
on bytes already in memory, through the same DataLoader settings, so every
figure is also a ratio to what decoding alone allows. With ``decode="crop"``
the ceiling is PIL's full decode and the standard crop, the work
:class:`packdata.DecodeCrop` replaces, so the ratio is its gain.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from torch.utils.data import Dataset

from packdata.errors import ConfigError, PackdataError
from packdata.host.cores import MAX_WORKERS_PER_CPU, check_workers, usable_cores
from packdata.host.facts import cpu_counts
from packdata.measure.loop import (
    DEFAULT_BATCHES,
    DEFAULT_MIN_SECONDS,
    MEASURE_ERRORS,
    ConfigResult,
    LoaderConfig,
    check_timing,
    error_line,
    measure_loader,
)
from packdata.measure.sources import InMemoryDataset, _decoder, _raw_view, check_decode, open_source
from packdata.pack.turbo import turbojpeg
from packdata.reading.decode import DecodeFn
from packdata.reading.loader import list_collate
from packdata.reading.transforms import standard_transform
from packdata.units import format_size

__all__ = ["CEILING", "MAX_WORKERS_PER_CPU", "BenchResult", "run_bench"]

CEILING = "ceiling"


@dataclass
class BenchResult:
    """Every configuration measured, the sources, settings, and system facts."""

    results: list[ConfigResult]
    sources: list[dict[str, Any]]
    settings: dict[str, Any]
    system: dict[str, Any]
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; ``best`` is the table's best setting (:meth:`best`), as an index into ``results``."""
        best = self.best()
        return {
            "results": [asdict(r) for r in self.results],
            "best": None if best is None else self.results.index(best),
            "sources": self.sources,
            "settings": self.settings,
            "system": self.system,
            "warnings": self.warnings,
        }

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The result as JSON text, also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=1, ensure_ascii=False)
        if path is not None:
            Path(path).write_text(text + "\n", encoding="utf-8")
        return text

    def for_source(self, name: str) -> list[ConfigResult]:
        """The results of one source (``"ceiling"`` for the ceiling)."""
        return [r for r in self.results if r.source == name]

    def table(self, *, wide: bool = False, say: Callable[[str], str] = str) -> str:
        """A fixed-width table, one line per source and setting, a legend, and the best setting.

        The default table has the columns that decide a setting; ``wide`` adds
        MB/s, CPU time, first-batch time, wait percentiles and every memory
        figure. ``say`` rewords the error of a setting that failed, the advice to repeat and the best
        setting (the CLI: in its flags, the best one as options to paste).
        """
        width = max([len(r.source) for r in self.results] + [6])
        waiting = any(r.step_ms for r in self.results)
        # a swept pin_memory or prefetch_factor gets its column: rows that differ by it are told apart
        pin = wide or len({r.pin_memory for r in self.results}) > 1
        pf = wide or len({r.prefetch_factor for r in self.results}) > 1
        head = f"{'source':<{width}} {'workers':>7} {'batch':>5}"
        head += (f" {'pin':>3}" if pin else "") + (f" {'pf':>2}" if pf else "")
        head += f" {'samples/s':>10} {'spread':>7} {'x ceiling':>9}"
        head += f" {'wait%':>5}" if waiting else ""
        head += f" {'private mem':>11} {'avail min':>10}"
        if wide:
            head += (
                f" {'MB/s':>7} {'cpu ms':>6} {'first s':>7} {'p50 ms':>6} {'p95 ms':>6}"
                f" {'USS main':>10} {'USS wk':>10} {'file':>10}"
            )
        lines = [head]
        for r in self.results:
            line = f"{r.source:<{width}} {r.num_workers:>7} {r.batch_size:>5}"
            line += (f" {'y' if r.pin_memory else 'n':>3}" if pin else "") + (f" {_pf(r):>2}" if pf else "")
            if r.error:
                lines.append(f"{line}  error: {say(r.error)}")
                continue
            mem = r.memory
            ratio = f"{r.vs_ceiling:.2f}" if r.vs_ceiling is not None else "-"
            spread = _spread(r)
            line += f" {r.samples_per_s:>10.1f}"
            line += f" {spread:>7} {ratio:>9}"
            line += f" {100 * r.data_wait_share:>5.1f}" if waiting else ""
            # an upper bound: the total's peak, sampled every 0.25 s, can miss the instant both peak at once
            private = mem["main"]["uss_peak"] + mem["workers"]["uss_peak"]
            line += f" {format_size(private):>11} {format_size(mem['mem_available_min']):>10}"
            if wide:
                line += (
                    f" {r.mb_per_s:>7.1f}"
                    f" {r.cpu_ms_per_sample:>6.2f} {r.first_batch_s:>7.2f} {r.wait_p50_ms:>6.1f} {r.wait_p95_ms:>6.1f}"
                    f" {format_size(mem['main']['uss_peak']):>10} {format_size(mem['workers']['uss_peak']):>10}"
                    f" {format_size(mem['total']['file_peak']):>10}"
                )
            lines.append(line)
        repeats = max((r.repeats for r in self.results), default=1)
        lines.append(
            f"samples/s: median of {repeats} run{'s' * (repeats != 1)}; spread: (max - min) / median"
            + (say(" (one run: run again with repeats=3 for a noise estimate)") if repeats == 1 else "")
            + (
                "; x ceiling: over PIL full decode + the standard crop on bytes in memory (what DecodeCrop replaces;"
                f" DecodeCrop decoded with {self.settings.get('crop_decoder')})"
                if self.settings.get("decode") == "crop"
                else "; x ceiling: over the same decode on bytes in memory"
            )
            + " (ratios within the spread are noise)"
            + ("; wait%: share of each step spent waiting for data" if waiting else "")
            + "; private mem: peak USS of the main process plus the workers (page cache of mapped packs excluded)"
            + "; avail min: the least memory available in the run (MemAvailable, cut to the cgroup limit's headroom)"
        )
        best = self.best()
        if best is not None:
            lines.append(
                f"best: {best.source} with "
                + say(f"{self._setting(best)}:")
                + f" {best.samples_per_s:,.0f} samples/s"
                + (f" ({best.vs_ceiling:.2f}x the ceiling)" if best.vs_ceiling is not None else "")
            )
        return "\n".join(lines)

    def _setting(self, best: ConfigResult) -> str:
        """The best row's DataLoader keywords: its workers and batch size, and each other setting the bench swept
        or set off its default (a line pasted without it would fall back to the default)."""
        default = LoaderConfig()
        said = [f"num_workers={best.num_workers}", f"batch_size={best.batch_size}"]
        with_workers = [r for r in self.results if r.num_workers] if best.num_workers else []
        for name in ("pin_memory", "prefetch_factor", "persistent_workers"):
            rows = self.results if name == "pin_memory" else with_workers  # no workers: nothing prefetched or kept
            if rows and {getattr(r, name) for r in rows} != {getattr(default, name)}:
                said.append(f"{name}={getattr(best, name)}")
        return ", ".join(said)

    def best(self) -> ConfigResult | None:
        """The fastest setting of any source but the ceiling (the cheaper one when two are within their spread)."""
        rows = [r for r in self.results if not r.error and r.source != CEILING]
        if not rows:
            return None
        top = max(rows, key=lambda r: r.samples_per_s)
        close = [r for r in rows if r.samples_per_s >= top.samples_per_s_min and r.source == top.source]
        return min(close, key=lambda r: (r.num_workers, r.batch_size, -r.samples_per_s))


def _pf(r: ConfigResult) -> str:
    """The prefetch factor, or ``-`` without workers (the main process loads each batch when asked)."""
    return str(r.prefetch_factor) if r.num_workers else "-"


def _spread(r: ConfigResult) -> str:
    if r.repeats < 2 or not r.samples_per_s:
        return "-"
    return f"{100 * (r.samples_per_s_max - r.samples_per_s_min) / r.samples_per_s:.0f}%"


def _system_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "cpus_logical": psutil.cpu_count(logical=True),
        "cpus_physical": psutil.cpu_count(logical=False),
        "memory_total": psutil.virtual_memory().total,
        "platform": sys.platform,
    }
    facts["cpu_counts"] = list(cpu_counts())
    facts["cores_usable"] = usable_cores()
    return facts


def _drop_caches() -> str | None:
    """Drop the page cache (root only); returns why not, or None when done."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "cold=True needs root to drop the page cache; measured warm"
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:
        return f"could not drop the page cache ({exc}); measured warm"
    return None


def _as_tuple(value: Any) -> tuple[Any, ...]:
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return (value,)


def run_bench(
    sources: Sequence[str | os.PathLike] | str | os.PathLike,
    *,
    workers: Sequence[int] | int = (0, 2),
    batch_sizes: Sequence[int] | int = (64,),
    pin_memory: Sequence[bool] | bool = (False,),
    prefetch_factor: Sequence[int] | int = (2,),
    persistent_workers: bool = False,
    decode: str | DecodeFn = "pil",
    transform: str | Callable[[Any], Any] | None = "standard",
    size: int = 224,
    seconds: float | None = None,
    batches: int | None = None,
    warmup: int = 2,
    step_ms: float = 0.0,
    cold: bool = False,
    ceiling_samples: int = 1024,
    collate_fn: Callable[[Any], Any] | None = None,
    multiprocessing_context: str | None = None,
    sample_interval: float = 0.25,
    progress: Callable[[str], None] | None = None,
    repeats: int = 1,
) -> BenchResult:
    """Measure DataLoader throughput and memory for each source and setting.

    The ceiling (named ``"ceiling"``) is measured first: up to
    ``ceiling_samples`` samples' bytes of the first source that has them, held
    in memory, through the same decode, transform and DataLoader settings.
    Every other result gets ``vs_ceiling``, its throughput over the ceiling's
    at the same setting.

    Args:
        sources: packs (LMDB, TFRecord) and raw folders.
        workers, batch_sizes, pin_memory, prefetch_factor: values to sweep
            (every combination); ``pin_memory`` is measured off without CUDA, and a setting
            without workers once, with the first prefetch factor (it prefetches nothing).
        persistent_workers: keep workers between epochs.
        decode: ``"bytes"``, ``"pil"``, ``"reduced"`` (DCT-scaled JPEG decode to
            ``size``, see :class:`packdata.DecodeJPEG`), ``"crop"`` (:class:`packdata.DecodeCrop`
            to ``size``; the ceiling is then PIL's full decode and the standard
            transform, the work it replaces) or a callable.
        transform: ``"standard"`` (random resized crop to ``size``, flip,
            uint8 tensor), None, or a callable.
        size: output side of the standard transform.
        seconds, batches: timed budget per setting after ``warmup`` batches
            (default: 50 batches and at least one second; both: whichever ends first).
        step_ms: simulated training step per batch (main process sleeps).
        cold: drop the page cache before each source (needs root).
        ceiling_samples: samples the ceiling holds in memory.
        collate_fn: the DataLoader's collate (default: the torch default with a
            transform, a list collate without).
        multiprocessing_context: ``"fork"``, ``"spawn"`` or ``"forkserver"``.
        sample_interval: seconds between memory samples.
        progress: called with a line of text before each measurement.

    Returns:
        A :class:`BenchResult`. A setting that cannot run has ``error`` set;
        the sweep goes on.

    Raises:
        ConfigError: no sources, or an option value is invalid (workers over
            :data:`MAX_WORKERS_PER_CPU` per CPU included).
    """
    paths = [sources] if isinstance(sources, (str, os.PathLike)) else list(sources)
    if not paths:
        raise ConfigError("no sources to bench", hint="Pass one or more packs or folders")
    check_decode(decode)
    check_timing(batches=batches, seconds=seconds, step_ms=step_ms, warmup=warmup)
    if isinstance(transform, str):
        if transform != "standard":
            raise ConfigError(f"transform should be 'standard', None or a callable, but got transform={transform!r}")
        transform = standard_transform(size, crop=decode != "crop")  # DecodeCrop crops as it decodes
    if collate_fn is None and (transform is None or decode == "bytes"):
        collate_fn = list_collate
    factors = _as_tuple(prefetch_factor)
    configs = list(
        dict.fromkeys(  # without workers nothing is prefetched: such a setting is measured once, not per factor
            LoaderConfig(w, b, p, f if w else factors[0], persistent_workers)
            for w, b, p, f in itertools.product(
                _as_tuple(workers), _as_tuple(batch_sizes), _as_tuple(pin_memory), factors
            )
        )
    )
    for c in configs:
        if c.num_workers < 0 or c.batch_size < 1 or c.prefetch_factor < 1:
            raise ConfigError(f"invalid setting {c}: workers >= 0, batch size >= 1 and prefetch factor >= 1")
    check_workers(max((c.num_workers for c in configs), default=0), name="workers")
    settings = {
        "decode": decode if isinstance(decode, str) else repr(decode),
        "transform": repr(transform),
        "size": size,
        "seconds": seconds,
        "batches": batches if batches or seconds else DEFAULT_BATCHES,
        "min_seconds": 0.0 if batches or seconds else DEFAULT_MIN_SECONDS,
        "warmup": warmup,
        "step_ms": step_ms,
        "cold": cold,
        "persistent_workers": persistent_workers,
        "multiprocessing_context": multiprocessing_context,
        "configs": [asdict(c) for c in configs],
    }
    if decode == "crop":
        settings["crop_decoder"] = "TurboJPEG 3, the crop's region" if turbojpeg() is not None else "PIL"
    warnings: list[str] = []
    if any(c.pin_memory for c in configs) and not torch.cuda.is_available():
        warnings.append("pin_memory has no effect without CUDA: measured with pin_memory off")
    opened: list[tuple[str, Dataset | None, dict[str, Any]]] = []
    for path in paths:
        name = os.fspath(path)
        try:
            opened.append((name, *open_source(path, decode=decode, transform=transform, size=size)))
        except PackdataError as exc:
            error = str(exc) if exc.path is not None else f"{name}: {exc}"  # named once
            opened.append((name, None, {"error": error}))
            warnings.append(error)
    ceiling = _make_ceiling(opened, decode, transform, size, ceiling_samples)
    all_sources: list[tuple[str, Dataset | None, dict[str, Any]]] = [ceiling, *opened]
    if repeats < 1:
        raise ConfigError(f"repeats should be at least 1, but got repeats={repeats}")

    def measure(name: str, dataset: Dataset, facts: dict[str, Any], config: LoaderConfig) -> ConfigResult:
        try:
            return measure_loader(
                dataset,
                config,
                batches=batches,
                seconds=seconds,
                warmup=warmup,
                step_ms=step_ms,
                collate_fn=collate_fn,
                multiprocessing_context=multiprocessing_context,
                mean_bytes=facts.get("mean_bytes", 0.0),
                sample_interval=sample_interval,
                source=name,
                kind=facts.get("format", ""),
            )
        except MEASURE_ERRORS as exc:
            return ConfigResult(name, facts.get("format", ""), **asdict(config), error=error_line(exc))

    runs: dict[tuple[str, LoaderConfig], list[ConfigResult]] = {}
    for _ in range(repeats):  # interleaved: a noisy minute hits every setting alike
        for name, dataset, facts in all_sources:
            if dataset is None:
                continue
            if cold and name != CEILING:
                reason = _drop_caches()
                if reason and reason not in warnings:
                    warnings.append(reason)
            for config in configs:
                if progress:
                    progress(f"bench {name}: {config}")
                result = measure(name, dataset, facts, config)
                runs.setdefault((name, config), []).append(result)
    results = [_median(group) for group in runs.values()]
    reference = {r.config: r.samples_per_s for r in results if r.source == CEILING and not r.error}
    for r in results:
        base = reference.get(r.config)
        if base and not r.error:
            r.vs_ceiling = r.samples_per_s / base
    source_facts = [{"name": name, **{k: v for k, v in facts.items()}} for name, _, facts in all_sources]
    return BenchResult(results, source_facts, settings, _system_facts(), warnings)


def _median(group: list[ConfigResult]) -> ConfigResult:
    """The run with the median throughput, carrying the spread of all runs of its setting."""
    good = sorted((r for r in group if not r.error), key=lambda r: r.samples_per_s)
    if not good:
        return group[0]
    middle = good[len(good) // 2]
    middle.repeats = len(good)
    middle.samples_per_s_min, middle.samples_per_s_max = good[0].samples_per_s, good[-1].samples_per_s
    return middle


def _make_ceiling(
    opened: list[tuple[str, Dataset | None, dict[str, Any]]],
    decode: str | DecodeFn,
    transform: Callable[[Any], Any] | None,
    size: int,
    max_samples: int,
) -> tuple[str, Dataset | None, dict[str, Any]]:
    for name, dataset, facts in opened:
        view = _raw_view(name, dataset, facts) if dataset is not None else None
        if view is None:
            continue
        kind = facts.get("kind", "image")
        tf: Callable[[Any], Any] | None
        if decode == "crop":  # the reference is the work DecodeCrop replaces: full decode, then the crop
            decoder, tf = _decoder("pil", kind, size), standard_transform(size) if kind == "image" else None
        else:
            decoder, tf = _decoder(decode, kind, size), transform if kind == "image" and decode != "bytes" else None
        memory = InMemoryDataset.from_dataset(view, max_samples=max_samples, transform=tf, decode=decoder)
        return (
            CEILING,
            memory,
            {
                "kind": kind,
                "format": "memory",
                "samples": len(memory),
                "held": memory.held,
                "mean_bytes": memory.mean_bytes,
                "from": name,
                "decode": decoder if isinstance(decoder, str) else repr(decoder),
                "transform": repr(tf),
            },
        )
    return CEILING, None, {"error": "no source could give its bytes for the ceiling"}
