"""Multi-field samples: field names, value encodings, and the field block of one record.

A multi-field sample is a key, an optional integer label, and named fields.
Names follow WebDataset: a name is an extension that tells the encoding
(``jpg``, ``png``, ``txt``, ``json``, ``npy``, ``cls``; anything else is
bytes), and a compound name (``seg.png``) keeps its full name but is encoded
and decoded by its last part. The label lives in the record header and the
sample index (samplers read it without records); the ``cls`` field *is* the
label, so it is never stored twice.

The fields of one sample travel as one record payload, the *field block*,
little-endian, no pickle::

    offset  size  field
    0       4     magic b"PDF1" (packdata fields, version 1)
    4       2     F, the number of fields, uint16
    6       ...   F directory entries, in name order:
                    1  N, the name's length in bytes, uint8
                    N  the name, UTF-8
                    8  the field's length in bytes, uint64
                    4  CRC-32 (zlib) of the field's bytes
    ...     ...   the fields' bytes, concatenated in directory order

A reader parses the directory (a few dozen bytes) and copies out only the
fields it was asked for, each checked against its own CRC.
"""

from __future__ import annotations

import io
import json
import math
import numbers
import re
import struct
import sys
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import numpy as np
import numpy.lib.format as npy_format
from PIL import Image
from zlib_ng.zlib_ng import crc32

from packdata.pack.images import IMAGE_EXTENSIONS, encode_image

__all__ = [
    "BLOCK_MAGIC",
    "CODECS",
    "DECIMAL_INTEGER",
    "FieldEntry",
    "FieldError",
    "LABEL_FIELD",
    "KEY_FIELD",
    "check_field_name",
    "check_npy",
    "cls_problem",
    "codec_of",
    "decode_block",
    "dotted_key_problem",
    "encode_block",
    "encode_value",
    "read_directory",
]

BLOCK_MAGIC = b"PDF1"
KEY_FIELD = "__key__"
LABEL_FIELD = "cls"
CODECS = ("image", "txt", "json", "npy", "cls", "bytes")
"""How a field's bytes are meant: its codec, from the last part of its name (:func:`codec_of`)."""
_IMAGE_EXTENSIONS = frozenset(ext[1:] for ext in IMAGE_EXTENSIONS)
_TEXT_EXTENSIONS = frozenset({"txt", "text", "md", "csv", "tsv", "xml", "html", "yaml", "yml", "rst"})
_HEAD = struct.Struct("<4sH")
_ENTRY = struct.Struct("<QI")
_MAX_FIELDS = 0xFFFF
DECIMAL_INTEGER = re.compile(rb"\s*[+-]?[0-9]+\s*")
"""What a ``cls`` field holds (``fullmatch``): a decimal integer, spaces around it allowed (``int()`` takes more)."""
_INT64 = (-(2**63), 2**63 - 1)


class FieldError(ValueError):
    """A field name or value cannot be stored, or a field block is damaged (the caller adds where)."""


class FieldEntry(NamedTuple):
    """One directory entry: the field's name, where its bytes start in the block, their length and CRC-32."""

    name: str
    start: int
    length: int
    crc: int


def codec_of(name: str) -> str:
    """The codec a field name implies: by its last dotted part (``seg.png`` -> ``image``)."""
    ext = name.rsplit(".", 1)[-1].lower()
    if ext in _IMAGE_EXTENSIONS:
        return "image"
    if ext in _TEXT_EXTENSIONS:
        return "txt"
    if ext in ("json", "npy", "cls"):
        return ext
    return "bytes"


def cls_problem(data: bytes) -> str | None:
    """Why ``data`` cannot be a ``cls``-codec field such as ``seg.cls`` (read as an int), or None.

    Such a field holds a decimal integer (ASCII digits, an optional sign,
    spaces around it), as WebDataset's ``int(text)`` and packdata's
    ``decode="int"`` read it, negative ones included (a class to ignore is
    often -1), within int64 (what a DataLoader's collate makes of it). The
    label itself (the field named ``cls``) is also at least 0: its caller checks that.
    """
    if not DECIMAL_INTEGER.fullmatch(data):
        return f"a cls field holds a decimal integer, read as an int, not {data[:20]!r}"
    digits = data.strip().lstrip(b"+-").lstrip(b"0")
    if len(digits) > 19 or not _INT64[0] <= int(data) <= _INT64[1]:  # length first: no int() of a million digits
        return f"a cls field holds an integer within int64, read as an int, not {data[:20]!r}"
    return None


def check_field_name(name: object) -> str:
    """Return ``name`` if it can name a field, else raise :class:`FieldError`.

    A name is a non-empty string of at most 255 UTF-8 bytes without ``/``,
    NUL or surrounding dots, and not starting with ``_`` (``__key__`` and the
    like are WebDataset's metadata, not fields).
    """
    if not isinstance(name, str) or not name:
        raise FieldError(f"a field name should be a non-empty string, but got {name!r}")
    if name.startswith("_") or "/" in name or "\x00" in name or name.startswith(".") or name.endswith("."):
        raise FieldError(f"{name!r} cannot name a field (no '/', NUL, leading '_' or leading/trailing '.')")
    if len(name.encode("utf-8", "surrogatepass")) > 255:
        raise FieldError(f"field name {name[:40]!r}... is longer than 255 bytes")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise FieldError(f"field name {name!r} is not valid UTF-8") from exc
    return name


