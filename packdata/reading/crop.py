"""Decode only what a random resized crop needs: ``DecodeCrop(224)``, a decoder that is also the crop.

torchvision's ``RandomResizedCrop`` decodes the whole image, then keeps a box of
8-100% of its area and downsizes it. ``DecodeCrop`` draws the box first, from
the image's header alone (the same distribution: :func:`crop_box` follows
``RandomResizedCrop.get_params``), then decodes a JPEG at the smallest DCT scale
(1/2, 1/4, 1/8: PIL's ``draft``) that still gives the box at least the output
size, and crops and resizes in one step (``Image.resize(box=...)``). Where the
box is large against the output, most of the decode is skipped; where it is
small, the full-resolution decode is kept, so the output is the full decode's
crop within JPEG rounding. Other formats decode at full size. As with
:func:`packdata.reading.decode.decode_pil`, EXIF orientation is not applied: the box is drawn on
the pixels as stored. No extra library
is needed (libjpeg-turbo, inside Pillow, does the scaling).

Where TurboJPEG 3 is found (``pip install 'packdata[turbo]'``, or a system
``libturbojpeg`` 3: :mod:`packdata.pack.turbo`), an RGB or greyscale JPEG is
decoded through it instead, and only the box's rows and columns are decoded
(at the same DCT scale): rows below the box are never read, and the inverse
DCT and colour conversion run on the box alone. At full scale the box is then
resized by torch's uint8 antialiased bilinear kernel, as torchvision's tensor
transform does (PIL's resize also filters with pixels just outside the box:
the two differ on the box's edge rows and columns only). A JPEG that does not end with
its end-of-image marker (cut short) still goes through PIL's full decode, which
names it, since rows after the cut may lie below the box, where the partial
decode never reads. ``DecodeCrop(turbo=False)`` keeps PIL; ``turbo=True`` fails
when the library is missing.

Use it as the dataset's decoder, in place of decode + ``RandomResizedCrop``::

    ds = packdata.LMDBDataset(
        "train.lmdb",
        decode=packdata.DecodeCrop(224, output="tensor"),
        transform=packdata.standard_transform(224, crop=False),  # flip; the tensor passes through
    )

Workers: the random generator is seeded on first use in each process from
``torch.initial_seed()``, which the DataLoader makes different per worker and epoch
(with ``seed=``, from that seed and the worker's).
"""

from __future__ import annotations

import math
import os
import random

import numpy as np
import torch
from PIL import Image

from packdata.errors import ConfigError
from packdata.pack.images import JPEG_FORMATS, decoding_errors, open_image, rgb_image
from packdata.pack.turbo import turbojpeg
from packdata.reading.transforms import ToUint8Tensor

__all__ = ["DecodeCrop", "crop_box"]


