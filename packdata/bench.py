"""``packdata bench``: DataLoader throughput and memory, measured the way you train.

Each source (a pack or a raw folder) goes through the real
``torch.utils.data.DataLoader`` and the real dataset classes, for every
combination of the swept settings. Batches are timed one by one after a
warm-up; a background thread samples the memory of the main process and every
worker. Next to the sources, the **ceiling** is always measured: the same
decode and transform on bytes already in memory, through the same DataLoader
settings, so every figure is also a ratio to what decoding alone allows.

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

import itertools
import json
import os
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from packdata.decode import DecodeFn, DecodeJPEG, resolve_decoder
from packdata.errors import ConfigError, PackdataError, SourceError
from packdata.loader import list_collate, worker_init_fn
from packdata.manifest import MANIFEST_NAME, read_manifest
from packdata.sources import SourceFile, scan_source
from packdata.transforms import standard_transform

__all__ = [
    "CEILING",
    "BenchResult",
    "ConfigResult",
    "FolderDataset",
    "InMemoryDataset",
    "LoaderConfig",
    "measure_loader",
    "open_source",
    "plot_bench",
    "run_bench",
]

CEILING = "ceiling"
_DEFAULT_BATCHES = 50


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


# --------------------------------------------------------------------- datasets


class _Blob:
    """Many byte strings in one numpy buffer plus offsets (no per-item Python objects)."""

    def __init__(self, items: Iterable[bytes]) -> None:
        chunks = list(items)
        self.offsets = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum([len(c) for c in chunks], out=self.offsets[1:])
        self.data = np.frombuffer(b"".join(chunks), dtype=np.uint8)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> bytes:
        return self.data[self.offsets[i] : self.offsets[i + 1]].tobytes()


class FolderDataset(Dataset):
    """The raw folder as ``torchvision.datasets.ImageFolder`` reads it: one file per sample.

    Files and labels come from :func:`packdata.sources.scan_source` (the same
    rules and order as ``convert``); the list is kept as one byte buffer and
    numpy arrays, so forked workers do not copy it on access. Files the walk
    skips (hidden, other kinds) are counted in ``skipped``.

    Workers: nothing is held open; each ``__getitem__`` opens, reads and closes its file.

    Args:
        root: the folder.
        transform: applied to the decoded sample.
        decode: ``"pil"``, ``"bytes"``, ``"text"`` or a callable on the bytes.
        kind: ``"image"``, ``"text"`` or ``"auto"``.

    Raises:
        SourceError: the folder is missing or holds no usable file.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        transform: Callable[[Any], Any] | None = None,
        decode: str | DecodeFn = "pil",
        *,
        kind: str = "auto",
    ) -> None:
        source = scan_source(root, kind)
        self.root = source.root
        self.kind = source.kind
        self.classes = source.classes
        self.transform = transform
        self.decode = resolve_decoder(decode)
        paths: list[bytes] = []
        labels: list[int] = []
        total = 0
        self.skipped: Counter[str] = Counter()
        for entry in source.walk():
            if isinstance(entry, SourceFile):
                paths.append(os.fsencode(entry.path))
                labels.append(entry.label)
                try:
                    total += os.stat(entry.path).st_size
                except OSError:
                    self.skipped["unreadable"] += 1
            else:
                self.skipped[entry.reason] += 1
        if not paths:
            raise SourceError(f"no {self.kind} files found", path=self.root, hint="Check the folder and --kind")
        self._paths = _Blob(paths)
        self.targets = np.asarray(labels, dtype=np.int32)
        self.mean_bytes = total / len(paths)

    def __len__(self) -> int:
        return len(self.targets)

    def raw(self, index: int) -> tuple[bytes, int]:
        """The file's bytes and label."""
        with open(os.fsdecode(self._paths[index]), "rb") as f:
            return f.read(), int(self.targets[index])

    def __getitem__(self, index: int) -> tuple[Any, int]:
        data, label = self.raw(index)
        sample = self.decode(data)
        if self.transform is not None:
            sample = self.transform(sample)
        return sample, label


