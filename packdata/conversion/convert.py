"""Source folder -> parallel reads -> one writer per shard -> manifest, atomically.

The pack is written into a hidden sibling, ``.NAME.partial``, and renamed into
place only once its manifest is written, so a reader never sees a half pack.
Every commit is followed by a checkpoint (``progress.json``) that records how far
the sorted walk got; ``resume=True`` cuts the shard and index back to the last
checkpoint and carries on, giving the same content as an uninterrupted run.
A checkpoint counts a source file only together with its sample (or its skip
line), so a kill at any instant loses nothing. One process at a time converts
into a destination: it holds ``.NAME.lock`` beside it (:mod:`packdata.pack.lock`)
from before the partial folder is touched until after the publish rename.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
import stat
import time
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image
from tqdm import tqdm

from packdata.conversion.sources import Skip, Source, SourceFile, scan_source
from packdata.errors import (
    CapacityError,
    ConfigError,
    ImageFormatError,
    PackFormatError,
    SourceError,
    destination_error,
)
from packdata.formats import FORMATS, ShardWriter, format_from_path, get_format, shard_writer
from packdata.pack.images import open_image
from packdata.pack.index import FILES as INDEX_FILES
from packdata.pack.index import SampleIndexWriter
from packdata.pack.lock import convert_lock_path, hold_lock
from packdata.pack.manifest import MANIFEST_NAME, Manifest, ShardInfo, read_manifest, write_manifest
from packdata.pack.records import Sample

__all__ = ["ConvertResult", "convert", "partial_path"]

SKIP_REPORT = "skipped.jsonl"
_PROGRESS = "progress.json"
_COMMIT_BYTES = 128 << 20
_COMMIT_SAMPLES = 20_000


@dataclass
class ConvertResult:
    """What a conversion did: counts, bytes and time, and every skip by reason."""

    pack: Path
    format: str
    kind: str
    found: int
    packed: int
    skipped: dict[str, int]
    bytes_in: int
    bytes_out: int
    seconds: float
    shards: int
    resumed: bool = False
    reencoded: int = 0
    skip_examples: list[dict[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        out = asdict(self)
        out["pack"] = str(self.pack)
        return out


def partial_path(dst: str | os.PathLike) -> Path:
    """The hidden sibling a conversion into ``dst`` writes before renaming."""
    dst = Path(dst)
    return dst.parent / f".{dst.name}.partial"


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


def _check_paths(src: Path, dst: Path, overwrite: bool) -> None:
    real_src, real_dst = os.path.realpath(src), os.path.realpath(dst)
    if real_dst == real_src or real_dst.startswith(real_src.rstrip(os.sep) + os.sep):
        raise ConfigError(
            "destination is inside the source folder", path=dst, hint="Write the pack outside the folder being packed"
        )
    if real_src.startswith(real_dst.rstrip(os.sep) + os.sep):
        raise ConfigError(
            "the source folder is inside the destination",
            path=dst,
            hint="Choose a destination that does not contain the source",
        )
    if dst.exists() or dst.is_symlink():
        if not overwrite:
            raise ConfigError(
                "destination already exists", path=dst, hint="Pass --overwrite to replace it, or choose another path"
            )
        _check_replaceable(dst)


def _foreign_entry(manifest: Manifest, dst: Path) -> str | None:
    """The first entry of ``dst`` that is not one of the pack's own files, or of the wrong type; None if none.

    A pack holds its manifest, the skip report, the sample index folder (its
    files only), and each shard's files as its format lays them out (a folder
    with its files, or a file with side files beside it). No symlink anywhere.
    """
    layout_of = get_format(manifest.format).shard_layout
    files = {MANIFEST_NAME, f".{MANIFEST_NAME}.tmp", SKIP_REPORT}
    folders: dict[str, set[str]] = {manifest.index_dir: set(INDEX_FILES)}
    for shard in manifest.shards:
        layout = layout_of(shard.file)
        if layout.folder:
            folders[shard.file] = {layout.data, *layout.side, *layout.scratch}
        else:
            files.update((layout.data, *layout.side))
    for entry in sorted(os.scandir(dst), key=lambda e: e.name):
        if entry.name in files and entry.is_file(follow_symlinks=False):
            continue
        if entry.name not in folders or not entry.is_dir(follow_symlinks=False):
            return entry.name
        for inner in sorted(os.scandir(entry.path), key=lambda e: e.name):
            if inner.name not in folders[entry.name] or not inner.is_file(follow_symlinks=False):
                return f"{entry.name}/{inner.name}"
    return None


def _check_replaceable(dst: Path) -> None:
    """``dst`` is provably a complete packdata pack that ``overwrite`` may replace, and nothing else.

    Its manifest must pass :func:`~packdata.pack.manifest.read_manifest` (schema,
    version, paths inside the pack), it must not be a staged pack, every shard
    and the sample index must be there, and it may hold nothing but the pack's
    own files: anything else (a web app's folder with a ``manifest.json``) is
    refused, never deleted.

    Raises:
        ConfigError: naming what makes ``dst`` not a pack packdata may replace.
    """
    hint = "Remove it yourself or choose another path"
    if dst.is_symlink() or not dst.is_dir():
        raise ConfigError(
            "destination exists and is not a packdata pack (not a folder); refusing to replace it", path=dst, hint=hint
        )
    try:
        manifest = read_manifest(dst)
    except PackFormatError as exc:
        reason = str(exc)[: -len(exc.hint) - 2] if exc.hint else str(exc)
        raise ConfigError(
            f"destination exists and is not a packdata pack; refusing to replace it ({reason})", hint=hint
        ) from exc
    if manifest.staged_from is not None:
        raise ConfigError(
            "destination is a staged pack; refusing to replace it", path=dst, hint=f"Run `packdata unstage {dst}` first"
        )
    needed = [(dst / s.file, f"shard {s.file}") for s in manifest.shards]
    needed += [(dst / manifest.index_dir / name, f"sample index file {name}") for name in INDEX_FILES]
    for path, what in needed:
        if not os.path.lexists(path):
            raise ConfigError(
                f"destination is not a complete packdata pack ({what} is missing); refusing to replace it",
                path=dst,
                hint=hint,
            )
    foreign = _foreign_entry(manifest, dst)
    if foreign is not None:
        raise ConfigError(
            f"destination holds {foreign!r}, which is not part of a packdata pack; refusing to replace it",
            path=dst,
            hint=hint,
        )


_MIN_FREE_BYTES = 1 << 20


def _check_destination_writable(dst: Path) -> None:
    """Refuse, with one line, a destination packdata cannot write a pack at.

    ``dst`` must not be a symbolic link (to a folder or to nothing) nor an
    existing non-folder (a file, a device); its nearest existing ancestor (the
    parent, or where missing parents will be created) must be a writable folder
    with at least 1 MiB free. Nothing is created here; what
    only an attempt reveals (``/proc``, races) is caught where the pack's
    folder and first shard are created.

    Raises:
        ConfigError: ``dst`` or its parent cannot be used.
        CapacityError: the parent's file system is full.
    """
    if dst.is_symlink():
        raise ConfigError(
            f"destination is a symbolic link (to {os.readlink(dst)!r}); packdata writes a pack only at a real path",
            path=dst,
            hint="Pass the path the link points to, or another path",
        )
    if dst.exists() and not dst.is_dir():
        raise ConfigError(
            "destination exists and is not a folder", path=dst, hint="Choose another path; packdata will not replace it"
        )
    parent = dst.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent  # missing parents are created with the pack
    if not parent.is_dir():
        raise ConfigError("the destination's parent is not a folder", path=parent, hint="Choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(
            "the destination's parent folder is not writable (read-only file system or permissions)",
            path=parent,
            hint="Choose a writable destination",
        )
    st = os.statvfs(parent)
    if st.f_blocks == 0:
        raise ConfigError(
            "the destination's parent folder is on a file system without storage (such as /proc or /sys)",
            path=parent,
            hint="Choose a destination on a disk or tmpfs",
        )
    free = st.f_bavail * st.f_frsize
    if free < _MIN_FREE_BYTES:
        raise CapacityError(
            f"the destination disk is full: {free} bytes free, at least {_MIN_FREE_BYTES} needed to start",
            path=parent,
            hint="Free space or choose another destination",
        )


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


class _Checkpoint:
    """The resumable state of a conversion, saved in ``progress.json``."""

    def __init__(self, path: Path, options: dict[str, Any]) -> None:
        self.path = path
        self.options = options
        self.files_done = 0
        self.samples_done = 0
        self.walk = hashlib.sha256()
        self.skip_report_bytes = 0
        self.skipped: Counter[str] = Counter()
        self.skip_examples: list[dict[str, str]] = []
        self.bytes_in = 0
        self.reencoded = 0
        self.shards: list[ShardInfo] = []
        self.shard_first = 0
        self.shard_bytes = 0
        self.walk_expected = ""
        self.finishing = False  # every shard is closed and listed: only naming, manifest and publish remain

    def save(self) -> None:
        state = {
            "options": self.options,
            "files_done": self.files_done,
            "samples_done": self.samples_done,
            "walk_sha256": self.walk.hexdigest(),
            "skip_report_bytes": self.skip_report_bytes,
            "skipped": dict(self.skipped),
            "skip_examples": self.skip_examples,
            "bytes_in": self.bytes_in,
            "reencoded": self.reencoded,
            "shards": [asdict(s) for s in self.shards],
            "shard_first": self.shard_first,
            "shard_bytes": self.shard_bytes,
            "finishing": self.finishing,
        }
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state), encoding="utf-8")
        os.replace(tmp, self.path)

    def load(self) -> dict[str, Any]:
        state = json.loads(self.path.read_text(encoding="utf-8"))
        if state["options"] != self.options:
            raise ConfigError(
                f"the interrupted conversion used other options ({state['options']})",
                path=self.path.parent,
                hint="Resume with the same options, or start again with --overwrite",
            )
        for name in (
            "files_done",
            "samples_done",
            "skip_report_bytes",
            "bytes_in",
            "reencoded",
            "shard_first",
            "shard_bytes",
        ):
            setattr(self, name, state[name])
        self.skipped = Counter(state["skipped"])
        self.skip_examples = state["skip_examples"]
        self.shards = [ShardInfo(**s) for s in state["shards"]]
        self.walk_expected = state["walk_sha256"]
        self.finishing = bool(state.get("finishing", False))
        return state


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    format: str | None = None,
    kind: str = "auto",
    workers: int | None = None,
    on_error: str = "skip",
    verify_images: bool = False,
    max_side: int | None = None,
    quality: int = 90,
    shard_size: int | None = None,
    shard_samples: int | None = None,
    overwrite: bool = False,
    resume: bool = False,
    progress: bool = True,
    engine: str = "local",
    address: str | None = None,
) -> ConvertResult:
    """Pack the files of ``src`` into a pack at ``dst``.

    Args:
        src: the source folder; ImageFolder class subfolders give labels. Never modified.
        dst: the pack to create (``out.lmdb``; a folder for TFRecord).
        format: a name from :data:`packdata.formats.FORMATS`; by default from ``dst``'s suffix, else the first.
        kind: ``"image"``, ``"text"`` or ``"auto"``.
        workers: parallel reader threads (default: 4 per CPU, at most 32).
        on_error: ``"skip"`` corrupt, empty or unreadable files (listed in the
            summary and in ``skipped.jsonl``), or ``"fail"`` at the first.
        verify_images: fully decode every image (catches truncated files).
        max_side: re-encode images whose longer side is larger to this size, as JPEG.
        quality: JPEG quality of re-encoded images.
        shard_size: start a new shard before one would exceed this many bytes.
        shard_samples: at most this many samples per shard.
        overwrite: replace an existing pack at ``dst``.
        resume: continue an interrupted conversion into ``dst``.
        progress: show a progress bar on stderr.
        engine: ``"local"`` (threads in this process) or ``"ray"`` (one Ray task
            per shard, see :mod:`packdata.conversion.ray`; needs ``packdata[ray]``).
        address: with ``engine="ray"``, the Ray cluster to connect to (``"auto"``,
            ``"ray://host:10001"``, ...); by default a local Ray instance starts.

    Returns:
        A :class:`ConvertResult`.

    Raises:
        SourceError: ``src`` is missing, has no usable files, or (with
            ``on_error="fail"``) holds a bad file.
        ConfigError: ``dst`` exists, is inside ``src``, is a link, is not a
            folder, its parent is missing or not writable, or options contradict.
        CapacityError: the destination disk is full (at the start, or later:
            then free space and resume).
        LockedError: another process is converting into ``dst`` (it is named).
    """
    started = time.perf_counter()
    src, dst = Path(src), Path(dst)
    if engine == "ray":
        from packdata.conversion.ray import require_ray

        require_ray()
    elif engine != "local":
        raise ConfigError(f"engine should be 'local' or 'ray', but got engine={engine!r}")
    elif address is not None:
        raise ConfigError("address is only used by engine='ray'", hint="Pass engine='ray' or drop address")
    fmt = format or format_from_path(os.fspath(dst)) or FORMATS[0]
    pack_format = get_format(fmt)
    if on_error not in ("skip", "fail"):
        raise ConfigError(f"on_error should be 'skip' or 'fail', but got on_error={on_error!r}")
    if max_side is not None and max_side < 1:
        raise ConfigError(f"max_side should be a positive number of pixels, but got max_side={max_side}")
    if shard_size is None and shard_samples is None:
        shard_size = pack_format.default_shard_bytes
    source = scan_source(src, kind)
    _check_destination_writable(dst)
    _check_paths(src, dst, overwrite)
    opts = _Options(fmt, source.kind, on_error, verify_images, max_side, quality, shard_size, shard_samples)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with hold_lock(convert_lock_path(dst), what=f"packdata convert, {engine} engine", target=dst):
        _check_paths(src, dst, overwrite)  # again, under the lock: another writer may have published meanwhile
        if engine == "ray":
            from packdata.conversion.ray import convert_on_ray

            return convert_on_ray(
                source,
                dst,
                opts,
                workers=workers,
                overwrite=overwrite,
                resume=resume,
                progress=progress,
                address=address,
                started=started,
            )
        return _convert_local(
            source, dst, opts, workers=workers, overwrite=overwrite, resume=resume, progress=progress, started=started
        )


def _convert_local(
    source: Source,
    dst: Path,
    opts: _Options,
    *,
    workers: int | None,
    overwrite: bool,
    resume: bool,
    progress: bool,
    started: float,
) -> ConvertResult:
    """The local engine: threads read, this process writes; run under the destination's lock."""
    partial = partial_path(dst)
    checkpoint = _Checkpoint(partial / _PROGRESS, asdict(opts))
    resumed = resume and checkpoint.path.is_file()
    if resumed:
        checkpoint.load()
    elif partial.exists():
        if not overwrite and not resume:
            raise ConfigError(
                f"an interrupted conversion into {dst} is in {partial}",
                path=dst,
                hint="Pass --resume to continue it, or --overwrite to start again",
            )
        shutil.rmtree(partial)
    try:
        partial.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise destination_error(exc, partial) from exc
    workers = workers or min(32, 4 * (os.cpu_count() or 1))

    packer = _Packer(source, partial, opts, checkpoint, resumed)
    try:
        if not checkpoint.finishing:  # else every shard was closed before the interruption
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="packdata-read") as pool:
                try:
                    packer.run(pool, depth=2 * workers, progress=progress)
                except BaseException:
                    pool.shutdown(wait=True, cancel_futures=True)
                    raise
    except SourceError:
        packer.close_files(failed=True)
        shutil.rmtree(partial)  # a deliberate stop: nothing to resume
        raise
    except OSError as exc:
        packer.close_files(failed=True)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise CapacityError(
                "the destination disk is full", path=partial, hint="Free space and rerun with --resume"
            ) from exc
        raise
    except BaseException:
        packer.close_files(failed=True)
        raise
    packer.close_files()
    if checkpoint.samples_done == 0:
        shutil.rmtree(partial)
        raise _no_samples_error(source, checkpoint.skipped)
    manifest = packer.finish()
    _publish(partial, dst, overwrite=overwrite)
    return ConvertResult(
        pack=dst,
        format=opts.format,
        kind=source.kind,
        found=checkpoint.files_done,
        packed=checkpoint.samples_done,
        skipped=dict(checkpoint.skipped),
        bytes_in=checkpoint.bytes_in,
        bytes_out=manifest.total_bytes,
        seconds=time.perf_counter() - started,
        shards=len(manifest.shards),
        resumed=resumed,
        reencoded=checkpoint.reencoded,
        skip_examples=checkpoint.skip_examples,
    )


