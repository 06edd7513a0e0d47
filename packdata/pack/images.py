"""The image formats a pack may hold, and the one way packdata opens image bytes."""

from __future__ import annotations

import contextlib
import io
import re
import struct
import warnings
from collections.abc import Callable, Iterator
from contextvars import ContextVar

from PIL import Image, ImageMode, UnidentifiedImageError

from packdata.errors import ImageFormatError

__all__ = [
    "IMAGE_EXTENSIONS",
    "DAMAGED_HINT",
    "IMAGE_FORMATS",
    "JPEG_FORMATS",
    "JPEG_QUALITY",
    "SCAN_LIMIT",
    "decoding_errors",
    "decoding_sample",
    "deep_mode",
    "encode_image",
    "jpeg_frame",
    "open_image",
    "rgb_image",
]

#: File extensions packed as images (any letter case), and the image field names.
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"})

#: The PIL formats packdata opens: those of the image extensions a pack holds.
#: No other PIL plug-in (EPS hands data to Ghostscript, and dozens more parse
#: rarely used formats) is ever reached from a pack's or a source's bytes.
IMAGE_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF")

#: The hint of an error for damaged image bytes, which a conversion that decodes would have skipped.
DAMAGED_HINT = "Convert with verify_images=True to skip such files (they are listed with the skipped files)"

#: The formats PIL names JPEG bytes by: MPO is a JPEG followed by more images
#: (a camera's preview or depth map), and reads as its first, a JPEG.
JPEG_FORMATS = ("JPEG", "MPO")

#: The JPEG quality a PIL image given for a ``jpg`` field is saved at.
JPEG_QUALITY = 95

#: The scans one JPEG may have. Each scan passes over every block of its
#: components, and a crafted file of ten bytes a scan can hold thousands: a
#: progressive one (a valid one needs at most about 2,700; encoders write about
#: 10), or a sequential one whose first scan holds one component (libjpeg then
#: decodes any number of scans, a valid file needing one a component).
SCAN_LIMIT = 500

#: Set by a dataset around an image's decode: what names the sample (called
#: only when :func:`open_image` warns of a possible decompression bomb).
decoding_sample: ContextVar[Callable[[], str] | None] = ContextVar("packdata_decoding_sample", default=None)

_START_OF_SCAN = re.compile(rb"\xff\xda")  # re finds it by memchr: 3x faster than bytes.count
_SAVE_FORMAT = {"jpg": "JPEG", "jpeg": "JPEG", "png": "PNG", "webp": "WEBP", "bmp": "BMP", "gif": "GIF"}
_SAVE_FORMAT |= {"tif": "TIFF", "tiff": "TIFF"}


def deep_mode(mode: str) -> bool:
    """Whether a PIL mode has more than 8 bits a channel (16-bit, 32-bit, float), which RGB would clip."""
    return ImageMode.getmode(mode).typestr[-1] != "1"


def encode_image(image: Image.Image, extension: str) -> bytes:
    """A PIL image saved in the format its field's extension names (``jpg``: JPEG at :data:`JPEG_QUALITY`).

    JPEG takes RGB or grayscale, so other 8-bit modes (RGBA, P) are converted
    to RGB first; WebP is saved lossless (colours under transparent pixels too);
    the other formats keep the image's mode. Every format but JPEG is read back
    and must give the image's mode and pixels exactly.

    Raises:
        ValueError: the format cannot hold the image (a JPEG of more than 8
            bits a channel, a mode the format changes or PIL cannot write), or
            it is past PIL's decompression-bomb limit, which every reader applies.
    """
    fmt = _SAVE_FORMAT[extension.lower()]
    if fmt == "JPEG" and deep_mode(image.mode):  # 16-bit, 32-bit, float: RGB would clip
        raise ValueError(f"a {fmt} file cannot hold an image of mode {image.mode} (more than 8 bits a channel)")
    out = io.BytesIO()
    try:
        if fmt == "JPEG":
            image = image if image.mode in ("RGB", "L", "CMYK") else image.convert("RGB")
            image.save(out, format=fmt, quality=JPEG_QUALITY)
            return out.getvalue()
        if fmt == "WEBP":
            image.save(out, format=fmt, lossless=True, exact=True)  # exact: keep the colour under transparent pixels
        else:
            image.save(out, format=fmt)
        with Image.open(out, formats=(fmt,)) as back:
            exact = (back.mode, back.size, back.tobytes()) == (image.mode, image.size, image.tobytes())
            if exact and image.mode in ("P", "PA"):
                exact = back.convert("RGBA").tobytes() == image.convert("RGBA").tobytes()
    except (OSError, ValueError, KeyError, Image.DecompressionBombError) as exc:  # a mode PIL cannot write; a bomb
        raise ValueError(f"a {fmt} file cannot hold an image of mode {image.mode} ({exc})") from exc
    if not exact:
        raise ValueError(f"a {fmt} file cannot hold this image of mode {image.mode} exactly (it reads back otherwise)")
    return out.getvalue()


