"""Turn stored bytes into what a model reads: a PIL image, text, JSON, an array, an int, or bytes.

Decoders are plain picklable callables, so a dataset that holds one can go to
``spawn``-ed DataLoader workers.
"""

from __future__ import annotations

import codecs
import io
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.lib.format as npy_format
from PIL import Image

from packdata.errors import DecodeError
from packdata.pack.fields import DECIMAL_INTEGER, check_npy
from packdata.pack.images import IMAGE_FORMATS, JPEG_FORMATS, decoding_errors, open_image
from packdata.pack.turbo import decoded_rgb

__all__ = [
    "IMAGE_FORMATS",
    "DecodeFn",
    "CODEC_DECODERS",
    "DecodeJPEG",
    "decode_int",
    "decode_json",
    "decode_npy",
    "decode_pil",
    "decode_text",
    "open_image",
    "resolve_decoder",
]

DecodeFn = Callable[[bytes], Any]
_DAMAGED = "Check that decode= (or the field's codec) fits the data; if it does, run `packdata verify` on the pack"


def decode_pil(data: bytes) -> Image.Image:
    """Decode image bytes into an RGB PIL image, as ImageFolder's loader does.

    EXIF orientation is not applied: the pixels as stored (as ImageFolder gives
    them, and as :class:`packdata.DecodeCrop` crops them). Where TurboJPEG 3 is
    found (:mod:`packdata.pack.turbo`), an RGB or greyscale JPEG is decoded
    through it, to the same pixels, refusing a JPEG cut short and closed with
    an end-of-image marker, whose missing rows PIL fills with grey.

    Raises:
        ImageFormatError: not one of :data:`IMAGE_FORMATS`, truncated or damaged, or
            of more than 8 bits a channel (a 16-bit PNG: RGB would clip it white).
    """
    with decoding_errors(), open_image(data) as img:
        return decoded_rgb(img, data, img.size)


class DecodeJPEG:
    """Decode an image at reduced size: JPEG DCT scaling straight to what is needed.

    A JPEG decoder can scale by 1/2, 1/4 or 1/8 while decoding (PIL's
    ``Image.draft``), doing a fraction of the work of a full decode followed by
    a resize. This decoder picks the smallest such scale whose result is still
    at least ``min_size``, so a 224 px training crop never decodes more pixels
    than it needs: a 1024x768 JPEG asked for 256 decodes at 512x384.
    Non-JPEG images (PNG, WebP, ...) decode normally at full size.

    The model sees what a resize to the reduced size followed by the usual
    transform would give; with ``RandomResizedCrop`` small crops of a large
    image are upsampled from fewer source pixels, so ask for the crop size or
    somewhat more (``min_size=256`` for a 224 crop keeps small crops sharp).

    Args:
        min_size: the shorter side the decoded image must at least have, or
            ``(height, width)`` it must at least cover.
    """

    def __init__(self, min_size: int | tuple[int, int] = 224) -> None:
        height, width = (min_size, min_size) if isinstance(min_size, int) else min_size
        if int(height) < 1 or int(width) < 1:
            raise ValueError(f"min_size should be positive, but got min_size={min_size!r}")
        self.min_size = (int(height), int(width))

    def __call__(self, data: bytes) -> Image.Image:
        with decoding_errors(), open_image(data) as img:
            full = img.size
            if img.format in JPEG_FORMATS:
                height, width = self.min_size
                img.draft("RGB", (width, height))
            return decoded_rgb(img, data, full)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DecodeJPEG) and other.min_size == self.min_size

    def __hash__(self) -> int:
        return hash(("DecodeJPEG", self.min_size))

    def __repr__(self) -> str:
        return f"DecodeJPEG(min_size={self.min_size})"


def decode_text(data: bytes) -> str:
    """Decode UTF-8 text; a leading byte order mark is dropped, as Python's ``utf-8-sig`` drops it.

    A file saved by an editor that marks UTF-8 (Notepad, Excel) starts with
    U+FEFF, which a tokenizer would read as the text's first character. The
    stored bytes keep it (``decode="bytes"``, ``packdata cat`` and export give
    the file as it was); only the str loses it.

    Raises:
        DecodeError: the bytes are not UTF-8.
    """
    try:
        if data[:3] == codecs.BOM_UTF8:
            return data[3:].decode("utf-8")
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeError(f"text is not UTF-8 ({exc})", hint=_DAMAGED) from exc


def _identity(data: bytes) -> bytes:
    return data


def decode_json(data: bytes) -> Any:
    """Parse UTF-8 JSON.

    Raises:
        DecodeError: not UTF-8, not JSON, or nested too deep for the parser.
    """
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise DecodeError(f"JSON cannot be parsed ({type(exc).__name__}: {exc})", hint=_DAMAGED) from exc


def decode_npy(data: bytes) -> np.ndarray:
    """Load a ``.npy`` array.

    Object arrays are refused (``allow_pickle=False``: a pack never runs code),
    and so is a header whose shape and dtype do not account for exactly the
    bytes that follow (it is read before anything is allocated for the array).

    Raises:
        DecodeError: not a ``.npy`` file, damaged, cut, or holding objects.
    """
    try:
        check_npy(data)
        return npy_format.read_array(io.BytesIO(data), allow_pickle=False)
    except (ValueError, EOFError, OSError, TypeError, OverflowError) as exc:  # numpy's own, on what check_npy passed
        raise DecodeError(f".npy array cannot be read ({exc})", hint=_DAMAGED) from exc


def decode_int(data: bytes) -> int:
    """Parse a decimal integer (ASCII, spaces around it allowed), as WebDataset reads ``cls``, ``cls2``, ``index``.

    Raises:
        DecodeError: not a decimal integer, or more digits than Python converts.
    """
    if not DECIMAL_INTEGER.fullmatch(data):  # int() takes more: '1_000', non-ASCII digits
        raise DecodeError(f"not a decimal integer: {bytes(data[:20])!r}", hint=_DAMAGED)
    try:
        return int(data)
    except ValueError as exc:  # past sys.get_int_max_str_digits
        raise DecodeError(f"integer cannot be read ({exc})", hint=_DAMAGED) from exc


_DECODERS: dict[str, DecodeFn] = {
    "pil": decode_pil,
    "text": decode_text,
    "bytes": _identity,
    "json": decode_json,
    "npy": decode_npy,
    "int": decode_int,
}
CODEC_DECODERS: dict[str, str] = {
    "image": "pil",
    "txt": "text",
    "json": "json",
    "npy": "npy",
    "cls": "int",  # a field such as ``seg.cls``, as WebDataset reads it (the label itself is never a stored field)
    "bytes": "bytes",
}
"""The default decoder of each field codec (:data:`packdata.pack.fields.CODECS`)."""


def resolve_decoder(decode: str | DecodeFn) -> DecodeFn:
    """Map ``"pil"``, ``"text"``, ``"bytes"``, ``"json"``, ``"npy"``, ``"int"`` or a callable to a decoder.

    No name unpickles (a pack never runs code): WebDataset's ``pyd``, ``pkl``,
    ``pickle`` and ``pth`` fields read as their bytes.
    """
    if callable(decode):
        return decode
    try:
        return _DECODERS[decode]
    except (KeyError, TypeError):
        raise ValueError(
            f"decode should be one of {', '.join(map(repr, _DECODERS))} or a callable, but got decode={decode!r}"
        ) from None
