"""How packdata writes a small file that must never be seen half-written, hashes a file, and removes a leftover."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import re
import shutil
import stat
import tempfile
from io import BufferedReader
from pathlib import Path

import numpy as np

from packdata.errors import (
    ConfigError,
    PackFormatError,
    SourceError,
    out_of_files_error,
    out_of_maps,
    out_of_maps_error,
    too_many_open_files,
)
from packdata.host.disks import FULL_DISK_ERRNOS, no_space_error

__all__ = [
    "PROGRESS_FILE",
    "RAY_PLAN_FILE",
    "aside_path",
    "atomic_write",
    "discard_partial",
    "discard_stale",
    "stale_siblings",
    "file_sha256",
    "file_stamp",
    "sha256_prefix",
    "file_kind",
    "fsync_dir",
    "fsync_named",
    "holds_conversion",
    "is_inside",
    "map_int64",
    "not_a_file",
    "open_pack_file",
    "open_regular",
    "private_folder",
    "private_temp_folder",
    "read_bounded",
    "read_regular",
    "source_mode",
    "check_visible",
    "stream_sha256",
    "temporary_owner",
]


PROGRESS_FILE = "progress.json"
"""The local engine's checkpoint in a conversion's partial folder (its presence says which engine was interrupted)."""

RAY_PLAN_FILE = "ray-plan.json"
"""The Ray engine's plan in a conversion's partial folder."""


def is_inside(path: str | os.PathLike, folder: str | os.PathLike) -> bool:
    """Whether ``path`` lies strictly inside ``folder``, links resolved (a path yet to be made, too)."""
    real_path, real_folder = os.path.realpath(path), os.path.realpath(folder)
    return real_path.startswith(real_folder.rstrip(os.sep) + os.sep)


def file_stamp(path: str | os.PathLike) -> list[int] | None:
    """``[size, inode, mtime_ns, ctime_ns]`` of the regular file ``path`` (a link is not followed): a write since
    changes it (the change time, which no call sets back); None when it is not a regular file.

    Raises:
        OSError: ``path`` cannot be looked up (missing).
    """
    info = os.lstat(path)
    return [info.st_size, info.st_ino, info.st_mtime_ns, info.st_ctime_ns] if stat.S_ISREG(info.st_mode) else None


def holds_conversion(folder: Path) -> bool:
    """Whether ``folder`` is an interrupted conversion's partial folder (it holds a checkpoint or a Ray plan).

    A ``.NAME.partial`` is also the name of a stage's download from a URL, which holds neither.
    """
    return any(os.path.lexists(folder / name) for name in (PROGRESS_FILE, RAY_PLAN_FILE))


_FSYNC_HINT = (
    "What was written there is not known to be on the disk: check that disk (a failing device, or a full volume "
    "beneath it: a thin, loop or network volume), or write to a local file system that supports fsync, "
    "then run again"
)


def fsync_named(fd: int, path: str | os.PathLike, *, full_disk_as_oserror: bool = False) -> None:
    """``os.fsync(fd)`` of the open file or folder ``path``; its file system's refusal is named.

    Args:
        full_disk_as_oserror: for a caller that names a full disk in its own words (a stage's):
            a full disk or quota raises the ``OSError`` again, with ``path`` as its file name.

    Raises:
        CapacityError: a full disk or quota (of the volume beneath it too: the mount is named).
        ConfigError: any other refusal (``EIO`` from a failing device, ``EINVAL`` where the file
            system does not support fsync, as some FUSE and special file systems).
    """
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno in FULL_DISK_ERRNOS and full_disk_as_oserror:
            raise OSError(exc.errno, exc.strerror, os.fspath(path)) from exc
        if exc.errno in FULL_DISK_ERRNOS:
            path = Path(path)
            raise no_space_error(exc, path, folder=path.parent, of="(flushing it to disk)", hint=_FSYNC_HINT) from exc
        raise ConfigError(
            f"its file system refused to flush it to disk (fsync: {exc.strerror or exc})", path=path, hint=_FSYNC_HINT
        ) from exc


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new entry in the folder ``path`` durable (a refusal: see :func:`fsync_named`)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fsync_named(fd, path)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, data: bytes, *, tmp_suffix: str = ".tmp") -> None:
    """Write ``data`` to ``path``: a hidden temporary file beside it, fsync, rename, fsync of the folder.

    A crash at any instant leaves either the old file or the new one, never a
    mix; the temporary file (``.NAME<tmp_suffix>``) is removed on error. A
    leftover temporary is unlinked and a new one created exclusively, so a
    symlink planted under its name is never followed.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}{tmp_suffix}")
    tmp.unlink(missing_ok=True)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            fsync_named(f.fileno(), tmp)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.filename is None:  # a write's refusal names no file: the temporary one
            raise OSError(exc.errno, exc.strerror, os.fspath(tmp)) from exc
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


