"""The main job on the built-in sample: generate, pack, read back, compare with the raw folder.

Run by ``make demo``. Everything lands in ``demo-data/`` (the sample is generated
once and reused; the packs are rebuilt every run).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from torch.utils.data import DataLoader

import packdata
from packdata.demo_data import make_sample_images, make_sample_texts
from packdata.measure.bench import BenchResult, run_bench
from packdata.units import format_size

DATA = Path(os.environ.get("PACKDATA_DEMO_DIR", "demo-data"))
BENCH = {"workers": (2,), "batch_sizes": (64,), "seconds": 4.0}
"""The demo's bench settings: what run_bench is given, and the command line to repeat it says."""


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _ensure(root: Path, make, **kwargs) -> Path:
    if not root.exists():
        _log(f"generating {root} ...")
        tmp = root.with_name(root.name + ".tmp")
        make(tmp, **kwargs)
        os.replace(tmp, root)
    return root


def bench_again(sources: list[Path]) -> str:
    """The ``packdata bench`` command line that measures what the demo did, three times interleaved."""
    program = Path(sys.executable).with_name("packdata")  # the demo's virtualenv, maybe not on PATH
    start = [os.path.relpath(program)] if program.exists() else [sys.executable, "-m", "packdata.cli"]
    settings = [
        *("--workers", ",".join(map(str, BENCH["workers"]))),
        *("--batch-size", ",".join(map(str, BENCH["batch_sizes"]))),
        *("--seconds", f"{BENCH['seconds']:g}"),
    ]
    return shlex.join([*start, "bench", *map(str, sources), *settings, "--repeat", "3"])


def bench_table(result: BenchResult, sources: list[Path]) -> str:
    """run_bench's table, its advice to repeat said as the command to run: the demo's user passes no repeats=."""
    below = "for a noise estimate, run the command below"
    table = result.table(say=lambda line: line.replace("run again with repeats=3 for a noise estimate", below))
    if below not in table:  # more than one run: no advice
        return table
    return f"{table}\nFor a noise estimate (every setting run 3 times, interleaved), run:\n  {bench_again(sources)}"


def main() -> None:
    images = _ensure(DATA / "images", make_sample_images, num_images=3000)
    texts = _ensure(DATA / "texts", make_sample_texts, num_files=2000)
    packs = {}
    for name, src, kwargs in [
        ("images.lmdb", images, {}),
        ("images-tfrecord", images, {"format": "tfrecord", "shard_size": 32 * 10**6}),
        ("texts.lmdb", texts, {"kind": "text"}),
    ]:
        result = packdata.convert(src, DATA / name, overwrite=True, **kwargs)
        _log(
            f"{name}: packed {result.packed:,} files ({format_size(result.bytes_in)}) in {result.shards} "
            f"shard{'s' * (result.shards != 1)}, {result.packed / result.seconds:,.0f} files/s"
        )
        packs[name] = DATA / name

    text_ds = packdata.LMDBDataset(packs["texts.lmdb"], decode="text")
    seen = sum(len(batch[0]) for batch in DataLoader(text_ds, batch_size=100, num_workers=2))
    print(
        f"texts.lmdb: read {seen:,} of {len(text_ds):,} text samples back through 2 workers; "
        f"first: {text_ds.keys[0]!r} -> {text_ds[0][0][:40]!r}..."
    )

    print(
        "\nDecoded image throughput (PIL decode + random-resized-crop 224 + flip), 2 workers, "
        "against the raw folder and the in-memory decode ceiling:"
    )
    sources = [images, packs["images.lmdb"], packs["images-tfrecord"]]
    result = run_bench(sources, **BENCH, progress=_log)
    print(bench_table(result, sources))


if __name__ == "__main__":
    main()
