"""TFRecord raw-read throughput: packdata's readers next to the ``tfrecord`` package's, warm cache.

One process, raw bytes (no decode), on a generated pack of JPEGs of about 50-90 KB::

    .venv/bin/python benchmarks/bench_tfrecord.py [--images 5000] [--data /tmp/bench-tfrecord]

Prints samples/s of each reader and its ratio to the ``tfrecord`` package's
``tfrecord_loader`` (the reader its ``TFRecordDataset`` uses).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
from _common import make_images
from tfrecord.reader import tfrecord_loader

from packdata import TFRecordDataset, TFRecordIndexedDataset, convert
from packdata.formats.tfrecord import index_path


def timed(readers: dict, rounds: int = 5) -> dict[str, float]:
    """Best samples/s of each reader over ``rounds`` full passes, interleaved.

    Readers take turns pass by pass, so a busy machine slows them all alike.
    """
    best = dict.fromkeys(readers, 0.0)
    mb_per_sample = {}
    for _ in range(rounds):
        for label, iterate in readers.items():
            start = time.perf_counter()
            count = nbytes = 0
            for data in iterate():
                count += 1
                nbytes += len(data)
            best[label] = max(best[label], count / (time.perf_counter() - start))
            mb_per_sample[label] = nbytes / count / 1e6
    for label, rate in best.items():
        print(f"  {label:<46} {rate:>9,.0f} samples/s  ({rate * mb_per_sample[label]:,.0f} MB/s)")
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--data", type=Path, default=Path("/tmp/bench-tfrecord"))
    parser.add_argument("--shard-size", type=int, default=64 * 10**6)
    args = parser.parse_args()
    src, pack = args.data / "images", args.data / "pack"
    if not src.is_dir() or sum(1 for _ in src.rglob("*.jpg")) != args.images:
        shutil.rmtree(src, ignore_errors=True)
        make_images(src, args.images)
    if pack.exists():
        shutil.rmtree(pack)
    convert(src, pack, format="tfrecord", shard_size=args.shard_size, progress=False)
    shards = sorted(pack.glob("*.tfrecord"))
    sizes = [p.stat().st_size for p in src.rglob("*.jpg")]
    print(f"{args.images} JPEGs, {np.mean(sizes) / 1e3:.0f} KB mean, {len(shards)} shards; one process, warm cache")

    def package() -> object:
        for shard in shards:
            for example in tfrecord_loader(str(shard), None, ["image/encoded"]):
                yield example["image/encoded"]

    def package_indexed() -> object:
        for shard in shards:
            for example in tfrecord_loader(str(shard), str(index_path(shard)), ["image/encoded"], shard=(0, 1)):
                yield example["image/encoded"]

    def stream(check_crc: bool) -> object:
        ds = TFRecordDataset(pack, decode="bytes", shuffle=False, check_crc=check_crc)
        return (data for data, _ in ds)

    def stream_shuffled() -> object:
        return (data for data, _ in TFRecordDataset(pack, decode="bytes", shuffle=True, seed=1))

    def indexed_random() -> object:
        ds = TFRecordIndexedDataset(pack, decode="bytes")
        order = np.random.default_rng(0).permutation(len(ds))
        return (ds[int(i)][0] for i in order)

    results = timed(
        {
            "tfrecord_package": package,
            "tfrecord_package_indexed": package_indexed,
            "packdata_stream": lambda: stream(True),
            "packdata_stream_nocrc": lambda: stream(False),
            "packdata_stream_shuffled": stream_shuffled,
            "packdata_indexed_random": indexed_random,
        }
    )
    base = results["tfrecord_package"]
    print(
        json.dumps(
            {k: {"samples_per_s": round(v), "x_tfrecord": round(v / base, 2)} for k, v in results.items()}, indent=1
        )
    )


if __name__ == "__main__":
    main()
