"""The packdata error hierarchy: one base class, one subclass per cause.

Every error carries the path it concerns and a hint saying what to do, and its
message leads with the path, in the way of py-lmdb's errors.
"""

from __future__ import annotations

import copy
import errno
import os
from pathlib import Path
from typing import NoReturn

__all__ = [
    "CapacityError",
    "EngineError",
    "ConfigError",
    "DecodeError",
    "ImageFormatError",
    "LockedError",
    "MissingFieldError",
    "PackFormatError",
    "PackdataError",
    "RankMismatchError",
    "SourceError",
    "DAMAGED_PACK_HINT",
    "OUT_OF_FILES_HINT",
    "out_of_files_error",
    "out_of_maps",
    "out_of_maps_error",
    "raise_at_url",
    "sample_error",
    "too_many_open_files",
    "unwritable_error",
]


DAMAGED_PACK_HINT = (
    "Run `packdata verify` on the pack, then convert it again "
    "(a staged copy: stage it again; one staged from a URL: `packdata unstage` it first)"
)
"""What to do about a pack found damaged while it is read (a staged copy's origin may be sound)."""


class PackdataError(Exception):
    """Base class of every error packdata raises on purpose."""

    def __init__(self, message: str, *, path: str | os.PathLike | None = None, hint: str | None = None) -> None:
        self.message, self.path = message, os.fspath(path) if path is not None else None
        self.hint = hint
        super().__init__(self._text())

    def _text(self) -> str:
        text = f"{self.path}: {self.message}" if self.path else self.message
        return f"{text}. {self.hint}" if self.hint else text

    def with_hint(self, hint: str) -> PackdataError:
        """This error with ``hint`` in place of its own (advice that fits where it is raised again)."""
        hinted = copy.copy(self)
        hinted.hint = hint
        hinted.args = (hinted._text(),)
        return hinted

    def at_url(self, local: str | os.PathLike, url: str, *, cached: bool = True) -> PackdataError:
        """This error, its path in ``local`` (the cached copy of the pack at ``url``) named by the URL.

        A file that is in the copy is named there too, second, unless
        ``cached=False`` (a temporary copy, gone once the error is raised).
        Returns ``self`` when its path is not in ``local``.
        """
        if self.path is None or not (self.path + os.sep).startswith(os.path.join(local, "")):
            return self
        named = copy.copy(self)
        rel = os.path.relpath(self.path, local)
        named.path = url if rel == "." else f"{url}/{Path(rel).as_posix()}"
        if cached and os.path.lexists(self.path):
            named.message = f"{self.message} (cached copy: {self.path})"
        named.args = (named._text(),)
        return named


def raise_at_url(exc: PackdataError, local: str | os.PathLike, url: str | None, *, cached: bool = True) -> NoReturn:
    """Raise ``exc`` (being handled) naming ``url`` in place of ``local``, its cached copy (see
    :meth:`PackdataError.at_url`); as it is when ``url`` is None."""
    named = exc if url is None else exc.at_url(local, url, cached=cached)
    if named is exc:
        raise exc
    raise named from exc


class SourceError(PackdataError):
    """A source folder or file cannot be used: missing, empty, unreadable, corrupt.

    ``resumable`` is True for a failure that a rerun may not meet (a request to
    object storage that failed): a conversion it stops is kept to resume.
    """

    resumable = False


class PackFormatError(PackdataError):
    """A pack or shard is missing, not a packdata pack, of a newer version, or damaged."""


class CapacityError(PackdataError):
    """Not enough disk space, memory or file descriptors for the requested operation."""


class ConfigError(PackdataError, ValueError):
    """Options that contradict each other or a destination that must not be used (also a ``ValueError``)."""


class MissingFieldError(PackdataError, KeyError):
    """A multi-field sample read as a dict, or a batch of them, holds no such field (also a ``KeyError``)."""

    def __str__(self) -> str:  # a KeyError's repr()s its argument: keep the message one plain line
        return str(self.args[0]) if self.args else ""


class RankMismatchError(PackdataError):
    """The ranks of one distributed job read different packs (or one pack through different options)."""


class LockedError(PackdataError):
    """Another process is writing the same pack or staging target (the message names it)."""


