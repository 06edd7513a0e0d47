"""A pack in object storage looked at in place: its small files copied locally (its shards are streamed).

:func:`fetch_pack_skeleton` copies what is not a shard (manifest, sample
index, each shard's side tables, the skip report) into a local folder, so
``ls``, ``cat`` and the streaming TFRecord reader use the same local code as
for a pack on disk; the shards themselves are read in ranged requests
(:mod:`packdata.formats.remote_reads`). Every message names the URL without
credentials.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
from pathlib import Path, PurePosixPath
from typing import Any

from packdata.errors import CapacityError, ConfigError, PackFormatError
from packdata.formats import get_format
from packdata.host.disks import FULL_DISK_ERRNOS, no_space_error
from packdata.pack.files import aside_path, atomic_write, discard_stale, file_stamp, private_temp_folder
from packdata.pack.index import index_files
from packdata.pack.lock import convert_lock_path, wait_for_lock
from packdata.pack.manifest import MANIFEST_NAME, Manifest
from packdata.pack.urls import (
    conditional_reads,
    display_url,
    local_name,
    manifest_kept,
    open_at_version,
    open_url,
    precondition_failed,
    read_url_manifest,
    remote_error,
    remote_object,
    url_place,
    version_now,
)

__all__ = ["download_skeleton", "fetch_pack_skeleton", "forget_skeleton", "pack_objects"]


def _skeleton_names(manifest: Manifest, *, report: bool) -> list[tuple[str, bool]]:
    """``(relative path, required)`` of every file of a pack that is not a shard's data."""
    layout_of = get_format(manifest.format).shard_layout
    names = [(f"{manifest.index_dir}/{n}", True) for n in index_files(manifest.kind)]
    for shard in manifest.shards:
        layout = layout_of(os.path.basename(shard.file))
        base = shard.file if layout.folder else str(PurePosixPath(shard.file).parent)
        names += [(str(PurePosixPath(base) / side), False) for side in layout.side]
    skip_report = manifest.skipped.get("report")
    if report and isinstance(skip_report, str) and skip_report:
        names.append((skip_report, False))
    return names


def pack_objects(manifest: Manifest) -> list[str]:
    """The relative name of every file a pack of ``manifest`` may hold, its manifest but: each shard's data,
    side tables and scratch files, the sample index, the skip report (names a stranger's manifest gives are
    checked plain, in the pack, when it is read)."""
    layout_of = get_format(manifest.format).shard_layout
    names = [name for name, _ in _skeleton_names(manifest, report=True)]
    for shard in manifest.shards:
        layout = layout_of(os.path.basename(shard.file))
        names.append(f"{shard.file}/{layout.data}" if layout.folder else shard.file)
        if layout.folder:
            names += [f"{shard.file}/{name}" for name in layout.scratch]
    return names


_COPY_BLOCK = 4 << 20
_FILES = ".files.json"  # in a downloaded skeleton: {relative path: its stamp} of each file downloaded


