"""Naming a full staging disk: which file system, of what type and size, with how much left.

Every write of a stage that runs out of room (a shard's copy, the sample index, the
manifest, ``staged.json``) says it in the same words: ``no space left on MOUNT
(FSTYPE of SIZE, FREE free) while ...`` (:mod:`packdata.host.disks`, as conversion's).
"""

from __future__ import annotations

import os
from pathlib import Path

from packdata.errors import CapacityError, PackdataError
from packdata.host import disks
from packdata.host.disks import FULL_DISK_ERRNOS, filesystem_named

__all__ = ["FULL_DISK_ERRNOS", "area_error", "filesystem_named", "no_space_error"]

_RERUN_HINT = (
    "The source is untouched; the staged pack is left as it was, or to be completed by a rerun. "
    "Free space, stage fewer shards with budget=SIZE, or use a larger tmpfs=SIZE, then stage again"
)


def no_space_error(exc: OSError, path: str | os.PathLike, *, staged: Path, hint: str = _RERUN_HINT) -> CapacityError:
    """The CapacityError for ``exc`` (a full disk or quota) raised writing ``path``, a file of the staged pack.

    Raise it ``from exc``; ``hint`` says what to do (by default: a local stage's remedies).
    """
    return disks.no_space_error(exc, path, folder=staged, of="of the staged pack", hint=hint)


def area_error(exc: OSError, area: Path, *, hint: str = _RERUN_HINT) -> PackdataError:
    """The one-line error for ``exc``, raised making the staging area (or cache) ``area``.

    A full disk or quota is named as a full stage is (``hint`` says what to do); anything else
    (read-only, no permission, a file on the way) is :func:`packdata.errors.unwritable_error`'s.
    Raise it ``from exc``.
    """
    return disks.write_error(exc, area, folder=area.parent, of="(the staging area's folder)", hint=hint)
