"""Keys a conversion remembers: KeySet's peak memory and time per key, and a list walk's time per row.

One run, side by side, each key count in fresh processes (spawned, one per mode and repeat, interleaved)::

    .venv/bin/python benchmarks/bench_keys.py [--keys 200000] [--rows 20000] [--repeats 3] [--data DIR]

Modes: ``memory`` (today's KeySet with no spill folder: every key stays in
memory), ``default`` (spilling past the 256 MiB budget) and ``16MiB`` (a
16 MiB budget). For each: the process's RSS after its imports, its peak RSS
(``ru_maxrss``) after adding the keys, the time per key, new/memory time ratios
per repeat, and the read calls per new key looked up afterwards (``syscr`` of
``/proc/self/io``: a key that gets past the in-memory filter reads each run on
disk). The list walk: ``ListSource.walk`` over a CSV of ``--rows`` rows naming
small files, microseconds per row. docs/figures.md (keys a conversion remembers)
gives the command for the sizes it reports: ``--keys 1000000,5000000 --rows 200000``.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from _common import in_fresh_process

_MODES = {"memory": None, "default": 0, "16MiB": 16 << 20}
_LOOKUPS = 20_000  # new keys looked up once all are added


def _rss() -> int:
    """This process's resident memory now, in bytes."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _read_calls() -> int:
    with open("/proc/self/io", encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("syscr:"))


def _keyset_run(mode: str, count: int, spill: str) -> dict[str, float]:
    """In a fresh process: add ``count`` distinct keys to a KeySet in ``mode``, then look up new ones."""
    from packdata.pack.keyset import KeySet

    budget = _MODES[mode]
    start_rss = _rss()
    keys = KeySet(spill=None if budget is None else Path(spill), budget=budget or None)
    began = time.perf_counter()
    for i in range(count):
        keys.add(f"train/c{i % 1000:03d}/img_{i:09d}.jpg", i)
    seconds = time.perf_counter() - began
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    calls = _read_calls()
    absent = sum(f"val/c{i % 1000:03d}/img_{i:09d}.jpg" in keys for i in range(_LOOKUPS))
    reads = (_read_calls() - calls) / _LOOKUPS
    runs = keys.runs
    keys.close()
    assert absent == 0
    return {"start": start_rss, "peak": peak, "us_per_key": seconds / count * 1e6, "reads": reads, "runs": runs}


def _list(root: Path, rows: int) -> Path:
    """A CSV list of ``rows`` rows, each naming its own small file in ``root``, in 10 classes."""
    listing = root / f"list-{rows}.csv"
    if listing.exists():
        return listing
    files = root / "files"
    files.mkdir(parents=True, exist_ok=True)
    lines = ["path,label"]
    for i in range(rows):
        name = f"files/{i:07d}.txt"
        (root / name).write_bytes(b"x")
        lines.append(f"{name},c{i % 10}")
    listing.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return listing


def _walk_us_per_row(listing: Path, rows: int, spill: Path) -> float:
    from packdata.conversion.lists import scan_list

    source = scan_list(listing, label_column="label")
    began = time.perf_counter()
    walked = sum(1 for _ in source.walk(spill))
    assert walked == rows, walked
    return (time.perf_counter() - began) / rows * 1e6


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", default="200000", help="key counts, comma-separated (default 200000)")
    parser.add_argument("--rows", type=int, default=20_000, help="rows of the walked list (0: no walk)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--data", default=None, help="folder for the spilled runs and the list (default: a temp, removed)"
    )
    args = parser.parse_args()
    data = Path(args.data or tempfile.mkdtemp(prefix="bench-keys-"))
    data.mkdir(parents=True, exist_ok=True)
    try:
        _run(args, data)
    finally:
        if args.data is None:
            shutil.rmtree(data)


def _run(args: argparse.Namespace, data: Path) -> None:
    for count in (int(k) for k in args.keys.split(",")):
        results: dict[str, list[dict[str, float]]] = {mode: [] for mode in _MODES}
        for repeat in range(args.repeats):  # interleaved: the machine's load falls on every mode alike
            for mode in _MODES:
                spill = data / f"spill-{mode}-{repeat}"
                results[mode].append(in_fresh_process(_keyset_run, mode, count, os.fspath(spill)))
        print(f"\n{count:,} keys, {args.repeats} repeats (median [min-max]):")
        print(f"{'mode':<8} {'start RSS':>10} {'peak RSS':>10} {'us/key':>18} {'vs memory':>10} {'reads/new key':>14}")
        for mode, runs in results.items():
            us = [r["us_per_key"] for r in runs]
            ratio = statistics.median(
                r["us_per_key"] / m["us_per_key"] for r, m in zip(runs, results["memory"], strict=True)
            )
            print(
                f"{mode:<8} {_mib(statistics.median(r['start'] for r in runs)):>10} "
                f"{_mib(statistics.median(r['peak'] for r in runs)):>10} "
                f"{statistics.median(us):>6.2f} [{min(us):.2f}-{max(us):.2f}] {ratio:>10.2f} "
                f"{statistics.median(r['reads'] for r in runs):>8.3f} ({int(runs[0]['runs'])} runs)"
            )
    if args.rows:
        listing = _list(data, args.rows)
        us = [_walk_us_per_row(listing, args.rows, data / "walk-spill") for _ in range(args.repeats)]
        print(f"\nlist walk, {args.rows:,} rows: {statistics.median(us):.1f} us a row [{min(us):.1f}-{max(us):.1f}]")


if __name__ == "__main__":
    main()
