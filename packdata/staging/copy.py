"""The copying half of :mod:`packdata.staging.stage`: shard files, verified parallel copies, markers.

A shard is copied as :class:`ShardFiles`: its files (``data.mdb`` and
``records.i64`` for LMDB, the ``.tfrecord``, its ``.tfindex`` and ``.tfpayload`` for TFRecord),
each to a hidden ``.NAME.partial`` name first, hashed as written, renamed into
place only once the checksummed file matches the manifest. Internal: the API
and its documentation live in :mod:`packdata.staging.stage`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packdata.errors import CapacityError, ConfigError, PackdataError, PackFormatError, destination_error
from packdata.formats import get_format
from packdata.pack.files import (
    aside_path,
    atomic_write,
    discard_partial,
    discard_stale,
    file_kind,
    open_regular,
    stream_sha256,
)
from packdata.pack.index import ALL_FILES as INDEX_FILES
from packdata.pack.index import damaged_index_file, index_files
from packdata.pack.lock import convert_lock_path, wait_for_lock
from packdata.pack.manifest import MANIFEST_NAME, STAGED_FILE, Manifest, ShardInfo
from packdata.progress import progress as show_progress
from packdata.staging.space import FULL_DISK_ERRNOS, filesystem_named, no_space_error
from packdata.units import format_size

__all__ = [
    "Cancelled",
    "ShardFiles",
    "copy_all",
    "copy_file",
    "copy_index",
    "copy_regular",
    "dir_bytes",
    "index_folder",
    "is_staged",
    "locked",
    "missing_folders",
    "old_shards",
    "remove_empty",
    "remove_leftovers",
    "removed_if_refused",
    "resolve_order",
    "same_tree",
    "sha256_of",
    "shard_files",
    "staged_manifest",
]

"""Written in every staged pack: where it came from, which shards are staged and which were left."""

PARTIAL = ".partial"
LOCK = ".stage.lock"
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
        return sum(dst.lstat().st_size for _, dst, _, _ in self.files if _is_regular(dst))

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


def _is_regular(path: Path) -> bool:
    """``path`` is a regular file itself, not a symlink to one."""
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def _require_regular(path: Path, what: str) -> None:
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
                _require_regular(src / f, f"shard {number}'s {f}")
            files = [(src / f, root / f, temp / f, f == layout.data) for f in names]
            units.append(ShardFiles(number, info, name, files, root, temp, True))
        else:
            _require_regular(src, f"shard {number}")
            files = [(src, dest / name, dest / f".{name}{PARTIAL}", True)]
            for p in reversed(side):
                _require_regular(p, f"shard {number}'s {p.suffix} file")
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
            os.fsync(out)
    return size, digest.hexdigest()


def is_staged(unit: ShardFiles) -> bool:
    """Every file of the staged copy has the source's size and the expected checksum, inside the staged pack.

    A shard folder that is a link (to files elsewhere) is no staged copy, however its files hash.
    """
    if unit.directory and unit.dest_root.is_symlink():
        return False
    try:
        for src, dst, _, primary in unit.files:
            if not _is_regular(dst) or dst.stat().st_size != src.lstat().st_size:
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


# --------------------------------------------------------------------------- helpers


def dir_bytes(path: Path) -> int:
    if _is_regular(path):
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if _is_regular(p))


def same_tree(src: Path, dst: Path, digests: dict[str, str]) -> bool:
    """``dst`` holds the same sample index files as ``src``, each with its SHA-256 in ``digests`` where it has one.

    Only the index's own files count. ``digests`` is the manifest's
    ``index.sha256``: a copy of a damaged index is never kept as current.
    """
    if dst.is_symlink() or not dst.is_dir():
        return False
    for name in INDEX_FILES:
        mine, other = src / name, dst / name
        if not os.path.lexists(mine):
            continue
        if not _is_regular(other) or other.lstat().st_size != mine.lstat().st_size:
            return False
        copied = sha256_of(other)
        if copied != sha256_of(mine) or copied != digests.get(name, copied):
            return False
    return True


def index_folder(source: Path, manifest: Manifest) -> Path:
    """The source pack's sample index folder, which stage copies: a folder of the pack's own, not a link.

    Each index file a pack of its kind holds must be there as a regular file.

    Raises:
        PackFormatError: it is missing, or is a symlink or not a folder; or one
            of its index files is missing or not a regular file (named).
    """
    folder = source / manifest.index_dir
    try:
        mode = folder.lstat().st_mode
    except FileNotFoundError:
        raise PackFormatError(
            "the sample index folder is missing", path=folder, hint="Convert the pack again"
        ) from None
    if not stat.S_ISDIR(mode):
        raise PackFormatError(
            f"the sample index folder is not a folder of the pack (it is {file_kind(mode)})",
            path=folder,
            hint="packdata copies only a pack's own regular files: replace it by the real folder or convert again",
        )
    for file in index_files(manifest.kind):
        _require_regular(folder / file, f"sample index file {file}")
    return folder


def copy_index(source: Path, dest: Path, manifest: Manifest) -> None:
    """Copy the sample index (and small extras) unless the destination already holds the same files.

    Only the index's own files are copied, each as a regular file (see
    :func:`copy_regular`); anything else in the source's index folder is left.
    Each copy must match its SHA-256 in the manifest (``index.sha256``), which
    the staged manifest keeps: the staged index is the one the pack was written with.
    The old index is moved aside (:func:`~packdata.pack.files.aside_path`) and
    deleted; call it holding ``dest``'s lock.

    Raises:
        PackFormatError: an index file of the source is damaged (its copy does
            not match the manifest) or is not a regular file, or the index folder
            is not a folder of the pack (:func:`index_folder`).
    """
    name = manifest.index_dir
    src = index_folder(source, manifest)
    digests = manifest.index_sha256
    if not same_tree(src, dest / name, digests):
        temp = dest / f".{name}{PARTIAL}"
        shutil.rmtree(temp, ignore_errors=True)
        try:
            temp.mkdir()
            for file in INDEX_FILES:
                if file in digests or os.path.lexists(src / file):
                    _, digest = copy_regular(src / file, temp / file)
                    if digest != digests.get(file, digest):
                        hint = "The source pack is damaged: run `packdata verify` on it and convert it again"
                        raise damaged_index_file(src / file, hint=hint)
        except BaseException:  # a damaged file, a full disk: no partial index is left
            shutil.rmtree(temp, ignore_errors=True)
            raise
        discard_stale(dest / name, "old")  # what a run killed between the renames below left
        old = aside_path(dest / name)  # never onto a leftover that could not be removed
        try:
            if os.path.lexists(dest / name):
                os.rename(dest / name, old)
            os.rename(temp, dest / name)
        except OSError:  # a file system that refuses the rename: the old index stays, no copy is left over
            shutil.rmtree(temp, ignore_errors=True)
            raise
        with contextlib.suppress(OSError):  # one that cannot be removed costs disk; the next stage sweeps it
            discard_partial(old)
    for extra in EXTRA_FILES:
        if os.path.lexists(source / extra):
            tmp = dest / f".{extra}{PARTIAL}"
            tmp.unlink(missing_ok=True)
            copy_regular(source / extra, tmp)
            os.replace(tmp, dest / extra)


def old_shards(dest: Path, marker: dict[str, Any], units: list[ShardFiles], manifest: Manifest) -> list[Path]:
    """The files and folders in ``dest`` of shards its ``marker`` names (staged or left) that ``units`` no longer has.

    What a source converted again into other shards leaves of its old ones, each
    with its side tables: only plain names directly in ``dest`` (not hidden) that
    are no file of the pack being staged. Remove them with
    :func:`~packdata.pack.files.discard_partial` (a link itself, never followed),
    holding ``dest``'s lock.
    """
    try:
        layout_of = get_format(marker["format"]).shard_layout
    except PackdataError:  # a format this packdata does not know: nothing is taken for its shards
        return []
    current = {u.name for u in units} | {dst.name for u in units for _, dst, _, _ in u.files}
    current |= {MANIFEST_NAME, manifest.index_dir, *EXTRA_FILES, STAGED_FILE}
    found = []
    for name in [*marker["staged"], *marker["left"]]:
        plain = isinstance(name, str) and name[:1] not in ("", ".") and "/" not in name and "\0" not in name
        if not plain or name in current:
            continue
        layout = layout_of(name)
        paths = [dest / name] if layout.folder else [dest / name, *layout.side_paths(dest / name)]
        found += [p for p in paths if p.name not in current and os.path.lexists(p)]
    return found


def remove_leftovers(dest: Path) -> None:
    """Delete ``.partial`` files and folders an interrupted run left."""
    for entry in dest.iterdir():
        if entry.name.startswith(".") and entry.name.endswith(PARTIAL):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


@contextlib.contextmanager
def locked(
    dest: Path, what: str = "packdata stage", made: Sequence[Path] = (), wait_seconds: float = 0
) -> Iterator[None]:
    """Hold ``dest``'s locks (see :mod:`packdata.pack.lock`), making ``dest`` once the first is held.

    Another process holding one is waited for, at most ``wait_seconds`` for each (0: not at all).

    ``.NAME.lock`` beside ``dest`` is the one a stage from a URL into the same
    folder holds (it replaces the whole folder, so its lock lives outside it);
    ``.stage.lock`` inside is the one any other path to ``dest`` (a symlink) shares.
    A run refused by the first lock creates nothing; one refused by the second
    found ``dest`` already there. A block that raises removes ``dest`` if this
    made it and it is left empty, then the folders above it in ``made`` (those
    the caller made for it, deepest first) while each is empty: never a folder
    that was there before.

    Raises:
        LockedError: another process holds either lock, still after ``wait_seconds`` (it is named).
    """
    try:
        with wait_for_lock(convert_lock_path(dest), what=what, target=dest, timeout=wait_seconds):
            created = not os.path.lexists(dest)
            dest.mkdir(exist_ok=True)
            try:
                with wait_for_lock(dest / LOCK, what=what, target=dest, timeout=wait_seconds):
                    yield
            except BaseException:
                if created:
                    remove_empty([dest])
                raise
    except BaseException:
        if not os.path.lexists(dest):  # after .NAME.lock is gone from the folder above
            remove_empty(made)
        raise


def missing_folders(folder: Path) -> list[Path]:
    """``folder`` and the folders above it that do not exist yet, deepest first: what making ``folder`` creates."""
    return [p for p in (folder, *folder.parents) if not os.path.lexists(p)]


@contextlib.contextmanager
def removed_if_refused(made: Sequence[Path]) -> Iterator[None]:
    """If the block raises, remove the folders of ``made`` (deepest first) that it left empty; never another."""
    try:
        yield
    except BaseException:
        remove_empty(made)
        raise


def remove_empty(folders: Sequence[Path]) -> None:
    """Remove ``folders`` (deepest first) that are empty folders, stopping at the first that is not."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # not empty (something was written there), or gone: the ones above hold it
            return


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON atomically (a kill leaves a ``.partial`` temporary, which stage cleans up).

    Raises:
        CapacityError: the disk is full; ConfigError: it cannot be written otherwise (both name ``path``).
    """
    try:
        atomic_write(path, (json.dumps(data, indent=1, ensure_ascii=False) + "\n").encode("utf-8"), tmp_suffix=PARTIAL)
    except OSError as exc:
        if exc.errno in FULL_DISK_ERRNOS:
            raise no_space_error(exc, path, staged=path.parent) from exc
        raise destination_error(exc, path) from exc


def staged_manifest(manifest: Manifest, source: Path, units: list[ShardFiles], staged: set[int]) -> Manifest:
    """The staged pack's manifest: staged shards by name, the others at their origin (absolute paths).

    ``staged_from`` marks it as staged: only such a manifest may name shards
    outside its pack, and :func:`packdata.pack.manifest.read_manifest` checks each
    against its origin pack's manifest.
    """
    shards = [
        dataclasses.replace(u.info, file=u.name if u.number in staged else os.fspath(u.info.path(source)))
        for u in units
    ]
    return dataclasses.replace(manifest, shards=shards, staged_from=os.fspath(source))


def resolve_order(manifest: Manifest, shards: Sequence[int | str] | None) -> list[int]:
    n = len(manifest.shards)
    if shards is None:
        return list(range(n))
    names = {Path(s.file).name: i for i, s in enumerate(manifest.shards)}
    hint = f"The pack's shards are {', '.join(list(names)[:3])}{', ...' if n > 3 else ''}"
    if not shards:
        raise ConfigError("shards should name at least one shard, but got none", hint=hint)
    order: list[int] = []
    for item in shards:
        digits = isinstance(item, str) and item.strip().isascii() and item.strip().isdigit()  # not '²'
        if isinstance(item, int) or digits:
            number = int(item) if isinstance(item, int) or len(item.strip()) <= 18 else n  # 5,000 digits: out of range
            if not 0 <= number < n:
                raise ConfigError(
                    f"shards should be numbers from 0 to {n - 1} or shard names, but got {item!r}", hint=hint
                )
        elif item in names:
            number = names[item]
        else:
            raise ConfigError(f"shards should be numbers from 0 to {n - 1} or shard names, but got {item!r}", hint=hint)
        if number not in order:
            order.append(number)
    return order


def copy_all(units: list[ShardFiles], total: int, workers: int | None, progress: bool) -> None:
    if not units:
        return
    stop = threading.Event()
    bar = show_progress(
        total=total, unit="B", desc=f"stage {len(units)} shard{'s' * (len(units) != 1)}", disable=progress is False
    )
    pool = ThreadPoolExecutor(max_workers=workers or min(4, len(units)), thread_name_prefix="packdata-stage")
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


# --------------------------------------------------------------------------- status and unstage
