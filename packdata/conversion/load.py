"""Read one source file, validate it and re-encode it when asked; the read pipeline both engines use
(run in a thread pool by :func:`~packdata.conversion.pool_map.ordered_map`)."""

from __future__ import annotations

import io
import json
import operator
import os
import stat
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

from PIL import Image

from packdata.conversion.pool_map import ordered_map
from packdata.conversion.remote_folder import RemoteSourceFile
from packdata.conversion.sources import FREE_CLASSES, RemoteFile, Skip, SourceFile, SourceGroup, too_large
from packdata.errors import ConfigError, ImageFormatError
from packdata.pack.fields import LABEL_FIELD, FieldError, check_npy, cls_problem, codec_of, encode_block
from packdata.pack.images import decoding_errors, decoding_sample, deep_mode, jpeg_frame, open_image
from packdata.pack.records import MAX_SAMPLE_BYTES, Sample
from packdata.pack.turbo import decoded_rgb

__all__ = ["number_fields"]

Entry = SourceFile | SourceGroup | Skip
"""One item of a source's walk: a file, a group of files, or a skip."""

_ORIENTATION = 0x0112  # the EXIF tag
_MAX_READ = 0x7FFFF000  # the most one read() returns on Linux: a shorter read of a regular file is its end


@dataclass
class _Options:
    format: str
    kind: str
    on_error: str
    verify_images: bool
    max_side: int | None
    quality: int
    shard_size: int | None
    shard_samples: int | None
    require: str = ""  # the fields every sample must have, comma-separated: a resume must ask the same


def shard_limits(
    shard_size: int | None, shard_samples: int | None, default_bytes: int | None
) -> tuple[int | None, int | None]:
    """``(shard_size, shard_samples)`` checked, each None or a whole number >= 1; ``default_bytes`` when neither.

    Raises:
        ConfigError: naming the first limit that is not (0, -1, 1.5 and True made odd shards or none).
    """
    limits: list[int | None] = []
    for name, given in (("shard_size", shard_size), ("shard_samples", shard_samples)):
        value = None
        if given is not None:
            try:
                value = 0 if isinstance(given, bool) else operator.index(given)
            except TypeError:
                value = 0
            if value < 1:
                raise ConfigError(f"{name} should be a whole number >= 1 (or None), but got {name}={given!r}")
        limits.append(value)
    if limits == [None, None]:
        return default_bytes, None
    return limits[0], limits[1]


def number_fields(sample: Sample, numbers: dict[str, int], names: list[str]) -> list[tuple[int, int]] | None:
    """A fields sample's ``(field number, size)`` pairs, numbering new field names in order of first appearance.

    ``numbers`` maps the names seen so far to their numbers and ``names`` lists
    them in number order; both grow. None for a single-field sample.
    """
    if sample.kind != "fields":
        return None
    for name, _ in sample.field_sizes:
        if name not in numbers:
            numbers[name] = len(names)
            names.append(name)
    return [(numbers[name], size) for name, size in sample.field_sizes]


def _source_bytes(entry: Entry, sample: Sample, reencoded: bool) -> int:
    """The bytes a sample took in the source: its file's size when it was re-encoded, else the data's.

    "bytes in" reports the source, so a ``max_side`` convert shows what it read,
    not what it wrote; should the file have gone since it was read, the data's size stands in.
    """
    if reencoded and isinstance(entry, RemoteSourceFile):
        return entry.size
    if reencoded and isinstance(entry, SourceFile):
        try:
            return os.stat(entry.path).st_size
        except OSError:
            pass
    return len(sample.data)


