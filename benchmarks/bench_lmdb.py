"""Foundation benchmark: convert vs tar, raw reads vs naive py-lmdb and the folder, decode ceiling.

One run, side by side, on a generated dataset (default 20,000 images)::

    .venv/bin/python benchmarks/bench_lmdb.py [--images 20000] [--data bench-data]

Cold-cache figures need root (``/proc/sys/vm/drop_caches``); without it they are skipped.
Every figure is printed as a ratio to the thing users would use instead.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from _common import NaiveLMDB, drop_caches, in_fresh_process
from torch.utils.data import DataLoader, Dataset

from packdata import LMDBDataset, convert
from packdata.demo_data import make_sample_images
from packdata.reading.decode import decode_pil
from packdata.reading.transforms import standard_transform


class FolderBytes(Dataset):
    def __init__(self, files: list[str]) -> None:
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> bytes:
        with open(self.files[i], "rb") as f:
            return f.read()


class Decoded(Dataset):
    """Decode + standard transform over any bytes source: a pack, the folder, or memory."""

    def __init__(self, get_bytes, n: int) -> None:
        self.get_bytes, self.n, self.transform = get_bytes, n, standard_transform(224)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.transform(decode_pil(self.get_bytes(i)))


class _PackBytes:
    def __init__(self, ds: LMDBDataset) -> None:
        self.ds = ds

    def __call__(self, i: int) -> bytes:
        return self.ds.raw(i)[0]


class _MemoryBytes:
    def __init__(self, blobs: list[bytes]) -> None:
        self.blobs = blobs

    def __call__(self, i: int) -> bytes:
        return self.blobs[i % len(self.blobs)]


def raw_rate(reader: str, pack: Path, files: list[str], order: list[int], warm: bool) -> float:
    """Samples/s reading raw bytes in ``order`` with one reader, in this (fresh) process."""
    if reader == "packdata":
        ds = LMDBDataset(pack, decode="bytes")

        def get(i):
            return ds.raw(i)[0]
    elif reader == "naive_lmdb":
        get = NaiveLMDB(str(pack / "shard-00000.lmdb"), len(files)).__getitem__
    else:
        get = FolderBytes(files).__getitem__
    if warm:
        for i in order:
            get(i)
    start = time.perf_counter()
    for i in order:
        get(i)
    return len(order) / (time.perf_counter() - start)


def loader_rate(ds: Dataset, batches: int, workers: int = 2, batch_size: int = 64) -> float:
    torch.manual_seed(0)
    loader = DataLoader(
        ds, batch_size=batch_size, shuffle=True, num_workers=workers, multiprocessing_context="fork", prefetch_factor=4
    )
    it = iter(loader)
    for _ in range(3):  # warm-up: workers started, first batches out
        next(it)
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    elapsed = time.perf_counter() - start
    del it
    return batches * batch_size / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=20_000)
    parser.add_argument("--data", type=Path, default=Path("bench-data"))
    parser.add_argument("--cold-samples", type=int, default=4000)
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    src = args.data / f"images-{args.images}"
    if not src.exists():
        print(f"generating {args.images} images into {src} ...", file=sys.stderr)
        make_sample_images(src.with_suffix(".tmp"), num_images=args.images)
        os.replace(src.with_suffix(".tmp"), src)
    sorted(str(p) for p in src.rglob("*.jpg"))
    results: dict[str, float] = {}

    # 1. convert vs tar -cf, both from a cold cache and including the final sync
    cold = drop_caches()
    tar_path = args.data / "images.tar"
    start = time.perf_counter()
    subprocess.run(["tar", "-cf", str(tar_path), "-C", str(src), "."], check=True)
    os.sync()
    results["tar_seconds"] = time.perf_counter() - start
    tar_path.unlink()
    pack = args.data / "images.lmdb"
    shutil.rmtree(pack, ignore_errors=True)
    drop_caches()
    start = time.perf_counter()
    convert(src, pack, progress=False)
    os.sync()
    results["convert_seconds"] = time.perf_counter() - start
    results["convert_over_tar"] = results["convert_seconds"] / results["tar_seconds"]

    # 2. raw bytes, one process, random order; each reader in a fresh process of its own
    #    (py-lmdb refuses a second handle on one environment in a process)
    ds = LMDBDataset(pack, decode="bytes")
    folder_files = [str(src / k) for k in ds.keys]
    order = list(range(len(ds)))
    random.Random(0).shuffle(order)
    readers = ("packdata", "naive_lmdb", "folder")
    for name in readers:
        results[f"warm_{name}"] = in_fresh_process(raw_rate, name, pack, folder_files, order, True)
    if cold:
        sub = order[: args.cold_samples]
        for name in readers:
            drop_caches()
            results[f"cold_{name}"] = in_fresh_process(raw_rate, name, pack, folder_files, sub, False)
    results["warm_packdata_over_naive"] = results["warm_packdata"] / results["warm_naive_lmdb"]
    results["warm_packdata_over_folder"] = results["warm_packdata"] / results["warm_folder"]
    if cold:
        results["cold_packdata_over_folder"] = results["cold_packdata"] / results["cold_folder"]
        results["cold_packdata_over_naive"] = results["cold_packdata"] / results["cold_naive_lmdb"]

    # 3. decoded DataLoader throughput, 2 workers, against the in-memory decode ceiling
    # The ceiling holds 1,024 of the same images in memory (index modulo 1,024): a list of
    # every blob would make forked workers copy pages on access and measure that instead.
    blobs = [ds.raw(i)[0] for i in range(1024)]
    results["decoded_ceiling"] = loader_rate(Decoded(_MemoryBytes(blobs), len(ds)), args.batches)
    del blobs
    results["decoded_packdata"] = loader_rate(Decoded(_PackBytes(ds), len(ds)), args.batches)
    results["decoded_folder"] = loader_rate(Decoded(FolderBytes(folder_files).__getitem__, len(ds)), args.batches)
    results["decoded_packdata_over_ceiling"] = results["decoded_packdata"] / results["decoded_ceiling"]
    results["decoded_folder_over_ceiling"] = results["decoded_folder"] / results["decoded_ceiling"]

    width = max(map(len, results))
    for name, value in results.items():
        print(f"{name:<{width}}  {value:12.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