class ImageFormatError(PackFormatError, OSError):
    """Image bytes in a format packdata does not decode (see ``packdata.pack.images.IMAGE_FORMATS``), or no image.

    ``detected`` is the format PIL recognises (``"EPS"``, ``"PPM"``, ...) or None. An
    ``OSError`` too, as PIL's ``UnidentifiedImageError`` is, so existing handlers still catch it.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike | None = None,
        hint: str | None = None,
        detected: str | None = None,
    ) -> None:
        super().__init__(message, path=path, hint=hint)
        self.detected = detected


class DecodeError(PackFormatError, ValueError):
    """Stored bytes their decoder cannot read: text that is not UTF-8, JSON or ``.npy`` that does not parse.

    A ``ValueError`` too, as what ``bytes.decode``, ``json.loads`` and ``numpy.load`` raise is.
    """


def sample_error(exc: ImageFormatError | DecodeError, which: str, path: str | os.PathLike | None) -> PackFormatError:
    """``exc`` raised again by a dataset, led by the sample it came from (``which``) and the pack (``path``)."""
    if isinstance(exc, ImageFormatError):
        return ImageFormatError(f"{which}: {exc}", path=path, detected=exc.detected)
    return DecodeError(f"{which}: {exc}", path=path)


def unwritable_error(exc: OSError, path: str | os.PathLike) -> ConfigError:
    """The ConfigError for ``exc``, raised creating or writing ``path`` where packdata writes: not a full disk.

    Read-only file system, no permission, a parent that is not a folder, a special
    file system such as ``/proc``. Never a full disk or quota: those are named with their
    mount, size and free space by ``packdata.host.disks.write_error`` (which calls this
    for anything else), as this layer knows no mounts. Raise it ``from exc``.
    """
    if exc.errno == errno.ENOTDIR:  # a file where a folder above it should be: name it, not 'Not a directory'
        above = next((p for p in Path(path).parents if os.path.lexists(p) and not os.path.isdir(p)), None)
        if above is not None:
            return ConfigError(
                f"cannot write the destination: {above} is a file, not a folder",
                path=path,
                hint="Choose a destination whose parents are folders (or can be made)",
            )
    permissions = exc.errno in (errno.EACCES, errno.EPERM)  # not the file system: this user's rights in a folder
    return ConfigError(
        f"cannot write the destination ({exc.strerror or exc})",
        path=path,
        hint="Choose a destination in a folder this user may write"
        if permissions
        else "Choose a destination on a writable local or network file system",
    )


_OUT_OF_FILES = (errno.EMFILE, errno.ENFILE)


def too_many_open_files(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it was raised from, says the process or the system is out of file descriptors.

    Errors of C libraries that carry no ``errno`` (py-lmdb's) are known by the
    C library's message for it ("Too many open files").
    """
    return _caused_by(exc, _OUT_OF_FILES)


def out_of_maps(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it was raised from, is a memory map refused (``ENOMEM``: too many, or memory)."""
    return _caused_by(exc, (errno.ENOMEM,))


def _caused_by(exc: BaseException, codes: tuple[int, ...]) -> bool:
    """Whether ``exc`` or its causes carry one of the ``errno`` ``codes``, or the C library's message for one."""
    messages = tuple(os.strerror(code) for code in codes)
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in codes:
            return True
        if any(message in str(current) for message in messages):
            return True
        current = current.__cause__ or current.__context__
    return False


def out_of_files_error(path: str | os.PathLike) -> CapacityError:
    """Out of file descriptors opening ``path``, said as such (never as a damaged file). Raise it ``from`` the error."""
    return CapacityError(
        "too many open files: the limit on open files (ulimit -n) is reached",
        path=path,
        hint=OUT_OF_FILES_HINT,
    )


def out_of_maps_error(path: str | os.PathLike) -> CapacityError:
    """A memory map of ``path`` refused (``ENOMEM``), said as such (never as damage). Raise it ``from`` the error.

    Readers map two or three files for each shard they have read; Linux allows a
    process ``vm.max_map_count`` maps (65,530 by default), about 20,000 shards.
    """
    try:
        with open("/proc/sys/vm/max_map_count", encoding="ascii") as f:
            limit = f"{int(f.read()):,}"
        with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
            used = f"{sum(1 for _ in f):,}"
    except (OSError, ValueError):
        limit = used = "?"
    return CapacityError(
        f"cannot map the file: out of memory maps ({used} in use, vm.max_map_count {limit}) or of memory",
        path=path,
        hint="Raise vm.max_map_count (sysctl -w vm.max_map_count=262144, as root), read fewer shards per process "
        "(BlockShuffleSampler), or convert with a larger shard_size (`packdata convert --shard-size`) so the pack has "
        "fewer shards",
    )


OUT_OF_FILES_HINT = (
    "Raise the hard limit (ulimit -Hn as root, LimitNOFILE= for a service, --ulimit nofile= for a container), "
    "or convert with a larger shard_size (`packdata convert --shard-size`) so the pack has fewer shards"
)


class EngineError(PackdataError):
    """A conversion engine is unavailable, or one of its tasks failed for good (after retries)."""