def _load(entry: SourceFile | SourceGroup, opts: _Options) -> tuple[Sample | Skip, bool]:
    """Read one file (or a group's files), validate it and re-encode it when asked; runs in the read pool.

    Returns the sample (or why it is skipped) and whether it was re-encoded.
    """
    if isinstance(entry, SourceGroup):
        return _load_group(entry, opts), False
    if isinstance(entry, RemoteSourceFile) and entry.remote is not None:
        data = entry.remote.read(entry.key)
    else:
        data = _read_or_skip(entry.key, entry.path)
    if isinstance(data, Skip):
        return data, False
    if not data:
        return Skip(entry.key, "empty", "file has 0 bytes"), False
    if len(data) > MAX_SAMPLE_BYTES:  # an object read whole (a file is refused before its read)
        return Skip(entry.key, *too_large(len(data))), False
    if opts.kind == "text":
        problem = _text_problem(data)
        if problem:
            return Skip(entry.key, "not UTF-8 text", problem), False
        return Sample(entry.key, entry.label, data, "text"), False
    checked = _check_image(data, opts, entry.key)
    if isinstance(checked, tuple):
        return Skip(entry.key, *checked), False
    return Sample(entry.key, entry.label, checked, "image"), checked is not data


def _read_or_skip(key: str, path: str, *, stat_first: bool = False) -> bytes | Skip:
    """The file's bytes, or why it cannot be read (``stat_first``: see :func:`_read_regular`)."""
    try:
        return _read_regular(path, stat_first=stat_first)
    except _NotReadable as skip:
        return Skip(key, skip.reason, skip.detail)
    except FileNotFoundError as exc:
        if os.path.lexists(path):  # a broken link
            return Skip(key, "unreadable", exc.strerror or str(exc))
        return Skip(key, "vanished", "no such file: removed since the walk or the list named it, or never there")
    except OSError as exc:
        return Skip(key, "unreadable", exc.strerror or str(exc))


def _text_problem(data: bytes) -> str:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return str(exc)
    return ""


def _check_image(data: bytes, opts: _Options, key: str) -> bytes | tuple[str, str]:
    """The image's bytes (re-encoded when ``max_side`` asks), or a skip's ``(reason, detail)``.

    An image JPEG cannot hold (:func:`_not_for_jpeg`) is kept as it is,
    unresized, with a warning naming ``key``; so is one over twice PIL's
    decompression-bomb limit, which only ``verify_images`` skips.
    """
    if not (opts.verify_images or opts.max_side) and data[:3] == b"\xff\xd8\xff":
        if jpeg_frame(data) is not None:
            return data
        return "corrupt image", "JPEG header is damaged or incomplete"
    token = decoding_sample.set(lambda: key)  # PIL's decompression-bomb warning names the file
    try:
        with open_image(data) as img:
            reencode = bool(opts.max_side) and max(img.size) > opts.max_side  # type: ignore[operator]
            why = _not_for_jpeg(img) if reencode else None
            if why is not None:
                warnings.warn(f"{key}: {why}; kept as it is, {img.size[0]}x{img.size[1]}, not re-encoded", stacklevel=1)
                reencode = False
            if (opts.verify_images or reencode) and img.format == "PNG":
                _check_png(data)
            if deep_mode(img.mode) and opts.verify_images:
                img.load()
            elif opts.verify_images or reencode:
                rgb = decoded_rgb(img, data, img.size)  # a damaged JPEG refused where TurboJPEG is found
                if reencode:
                    return _reencode(rgb, img, opts.max_side, opts.quality)  # type: ignore[arg-type]
    except ImageFormatError as exc:
        if exc.detected is not None:
            return "unsupported image format", str(exc)
        return "corrupt image", exc.message
    except Image.DecompressionBombError as exc:  # over twice MAX_IMAGE_PIXELS, its header whole: never decoded
        if opts.verify_images:
            return "too large to decode", f"{exc} If it is genuine, raise PIL.Image.MAX_IMAGE_PIXELS where you convert"
        if opts.max_side:
            warnings.warn(f"{key}: {exc} Kept as it is, not re-encoded", Image.DecompressionBombWarning, stacklevel=1)
    except (OSError, ValueError) as exc:
        return "corrupt image", str(exc)
    finally:
        decoding_sample.reset(token)
    return data


def _check_png(data: bytes) -> None:
    """Check a PNG's chunk checksums: PIL decodes without them, and a bit flipped in its data can decode.

    Raises:
        ImageFormatError: a checksum does not match, or the file ends before its end chunk.
    """
    with decoding_errors(), open_image(data) as again:
        again.verify()


