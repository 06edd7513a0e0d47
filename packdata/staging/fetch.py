"""The download of a stage from a URL: each file in parallel byte ranges, hashed while they arrive.

:func:`download` cuts every file into ranges of :data:`_RANGE` bytes and
fetches them in a thread pool, each written with ``os.pwrite`` into the
file's preallocated ``.NAME.part``. A file's SHA-256 is taken from the
ranges themselves, in order, as they arrive: a range that lands before the
ones ahead of it is held in memory (at most ``workers`` ranges' bytes held
at once, then read back from the file instead) until they have. As soon as a
file's last byte is hashed it is made durable, checked against the
manifest's SHA-256 and given its name, while the other files download: a
stage that fails later keeps it, so a rerun resumes from it.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from packdata.errors import PackFormatError
from packdata.formats.remote_reads import check_not_short
from packdata.pack.files import file_sha256, fsync_named
from packdata.pack.ranges import range_ignored
from packdata.pack.urls import (
    conditional_reads,
    precondition_failed,
    range_not_satisfiable,
    read_at_version,
    remote_error,
    version_now,
)
from packdata.progress import progress as show_progress

__all__ = ["FETCH_WORKERS", "complete", "download", "pack_changed"]

FETCH_WORKERS = 16
"""The parallel range downloads a stage from a URL makes when it is given no ``workers``."""

_RANGE = 16 << 20  # bytes per ranged request; a download holds at most about 2 x workers x this in memory


def download(
    fs: Any,
    root: str,
    partial: Path,
    todo: list[tuple[str, int, str | None, str]],
    shown: str,
    name: str,
    needed: int,
    workers: int | None,
    progress: bool,
) -> None:
    """Download the files ``todo`` (``(relative path, size, sha256, version)``) into ``partial``, each checked and
    renamed as soon as its last range has arrived (see :func:`_fetch_range` for ``version``).

    Raises:
        PackFormatError, SourceError: as :func:`_fetch_range` and :func:`_finish`; the files
            finished before the failure keep their names.
    """
    threads = workers or FETCH_WORKERS
    held = _Budget(threads * _RANGE)
    files: list[_File] = []
    ranges: list[tuple[_File, int, int]] = []
    try:
        for rel, size, sha, version in todo:  # every file cut into ranges: a big shard downloads in parallel too
            tmp = _part(partial / rel)
            tmp.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.truncate(size)
            files.append(file := _File(partial / rel, rel, size, sha, version, held))
            ranges += [(file, offset, min(offset + _RANGE, size)) for offset in range(0, size, _RANGE)]
        for file in files:
            if file.size == 0:  # no range: nothing to wait for
                _finish(file, shown)
        with (
            show_progress(desc=f"download {name}", unit="B", total=needed, disable=not progress) as bar,
            ThreadPoolExecutor(max_workers=threads, thread_name_prefix="packdata-fetch") as pool,
        ):
            for got in pool.map(lambda r: _fetch_range(fs, root, r[0], r[1], r[2], shown), ranges):
                bar.update(got)
    finally:
        for file in files:
            file.close()


class _Budget:
    """Bytes of ranges held in memory, waiting to be hashed, across a download's files: at most ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used, self.lock = limit, 0, threading.Lock()

    def take(self, n: int) -> bool:
        with self.lock:
            if self.used + n > self.limit:
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self.lock:
            self.used -= n


class _File:
    """One file being downloaded: its ``.part`` open (from its first range to its finish), its SHA-256 taken in order.

    ``arrived`` holds each range written but not hashed yet: start -> (end, its
    bytes, or None where the budget held none and the range is read back from
    the file). One thread at a time hashes (``hashing``): the others leave
    what they brought and go.
    """

    def __init__(self, local: Path, rel: str, size: int, sha256: str | None, version: str, held: _Budget) -> None:
        self.local, self.rel, self.size, self.sha256, self.version, self.held = local, rel, size, sha256, version, held
        self.fd = -1
        self.digest = hashlib.sha256()
        self.hashed = 0
        self.arrived: dict[int, tuple[int, bytes | None]] = {}
        self.hashing = False
        self.lock = threading.Lock()

    def descriptor(self) -> int:
        """The ``.part`` file open for reads and writes (opened on first use)."""
        with self.lock:
            if self.fd < 0:
                self.fd = os.open(_part(self.local), os.O_RDWR | os.O_CLOEXEC)
            return self.fd

    def landed(self, start: int, chunk: bytes, shown: str) -> None:
        """Note ``chunk``, written at ``start``; hash what is in order now; finish the file once whole."""
        kept = chunk if self.held.take(len(chunk)) else None
        with self.lock:
            self.arrived[start] = (start + len(chunk), kept)
            if self.hashing:  # the thread hashing takes it when it comes to it
                return
            self.hashing = True
        while True:
            with self.lock:
                end, data = self.arrived.pop(self.hashed, (-1, None))
                if end < 0:
                    self.hashing = False
                    if self.hashed < self.size:
                        return
                    break
            if data is None:
                self.digest.update(os.pread(self.fd, end - self.hashed, self.hashed))
            else:
                self.digest.update(data)
                self.held.give(len(data))
            with self.lock:
                self.hashed = end
        _finish(self, shown)

    def close(self) -> None:
        with self.lock:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1


