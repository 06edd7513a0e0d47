"""The cache of packs staged from URLs: eviction under a size limit, and deletion of copies nobody reads.

A copy is deleted only under its readers' lock, renamed aside first (:func:`delete_unread`),
so a process that has a file of it open keeps reading and the next stage never finds half a copy.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from packdata.errors import CapacityError, ConfigError, LockedError
from packdata.host.processes import open_by_any_process
from packdata.pack.files import (
    aside_path,
    discard_partial,
    fsync_dir,
    stale_siblings,
    temporary_owner,
)
from packdata.pack.lock import (
    READERS_LOCK,
    convert_lock_path,
    exclude_readers,
    hold_lock,
)
from packdata.pack.manifest import MANIFEST_NAME, evicted_mark
from packdata.pack.urls import (
    is_url,
    open_url,
    store_digest,
    user_digest,
)
from packdata.staging.copy import LOCK as STAGE_LOCK
from packdata.staging.folder import dir_bytes
from packdata.staging.marker import STAGED_FILE, read_marker

__all__ = ["delete_copy", "delete_unread", "discard_aside", "discard_stale_copies", "evict_for", "unread_copy"]


def _owner(entry: Path) -> Path:
    """The staged copy ``entry`` stands for: itself, or the copy whose partial or moved-aside folder it is."""
    return temporary_owner(entry, "partial", "old") or entry


def evict_for(
    cache: Path,
    incoming: int,
    limit: int,
    *,
    keep: Path,
    storage_options: dict[str, Any] | None = None,
    source: str | None = None,
) -> list[Path]:
    """Delete least recently used staged copies in ``cache`` until they and ``incoming`` bytes fit ``limit``.

    Only complete, verified copies of packs in object storage are candidates,
    each deleted holding its ``.NAME.lock`` (taken without waiting: a copy
    another process is staging, replacing or unstaging is skipped), and only
    when its origin's manifest is still there (never the last copy; nor one
    whose origin cannot be looked up: its URL's user part not shown) and nobody
    reads it: no dataset holds its ``.readers.lock`` and no process visibly has
    a file of it open (:func:`delete_unread`, which renames it aside before
    deleting it). An origin is looked up only in the store of ``source`` (the URL being staged, whose
    ``storage_options`` these are): same scheme, and same host for ``http(s)``, staged with storage
    options that send requests to the same place (:func:`~packdata.pack.urls.store_digest`: endpoint,
    profile; credentials aside). A copy whose ``staged.json`` names another store (a folder planted
    in the cache can name any URL), or whose stage sent its requests elsewhere (another S3 endpoint
    can hold the same bucket and path: asking this one would take its origin for there, or gone),
    or does not say where (staged before packdata recorded it), is kept, never contacted.
    ``keep`` (the copy being staged) and its partial or old folders are never evicted.

    Returns:
        The copies deleted, oldest first.

    Raises:
        CapacityError: the limit cannot be met by evicting what may be evicted (when
            no eviction could meet it, such as a pack larger than the limit, nothing is evicted).
    """
    copies = []
    for entry in cache.iterdir():
        marker = read_marker(entry) if entry.is_dir() and not entry.is_symlink() else None
        if marker is None or _owner(entry) == keep:
            continue
        copies.append((os.stat(entry / STAGED_FILE).st_mtime, entry, dir_bytes(entry), marker))
    total = incoming + sum(size for _, _, size, _ in copies)
    kept = sum(size for _, _, size, marker in copies if not _remote_copy(marker))
    if incoming + kept > limit:  # evicting every copy would not make room: evict none
        beside = f" beside {kept:,} bytes of copies that are never evicted (of local packs, or incomplete)"
        raise CapacityError(
            f"the cache limit of {limit:,} bytes cannot hold the pack ({incoming:,} bytes){beside if kept else ''}",
            path=cache,
            hint="Raise cache_limit=SIZE, or stage into another folder",
        )
    evicted: list[Path] = []
    unknown = ""  # why a copy whose readers cannot be told was kept
    kept_because: list[str] = []  # a key of _KEPT for each copy kept
    for _, entry, size, marker in sorted(copies, key=lambda c: c[0]):
        if total <= limit:
            break
        if not _remote_copy(marker):
            kept_because.append("local")  # not ours to evict (its lock is never taken)
            continue
        owner = _owner(entry)
        try:
            with hold_lock(convert_lock_path(owner), what="packdata stage (evicting)", target=owner):
                try:
                    if not _evictable(entry, storage_options, source, kept_because):
                        continue
                    if delete_unread(entry, owner):
                        evicted.append(entry)
                        total -= size
                        if entry == owner:
                            _mark_evicted(owner)
                    else:
                        kept_because.append("read")
                except ConfigError as exc:  # its .readers.lock is not one a stage made
                    unknown = unknown or f" ({exc})"
                    kept_because.append("untold")
        except LockedError:
            kept_because.append("busy")
    if total > limit:
        why = "; ".join(f"{kept_because.count(k)} {words}" for k, words in _KEPT.items() if k in kept_because)
        raise CapacityError(
            f"the cache limit of {limit:,} bytes cannot hold the pack ({incoming:,} bytes) beside the staged "
            f"copies kept: {why}; {total:,} bytes in all{unknown}",
            path=cache,
            hint="Raise cache_limit=SIZE, stop the readers of older copies, or unstage them",
        )
    return evicted


def _mark_evicted(copy: Path) -> None:
    """Leave :func:`~packdata.pack.manifest.evicted_mark` beside the evicted ``copy`` (an empty file; whatever
    already stands there is left unopened). One that cannot be made only leaves the plainer 'no such pack'."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    with contextlib.suppress(OSError):
        os.close(os.open(evicted_mark(copy), flags, 0o644))


