"""tf.train.Example records parsed: a wire-format walker that slices the payload without protobuf objects.

:func:`parse_example` reads an image's or a text's payload, label and key,
:func:`example_fields` a multi-field sample's fields; both read any valid
Example with these feature names, whoever wrote it. Encoding is
:mod:`packdata.formats.tfrecord_example`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from packdata.formats.tfrecord_example import FIELDS_FEATURE, PRIMARY_FEATURE
from packdata.pack.records import RecordError

__all__ = ["ParsedExample", "example_fields", "parse_example"]


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


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0])


def _payload_span(example: bytes) -> tuple[int, int]:
    """``(offset, length)`` of the payload inside a serialized Example, as the reader finds it."""
    buf = memoryview(example)
    view = parse_example(buf, with_key=False).data
    if not len(view):
        return 0, 0
    return _address(view) - _address(buf), len(view)
