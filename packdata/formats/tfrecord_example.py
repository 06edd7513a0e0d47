"""tf.train.Example records: encoding, and a parser that slices the payload without protobuf objects.

A record's TFRecord framing (length, masked CRC32C) is :mod:`packdata.formats.tfrecord_framing`.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple, cast

import numpy as np

from packdata.pack.fields import LABEL_FIELD, codec_of, decode_block
from packdata.pack.records import RecordError, Sample

__all__ = [
    "FIELDS_FEATURE",
    "PRIMARY_FEATURE",
    "ParsedExample",
    "encode_example",
    "encode_with_span",
    "example_fields",
    "parse_example",
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


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0])


def _payload_span(example: bytes) -> tuple[int, int]:
    """``(offset, length)`` of the payload inside a serialized Example, as the reader finds it."""
    buf = memoryview(example)
    view = parse_example(buf, with_key=False).data
    if not len(view):
        return 0, 0
    return _address(view) - _address(buf), len(view)


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

    The span is where :func:`parse_example` finds the payload ((0, 0) for an
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


class ParsedExample(NamedTuple):
    """The packdata fields of one ``tf.train.Example``."""

    data: memoryview  # image/encoded or text/encoded, a view into the record
    label: int
    key: bytes
    kind: str


_LIST_KINDS = ("bytes", "float", "int64")


_WANTED_NO_KEY = frozenset({b"image/encoded", b"text/encoded", b"image/class/label"})


_WANTED = _WANTED_NO_KEY | {b"image/filename"}


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    b = buf[pos]
    pos += 1
    if b < 0x80:
        return b, pos
    result, shift = b & 0x7F, 7
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise RecordError("varint is longer than 10 bytes")


def _skip(buf: memoryview, pos: int, wire: int) -> int:
    if wire == 0:
        return _varint(buf, pos)[1]
    if wire == 1:
        return pos + 8
    if wire == 2:
        n, pos = _varint(buf, pos)
        return pos + n
    if wire == 5:
        return pos + 4
    raise RecordError(f"unsupported protobuf wire type {wire}")


def _first_value(buf: memoryview, pos: int, end: int) -> tuple[str, memoryview | int | None]:
    """The list type and first value of one ``Feature`` message in ``buf[pos:end]``.

    Varints are decoded inline when they fit one byte (tags and short lengths
    always do): this runs four times per record, so calls are kept few.
    """
    kind: str = ""
    value: memoryview | int | None = None
    while pos < end:
        tag = buf[pos]
        if tag >= 0x80:
            tag, pos = _varint(buf, pos)
        else:
            pos += 1
        field = tag >> 3
        if tag & 7 != 2 or field not in (1, 2, 3):
            pos = _skip(buf, pos, tag & 7)
            continue
        n = buf[pos]
        if n >= 0x80:
            n, pos = _varint(buf, pos)
        else:
            pos += 1
        list_end = pos + n
        if list_end > end:
            raise RecordError("a feature list runs past its feature")
        kind, value = _LIST_KINDS[field - 1], None
        inner = pos
        while inner < list_end and value is None:  # the first element of BytesList/Int64List
            tag = buf[inner]
            if tag >= 0x80:
                tag, inner = _varint(buf, inner)
            else:
                inner += 1
            if tag == 0x0A and field == 1:
                m = buf[inner]
                if m >= 0x80:
                    m, inner = _varint(buf, inner)
                else:
                    inner += 1
                if inner + m > list_end:
                    raise RecordError("a bytes value runs past its list")
                value = buf[inner : inner + m]
            elif tag == 0x08 and field == 3:
                value, inner = _varint(buf, inner)
            elif tag == 0x0A and field == 3:  # packed int64
                m, inner = _varint(buf, inner)
                if inner + m > list_end:
                    raise RecordError("packed int64 values run past their list")
                if m:
                    value, after = _varint(buf, inner)
                    if after > inner + m:
                        raise RecordError("a packed int64 value runs past its values")
                inner += m
            else:
                inner = _skip(buf, inner, tag & 7)
            if inner > list_end:
                raise RecordError("a value runs past its list")
        pos = list_end
    return kind, value


def _features(
    buf: memoryview, wanted: frozenset[bytes] | None, spans: dict[bytes, tuple[int, int]] | None = None
) -> dict[bytes, tuple[str, memoryview | int | None]]:
    """Feature name -> (list type, first value) of a serialized Example (``wanted`` names only, or all).

    ``spans``, when given, receives each wanted feature's ``Feature`` message span.
    """
    end = len(buf)
    found: dict[bytes, tuple[str, memoryview | int | None]] = {}
    try:
        pos = 0
        while pos < end:
            tag, pos = _varint(buf, pos)
            if tag != 0x0A:  # Example.features, length-delimited
                pos = _skip(buf, pos, tag & 7)
                continue
            n, pos = _varint(buf, pos)
            features_end = pos + n
            if features_end > end:
                raise RecordError("features run past the message")
            while pos < features_end:
                if buf[pos] != 0x0A:  # not a Features.feature map entry
                    tag, pos = _varint(buf, pos)
                    pos = _skip(buf, pos, tag & 7)
                    continue
                n = buf[pos + 1]
                if n >= 0x80:
                    n, pos = _varint(buf, pos + 1)
                else:
                    pos += 2
                entry_end = pos + n
                if entry_end > features_end:
                    raise RecordError("a feature runs past its features")
                name = b""
                value_span = None
                while pos < entry_end:
                    tag = buf[pos]
                    if tag != 0x0A and tag != 0x12:  # neither key nor value
                        tag, pos = _varint(buf, pos)
                        pos = _skip(buf, pos, tag & 7)
                        continue
                    m = buf[pos + 1]
                    if m >= 0x80:
                        m, pos = _varint(buf, pos + 1)
                    else:
                        pos += 2
                    if pos + m > entry_end:
                        raise RecordError("a feature's name or value runs past the feature")
                    if tag == 0x0A:
                        name = bytes(buf[pos : pos + m])
                    else:
                        value_span = (pos, pos + m)
                    pos += m
                if value_span is not None and (wanted is None or name in wanted):
                    found[name] = _first_value(buf, *value_span)
                    if spans is not None:
                        spans[name] = value_span
                if pos != entry_end:
                    raise RecordError("a field runs past its feature")
            if pos != features_end:
                raise RecordError("a field runs past its features")
        if pos != end:
            raise RecordError("message ends inside a field")
    except IndexError:
        raise RecordError("protobuf message is cut short") from None
    return found


def _label_of(found: dict[bytes, tuple[str, memoryview | int | None]]) -> int:
    label_kind, label = found.get(b"image/class/label", ("int64", -1))
    if label_kind != "int64" or not isinstance(label, int):
        return -1
    return label - (1 << 64) if label >= 1 << 63 else label


def parse_example(record: bytes | memoryview, *, with_key: bool = True) -> ParsedExample:
    """Read packdata's fields out of a serialized ``tf.train.Example``.

    A small protobuf wire-format walker, several times faster than
    ``Example.ParseFromString`` on 70 KB images because it copies nothing: the
    payload comes back as a view into ``record``. It reads any valid Example
    with these feature names, whoever wrote it (map entries in any order,
    packed or unpacked int64, unknown fields skipped, the last of repeated
    entries winning, as protobuf does). A missing label reads as -1 and a
    missing filename as ``b""``; ``with_key=False`` skips the filename (``b""``).

    Raises:
        RecordError: the bytes are not an Example holding ``image/encoded`` or
            ``text/encoded``.
    """
    found = _features(memoryview(record), _WANTED if with_key else _WANTED_NO_KEY)
    kind = "text" if b"text/encoded" in found else "image"
    payload = found.get(b"text/encoded" if kind == "text" else b"image/encoded")
    if payload is None or payload[0] != "bytes" or not isinstance(payload[1], memoryview):
        raise RecordError("Example has no image/encoded or text/encoded bytes feature")
    key = found.get(b"image/filename", ("bytes", None))[1]
    return ParsedExample(payload[1], _label_of(found), bytes(key) if isinstance(key, memoryview) else b"", kind)


def example_fields(record: bytes | memoryview) -> tuple[dict[str, bytes], int, str]:
    """The fields, label and key of a multi-field Example (see :func:`encode_example`).

    Raises:
        RecordError: not a packdata multi-field Example, a field it lists is
            missing, or its key or a field name is not UTF-8.
    """
    found = _features(memoryview(record), None)
    listed = found.get(FIELDS_FEATURE)
    if listed is None:
        raise RecordError(f"Example has no {FIELDS_FEATURE.decode()} feature: not a multi-field sample")
    names = _all_bytes(memoryview(record), FIELDS_FEATURE)
    primary = found.get(PRIMARY_FEATURE, ("bytes", None))[1]
    primary_name = _utf8(primary, PRIMARY_FEATURE) if isinstance(primary, memoryview) else None
    fields = {}
    for raw in names:
        name = _utf8(raw, FIELDS_FEATURE)
        feature = b"image/encoded" if name == primary_name else raw
        kind, value = found.get(feature, ("", None))
        if kind != "bytes" or not isinstance(value, memoryview):
            raise RecordError(f"field {name!r} is listed but has no bytes feature")
        fields[name] = bytes(value)
    key = found.get(b"image/filename", ("bytes", None))[1]
    return fields, _label_of(found), _utf8(key, b"image/filename") if isinstance(key, memoryview) else ""


def _utf8(raw: bytes | memoryview, feature: bytes) -> str:
    """A name or key held by bytes feature ``feature``, decoded; :class:`RecordError` if it is not UTF-8."""
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecordError(f"{feature.decode()} holds {bytes(raw)!r}, which is not UTF-8 ({exc.reason})") from None


def _all_bytes(buf: memoryview, name: bytes) -> list[bytes]:
    """Every value of the bytes feature ``name`` (the list of field names), from the wire."""
    spans: dict[bytes, tuple[int, int]] = {}
    _features(buf, frozenset({name}), spans)
    if name not in spans:
        return []
    pos, end = spans[name]
    values = []
    while pos < end:  # Feature: field 1 (BytesList) holds field-1 values
        tag, pos = _varint(buf, pos)
        if tag != 0x0A:
            pos = _skip(buf, pos, tag & 7)
            continue
        n, pos = _varint(buf, pos)
        inner, list_end = pos, pos + n
        while inner < list_end:
            tag, inner = _varint(buf, inner)
            if tag != 0x0A:
                inner = _skip(buf, inner, tag & 7)
                continue
            m, inner = _varint(buf, inner)
            if inner + m > list_end:
                raise RecordError("a bytes value runs past its list")
            values.append(bytes(buf[inner : inner + m]))
            inner += m
        pos = list_end
    return values