_KEPT = {  # why evict_for kept a staged copy, in the words of its CapacityError
    "read": "in use by live readers",
    "busy": "being staged, replaced or unstaged by another process",
    "untold": "whose readers cannot be told",
    "local": "of a local pack, or incomplete",
    "gone": "whose origin is gone (the last copy)",
    "store": "whose origin is in another store than the pack staged, or may be: staged with storage_options for "
    "another endpoint (never looked up)",
    "user": "whose origin's URL had a user part it does not show (never looked up)",
    "unreachable": "whose origin could not be looked up",
}


def _remote_copy(marker: dict[str, Any] | None) -> bool:
    """Whether a staged copy's marker says it is a complete copy of a pack in object storage."""
    origin = marker.get("origin") if marker else None
    return bool(marker and marker.get("complete") and isinstance(origin, str) and is_url(origin))


@contextlib.contextmanager
def unread_copy(copy: Path) -> Iterator[bool]:
    """Hold ``copy``'s readers' lock exclusively for the block if nobody reads it; yields whether nobody does.

    Read: a dataset holds its ``.readers.lock`` (taken without waiting, see
    :func:`packdata.pack.lock.exclude_readers`), or a process visibly has one of
    its files open or mapped (readers that take no lock: other tools, copies
    staged before readers' locks; only processes this one may inspect are seen).
    """
    if open_by_any_process(copy, ignore=(READERS_LOCK, STAGE_LOCK)) is not None:  # readers hold no lock file
        yield False
        return
    with exclude_readers(copy) as unread:
        yield unread


