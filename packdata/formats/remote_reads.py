"""A shard in object storage read in place: ranged requests, retried, at the version pinned for its pack.

:func:`fetch_range` reads bytes of an object, every failed request retried
with backoff; :class:`RemoteStream` reads one shard front to back in ranged
requests of about 8 MiB, hashing it on the way (memory stays bounded whatever
the shard's size), for ``verify``. Every message names the URL without
credentials.

A reader that names the manifest it opened reads each shard object at the
version pinned at its first access in the process (:func:`pinned_version`), so
a pack uploaded again while it reads (``convert ... --overwrite``) stops it
with one error instead of mixing two packs' records.

:class:`SpanRequest` reads a whole span of an S3 object (a reader's run of
records in one shard) in one GET, taken in pieces in order: an object store
that reads the whole object for every ranged GET (moto) then reads it once,
and a real one is asked once per shard rather than once per 8 MiB.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from typing import Any

from packdata.errors import PackFormatError, SourceError
from packdata.formats import get_format
from packdata.pack.manifest import Manifest
from packdata.pack.ranges import check_range_reply, range_ignored
from packdata.pack.urls import (
    conditional_reads,
    object_version,
    precondition_failed,
    range_not_satisfiable,
    read_at_version,
    read_url_manifest,
    remote_size,
)

__all__ = ["RemoteStream", "SpanRequest", "check_not_short", "fetch_range", "pinned_version"]

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
        SourceError: the store answered other bytes than the range asked for
            (it, or a proxy, ignores ``Range``): not retried.
    """
    delay = backoff
    problem = ""
    tries = 0
    for tries in range(1, retries + 1):
        try:
            version = "" if opened is None else pinned_version(fs, path, where, opened)
            data = read_at_version(fs, path, version, start, end, where=where)
            if len(data) == end - start:
                if version and not conditional_reads(fs):
                    _check_version(fs, path, where, version)
                return data
            problem = f"got {len(data)} of {end - start} bytes"
        except PackFormatError:  # the pack was replaced: no retry helps
            raise
        except SourceError as exc:
            if range_ignored(exc):  # the store answers other bytes than asked for: no retry helps
                raise
            problem = type(exc).__name__
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

    The first call for ``path`` and ``opened`` in a process (pins are keyed by
    the filesystem instance, which a reader opens anew in each process: a
    forked worker inherits none it uses and pins again) asks the store for the object's version
    (:func:`~packdata.pack.urls.object_version`; on S3, for a pack of at most
    ``_LISTED_SHARDS`` shards, every shard's version from one listing, all
    pinned together), then reads the pack's
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
    root, shown = _pack_of(path, where, opened)
    versions = _listed_versions(fs, root, opened)
    if path not in versions:  # not listed (a large pack, a shard in a folder, not S3): looked up alone
        fs.invalidate_cache(path)  # a listing cached earlier may predate the object
        versions = {path: object_version(fs.info(path))}
    try:
        current, _ = read_url_manifest(fs, root, shown)
    except PackFormatError as exc:  # no manifest: a new pack is being uploaded
        raise _replaced(where) from exc
    if current != opened:
        raise _replaced(where)
    for shard, version in versions.items():  # a pin for another manifest (an older dataset's) is replaced
        _PINS[fs, shard] = (opened, version)
    return versions[path]


_LISTED_SHARDS = 300
"""On S3, a pack of at most this many shards has all its shards pinned from one listing (one LIST page)."""


def _listed_versions(fs: Any, root: str, opened: Manifest) -> dict[str, str]:
    """Object path -> version of the shards of a small pack on S3 directly under ``root``, from one LIST page.

    One LIST and one manifest read then pin every shard a process reads (a
    DataLoader worker of each epoch), where a lookup and a manifest read a
    shard did. Only the first page (at most 1,000 objects, S3's) is asked
    for: a root that holds more objects beside the pack is never listed to its
    end in every process, and the shards that page misses are looked up alone.
    Nothing is kept in ``fs``'s listings cache. Empty where the pack is
    larger, its shards lie in folders, the store is not S3, or the listing fails.
    """
    if len(opened.shards) > _LISTED_SHARDS or not conditional_reads(fs):
        return {}
    fmt = get_format(opened.format)
    names = [fmt.data_name(shard.file) for shard in opened.shards]
    if any("/" in name for name in names):  # in folders (LMDB's NAME.lmdb/data.mdb): not in the listing of root
        return {}
    from fsspec.asyn import sync

    bucket, key, _ = fs.split_path(root)
    prefix = f"{key.strip('/')}/" if key.strip("/") else ""
    wanted = {f"{prefix}{name}" for name in names}
    try:
        page = sync(fs.loop, fs._call_s3, "list_objects_v2", Bucket=bucket, Prefix=prefix, Delimiter="/")
    except Exception:  # each shard is looked up alone, which tells what is wrong
        return {}
    return {
        f"{root}/{entry['Key'][len(prefix) :]}": object_version(entry)
        for entry in page.get("Contents", [])
        if entry.get("Key") in wanted and object_version(entry)
    }


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


class SpanRequest:
    """Bytes ``[start, end)`` of an S3 object in one GET, taken in order in pieces (:meth:`take`).

    The GET carries ``If-Match`` with the version pinned for ``opened`` (see
    :func:`fetch_range`), so the whole span comes from that version. Only a
    store where :func:`~packdata.pack.urls.conditional_reads` holds (s3fs) is
    read this way. Nothing here retries or explains: a request or a piece that
    fails raises whatever the client raised (``at`` stays at the piece's first
    byte), and the caller opens the span again from there or reads that piece
    with :func:`fetch_range`, which does both. Used from one thread at a time.
    """

    def __init__(self, fs: Any, path: str, where: str, start: int, end: int, *, opened: Manifest | None) -> None:
        from fsspec.asyn import sync

        self.fs, self.start, self.at, self.end = fs, start, start, end
        version = "" if opened is None else pinned_version(fs, path, where, opened)
        bucket, key, _ = fs.split_path(path)
        extra = {"IfMatch": version} if version else {}
        byte_range = f"bytes={start}-{end - 1}"
        response = sync(fs.loop, fs._call_s3, "get_object", Bucket=bucket, Key=key, Range=byte_range, **extra)
        self._body = response["Body"]
        try:
            check_range_reply(response, where, start, end)
        except SourceError:
            sync(fs.loop, _close_body, self._body)
            raise

    @staticmethod
    def possible(fs: Any) -> bool:
        """Whether ``fs`` is read this way (s3fs: :func:`~packdata.pack.urls.conditional_reads`)."""
        return conditional_reads(fs)

    def take(self, n: int) -> bytes:
        """The next ``n`` bytes of the span (all of them, or an error)."""
        from fsspec.asyn import sync

        if n > self.end - self.at:
            raise ValueError(f"{n} bytes asked, {self.end - self.at} left in the span")
        data: bytes = sync(self.fs.loop, _take, self._body, n)
        self.at += n
        return data

    def close(self) -> None:
        """Drop the response (its connection with it when not read to the end)."""
        from fsspec.asyn import sync

        sync(self.fs.loop, _close_body, self._body)


async def _take(body: Any, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        part = await body.read(n - got)
        if not part:
            raise EOFError(f"the response ended {n - got} bytes short")
        parts.append(part)
        got += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def _close_body(body: Any) -> None:
    body.close()
