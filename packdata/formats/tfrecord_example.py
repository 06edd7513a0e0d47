"""tf.train.Example records: encoding, written by hand from the wire format (no protobuf, no torch).

Parsing them back is :mod:`packdata.formats.tfrecord_parse`; a record's TFRecord
framing (length, masked CRC32C) is :mod:`packdata.formats.tfrecord_framing`.
"""

from __future__ import annotations

import functools
import os
from typing import cast

from packdata.pack.fields import LABEL_FIELD, codec_of, decode_block
from packdata.pack.records import Sample

__all__ = [
    "FIELDS_FEATURE",
    "PRIMARY_FEATURE",
    "encode_example",
    "encode_with_span",
]


FIELDS_FEATURE = b"packdata/fields"
"""A multi-field sample's field names (bytes list): every field is the feature of its name..."""
PRIMARY_FEATURE = b"packdata/primary"
"""...except the first image field (by name), stored as ``image/encoded``, whose name this holds."""


_IMAGE_FORMATS = (
    (b"\xff\xd8\xff", b"jpeg"),
    (b"\x89PNG\r\n\x1a\n", b"png"),
    (b"GIF8", b"gif"),
    (b"BM", b"bmp"),
    (b"II*\x00", b"tiff"),
    (b"MM\x00*", b"tiff"),
)


_IMAGE_KEY, _TEXT_KEY = b"\x0a\x0dimage/encoded", b"\x0a\x0ctext/encoded"
"""The map-entry key (tag 1, length, name) of each feature a payload-table row may point into."""


def _span_ok(buf: bytes | memoryview, start: int, m: int) -> bool:
    """Whether the ``m`` bytes at ``start`` are the value of the ``image/encoded`` or ``text/encoded`` feature.

    An O(1) check that a payload-table row points at the payload, not at
    another bytes value of the (CRC-checked) record such as ``image/format``
    or ``image/filename``: the bytes just before the span must be what
    :func:`encode_example` writes there, the map entry's key (tag 1, length,
    the feature's name), then ``Feature`` (tag 2, length), ``BytesList``
    (tag 1, length) and the value's header (tag 1, ``m``).
    """
    if m < 0x7C:  # lengths m, m + 2 and m + 4 take one byte each (short text)
        head = bytes((0x12, m + 4, 0x0A, m + 2, 0x0A, m))
    elif 0x80 <= m < 0x3FFA:  # m, m + 3 and m + 6: two bytes each
        inner, outer = m + 3, m + 6
        head = bytes(
            (
                0x12, (outer & 0x7F) | 0x80, outer >> 7,
                0x0A, (inner & 0x7F) | 0x80, inner >> 7,
                0x0A, (m & 0x7F) | 0x80, m >> 7,
            )
        )  # fmt: skip
    elif 0x4000 <= m < 0x1FFFF8:  # m, m + 4 and m + 8: three bytes each (images of 16 KiB to 2 MiB)
        inner, outer = m + 4, m + 8
        head = bytes(
            (
                0x12, (outer & 0x7F) | 0x80, ((outer >> 7) & 0x7F) | 0x80, outer >> 14,
                0x0A, (inner & 0x7F) | 0x80, ((inner >> 7) & 0x7F) | 0x80, inner >> 14,
                0x0A, (m & 0x7F) | 0x80, ((m >> 7) & 0x7F) | 0x80, m >> 14,
            )
        )  # fmt: skip
    else:
        value = _short_varint(m)
        listed = 1 + len(value) + m
        inner_bytes = _short_varint(listed)
        head = b"\x12" + _short_varint(1 + len(inner_bytes) + listed) + b"\x0a" + inner_bytes + b"\x0a" + value
    end = start - len(head)
    if end < len(_TEXT_KEY) or buf[end:start] != head:
        return False
    return buf[end - len(_IMAGE_KEY) : end] == _IMAGE_KEY or buf[end - len(_TEXT_KEY) : end] == _TEXT_KEY


def _short_varint(n: int) -> bytes:
    """:func:`_varint_bytes` of a length, without its loop for the lengths of most payloads (under 2 MiB)."""
    if n < 0x80:
        return bytes((n,))
    if n < 0x4000:
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    if n < 0x200000:
        return bytes(((n & 0x7F) | 0x80, ((n >> 7) & 0x7F) | 0x80, n >> 14))
    return _varint_bytes(n)


def _image_format(sample: Sample) -> bytes:
    data = sample.data
    for magic, name in _IMAGE_FORMATS:
        if data.startswith(magic):
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return b"webp"
    suffix = os.path.splitext(sample.key)[1].lower().lstrip(".")
    return {"jpg": "jpeg"}.get(suffix, suffix).encode("ascii", "replace")


def _varint_bytes(n: int) -> bytes:
    n &= 0xFFFFFFFFFFFFFFFF  # int64 as protobuf writes it: negative numbers take ten bytes
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _delimited(tag: int, parts: list[bytes]) -> list[bytes]:
    """Field ``tag`` holding the concatenation of ``parts``: its header, then ``parts`` (nothing copied)."""
    return [bytes((tag,)) + _varint_bytes(sum(map(len, parts))), *parts]


