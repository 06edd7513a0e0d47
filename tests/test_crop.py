"""DecodeCrop: the boxes follow RandomResizedCrop's distribution, and the output is the full decode's crop."""

from __future__ import annotations

import io
import math
import random

import numpy as np
import pytest
import torch
from conftest import image_bytes
from PIL import Image
from torch.utils.data import DataLoader

import packdata
from packdata.reading.crop import DecodeCrop, crop_box

SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)


def _torchvision_get_params(width: int, height: int, scale, ratio) -> tuple[int, int, int, int]:
    """``torchvision.transforms.RandomResizedCrop.get_params`` as torchvision writes it (torch's RNG)."""
    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()
        w = round(math.sqrt(target_area * aspect_ratio))
        h = round(math.sqrt(target_area / aspect_ratio))
        if 0 < w <= width and 0 < h <= height:
            i = torch.randint(0, height - h + 1, size=(1,)).item()
            j = torch.randint(0, width - w + 1, size=(1,)).item()
            return i, j, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = round(w / min(ratio))
    elif in_ratio > max(ratio):
        h = height
        w = round(h * max(ratio))
    else:
        w = width
        h = height
    return (height - h) // 2, (width - w) // 2, h, w


def _stats(boxes: list[tuple[int, int, int, int]], width: int, height: int) -> np.ndarray:
    b = np.asarray(boxes, dtype=np.float64)
    share = b[:, 2] * b[:, 3] / (width * height)
    aspect = np.log(b[:, 3] / b[:, 2])
    return np.array([share.mean(), *np.quantile(share, [0.1, 0.5, 0.9]), aspect.mean(), aspect.std()])


@pytest.mark.parametrize(("width", "height"), [(1000, 800), (640, 640), (300, 900)])
def test_boxes_follow_torchvisions_distribution(width: int, height: int) -> None:
    torch.manual_seed(0)
    rng = random.Random(0)
    ours = [crop_box(width, height, rng, SCALE, RATIO) for _ in range(20_000)]
    theirs = [_torchvision_get_params(width, height, SCALE, RATIO) for _ in range(20_000)]
    assert all(t >= 0 and left >= 0 and t + h <= height and left + w <= width for t, left, h, w in ours)
    # area share: mean and 10/50/90% quantiles; log aspect: mean and spread (2e4 draws: ~0.01 noise)
    assert np.abs(_stats(ours, width, height) - _stats(theirs, width, height)).max() < 0.02


def test_a_box_that_never_fits_falls_back_to_the_central_crop() -> None:
    top, left, h, w = crop_box(1000, 100, random.Random(1), (0.9, 1.0), RATIO)
    assert (h, w) == (100, 133) and (top, left) == (0, (1000 - 133) // 2)


def _reference(data: bytes, box: tuple[int, int, int, int], size: int) -> np.ndarray:
    top, left, h, w = box
    with Image.open(io.BytesIO(data)) as img:
        full = img.convert("RGB").resize((size, size), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
    return np.asarray(full, dtype=np.int16)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_output_is_the_full_decodes_crop_within_jpeg_rounding(fmt: str) -> None:
    data = image_bytes(3, (1600, 1200), fmt=fmt)
    decode = DecodeCrop(224, seed=11)
    boxes = random.Random(11)
    worst = 0.0
    for _ in range(12):
        box = crop_box(1600, 1200, boxes, SCALE, RATIO)
        out = np.asarray(decode(data), dtype=np.int16)
        assert out.shape == (224, 224, 3)
        worst = max(worst, float(np.abs(out - _reference(data, box, 224)).mean()))
    assert worst < (0.01 if fmt == "PNG" else 4.0), worst


def test_decode_crop_in_spawned_workers_differs_per_worker(tmp_path) -> None:
    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    for i in range(8):
        (src / f"{i}.jpg").write_bytes(image_bytes(1, (400, 300)))  # the same image: crops must still differ
    packdata.convert(tmp_path / "src", tmp_path / "p.lmdb", progress=False)
    ds = packdata.LMDBDataset(tmp_path / "p.lmdb", decode=packdata.DecodeCrop(64))
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    crops = [np.asarray(img).tobytes() for img, _ in loader]
    assert len(crops) == 8 and len(set(crops)) == 8