class InMemoryDataset(Dataset):
    """Samples whose encoded bytes are already in memory: decode and transform only.

    The decode ceiling: what a loader reaches when reading costs nothing. The
    bytes sit in one numpy buffer, shared by forked workers.

    Args:
        samples: ``(bytes, label)`` pairs.
        transform: applied to the decoded sample.
        decode: ``"pil"``, ``"bytes"``, ``"text"`` or a callable on the bytes.
    """

    def __init__(
        self,
        samples: Iterable[tuple[bytes, int]],
        transform: Callable[[Any], Any] | None = None,
        decode: str | DecodeFn = "pil",
    ) -> None:
        pairs = list(samples)
        self._data = _Blob(data for data, _ in pairs)
        self.targets = np.asarray([label for _, label in pairs], dtype=np.int32)
        self.transform = transform
        self.decode = resolve_decoder(decode)
        self.mean_bytes = float(self._data.offsets[-1]) / max(len(pairs), 1)

    @classmethod
    def from_dataset(
        cls,
        dataset: Any,
        *,
        max_samples: int = 1024,
        max_bytes: int = 256 << 20,
        transform: Callable[[Any], Any] | None = None,
        decode: str | DecodeFn = "pil",
    ) -> InMemoryDataset:
        """Copy the raw bytes of up to ``max_samples`` samples, spread over ``dataset``.

        ``dataset`` needs a ``raw(index) -> (bytes, label)`` method (the pack and
        folder datasets have one).
        """
        n = len(dataset)
        picks: Any = np.unique(np.linspace(0, n - 1, num=min(n, max_samples)).astype(np.int64)) if n else []
        pairs: list[tuple[bytes, int]] = []
        size = 0
        for index in picks:
            data, label = dataset.raw(int(index))
            pairs.append((data, label))
            size += len(data)
            if size >= max_bytes:
                break
        return cls(pairs, transform, decode)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        sample = self.decode(self._data[index])
        if self.transform is not None:
            sample = self.transform(sample)
        return sample, int(self.targets[index])


def _decoder(decode: str | DecodeFn, kind: str, size: int) -> DecodeFn | str:
    if kind == "text":
        return "bytes" if decode == "none" else "text"
    if callable(decode):
        return decode
    choices: dict[str, DecodeFn | str] = {"none": "bytes", "pil": "pil", "reduced": DecodeJPEG(size)}
    if decode not in choices:
        raise ConfigError(f"decode should be 'none', 'pil' or 'reduced', but got decode={decode!r}")
    return choices[decode]


def open_source(
    path: str | os.PathLike,
    *,
    decode: str | DecodeFn = "pil",
    transform: Callable[[Any], Any] | None = None,
    size: int = 224,
) -> tuple[Dataset, dict[str, Any]]:
    """Open a pack (LMDB or TFRecord) or a raw folder as the dataset users train with.

    Args:
        path: a pack directory (with ``manifest.json``) or a source folder.
        decode: ``"none"`` (bytes), ``"pil"``, ``"reduced"`` (:class:`DecodeJPEG`
            to ``size``), or a callable. Text sources always decode to text (or bytes with ``"none"``).
        transform: applied to decoded images (ignored for text and ``"none"``).
        size: the output size for ``"reduced"``.

    Returns:
        ``(dataset, facts)``, facts being the source's ``kind``, ``format``,
        ``samples``, ``mean_bytes`` and ``skipped`` counts.

    Raises:
        PackdataError: the path is neither a readable pack nor a usable folder,
            or the pack's reader is not available.
    """
    path = Path(path)
    if (path / MANIFEST_NAME).is_file():
        manifest = read_manifest(path)
        decoder = _decoder(decode, manifest.kind, size)
        tf = transform if manifest.kind == "image" and decode != "none" else None
        dataset: Any
        if manifest.format == "lmdb":
            from packdata.datasets import LMDBDataset

            dataset = LMDBDataset(path, transform=tf, decode=decoder)
        elif manifest.format == "tfrecord":
            dataset = _open_tfrecord(path, tf, decoder)
        else:
            raise ConfigError(f"bench does not know the pack format {manifest.format!r}", path=path)
        sizes = getattr(getattr(dataset, "pack", None), "index", None)
        mean = (
            float(np.mean(sizes.sizes))
            if sizes is not None and len(sizes.sizes)
            else manifest.total_bytes / max(manifest.num_samples, 1)
        )
        facts = {
            "kind": manifest.kind,
            "format": manifest.format,
            "samples": manifest.num_samples,
            "mean_bytes": mean,
            "skipped": dict(manifest.skipped.get("by_reason", {}) or {}),
        }
        return dataset, facts
    if not path.is_dir():
        raise SourceError(
            "no such pack or folder", path=path, hint="Pass a pack made by `packdata convert` or a folder"
        )
    kind = scan_source(path).kind
    decoder = _decoder(decode, kind, size)
    folder = FolderDataset(path, transform if kind == "image" and decode != "none" else None, decoder, kind=kind)
    facts = {
        "kind": kind,
        "format": "folder",
        "samples": len(folder),
        "mean_bytes": folder.mean_bytes,
        "skipped": dict(folder.skipped),
    }
    return folder, facts


