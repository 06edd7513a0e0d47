"""TFRecord shards read straight from object storage: byte ranges fetched ahead, every record checked.

:class:`RemoteShardReader` streams a run of records of one shard the way the
local reader does (whole records in chunks of about 8 MB, the same framing and
CRC checks on each, see :meth:`TFRecordShardReader.check_chunk`), fetching the
chunks two ahead of the one being checked, in a background thread: on S3 from
one GET of the run's whole byte span, read a chunk at a time
(:class:`~packdata.formats.remote_reads.SpanRequest`; memory stays bounded;
a GET dropped after it gave a chunk is made again from the next unread byte,
three times a run at most), elsewhere, or once a GET of the span gives
nothing, with a ranged request a chunk.
:func:`stream_ahead` does the same for a reader's whole run of shards, so
the read-ahead carries on into the next shard while the current one is
checked: a shard boundary costs no round trip. A request that fails (a
dropped connection, a throttled read) is retried with backoff; a chunk that
still cannot be read raises one :class:`~packdata.errors.PackFormatError`
naming the shard's URL and byte range, when the reader gets to that chunk, so
an epoch never skips or repeats a record silently. A reader given the manifest
its dataset opened reads every range of a shard from the object's version
pinned at the first access in the process, so a pack uploaded again meanwhile
stops it with one error (see :func:`~packdata.formats.remote_reads.fetch_range`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from pathlib import Path
from typing import Any, cast

import numpy as np

from packdata.errors import ConfigError, PackFormatError
from packdata.formats.remote_pack import fetch_pack_skeleton
from packdata.formats.remote_reads import SpanRequest, fetch_range
from packdata.formats.tfrecord import NAME
from packdata.formats.tfrecord_framing import check_record
from packdata.formats.tfrecord_reader import TFRecordShardReader, chunk_plan
from packdata.formats.tfrecord_tables import index_path
from packdata.pack.manifest import Manifest
from packdata.pack.urls import display_url

__all__ = ["RemoteShardReader", "ShardRun", "fetch_skeleton", "stream_ahead"]


class RemoteShardReader(TFRecordShardReader):
    """Reads records of one remote shard (see the module docstring).

    ``BACKOFF`` (0.5 s) is the first retry's delay; four tries wait 0.5 + 1 + 2 s in all.
    ``CHUNK`` (8 MiB) is the size of one chunk checked at a time (whole records, at least one), and of
    one ranged request where a run is not read in one GET (see the module docstring).

    Args:
        fs: the fsspec filesystem.
        remote_path: the shard's path on ``fs``.
        shown: the shard's URL without credentials (for messages).
        size: the shard's byte size from the manifest.
        check_crc: check both CRC32Cs of every record.
        retries: tries per chunk before giving up.
        backoff: seconds before the first retry, doubling (default :attr:`BACKOFF`).
        ahead: chunks fetched ahead of the one being checked.
        opened: the manifest of the pack as the dataset opened it: every read (streamed or
            single) then comes from the object's pinned version, and a replaced object
            raises :class:`~packdata.errors.PackFormatError`. None: read whatever is there.
        table: the local copy of the shard's payload table, named when its row misses a sound record's payload
            (None: the shard's URL is named, as for a damaged record).
    """

    BACKOFF = 0.5
    CHUNK = 8 << 20
    TABLE_HINT = "Open the pack again: its cached copy is not reused (if it persists, convert the pack again)"

    def __init__(
        self,
        fs: Any,
        remote_path: str,
        shown: str,
        size: int,
        *,
        check_crc: bool = True,
        retries: int = 4,
        backoff: float | None = None,
        ahead: int = 2,
        opened: Manifest | None = None,
        table: str | os.PathLike | None = None,
    ) -> None:
        super().__init__(shown, check_crc=check_crc, expected_bytes=size)
        self.table = os.fspath(table) if table is not None else None
        self.fs, self.remote_path, self.size, self.opened = fs, remote_path, size, opened
        self.retries, self.ahead = retries, ahead
        self.backoff = self.BACKOFF if backoff is None else backoff

    def open(self) -> RemoteShardReader:
        """Nothing to open: every chunk is its own request."""
        return self

    def fetch(self, base: int, end: int, stop: threading.Event | None = None) -> bytes:
        """Bytes ``[base, end)`` of the shard (see :func:`~packdata.formats.remote_reads.fetch_range`)."""
        return fetch_range(
            self.fs,
            self.remote_path,
            self.path,
            base,
            end,
            retries=self.retries,
            backoff=self.backoff,
            stop=stop,
            opened=self.opened,
        )

    def stream(
        self,
        offsets: np.ndarray,
        lengths: np.ndarray,
        start: int,
        stop: int,
        payloads: np.ndarray | None = None,
        *,
        copy: bool = False,
    ) -> Iterator[memoryview | bytes]:
        """The data (or payloads) of records ``start..stop-1``, checked, chunks fetched ahead."""
        runs = [ShardRun(self, offsets, lengths, start, stop, payloads)]
        with closing(stream_ahead(runs, ahead=self.ahead)) as streams:  # an error must not leave the thread running
            for _, records in streams:
                yield from records

    def read(self, offset: int, length: int) -> memoryview:
        """One record (random access): a single ranged request, checked."""
        data = memoryview(self.fetch(offset, offset + length))
        return check_record(data, 0, length, path=self.path, offset=offset, check_crc=self.check_crc)

    def close(self) -> None:
        """Nothing to close."""


@dataclasses.dataclass(frozen=True, eq=False)
class ShardRun:
    """Records ``start..stop-1`` of one shard: its reader and the arguments of its ``stream``.

    ``shard`` is the caller's own number for the shard (:func:`stream_ahead` does not read it).
    """

    reader: TFRecordShardReader
    offsets: np.ndarray
    lengths: np.ndarray
    start: int
    stop: int
    payloads: np.ndarray | None = None
    shard: int = -1


def stream_ahead(
    runs: Iterable[ShardRun], *, ahead: int = 2, check: Callable[[], None] | None = None
) -> Generator[tuple[ShardRun, Iterator[memoryview]], None, None]:
    """Each run with an iterator of its checked records (data, or payloads), chunks fetched ahead across runs.

    One background thread fetches the chunks of all the runs in order (on S3 a
    run's chunks from one GET of its span), at most ``ahead + 1`` chunks queued
    or being read beyond the chunk being checked
    (with ``CHUNK`` of 8 MiB and ``ahead=2``: 24 MiB fetched and not read yet),
    whether they belong to the current run or to the next ones. ``runs`` is
    read lazily, one run ahead of the requests that need it, so the first
    chunks of the next shard are requested while the current one is still
    being checked; an error raised while producing a run is raised when the
    caller reaches that run, after every record of the runs before it.

    Read each run's records to the end before asking for the next run. Closing
    the iterator (or dropping it) cancels the requests not started, stops any
    retry waiting for its backoff, and lets the thread end with the request it
    is running.

    ``check``, when given, runs as each chunk arrives (or fails to), before
    any of its records is checked or yielded (a dataset's ``check_unchanged``):
    what it raises is raised instead.

    Raises:
        PackFormatError: a chunk could not be read (naming the shard's URL and
            byte range), or a record is damaged; raised when its chunk is reached.
        RuntimeError: a run's records were not all read before the next run.
    """
    read_ahead = _ReadAhead(iter(runs), ahead, check)
    try:
        while (run := read_ahead.next_run()) is not None:
            yield run, read_ahead.records(run)
    finally:
        read_ahead.close()


_Chunk = tuple[int, int, int, int]  # first record, end record, first byte, end byte


_REOPENS = 3  # GETs of a run's span made again after a drop, at most: a flapping store does not loop


@dataclasses.dataclass
class _Span:
    """A run's span: its end, its GET open now (or None), and how many more GETs of it may be made."""

    end: int
    opens_left: int
    stream: SpanRequest | None = None


class _ReadAhead:
    """The state of :func:`stream_ahead`: runs pulled, chunks to request, requests in flight."""

    def __init__(self, runs: Iterator[ShardRun], ahead: int, check: Callable[[], None] | None) -> None:
        self._runs = runs
        self._ahead = max(0, ahead)
        self._check = check
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="packdata-readahead")
        self._stop = threading.Event()
        self._ready: deque[ShardRun] = deque()  # pulled, not handed to the caller yet
        self._chunks: dict[int, int] = {}  # id(run) -> chunks in its plan, for the runs pulled
        self._unrequested: deque[tuple[ShardRun, deque[_Chunk]]] = deque()
        self._pending: deque[tuple[ShardRun, _Chunk, Future[bytes]]] = deque()
        self._failure: Exception | None = None  # producing the next run failed: raised when the caller gets there
        self._done = False
        # id(run) -> its span's GET: made in _pull, then read, changed and dropped only in the pool's thread
        self._spans: dict[int, _Span] = {}

    def _pull(self) -> bool:
        """Take the next run from the caller; False when there is none (or producing it failed)."""
        if self._done:
            return False
        try:
            run = next(self._runs)
        except StopIteration:
            self._done = True
            return False
        except Exception as exc:  # kept for the caller: the runs before it are still read whole
            self._failure, self._done = exc, True
            return False
        reader = run.reader
        if not isinstance(reader, RemoteShardReader):
            raise TypeError(f"stream_ahead reads remote shards, but got a {type(reader).__name__}")
        plan = deque(chunk_plan(run.offsets, run.lengths, run.start, run.stop, reader.size, reader.CHUNK))
        self._chunks[id(run)] = len(plan)
        if plan:
            self._spans[id(run)] = _Span(plan[-1][3], 1 + _REOPENS if SpanRequest.possible(reader.fs) else 0)
        self._ready.append(run)
        self._unrequested.append((run, plan))
        return True

    def _top_up(self) -> None:
        """Keep ``ahead + 1`` requests queued or running, pulling the next run when this one is all requested."""
        while len(self._pending) <= self._ahead:
            if not self._unrequested and not self._pull():
                return
            run, plan = self._unrequested[0]
            if not plan:
                self._unrequested.popleft()
                continue
            chunk = plan.popleft()
            self._pending.append((run, chunk, self._pool.submit(self._fetch, run, chunk[2], chunk[3])))

    def _fetch(self, run: ShardRun, base: int, end: int) -> bytes:
        """Bytes ``[base, end)`` of ``run``'s shard (in the pool's thread, chunks in order).

        On S3 the run's chunks come from one GET of its whole span (:class:`SpanRequest`);
        a GET dropped after it gave a chunk is made again from the next unread byte
        (``_REOPENS`` times a run at most); once one gives nothing, or where it cannot be
        made, each chunk is its own ranged request (:meth:`RemoteShardReader.fetch`:
        retried, errors explained).
        """
        reader = cast(RemoteShardReader, run.reader)  # checked in _pull
        span = self._spans.get(id(run))
        data = None if span is None else self._from_span(reader, span, base, end)
        if span is not None and end >= span.end:
            del self._spans[id(run)]
        return data if data is not None else reader.fetch(base, end, self._stop)

    def _from_span(self, reader: RemoteShardReader, span: _Span, base: int, end: int) -> bytes | None:
        """Bytes ``[base, end)`` from ``span``'s GET, opened or made again as needed; None: read them by chunk."""
        while not self._stop.is_set():
            stream = span.stream
            if stream is None:
                if span.opens_left <= 0:
                    return None
                span.opens_left -= 1
                try:
                    stream = span.stream = SpanRequest(
                        reader.fs, reader.remote_path, reader.path, base, span.end, opened=reader.opened
                    )
                except Exception:  # the chunk's own request tells what is wrong (or succeeds)
                    span.opens_left = 0
                    return None
            try:
                data = stream.take(end - base) if stream.at == base else None
            except Exception:
                data = None
            if data is None or stream.at >= stream.end:
                span.stream = None
                with contextlib.suppress(Exception):
                    stream.close()
            if data is not None:
                return data
            if stream.at == stream.start or stream.at != base:  # gave nothing (or not this chunk): by chunk
                span.opens_left = 0
                return None
        return None

    def _drop_spans(self) -> None:
        """Close the GETs left open (a run not read to its end)."""
        for span in list(self._spans.values()):
            if span.stream is not None:
                with contextlib.suppress(Exception):
                    span.stream.close()
        self._spans.clear()

    def next_run(self) -> ShardRun | None:
        """The next run, or None after the last; raises the error that producing it raised."""
        if not self._ready:
            self._pull()
        if self._ready:
            self._top_up()
            return self._ready.popleft()
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        return None

    def records(self, run: ShardRun) -> Iterator[memoryview]:
        """The checked records of ``run``, chunk by chunk, the requests kept ahead."""
        for _ in range(self._chunks.pop(id(run))):
            self._top_up()
            owner, (i, j, base, _), future = self._pending.popleft()
            if owner is not run:
                raise RuntimeError("stream_ahead: read every record of a run before asking for the next one")
            try:
                data = future.result()
            finally:  # a chunk read, or failing to be read, after the pack changed: say that it changed
                if self._check is not None:
                    self._check()
            self._top_up()
            yield from run.reader.check_chunk(memoryview(data), base, run.offsets, run.lengths, i, j, run.payloads)

    def close(self) -> None:
        """Cancel the requests not started and stop retries; the thread ends after its current request."""
        self._stop.set()
        for _, _, future in self._pending:
            future.cancel()
        self._pending.clear()
        with contextlib.suppress(RuntimeError):  # closed twice: the pool is shut down already
            self._pool.submit(self._drop_spans)  # after the request running, in the thread that owns the GETs
        self._pool.shutdown(wait=False, cancel_futures=False)


def fetch_skeleton(url: str, storage_options: dict[str, Any] | None, cache_dir: str | os.PathLike | None) -> Path:
    """A local copy of a remote TFRecord pack without its shards: manifest, sample index, shard side tables.

    A reader streams the shards from ``url`` and reads everything else from
    this copy (``cache_dir``, default the system's temporary folder), which is
    reused while the remote manifest is the same and replaced atomically when
    not (:func:`~packdata.formats.remote_pack.fetch_pack_skeleton`).

    Raises:
        PackFormatError: not a pack, or a file it needs is missing.
        ConfigError: not a TFRecord pack (LMDB reads through local files: stage it).
    """
    shown = display_url(url)
    dest, manifest, _, _ = fetch_pack_skeleton(url, storage_options, cache_dir)
    if manifest.format != NAME:
        raise ConfigError(
            f"{shown}: a {manifest.format} pack is read through local files",
            hint=f"Stage it first: packdata.stage({shown!r}, to='/nvme/cache'), then open the staged copy",
        )
    for shard in manifest.shards:
        if not index_path(dest / shard.file).is_file():
            name = index_path(shard.file).as_posix()
            raise PackFormatError(f"{shown}: {name} is missing", hint="The pack is incomplete")
    return dest
