"""One sample <-> bytes: the LMDB value encoding.

An LMDB value is one self-describing record, little-endian, no pickle::

    offset  size  field
    0       4     magic b"PDR1" (packdata record, version 1)
    4       1     kind: 0 = image, 1 = text, 2 = fields (the payload is a
                  :mod:`packdata.pack.fields` field block)
    5       4     label, int32 (-1 when the source had no class folders)
    9       4     CRC-32 (zlib) of the payload
    13      2     K, the key's length in bytes, uint16
    15      K     key: path relative to the source root, UTF-8, POSIX separators
    15+K    ...   payload: the file's bytes (unchanged unless re-encoded)

Any tool can read it with ``struct.unpack_from("<4sBiIH", value)``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from zlib_ng.zlib_ng import crc32

__all__ = [
    "KINDS",
    "MAX_KEY_BYTES",
    "MAX_SAMPLE_BYTES",
    "RECORD_HEADER_BYTES",
    "RECORD_MAGIC",
    "RecordError",
    "RecordHeaders",
    "Sample",
    "checked_payload_start",
    "decode_record",
    "encode_record",
    "payload_start",
    "read_headers",
    "record_payload",
]

RECORD_MAGIC = b"PDR1"
KINDS = ("image", "text", "fields")
_HEADER = struct.Struct("<4sBiIH")
_HEADER_FIELDS = np.dtype(  # the same header, for numpy: read_headers parses many at once
    {"names": ["magic", "kind", "label", "crc", "key_len"], "formats": ["S4", "u1", "<i4", "<u4", "<u2"]}
)
assert _HEADER_FIELDS.itemsize == _HEADER.size
RECORD_HEADER_BYTES = _HEADER.size
"""Bytes of a record before its key."""
MAX_KEY_BYTES = 0xFFFF
"""The longest key a record holds, in UTF-8 bytes (its length is a uint16)."""
MAX_SAMPLE_BYTES = (1 << 31) - (1 << 20)
"""The largest sample payload a pack holds, in either format: protobuf parses no
message over 2 GiB (a ``tf.train.Example``; 1 MiB is left for its other fields)
and LMDB's values end at 4 GiB."""


@dataclass(frozen=True)
class Sample:
    """One sample as stored: key, label, encoded bytes and kind.

    For kind ``"fields"``, ``data`` is a field block and ``field_sizes`` lists
    its ``(name, byte length)`` pairs (for the sample index).
    """

    key: str
    label: int
    data: bytes
    kind: str = "image"
    field_sizes: tuple[tuple[str, int], ...] = ()


class RecordError(ValueError):
    """A value is not a valid packdata record (the caller adds where it was)."""


def encode_record(sample: Sample) -> bytes:
    """Encode ``sample`` as one LMDB value (layout in the module docstring)."""
    key = sample.key.encode("utf-8")
    if len(key) > MAX_KEY_BYTES:
        raise RecordError(f"key is {len(key)} bytes long, but at most {MAX_KEY_BYTES} fit")
    header = _HEADER.pack(RECORD_MAGIC, KINDS.index(sample.kind), sample.label, crc32(sample.data), len(key))
    return b"".join((header, key, sample.data))


def _header(value: bytes | memoryview) -> tuple[int, int, int, int]:
    if len(value) < _HEADER.size:
        raise RecordError(f"record is {len(value)} bytes, shorter than its {_HEADER.size}-byte header")
    magic, kind, label, crc, key_len = _HEADER.unpack_from(value)
    if magic != RECORD_MAGIC:
        raise RecordError(f"record starts with {bytes(magic)!r}, expected {RECORD_MAGIC!r}")
    if kind >= len(KINDS) or _HEADER.size + key_len > len(value):
        raise RecordError("record header is damaged")
    return kind, label, crc, key_len


def payload_start(value: bytes | memoryview) -> int:
    """Offset of the payload inside a record (after the header and the key)."""
    return _HEADER.size + _header(value)[3]


def checked_payload_start(value: bytes | memoryview) -> int:
    """Offset of the payload inside a record, once the payload's CRC-32 is found to match (nothing copied).

    Raises:
        RecordError: the value is not a packdata record, or its CRC does not match.
    """
    _, _, crc, key_len = _header(value)
    start = _HEADER.size + key_len
    if crc32(value[start:]) != crc:
        raise RecordError("payload CRC-32 does not match: the record is damaged")
    return start


def record_payload(value: bytes | memoryview, *, check_crc: bool = False) -> tuple[bytes, int]:
    """Return ``(payload, label)`` of a record, copying only the payload.

    Raises:
        RecordError: the value is not a packdata record, or its CRC does not match.
    """
    _, label, crc, key_len = _header(value)
    payload = bytes(value[_HEADER.size + key_len :])
    if check_crc and crc32(payload) != crc:
        raise RecordError("payload CRC-32 does not match: the record is damaged")
    return payload, label


def decode_record(value: bytes | memoryview, *, check_crc: bool = True) -> Sample:
    """Decode a whole record into a :class:`Sample`, checking its CRC by default."""
    kind, label, crc, key_len = _header(value)
    start = _HEADER.size
    try:
        key = bytes(value[start : start + key_len]).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecordError("record key is not valid UTF-8") from exc
    payload = bytes(value[start + key_len :])
    if check_crc and crc32(payload) != crc:
        raise RecordError("payload CRC-32 does not match: the record is damaged")
    return Sample(key=key, label=label, data=payload, kind=KINDS[kind])


class RecordHeaders(NamedTuple):
    """The headers of many records, by record (see :func:`read_headers`)."""

    labels: np.ndarray  # int32
    crcs: np.ndarray  # the payloads' CRC-32, int64
    keys: np.ndarray  # every record's key bytes, concatenated in record order (uint8)
    key_lengths: np.ndarray  # int64
    payload_offsets: np.ndarray  # int64, into the buffer
    payload_lengths: np.ndarray  # int64


def read_headers(buffer: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> RecordHeaders | None:
    """The headers of the records at ``offsets`` in ``buffer`` (``lengths`` bytes each), read at once.

    None unless every one is a valid header whose key lies inside its record
    (read them one by one with :func:`decode_record` to be told which is not).

    Args:
        buffer: bytes (uint8) that hold every record whole; ``offsets + lengths``
            must lie inside it (the caller has checked).
        offsets, lengths: int64, one per record.
    """
    n = len(offsets)
    if n and int(lengths.min()) < _HEADER.size:
        return None
    head = buffer[offsets[:, None] + np.arange(_HEADER.size)].view(_HEADER_FIELDS).ravel()
    key_lengths = head["key_len"].astype(np.int64)
    if n and (
        (head["magic"] != RECORD_MAGIC).any()
        or int(head["kind"].max()) >= len(KINDS)
        or (_HEADER.size + key_lengths > lengths).any()
    ):
        return None
    key_offsets = offsets + _HEADER.size
    ends = np.cumsum(key_lengths)  # each key's end in the concatenation
    within = np.arange(int(ends[-1]) if n else 0, dtype=np.int64) - np.repeat(ends - key_lengths, key_lengths)
    return RecordHeaders(
        labels=head["label"].astype(np.int32),
        crcs=head["crc"].astype(np.int64),
        keys=buffer[np.repeat(key_offsets, key_lengths) + within],
        key_lengths=key_lengths,
        payload_offsets=key_offsets + key_lengths,
        payload_lengths=lengths - _HEADER.size - key_lengths,
    )