def _open_tfrecord(path: Path, transform: Callable[[Any], Any] | None, decoder: DecodeFn | str) -> Any:
    try:
        import importlib

        module = importlib.import_module("packdata.tfrecord_dataset")
    except ModuleNotFoundError as exc:
        raise ConfigError(
            "this packdata has no TFRecord reader",
            path=path,
            hint="Install a packdata with packdata.tfrecord_dataset, or bench an LMDB pack",
        ) from exc
    return module.TFRecordDataset(path, transform=transform, decode=decoder)


def _raw_view(name: str, dataset: Any, facts: dict[str, Any]) -> Any:
    """Something with ``raw(index)`` over the source (the indexed reader for a streaming TFRecord pack)."""
    if hasattr(dataset, "raw"):
        return dataset
    if facts.get("format") == "tfrecord":
        from packdata.tfrecord_dataset import TFRecordIndexedDataset

        return TFRecordIndexedDataset(name, decode="bytes")
    return None


# ----------------------------------------------------------------------- memory

_ROLLUP = re.compile(rb"^(\w+):\s+(\d+) kB", re.M)


def _process_memory(proc: psutil.Process) -> dict[str, int] | None:
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


class _MemorySampler:
    """Samples the main process and all its descendants every ``interval`` seconds."""

    def __init__(self, interval: float = 0.25) -> None:
        self.interval = interval
        self.main = psutil.Process()
        self.ticks: list[tuple[dict[str, int], list[dict[str, int]], int, int]] = []
        self._procs: dict[int, psutil.Process] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.swap_start = psutil.swap_memory().used

    def sample(self) -> None:
        main = _process_memory(self.main) or {}
        workers = []
        try:
            children = self.main.children(recursive=True)
        except psutil.Error:
            children = []
        for child in children:
            proc = self._procs.setdefault(child.pid, child)
            mem = _process_memory(proc)
            if mem is not None:
                workers.append(mem)
        tick = (main, workers, psutil.virtual_memory().available, psutil.swap_memory().used)
        with self._lock:
            self.ticks.append(tick)

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the main process and its live descendants so far."""
        total = 0.0
        try:
            procs = [self.main, *self.main.children(recursive=True)]
        except psutil.Error:
            procs = [self.main]
        for proc in procs:
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system
        return total

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
            for main, workers, _, _ in ticks:
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
            "processes_peak": max((1 + len(t[1]) for t in ticks), default=1),
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


# ---------------------------------------------------------------- measurement


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

    @property
    def config(self) -> LoaderConfig:
        return LoaderConfig(
            self.num_workers, self.batch_size, self.pin_memory, self.prefetch_factor, self.persistent_workers
        )


def _batch_len(batch: Any) -> int:
    if isinstance(batch, (tuple, list)) and batch:
        batch = batch[-1]
    if isinstance(batch, dict):
        batch = next(iter(batch.values()))
    return len(batch)


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
        raise ConfigError("the loader yields no full batch", hint="Use a smaller --batch-size")

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
    (default 50 batches). With ``step_ms`` the main process sleeps that long
    after each batch, as a training step would occupy it, and
    ``data_wait_share`` is the share of the timed wall clock spent waiting for data.
    ``cpu_ms_per_sample`` is the CPU time (user + system) the main process and
    the workers alive at the end spent per timed sample (approximate with workers:
    batches prefetched at either edge of the timed window shift it): unlike samples/s it
    hardly moves when other work shares the machine, so compare routes with it there.

    Raises:
        ConfigError: the dataset holds fewer samples than one batch.
    """
    if batches is None and seconds is None:
        batches = _DEFAULT_BATCHES
    result = ConfigResult(source, kind, **asdict(config))
    iterable = isinstance(dataset, IterableDataset)
    if not iterable and len(dataset) < config.batch_size:  # type: ignore[arg-type]
        raise ConfigError(
            f"the source holds {len(dataset)} samples, fewer than batch_size={config.batch_size}",  # type: ignore[arg-type]
            hint="Use a smaller --batch-size",
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
                first = time.perf_counter() - started if first is None else first
                if step_ms:
                    time.sleep(step_ms / 1000)
            timed_start = time.perf_counter()
            cpu_start = sampler.cpu_seconds()
            while not (batches is not None and result.batches >= batches) and not (
                seconds is not None and time.perf_counter() - timed_start >= seconds
            ):
                before = time.perf_counter()
                batch = epochs.next()
                now = time.perf_counter()
                first = now - started if first is None else first
                waits.append(now - before)
                result.batches += 1
                result.samples += _batch_len(batch)
                del batch
                if step_ms:
                    time.sleep(step_ms / 1000)
            result.seconds = time.perf_counter() - timed_start
            cpu = sampler.cpu_seconds() - cpu_start
            result.cpu_ms_per_sample = 1000 * cpu / result.samples if result.samples else 0.0
            sampler.sample()
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


# -------------------------------------------------------------------- results


@dataclass
class BenchResult:
    """Every configuration measured, the sources, settings, and system facts."""

    results: list[ConfigResult]
    sources: list[dict[str, Any]]
    settings: dict[str, Any]
    system: dict[str, Any]
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "results": [asdict(r) for r in self.results],
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

    def table(self) -> str:
        """A fixed-width table, one line per source and setting."""
        width = max([len(r.source) for r in self.results] + [6])
        head = (
            f"{'source':<{width}} {'wk':>3} {'batch':>5} {'pin':>3} {'pf':>2} {'samples/s':>10} {'MB/s':>7} "
            f"{'x ceil':>6} {'cpu ms':>6} {'1st(s)':>6} {'p50ms':>6} {'p95ms':>6} {'wait%':>5} {'USS main':>9} "
            f"{'USS wk':>8} {'file':>8} {'avail min':>9}"
        )
        lines = [head]
        for r in self.results:
            pin = "y" if r.pin_memory else "n"
            if r.error:
                lines.append(
                    f"{r.source:<{width}} {r.num_workers:>3} {r.batch_size:>5} {pin:>3} "
                    f"{r.prefetch_factor:>2}  error: {r.error}"
                )
                continue
            mem = r.memory
            ratio = f"{r.vs_ceiling:.2f}" if r.vs_ceiling is not None else "-"
            lines.append(
                f"{r.source:<{width}} {r.num_workers:>3} {r.batch_size:>5} {pin:>3} {r.prefetch_factor:>2} "
                f"{r.samples_per_s:>10.1f} {r.mb_per_s:>7.1f} {ratio:>6} {r.cpu_ms_per_sample:>6.2f} "
                f"{r.first_batch_s:>6.2f} "
                f"{r.wait_p50_ms:>6.1f} {r.wait_p95_ms:>6.1f} {100 * r.data_wait_share:>5.1f} "
                f"{_mb(mem['main']['uss_peak']):>9} {_mb(mem['workers']['uss_peak']):>8} "
                f"{_mb(mem['total']['file_peak']):>8} {_mb(mem['mem_available_min']):>9}"
            )
        lines.append(
            "USS: private memory (peak); file: file-backed pages, i.e. page cache (mmap'd packs), "
            "shared and reclaimable; cpu ms: CPU time per sample, all processes; wait%: share of time waiting for data"
        )
        return "\n".join(lines)


def _mb(n: int) -> str:
    return f"{n / 2**20:.0f}M" if n < 10 * 2**30 else f"{n / 2**30:.1f}G"


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
    try:
        from packdata.system import cpu_counts

        facts["cpu_counts"] = _plain(cpu_counts())
    except Exception:  # system facts are informative only; never fail a bench on them
        pass
    return facts


def _plain(value: Any) -> Any:
    if hasattr(value, "_asdict"):
        return dict(value._asdict())
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    return value


def _drop_caches() -> str | None:
    """Drop the page cache (root only); returns why not, or None when done."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "--cold needs root to drop the page cache; measured warm"
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
            (every combination); ``pin_memory`` is measured off without CUDA.
        persistent_workers: keep workers between epochs.
        decode: ``"none"``, ``"pil"``, ``"reduced"`` (DCT-scaled JPEG decode to
            ``size``, see :class:`packdata.DecodeJPEG`) or a callable.
        transform: ``"standard"`` (random resized crop to ``size``, flip,
            uint8 tensor), None, or a callable.
        size: output side of the standard transform.
        seconds, batches: timed budget per setting after ``warmup`` batches
            (default 50 batches; both: whichever ends first).
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
        ConfigError: no sources, or an option value is invalid.
    """
    paths = [sources] if isinstance(sources, (str, os.PathLike)) else list(sources)
    if not paths:
        raise ConfigError("no sources to bench", hint="Pass one or more packs or folders")
    if isinstance(transform, str):
        if transform != "standard":
            raise ConfigError(f"transform should be 'standard', None or a callable, but got transform={transform!r}")
        transform = standard_transform(size)
    if collate_fn is None and (transform is None or decode == "none"):
        collate_fn = list_collate
    configs = [
        LoaderConfig(w, b, p, f, persistent_workers)
        for w, b, p, f in itertools.product(
            _as_tuple(workers), _as_tuple(batch_sizes), _as_tuple(pin_memory), _as_tuple(prefetch_factor)
        )
    ]
    for c in configs:
        if c.num_workers < 0 or c.batch_size < 1 or c.prefetch_factor < 1:
            raise ConfigError(f"invalid setting {c}: workers >= 0, batch size >= 1 and prefetch factor >= 1")
    settings = {
        "decode": decode if isinstance(decode, str) else repr(decode),
        "transform": repr(transform),
        "size": size,
        "seconds": seconds,
        "batches": batches if batches or seconds else _DEFAULT_BATCHES,
        "warmup": warmup,
        "step_ms": step_ms,
        "cold": cold,
        "persistent_workers": persistent_workers,
        "multiprocessing_context": multiprocessing_context,
        "configs": [asdict(c) for c in configs],
    }
    warnings: list[str] = []
    if any(c.pin_memory for c in configs) and not torch.cuda.is_available():
        warnings.append("pin_memory has no effect without CUDA: measured with pin_memory off")
    opened: list[tuple[str, Dataset | None, dict[str, Any]]] = []
    for path in paths:
        name = os.fspath(path)
        try:
            opened.append((name, *open_source(path, decode=decode, transform=transform, size=size)))
        except PackdataError as exc:
            opened.append((name, None, {"error": str(exc)}))
            warnings.append(f"{name}: {exc}")
    ceiling = _make_ceiling(opened, decode, transform, size, ceiling_samples)
    all_sources: list[tuple[str, Dataset | None, dict[str, Any]]] = [ceiling, *opened]
    results: list[ConfigResult] = []
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
            try:
                result = measure_loader(
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
            except (PackdataError, RuntimeError, OSError, TypeError, ValueError) as exc:
                result = ConfigResult(
                    name, facts.get("format", ""), **asdict(config), error=f"{type(exc).__name__}: {exc}"
                )
            results.append(result)
    reference = {r.config: r.samples_per_s for r in results if r.source == CEILING and not r.error}
    for r in results:
        base = reference.get(r.config)
        if base and not r.error:
            r.vs_ceiling = r.samples_per_s / base
    source_facts = [{"name": name, **{k: v for k, v in facts.items()}} for name, _, facts in all_sources]
    return BenchResult(results, source_facts, settings, _system_facts(), warnings)


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
        decoder = _decoder(decode, kind, size)
        tf = transform if kind == "image" and decode != "none" else None
        memory = InMemoryDataset.from_dataset(view, max_samples=max_samples, transform=tf, decode=decoder)
        return (
            CEILING,
            memory,
            {"kind": kind, "format": "memory", "samples": len(memory), "mean_bytes": memory.mean_bytes, "from": name},
        )
    return CEILING, None, {"error": "no source could give its bytes for the ceiling"}


def plot_bench(result: BenchResult, path: str | os.PathLike) -> Path:
    """Plot throughput and peak memory (PSS summed over processes) against num_workers, one line per source.

    PSS rather than USS: forking a worker makes the parent's pages shared, so the
    parent's USS drops as workers start while PSS sums the processes honestly.

    Raises:
        ConfigError: matplotlib is not installed (``pip install 'packdata[plot]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("--plot needs matplotlib", hint="pip install 'packdata[plot]'") from exc
    fig, (ax_speed, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2))
    groups: dict[tuple[str, int, bool, int], list[ConfigResult]] = {}
    for r in result.results:
        if not r.error:
            groups.setdefault((r.source, r.batch_size, r.pin_memory, r.prefetch_factor), []).append(r)
    several = len({k[1:] for k in groups}) > 1
    for (source, batch, pin, pf), rows in groups.items():
        rows.sort(key=lambda r: r.num_workers)
        label = Path(source).name or source
        if several:
            label += f" (batch {batch}, pin {'on' if pin else 'off'}, pf {pf})"
        x = [r.num_workers for r in rows]
        style = "--" if source == CEILING else "-"
        ax_speed.plot(x, [r.samples_per_s for r in rows], style, marker="o", label=label)
        ax_mem.plot(x, [r.memory["total"]["pss_peak"] / 2**20 for r in rows], style, marker="o", label=label)
    ax_speed.set(xlabel="num_workers", ylabel="samples/s", title="Throughput")
    ax_mem.set(xlabel="num_workers", ylabel="MiB", title="Peak memory, main + workers (PSS)")
    for ax in (ax_speed, ax_mem):
        ax.set_ylim(bottom=0)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