def dotted_key_problem(key: str) -> str | None:
    """Why the ``KEY.FIELD`` files of a multi-field sample's ``key`` would not read back as it, or None.

    A grouped folder, a tar and WebDataset take a sample's key up to the first
    dot of a file's name, so a dot in the key's last part gives another key
    (or, leading, hidden files); a dot in a folder of the key is fine.
    """
    folder, slash, name = key.rpartition("/")
    if "." not in name:
        return None
    stem = name.partition(".")[0]
    if not stem:
        return f"the key's last part starts with a dot: its files {key}.FIELD are hidden and read back as no sample"
    return f"the key's last part holds a dot: its files {key}.FIELD read back as key {folder + slash + stem!r}"


def check_npy(data: bytes | memoryview) -> int:
    """The offset of a ``.npy``'s array data, once its header is found sound; nothing is allocated for the array.

    Raises:
        ValueError: not a ``.npy``, a header numpy cannot read (or a shape it
            cannot take), more elements than the file has bytes (only a dtype
            of 0-byte elements can: ``|V0``, ``|S0``, ``[]``), an object dtype
            (pickled data), or a shape and dtype that do not account for exactly
            the bytes that follow.
    """
    stream = io.BytesIO(data)
    try:
        version = npy_format.read_magic(stream)
        read_header = npy_format.read_array_header_1_0 if version == (1, 0) else npy_format.read_array_header_2_0
        shape, _, dtype = read_header(stream)  # a version-3 (UTF-8) header reads as one of latin-1: sizes alike
    except EOFError as exc:
        raise ValueError(str(exc)) from exc
    if not all(type(d) is int and d >= 0 for d in shape) or math.prod(shape) > sys.maxsize:
        raise ValueError(f"its header's shape {shape!r} is not one numpy can take")
    count = math.prod(shape)
    needed = count * dtype.itemsize
    if dtype.hasobject:
        raise ValueError("it holds Python objects (pickled data), which a pack never loads")
    if needed != len(data) - stream.tell():
        raise ValueError(f"its header asks for {needed} bytes of array data, {len(data) - stream.tell()} follow")
    if count > len(data):  # 0-byte elements: numpy reads (10**18,) of them from a header alone
        raise ValueError(
            f"its header's shape {shape!r} holds {count} elements of {dtype.itemsize} bytes ({dtype.str}), "
            f"more than the {len(data)} bytes of the file"
        )
    return stream.tell()


def encode_value(name: str, value: Any, codec: str | None = None) -> bytes:
    """The stored bytes of one field value (bytes pass through unchanged).

    ``str`` is stored as UTF-8 (except in an image field); an image field (``jpg``, ``seg.png``, ...)
    takes a PIL image, saved in the format its name says (JPEG at quality
    :data:`~packdata.pack.images.JPEG_QUALITY`, WebP lossless; refused where
    that format would not read back as the image); for a ``json`` field any JSON-able value is
    dumped (sorted keys, no NaN); an ``npy`` field takes a numpy array (saved
    with ``allow_pickle=False``); a ``cls`` field (``seg.cls``) takes an int or
    its decimal text, within int64 (:func:`cls_problem`); an int or float
    in a ``txt`` field is stored as its decimal text.

    Raises:
        FieldError: the value cannot be stored under this name.
    """
    codec = codec or codec_of(name)
    if codec == "cls" and isinstance(value, numbers.Integral) and not isinstance(value, bool):  # read back as an int
        if not _INT64[0] <= int(value) <= _INT64[1]:
            shown = int(value) if int(value).bit_length() <= 256 else f"an integer of {int(value).bit_length()} bits"
            raise FieldError(f"field {name!r}: a cls field holds an integer within int64, read as an int, not {shown}")
    elif codec == "cls" and isinstance(value, str | bytes | bytearray | memoryview):
        problem = cls_problem(value.encode("utf-8", "replace") if isinstance(value, str) else bytes(value))
        if problem:
            raise FieldError(f"field {name!r}: {problem}")
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if codec == "json":
        try:
            return json.dumps(value, sort_keys=True, ensure_ascii=False, allow_nan=False).encode("utf-8")
        except (TypeError, ValueError, RecursionError) as exc:  # RecursionError: nested past Python's stack
            raise FieldError(f"field {name!r}: value is not JSON-serialisable ({exc})") from exc
    if codec == "image" and isinstance(value, str):
        raise FieldError(f"field {name!r}: a str is not an image; pass the image file's bytes or a PIL image")
    if codec == "image" and isinstance(value, Image.Image):
        try:
            return encode_image(value, name.rsplit(".", 1)[-1])
        except ValueError as exc:
            raise FieldError(f"field {name!r}: {exc}; store it in a png or tif field, or convert it first") from exc
    if codec == "npy":
        if not isinstance(value, np.ndarray) or value.dtype.hasobject:
            raise FieldError(f"field {name!r}: an npy field takes a numpy array without objects, not {type(value)}")
        out = io.BytesIO()
        np.save(out, value, allow_pickle=False)
        try:
            check_npy(out.getvalue())  # what a reader checks: a header past numpy's safe size would never load
        except ValueError as exc:
            raise FieldError(f"field {name!r}: its .npy would not read back ({exc})") from exc
        return out.getvalue()
    if isinstance(value, str):
        try:
            return value.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate, as JSON spells "\ud800": no UTF-8 holds it
            raise FieldError(f"field {name!r}: the text is not valid UTF-8 ({exc.reason})") from exc
    if isinstance(value, bool):
        raise FieldError(f"field {name!r}: a bool is ambiguous here; store it in a json field")
    if isinstance(value, numbers.Integral) or (isinstance(value, float) and math.isfinite(value) and codec == "txt"):
        try:
            return str(int(value) if isinstance(value, numbers.Integral) else value).encode("ascii")
        except ValueError as exc:  # more digits than Python converts (sys.get_int_max_str_digits)
            raise FieldError(f"field {name!r}: {exc}") from exc
    raise FieldError(
        f"field {name!r} ({codec}): cannot store a {type(value).__name__}; pass bytes, or a str/JSON value/array "
        "in a field whose name says how to encode it (txt, json, npy, or a PIL image in jpg, png, ...)"
    )


