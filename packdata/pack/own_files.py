"""Files packdata keeps for itself in a work folder (journals, job records): this user's regular files, appended to
and read never through a link, and read no further than packdata writes there."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from packdata.errors import ConfigError
from packdata.pack.files import file_kind, fsync_named, read_bounded

__all__ = ["append_own_file", "read_own_bytes", "read_own_file"]


def append_own_file(path: Path, text: str, *, hint: str, sync: bool = False) -> None:
    """Append ``text`` to ``path`` (made, mode 0600, when missing): a regular file of this user's, never a link's
    target (``O_NOFOLLOW``), so a link planted where packdata keeps a journal never has it write elsewhere.

    Raises:
        ConfigError: a link, FIFO or folder is there, or another user's file (``hint`` says what to do).
    """
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    with os.fdopen(_open_own(path, flags, hint), "a", encoding="utf-8") as f:
        f.write(text)
        if sync:
            f.flush()
            fsync_named(f.fileno(), path)


def read_own_file(path: Path, *, hint: str, most: int | None = None, over_hint: str = "") -> str | None:
    """The text of ``path`` (None when there is nothing there), a regular file of this user's, never through a
    link; raises as :func:`append_own_file`, and as :func:`read_own_bytes` over ``most`` bytes."""
    data = read_own_bytes(path, hint=hint, most=most, over_hint=over_hint)
    return None if data is None else data.decode("utf-8", errors="replace")


def read_own_bytes(path: Path, *, hint: str, most: int | None = None, over_hint: str = "") -> bytes | None:
    """The bytes of ``path`` (None when there is nothing there), as :func:`read_own_file` reads it.

    Raises:
        ConfigError: as :func:`append_own_file`; or it holds more than ``most`` bytes, more than packdata
            writes there (refused by its size unread, or read no further; ``over_hint`` says what to do).
    """
    try:
        fd = _open_own(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, hint)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        data = read_bounded(f, most)
    if data is None:
        problem = f"holds more than the {most} bytes packdata writes there at most: it is not packdata's file"
        raise ConfigError(problem, path=path, hint=over_hint or hint)
    return data


def _open_own(path: Path, flags: int, hint: str) -> int:
    """``os.open(path, flags, 0o600)``, kept only if it is this user's regular file; ConfigError if not."""
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise  # missing (a reader says what that means), or a disk's failure
        mode = os.lstat(path).st_mode
        raise ConfigError(_not_own(f"is {file_kind(mode)}, not a regular file"), path=path, hint=hint) from exc
    info = os.fstat(fd)
    if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid():
        os.set_blocking(fd, True)
        return fd
    os.close(fd)
    problem = f"is {file_kind(info.st_mode)}, not a regular file" if not stat.S_ISREG(info.st_mode) else ""
    raise ConfigError(_not_own(problem or "is another user's file"), path=path, hint=hint)


def _not_own(problem: str) -> str:
    return f"{problem}: packdata never reads or writes its own files through it (another user may have put it there)"