_HASH_BLOCK = 4 << 20


def stream_sha256(f: BufferedReader) -> str:
    """SHA-256 hex digest of an open binary file, read in blocks of 4 MiB.

    Each read and each hash update lets go of the GIL and must take it back,
    waiting behind any busy Python thread: in ``hashlib.file_digest``'s 256 KiB
    blocks, a 64 MiB shard took 2.8 s to hash beside one busy thread (51 ms
    alone); in 4 MiB blocks, 0.23 s (54 ms alone). Blocks much larger spill
    out of the CPU's caches between the read and the hash.
    """
    digest = hashlib.sha256()
    block = memoryview(bytearray(_HASH_BLOCK))
    while size := f.readinto(block):
        digest.update(block[:size])
    return digest.hexdigest()


def file_kind(mode: int) -> str:
    """What a file of this ``st_mode`` is, in words: "a regular file", "a FIFO", "a folder", "a symlink", ..."""
    for test, name in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "a special file"


def not_a_file(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a regular file, in words to follow its name, or None when it is one (links followed).

    "is missing", "is a broken link", "is not a regular file (mode prw-r--r--, a FIFO)": a
    FIFO or a folder standing where a pack file should be is named as such, not reported missing.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "is a broken link" if os.path.islink(path) else "is missing"
    except OSError as exc:
        return f"cannot be looked at ({exc.strerror or exc})"
    return None if stat.S_ISREG(mode) else f"is not a regular file (mode {stat.filemode(mode)}, {file_kind(mode)})"


def source_mode(path: str | os.PathLike) -> int | None:
    """The ``st_mode`` of a source to read (links followed), or None when nothing is there.

    Raises:
        SourceError: a folder above ``path`` may not be searched by this user (mode 700, another's), named
            in one line where ``Path.exists`` and ``Path.is_file`` would raise ``PermissionError``.
    """
    try:
        return os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise SourceError(
            f"cannot be looked at ({exc.strerror or exc})",
            path=path,
            hint="Check the permissions of the folders above it: each needs search (x) permission for this user",
        ) from exc


def check_visible(path: str | os.PathLike, *, what: str, hint: str) -> None:
    """Refuse a path to write that cannot be looked at (a folder above it this user may not search); missing passes.

    Args:
        path: the destination (a pack, a staged pack, an export's folder), which need not exist yet.
        what: what it is, opening the message (``the destination``).
        hint: what to do, naming keyword arguments.

    Raises:
        ConfigError: ``path``: ``WHAT cannot be looked at (Permission denied)``, where ``Path.exists`` and
            ``Path.is_symlink`` would raise ``PermissionError`` with a traceback.
    """
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        pass  # a new destination
    except OSError as exc:
        raise ConfigError(f"{what} cannot be looked at ({exc.strerror or exc})", path=path, hint=hint) from exc


def sha256_prefix(sha256_hex: str) -> int:
    """The first 8 bytes of a hex SHA-256 as a little-endian int64, binding a side table to its file (0: none)."""
    if len(sha256_hex) < 16:
        return 0
    try:
        return int.from_bytes(bytes.fromhex(sha256_hex[:16]), "little", signed=True)
    except ValueError:
        return 0


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 hex digest of the regular file at ``path`` (a FIFO is refused, never read).

    Raises:
        OSError: it cannot be opened, or is not a regular file (``EINVAL``).
    """
    with os.fdopen(open_regular(path), "rb") as f:
        return stream_sha256(f)


def open_regular(path: str | os.PathLike, *, follow_symlinks: bool = True) -> int:
    """A read-only descriptor of ``path``, only if it is a regular file.

    A device node, FIFO or socket in its place is refused before it is opened
    (opening a device can act on it: a tape rewinds); ``O_NONBLOCK`` keeps a
    FIFO swapped in after that check from blocking the open forever, and the
    type is checked again on the opened descriptor, so a swap cannot slip
    through. ``follow_symlinks=False`` refuses a symlink (``ELOOP``).

    Raises:
        OSError: it cannot be opened, or is not a regular file (``EINVAL``, the
            message says what it is).
    """
    try:
        mode = os.stat(path, follow_symlinks=follow_symlinks).st_mode
    except OSError:
        mode = stat.S_IFREG  # missing or unreadable: the open says so
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        raise _not_regular(path, mode)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _not_regular(path, mode)
    os.set_blocking(fd, True)
    return fd


def _not_regular(path: str | os.PathLike, mode: int) -> OSError:
    return OSError(errno.EINVAL, f"not a regular file: {file_kind(mode)}", os.fspath(path))


def open_pack_file(path: str | os.PathLike, *, shown: str | os.PathLike | None = None) -> int:
    """A read-only descriptor of a pack's own file ``path``: a regular file, not a symlink (never followed).

    For files a pack names by a fixed name (the skip report, a side table):
    a link could lead anywhere outside the pack, a FIFO would block a read.

    Args:
        path: the file.
        shown: its name in messages (default ``path``; a URL for a downloaded copy).

    Raises:
        FileNotFoundError: there is nothing at ``path`` (the caller says what that means).
        PackFormatError: a symlink, FIFO, folder or device is there, or it cannot be opened.
    """
    try:
        return open_regular(path, follow_symlinks=False)
    except FileNotFoundError:
        raise
    except OSError as exc:
        problem = {
            errno.ELOOP: "is a symlink, not a regular file of the pack",
            errno.EINVAL: f"is {exc.strerror}",  # names what it is: "not a regular file: a FIFO"
        }.get(exc.errno or 0, f"cannot be opened: {exc.strerror}")
        hint = "A pack's files are its own regular files: convert or stage the pack again"
        raise PackFormatError(problem, path=shown if shown is not None else path, hint=hint) from exc


def read_regular(
    path: str | os.PathLike,
    most: int | None = None,
    *,
    follow_symlinks: bool = True,
    too_long: Exception | None = None,
) -> bytes:
    """The bytes of the regular file at ``path`` (a FIFO, device or folder raises ``OSError``, never blocks).

    With ``most``, a longer file is never read whole: one whose size is over it is refused unread, one that grows
    past it while read is read no further than ``most + 1`` bytes; either raises ``too_long`` (the caller's words;
    default: ``OSError`` ``EFBIG`` naming ``path``). ``follow_symlinks=False`` refuses a symlink (``ELOOP``): a
    pack's side file that could lead out of the pack.
    """
    with os.fdopen(open_regular(path, follow_symlinks=follow_symlinks), "rb") as f:
        data = read_bounded(f, most)
    if data is None:
        if too_long is not None:
            raise too_long
        raise OSError(errno.EFBIG, f"it holds more than the {most} bytes it may hold", os.fspath(path))
    return data


def read_bounded(f: BufferedReader, most: int | None) -> bytes | None:
    """All of the open regular file ``f``, or None when it holds more than ``most`` bytes: by its size, unread, or
    (growing while read) read no further than ``most + 1`` bytes: :func:`read_regular`'s and
    :func:`~packdata.pack.own_files.read_own_bytes`'s read."""
    if most is None:
        return f.read()
    if os.fstat(f.fileno()).st_size > most:
        return None
    data = f.read(most + 1)
    return None if len(data) > most else data


def map_int64(path: str | os.PathLike, *, follow_symlinks: bool = True) -> np.ndarray | None:
    """A read-only memory map of the regular file at ``path`` as little-endian int64s (a side table).

    Every process mapping it shares the page cache's copy. None when it is
    missing, not a regular file (never blocks on a FIFO), empty, not a
    whole number of int64s, or (``follow_symlinks=False``) a symlink.

    Raises:
        CapacityError: out of file descriptors (a table is not absent for that).
    """
    try:
        fd = open_regular(path, follow_symlinks=follow_symlinks)
    except OSError as exc:
        if too_many_open_files(exc):
            raise out_of_files_error(path) from exc
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0 or size % 8:
            return None
        return np.frombuffer(mmap.mmap(fd, size, access=mmap.ACCESS_READ), dtype="<i8")
    except (OSError, ValueError) as exc:
        if too_many_open_files(exc):
            raise out_of_files_error(path) from exc
        if out_of_maps(exc):  # not absent: the process may map no more
            raise out_of_maps_error(path) from exc
        return None
    finally:
        os.close(fd)


def discard_partial(partial: Path) -> None:
    """Remove what stands at ``partial``: the folder an interrupted run left, or only the link or file itself."""
    if partial.is_dir() and not partial.is_symlink():
        shutil.rmtree(partial)
    elif os.path.lexists(partial):
        partial.unlink()


def stale_siblings(dest: Path, *kinds: str) -> list[Path]:
    """The ``.NAME.KIND-PID`` (or ``-PID-N``) siblings of ``dest`` that runs left (``kinds``: ``"partial"``, ``"old"``).

    Only names matching exactly that pattern; none when ``dest``'s folder is missing.
    """
    stale = re.compile(rf"\.{re.escape(dest.name)}\.(?:{'|'.join(map(re.escape, kinds))})-[0-9]+(?:-[0-9]+)?")
    if not dest.parent.is_dir():
        return []
    return [Path(entry.path) for entry in os.scandir(dest.parent) if stale.fullmatch(entry.name)]


def aside_path(dest: Path) -> Path:
    """Where to move ``dest`` aside before deleting it: ``.NAME.old-PID``, or ``-PID-N`` when that is taken.

    A leftover at ``.NAME.old-PID`` (a killed process whose pid this one
    reuses) is passed over, never renamed onto; :func:`discard_stale` removes
    it later. Call it holding ``dest``'s lock.
    """
    aside = dest.with_name(f".{dest.name}.old-{os.getpid()}")
    counter = 0
    while os.path.lexists(aside):
        counter += 1
        aside = dest.with_name(f".{dest.name}.old-{os.getpid()}-{counter}")
    return aside


_TEMPORARY = {"old": r"old-[0-9]+(?:-[0-9]+)?", "partial": "partial", "evicted": "evicted"}  # .NAME.KIND


def temporary_owner(entry: Path, *kinds: str) -> Path | None:
    """``NAME`` beside ``entry`` when ``entry`` is its temporary of one of ``kinds``, else None.

    ``"old"``: ``.NAME.old-PID`` or ``-PID-N``, a copy moved aside before its
    deletion (:func:`aside_path`); ``"partial"``: ``.NAME.partial``, a stage's
    download; ``"evicted"``: ``.NAME.evicted``, the mark a cache limit's eviction of NAME left
    (:func:`~packdata.pack.manifest.evicted_mark`). NAME is a plain name, whatever characters it holds (a newline
    too): ``...partial`` or ``....old-1`` stand for no folder beside them
    (``.``, ``..``) and give None.
    """
    match = re.fullmatch(rf"\.(.+)\.(?:{'|'.join(_TEMPORARY[kind] for kind in kinds)})", entry.name, re.DOTALL)
    if match is None or match.group(1) in (".", ".."):
        return None
    return entry.with_name(match.group(1))


def discard_stale(dest: Path, *kinds: str) -> None:
    """Remove the :func:`stale_siblings` of ``dest`` that killed runs left.

    Call it holding ``dest``'s lock, under which no live process writes one.
    A symlink is unlinked, never followed; one that cannot be removed costs disk, never the caller.
    """
    for entry in stale_siblings(dest, *kinds):
        with contextlib.suppress(OSError):
            discard_partial(entry)


def private_temp_folder(name: str, *, hint: str) -> Path:
    """``NAME-UID`` in the system's temporary folder, which only this user may write; made (mode 0700) when missing.

    The temporary folder is shared: a folder another user made there first, or a
    link, would let them change what packdata keeps in it or have packdata write
    where they chose.

    Raises:
        ConfigError: it is a link or not a folder, another user's, or others may write in it
            (``hint`` says where else to keep the files).
    """
    return private_folder(Path(tempfile.gettempdir()) / f"{name}-{os.getuid()}", hint=hint)


def private_folder(folder: Path, *, hint: str) -> Path:
    """``folder``, made (mode 0700, its parents as usual) when missing, only if it is this user's and no one
    else may write in it (see :func:`private_temp_folder`); raises as it does."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode):
        problem = f"is {file_kind(info.st_mode)}, not a folder"
    elif info.st_uid != os.getuid():
        problem = "is another user's folder"
    elif info.st_mode & 0o022:
        problem = "is a folder others may write in"
    else:
        return folder
    raise ConfigError(f"{problem}: packdata keeps no files there (others could change them)", path=folder, hint=hint)
