"""Decode one region of a JPEG at a DCT scale, through libjpeg-turbo's TurboJPEG 3 API (ctypes).

Pillow's JPEG decoder runs the inverse DCT and colour conversion on every block
of the image; TurboJPEG 3 (``tj3SetCroppingRegion``) skips them for the rows
above a region, stops after its last row and leaves out the columns beside it
(only entropy decoding still runs across a row). The library is looked for, in
order: at the path in ``PACKDATA_LIBTURBOJPEG``, as the system's
``libturbojpeg`` when it is version 3 or newer, and inside the ``turbojpeg``
wheel (``pip install 'packdata[turbo]'``). Without one, :func:`turbojpeg`
returns None and callers decode with PIL. :func:`decoded_rgb` decodes a whole
RGB or greyscale JPEG through it, to PIL's pixels.

Any error or warning stops the decode and raises (``ImageFormatError``): a
truncated or damaged JPEG is never returned with its missing rows filled in.
Two warnings are no damage. Odd parameters in a sequential JPEG's start of
scan ("Invalid SOS parameters for sequential JPEG", of some phones), which
libjpeg ignores: such a JPEG is decoded with them set as libjpeg takes them,
still stopping at any later warning. Junk between the last scan and the end
marker ("extraneous bytes before marker 0xd9", of many cameras and a few
ImageNet files), met after every pixel is decoded: such a JPEG is decoded past it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import importlib.util
import math
import os
import re
import threading
import warnings

import numpy as np
from PIL import Image

from packdata.errors import ImageFormatError
from packdata.pack.images import DAMAGED_HINT, JPEG_FORMATS, SCAN_LIMIT, rgb_image

__all__ = ["TurboJPEG", "decoded_rgb", "turbojpeg"]

ENV = "PACKDATA_LIBTURBOJPEG"
_DECOMPRESS = 1  # TJINIT_DECOMPRESS
_STOPONWARNING, _SUBSAMP, _WIDTH, _HEIGHT, _PRECISION, _SCANLIMIT = 0, 4, 5, 6, 7, 13  # TJPARAM_*
_PF_RGB = 0  # TJPF_RGB
_WARNING = 0  # TJERR_WARNING, of tj3GetErrorCode
_NOT_SEQUENTIAL = re.compile(rb"^Invalid SOS parameters for sequential JPEG")  # JWRN_NOT_SEQUENTIAL
_START_OF_SCAN = re.compile(rb"\xff\xda")
_JUNK_AT_END = re.compile(rb"extraneous bytes before marker 0xd9$")  # libjpeg's JWRN_EXTRANEOUS_DATA, at the end
_MCU_WIDTH = (8, 16, 16, 8, 8, 32, 8)  # tjMCUWidth, by TJSAMP_* (444, 422, 420, GRAY, 440, 411, 441)


class _Region(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int), ("y", ctypes.c_int), ("w", ctypes.c_int), ("h", ctypes.c_int)]


class _Scale(ctypes.Structure):
    _fields_ = [("num", ctypes.c_int), ("denom", ctypes.c_int)]


class _Handle:
    """A TurboJPEG decompressor, destroyed with its last reference (one per thread: a handle is not thread-safe)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self.value = lib.tj3Init(_DECOMPRESS)
        if not self.value:
            raise MemoryError("tj3Init failed")
        for param, value in ((_STOPONWARNING, 1), (_SCANLIMIT, SCAN_LIMIT)):
            lib.tj3Set(self.value, param, value)

    def __del__(self) -> None:
        if getattr(self, "value", None):
            self._lib.tj3Destroy(self.value)


