"""Decode only what the crop needs: ``DecodeCrop(224)`` next to PIL full decode + the same random resized crop.

In memory (the decode ceiling: no I/O), single process, interleaved repeats::

    python benchmarks/bench_crop.py [--images 200] [--side 1024] [--repeats 5] [--folder DIR]

``DecodeCrop`` is measured through PIL (DCT scaling only) and, where TurboJPEG 3
is found (``pip install 'packdata[turbo]'``), through it (only the box's rows and
columns decoded). All draw the same boxes (``crop_box``, RandomResizedCrop's distribution) and
output 224x224 RGB; the reference decodes every JPEG at full size first, as
``torchvision.transforms.RandomResizedCrop`` after a PIL loader does.
"""

from __future__ import annotations

import argparse
import io
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from packdata.pack.turbo import turbojpeg
from packdata.reading.crop import DecodeCrop, crop_box


def _jpegs(n: int, side: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        h, w = side * 3 // 4, side
        y, x = np.mgrid[0:h, 0:w]
        base = ((x * (1 + i % 5) + y * 2) % 256).astype(np.uint8)
        pixels = np.stack([base, base[::-1], np.roll(base, i, 1)], -1) // 2 + rng.integers(0, 64, (h, w, 3), np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=88)
        out.append(buf.getvalue())
    return out


def _full_decode_crop(data: bytes, rng: random.Random) -> Image.Image:
    with Image.open(io.BytesIO(data)) as img:
        rgb = img.convert("RGB")
    top, left, h, w = crop_box(rgb.width, rgb.height, rng, (0.08, 1.0), (3 / 4, 4 / 3))
    return rgb.resize((224, 224), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--side", type=int, default=1024, help="longer side of the generated JPEGs")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--folder", help="read the first --images JPEGs under this folder instead of generating them")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core's work, as in a DataLoader worker (DecodeCrop resizes with torch)
    if args.folder:
        paths = sorted(p for p in Path(args.folder).rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))
        data = [p.read_bytes() for p in paths[: args.images]]
        with Image.open(io.BytesIO(data[0])) as first:
            what = f"{len(data)} JPEGs from {args.folder} (the first {first.width}x{first.height})"
    else:
        data = _jpegs(args.images, args.side)
        what = f"{args.images} JPEGs of {args.side}x{args.side * 3 // 4}"
    backends = {"DecodeCrop(224), PIL": False} | ({"DecodeCrop(224), TurboJPEG 3": True} if turbojpeg() else {})
    rates: dict[str, list[float]] = {"PIL full decode + crop": []} | {name: [] for name in backends}
    for r in range(args.repeats):
        rng = random.Random(r)
        start = time.perf_counter()
        for blob in data:
            _full_decode_crop(blob, rng)
        rates["PIL full decode + crop"].append(len(data) / (time.perf_counter() - start))
        for name, turbo in backends.items():
            decode = DecodeCrop(224, seed=r, turbo=turbo)
            start = time.perf_counter()
            for blob in data:
                decode(blob)
            rates[name].append(len(data) / (time.perf_counter() - start))
    base = statistics.median(rates["PIL full decode + crop"])
    size = sum(map(len, data)) / len(data) / 1e3
    print(f"{what} ({size:.0f} KB mean), {args.repeats} repeats")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"  {name:<30} {median:8.1f} images/s [{min(values):.1f} - {max(values):.1f}]  {median / base:.2f}x")


if __name__ == "__main__":
    main()
