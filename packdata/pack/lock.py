"""One writer at a time: an ``flock`` on a small lock file that names its holder.

``convert`` holds ``.NAME.lock`` beside its destination (from before the
partial folder is touched until after the publish rename); ``stage`` from a
URL holds the same ``.NAME.lock`` beside its copy, and a local ``stage`` and
``unstage`` hold it too, then ``.stage.lock`` inside the staged pack. The
kernel drops an ``flock`` when its process dies, however it dies, so a lock
file left by a killed run is simply taken over by the next one: staleness is
never guessed from age. The holder writes its pid, host, command and start
time into the file so a refused run can say who holds it. A clean release
unlinks the file (while still holding it); a run that locked a file just
unlinked by its previous holder notices (the path no longer names its inode)
and starts over.
Lock files are opened with ``O_NOFOLLOW`` and checked before anything is
written: a symlink, hard link, non-regular file, or a file whose content is not
a packdata lock record is refused, never truncated or removed.

Readers of a staged copy hold a shared ``flock`` on its ``.readers.lock``
(:func:`hold_readers_lock`), from the moment a dataset opens the pack for as
long as it lives; eviction, unstage and a stage replacing an older copy take it
exclusively without waiting (:func:`exclude_readers`) and leave the copy when
they cannot. It is never the writers' ``.NAME.lock``, so readers never block a stage.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from packdata.errors import ConfigError, LockedError, PackFormatError
from packdata.host.disks import FULL_DISK_ERRNOS, RERUN_HINT, no_space_error
from packdata.pack.files import file_kind, open_regular

__all__ = [
    "READERS_LOCK",
    "convert_lock_path",
    "copy_evicted",
    "create_readers_lock",
    "exclude_readers",
    "hold_lock",
    "hold_readers_lock",
    "wait_for_lock",
]

READERS_LOCK = ".readers.lock"
"""In a staged copy: the file its readers hold shared, and whoever deletes the copy exclusively."""


_WAIT_POLL = 0.05  # seconds between tries for a lock another process holds


def convert_lock_path(dst: str | os.PathLike) -> Path:
    """The lock file of a conversion into ``dst``: ``.NAME.lock`` beside it, never inside the pack."""
    dst = Path(dst)
    return dst.parent / f".{dst.name}.lock"


def _holder(fd: int) -> str:
    """Who holds the lock on ``fd``, from what the holder wrote into the file."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
        return (
            f"pid {int(info['pid'])} on host {info['host']} "
            f"({info['command']}, since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(info['since']))})"
        )
    except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError):  # its record: any bytes
        return "another process (it has not written its name yet)"


_FIELDS = {"pid", "host", "command", "since"}


