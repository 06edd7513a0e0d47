"""The objects of a pack in object storage that an overwriting conversion replaces, removed once the new one is up.

Before the old pack's manifest is deleted (:func:`record_replaced`), each
object its manifest lists (shards, side tables, sample index, skip report) is
recorded with the size and version the store reports, in ``replaced.jsonl``
beside the conversion's work folder, so a rerun after an interruption still
knows them. Once the new manifest is up (:func:`remove_replaced`), each
recorded object the new pack does not have is removed, only while the store
still reports it as recorded (on S3 the delete itself carries ``If-Match``, so
an object rewritten after that look-up is kept too): an object written since, or one the old
manifest did not list (anything else under the prefix), is never touched. A
pack with fewer shards thus leaves no old shard behind for a ``*.tfrecord``
glob to read, or to pay for.
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path
from typing import Any, cast

from packdata.errors import PackFormatError, SourceError
from packdata.formats.remote_pack import pack_objects
from packdata.pack.own_files import append_own_file, read_own_file
from packdata.pack.urls import object_version, read_url_manifest, remote_error, remove_at_version, retry_transient

__all__ = [
    "OVERSIZED_WORK_FILE_HINT",
    "WORK_FILE_HINT",
    "files_under",
    "journal_most",
    "record_replaced",
    "remove_replaced",
]

WORK_FILE_HINT = "Remove it if it is not yours (nothing was written through it), or set PACKDATA_TMP to your own folder"
"""The hint of a file in a conversion's work folder that packdata refuses (a link planted there, another user's)."""

OVERSIZED_WORK_FILE_HINT = (
    "A resume cannot go on from it: remove it with the work folder beside it (nothing was read from it), then run again"
)
"""The hint of a work file longer than packdata writes it (a stranger's file, never read whole)."""

_JOURNAL_LINE_MOST = 2 * (6 * 1024 + 2) + 256
"""The longest line packdata appends to a journal: an object's name and version (1,024 bytes each at most, as
object stores keep keys), every byte JSON-escaped at most 6 ways, with a size and digests."""


def journal_most(objects: int) -> int:
    """The most bytes a journal of ``objects`` objects (downloaded, uploaded or replaced) can hold.

    A line each at its longest (:data:`_JOURNAL_LINE_MOST`), some 100 times an
    ordinary line: room for each object journaled again run after run.
    """
    return (objects + 1) * _JOURNAL_LINE_MOST


def files_under(folder: Path) -> int:
    """How many files ``folder`` holds, in its subfolders too (0 when it is missing); links are not followed."""
    return sum(len(files) for _, _, files in os.walk(folder))


_REPLACED = "replaced.jsonl"
"""Beside a destination's work folder: one line per object of the pack it replaces (name, size, version)."""


def record_replaced(fs: Any, root: str, shown: str, work: Path) -> None:
    """Record the objects at ``root`` that the manifest there lists, beside the work folder ``work``.

    A manifest packdata cannot read names nothing: none of its objects is removed later.
    """
    try:
        old, _ = read_url_manifest(fs, root, shown)
    except PackFormatError:
        return
    names = set(pack_objects(old))
    found = _listing(fs, root)
    lines = [json.dumps({"name": n, "size": s, "version": v}) + "\n" for n, (s, v) in found.items() if n in names]
    work.parent.mkdir(parents=True, exist_ok=True)  # a second ended pack adds its own lines
    append_own_file(work.parent / _REPLACED, "".join(lines), hint=WORK_FILE_HINT, sync=True)


def remove_replaced(fs: Any, root: str, shown: str, work: Path, keep: set[str]) -> int:
    """Remove the recorded objects (see :func:`record_replaced`) whose names are not in ``keep`` (the new
    pack's files), each only while the store reports the recorded size and version; returns how many.

    Raises:
        SourceError: a request failed (the record is kept: a rerun removes the rest).
    """
    record = work.parent / _REPLACED
    if not os.path.lexists(record):
        return 0
    try:
        found = _listing(fs, root)
    except Exception as exc:  # the new pack is up: say so, and how the rest goes
        raise _not_all_removed(shown, exc) from exc
    text = read_own_file(record, hint=WORK_FILE_HINT, most=journal_most(len(found)), over_hint=OVERSIZED_WORK_FILE_HINT)
    lines = (text or "").splitlines()
    recorded: dict[str, tuple[int, str]] = {}
    for line in lines:
        try:
            entry = json.loads(line)
            recorded[str(entry["name"])] = (int(entry["size"]), str(entry["version"]))
        except (ValueError, KeyError, TypeError, RecursionError):
            continue  # a torn line (or one nested past Python's stack) counts for nothing
    removed = 0
    try:
        for name, was in sorted(recorded.items()):
            if name in keep or any(part in ("", ".", "..") for part in name.split("/")) or found.get(name) != was:
                continue
            removed += retry_transient(partial(remove_at_version, fs, f"{root}/{name}", was[1]))
    except Exception as exc:  # the new pack is up: say so, and how the rest goes
        raise _not_all_removed(shown, exc) from exc
    record.unlink()
    return removed


def _not_all_removed(shown: str, exc: Exception) -> SourceError:
    """The error of a request that failed as the objects of the pack replaced at ``shown`` were removed."""
    error = remote_error(
        shown, "the new pack is published, but the objects of the pack it replaced could not all be removed", exc
    )
    hint = f"{error.hint} with resume=True to remove the rest (nothing is uploaded again)"
    return cast(SourceError, error.with_hint(hint))


def _listing(fs: Any, root: str) -> dict[str, tuple[int, str]]:
    """Every object under ``root``, asked of the store: name relative to ``root`` -> (size, version)."""
    fs.invalidate_cache(root)
    found = retry_transient(partial(fs.find, root, detail=True))
    prefix = f"{root}/"
    return {
        path[len(prefix) :]: (int(info.get("size") or 0), object_version(info))
        for path, info in found.items()
        if path.startswith(prefix) and info.get("type", "file") == "file"
    }
