"""Stage a pack from object storage (``s3://``, any fsspec URL) into a local cache, once per node.

``packdata.stage("s3://bucket/train.lmdb", to="/nvme/cache")`` is meant to be
called by every rank of a job: one process per cache folder downloads while
the others wait on ``.NAME.lock`` there (an ``flock``: a process that dies
holding it releases it, so nobody hangs on a dead downloader), then all open
the finished copy. A local ``stage`` or ``unstage`` of ``CACHE/NAME`` takes
the same lock: a download waits for them, a local stage waits for a download,
and an unstage is refused while one runs. The steps:

1. The remote ``manifest.json`` is read and validated like a local one.
2. When ``CACHE/NAME`` already holds a complete copy of this manifest, still
   holding every file the pack needs, none written to since it was staged,
   nothing is downloaded.
3. Otherwise every file of the pack (shards with their side tables, the sample
   index, the skip report) is downloaded into ``CACHE/.NAME.partial``: in
   parallel, large files in parallel byte ranges (:mod:`packdata.staging.fetch`), each shard's SHA-256
   checked against the manifest before it takes its name. Files already there
   from an interrupted run are kept when their size (and, for shards, hash) is
   right, so a rerun resumes.
4. The manifest is written last, then the folder is renamed to ``CACHE/NAME``
   (a previous copy is moved aside and deleted): a reader never sees a half copy.
   An old copy that a stage killed in between left (``.NAME.old-PID``) is
   deleted by the next stage of ``NAME``. A previous copy that is still read
   (see :func:`~packdata.staging.cache.delete_unread`) is never replaced: the stage is refused, before
   downloading and again at the swap, and a rerun once its readers are gone
   resumes from the finished download.
   Only a staged copy of the same URL (its ``staged.json`` says so) or an empty
   folder is replaced; any other folder at ``CACHE/NAME`` is refused before a
   byte is downloaded.

An LMDB pack is read through local files only, so a pack is staged whole or
not at all: a cache without room for it is refused before anything is downloaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from packdata.errors import CapacityError, ConfigError, LockedError, PackFormatError
from packdata.formats import get_format
from packdata.host.facts import gather_facts, read_mounts
from packdata.host.memory import memory_warnings
from packdata.pack.files import (
    atomic_write,
    discard_partial,
    file_stamp,
    fsync_dir,
    holds_conversion,
)
from packdata.pack.index import index_files
from packdata.pack.lock import (
    convert_lock_path,
    create_readers_lock,
    wait_for_lock,
)
from packdata.pack.manifest import MANIFEST_NAME, Manifest, evicted_mark
from packdata.pack.urls import (
    display_url,
    manifest_kept,
    open_url,
    read_url_manifest,
    remote_object,
    store_digest,
    user_digest,
)
from packdata.staging.cache import delete_unread, discard_stale_copies, evict_for, unread_copy
from packdata.staging.fetch import FETCH_WORKERS, complete, download, pack_changed
from packdata.staging.folder import missing_folders, removed_if_refused
from packdata.staging.marker import STAGED_FILE, check_destination, check_name, read_marker, write_marker
from packdata.staging.space import FULL_DISK_ERRNOS, area_error, no_space_error
from packdata.staging.tmpfs import mount_of

__all__ = ["FETCH_WORKERS", "RemoteStageResult", "stage_remote"]

_FULL_HINT = (
    "A pack is staged whole from a URL: free space or stage into another cache, then stage again "
    "(what was downloaded is kept)"
)


@dataclass
class RemoteStageResult:
    """A remote pack staged (or found staged) in a local cache."""

    source: str  # the URL, without credentials
    staged: Path
    downloaded: bool  # False: this process found a complete copy (another rank made it, or an earlier run)
    files: int
    bytes_downloaded: int
    seconds: float
    waited_seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "staged": os.fspath(self.staged)}


def stage_remote(
    url: str,
    *,
    to: str | os.PathLike | None,
    name: str | None = None,
    storage_options: dict[str, Any] | None = None,
    workers: int | None = None,
    wait_seconds: float = 6 * 3600,
    reserve: int | None = None,
    force: bool = False,
    progress: bool = True,
    cache_limit: int | None = None,
) -> RemoteStageResult:
    """Download the pack at ``url`` into ``to/NAME`` once per cache folder (see the module docstring).

    Args:
        url: the pack in object storage (``s3://bucket/train.lmdb``).
        to: the local cache folder (NVMe, or a tmpfs mount).
        name: the staged pack's folder name in ``to``, one plain name (default: the URL's last part).
        storage_options: passed to fsspec (credentials, endpoint, ``anon``).
        workers: parallel requests (default 16: object stores want many).
        wait_seconds: how long a rank waits for another one's download.
        reserve, force: the tmpfs memory checks, as for a local stage.
        progress: show progress on stderr.
        cache_limit: most bytes the cache folder's staged copies may hold; the
            least recently used copies of remote packs are evicted to make room
            (see :func:`~packdata.staging.cache.evict_for`).

    Raises:
        ConfigError: no ``to`` (or one that cannot be made), a ``name`` that is not a plain folder name,
            ``to/NAME`` holds a folder that is not a staged copy of ``url``, or the URL cannot be opened.
        CapacityError: the cache cannot hold the whole pack, memory checks refuse, or the
            cache filled up while downloading (what was downloaded is kept: a rerun resumes).
        PackFormatError: the remote pack is not a pack, or a shard fails its checksum.
        LockedError: another process kept the download for longer than ``wait_seconds``, or
            ``to/NAME`` holds a copy of an older version of the pack that is still read.
    """
    start = time.monotonic()
    if to is None:
        raise ConfigError("staging from a URL needs to=DIR: the local cache folder", hint="Pass to='/nvme/cache'")
    fs, root = open_url(url, storage_options)
    shown = display_url(url)
    cache = Path(to).absolute()
    if name is None:
        name = PurePosixPath(root.rstrip("/")).name
        check_name(name, area=cache, url=shown)
    else:
        check_name(name, area=cache)
    made = missing_folders(cache)  # a refused stage leaves none of them (a download it began stays, to resume)
    with removed_if_refused(made), contextlib.ExitStack() as held:
        try:
            cache.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise area_error(exc, cache, hint=_FULL_HINT) from exc
        lock = convert_lock_path(cache / name)  # the lock a local stage into cache/NAME takes too
        # only the lock is waited for: a refusal under it (a copy still read) is final
        held.enter_context(
            wait_for_lock(lock, what="packdata stage (download)", target=cache / name, timeout=wait_seconds)
        )
        result = _stage_locked(
            fs,
            root.rstrip("/"),
            shown,
            user_digest(url),
            cache,
            name,
            workers,
            reserve,
            force,
            progress,
            cache_limit,
            storage_options,
        )
    result.waited_seconds = time.monotonic() - start - result.seconds
    return result


def _pack_files(manifest: Manifest, shown: str) -> list[tuple[str, int | None, str | None, bool]]:
    """``(relative path, size, sha256, required)`` of every file of the pack at ``shown``, each named once."""
    fmt = get_format(manifest.format)
    fmt.check_names(manifest, f"{shown}/{MANIFEST_NAME}")
    layout_of = fmt.shard_layout
    files: list[tuple[str, int | None, str | None, bool]] = []
    for shard in manifest.shards:
        layout = layout_of(shard.file)
        data = f"{shard.file}/{layout.data}" if layout.folder else shard.file
        files.append((data, shard.bytes, shard.sha256, True))
        base = shard.file if layout.folder else str(PurePosixPath(shard.file).parent)
        files += [(str(PurePosixPath(base) / side), None, None, False) for side in layout.side]
    digests = manifest.index_sha256  # empty for a pack written before them
    files += [(f"{manifest.index_dir}/{n}", None, digests.get(n), True) for n in index_files(manifest.kind)]
    report = manifest.skipped.get("report")
    if report:
        files.append((report, None, None, False))
    return files


def _stage_locked(
    fs: Any,
    root: str,
    shown: str,
    user: str,
    cache: Path,
    name: str,
    workers: int | None,
    reserve: int | None,
    force: bool,
    progress: bool,
    cache_limit: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> RemoteStageResult:
    start = time.monotonic()
    manifest, raw = read_url_manifest(fs, root, shown)
    files = _pack_files(manifest, shown)
    dest, partial = cache / name, cache / f".{name}.partial"
    check_destination(shown, dest, user=user)  # a folder there is replaced only when it is a staged copy of this URL
    discard_stale_copies(dest)  # the copy a stage killed between the renames of its swap moved aside
    digest = hashlib.sha256(raw).hexdigest()
    marker = read_marker(dest) if dest.is_dir() else None
    if (
        marker
        and (marker.get("origin"), marker.get("origin_user", "")) == (shown, user)
        and marker.get("manifest_sha256") == digest
        and marker.get("complete")
        and _intact(dest, files, marker.get("stamps"))
    ):
        os.utime(dest / STAGED_FILE)  # used now: the least recently used copies are evicted first
        create_readers_lock(dest)  # a copy staged before readers' locks gets one
        store = store_digest(storage_options)
        if marker.get("origin_store") != store:  # its manifest is this store's: eviction may look it up there
            with contextlib.suppress(OSError):  # unrecorded, it is only kept from eviction, as it was
                _add_to_marker(dest, marker, origin_store=store)
        return RemoteStageResult(shown, dest, False, 0, 0, time.monotonic() - start, 0.0)
    if dest.is_dir():
        with unread_copy(dest) as unread:
            if not unread:
                raise _still_read(dest, shown)  # before a byte is downloaded
    if partial.is_symlink() or (os.path.lexists(partial) and not partial.is_dir()):
        discard_partial(partial)  # never downloaded through: only the link or file itself goes
    if holds_conversion(partial):  # not a download of ours: a conversion into NAME was interrupted here
        raise ConfigError(
            f"{partial.name} is an interrupted conversion into {name} (it holds its checkpoint), not a download",
            path=partial,
            hint=f"Finish it with resume (`packdata convert ... {dest} --resume`), drop it with overwrite "
            "(`--overwrite`), or stage as another name",
        )
    made = [] if os.path.lexists(partial) else [partial]
    with removed_if_refused(made):  # refused before a download began (no room, the cache limit): it goes
        try:  # the disk may fill after the check (another stage into the cache): what is downloaded is kept
            partial.mkdir(exist_ok=True)
            looked = _look_up(fs, root, files, workers)
            if not manifest_kept(fs, root, raw, shown):  # a pack uploaded again since the manifest was read
                raise pack_changed(f"{shown}/{MANIFEST_NAME}", "was rewritten or removed")
            todo = [
                (rel, size, sha, version)
                for rel, _, sha, _ in files
                for size, version in [looked[rel]]
                if size is not None and not complete(partial / rel, size, sha)
            ]
            needed = sum(size for _, size, _, _ in todo)
            if cache_limit is not None:
                evict_for(
                    cache, manifest.total_bytes, cache_limit, keep=dest, storage_options=storage_options, source=shown
                )
            _check_room(cache, needed, reserve, force)
            download(fs, root, partial, todo, shown, name, needed, workers, progress)
            atomic_write(partial / MANIFEST_NAME, raw)
            write_marker(
                partial,
                origin=shown,
                origin_user=user,
                format=manifest.format,
                staged=[s.file for s in manifest.shards],
                left=[],
                bytes_staged=manifest.total_bytes,
                bytes_left=0,
                complete=True,
            )
            stamps = {rel: file_stamp(partial / rel) for rel, _, _, _ in files if os.path.lexists(partial / rel)}
            _add_to_marker(partial, manifest_sha256=digest, stamps=stamps, origin_store=store_digest(storage_options))
            create_readers_lock(partial)
            fsync_dir(partial)
        except OSError as exc:
            if exc.errno not in FULL_DISK_ERRNOS:
                raise
            raise no_space_error(exc, exc.filename or partial, staged=partial, hint=_FULL_HINT) from exc
    check_destination(shown, dest, user=user)  # again: a folder may have appeared there while downloading
    if not dest.exists():
        os.rename(partial, dest)
        fsync_dir(cache)
    elif not delete_unread(dest, successor=partial):
        raise _still_read(dest, shown)  # again: a reader may have opened it while downloading
    with contextlib.suppress(OSError):  # a copy stands there again: not evicted (a mark left only words a refusal)
        evicted_mark(dest).unlink()
    return RemoteStageResult(shown, dest, True, len(todo), needed, time.monotonic() - start, 0.0)


def _still_read(dest: Path, shown: str) -> LockedError:
    return LockedError(
        f"holds a copy of an older version of {shown} that is still read (a dataset holds it, or a process has "
        "its files open), so it is not replaced",
        path=dest,
        hint="Stage again once its readers are done (the download is kept), or stage under another name=NAME",
    )


def _add_to_marker(folder: Path, marker: dict[str, Any] | None = None, **items: Any) -> None:
    """Write ``folder``'s ``staged.json`` again with ``items``: over ``marker`` (as :func:`read_marker` read it),
    or over the file this stage has just written."""
    path = folder / STAGED_FILE
    data = json.loads(path.read_text(encoding="utf-8")) if marker is None else marker
    atomic_write(path, json.dumps({**data, **items}, indent=1).encode("utf-8"))


def _look_up(
    fs: Any, root: str, files: list[tuple[str, int | None, str | None, bool]], workers: int | None
) -> dict[str, tuple[int | None, str]]:
    """Relative path -> (size, version) of each of ``files`` (see :func:`_pack_files`), looked up in parallel (one
    request each): the manifest's size, or its size now for a file it gives none, and its version now.

    Every range of the download is read at that version (:func:`~packdata.staging.fetch.download`), so a file
    replaced after its look-up is named at its first range read since, not after all of it is downloaded. A
    file of the manifest's size missing here keeps that size and no version: its download names it missing.
    """
    with ThreadPoolExecutor(max_workers=max(1, min(len(files), workers or FETCH_WORKERS))) as pool:
        found = pool.map(lambda f: _remote_size(fs, f"{root}/{f[0]}", f[3] and f[1] is None), files)
        return {
            rel: (found_size if size is None else size, version)
            for (rel, size, _, _), (found_size, version) in zip(files, found, strict=True)
        }


def _remote_size(fs: Any, path: str, required: bool) -> tuple[int | None, str]:
    """The size (None: no such object) and version (:func:`~packdata.pack.urls.object_version`) of ``path``, asked
    of the store now: not of a listing this process cached earlier (another client may have written it since)."""
    fs.invalidate_cache(path)
    found = remote_object(fs, path, display_url(path))
    if found is None and required:
        raise PackFormatError(f"{display_url(path)}: a file the manifest needs is missing")
    return found or (None, "")


def _intact(dest: Path, files: list[tuple[str, int | None, str | None, bool]], stamps: object) -> bool:
    """Whether the staged copy ``dest`` still holds each file the pack needs (``files``, see :func:`_pack_files`).

    Each is a regular file, a shard of the manifest's size: one ``lstat`` a
    file (a copy that lost a shard to a clean-up is downloaded again, not
    reused until a reader fails on it). A copy staged with ``stamps`` (its
    marker's: relative path -> :func:`~packdata.pack.files.file_stamp` when
    staged) holds those files only, each unchanged since: one written to in
    place, even at the same size, is downloaded again, so "stage it again"
    mends what a reader found damaged. Nothing is hashed: damage no write
    made (a failing disk) is found by the readers' checks of each record.
    """
    stamped = stamps if isinstance(stamps, dict) else None
    for rel, size, _, required in files:
        try:
            stamp = file_stamp(dest / rel)
        except FileNotFoundError:
            if required:
                return False
            continue
        if stamp is None or (size is not None and stamp[0] != size):
            return False
        if stamped is not None and stamped.get(rel) != stamp:
            return False
    return True


def _check_room(cache: Path, needed: int, reserve: int | None, force: bool) -> None:
    free = shutil.disk_usage(cache).free
    if needed > free:
        raise CapacityError(
            f"the pack needs {needed:,} more bytes here, {free:,} are free",
            path=cache,
            hint="A pack is staged whole from a URL (LMDB reads local files only): free space or choose another cache",
        )
    mount = mount_of(cache, read_mounts())
    if mount is not None and mount.fstype == "tmpfs":
        warnings = memory_warnings(gather_facts(include_gpus=False), tmpfs_size=needed, reserve=reserve, adding=True)
        refused = [w for w in warnings if w.severity == "refuse"]
        if refused and not force:
            raise CapacityError(refused[0].message, path=cache, hint="Stage onto disk, or pass force=True")