def _fetch_range(fs: Any, root: str, file: _File, start: int, end: int, shown: str) -> int:
    """Download bytes ``[start, end)`` of ``file`` into its ``.part`` file; returns the bytes written.

    The last range asks for one byte more: an object now larger than ``size``
    (rewritten at the origin) is named, never cut to a prefix of another
    file. With a ``version`` (every file found when the stage looked it up,
    shards included) the bytes come only from that version on S3
    (``If-Match``; elsewhere its version is looked up again after each read):
    an object rewritten since, even at the same size, is named at its first
    range read after the change, before the rest of it is downloaded.

    Raises:
        PackFormatError: the object is missing, shorter or larger than the manifest (a shard) or its look-up
            says, or was rewritten since its look-up.
        SourceError: the request failed (a rerun resumes).
    """
    rel, size, version = file.rel, file.size, file.version
    where = f"{shown}/{rel}"
    asked = end + 1 if end == size else end
    try:
        chunk = read_at_version(fs, f"{root}/{rel}", version, start, asked, where=where)
    except FileNotFoundError as exc:  # the manifest names it: no rerun helps
        raise PackFormatError(
            "is missing", path=where, hint="The pack is incomplete: convert or upload it again"
        ) from exc
    except Exception as exc:
        if precondition_failed(exc):
            raise pack_changed(where, "was rewritten") from exc
        if range_not_satisfiable(exc):  # S3's answer to a range past the end
            check_not_short(fs, f"{root}/{rel}", where, start, end)
        if range_ignored(exc):  # the store answered other bytes than the range: no rerun helps
            raise
        raise remote_error(shown, f"cannot read {rel}; rerun to resume", exc) from exc
    if len(chunk) > end - start:
        raise pack_changed(where, f"is larger than the {size} bytes the stage began with")
    if len(chunk) != end - start:
        check_not_short(fs, f"{root}/{rel}", where, start, end)  # the object itself ends early: named
        raise PackFormatError(f"{shown}: {rel} is shorter than expected (it changed while staging)", hint="Rerun")
    if version and not conditional_reads(fs) and version_now(fs, f"{root}/{rel}") != version:
        raise pack_changed(where, "was rewritten")  # elsewhere than S3: its version looked up again after the read
    fd, written = file.descriptor(), 0
    while written < len(chunk):  # one call for the whole range, but a write may be short
        written += os.pwrite(fd, memoryview(chunk)[written:], start + written)
    file.landed(start, chunk, shown)
    return len(chunk)


def pack_changed(where: str, what: str) -> PackFormatError:
    """The error for a pack at a URL that changed while it was staged: ``where`` ``what``."""
    return PackFormatError(
        f"{what} (the pack at the URL changed while staging): nothing was staged from it",
        path=where,
        hint="Stage again once the pack at the URL is complete (converted or uploaded again?)",
    )


def _finish(file: _File, shown: str) -> None:
    """Check a downloaded file against the manifest's SHA-256 (if it has one), make it durable and give it its name."""
    tmp = _part(file.local)
    fsync_named(file.descriptor(), tmp, full_disk_as_oserror=True)  # a full disk: the stage's words, the file named
    file.close()
    if file.sha256 is not None and file.digest.hexdigest() != file.sha256:
        tmp.unlink()
        raise PackFormatError(
            f"{shown}: {file.rel} does not match the manifest's SHA-256 (damaged, or the pack changed while staging)",
            hint="Rerun; if it persists, verify the pack at its origin",
        )
    os.replace(tmp, file.local)


def _part(local: Path) -> Path:
    return local.with_name(f".{local.name}.part")


def complete(local: Path, size: int, sha256: str | None) -> bool:
    """A file already downloaded by an interrupted run: right size and right hash.

    A file the manifest gives no hash (a side table, the skip report, an older
    pack's index file) is never taken from a partial folder: an interrupted
    stage of another pack, or of this URL before it was converted again, may
    have left one of the same size.
    """
    if sha256 is None or not (local.is_file() and not local.is_symlink() and local.stat().st_size == size):
        return False
    return file_sha256(local) == sha256
