"""Cold-cache reads of small files: folder, LMDB in random order, LMDB with BlockShuffleSampler and its read-ahead.

One run, side by side, raw bytes, one process, page cache dropped before each (needs root)::

    .venv/bin/python benchmarks/bench_locality.py [--files 50000] [--data bench-data]

The issue's reference figures on such data: folder ~9,900 samples/s, naive LMDB in
random order ~12,600, LitData (chunk-sequential) ~49,000. Shuffle quality of each
order is printed next to its speed (``packdata.shuffle_quality``).
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

from _common import drop_caches, in_fresh_process

from packdata import BlockShuffleSampler, LMDBDataset, convert, shuffle_quality
from packdata.demo_data import make_sample_texts


def rate(kind: str, pack: str, src: str, order: list[int]) -> float:
    ds = LMDBDataset(pack, decode="bytes")
    if kind == "folder":
        files = [os.path.join(src, ds.keys[i]) for i in order]  # the index is read before the clock starts
        start = time.perf_counter()
        for f in files:
            with open(f, "rb") as fh:
                fh.read()
    elif kind == "lmdb":
        start = time.perf_counter()
        for i in order:
            ds.raw(i)
    else:  # the sampler itself, so its read-ahead (or its absence) runs as in training
        sampler = BlockShuffleSampler(ds, seed=0, read_ahead=kind == "lmdb, read-ahead")
        start = time.perf_counter()
        for i in sampler:
            ds.raw(i)
    return len(order) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=50_000)
    parser.add_argument("--data", type=Path, default=Path("bench-data"))
    args = parser.parse_args()
    src = args.data / f"texts-{args.files}"
    if not src.exists():
        make_sample_texts(src.with_suffix(".tmp"), num_files=args.files)
        os.replace(src.with_suffix(".tmp"), src)
    pack = args.data / f"texts-{args.files}.lmdb"
    if not pack.exists():
        convert(src, pack, kind="text", progress=False)
    n = len(LMDBDataset(pack))
    uniform = list(range(n))
    random.Random(0).shuffle(uniform)
    sampler = BlockShuffleSampler(n, seed=0)
    orders = {
        "folder, random": ("folder", uniform),
        "lmdb, random": ("lmdb", uniform),
        "lmdb, BlockShuffleSampler": ("lmdb, no read-ahead", list(sampler)),
        "lmdb, Block... + read-ahead": ("lmdb, read-ahead", list(sampler)),
    }
    print(f"{'reader':<28} {'cold samples/s':>14} {'displacement':>12} {'correlation':>11}")
    for name, (kind, order) in orders.items():
        if not drop_caches():
            raise SystemExit("cold reads need root (/proc/sys/vm/drop_caches)")
        value = in_fresh_process(rate, kind, str(pack), str(src), order)
        q = shuffle_quality(order)
        print(f"{name:<28} {value:>14.0f} {q.displacement:>12.3f} {q.correlation:>11.3f}")


if __name__ == "__main__":
    main()