def open_image(data: bytes) -> Image.Image:
    """Open image bytes with PIL's plug-ins for :data:`IMAGE_FORMATS` only (lazily, like ``Image.open``).

    PIL's ``DecompressionBombWarning`` (more than ``Image.MAX_IMAGE_PIXELS``
    pixels, at most twice that) names no image: under :data:`decoding_sample`
    a second one, of the same category, names the sample.

    Raises:
        ImageFormatError: the bytes are in another format (named when PIL knows
            it, e.g. EPS or PPM) or in none, or are a JPEG of more than
            :data:`SCAN_LIMIT` scans (PIL's decoder has no such limit).
    """
    if data[:2] == b"\xff\xd8":
        _check_scans(data)
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except UnidentifiedImageError:
        detected = _sniff_format(data)
    else:
        _name_bomb_warning(image.size)
        return image
    allowed = ", ".join(IMAGE_FORMATS)
    if detected is not None:
        raise ImageFormatError(
            f"image format {detected} is not allowed (packdata decodes only {allowed})",
            hint="Convert such files to PNG or JPEG before packing",
            detected=detected,
        ) from None
    raise ImageFormatError(f"not an image in a known format (expected one of {allowed})", hint="The bytes are damaged")


def rgb_image(image: Image.Image) -> Image.Image:
    """``image.convert("RGB")``, refused where it would clip: more than 8 bits a channel (16-bit, 32-bit, float).

    Raises:
        ImageFormatError: PIL would turn every value above 255 white.
    """
    if deep_mode(image.mode):
        raise ImageFormatError(
            f"image of mode {image.mode} has more than 8 bits a channel, which RGB would clip (above 255: white)",
            hint="Read such images with decode='bytes' and a reader of your own, or convert them to 8 bits",
        )
    return image.convert("RGB")


def _name_bomb_warning(size: tuple[int, int]) -> None:
    """Warn naming the sample :data:`decoding_sample` names where PIL, opening an image of ``size``, warned."""
    limit, name = Image.MAX_IMAGE_PIXELS, decoding_sample.get()
    pixels = max(1, size[0]) * max(1, size[1])  # PIL's count
    if name is not None and limit is not None and pixels > limit:
        warnings.warn(
            f"{name()}: image of {size[0]}x{size[1]} ({pixels} pixels) is over PIL.Image.MAX_IMAGE_PIXELS "
            f"({limit}), possibly a decompression bomb; decoded, as it is at most twice the limit",
            Image.DecompressionBombWarning,
            stacklevel=3,  # the decoder that opened it
        )


def _check_scans(data: bytes) -> None:
    """Refuse a JPEG of more than :data:`SCAN_LIMIT` start-of-scan markers (an upper bound on its scans).

    Only metadata, never scan data, holds FF DA. About 25 us on 90 KB, 3% of
    PIL's decode; no match object is made past the limit (a sample of
    millions of markers is counted by ``bytes.count``).

    Raises:
        ImageFormatError: naming the count.
    """
    for count, _ in enumerate(_START_OF_SCAN.finditer(data), 1):
        if count > SCAN_LIMIT:
            total = bytes(data).count(b"\xff\xda")  # the exact count, no match objects
            raise ImageFormatError(
                f"JPEG has {total} start-of-scan markers, more than the {SCAN_LIMIT} scans packdata decodes",
                hint="Each scan is a pass over the whole image; re-encode the file if it is genuine",
            )


def jpeg_frame(data: bytes | memoryview) -> int | None:
    """The start-of-frame marker (0xC0 baseline, 0xC2 progressive, ...) of a JPEG whose header is whole, else None.

    Walks the marker segments up to the start of scan as PIL's header parser
    does, about 20x cheaper than ``Image.open``: None for bytes that are not
    a JPEG past their first bytes, a header cut short, or no frame before the
    scan. Truncated scan data is found only by a decode.
    """
    i, n, frame = 2, len(data), None
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            i += 2
            continue
        if marker == 0x00:  # no marker: decoders skip it as junk, so no length after it may be trusted
            return None
        length = int.from_bytes(data[i + 2 : i + 4], "big")
        if length < 2:
            return None
        if marker == 0xDA:  # start of scan: the header is complete
            return frame if i + 2 + length <= n else None
        if frame is None and 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            frame = marker
        i += 2 + length
    return None


@contextlib.contextmanager
def decoding_errors() -> Iterator[None]:
    """Turn what PIL raises on truncated or damaged image bytes into :class:`ImageFormatError`.

    Wrap an image decode in it (``with decoding_errors(): ...``): PIL raises
    ``OSError`` (``image file is truncated``), ``SyntaxError``, ``EOFError`` or
    ``struct.error`` there, which a dataset cannot tell from its own failures.
    An image over PIL's decompression-bomb limit (``DecompressionBombError``,
    not an ``OSError``) is refused the same way. ``ImageFormatError`` passes unchanged.
    """
    try:
        yield
    except ImageFormatError:
        raise
    except Image.DecompressionBombError as exc:
        raise ImageFormatError(
            f"image is too large to decode ({exc})",
            hint="If the image is genuine, raise PIL.Image.MAX_IMAGE_PIXELS in the process that decodes it",
        ) from exc
    except (OSError, SyntaxError, EOFError, ValueError, struct.error) as exc:
        raise ImageFormatError(
            f"image data is truncated or damaged ({exc})",
            hint=DAMAGED_HINT,
        ) from exc


def _sniff_format(data: bytes) -> str | None:
    """The PIL format whose signature ``data`` starts with, outside :data:`IMAGE_FORMATS`; never opens it."""
    Image.init()
    prefix = data[:16]
    for fmt in Image.ID:
        accept = Image.OPEN[fmt][1]
        if fmt in IMAGE_FORMATS or accept is None:
            continue
        try:
            accepted = accept(prefix)
        except Exception:  # a plug-in's test that reads past a short prefix (DIB's struct.error): not its format
            continue
        if accepted:
            return fmt
    return None