def _not_for_jpeg(img: Image.Image) -> str | None:
    """Why a JPEG re-encoding would lose part of the image, or None."""
    if deep_mode(img.mode):
        return f"image of mode {img.mode} has more than 8 bits a channel, which JPEG would clip (above 255: white)"
    try:
        frames = getattr(img, "n_frames", 1)  # reads every frame's header
    except Exception as exc:  # a later frame's header is damaged: PIL's plug-ins raise many kinds there
        return f"image's frames cannot be counted ({type(exc).__name__}: {exc})"
    if frames > 1 and img.format != "MPO":  # an animated GIF, a multi-page TIFF (not a camera's MPO: its preview)
        return f"image has {frames} frames, and a JPEG holds one"
    return None


def _load_group(group: SourceGroup, opts: _Options) -> Sample | Skip:
    """Read and check every field of a group; any bad field skips the whole sample, naming the field."""
    fields: dict[str, bytes] = {}
    label = group.label
    items = [(name, data) for name, data in group.values] + list(group.files)
    for name, source in items:
        if isinstance(source, bytes):
            data: bytes | Skip = source
        elif isinstance(source, RemoteFile):
            data = source.read(group.key)
        else:  # a list file's row names any path: its type is looked at before any open (a walk's was)
            data = _read_or_skip(group.key, source, stat_first=not group.walked)
        if isinstance(data, Skip):
            return Skip(group.key, data.reason, f"field {name!r}: {data.detail}")
        problem = _field_problem(name, data, opts)
        if problem:
            return Skip(group.key, problem[0], f"field {name!r}: {problem[1]}")
        if name == LABEL_FIELD:
            value = int(data)
            if label >= 0 and value != label:
                return Skip(group.key, "label conflict", f"cls says {value}, its class folder {label}")
            label = value
            continue
        fields[name] = data
    try:
        block = encode_block(fields)
    except FieldError as exc:  # more fields than a block holds (a tar, list or folder can name any number)
        return Skip(group.key, "too many fields", str(exc))
    if len(block) > MAX_SAMPLE_BYTES:
        return Skip(group.key, *too_large(len(block)))
    sizes = tuple(sorted((name, len(data)) for name, data in fields.items()))
    return Sample(group.key, label, block, "fields", sizes)


def _field_problem(name: str, data: bytes, opts: _Options) -> tuple[str, str] | None:
    """Why a field's bytes cannot be packed under its name (``(reason, detail)``), or None."""
    codec = codec_of(name)
    if codec == "image":
        if not data:
            return "empty", "file has 0 bytes"
        checked = _check_image(data, opts, name)  # never re-encoded: max_side refuses fields
        return checked if isinstance(checked, tuple) else None
    if codec == "txt" and _text_problem(data):
        return "not UTF-8 text", _text_problem(data)
    if codec == "json":
        try:
            json.loads(data)
        except ValueError as exc:
            return "not JSON", str(exc)
        except RecursionError:
            return "not JSON", "nested deeper than the JSON parser goes"
    if codec == "cls":  # as PackWriter stores it: any int64 (seg.cls may hold -1), the label itself from 0
        if cls_problem(data):
            return "bad label", f"cls file holds {data[:20]!r}, not a decimal integer within int64"
        if name == LABEL_FIELD and int(data) < 0:
            return "bad label", f"cls file holds {data[:20]!r}, not a non-negative integer"
        if name == LABEL_FIELD and int(data) >= FREE_CLASSES:  # classes 0..label would each be named in the manifest
            return "bad label", f"cls file holds {int(data)}: a cls label is below {FREE_CLASSES}, each class named"
    if codec == "npy":
        try:
            check_npy(data)  # the header, against the bytes that follow: no array is allocated
        except ValueError as exc:
            return "not npy", str(exc)
    return None


