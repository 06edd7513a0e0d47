"""Conversion throughput: the Ray engine with 1 and 2 worker processes next to the local engine.

One run, same data, same options, page cache warm for all::

    .venv/bin/python benchmarks/bench_ray.py [--images 3000] [--shard-samples 250] [--data bench-ray-data]

For each Ray size a fresh local Ray instance starts (``ray.init(num_cpus=N)``,
not timed). Two conversions are timed on it: ``cold`` is the first, and pays for
starting and importing the worker processes; ``warm`` is the second, on the same
workers, which is what a long conversion on a cluster amortises to. Every
figure is also printed as a ratio to the local engine's files/s.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from _common import cpus_note
from PIL import Image

from packdata import convert


def _make_images(root: Path, n: int) -> None:
    """Natural-looking JPEGs from :mod:`packdata.demo_data` when there, else gradients with grain."""
    try:
        from packdata.demo_data import make_sample_images
    except ImportError:
        rng = np.random.default_rng(0)
        for i in range(n):
            folder = root / f"c{i % 10:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            base = np.linspace(0, 255, 320)[None, :, None] * rng.uniform(0.3, 1, (1, 1, 3))
            pixels = np.clip(base + rng.normal(0, 12, (240, 320, 3)), 0, 255).astype(np.uint8)
            out = io.BytesIO()
            Image.fromarray(pixels).save(out, format="JPEG", quality=85)
            (folder / f"img_{i:06d}.jpg").write_bytes(out.getvalue())
        return
    make_sample_images(root, num_images=n)


def _warm(root: Path) -> int:
    total = 0
    for path in sorted(root.rglob("*.jpg")):
        total += len(path.read_bytes())
    return total


def _timed(src: Path, dst: Path, **options) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    result = convert(src, dst, shard_samples=options.pop("shard_samples"), overwrite=True, progress=False, **options)
    return {"files": result.packed, "seconds": result.seconds, "files_per_s": result.packed / result.seconds,
            "shards": result.shards}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--shard-samples", type=int, default=250, help="Files per shard (and per Ray task).")
    parser.add_argument("--data", type=Path, default=Path("bench-ray-data"))
    parser.add_argument("--json", type=Path, help="Also write the figures here.")
    args = parser.parse_args()
    import ray

    src, out = args.data / "images", args.data / "out"
    if not src.is_dir() or sum(1 for _ in src.rglob("*.jpg")) != args.images:
        shutil.rmtree(src, ignore_errors=True)
        _make_images(src, args.images)
    nbytes = _warm(src)
    print(f"# {args.images} JPEGs, {nbytes / 1e6:.0f} MB, {args.shard_samples} per shard, "
          f"{cpus_note()}", file=sys.stderr)  # fmt: skip

    figures: dict[str, dict] = {"local": _timed(src, out / "local.lmdb", shard_samples=args.shard_samples)}
    for cpus in (1, 2):
        started = time.perf_counter()
        ray.init(num_cpus=cpus, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
        init_s = time.perf_counter() - started
        for run in ("cold", "warm"):
            figure = _timed(src, out / f"ray{cpus}.lmdb", shard_samples=args.shard_samples, engine="ray")
            figures[f"ray {cpus} worker{'s' * (cpus > 1)} {run}"] = figure | {"ray_init_s": init_s}
        ray.shutdown()

    local = figures["local"]["files_per_s"]
    print(f"{'engine':<22} {'files/s':>9} {'seconds':>8} {'x local':>8}")
    for name, figure in figures.items():
        print(
            f"{name:<22} {figure['files_per_s']:>9.0f} {figure['seconds']:>8.2f} {figure['files_per_s'] / local:>8.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