class _Packer:
    """The single writer: consumes read results in walk order, rolls shards, checkpoints."""

    def __init__(self, source: Source, partial: Path, opts: _Options, cp: _Checkpoint, resumed: bool) -> None:
        self.source, self.partial, self.opts, self.cp = source, partial, opts, cp
        self.writer_cls = shard_writer(opts.format)
        self.index = SampleIndexWriter(partial, resume_at=cp.samples_done if resumed else None)
        report = partial / SKIP_REPORT
        report.touch()
        if resumed:
            os.truncate(report, cp.skip_report_bytes)
        self.report = open(report, "ab")  # noqa: SIM115 (closed in close_files())
        self.writer: ShardWriter | None = None  # None once finishing: every shard is closed
        if not cp.finishing:
            self.writer = self._open_shard(cp.samples_done - cp.shard_first if resumed else None)
        self.batch: list[tuple[int, Sample]] = []
        self.batch_bytes = 0
        self.shard_samples = cp.samples_done - cp.shard_first

    def _open_shard(self, resume_at: int | None = None) -> ShardWriter:
        path = self.partial / self.writer_cls.shard_name(len(self.cp.shards))
        return self.writer_cls(path, resume_at=resume_at)

    def run(self, pool: ThreadPoolExecutor, depth: int, progress: bool) -> None:
        entries = self._entries()
        bar = tqdm(
            desc="packing",
            unit=" files",
            unit_scale=True,
            disable=not progress,
            initial=self.cp.files_done,
            dynamic_ncols=True,
        )
        last_bytes, last_time = self.cp.bytes_in, time.perf_counter()
        with bar:
            for entry, result, reencoded in _pipeline(entries, pool, self.opts, depth):
                if isinstance(result, Sample):
                    # A full shard is closed and checkpointed *before* this file is counted:
                    # a checkpoint never counts a file whose sample is not written with it.
                    self._make_room(len(result.data))
                self.cp.walk.update(entry.key.encode("utf-8", "surrogateescape") + b"\0")
                self.cp.files_done += 1
                if isinstance(result, Skip):
                    self._skip(result, is_read_error=isinstance(entry, SourceFile))
                else:
                    self._add(result)
                    self.cp.reencoded += reencoded
                bar.update()
                now = time.perf_counter()
                if now - last_time > 1.0:
                    bar.set_postfix_str(f"{(self.cp.bytes_in - last_bytes) / (now - last_time) / 1e6:.1f} MB/s")
                    last_bytes, last_time = self.cp.bytes_in, now
            self._commit()

    def _entries(self) -> Iterator[SourceFile | Skip]:
        """The walk, with the part an interrupted run already packed verified and dropped."""
        walk = self.source.walk()
        if self.cp.files_done:
            check = hashlib.sha256()
            for _, entry in zip(range(self.cp.files_done), walk, strict=False):
                check.update(entry.key.encode("utf-8", "surrogateescape") + b"\0")
            if check.hexdigest() != self.cp.walk_expected:
                raise SourceError(
                    "the source folder changed since the interrupted conversion",
                    path=self.source.root,
                    hint="Start again with --overwrite",
                )
            self.cp.walk = check
        return walk

    def _skip(self, skip: Skip, is_read_error: bool) -> None:
        if is_read_error and self.opts.on_error == "fail":
            detail = f": {skip.detail}" if skip.detail else ""
            raise SourceError(
                f"{skip.reason}{detail}",
                path=self.source.root / skip.key,
                hint="Fix or remove the file, or pass --on-error skip",
            )
        self.cp.skipped[skip.reason] += 1
        line = {"key": skip.key, "reason": skip.reason, "detail": skip.detail}
        if is_read_error and len(self.cp.skip_examples) < 20:
            self.cp.skip_examples.append(line)
        self.report.write(json.dumps(line, ensure_ascii=False).encode("utf-8") + b"\n")

    def _make_room(self, size: int) -> None:
        """Close the current shard when a sample of ``size`` bytes would overfill it."""
        limit_bytes, limit_samples = self.opts.shard_size, self.opts.shard_samples
        if self.shard_samples and (
            (limit_samples and self.shard_samples >= limit_samples)
            or (limit_bytes and self.cp.shard_bytes + size > limit_bytes)
        ):
            self._roll_shard()

    def _add(self, sample: Sample) -> None:
        """Append a sample, counted with its file (call :meth:`_make_room` first)."""
        size = len(sample.data)
        self.batch.append((self.shard_samples, sample))
        self.index.append(sample.key, sample.label, size)
        self.cp.samples_done += 1
        self.cp.bytes_in += size
        self.shard_samples += 1
        self.cp.shard_bytes += size
        self.batch_bytes += size
        if self.batch_bytes >= _COMMIT_BYTES or len(self.batch) >= _COMMIT_SAMPLES:
            self._commit()

    def _commit(self) -> None:
        """Write the batch, make everything durable, then record the checkpoint."""
        assert self.writer is not None  # internal invariant: only called while packing
        if self.batch:
            self.writer.write(self.batch)
            self.batch, self.batch_bytes = [], 0
        self.writer.sync()
        self.index.flush()
        self.report.flush()
        os.fsync(self.report.fileno())
        self.cp.skip_report_bytes = self.report.tell()
        self.cp.save()

    def _roll_shard(self) -> None:
        """Close the full shard, list it and open the next (a checkpoint before and after).

        Killed between the two checkpoints, a resume reopens the closed shard at
        its full count and rolls it again: closing is repeatable.
        """
        self._commit()
        assert self.writer is not None
        nbytes, digest = self.writer.close()
        name = self.writer_cls.shard_name(len(self.cp.shards))
        self.cp.shards.append(ShardInfo(name, self.shard_samples, self.cp.shard_first, nbytes, digest))
        self.cp.shard_first = self.cp.samples_done
        self.shard_samples = self.cp.shard_bytes = 0
        self.writer = self._open_shard()
        self.cp.save()

    def close_files(self, failed: bool = False) -> None:
        """Close the skip report and the index files (safe to call twice).

        After a failure, errors closing them (a full disk) are ignored: the last
        checkpoint, not these buffers, is what a resume continues from.
        """
        if self.report.closed:
            return
        try:
            self.report.close()
            self.index.close()
        except OSError:
            if not failed:
                raise

    def finish(self) -> Manifest:
        """Close the last shard, give shards their final names, write the manifest.

        The closed shard list is checkpointed (``finishing``) before any shard is
        renamed, and the checkpoint is removed only after the manifest is
        written, so a run killed in between resumes by redoing these steps
        (:meth:`finalize` is repeatable).
        """
        if not self.cp.finishing:
            assert self.writer is not None
            nbytes, digest = self.writer.close()
            name = self.writer_cls.shard_name(len(self.cp.shards))
            self.cp.shards.append(ShardInfo(name, self.shard_samples, self.cp.shard_first, nbytes, digest))
            self.cp.finishing = True
            self.cp.save()
        shards = self.writer_cls.finalize(self.partial, list(self.cp.shards))
        manifest = _make_manifest(
            self.source,
            self.opts,
            shards,
            samples=self.cp.samples_done,
            files_found=self.cp.files_done,
            bytes_in=self.cp.bytes_in,
            reencoded=self.cp.reencoded,
            skipped=self.cp.skipped,
        )
        write_manifest(self.partial, manifest)
        (self.partial / _PROGRESS).unlink()
        _fsync_dir(self.partial)
        return manifest