def delete_unread(entry: Path, owner: Path | None = None, *, successor: Path | None = None) -> bool:
    """Delete the staged copy ``entry`` (``owner``'s ``.NAME.lock`` held) unless it is read; whether it did.

    Under its readers' lock (see :func:`unread_copy`) the copy is renamed aside
    (``.NAME.old-PID``, which the next stage of NAME discards if this one is
    killed) and ``successor``, a finished copy, renamed into its place, so a
    reader opening it meanwhile finds it gone or replaced, never half deleted.
    A copy that never stood at its name is deleted where it is, as is one its file system
    will not rename (``EXDEV``: an overlay's lower layer), its ``staged.json`` last.

    Args:
        entry: the staged copy, or a partial or moved-aside folder of one.
        owner: the copy ``entry`` stands for (default: ``entry``, see :func:`_owner`).
        successor: the folder that takes ``entry``'s place.

    Raises:
        ConfigError: its ``.readers.lock`` is not a regular file, so its readers
            cannot be told (:func:`packdata.pack.lock.exclude_readers`): it is kept.
    """
    owner = entry if owner is None else owner
    with unread_copy(entry) as unread:
        if not unread:
            return False
        doomed = entry
        if entry == owner:
            doomed = aside_path(owner)
            try:
                os.rename(entry, doomed)
            except OSError as exc:  # an overlay whose lower layer holds the copy: deleted where it is
                if exc.errno != errno.EXDEV or successor is not None:
                    raise
                doomed = entry
        if successor is not None:
            os.rename(successor, entry)
            fsync_dir(entry.parent)
        delete_copy(doomed, ignore_errors=successor is not None)  # a leftover there costs disk; swept later
    return True


def delete_copy(copy: Path, *, ignore_errors: bool = False) -> None:
    """Delete a staged copy (a folder, not a link), its ``staged.json`` last.

    A delete killed midway so leaves a folder still known as a staged copy,
    which ``unstage AREA`` sweeps; without its marker it would stay for good
    (on tmpfs: RAM) unless NAME were staged there again. A link (or a file)
    standing there is removed itself: what a link leads to is never deleted.
    """
    if copy.is_symlink() or not copy.is_dir():
        discard_partial(copy)
        return
    with os.scandir(copy) as entries:
        inside = [Path(entry.path) for entry in entries if entry.name != STAGED_FILE]
    try:
        for path in inside:
            discard_partial(path)
    except OSError:
        if not ignore_errors:
            raise
        return
    shutil.rmtree(copy, ignore_errors=ignore_errors)


def discard_aside(aside: Path) -> None:
    """Remove a ``.NAME.old-PID`` a killed run left: a folder as :func:`delete_copy` does, a link or file itself."""
    if aside.is_dir() and not aside.is_symlink():
        delete_copy(aside)
    else:
        discard_partial(aside)


def discard_stale_copies(dest: Path) -> None:
    """Remove the copies of ``dest`` that killed runs left aside (:func:`~packdata.pack.files.discard_stale`'s rule).

    Each goes by :func:`discard_aside`: a staged copy's ``staged.json`` last,
    so a stage killed midway leaves it still known to ``unstage AREA``. Call it
    holding ``dest``'s lock; one that cannot be removed costs disk, never the caller.
    """
    for aside in stale_siblings(dest, "old"):
        with contextlib.suppress(OSError):
            discard_aside(aside)


def _same_store(origin: str, source: str | None) -> bool:
    """Whether ``origin`` lies in the store of ``source``: same scheme, and same host for ``http(s)``."""
    if source is None:
        return True
    a, b = urlsplit(origin), urlsplit(source)
    return a.scheme == b.scheme and (a.scheme not in ("http", "https") or a.netloc == b.netloc)


def _evictable(entry: Path, storage_options: dict[str, Any] | None, source: str | None, why: list[str]) -> bool:
    """Whether ``entry`` (its lock held) is still a complete remote copy whose origin is there.

    When it is not, the reason (a key of ``_KEPT``) is appended to ``why``.
    """
    marker = read_marker(entry) if entry.is_dir() and not entry.is_symlink() else None
    reason = ""
    if marker is None or not _remote_copy(marker):
        reason = "busy"  # replaced or removed before its lock was taken
    elif user_digest(marker["origin"]) != marker.get("origin_user", ""):
        reason = "user"  # its URL had a user part the origin does not show: it names another place
    elif not _same_store(marker["origin"], source) or marker.get("origin_store") != store_digest(storage_options):
        reason = "store"  # never sent these storage_options, nor a request a planted marker names
    else:
        try:
            fs, root = open_url(marker["origin"], storage_options)
            reason = "" if fs.exists(f"{root.rstrip('/')}/{MANIFEST_NAME}") else "gone"
        except Exception:
            reason = "unreachable"
    if reason:
        why.append(reason)
    return not reason