def _feature(values: list[bytes] | list[int]) -> list[bytes]:
    """A ``Feature``: a ``BytesList`` (field 1) or a packed ``Int64List`` (field 3)."""
    if values and isinstance(values[0], int):
        packed = b"".join(_varint_bytes(v) for v in values)  # type: ignore[arg-type]
        return _delimited(0x1A, _delimited(0x0A, [packed]))
    return _delimited(0x0A, [part for v in values for part in _delimited(0x0A, [v])])  # type: ignore[list-item]


def _serialize(features: dict[str, list[bytes] | list[int]]) -> bytes:
    """A ``tf.train.Example`` as protobuf's deterministic serialization writes it (map keys sorted).

    Written by hand from the wire format so that encoding needs neither
    protobuf nor the ``tfrecord`` package (whose import pulls in torch);
    a test checks it byte for byte against ``example_pb2``. The nested
    messages are lists of parts until one join at the end: each payload is
    copied once, not once per level of nesting.
    """
    entries: list[bytes] = []
    for name in sorted(features, key=lambda n: n.encode("utf-8")):
        entries += _delimited(
            0x0A, _delimited(0x0A, [name.encode("utf-8")]) + _delimited(0x12, _feature(features[name]))
        )
    return b"".join(_delimited(0x0A, entries))


def encode_example(sample: Sample) -> bytes:
    """Serialize ``sample`` as a ``tf.train.Example`` (feature names in :mod:`packdata.formats.tfrecord`)."""
    return encode_with_span(sample)[0]


def encode_with_span(sample: Sample) -> tuple[bytes, tuple[int, int] | None]:
    """:func:`encode_example`, and the payload's ``(offset, length)`` inside it (None for a multi-field sample).

    The span is where :func:`~packdata.formats.tfrecord_parse.parse_example` finds the payload ((0, 0) for an
    empty one). An image or a text is written by :func:`_one_payload`: the
    same bytes as :func:`_serialize`, with the lengths of the fixed feature
    names worked out once, and the span counted, not parsed back.
    """
    if sample.kind != "fields":
        return _one_payload(sample)
    return _serialize(_field_features(sample)), None


_NAME = {name: b"\x0a" + bytes((len(name),)) + name for name in (b"image/encoded", b"image/filename", b"text/encoded")}


def _bytes_entry(name: bytes, value: bytes) -> bytes:
    """The ``Features`` map entry of feature ``name`` holding the one bytes ``value``, up to that value."""
    v1 = _short_varint(len(value))  # BytesList: field 1, the value
    listed = 1 + len(v1) + len(value)
    v2 = _short_varint(listed)  # Feature: field 1, the BytesList
    feature = 1 + len(v2) + listed
    v3 = _short_varint(feature)  # the entry: field 1 its name, field 2 the Feature
    entry = len(_NAME[name]) + 1 + len(v3) + feature
    return b"".join((b"\x0a", _short_varint(entry), _NAME[name], b"\x12", v3, b"\x0a", v2, b"\x0a", v1))


@functools.lru_cache(maxsize=4096)
def _fixed_entry(name: str, value: int | bytes) -> bytes:
    """The whole map entry of a feature of one value that repeats across samples (a label, an image format)."""
    feature = _feature(cast("list[bytes] | list[int]", [value]))
    return b"".join(_delimited(0x0A, _delimited(0x0A, [name.encode()]) + _delimited(0x12, feature)))


def _one_payload(sample: Sample) -> tuple[bytes, tuple[int, int]]:
    """An image's or a text's Example (as :func:`_serialize` writes it) and its payload's span."""
    key = sample.key.encode("utf-8")
    label = _fixed_entry("image/class/label", sample.label)
    named = _bytes_entry(b"image/filename", key)
    if sample.kind == "text":
        before = [label, named, key, _bytes_entry(b"text/encoded", sample.data)]
        after: list[bytes] = []
    else:
        before = [label, _bytes_entry(b"image/encoded", sample.data)]
        after = [named, key, _fixed_entry("image/format", _image_format(sample))]
    offset = sum(map(len, before))
    head = b"\x0a" + _short_varint(offset + len(sample.data) + sum(map(len, after)))
    example = b"".join((head, *before, sample.data, *after))
    return example, (len(head) + offset, len(sample.data)) if sample.data else (0, 0)


def _field_features(sample: Sample) -> dict[str, list[bytes] | list[int]]:
    """The features of a multi-field sample's Example (see :func:`encode_example`)."""
    fields = decode_block(sample.data, check_crc=False)
    primary = next((n for n in sorted(fields) if codec_of(n) == "image"), None)
    names: list[bytes] = [n.encode("utf-8") for n in sorted(fields)]
    features: dict[str, list[bytes] | list[int]] = {FIELDS_FEATURE.decode(): names}
    for name, data in fields.items():
        if name == primary:
            features["image/encoded"] = [data]
            features["image/format"] = [_image_format(Sample(f"x.{name}", -1, data))]
            features[PRIMARY_FEATURE.decode()] = [name.encode("utf-8")]
        else:
            features[name] = [data]
    if sample.label >= 0:
        features[LABEL_FIELD] = [sample.label]
    features["image/class/label"] = [sample.label]
    features["image/filename"] = [sample.key.encode("utf-8")]
    return features