class TurboJPEG:
    """The TurboJPEG 3 calls packdata uses."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        if not hasattr(lib, "tj3SetCroppingRegion"):
            raise OSError(f"{path}: not TurboJPEG 3 or newer (no tj3SetCroppingRegion)")
        handle, buf, size = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
        lib.tj3Init.restype, lib.tj3Init.argtypes = handle, [ctypes.c_int]
        lib.tj3Destroy.restype, lib.tj3Destroy.argtypes = None, [handle]
        lib.tj3Set.argtypes = [handle, ctypes.c_int, ctypes.c_int]
        lib.tj3Get.argtypes = [handle, ctypes.c_int]
        lib.tj3DecompressHeader.argtypes = [handle, buf, size]
        lib.tj3SetScalingFactor.argtypes = [handle, _Scale]
        lib.tj3SetCroppingRegion.argtypes = [handle, _Region]
        lib.tj3Decompress8.argtypes = [handle, buf, size, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        lib.tj3GetErrorStr.restype, lib.tj3GetErrorStr.argtypes = ctypes.c_char_p, [handle]
        lib.tj3GetErrorCode.argtypes = [handle]
        self.path = path
        self._lib = lib
        self._local = threading.local()

    def _handle(self) -> int:
        handle = getattr(self._local, "handle", None)
        if handle is None:
            handle = self._local.handle = _Handle(self._lib)
        return handle.value

    def _check(self, handle: int, status: int, error: bytes | None = None) -> None:
        """Raise for a failed call (``error``: its message, where already read: a second read may give another)."""
        if status != 0:
            message = (error or self._lib.tj3GetErrorStr(handle) or b"unknown error").decode(errors="replace")
            raise ImageFormatError(f"JPEG cannot be decoded: {message}", hint=DAMAGED_HINT)

    def decode(
        self, data: bytes, box: tuple[int, int, int, int], shrink: int
    ) -> tuple[np.ndarray, tuple[float, float, float, float]]:
        """The RGB pixels around ``box`` (``left, top, right, bottom`` in full-size pixels), decoded at 1/``shrink``.

        ``data`` is the whole JPEG as ``bytes``; ``shrink`` is 1, 2, 4 or 8. Returns the
        pixels (height x width x 3) and the box in their coordinates: the region
        starts at a block (iMCU) edge, so a few columns left of the box come with
        it, and at a scale the box's edges fall between pixels.
        """
        handle = self._handle()
        self._check(handle, self._lib.tj3DecompressHeader(handle, data, len(data)))
        if self._lib.tj3Get(handle, _PRECISION) != 8:
            raise ImageFormatError("JPEG cannot be decoded: not 8 bits per sample", hint="Convert it to 8-bit JPEG")
        width, height = self._lib.tj3Get(handle, _WIDTH), self._lib.tj3Get(handle, _HEIGHT)
        left, top, right, bottom = box
        if not (0 <= left < right <= width and 0 <= top < bottom <= height):
            raise ImageFormatError(
                f"JPEG header gives {width}x{height}, too small for box {box}", hint="The bytes are damaged"
            )
        self._check(handle, self._lib.tj3SetScalingFactor(handle, _Scale(1, shrink)))
        scaled_w, scaled_h = -(-width // shrink), -(-height // shrink)  # TJSCALED: rounded up
        sx, sy = scaled_w / width, scaled_h / height
        x0, x1 = int(left * sx), min(scaled_w, math.ceil(right * sx))
        y0, y1 = int(top * sy), min(scaled_h, math.ceil(bottom * sy))
        subsamp = self._lib.tj3Get(handle, _SUBSAMP)
        if 0 <= subsamp < len(_MCU_WIDTH):
            x0 -= x0 % -(-_MCU_WIDTH[subsamp] // shrink)
        else:  # subsampling TurboJPEG cannot name: it crops no columns
            x0, x1 = 0, scaled_w
        self._check(handle, self._lib.tj3SetCroppingRegion(handle, _Region(x0, y0, x1 - x0, y1 - y0)))
        out = np.empty((y1 - y0, x1 - x0, 3), dtype=np.uint8)
        args = (handle, data, len(data), out.ctypes.data, out.strides[0], _PF_RGB)
        status = self._lib.tj3Decompress8(*args)
        error = self._lib.tj3GetErrorStr(handle) if status != 0 else None
        if error is not None and _NOT_SEQUENTIAL.search(error):  # decoded as libjpeg does, past the warning
            data = _sequential_scans(data)
            args = (handle, data, len(data), *args[3:])
            status = self._lib.tj3Decompress8(*args)
            error = self._lib.tj3GetErrorStr(handle) if status != 0 else None
        if error is not None and _JUNK_AT_END.search(error):
            # the first warning is of junk after every scan: the pixels are whole, decoded again past it
            self._lib.tj3Set(handle, _STOPONWARNING, 0)
            try:
                status = self._lib.tj3Decompress8(*args)
                error = self._lib.tj3GetErrorStr(handle) if status != 0 else None
                if status != 0 and self._lib.tj3GetErrorCode(handle) == _WARNING:
                    status = 0
            finally:
                self._lib.tj3Set(handle, _STOPONWARNING, 1)
        self._check(handle, status, error)
        return out, (left * sx - x0, top * sy - y0, right * sx - x0, bottom * sy - y0)


def _sequential_scans(data: bytes) -> bytes:
    """``data`` with each start of scan's spectral selection and approximation those of a sequential JPEG.

    libjpeg warns of others in a sequential JPEG (some phones write zeros)
    and decodes it as if they were 0, 63 and 0: this copy decodes the same
    without the warning. Bytes that only look like a start of scan are left.
    """
    out = bytearray(data)
    for match in _START_OF_SCAN.finditer(data):
        i = match.start()
        count = out[i + 4] if i + 4 < len(out) else 0
        end = i + 8 + 2 * count  # marker, length, count, a table pair per component, the three parameters
        if 1 <= count <= 4 and int.from_bytes(out[i + 2 : i + 4], "big") == 6 + 2 * count and end <= len(out):
            out[end - 3 : end] = b"\x00\x3f\x00"
    return bytes(out)


def _candidates() -> list[str]:
    """Where libturbojpeg may be, in the order of the module docstring."""
    paths = [os.environ[ENV]] if os.environ.get(ENV) else []
    system = ctypes.util.find_library("turbojpeg")
    if system:
        paths.append(system)
    spec = importlib.util.find_spec("turbojpeg")
    if spec is not None and spec.origin:
        libs = os.path.join(os.path.dirname(spec.origin), "turbojpeg.libs")
        paths += sorted(glob.glob(os.path.join(libs, "libturbojpeg*.so*")))
    return paths


@functools.cache
def turbojpeg() -> TurboJPEG | None:
    """The first TurboJPEG 3 library found (see the module docstring), loaded once per process; None if none."""
    for path in _candidates():
        try:
            return TurboJPEG(path)
        except OSError as exc:
            if path == os.environ.get(ENV):
                warnings.warn(f"{ENV}={path} cannot be used ({exc}); looking elsewhere", stacklevel=2)
    return None


def decoded_rgb(img: Image.Image, data: bytes | memoryview, full: tuple[int, int]) -> Image.Image:
    """``img``, opened from ``data`` (``full`` pixels, maybe drafted smaller), decoded in RGB.

    An RGB or greyscale JPEG is decoded through TurboJPEG where found, to the
    pixels PIL gives, but stopping at libjpeg's warnings: PIL's decoder drops
    them and fills a scan cut short (then closed with FF D9) with grey.

    Raises:
        ImageFormatError: TurboJPEG refused the JPEG, or :func:`rgb_image` the image.
    """
    turbo = turbojpeg() if img.format in JPEG_FORMATS and img.mode in ("RGB", "L") else None
    if turbo is None:
        return rgb_image(img)
    shrink = next(f for f in (1, 2, 4, 8) if (-(-full[0] // f), -(-full[1] // f)) == img.size)  # PIL's draft
    pixels, _ = turbo.decode(bytes(data), (0, 0, *full), shrink)
    return Image.fromarray(pixels)