def download_skeleton(fs: Any, root: str, manifest: Manifest, raw: bytes, shown: str, dest: Path) -> Path:
    """Copy a pack's files but its shards' data into the new folder ``dest``, the manifest last.

    Optional files (side tables, the skip report) that are not there are left
    out; a missing sample index file raises. Every file's version is looked up before the first is read (then the
    manifest is read again: a pack uploaded again since it was first read is
    named); on S3 each read carries that version (``If-Match``), elsewhere each
    file's version is looked up again after its read, so a file rewritten
    meanwhile (an older pack, without index digests, uploaded again) is named,
    never cached beside another upload's files.

    The files together may take the disk's free space less a twentieth of
    the file system or 1 GiB, whichever is less (but at least half the free
    space), whatever a stranger's pack holds: a side table of gigabytes stops
    the copy before it fills the disk (``/tmp`` may be a tmpfs: memory).

    Raises:
        PackFormatError: a file the pack needs is missing, or one was rewritten during the copy.
        SourceError: a request failed.
        CapacityError: the files pass what the disk may take (what was
            written is removed), or it filled up (named; what was written
            is left for the next run to remove).
    """
    sizes: dict[str, int] = {}
    try:
        usage = shutil.disk_usage(dest.parent)  # dest is made by the first copy
        room = limit = max(usage.free // 2, usage.free - min(usage.total // 20, 1 << 30))
        names = _skeleton_names(manifest, report=True)
        pinned, at = conditional_reads(fs), None  # S3: each read at the version looked up (If-Match)
        found = {n: remote_object(fs, f"{root}/{n}", f"{shown}/{n}") for n, _ in names}
        if not manifest_kept(fs, root, raw, shown):  # a pack uploaded again since the manifest was read
            raise _rewritten(f"{shown}/{MANIFEST_NAME}")
        for name, required in names:
            target, where, looked = dest / name, f"{shown}/{name}", found.get(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:  # streamed: an index of 100 M keys is gigabytes, never held in memory at once
                if looked is None:
                    raise FileNotFoundError(name)
                at = looked if pinned and looked[1] else None  # else looked up again after the read
                with open_at_version(fs, f"{root}/{name}", at) as remote, open(target, "wb") as local:
                    sizes[name] = _copy_within(remote, local, room)
                room -= sizes[name]
            except FileNotFoundError:
                if looked is not None:  # there at the look-up
                    raise _rewritten(where) from None
                if required:
                    raise PackFormatError(f"{shown}: {name} is missing", hint="The pack is incomplete") from None
            except _NoRoom:
                shutil.rmtree(dest, ignore_errors=True)  # this run's own folder: it would never fit
                raise CapacityError(
                    f"{shown}: the pack's index and side tables do not fit here: {name} passes the "
                    f"{limit:,} bytes the cache may take (its free space, less a twentieth of its file system "
                    "or 1 GiB kept free)",
                    path=dest,
                    hint=_ROOM_HINT,
                ) from None
            except Exception as exc:
                if _disk_full(exc):
                    raise
                if precondition_failed(exc):  # S3: no longer at the version looked up
                    raise _rewritten(where) from exc
                raise remote_error(shown, f"cannot read {name}", exc) from exc
            if looked is not None and at is None and version_now(fs, f"{root}/{name}", where) != looked[1]:
                raise _rewritten(where)
        stamps = {name: file_stamp(dest / name) for name in sizes}
        atomic_write(dest / _FILES, json.dumps(stamps).encode("utf-8"))  # what a reused copy must still hold
        atomic_write(dest / MANIFEST_NAME, raw)  # the manifest last: a skeleton without it is not used
    except OSError as exc:
        if not _disk_full(exc):
            raise
        of = "(the pack's index and side tables, copied from the URL)"
        raise no_space_error(exc, exc.filename or dest, folder=dest, of=of, hint=_ROOM_HINT) from exc
    return dest


def _rewritten(where: str) -> PackFormatError:
    return PackFormatError(
        "was rewritten or removed while the pack's index and side tables were copied (the pack at the URL "
        "changed): nothing was cached from it",
        path=where,
        hint="Open it again once the pack at the URL is complete (converted or uploaded again?)",
    )


class _NoRoom(Exception):
    """A copy passed the bytes it may write."""


def _copy_within(remote: Any, local: Any, room: int) -> int:
    """Copy ``remote`` to ``local`` a block at a time; the bytes copied. Raises :class:`_NoRoom` past ``room``."""
    copied = 0
    while block := remote.read(_COPY_BLOCK):
        copied += len(block)
        if copied > room:
            raise _NoRoom
        local.write(block)
    return copied


def _disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is a local write refused for want of space (never what a failed request raises)."""
    return isinstance(exc, OSError) and exc.errno in FULL_DISK_ERRNOS


_ROOM_HINT = "Free space there, or pass cache_dir=DIR on a larger disk"


_CACHE_HINT = "Remove it if it is not yours, or pass cache_dir=DIR (a folder of your own)"


def _holds(dest: Path, digest: str, required: list[str]) -> bool:
    """Whether the cached copy ``dest`` is of the manifest whose sha256 is ``digest`` and still holds every file.

    Its record of the files downloaded must name every file in ``required`` (the
    sample index files) and every other file of the pack the copy holds: an empty
    or partial record (written by hand, or planted) checks nothing, so the copy is
    downloaded again. Each file recorded must still be the regular file written then, unchanged
    since: same size, inode, modification and change times (:func:`~packdata.pack.files.file_stamp`). A
    copy that lost a file (to a clean-up of the temporary folder or a full disk)
    or had one edited, even at the same size, is downloaded again rather than
    read with it. One ``lstat`` a file: nothing is hashed.
    """
    try:
        if hashlib.sha256((dest / MANIFEST_NAME).read_bytes()).hexdigest() != digest:
            return False
        stamps = json.loads((dest / _FILES).read_bytes())
        if not isinstance(stamps, dict) or any(name not in stamps for name in required):
            return False
        return all(file_stamp(dest / name) == stamp for name, stamp in stamps.items())
    except (OSError, ValueError, RecursionError):  # RecursionError: its record nested past Python's stack
        return False


def _recorded_needs(dest: Path, manifest: Manifest) -> list[str]:
    """The files a cached copy's record must name: the sample index files, and each optional one the copy holds."""
    return [
        name for name, required in _skeleton_names(manifest, report=True) if required or os.path.lexists(dest / name)
    ]


def forget_skeleton(dest: Path) -> None:
    """Mark the cached copy ``dest`` as not to be reused (a damaged file found in it): the next fetch downloads anew.

    Only its record of the files downloaded goes; readers of the copy read on,
    and the next :func:`fetch_pack_skeleton` swaps a fresh copy in atomically.
    """
    (dest / _FILES).unlink(missing_ok=True)


def _own_folder(folder: Path) -> None:
    """Make ``folder`` (a cache entry's tag folder) a folder: a link or a file at its name is removed, never followed.

    A link planted there would have the cache's swap replace (and delete) a
    folder wherever it leads.

    Raises:
        ConfigError: it is a link again after its removal (another process keeps planting one).
    """
    for _ in range(2):
        with contextlib.suppress(FileExistsError):
            folder.mkdir(parents=True)
        if stat.S_ISDIR(folder.lstat().st_mode):
            return
        folder.unlink()
    raise ConfigError("is not a folder of the cache: packdata never writes through it", path=folder, hint=_CACHE_HINT)


def fetch_pack_skeleton(
    url: str, storage_options: dict[str, Any] | None, cache_dir: str | os.PathLike | None
) -> tuple[Path, Manifest, Any, str]:
    """A cached local copy of a remote pack without its shards' data (see the module docstring).

    Kept in ``cache_dir`` (default ``packdata-remote-UID`` in the system's temporary folder) and reused
    while the remote manifest is the same, replaced atomically when not. Processes
    sharing ``cache_dir`` take turns on an entry: one downloads it while the
    others wait, then use its copy; a copy whose manifest matches is never replaced.
    A download first removes the partial and old copies that killed downloads of the entry left.

    Returns:
        ``(local copy, manifest, filesystem, path of the pack on it)``.

    Raises:
        PackFormatError: not a pack, or a file it needs is missing.
    """
    fs, root = open_url(url, storage_options)
    root = root.rstrip("/")
    shown = display_url(url)
    manifest, raw = read_url_manifest(fs, root, shown)
    digest = hashlib.sha256(raw).hexdigest()
    base = Path(cache_dir) if cache_dir else private_temp_folder("packdata-remote", hint=_CACHE_HINT)
    tag = base / hashlib.sha256(url_place(url).encode("utf-8")).hexdigest()[:16]  # hashed: a user part is never shown
    _own_folder(tag)
    dest = tag / local_name(root)  # never the tag folder
    if _holds(dest, digest, _recorded_needs(dest, manifest)):
        return dest, manifest, fs, root
    with wait_for_lock(convert_lock_path(dest), what="packdata (remote pack cache)", target=dest):  # one at a time
        if _holds(dest, digest, _recorded_needs(dest, manifest)):  # another process made it while this one waited
            return dest, manifest, fs, root
        discard_stale(dest, "partial", "old")  # what killed downloads and swaps of this entry left
        partial = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
        download_skeleton(fs, root, manifest, raw, shown, partial)
        old = aside_path(dest)
        if dest.exists():
            os.rename(dest, old)
        os.rename(partial, dest)
        shutil.rmtree(old, ignore_errors=True)
    return dest, manifest, fs, root
