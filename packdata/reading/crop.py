"""Decode only what a random resized crop needs: ``DecodeCrop(224)``, a decoder that is also the crop.

torchvision's ``RandomResizedCrop`` decodes the whole image, then keeps a box of
8-100% of its area and downsizes it. ``DecodeCrop`` draws the box first, from
the image's header alone (the same distribution: :func:`crop_box` follows
``RandomResizedCrop.get_params``), then decodes a JPEG at the smallest DCT scale
(1/2, 1/4, 1/8: PIL's ``draft``) that still gives the box at least the output
size, and crops and resizes in one step (``Image.resize(box=...)``). Where the
box is large against the output, most of the decode is skipped; where it is
small, the full-resolution decode is kept, so the output is the full decode's
crop within JPEG rounding. Other formats decode at full size. No extra library
is needed (libjpeg-turbo, inside Pillow, does the scaling).

Use it as the dataset's decoder, in place of decode + ``RandomResizedCrop``::

    ds = packdata.LMDBDataset("train.lmdb", decode=packdata.DecodeCrop(224), transform=flip_and_to_tensor)

Workers: the random generator is seeded on first use in each process from
``torch.initial_seed()``, which the DataLoader makes different per worker and epoch.
"""

from __future__ import annotations

import math
import os
import random

import torch
from PIL import Image

from packdata.pack.images import open_image

__all__ = ["DecodeCrop", "crop_box"]


def crop_box(
    width: int, height: int, rng: random.Random, scale: tuple[float, float], ratio: tuple[float, float]
) -> tuple[int, int, int, int]:
    """``(top, left, height, width)`` of a random crop, as ``torchvision.transforms.RandomResizedCrop`` draws it.

    Ten tries at an area share in ``scale`` and a log-uniform aspect ratio in
    ``ratio``; if none fits, the central crop at the nearest allowed aspect ratio.
    """
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        h, w = height, round(height * max(ratio))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class DecodeCrop:
    """Decode image bytes straight to a random resized crop of ``size`` (see the module docstring).

    Args:
        size: the output side, or ``(height, width)``.
        scale: the range of the crop's share of the image area.
        ratio: the range of the crop's aspect ratio (width / height).
        seed: a fixed seed (tests and reproducible runs); by default per process from torch.
    """

    def __init__(
        self,
        size: int | tuple[int, int] = 224,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        *,
        seed: int | None = None,
    ) -> None:
        height, width = (size, size) if isinstance(size, int) else size
        if height < 1 or width < 1 or not 0 < scale[0] <= scale[1] or not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"size, scale and ratio should be positive ranges, but got {size}, {scale}, {ratio}")
        self.size = (int(height), int(width))
        self.scale, self.ratio, self.seed = scale, ratio, seed
        self._rng: random.Random | None = None
        self._pid = -1

    def _generator(self) -> random.Random:
        if self._rng is None or self._pid != os.getpid():
            self._rng = random.Random(self.seed if self.seed is not None else torch.initial_seed())
            self._pid = os.getpid()
        return self._rng

    def __call__(self, data: bytes) -> Image.Image:
        with open_image(data) as img:
            width, height = img.size
            top, left, h, w = crop_box(width, height, self._generator(), self.scale, self.ratio)
            out_h, out_w = self.size
            if img.format == "JPEG":
                shrink = min(w / out_w, h / out_h)  # how far the box may shrink and still cover the output
                if shrink >= 2:
                    img.draft("RGB", (math.ceil(width / shrink), math.ceil(height / shrink)))
            sx, sy = img.size[0] / width, img.size[1] / height  # the scale the decoder chose
            box = (left * sx, top * sy, (left + w) * sx, (top + h) * sy)
            rgb = img if img.mode == "RGB" else img.convert("RGB")  # convert("RGB") of RGB is a full copy
            return rgb.resize((out_w, out_h), Image.Resampling.BILINEAR, box=box)

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_rng": None, "_pid": -1}

    def __repr__(self) -> str:
        return f"DecodeCrop(size={self.size}, scale={self.scale}, ratio={self.ratio})"
