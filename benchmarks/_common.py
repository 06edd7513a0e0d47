"""Helpers shared by the benchmark scripts: generated data, the naive py-lmdb reader, cache drops, fresh processes.

The scripts run as ``python benchmarks/bench_x.py``, so this module imports as ``_common``.
"""

from __future__ import annotations

import importlib.util
import io
import multiprocessing
import os
import sys
import types
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
from PIL import Image

from packdata.formats.lmdb_env import encode_key
from packdata.host.cores import usable_cpus

__all__ = [
    "NaiveLMDB",
    "cpus_note",
    "drop_caches",
    "import_streaming",
    "in_fresh_process",
    "make_images",
    "make_texts",
]


def cpus_note() -> str:
    """The CPUs a run may use, in words, with the host's count beside it where it differs.

    Counted as convert and tune count them (:func:`packdata.host.cores.usable_cpus`: the affinity cut to the
    cgroup's CPU quota): ``2 CPUs``, or ``2 CPUs (the host has 8)``.
    """
    usable, host = usable_cpus(), os.cpu_count()
    return f"{usable} CPUs" if usable == host else f"{usable} CPUs (the host has {host})"


def drop_caches() -> bool:
    """Sync, then drop the page cache (``echo 3 > /proc/sys/vm/drop_caches``); False when not allowed (not root)."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def in_fresh_process(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` in a new (spawned) process that has exited, its mappings gone, when this returns."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


class NaiveLMDB:
    """The py-lmdb reader most projects write: a transaction per item, readahead off, nothing checked.

    ``ds[i]`` is the value stored under key ``encode_key(i)`` (fixed-width big-endian, as packdata's shards and
    the naive writers here use). The environment opens on first access, in the process that reads.
    """

    def __init__(self, shard: str, n: int) -> None:
        self.shard, self.n, self.env = shard, n, None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> bytes:
        if self.env is None:
            self.env = lmdb.open(self.shard, readonly=True, lock=False, readahead=False, meminit=False)
        with self.env.begin() as txn:
            return txn.get(encode_key(i))


def import_streaming() -> types.ModuleType:
    """MosaicML Streaming without its ``streaming.vision`` subpackage (the only part needing torchvision).

    PyPI's torchvision cannot load beside a CPU torch build, and ``streaming``
    imports ``streaming.vision`` eagerly; an empty stand-in for that subpackage
    lets the writer and the dataset load, and nothing here uses the vision datasets.
    """
    if importlib.util.find_spec("torchvision") is None:
        sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    import streaming

    return streaming


def make_images(
    root: Path, count: int, *, sides: tuple[int, int] = (290, 380), classes: int = 10, part: tuple[int, int] = (0, 1)
) -> None:
    """``count`` noisy-gradient JPEGs in ``classes`` class folders, deterministic.

    Square, a side drawn from ``sides``, quality 90: 50-90 KB (73 KB mean) at the
    default sides, about 90 KB mean at ``(320, 420)``. ``part=(k, parts)`` writes
    only every ``parts``-th image from the ``k``-th, so processes can share the work.
    """
    for i in range(part[0], count, part[1]):
        rng = np.random.default_rng(i)
        side = int(rng.integers(*sides))
        base = np.linspace(0, 255, side)[None, :, None] * np.ones((side, 1, 3))
        pixels = np.clip(base + rng.normal(0, 35, (side, side, 3)), 0, 255).astype(np.uint8)
        folder = root / f"c{i % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, format="JPEG", quality=90)
        (folder / f"{i:06d}.jpg").write_bytes(out.getvalue())


def make_texts(root: Path, count: int, *, sizes: tuple[int, int] = (4600, 4600), classes: int = 1) -> None:
    """``count`` ASCII text files (hex digits) in ``classes`` class folders, deterministic.

    Each file's size is drawn uniformly from ``sizes`` (inclusive, bytes; even sizes);
    the default makes every file 4.6 KB.
    """
    rng = np.random.default_rng(0)
    lengths = rng.integers(sizes[0] // 2, sizes[1] // 2 + 1, count)
    for i, half in enumerate(lengths.tolist()):
        folder = root / f"c{i % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:06d}.txt").write_bytes(rng.bytes(half).hex().encode())
