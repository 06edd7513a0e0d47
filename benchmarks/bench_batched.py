"""Raw warm reads of small records: batched (``__getitems__``) vs per-sample ``LMDBDataset`` vs a naive py-lmdb reader.

Side by side in one run, interleaved repeats, ``DataLoader(batch_size=64, shuffle=True, num_workers=0)``::

    python benchmarks/bench_batched.py [--records 20000] [--repeats 7]

The pack is one shard (92 MB, under the 256 MB default); the same records in
16 MB shards (6) and 1 MB shards (92: a batch of 64 touches ~50 of them, as on
a terabyte pack of 256 MB shards) show what a batch spread over shards costs.

The naive reader (a transaction per item, the usual py-lmdb dataset) checks
nothing; ``LMDBDataset`` checks every payload's CRC32C. The row "no records.i64"
reads the one-shard pack with its location table deleted (a pack of an older
packdata): records found by walking the shard's pages, each record's CRC-32 checked.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from _common import NaiveLMDB, make_texts
from torch.utils.data import DataLoader

import packdata


class _PerSample(packdata.LMDBDataset):
    __getitems__ = None  # the DataLoader falls back to one __getitem__ per sample


def _rate(dataset: object) -> float:
    loader = DataLoader(dataset, batch_size=64, shuffle=True, num_workers=0, collate_fn=list)  # type: ignore[arg-type]
    start = time.perf_counter()
    n = sum(len(batch) for batch in loader)
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-batched-"))
    try:
        make_texts(work / "src", args.records)  # 4.6 KB of text each
        packdata.convert(work / "src", work / "t.lmdb", progress=False)
        packdata.convert(work / "src", work / "s.lmdb", shard_size=16 * 10**6, progress=False)  # 6 shards
        packdata.convert(work / "src", work / "m.lmdb", shard_size=10**6, progress=False)  # 92 shards
        shutil.copytree(work / "t.lmdb", work / "nt.lmdb")
        (work / "nt.lmdb" / "shard-00000.lmdb" / "records.i64").unlink()
        naive_copy = work / "naive.lmdb"  # py-lmdb opens a file once per process: the naive reader gets a copy
        shutil.copytree(work / "t.lmdb" / "shard-00000.lmdb", naive_copy)
        rates: dict[str, list[float]] = {
            "LMDBDataset batched": [],
            "... 16 MB shards": [],
            "... 1 MB shards": [],
            "LMDBDataset per sample": [],
            "... no records.i64": [],
            "naive py-lmdb": [],
        }
        for _ in range(args.repeats):
            rates["LMDBDataset batched"].append(_rate(packdata.LMDBDataset(work / "t.lmdb", decode="bytes")))
            rates["... 16 MB shards"].append(_rate(packdata.LMDBDataset(work / "s.lmdb", decode="bytes")))
            rates["... 1 MB shards"].append(_rate(packdata.LMDBDataset(work / "m.lmdb", decode="bytes")))
            rates["LMDBDataset per sample"].append(_rate(_PerSample(work / "t.lmdb", decode="bytes")))
            rates["... no records.i64"].append(_rate(packdata.LMDBDataset(work / "nt.lmdb", decode="bytes")))
            rates["naive py-lmdb"].append(_rate(NaiveLMDB(str(naive_copy), args.records)))
        naive = statistics.median(rates["naive py-lmdb"])
        print(f"{args.records} records of 4.6 KB, warm, batch 64, 0 workers, {args.repeats} interleaved repeats")
        for name, values in rates.items():
            median = statistics.median(values)
            spread = f"[{min(values):,.0f} - {max(values):,.0f}]"
            print(f"  {name:<24} {median:>10,.0f}/s {spread}  {median / naive:.2f}x naive")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
