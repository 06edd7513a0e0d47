"""The image formats a pack may hold, and the one way packdata opens image bytes."""

from __future__ import annotations

import io

from PIL import Image, UnidentifiedImageError

from packdata.errors import ImageFormatError

__all__ = ["IMAGE_EXTENSIONS", "IMAGE_FORMATS", "open_image"]

#: File extensions packed as images (any letter case), and the image field names.
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"})

#: The PIL formats packdata opens: those of the image extensions a pack holds.
#: No other PIL plug-in (EPS hands data to Ghostscript, and dozens more parse
#: rarely used formats) is ever reached from a pack's or a source's bytes.
IMAGE_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF")


def open_image(data: bytes) -> Image.Image:
    """Open image bytes with PIL's plug-ins for :data:`IMAGE_FORMATS` only (lazily, like ``Image.open``).

    Raises:
        ImageFormatError: the bytes are in another format (named when PIL knows
            it, e.g. EPS or PPM) or in none.
    """
    try:
        return Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except UnidentifiedImageError:
        detected = _sniff_format(data)
    allowed = ", ".join(IMAGE_FORMATS)
    if detected is not None:
        raise ImageFormatError(
            f"image format {detected} is not allowed (packdata decodes only {allowed})",
            hint="Convert such files to PNG or JPEG before packing",
            detected=detected,
        ) from None
    raise ImageFormatError(f"not an image in a known format (expected one of {allowed})", hint="The bytes are damaged")


def _sniff_format(data: bytes) -> str | None:
    """The PIL format whose signature ``data`` starts with, outside :data:`IMAGE_FORMATS`; never opens it."""
    Image.init()
    prefix = data[:16]
    for fmt in Image.ID:
        accept = Image.OPEN[fmt][1]
        if fmt not in IMAGE_FORMATS and accept is not None and accept(prefix):
            return fmt
    return None