class _NotReadable(Exception):
    """Why :func:`_read_regular` refused a path (becomes a :class:`Skip`)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def _read_regular(path: str, *, stat_first: bool = False) -> bytes:
    """The bytes of the regular file at ``path`` (links followed), read as one consistent version.

    ``stat_first``: for a path no walk has seen (a list file's row), refuse a
    device node, FIFO or socket from its type before opening it at all
    (opening a device can act on it: a tape rewinds).

    The file is opened non-blocking (a FIFO put in its place never blocks) and
    checked with ``fstat`` on the open descriptor: anything but a regular file
    (FIFO, device, socket, folder) is refused without a read. At most the size
    seen at open plus one byte is read, so a file that grows without end (or a
    device) cannot stall the read, and a file whose size or modification time
    changed while it was read is refused rather than packed half old, half new.

    Raises:
        _NotReadable: not a regular file, changed while read, or of a length stat does not give (/proc).
        OSError: it cannot be opened or read.
    """
    if stat_first:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise _NotReadable("not a regular file", f"mode {stat.filemode(mode)}, never opened")
    fd = os.open(path, _OPEN_FLAGS)
    try:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode):
            raise _NotReadable("not a regular file", f"mode {stat.filemode(before.st_mode)} when opened")
        size = before.st_size
        if size > MAX_SAMPLE_BYTES:  # never read into memory
            raise _NotReadable(*too_large(size))
        chunks, got = [], 0
        while got <= size:
            wanted = size + 1 - got
            chunk = os.read(fd, wanted)
            chunks.append(chunk)
            got += len(chunk)
            if len(chunk) < min(wanted, _MAX_READ):  # end of file (a regular file reads short only there)
                break
        after = os.fstat(fd)
    finally:
        os.close(fd)
    unchanged = (after.st_size, after.st_mtime_ns) == (size, before.st_mtime_ns)
    if got != size and unchanged:  # a file of /proc or /sys: its size in stat is 0 or a page, not its length
        read = "more" if got > size else f"{got} bytes"
        raise _NotReadable(
            "size unknown",
            f"stat gives {size} bytes but {read} were read, the file unchanged: a file of /proc or /sys, whose "
            "length no stat gives; copy it into a regular file to pack it",
        )
    if got != size or not unchanged:
        raise _NotReadable(
            "changed while read",
            f"{size} bytes when opened, {got} read, {after.st_size} after; it is being written to",
        )
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _reencode(rgb: Image.Image, source: Image.Image, max_side: int, quality: int) -> bytes:
    """``rgb`` shrunk to ``max_side`` as a JPEG, with ``source``'s EXIF orientation and RGB colour profile.

    The pixels stay as stored (the decoders apply neither); the two say of the
    JPEG what they said of the source, so a reader that applies them treats
    re-encoded and kept images alike.
    """
    rgb.thumbnail((max_side, max_side), Image.Resampling.BICUBIC)
    keep: dict[str, object] = {}
    icc = source.info.get("icc_profile")
    if isinstance(icc, bytes) and icc[16:20] == b"RGB ":  # its data colour space: not a grey or CMYK profile
        keep["icc_profile"] = icc
    orientation = source.getexif().get(_ORIENTATION)
    if isinstance(orientation, int) and 2 <= orientation <= 8:
        exif = Image.Exif()
        exif[_ORIENTATION] = orientation
        keep["exif"] = exif
    out = io.BytesIO()
    rgb.save(out, format="JPEG", quality=quality, **keep)
    return out.getvalue()


def _pipeline(
    entries: Iterator[Entry], pool: ThreadPoolExecutor, opts: _Options, depth: int, chunk: int = 16
) -> Iterator[tuple[Entry, Sample | Skip, bool]]:
    """Read files in the pool in chunks, yielding results in walk order, ``depth`` chunks ahead."""
    for entry, (result, reencoded) in ordered_map(partial(_load_entry, opts=opts), entries, pool, depth, chunk):
        yield entry, result, reencoded


def _load_entry(entry: Entry, opts: _Options) -> tuple[Sample | Skip, bool]:
    return (entry, False) if isinstance(entry, Skip) else _load(entry, opts)
