"""Read one source file, validate it and re-encode it when asked; the bounded read pipeline both engines use."""

from __future__ import annotations

import io
import os
import stat
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from PIL import Image

from packdata.conversion.sources import Skip, SourceFile
from packdata.errors import (
    ImageFormatError,
)
from packdata.pack.images import open_image
from packdata.pack.records import Sample

__all__ = []


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


def _load(entry: SourceFile, opts: _Options) -> tuple[Sample | Skip, bool]:
    """Read one file, validate it and re-encode it when asked; runs in the read pool.

    Returns the sample (or why it is skipped) and whether it was re-encoded.
    """
    try:
        data = _read_regular(entry.path)
    except _NotReadable as skip:
        return Skip(entry.key, skip.reason, skip.detail), False
    except FileNotFoundError as exc:
        if os.path.lexists(entry.path):  # a broken link
            return Skip(entry.key, "unreadable", exc.strerror or str(exc)), False
        return Skip(entry.key, "vanished", "the file was removed between the walk and the read"), False
    except OSError as exc:
        return Skip(entry.key, "unreadable", exc.strerror or str(exc)), False
    if not data:
        return Skip(entry.key, "empty", "file has 0 bytes"), False
    if opts.kind == "text":
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            return Skip(entry.key, "not UTF-8 text", str(exc)), False
        return Sample(entry.key, entry.label, data, "text"), False
    if not (opts.verify_images or opts.max_side) and data[:3] == b"\xff\xd8\xff":
        if _jpeg_header_ok(data):
            return Sample(entry.key, entry.label, data, "image"), False
        return Skip(entry.key, "corrupt image", "JPEG header is damaged or incomplete"), False
    reencode = False
    try:
        with open_image(data) as img:
            reencode = bool(opts.max_side) and max(img.size) > opts.max_side  # type: ignore[operator]
            if opts.verify_images or reencode:
                img.load()
            if reencode:
                data = _reencode(img, opts.max_side, opts.quality)  # type: ignore[arg-type]
    except ImageFormatError as exc:
        if exc.detected is not None:
            return Skip(entry.key, "unsupported image format", str(exc)), False
        return Skip(entry.key, "corrupt image", "not a recognised image format"), False
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        return Skip(entry.key, "corrupt image", str(exc)), False
    return Sample(entry.key, entry.label, data, "image"), reencode


class _NotReadable(Exception):
    """Why :func:`_read_regular` refused a path (becomes a :class:`Skip`)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def _read_regular(path: str) -> bytes:
    """The bytes of the regular file at ``path`` (links followed), read as one consistent version.

    The file is opened non-blocking (a FIFO put in its place never blocks) and
    checked with ``fstat`` on the open descriptor: anything but a regular file
    (FIFO, device, socket, folder) is refused without a read. At most the size
    seen at open plus one byte is read, so a file that grows without end (or a
    device) cannot stall the read, and a file whose size or modification time
    changed while it was read is refused rather than packed half old, half new.

    Raises:
        _NotReadable: not a regular file, or changed while read.
        OSError: it cannot be opened or read.
    """
    fd = os.open(path, _OPEN_FLAGS)
    try:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode):
            raise _NotReadable("not a regular file", f"mode {stat.filemode(before.st_mode)} when opened")
        size = before.st_size
        chunks, got = [], 0
        while got <= size:
            chunk = os.read(fd, size + 1 - got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        after = os.fstat(fd)
    finally:
        os.close(fd)
    if got != size or (after.st_size, after.st_mtime_ns) != (size, before.st_mtime_ns):
        raise _NotReadable(
            "changed while read",
            f"{size} bytes when opened, {got} read, {after.st_size} after; it is being written to",
        )
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _jpeg_header_ok(data: bytes) -> bool:
    """Walk a JPEG's marker segments up to the start of scan, as PIL's header parser does.

    About 20x cheaper than ``Image.open`` (which parses the same segments in
    Python objects); it catches files that are not JPEGs past the first bytes
    and headers cut short. Truncated scan data needs ``verify_images``.
    """
    i, n, frame = 2, len(data), False
    while i + 4 <= n:
        if data[i] != 0xFF:
            return False
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            i += 2
            continue
        length = int.from_bytes(data[i + 2 : i + 4], "big")
        if length < 2:
            return False
        if marker == 0xDA:  # start of scan: the header is complete
            return frame and i + 2 + length <= n
        frame = frame or (0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC))
        i += 2 + length
    return False


def _load_chunk(entries: list[SourceFile | Skip], opts: _Options) -> list[tuple[Sample | Skip, bool]]:
    """:func:`_load` over a chunk of walk entries (skips pass through), one pool task per chunk."""
    return [_load(e, opts) if isinstance(e, SourceFile) else (e, False) for e in entries]


def _reencode(img: Image.Image, max_side: int, quality: int) -> bytes:
    img = img.convert("RGB")
    img.thumbnail((max_side, max_side), Image.Resampling.BICUBIC)
    out = io.BytesIO()
    img.save(out, format="JPEG", quality=quality)
    return out.getvalue()


def _pipeline(
    entries: Iterator[SourceFile | Skip], pool: ThreadPoolExecutor, opts: _Options, depth: int, chunk: int = 16
) -> Iterator[tuple[SourceFile | Skip, Sample | Skip, bool]]:
    """Read files in the pool in chunks, yielding results in walk order, ``depth`` chunks ahead."""
    pending: deque[tuple[list[SourceFile | Skip], Future]] = deque()

    def resolve(
        item: tuple[list[SourceFile | Skip], Future],
    ) -> Iterator[tuple[SourceFile | Skip, Sample | Skip, bool]]:
        batch, future = item
        for entry, (result, reencoded) in zip(batch, future.result(), strict=True):
            yield entry, result, reencoded

    for batch in _chunks(entries, chunk):
        pending.append((batch, pool.submit(_load_chunk, batch, opts)))
        if len(pending) >= depth:
            yield from resolve(pending.popleft())
    while pending:
        yield from resolve(pending.popleft())


def _chunks(items: Iterator[SourceFile | Skip], size: int) -> Iterator[list[SourceFile | Skip]]:
    batch: list[SourceFile | Skip] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