def _foreign(fd: int) -> str | None:
    """Why the file open on ``fd`` is not a packdata lock file, or None when it is one (or empty)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_nlink > 1:
        return f"it has {st.st_nlink} hard links"
    if st.st_size == 0:
        return None
    if st.st_size > 4096:
        return f"it holds {st.st_size} bytes, not a lock record"
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
    except (ValueError, RecursionError):  # not UTF-8, not JSON, nested past Python's stack
        return "its content is not a packdata lock record"
    if not isinstance(info, dict) or set(info) != _FIELDS:
        return "its content is not a packdata lock record"
    return None


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _owned_by(folder: Path) -> str:
    """`` (uid N's)`` for a folder's owner, or nothing when it cannot be looked at."""
    try:
        return f" (uid {os.stat(folder).st_uid}'s)"
    except OSError:
        return ""


@contextlib.contextmanager
def hold_lock(path: str | os.PathLike, *, what: str, target: str | os.PathLike) -> Iterator[Path]:
    """Hold the lock file ``path`` for the duration of the block, or fail at once.

    Args:
        path: the lock file (created when missing; its folder must exist).
        what: the holder's command, for the refusal of others (``"packdata convert"``).
        target: what the lock protects (the destination), named in the refusal.

    Raises:
        LockedError: another live process holds it; the message names its pid and host.
        ConfigError: the lock file cannot be created (no permission), or a file
            that is not packdata's lock is in its place (a symlink, a hard link,
            other content): it is left untouched.
    """
    path = Path(path)
    while True:
        try:
            mode, exists = os.lstat(path).st_mode, True
        except OSError:
            mode, exists = stat.S_IFREG, False  # missing (created below), or the open says why not
        try:
            if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):  # a device is never opened: that can act on it
                raise OSError(errno.EINVAL, f"{file_kind(mode)} is in its place", os.fspath(path))
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as exc:
            if exc.errno in FULL_DISK_ERRNOS:  # named as any full disk packdata writes to
                of = f"(the lock file of {what})"
                raise no_space_error(exc, path, folder=path.parent, of=of, hint=RERUN_HINT) from exc
            reason = "a symlink is in its place" if exc.errno == errno.ELOOP else (exc.strerror or str(exc))
            in_place = exists or exc.errno == errno.ELOOP  # a file stands there, else the folder refuses a new one
            hint = "Choose a destination on a writable file system"
            if in_place:
                hint = "Remove it if it is not packdata's, or choose another destination"
            elif exc.errno in (errno.EACCES, errno.EPERM):  # this user's rights in the folder, not the file system
                hint = (
                    f"{path.parent} is not this user's to write{_owned_by(path.parent)}: "
                    "run it as its owner, or choose a folder this user may write"
                )
            raise ConfigError(f"cannot create the lock file: {reason}", path=path, hint=hint) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise LockedError(
                f"{holder} is writing it (lock file {path})",
                path=target,
                hint="Wait for it to finish, or stop that process; a lock left by a dead process is taken over",
            ) from None
        except BaseException:
            os.close(fd)
            raise
        problem = _foreign(fd)
        if problem is not None:
            os.close(fd)
            raise ConfigError(
                f"a file is in the way of the lock file: {problem}",
                path=path,
                hint="Move it away if it is not packdata's, or choose another destination",
            )
        if _same_file(fd, path):
            break
        os.close(fd)  # the previous holder unlinked it as we opened it: lock the new one
    try:
        info = {"pid": os.getpid(), "host": socket.gethostname(), "command": what, "since": time.time()}
        os.ftruncate(fd, 0)
        try:
            os.pwrite(fd, json.dumps(info).encode("utf-8"), 0)
        except OSError as exc:  # a full disk: the flock holds all the same; others then read no name
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
        yield path
    except BaseException:
        _release(fd, path, failing=True)
        raise
    _release(fd, path, failing=False)


def _release(fd: int, path: Path, *, failing: bool) -> None:
    """Unlink the lock file ``path`` held on ``fd`` (if it is still that file), then close ``fd``.

    Where it cannot be removed (its volume turned read-only), the error already
    propagating (``failing``) is kept, never replaced by that one; else the lock
    file is named: the run's own work is done, and the next run takes it over.
    """
    try:
        if _same_file(fd, path):  # never unlink a lock file that someone else created since
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if not failing:
            raise ConfigError(
                f"cannot remove the lock file: {exc.strerror or exc}",
                path=path,
                hint="The work under it is done, and the next run takes over a lock file left behind; "
                "remove it once its file system is writable again",
            ) from exc
    finally:
        os.close(fd)


@contextlib.contextmanager
def wait_for_lock(
    path: str | os.PathLike, *, what: str, target: str | os.PathLike, timeout: float | None = None
) -> Iterator[Path]:
    """Hold the lock file ``path`` for the block (see :func:`hold_lock`), waiting while another process holds it.

    The holder is at work, and the kernel drops its lock if it dies. ``timeout``
    bounds the wait in seconds (None: no limit; 0: one try).

    Raises:
        LockedError: another process still held it after ``timeout`` seconds (its pid and host named).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    with contextlib.ExitStack() as stack:
        while True:
            try:
                held = stack.enter_context(hold_lock(path, what=what, target=target))
                break
            except LockedError as exc:
                if deadline is None or time.monotonic() < deadline:
                    time.sleep(_WAIT_POLL)
                elif timeout:
                    raise LockedError(
                        f"{exc.message}, still after waiting {timeout:g} s", path=exc.path, hint=exc.hint
                    ) from None
                else:
                    raise
        yield held


