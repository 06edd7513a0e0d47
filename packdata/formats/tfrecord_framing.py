"""TFRecord framing: a record is its length (uint64), the length's masked CRC32C, the data, the data's masked CRC32C.

:func:`frame_record` frames one record, :func:`check_record` checks one framed record read back.
"""

from __future__ import annotations

import os
import struct

from fastcrc.crc32 import iscsi as crc32c  # CRC-32C (Castagnoli), SIMD (about 2x the crc32c package)

from packdata.errors import PackFormatError

__all__ = ["check_record", "frame_record", "masked_crc"]


_HEADER = struct.Struct("<QI")
_U32 = struct.Struct("<I")
_MASK_DELTA = 0xA282EAD8


def masked_crc(data: bytes | memoryview) -> int:
    """TFRecord's masked CRC32C of ``data``."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def frame_record(data: bytes) -> bytes:
    """``data`` framed as one TFRecord record."""
    head = struct.pack("<Q", len(data))
    return b"".join((head, _U32.pack(masked_crc(head)), data, _U32.pack(masked_crc(data))))


def _damaged(path: str | os.PathLike, offset: int, problem: str) -> PackFormatError:
    return PackFormatError(
        f"record at byte offset {offset} is damaged: {problem}",
        path=path,
        hint="Run `packdata verify` on the pack, then convert or stage it again",
    )


def check_record(buf: memoryview, pos: int, length: int, *, path: str, offset: int, check_crc: bool) -> memoryview:
    """The data of the framed record ``buf[pos:pos + length]``, its framing checked.

    ``offset`` is where the record starts in the shard file (for the message).
    """
    if length < 16 or pos + length > len(buf):
        raise _damaged(path, offset, f"record of {length} bytes does not fit")
    n, length_crc = _HEADER.unpack_from(buf, pos)
    if n != length - 16:
        raise _damaged(path, offset, f"length field says {n} bytes, the index says {length - 16}")
    data = buf[pos + 12 : pos + 12 + n]
    if check_crc:  # masked_crc inlined: this runs once per record read
        crc = crc32c(buf[pos : pos + 8])
        if (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF != length_crc:
            raise _damaged(path, offset, "CRC32C of the length field does not match")
        crc = crc32c(data)
        if (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF != _U32.unpack_from(buf, pos + 12 + n)[0]:
            raise _damaged(path, offset, "CRC32C of the data does not match")
    return data
