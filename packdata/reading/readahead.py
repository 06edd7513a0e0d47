"""Read-ahead hints: the bytes of the samples a sampler will hand out next, asked of the kernel in advance.

A sampler that knows its order (:class:`~packdata.reading.samplers.BlockShuffleSampler`
knows a whole epoch) passes the indices of its next window to
:meth:`ReadAhead.advise`; a background thread maps them to byte ranges of the
shards (each format's side table: ``records.i64``, ``.tfindex``), merges ranges
closer than :attr:`ReadAhead.GAP`, and calls ``posix_fadvise(WILLNEED)`` on
them. The kernel then reads those runs in large sequential requests while the
DataLoader workers are still busy with the window before, so on a cold page
cache the workers' reads find their pages in memory. Whether a shard is warm (at
least :data:`~packdata.formats.residency.WARM_SHARE` of it in the page cache) is
asked with one ``mincore`` and trusted for :attr:`ReadAhead.RECHECK` seconds; a
warm shard gets no hints, and a window of warm shards only costs the sampler a
lookup: the thread's work took the GIL from the training loop (a warm epoch of
4.6 KB records ran about 25% slower with hints than without). Hints change only *when* bytes are read, never *what* a
reader returns: every record is still read and checked by its reader.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path

import numpy as np

from packdata.errors import PackdataError
from packdata.formats import get_format
from packdata.formats.residency import WARM_SHARE, PagedFile
from packdata.host.descriptors import open_files_limit
from packdata.pack.files import open_regular
from packdata.pack.manifest import Manifest

__all__ = ["ReadAhead"]


class ReadAhead:
    """Asks the kernel for the byte ranges of samples about to be read (see the module docstring).

    Lives in the process that runs the sampler (the DataLoader's main
    process); the page cache it fills is shared with the workers. Files are
    opened in its thread, lazily; the thread ends, closing them, after
    :attr:`IDLE` seconds without work or at :meth:`close`.

    Args:
        root: the pack folder.
        manifest: its manifest.
    """

    GAP = 256 << 10
    """Ranges closer than this many bytes are asked for as one (a few skipped records cost less than a seek)."""

    IDLE = 2.0
    """Seconds without work after which the thread ends and the files close (the next hint starts them again)."""

    OPEN_FILES = 64
    """Shards whose data file and record table the thread keeps open at most (a window of blocks spans a few;
    keeping all ran the training process out of file descriptors on a pack of thousands of shards), and no more
    than a sixteenth of the soft limit on open files: two files each, an eighth of it, beside the half the
    shard readers may keep (:class:`~packdata.reading.shard_readers.ShardReaders`)."""

    RECHECK = 1.0
    """Seconds a shard's residency (warm: no hints; cold: hints) is trusted before the kernel is asked again."""

    def __init__(self, root: Path, manifest: Manifest) -> None:
        fmt = get_format(manifest.format)
        self._root = root
        self._format = fmt
        self._shards = list(manifest.shards)
        self._first = np.array([s.first_index for s in self._shards], dtype=np.int64)
        self._spans: dict[int, tuple[np.ndarray, np.ndarray] | None] = {}
        self._fds: dict[int, int] = {}
        self._residency: dict[int, tuple[bool, float]] = {}  # shard: (warm, time.monotonic() it expires at)
        self._pid = os.getpid()
        self._queue: queue.SimpleQueue[np.ndarray | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # whether the thread runs is decided under it
        soft = open_files_limit()[0]
        self._open_files = self.OPEN_FILES if soft < 0 else max(2, min(self.OPEN_FILES, soft // 16))
        self.advised_bytes = 0  # asked for so far (for tests and benchmarks)

    def advise(self, indices: np.ndarray | list[int]) -> None:
        """Queue the samples at ``indices`` (global sample indices) for a hint; returns at once.

        Nothing is queued when every shard they lie in was found warm within :attr:`RECHECK` seconds.
        """
        if len(indices) == 0:
            return
        if self._pid != os.getpid():
            self._forked()
        indices = np.asarray(indices, dtype=np.int64)
        now, known = time.monotonic(), self._residency
        shards = np.unique(np.searchsorted(self._first, indices, side="right") - 1).tolist()
        if all(known.get(shard, (False, 0.0)) >= (True, now) for shard in shards):
            return
        with self._lock:
            self._queue.put(indices)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="packdata-sampler-hints", daemon=True)
                self._thread.start()

    def _forked(self) -> None:
        """Start afresh in a forked child: the parent's thread does not run here, and may have held the lock.

        Its files (this process's copies of the parent's descriptors) are closed; its queue and lock are new.
        """
        for fd in self._fds.values():
            os.close(fd)
        self._fds, self._spans, self._residency = {}, {}, {}
        self._queue, self._thread, self._lock = queue.SimpleQueue(), None, threading.Lock()
        self._pid = os.getpid()

    def close(self) -> None:
        """Stop the thread and close the files (hints already given stay with the kernel)."""
        if self._pid != os.getpid():
            self._forked()
        with self._lock:
            thread = self._thread
            if thread is not None:
                self._queue.put(None)
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        """The thread: hint each queued window; end when idle or closed, or on an error, its files closed."""
        try:
            while True:
                try:
                    indices = self._queue.get(timeout=self.IDLE)
                except queue.Empty:
                    with self._lock:
                        if self._queue.empty():  # idle: end, so an abandoned sampler leaves no thread
                            self._end()
                            return
                    continue
                if indices is None:
                    with self._lock:
                        self._end()
                    return
                self._hint(indices)  # a hint is never worth an error: the reader reports a damaged pack
        except BaseException:
            with self._lock:
                self._end()  # the next hint starts a thread again
            raise

    def _end(self) -> None:
        """Close the thread's files and mark it gone; called under the lock, so the next thread opens only after.

        Closed outside it, the files of a thread started by the next hint went with them, or (their numbers
        reused by a shard reader since) a reader's file: 'Bad file descriptor', or another shard's bytes.
        """
        fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)
        self._thread = None

    def _hint(self, indices: np.ndarray) -> None:
        indices = np.sort(indices)
        shard_of = np.searchsorted(self._first, indices, side="right") - 1
        for shard in np.unique(shard_of).tolist():
            if shard < 0:
                continue
            try:
                self._hint_shard(shard, indices[shard_of == shard] - self._first[shard])
            except (OSError, ValueError, IndexError, PackdataError):
                continue  # this shard only (not a regular file, a table that lies, out of files): its reader says so

    def _hint_shard(self, shard: int, local: np.ndarray) -> None:
        """Hint the records ``local`` (indices within the shard) unless the shard is warm or has no spans."""
        if self._is_warm(shard):
            return
        spans = self._shard_spans(shard)
        if spans is None:
            return
        local = local[(local >= 0) & (local < len(spans[0]))]
        if len(local) == 0:
            return
        starts, lengths = spans[0][local], spans[1][local]
        for start, length in _merged(starts, starts + lengths, self.GAP):
            os.posix_fadvise(self._fd(shard), start, length, os.POSIX_FADV_WILLNEED)
            self.advised_bytes += length

    def _is_warm(self, shard: int) -> bool:
        """Whether the shard's data file is in the page cache (asked of the kernel at most every RECHECK s)."""
        now = time.monotonic()
        warm, until = self._residency.get(shard, (False, 0.0))
        if until > now:
            return warm
        fd = self._fd(shard)
        pages = PagedFile(fd, os.fstat(fd).st_size)
        try:
            warm = pages.resident_share() >= WARM_SHARE
        finally:
            pages.close()
        self._residency[shard] = (warm, now + self.RECHECK)
        return warm

    def _shard_spans(self, shard: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The shard's record spans, kept for at most :attr:`OPEN_FILES` shards (a mapped table holds a file)."""
        if shard in self._spans:
            spans = self._spans.pop(shard)
        else:
            if len(self._spans) >= self._open_files:
                del self._spans[next(iter(self._spans))]  # the least recently used: its map closes with it
            info = self._shards[shard]
            spans = self._format.record_spans(self._root / info.file, info.bytes)
        self._spans[shard] = spans  # the most recently used last
        return spans

    def _fd(self, shard: int) -> int:
        """The shard's data file, open; at most :attr:`OPEN_FILES` stay open, the least recently used closed first."""
        fd = self._fds.pop(shard, None)
        if fd is None:
            if len(self._fds) >= self._open_files:
                os.close(self._fds.pop(next(iter(self._fds))))
            path = self._root / self._format.data_name(self._shards[shard].file)
            fd = open_regular(path)  # a FIFO in its place is refused, never waited on
        self._fds[shard] = fd  # the most recently used last
        return fd


def _merged(starts: np.ndarray, ends: np.ndarray, gap: int) -> list[tuple[int, int]]:
    """``(start, length)`` runs covering every ``[starts[i], ends[i])``, joined across gaps under ``gap`` bytes."""
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)
    breaks = np.flatnonzero(starts[1:] - reach[:-1] >= gap) + 1
    firsts = np.concatenate(([0], breaks))
    lasts = np.concatenate((breaks - 1, [len(starts) - 1]))
    return [(int(starts[a]), int(reach[b] - starts[a])) for a, b in zip(firsts, lasts, strict=True)]
