"""Turn stored bytes into what a model reads: a PIL image, text, or bytes.

Decoders are plain picklable callables, so a dataset that holds one can go to
``spawn``-ed DataLoader workers.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

from PIL import Image

__all__ = ["DecodeFn", "decode_pil", "decode_text", "resolve_decoder"]

DecodeFn = Callable[[bytes], Any]


def decode_pil(data: bytes) -> Image.Image:
    """Decode image bytes into an RGB PIL image, as ImageFolder's loader does."""
    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")


def decode_text(data: bytes) -> str:
    """Decode UTF-8 text."""
    return data.decode("utf-8")


def _identity(data: bytes) -> bytes:
    return data


_DECODERS: dict[str, DecodeFn] = {"pil": decode_pil, "text": decode_text, "bytes": _identity}


def resolve_decoder(decode: str | DecodeFn) -> DecodeFn:
    """Map ``"pil"``, ``"text"``, ``"bytes"`` or a callable to a decoder."""
    if callable(decode):
        return decode
    try:
        return _DECODERS[decode]
    except KeyError:
        raise ValueError(
            f"decode should be 'pil', 'text', 'bytes' or a callable, but got decode={decode!r}"
        ) from None