def _no_samples_error(source: Source, skipped: Counter[str]) -> SourceError:
    """The error of a conversion that packed nothing."""
    reasons = ", ".join(f"{n} {r}" for r, n in skipped.items()) or "none"
    return SourceError(
        f"no usable {source.kind} files (skipped: {reasons})", path=source.root, hint="Check the folder and --kind"
    )


def _make_manifest(
    source: Source,
    opts: _Options,
    shards: list[ShardInfo],
    *,
    samples: int,
    files_found: int,
    bytes_in: int,
    reencoded: int,
    skipped: Counter[str],
) -> Manifest:
    """The manifest of a finished pack (shards already finalized); every engine writes this one."""
    return Manifest(
        format=opts.format,
        kind=source.kind,
        classes=source.classes,
        num_samples=samples,
        shards=shards,
        index={"dir": "index"},
        fields=[opts.kind, "label", "key"],
        reencode={"max_side": opts.max_side, "quality": opts.quality, "count": reencoded} if opts.max_side else None,
        skipped={"count": sum(skipped.values()), "by_reason": dict(skipped), "report": SKIP_REPORT},
        source={"files_found": files_found, "bytes": bytes_in},
    )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(partial: Path, dst: Path, *, overwrite: bool) -> None:
    """Rename the finished pack into place; with ``overwrite``, an old pack at ``dst`` is replaced.

    Something that appeared at ``dst`` while converting is refused without
    ``overwrite``. The old pack is checked again (:func:`_check_replaceable`: it
    may have changed while converting), moved aside to a hidden sibling, and deleted only
    once the new pack has its name; if the rename fails, it is moved back.
    """
    old = None
    if os.path.lexists(dst):
        if not overwrite:
            raise ConfigError(
                "destination appeared while converting",
                path=dst,
                hint=f"The new pack is left in {partial}: move what is at the destination away and convert again",
            )
        _check_replaceable(dst)
        old = dst.parent / f".{dst.name}.old-{os.getpid()}"
        counter = 0
        while os.path.lexists(old):
            counter += 1
            old = dst.parent / f".{dst.name}.old-{os.getpid()}-{counter}"
        os.rename(dst, old)
    try:
        os.rename(partial, dst)
    except BaseException:
        if old is not None and not os.path.lexists(dst):
            os.rename(old, dst)
        raise
    _fsync_dir(dst.parent)
    if old is not None:
        shutil.rmtree(old)
