"""The packdata error hierarchy: one base class, one subclass per cause.

Every error carries the path it concerns and a hint saying what to do, and its
message leads with the path, in the way of py-lmdb's errors.
"""

from __future__ import annotations

import os

__all__ = [
    "CapacityError",
    "ConfigError",
    "LockedError",
    "PackFormatError",
    "PackdataError",
    "SourceError",
]


class PackdataError(Exception):
    """Base class of every error packdata raises on purpose."""

    def __init__(self, message: str, *, path: str | os.PathLike | None = None, hint: str | None = None) -> None:
        self.path = os.fspath(path) if path is not None else None
        self.hint = hint
        text = f"{self.path}: {message}" if self.path else message
        if hint:
            text = f"{text}. {hint}"
        super().__init__(text)


class SourceError(PackdataError):
    """A source folder or file cannot be used: missing, empty, unreadable, corrupt."""


class PackFormatError(PackdataError):
    """A pack or shard is missing, not a packdata pack, of a newer version, or damaged."""


class CapacityError(PackdataError):
    """Not enough disk space or memory for the requested operation."""


class ConfigError(PackdataError):
    """Options that contradict each other or a destination that must not be used."""


class LockedError(PackdataError):
    """Another process is writing the same pack or staging target (the message names it)."""
