"""The copying half of :mod:`packdata.staging.stage`: shard files, verified parallel copies, markers.

A shard is copied as :class:`ShardFiles`: its files (``data.mdb`` and
``records.i64`` for LMDB, the ``.tfrecord``, its ``.tfindex`` and ``.tfpayload`` for TFRecord),
each to a hidden ``.NAME.partial`` name first, hashed as written, renamed into
place only once the checksummed file matches the manifest. Internal: the API
and its documentation live in :mod:`packdata.staging.stage`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packdata.errors import CapacityError, PackdataError, PackFormatError
from packdata.formats import get_format
from packdata.pack.files import (
    file_kind,
    fsync_named,
    open_regular,
    stream_sha256,
)
from packdata.pack.manifest import MANIFEST_NAME, Manifest, ShardInfo
from packdata.progress import progress as show_progress
from packdata.staging.space import FULL_DISK_ERRNOS, filesystem_named
from packdata.units import format_size

__all__ = [
    "CHUNK",
    "COPY_WORKERS",
    "EXTRA_FILES",
    "LOCK",
    "PARTIAL",
    "Cancelled",
    "ShardFiles",
    "copy_all",
    "copy_file",
    "copy_regular",
    "is_regular",
    "is_staged",
    "require_regular",
    "sha256_of",
    "shard_files",
]


PARTIAL = ".partial"
LOCK = ".stage.lock"
COPY_WORKERS = 4
"""The most parallel copy threads a stage uses when it is given no ``workers``."""
CHUNK = 8 << 20
EXTRA_FILES = ("skipped.jsonl",)


class Cancelled(Exception):
    """Another copy failed or the user interrupted: stop this one and clean up."""


@dataclass
class ShardFiles:
    """One shard as files on disk: where it is, where it goes, its temporary names."""

    number: int
    info: ShardInfo
    name: str  # the shard's name in the staged pack
    files: list[tuple[Path, Path, Path, bool]]  # (source, destination, temporary, is the checksummed file)
    dest_root: Path  # what "staged" means on disk: a directory (LMDB) or the shard file (TFRecord)
    temp_root: Path
    directory: bool

    @property
    def size(self) -> int:
        return sum(src.lstat().st_size for src, _, _, _ in self.files)

    def dest_bytes(self) -> int:
        return sum(dst.lstat().st_size for _, dst, _, _ in self.files if is_regular(dst))

    def remove(self) -> None:
        if self.directory and not self.dest_root.is_symlink():
            shutil.rmtree(self.dest_root, ignore_errors=True)
        elif self.directory:
            self.dest_root.unlink(missing_ok=True)
        else:
            for _, dst, _, _ in self.files:
                dst.unlink(missing_ok=True)

    def remove_temp(self) -> None:
        if self.directory:
            shutil.rmtree(self.temp_root, ignore_errors=True)
        else:
            for _, _, tmp, _ in self.files:
                tmp.unlink(missing_ok=True)


def is_regular(path: Path) -> bool:
    """``path`` is a regular file itself, not a symlink to one."""
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def require_regular(path: Path, what: str) -> None:
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        raise PackFormatError(f"{what} is missing", path=path, hint="Convert the pack again") from None
    if not stat.S_ISREG(mode):
        raise PackFormatError(
            f"{what} is not a regular file (it is {file_kind(mode)})",
            path=path,
            hint="packdata copies only a pack's own regular files: replace it by the real file or convert again",
        )


def shard_files(manifest: Manifest, source: Path, dest: Path) -> list[ShardFiles]:
    """The files of each shard to copy: only the pack's own (the format's), all regular files.

    A shard's name in the manifest is a plain name (or, for a staged pack, an
    origin shard's path) checked by :func:`packdata.pack.manifest.read_manifest`, so
    every destination lies directly in ``dest``.
    """
    fmt = get_format(manifest.format)
    fmt.check_names(manifest, source / MANIFEST_NAME)
    layout_of = fmt.shard_layout
    units = []
    for number, info in enumerate(manifest.shards):
        src = info.path(source)
        name = os.path.basename(info.file)
        layout = layout_of(name)
        side = [p for p in layout.side_paths(src) if os.path.lexists(p) or p.name in layout.needed]
        if layout.folder:
            if src.is_symlink() or not src.is_dir():
                raise PackFormatError(
                    f"shard {number} is not a folder holding {layout.data}", path=src, hint="Convert the pack again"
                )
            root, temp = dest / name, dest / f".{name}{PARTIAL}"
            names = sorted([layout.data] + [p.name for p in side])
            for f in names:
                require_regular(src / f, f"shard {number}'s {f}")
            files = [(src / f, root / f, temp / f, f == layout.data) for f in names]
            units.append(ShardFiles(number, info, name, files, root, temp, True))
        else:
            require_regular(src, f"shard {number}")
            files = [(src, dest / name, dest / f".{name}{PARTIAL}", True)]
            for p in reversed(side):
                require_regular(p, f"shard {number}'s {p.suffix} file")
                files.insert(0, (p, dest / p.name, dest / f".{p.name}{PARTIAL}", False))
            units.append(ShardFiles(number, info, name, files, dest / name, dest / f".{name}{PARTIAL}", False))
    return units


def _open_regular(path: Path) -> int:
    """Open ``path`` for reading without following a symlink, and only if it is a regular file.

    Raises:
        PackFormatError: a symlink, a FIFO, a device or a folder (named), or it cannot be opened.
    """
    hint = "packdata copies only a pack's own regular files"
    try:
        return open_regular(path, follow_symlinks=False)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PackFormatError("is a symlink, not a regular file of the pack", path=path, hint=hint) from exc
        if exc.errno == errno.EINVAL:  # the message names what it is
            raise PackFormatError(f"is {exc.strerror}", path=path, hint=hint) from exc
        raise PackFormatError(f"cannot be opened: {exc.strerror}", path=path) from exc


def sha256_of(path: Path) -> str:
    """SHA-256 of ``path``, opened as a regular file only (no symlink, FIFO or device)."""
    with os.fdopen(_open_regular(path), "rb") as f:
        return stream_sha256(f)


def copy_regular(src: Path, tmp: Path, on_chunk: Callable[[int], None] | None = None) -> tuple[int, str]:
    """Copy the regular file ``src`` to the new file ``tmp`` with ``src``'s permission bits.

    ``src`` is opened with ``O_NOFOLLOW`` and must be a regular file (checked on
    the descriptor); ``tmp`` must not exist. Returns ``(bytes, sha256)`` of what
    was written, after an fsync.

    Raises:
        PackFormatError: ``src`` is a symlink, a FIFO, a device or a folder.
        ConfigError: the file system of ``tmp`` refused the fsync (a full disk: the ``OSError``, ``tmp`` named).
    """
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    size = 0
    fd = _open_regular(src)
    with os.fdopen(fd, "rb") as fin:
        mode = stat.S_IMODE(os.fstat(fd).st_mode) & 0o777
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(out, "wb") as fout:
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while True:
                n = fin.readinto(buffer)
                if not n:
                    break
                digest.update(view[:n])
                fout.write(view[:n])
                size += n
                if on_chunk is not None:
                    on_chunk(n)
            fout.flush()
            os.fchmod(out, mode)
            fsync_named(out, tmp, full_disk_as_oserror=True)  # a full disk: the stage's words
    return size, digest.hexdigest()


def is_staged(unit: ShardFiles) -> bool:
    """Every file of the staged copy has the source's size and the expected checksum, inside the staged pack.

    A shard folder that is a link (to files elsewhere) is no staged copy, however its files hash.
    """
    if unit.directory and unit.dest_root.is_symlink():
        return False
    try:
        for src, dst, _, primary in unit.files:
            if not is_regular(dst) or dst.stat().st_size != src.lstat().st_size:
                return False
            expected = unit.info.sha256 if primary else sha256_of(src)
            if sha256_of(dst) != expected:
                return False
    except (OSError, PackFormatError):
        return False
    return True


def copy_file(src: Path, tmp: Path, stop: threading.Event, bar: Any) -> tuple[int, str]:
    """Copy ``src`` to ``tmp`` (see :func:`copy_regular`), stopping at the next chunk once ``stop`` is set."""

    def chunk(n: int) -> None:
        bar.update(n)
        if stop.is_set():
            raise Cancelled

    if stop.is_set():
        raise Cancelled
    return copy_regular(src, tmp, chunk)


def copy_unit(unit: ShardFiles, stop: threading.Event, bar: Any) -> None:
    """Copy one shard to its temporary names, verify it, and rename it into place."""
    unit.remove_temp()
    try:
        for src, tmp, primary in _copied(unit):
            try:
                size, sha = copy_file(src, tmp, stop, bar)
            except OSError as exc:
                _raise_if_full(exc, unit)
                raise
            if primary and (sha != unit.info.sha256 or size != unit.info.bytes):
                raise PackFormatError(
                    f"shard {unit.number} does not match the manifest: {size} bytes with SHA-256 {sha[:16]}..., "
                    f"expected {unit.info.bytes} bytes with {unit.info.sha256[:16]}...",
                    path=src,
                    hint="The source pack is damaged: run `packdata verify` on it and convert it again",
                )
        if unit.directory:
            os.rename(unit.temp_root, unit.dest_root)
        else:
            # the checksummed file last: until it has its name the shard is not staged
            for _, dst, tmp, _ in sorted(unit.files, key=lambda f: f[3]):
                os.replace(tmp, dst)
    except BaseException:
        unit.remove_temp()
        raise


def _copied(unit: ShardFiles) -> Iterator[tuple[Path, Path, bool]]:
    """``unit``'s files to copy as (source, temporary, is the checksummed file), its temporary folder made first."""
    if unit.directory:
        try:
            unit.temp_root.mkdir()
        except OSError as exc:  # no inode left for the folder
            _raise_if_full(exc, unit)
            raise
    for src, _, tmp, primary in unit.files:
        yield src, tmp, primary


