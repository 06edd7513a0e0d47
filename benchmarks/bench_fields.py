"""Multi-field samples (image + caption + JSON): convert and raw reads next to WebDataset and MosaicML Streaming.

One run, side by side, on generated samples (default 20,000), in an environment
with the peers installed (``pip install webdataset mosaicml-streaming``)::

    python benchmarks/bench_fields.py [--samples 20000] [--data bench-fields] [--repeats 3]

Convert: packdata from the grouped folder and from WebDataset tars, next to
WebDataset's ``ShardWriter`` and Streaming's ``MDSWriter`` writing the same
samples read from the same folder; each timed to its ``sync``. Raw reads (no
decode): ``LMDBDataset`` returning the three fields, next to ``wds.WebDataset``
and ``StreamingDataset`` over their own outputs, 0 and 2 DataLoader workers,
warm page cache. Repeats are interleaved; medians with min-max are printed.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from _common import cpus_note, import_streaming
from PIL import Image
from torch.utils.data import DataLoader

import packdata


def _samples(n: int) -> list[tuple[str, bytes, bytes, bytes]]:
    """``n`` (key, jpg, caption, json) samples: natural-looking JPEGs of about 20-40 KB."""
    rng = np.random.default_rng(0)
    out = []
    base = rng.integers(0, 255, (96, 128, 3), dtype=np.uint8)
    for i in range(n):
        pixels = np.roll(base, i % 97, axis=1) // 2 + rng.integers(0, 128, (96, 128, 3), dtype=np.uint8)
        image = Image.fromarray(pixels).resize((256, 192))
        buf = io.BytesIO()
        image.save(buf, format="JPEG", quality=85)
        caption = f"a photo number {i} of something {'quite ' * (i % 7)}interesting".encode()
        meta = json.dumps({"id": i, "boxes": [[i % 50, 3, 40, 60]], "source": "bench"}).encode()
        out.append((f"{i:07d}", buf.getvalue(), caption, meta))
    return out


def _write_folder(root: Path, samples: list[tuple[str, bytes, bytes, bytes]]) -> None:
    root.mkdir(parents=True)
    for key, jpg, txt, meta in samples:
        (root / f"{key}.jpg").write_bytes(jpg)
        (root / f"{key}.txt").write_bytes(txt)
        (root / f"{key}.json").write_bytes(meta)


def _read_folder(root: Path) -> list[dict]:
    """The grouped folder's samples as dicts, read from the files (what every writer starts from)."""
    keys = sorted({p.name.split(".", 1)[0] for p in root.iterdir()})
    return [
        {
            "__key__": key,
            "jpg": (root / f"{key}.jpg").read_bytes(),
            "txt": (root / f"{key}.txt").read_bytes(),
            "json": (root / f"{key}.json").read_bytes(),
        }
        for key in keys
    ]


def _sync() -> None:
    os.sync()


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def convert_packdata_folder(folder: Path, out: Path) -> None:
    packdata.convert(folder, out, layout="grouped", progress=False, overwrite=out.exists())


def convert_packdata_tars(tars: str, out: Path) -> None:
    packdata.convert(tars, out, progress=False, overwrite=out.exists())


def write_wds(folder: Path, out: Path) -> None:
    import webdataset as wds

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    with wds.ShardWriter(str(out / "data-%06d.tar"), maxcount=2500, verbose=0) as sink:  # 8 shards of 20,000
        for sample in _read_folder(folder):
            sink.write(sample)


def write_mds(folder: Path, out: Path) -> None:
    MDSWriter = import_streaming().MDSWriter

    shutil.rmtree(out, ignore_errors=True)
    columns = {"__key__": "str", "jpg": "bytes", "txt": "bytes", "json": "bytes"}
    with MDSWriter(out=str(out), columns=columns, size_limit=64 << 20) as sink:
        for sample in _read_folder(folder):
            sink.write(sample)


def _loader_rate(dataset: object, workers: int, n: int) -> float:
    loader = DataLoader(dataset, batch_size=64, num_workers=workers, collate_fn=list)  # type: ignore[arg-type]
    start = time.perf_counter()
    count = sum(len(batch) for batch in loader)
    assert count == n, (count, n)
    return n / (time.perf_counter() - start)


def read_packdata(pack: Path, workers: int, n: int) -> float:
    ds = packdata.LMDBDataset(pack, fields=("__key__", "jpg", "txt", "json"), decode="bytes")
    return _loader_rate(ds, workers, n)


def read_wds(tars: Path, workers: int, n: int) -> float:
    import webdataset as wds

    urls = sorted(str(p) for p in tars.glob("*.tar"))
    ds = wds.WebDataset(urls, shardshuffle=False, empty_check=False).to_tuple("__key__", "jpg", "txt", "json")
    return _loader_rate(ds, workers, n)


def read_mds(out: Path, workers: int, n: int) -> float:
    ds = import_streaming().StreamingDataset(local=str(out), shuffle=False, batch_size=64)
    return _loader_rate(ds, workers, n)


def _row(name: str, values: list[float], unit: str, reference: float | None = None) -> str:
    median = statistics.median(values)
    ratio = f"{median / reference:5.2f}x" if reference else "     "
    return f"  {name:<44} {median:10.1f} {unit}  [{min(values):.1f} - {max(values):.1f}]  {ratio}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--data", type=Path, default=Path("bench-fields"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    data: Path = args.data
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    samples = _samples(args.samples)
    folder = data / "grouped"
    _write_folder(folder, samples)
    write_wds(folder, data / "wds-src")  # the tar source packdata converts from
    tars = str(data / "wds-src" / "data-*.tar")
    size = sum(len(j) + len(t) + len(m) for _, j, t, m in samples)
    print(f"{args.samples} samples (jpg + txt + json), {size / 1e6:.1f} MB; {cpus_note()}")

    convert_times: dict[str, list[float]] = {k: [] for k in ("packdata folder", "packdata tars", "wds", "mds")}
    for _ in range(args.repeats):
        convert_times["packdata folder"].append(_timed(lambda: convert_packdata_folder(folder, data / "p.lmdb")))
        convert_times["packdata tars"].append(_timed(lambda: convert_packdata_tars(tars, data / "pt.lmdb")))
        convert_times["wds"].append(_timed(lambda: write_wds(folder, data / "wds")))
        convert_times["mds"].append(_timed(lambda: write_mds(folder, data / "mds")))
    fastest = min(statistics.median(convert_times["wds"]), statistics.median(convert_times["mds"]))
    print("convert + sync, seconds (ratio to the faster peer; target <= 1.0x):")
    for name, values in convert_times.items():
        print(_row(name, values, "s", fastest))

    readers = {
        "LMDBDataset (jpg, txt, json)": lambda w: read_packdata(data / "p.lmdb", w, args.samples),
        "wds.WebDataset": lambda w: read_wds(data / "wds", w, args.samples),
        "StreamingDataset": lambda w: read_mds(data / "mds", w, args.samples),
    }
    for workers in (0, 2):
        rates: dict[str, list[float]] = {k: [] for k in readers}
        for _ in range(args.repeats):
            for name, read in readers.items():
                rates[name].append(read(workers))
        best_peer = max(statistics.median(v) for k, v in rates.items() if not k.startswith("LMDB"))
        print(f"raw multi-field reads, warm, num_workers={workers}, samples/s (ratio to the fastest peer; >= 1.5x):")
        for name, values in rates.items():
            print(_row(name, values, "/s", best_peer))


if __name__ == "__main__":
    main()
