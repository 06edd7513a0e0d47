"""A pack in object storage looked at in place: its small files copied locally, its shards streamed.

:func:`fetch_pack_skeleton` copies what is not a shard (manifest, sample
index, each shard's side tables, the skip report) into a local folder, so
``ls``, ``cat`` and the streaming TFRecord reader use the same local code as
for a pack on disk; :class:`RemoteStream` reads one shard front to back in
ranged requests of about 8 MiB, hashing it on the way (memory stays bounded
whatever the shard's size), for ``verify``. Every failed request is retried
with backoff (:func:`fetch_range`), and every message names the URL without
credentials.

A reader that names the manifest it opened reads each shard object at the
version pinned at its first access in the process (:func:`pinned_version`), so
a pack uploaded again while it reads (``convert ... --overwrite``) stops it
with one error instead of mixing two packs' records.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from packdata.errors import CapacityError, ConfigError, PackFormatError, SourceError, destination_error
from packdata.formats import get_format
from packdata.pack.files import aside_path, atomic_write, discard_stale, file_stamp, private_temp_folder
from packdata.pack.index import index_files
from packdata.pack.lock import convert_lock_path, wait_for_lock
from packdata.pack.manifest import MANIFEST_NAME, Manifest
from packdata.pack.urls import (
    conditional_reads,
    display_url,
    local_name,
    manifest_kept,
    object_version,
    open_at_version,
    open_url,
    precondition_failed,
    range_not_satisfiable,
    read_at_version,
    read_url_manifest,
    remote_error,
    remote_object,
    remote_size,
    url_place,
    version_now,
)

__all__ = [
    "RemoteStream",
    "check_not_short",
    "download_skeleton",
    "fetch_pack_skeleton",
    "fetch_range",
    "forget_skeleton",
    "pack_objects",
    "pinned_version",
]

_CHUNK = 8 << 20  # bytes per ranged request while streaming a shard


def fetch_range(
    fs: Any,
    path: str,
    where: str,
    start: int,
    end: int,
    *,
    retries: int = 4,
    backoff: float = 0.5,
    stop: threading.Event | None = None,
    opened: Manifest | None = None,
) -> bytes:
    """Bytes ``[start, end)`` of ``path`` on ``fs``, retried with doubling backoff (4 tries wait 0.5 + 1 + 2 s).

    A missing or forbidden object is reported at once (retrying cannot help).

    ``stop``, once set, ends the retries at once (a reader that was closed).

    ``opened``: the manifest of the pack ``path`` is a shard of, as the reader
    opened it. The bytes then come only from the object's version pinned for
    that manifest (:func:`pinned_version`): on S3 each request carries
    ``If-Match`` (a replaced object answers 412, at no extra request); on other
    stores the object's version is looked up again after each read (one
    metadata request a read). A store that reports no version (no ETag,
    modification or creation time) is read as without ``opened``, but for
    the manifest check at the pin.

    Raises:
        PackFormatError: the bytes could not be read in ``retries`` tries
            (``where`` names the object), the object is missing or shorter, or
            it was replaced since it was pinned.
    """
    delay = backoff
    problem = ""
    tries = 0
    for tries in range(1, retries + 1):
        try:
            version = "" if opened is None else pinned_version(fs, path, where, opened)
            data = read_at_version(fs, path, version, start, end)
            if len(data) == end - start:
                if version and not conditional_reads(fs):
                    _check_version(fs, path, where, version)
                return data
            problem = f"got {len(data)} of {end - start} bytes"
        except PackFormatError:  # the pack was replaced: no retry helps
            raise
        except FileNotFoundError as exc:  # no retry helps
            raise PackFormatError(
                "is missing (removed, or its pack is being converted again)",
                path=where,
                hint="Run `packdata verify` on the pack; once it is converted again, recreate the dataset",
            ) from exc
        except PermissionError as exc:  # denied: no retry helps
            problem = type(exc).__name__
            break
        except Exception as exc:
            if precondition_failed(exc):
                raise _replaced(where) from exc
            problem = type(exc).__name__
            if range_not_satisfiable(exc):
                check_not_short(fs, path, where, start, end)
        else:
            check_not_short(fs, path, where, start, end)
        if tries < retries:
            if stop is None:
                time.sleep(delay)
            elif stop.wait(delay):
                problem += "; the reader was closed"
                break
            delay *= 2
    raise PackFormatError(
        f"bytes {start}-{end} could not be read after {tries} tries ({problem})",
        path=where,
        hint="The epoch stops here rather than skip records: check the network or the object, then rerun",
    )


_PINS: dict[tuple[Any, str], tuple[Manifest, str]] = {}
"""(filesystem, object path) -> (the manifest its version was pinned for, that version), in this process."""


def pinned_version(fs: Any, path: str, where: str, opened: Manifest) -> str:
    """The version of the shard object ``path`` this process reads for the pack whose manifest is ``opened``.

    The first call for ``path`` and ``opened`` in a process (forked children
    inherit the pins) asks the store for the object's version
    (:func:`~packdata.pack.urls.object_version`), then reads the pack's
    manifest again: packdata replaces a pack in object storage manifest first
    (``convert --overwrite`` deletes the old manifest before it uploads any
    shard, and puts the new one last), so the same manifest after the lookup
    proves the version is the opened pack's. Later calls return the pinned
    version; ``""`` where the store reports none. A pack uploaded by other
    means (a plain recursive copy) carries no such proof.

    Raises:
        PackFormatError: the manifest is gone or changed (the pack was replaced since it was opened).
        FileNotFoundError: the object is missing.
    """
    held = _PINS.get((fs, path))
    if held is not None and held[0] == opened:
        return held[1]
    fs.invalidate_cache(path)  # a listing cached earlier may predate the object
    version = object_version(fs.info(path))
    root, shown = _pack_of(path, where, opened)
    try:
        current, _ = read_url_manifest(fs, root, shown)
    except PackFormatError as exc:  # no manifest: a new pack is being uploaded
        raise _replaced(where) from exc
    if current != opened:
        raise _replaced(where)
    _PINS[fs, path] = (opened, version)  # a pin for another manifest (an older dataset's) is replaced
    return version


def _pack_of(path: str, where: str, opened: Manifest) -> tuple[str, str]:
    """The root and shown URL of the pack whose manifest is ``opened``, from one of its shard objects' ``path``.

    The shard's records file may lie in a folder of the pack (an LMDB shard's ``NAME.lmdb/data.mdb``).
    """
    fmt = get_format(opened.format)
    for shard in opened.shards:
        rel = fmt.data_name(shard.file)
        if path.endswith(f"/{rel}"):
            return path[: -len(rel) - 1], where[: -len(rel) - 1]
    raise PackFormatError("is not a shard of the pack this reader opened", path=where)


def _replaced(where: str) -> PackFormatError:
    return PackFormatError(
        "was replaced (re-uploaded?) while this reader ran",
        path=where,
        hint="Rebuild the dataset (and its DataLoader) to read the new pack",
    )


def _check_version(fs: Any, path: str, where: str, version: str) -> None:
    """Raise if ``path`` is no longer at ``version`` (read just now: the bytes read may be another object's)."""
    fs.invalidate_cache(path)
    try:
        now = object_version(fs.info(path))
    except FileNotFoundError as exc:
        raise _replaced(where) from exc
    if now != version:
        raise _replaced(where)


def check_not_short(fs: Any, path: str, where: str, start: int, end: int) -> None:
    """After a short read: raise if the object itself ends before ``end`` (no retry helps); else let it retry."""
    try:
        size = remote_size(fs, path, where)
    except SourceError:  # the lookup failed too: a transient fault, retried as one
        return
    if size is not None and size < end:
        raise PackFormatError(
            f"the object is {size} bytes, but the pack's tables place bytes {start}-{end} in it",
            path=where,
            hint="The object is truncated or was replaced: run `packdata verify` on the pack",
        )


class RemoteStream:
    """One remote file read front to back (``read(n)`` like a file), in ranged requests, SHA-256 on the way.

    Holds at most one request's bytes plus the record being read, so memory is
    bounded whatever the file's size. ``on_bytes`` is called with each
    request's size (a progress bar).
    """

    def __init__(
        self, fs: Any, path: str, where: str, size: int, *, on_bytes: Callable[[int], object] | None = None
    ) -> None:
        self.fs, self.path, self.where, self.size = fs, path, where, size
        self.on_bytes = on_bytes
        self._sha = hashlib.sha256()
        self._buf = b""
        self._pos = 0
        self._next = 0  # the first byte not fetched yet

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes from the current position (fewer only at the end of the file)."""
        while len(self._buf) - self._pos < n and self._next < self.size:
            end = min(self._next + _CHUNK, self.size)
            chunk = fetch_range(self.fs, self.path, self.where, self._next, end)
            self._sha.update(chunk)
            if self.on_bytes is not None:
                self.on_bytes(len(chunk))
            self._buf = self._buf[self._pos :] + chunk
            self._pos = 0
            self._next = end
        out = self._buf[self._pos : self._pos + n]
        self._pos += len(out)
        return out

    def hexdigest(self) -> str:
        """SHA-256 of the whole file (the rest is read first)."""
        while self._next < self.size:
            self._pos = len(self._buf)
            self.read(_CHUNK)
        return self._sha.hexdigest()


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
                    hint="Free space there, or pass cache_dir=DIR on a larger disk",
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
        raise destination_error(exc, dest) from exc
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
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


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