def _raise_if_full(exc: OSError, unit: ShardFiles) -> None:
    """A full disk or quota while ``unit`` is copied: the CapacityError naming the file system and the shard."""
    if exc.errno not in FULL_DISK_ERRNOS:
        return
    unit.remove_temp()
    raise CapacityError(
        f"no space left on {filesystem_named(unit.dest_root.parent)} while staging shard {unit.number} "
        f"({unit.name}, {format_size(unit.size)})",
        path=unit.dest_root.parent,
        hint="The partial copy was removed and the source is untouched. Stage fewer shards "
        "with budget=SIZE, free space, or use a larger tmpfs=SIZE",
    ) from exc


def copy_all(units: list[ShardFiles], total: int, workers: int | None, progress: bool) -> None:
    if not units:
        return
    stop = threading.Event()
    bar = show_progress(
        total=total, unit="B", desc=f"stage {len(units)} shard{'s' * (len(units) != 1)}", disable=progress is False
    )
    pool = ThreadPoolExecutor(max_workers=workers or min(COPY_WORKERS, len(units)), thread_name_prefix="packdata-stage")
    futures = [pool.submit(copy_unit, u, stop, bar) for u in units]
    try:
        wait(futures, return_when=FIRST_EXCEPTION)
        if any(f.done() and f.exception() is not None for f in futures):
            stop.set()  # one failed: cancel the others at their next chunk
        wait(futures)
        errors = [e for e in (f.exception() for f in futures) if e is not None and not isinstance(e, Cancelled)]
        if errors:
            raise next((e for e in errors if isinstance(e, PackdataError)), errors[0])
    except BaseException:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        for unit in units:
            unit.remove_temp()
        raise
    finally:
        bar.close()
    pool.shutdown(wait=True)