def create_readers_lock(copy: Path) -> None:
    """Create the empty ``.readers.lock`` in ``copy`` (by a stage, holding ``.NAME.lock``), if missing.

    One that cannot be created (a read-only copy) leaves the copy's readers
    unlocked, as before; whatever is already in its place (a FIFO, a device
    node) is left unopened (``O_EXCL``).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    with contextlib.suppress(OSError):
        os.close(os.open(copy / READERS_LOCK, flags, 0o644))


def copy_evicted(copy: str | os.PathLike) -> PackFormatError:
    """The error of a reader whose staged copy is gone."""
    return PackFormatError(
        "the staged copy was evicted from its cache (a stage with a cache limit needed the room) or unstaged",
        path=copy,
        hint="Stage the pack again, then recreate the dataset",
    )


def hold_readers_lock(pack: str | os.PathLike) -> int | None:
    """A descriptor holding a shared ``flock`` on ``pack/.readers.lock``, or None when there is none to hold.

    Waits while an eviction decides (it holds the lock only for that and the
    deletion). Creates nothing: a pack without the file (not a staged copy, or
    one staged before readers' locks) or whose file cannot be opened
    or locked (permissions, a symlink or other file in its place) gives None,
    and is read unprotected as before: eviction then spares it only while a
    process visibly has one of its files open or mapped. Closing the last
    descriptor of the lock (the dataset and every forked copy of it gone)
    releases it.

    Raises:
        PackFormatError: the copy was evicted while this waited (:func:`copy_evicted`).
    """
    path = Path(pack) / READERS_LOCK
    try:
        fd = open_regular(path, follow_symlinks=False)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError:
        os.close(fd)
        return None
    except BaseException:  # interrupted while an eviction held it (Ctrl-C): no descriptor left behind
        os.close(fd)
        raise
    if not _same_file(fd, path):  # moved aside and deleted by the eviction this waited for
        os.close(fd)
        raise copy_evicted(pack)
    return fd


@contextlib.contextmanager
def exclude_readers(copy: Path) -> Iterator[bool]:
    """Hold ``copy/.readers.lock`` exclusively for the block, if no reader holds it; yields whether it may go.

    Yields False, without waiting, while a reader holds it shared, or when a
    lock that is a regular file cannot be opened (another user's copy): kept.
    A copy without a lock file (staged before readers' locks) yields True: its
    readers are only seen through their open files.

    Raises:
        ConfigError: the lock is not a regular file (a symlink, FIFO, folder,
            ...): not one a stage made, and readers never hold it
            (:func:`hold_readers_lock`), so whether the copy is read cannot be
            told and it must be kept.
    """
    path = copy / READERS_LOCK
    try:
        fd = open_regular(path, follow_symlinks=False)  # a FIFO or folder locks, yet no reader ever holds it
    except FileNotFoundError:
        yield True
        return
    except OSError as exc:
        what = _what_is_there(path)
        if what is None:  # a lock this process may not open (another user's copy, no descriptors left): read
            yield False
            return
        raise _not_a_readers_lock(path, what) from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            free = True
        except BlockingIOError:
            free = False
        yield free
    finally:
        os.close(fd)


def _what_is_there(path: Path) -> str | None:
    """What stands at ``path`` when it is not a regular file, in words to follow its name ("is a FIFO"); else None."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else f"is {file_kind(mode)}"


def _not_a_readers_lock(path: Path, problem: str) -> ConfigError:
    """The refusal to delete a staged copy whose ``.readers.lock`` (``path``) is not one readers can hold."""
    return ConfigError(
        f"{problem}, not the readers' lock a stage makes: whether the copy is read cannot be told, so it is kept",
        path=path,
        hint="Remove it if nothing reads the copy, or unstage the copy with force=True",
    )
