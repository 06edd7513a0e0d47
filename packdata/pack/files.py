"""The one way packdata writes a small file that must never be seen half-written, and hashes a file."""

from __future__ import annotations

import hashlib
import os
from io import BufferedReader
from pathlib import Path

__all__ = ["atomic_write", "file_sha256", "fsync_dir", "stream_sha256"]


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new entry in the folder ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, data: bytes, *, tmp_suffix: str = ".tmp") -> None:
    """Write ``data`` to ``path``: a hidden temporary file beside it, fsync, rename, fsync of the folder.

    A crash at any instant leaves either the old file or the new one, never a
    mix; the temporary file (``.NAME<tmp_suffix>``) is removed on error.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}{tmp_suffix}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def stream_sha256(f: BufferedReader) -> str:
    """SHA-256 hex digest of an open binary file, read in large blocks."""
    return hashlib.file_digest(f, "sha256").hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 hex digest of the file at ``path``."""
    with open(path, "rb") as f:
        return stream_sha256(f)
