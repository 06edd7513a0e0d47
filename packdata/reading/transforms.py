"""The standard training transform, without torchvision: crop, flip, uint8 tensor.

``standard_transform(224)`` does what ``torchvision.transforms.Compose([
RandomResizedCrop(224), RandomHorizontalFlip(), PILToTensor()])`` does, with
PIL and numpy only: a random crop of 8-100 % of the area at an aspect ratio of
3/4 to 4/3, resized to 224x224 in one PIL call (crop box and resize together,
so only the crop is resampled), a horizontal flip half the time, and a
``uint8`` CHW tensor. Normalisation is left to the device, where it is cheap.

Every transform is a small picklable class, so a dataset holding one can go to
``spawn``-ed workers. Randomness comes from ``torch``'s generator, which the
DataLoader seeds differently in every worker (numpy's global generator is not
reseeded by older torch versions, and forked workers would repeat its draws).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

__all__ = [
    "Compose",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "ToUint8Array",
    "ToUint8Tensor",
    "standard_transform",
]


def _rand() -> float:
    return float(torch.rand(()).item())


class Compose:
    """Apply transforms one after another."""

    def __init__(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        self.transforms = list(transforms)

    def __call__(self, x: Any) -> Any:
        for t in self.transforms:
            x = t(x)
        return x

    def __repr__(self) -> str:
        return f"Compose({self.transforms!r})"


class RandomResizedCrop:
    """Crop a random area and aspect ratio of a PIL image and resize it to ``size``.

    The same sampling as torchvision's ``RandomResizedCrop`` (ten tries, then a
    central crop clamped to the allowed ratios, at least one pixel on each side).

    Args:
        size: output side (square) or ``(height, width)``.
        scale: range of the crop's area as a fraction of the image's.
        ratio: range of the crop's aspect ratio (width / height).
        resample: PIL resampling filter.
    """

    def __init__(
        self,
        size: int | tuple[int, int] = 224,
        *,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        resample: int = Image.Resampling.BILINEAR,
    ) -> None:
        self.size = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
        if min(self.size) < 1:
            raise ValueError(f"size should be positive, but got size={size!r}")
        if not 0 < scale[0] <= scale[1] <= 1:
            raise ValueError(f"scale should satisfy 0 < min <= max <= 1, but got scale={scale!r}")
        if not 0 < ratio[0] <= ratio[1] < math.inf:
            raise ValueError(f"ratio should satisfy 0 < min <= max < inf, but got ratio={ratio!r}")
        self.scale = scale
        self.ratio = ratio
        self.resample = resample

    def box(self, width: int, height: int) -> tuple[int, int, int, int]:
        """A random crop box ``(left, top, right, bottom)`` for an image of this size."""
        area = width * height
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        for _ in range(10):
            target = area * (self.scale[0] + _rand() * (self.scale[1] - self.scale[0]))
            aspect = math.exp(log_lo + _rand() * (log_hi - log_lo))
            w = round(math.sqrt(target * aspect))
            h = round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                left = int(_rand() * (width - w + 1))
                top = int(_rand() * (height - h + 1))
                return left, top, left + w, top + h
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            w, h = width, max(1, round(width / self.ratio[0]))
        elif in_ratio > self.ratio[1]:
            w, h = max(1, round(height * self.ratio[1])), height
        else:
            w, h = width, height
        left, top = (width - w) // 2, (height - h) // 2
        return left, top, left + w, top + h

    def __call__(self, img: Image.Image) -> Image.Image:
        box = self.box(*img.size)
        height, width = self.size
        return img.resize((width, height), self.resample, box=box)

    def __repr__(self) -> str:
        return f"RandomResizedCrop(size={self.size}, scale={self.scale}, ratio={self.ratio})"


class RandomHorizontalFlip:
    """Mirror a PIL image or a CHW tensor left to right with probability ``p``."""

    def __init__(self, p: float = 0.5) -> None:
        if not 0 <= p <= 1:
            raise ValueError(f"p should be in [0, 1], but got p={p!r}")
        self.p = p

    def __call__(self, img: Image.Image | torch.Tensor) -> Image.Image | torch.Tensor:
        if _rand() < self.p:
            return img.flip(-1) if isinstance(img, torch.Tensor) else img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return img

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(p={self.p})"


ARRAY_MODES = ("L", "LA", "RGB", "RGBA")
"""PIL modes whose ``numpy.asarray`` is uint8 pixel values, one channel per band."""


def uint8_hwc(img: Image.Image | np.ndarray, who: str) -> np.ndarray:
    """A PIL image or numpy array as the ``uint8`` HWC array it holds; never cast (``TypeError`` naming ``who``)."""
    mode = getattr(img, "mode", None)
    if isinstance(mode, str) and mode not in ARRAY_MODES:
        raise TypeError(
            f"{who} expects images of mode {', '.join(ARRAY_MODES)}, but got mode {mode!r}, whose array "
            f"is not pixel values (a palette's indices, CMYK, YCbCr) or not uint8 (1-bit, 16-bit, float): "
            f"convert it, e.g. image.convert('RGB')"
        )
    array = np.asarray(img)
    if array.dtype != np.uint8:
        raise TypeError(f"{who} expects uint8 images, but got dtype={array.dtype}")
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3:
        raise TypeError(f"{who} expects HWC images, but got shape {array.shape}")
    return array


class ToUint8Array:
    """PIL image or ``uint8`` CHW tensor -> ``uint8`` numpy array, HWC (what :func:`packdata.fast_collate` stacks)."""

    def __call__(self, img: Image.Image | torch.Tensor) -> np.ndarray:
        if isinstance(img, torch.Tensor):
            return _chw_tensor(img).permute(1, 2, 0).numpy()
        return uint8_hwc(img, "ToUint8Array")

    def __repr__(self) -> str:
        return "ToUint8Array()"


def _chw_tensor(img: torch.Tensor) -> torch.Tensor:
    """``img`` itself when it is a ``uint8`` CHW tensor (what ``DecodeCrop(output="tensor")`` gives)."""
    if img.dtype != torch.uint8 or img.ndim != 3:
        raise TypeError(f"expected a uint8 CHW tensor, but got {img.dtype} of shape {tuple(img.shape)}")
    return img


class ToUint8Tensor:
    """PIL image -> ``uint8`` CHW tensor (like torchvision's ``PILToTensor``), no float conversion.

    A ``uint8`` CHW tensor passes through unchanged.
    """

    def __call__(self, img: Image.Image | torch.Tensor) -> torch.Tensor:
        if isinstance(img, torch.Tensor):
            return _chw_tensor(img)
        array = np.ascontiguousarray(uint8_hwc(img, "ToUint8Tensor").transpose(2, 0, 1))
        return torch.from_numpy(array)

    def __repr__(self) -> str:
        return "ToUint8Tensor()"


def standard_transform(size: int = 224, *, crop: bool = True, flip: bool = True, output: str = "tensor") -> Compose:
    """Random resized crop to ``size``, horizontal flip, then a ``uint8`` image.

    Args:
        size: output side in pixels.
        crop: start with the random resized crop (leave it out after a decoder
            that crops, :class:`packdata.DecodeCrop`).
        flip: add the random horizontal flip.
        output: ``"tensor"`` (CHW ``uint8`` tensor, for the default collate) or
            ``"array"`` (HWC ``uint8`` numpy array, for :func:`packdata.fast_collate`).
    """
    if output not in ("tensor", "array"):
        raise ValueError(f"output should be 'tensor' or 'array', but got output={output!r}")
    steps: list[Callable[[Any], Any]] = [RandomResizedCrop(size)] if crop else []
    if flip:
        steps.append(RandomHorizontalFlip())
    steps.append(ToUint8Tensor() if output == "tensor" else ToUint8Array())
    return Compose(steps)
