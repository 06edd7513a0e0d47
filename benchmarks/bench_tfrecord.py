"""TFRecord raw-read throughput: packdata's readers next to the ``tfrecord`` package's, warm cache.

One process, raw bytes (no decode), on a generated pack of JPEGs of about 50-90 KB::

    .venv/bin/python benchmarks/bench_tfrecord.py [--images 5000] [--texts 0] [--data /tmp/bench-tfrecord]

Prints samples/s of each reader and its ratio to the ``tfrecord`` package's
``tfrecord_loader`` (the reader its ``TFRecordDataset`` uses), then the median
time of one random fetch, warm: ``TFRecordIndexedDataset[i]`` (CRCs checked)
next to what a ``tfrecord`` package user writes for it (seek to the offset its
index gives, read, parse with the package's ``example_pb2``; nothing checked).
With ``--texts N`` the pack holds N text files of 4.6 KB instead of images.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
from _common import make_images, make_texts
from tfrecord import example_pb2
from tfrecord.reader import tfrecord_loader

from packdata import TFRecordDataset, TFRecordIndexedDataset, convert
from packdata.formats.tfrecord_tables import index_path


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
    parser.add_argument("--texts", type=int, default=0, help="text files instead of images")
    parser.add_argument("--shard-size", type=int, default=64 * 10**6)
    args = parser.parse_args()
    kind, count, suffix = ("texts", args.texts, ".txt") if args.texts else ("images", args.images, ".jpg")
    src, pack = args.data / kind, args.data / "pack"
    if not src.is_dir() or sum(1 for _ in src.rglob(f"*{suffix}")) != count:
        shutil.rmtree(src, ignore_errors=True)
        (make_texts if args.texts else make_images)(src, count)
    if pack.exists():
        shutil.rmtree(pack)
    convert(src, pack, format="tfrecord", shard_size=args.shard_size, progress=False)
    shards = sorted(pack.glob("*.tfrecord"))
    sizes = [p.stat().st_size for p in src.rglob(f"*{suffix}")]
    print(f"{count} {kind}, {np.mean(sizes) / 1e3:.1f} KB mean, {len(shards)} shards; one process, warm cache")
    field = "text/encoded" if args.texts else "image/encoded"

    def package() -> object:
        for shard in shards:
            for example in tfrecord_loader(str(shard), None, [field]):
                yield example[field]

    def package_indexed() -> object:
        for shard in shards:
            for example in tfrecord_loader(str(shard), str(index_path(shard)), [field], shard=(0, 1)):
                yield example[field]

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
    ours, theirs = single_fetch(pack, shards, field)
    print(f"one random fetch, median: TFRecordIndexedDataset {ours:.1f} us, tfrecord package by hand {theirs:.1f} us")


def single_fetch(pack: Path, shards: list[Path], field: str, n: int = 20_000) -> tuple[float, float]:
    """Median microseconds of one random warm fetch: packdata's map-style reader, then the package's way."""
    ds = TFRecordIndexedDataset(pack, decode="bytes")
    tables = [np.loadtxt(index_path(shard), dtype=np.int64, ndmin=2) for shard in shards]
    files = [open(shard, "rb") for shard in shards]  # noqa: SIM115 - closed below
    spots = [(f, int(o), int(m)) for f, table in zip(files, tables, strict=True) for o, m in table]

    def theirs(i: int) -> bytes:
        f, offset, length = spots[i]
        f.seek(offset)
        record = f.read(length)
        example = example_pb2.Example()
        example.ParseFromString(record[12 : length - 4])
        return example.features.feature[field].bytes_list.value[0]

    order = np.random.default_rng(0).integers(0, len(ds), n).tolist()
    assert all(ds[i][0] == theirs(i) for i in order[:200])  # the same bytes, and both warm
    times: dict[str, list[int]] = {"ours": [], "theirs": []}
    for i in order:
        for name, fetch in (("ours", ds.__getitem__), ("theirs", theirs)):
            start = time.perf_counter_ns()
            fetch(i)
            times[name].append(time.perf_counter_ns() - start)
    for f in files:
        f.close()
    return float(np.median(times["ours"])) / 1e3, float(np.median(times["theirs"])) / 1e3


if __name__ == "__main__":
    main()