def crop_box(
    width: int, height: int, rng: random.Random, scale: tuple[float, float], ratio: tuple[float, float]
) -> tuple[int, int, int, int]:
    """``(top, left, height, width)`` of a random crop, as ``torchvision.transforms.RandomResizedCrop`` draws it.

    Ten tries at an area share in ``scale`` and a log-uniform aspect ratio in
    ``ratio``; if none fits, the central crop at the nearest allowed aspect ratio,
    at least one pixel on each side (torchvision's is empty where a side rounds to 0).
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
        w, h = width, max(1, round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, max(1, round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _resize(pixels: np.ndarray, height: int, width: int, output: str) -> Image.Image | torch.Tensor:
    """An RGB array resized as torchvision's tensor ``RandomResizedCrop`` does (antialiased bilinear, uint8).

    torch's uint8 kernel and the merge take about a third of PIL's time here; it matches
    PIL's ``resize(box=...)`` within 1 except on the box's edge rows and
    columns, which PIL filters with the pixels beyond the box and torch does not.
    """
    image = torch.from_numpy(pixels).permute(2, 0, 1).unsqueeze(0)  # channels-last strides: the fast path
    out = torch.nn.functional.interpolate(image, size=(height, width), mode="bilinear", antialias=True)
    planes = out[0].contiguous()  # CHW: the tensor output as it is
    if output == "tensor":
        return planes
    # one plane per channel: merged by PIL, not transposed by numpy or torch
    return Image.merge(
        "RGB", [Image.frombuffer("L", (width, height), plane, "raw", "L", 0, 1) for plane in planes.numpy()]
    )


class DecodeCrop:
    """Decode image bytes straight to a random resized crop of ``size`` (see the module docstring).

    Args:
        size: the output side, or ``(height, width)``.
        scale: the range of the crop's share of the image area.
        ratio: the range of the crop's aspect ratio (width / height).
        seed: a fixed seed (tests and reproducible runs); by default per process from torch.
            In a DataLoader worker it is mixed with the worker's seed (different per worker
            and epoch, reproducible where the DataLoader's generator is seeded).
        turbo: decode JPEGs through TurboJPEG 3: None when it is found, True
            always (``ConfigError`` when it is not found), False never.
        output: ``"pil"`` (an RGB PIL image) or ``"tensor"`` (a ``uint8`` CHW tensor,
            which ``standard_transform(size, crop=False)`` flips and passes on, and
            :func:`packdata.fast_collate` stacks: at full scale with TurboJPEG it skips
            the merge into a PIL image and the transpose back, about 0.1 ms a sample).
    """

    def __init__(
        self,
        size: int | tuple[int, int] = 224,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        *,
        seed: int | None = None,
        turbo: bool | None = None,
        output: str = "pil",
    ) -> None:
        height, width = (size, size) if isinstance(size, int) else size
        finite = all(map(math.isfinite, (*scale, *ratio)))
        if height < 1 or width < 1 or not finite or not 0 < scale[0] <= scale[1] or not 0 < ratio[0] <= ratio[1]:
            raise ValueError(
                f"size, scale and ratio should be positive finite ranges, but got {size}, {scale}, {ratio}"
            )
        if output not in ("pil", "tensor"):
            raise ValueError(f"output should be 'pil' or 'tensor', but got output={output!r}")
        self.output = output
        self.size = (int(height), int(width))
        if turbo and turbojpeg() is None:
            raise ConfigError(
                "DecodeCrop(turbo=True): no TurboJPEG 3 library found",
                hint="pip install 'packdata[turbo]', or set PACKDATA_LIBTURBOJPEG to a libturbojpeg.so of version 3",
            )
        self.scale, self.ratio, self.seed, self.turbo = scale, ratio, seed, turbo
        self._rng: random.Random | None = None
        self._pid = -1

    def _generator(self) -> random.Random:
        if self._rng is None or self._pid != os.getpid():
            worker = torch.utils.data.get_worker_info()  # its seed differs per worker and epoch
            if self.seed is None:
                self._rng = random.Random(torch.initial_seed())
            else:  # in a worker, the fixed seed with the worker's: no two workers or epochs repeat the same boxes
                self._rng = random.Random(self.seed if worker is None else f"{self.seed}:{worker.seed}")
            self._pid = os.getpid()
        return self._rng

    def __call__(self, data: bytes) -> Image.Image | torch.Tensor:
        image = self._decode(data)
        return image if self.output == "pil" or isinstance(image, torch.Tensor) else ToUint8Tensor()(image)

    def _decode(self, data: bytes) -> Image.Image | torch.Tensor:
        data = bytes(data)  # a no-op for bytes; a memoryview (a mapped pack's slice) is copied once
        with decoding_errors(), open_image(data) as img:
            width, height = img.size
            top, left, h, w = crop_box(width, height, self._generator(), self.scale, self.ratio)
            out_h, out_w = self.size
            box = (left, top, left + w, top + h)
            if img.format in JPEG_FORMATS:
                reach = min(w / out_w, h / out_h)  # how far the box may shrink and still cover the output
                turbo = turbojpeg() if self.turbo is not False and img.mode in ("RGB", "L") else None
                if turbo is not None and data.rstrip(b"\0").endswith(b"\xff\xd9"):  # whole: ends with EOI
                    shrink = next(f for f in (8, 4, 2, 1) if f <= max(reach, 1))  # the scales PIL's draft uses
                    pixels, region = turbo.decode(data, box, shrink)
                    if shrink == 1:  # the box is whole pixels: torch's resize (at a scale its edges are not)
                        left, top, right, bottom = map(int, region)
                        return _resize(pixels[top:bottom, left:right], out_h, out_w, self.output)
                    return Image.fromarray(pixels).resize((out_w, out_h), Image.Resampling.BILINEAR, box=region)
                if reach >= 2:
                    img.draft("RGB", (math.ceil(width / reach), math.ceil(height / reach)))
            sx, sy = img.size[0] / width, img.size[1] / height  # the scale the decoder chose
            scaled = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
            rgb = img if img.mode == "RGB" else rgb_image(img)  # convert("RGB") of RGB is a full copy
            return rgb.resize((out_w, out_h), Image.Resampling.BILINEAR, box=scaled)

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_rng": None, "_pid": -1}

    def __repr__(self) -> str:
        return (
            f"DecodeCrop(size={self.size}, scale={self.scale}, ratio={self.ratio}, turbo={self.turbo}, "
            f"output={self.output!r})"
        )