def encode_block(fields: Mapping[str, bytes]) -> bytes:
    """The field block of ``fields`` (name -> stored bytes), in name order (layout in the module docstring).

    Raises:
        FieldError: a bad name, or more fields than fit.
    """
    if len(fields) > _MAX_FIELDS:
        raise FieldError(f"a sample has {len(fields)} fields, at most {_MAX_FIELDS} fit")
    names = sorted(fields)
    head = [_HEAD.pack(BLOCK_MAGIC, len(names))]
    for name in names:
        encoded = check_field_name(name).encode("utf-8")
        data = fields[name]
        head.append(bytes((len(encoded),)) + encoded + _ENTRY.pack(len(data), crc32(data)))
    return b"".join(head + [fields[name] for name in names])


def read_directory(block: bytes | memoryview, total: int | None = None) -> list[FieldEntry] | None:
    """Parse a field block's directory from the block or a prefix of it.

    Args:
        block: the block, or its first bytes.
        total: the whole block's length (default: ``len(block)``); every field must lie inside it.

    Returns:
        The entries in block order, or None when ``block`` is a prefix too
        short to hold the whole directory (read the whole block then).

    Raises:
        FieldError: the block is not a field block, or its directory is damaged.
    """
    total = len(block) if total is None else total
    if len(block) < _HEAD.size:
        if len(block) < total:
            return None
        raise FieldError(f"field block is {total} bytes, shorter than its {_HEAD.size}-byte header")
    magic, count = _HEAD.unpack_from(block)
    if magic != BLOCK_MAGIC:
        raise FieldError(f"field block starts with {bytes(magic)!r}, expected {BLOCK_MAGIC!r}")
    pos, spans = _HEAD.size, []
    for _ in range(count):
        end = pos + 1 + (block[pos] if pos < len(block) else 0) + _ENTRY.size
        if pos >= len(block) or end > len(block):
            if len(block) < total:
                return None
            raise FieldError("field block directory runs past the block: it is damaged")
        n = block[pos]
        try:
            name = bytes(block[pos + 1 : pos + 1 + n]).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FieldError("field name in the block is not UTF-8: it is damaged") from exc
        length, crc = _ENTRY.unpack_from(block, pos + 1 + n)
        spans.append((name, length, crc))
        pos = end
    entries, start = [], pos
    for name, length, crc in spans:
        if start + length > total:
            raise FieldError(f"field {name!r} runs past the end of its block ({start + length} > {total} bytes)")
        entries.append(FieldEntry(name, start, length, crc))
        start += length
    if start != total:
        raise FieldError(f"field block holds {total - start} bytes its directory does not account for")
    if len({e.name for e in entries}) != len(entries):
        raise FieldError("field block names a field twice: it is damaged")
    return entries


def decode_block(
    block: bytes | memoryview, names: Iterable[str] | None = None, *, check_crc: bool = True
) -> dict[str, bytes]:
    """The stored bytes of the fields ``names`` (default: all) of a whole field block.

    A name the block lacks is left out of the result (the caller decides
    whether that is an error). Only the fields asked for are copied.

    Raises:
        FieldError: the block is damaged, or a field's CRC does not match.
    """
    entries = read_directory(block)
    assert entries is not None  # a whole block is never too short a prefix
    wanted = None if names is None else set(names)
    out = {}
    for entry in entries:
        if wanted is not None and entry.name not in wanted:
            continue
        data = bytes(block[entry.start : entry.start + entry.length])
        if check_crc and crc32(data) != entry.crc:
            raise FieldError(f"field {entry.name!r}: CRC-32 does not match, the record is damaged")
        out[entry.name] = data
    return out
