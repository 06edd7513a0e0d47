"""The streaming torch dataset over a TFRecord pack: :class:`TFRecordDataset`, its split, shuffle and resume.

How an epoch is split: the pack's shards are put in the epoch's order
(shuffled from ``(seed, epoch)``, the same on every rank), laid end to end, and
the resulting stream of ``N`` samples is cut into ``world_size`` equal
contiguous ranges, one per rank, each cut again into one range per DataLoader
worker. A reader reads whole shards where its range covers them and, where it
starts or ends inside a shard, a record range found through the shard's offsets
index. With many shards each reader gets whole shards; with fewer shards than
readers, shards are shared by record ranges. Either way every sample is read
exactly once per epoch and no two readers read the same record.

Split, shuffle and resume are one state machine, so they stay in one class
here; the view it shares with the map-style
:class:`~packdata.reading.tfrecord_indexed.TFRecordIndexedDataset` is in
:mod:`packdata.reading.tfrecord_view`, the parts it is built from (record ranges, shuffle
buffer, epoch board) in :mod:`packdata.reading.stream_parts`, the checks and replay of
its resume states in :mod:`packdata.reading.stream_state`.
"""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, closing
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from packdata.errors import ConfigError, PackFormatError
from packdata.formats.tfrecord import NAME as TFRECORD
from packdata.formats.tfrecord_remote import ShardRun, stream_ahead
from packdata.pack.urls import display_url
from packdata.reading.decode import DecodeFn, resolve_decoder
from packdata.reading.ranks import RankCheck, check_rank_world, resolve_rank_world
from packdata.reading.samplers import order_number, per_rank_count
from packdata.reading.stream_parts import EpochBoard, shuffled, stream_segments
from packdata.reading.stream_state import check_state, fill_gaps, loader_counts, sparse_reads, unread_mask
from packdata.reading.tfrecord_view import _TFRecordView

__all__ = ["TFRecordDataset"]

DEFAULT_SHUFFLE_BUFFER = 1024


class TFRecordDataset(_TFRecordView, IterableDataset):
    """Streams a TFRecord pack's samples as ``(sample, label)``, split across ranks and workers.

    Each epoch yields every sample exactly once across all ranks and workers,
    whatever their numbers and the number of shards (see the module docstring
    for how the stream is cut), and every rank yields exactly ``len(self)``
    samples so DDP never waits on a short rank: with ``drop_uneven=False`` (the
    default) ranks are padded by repeating the epoch's first ``world_size - 1``
    samples at most; with ``drop_uneven=True`` up to ``world_size - 1`` samples
    are left out of the epoch instead.

    Workers: ``__init__`` reads only the manifest. Shard files and their
    offsets indexes are opened inside ``__iter__``, in the worker that reads
    them, and closed when it is done, so the dataset pickles to ``spawn``-ed
    workers and nothing is shared across a fork. The rank and world size are
    resolved once, at construction (``torch.distributed`` if initialised,
    else ``RANK``/``WORLD_SIZE``): build the dataset after
    ``init_process_group``. ``set_epoch`` (called before each epoch's loader
    iterator is made) also reaches the copies ``persistent_workers=True`` keeps.
    The first ``set_epoch``, or the first pass in the main process
    (``num_workers=0``), compares the pack and the order options across the
    ranks of an initialised ``torch.distributed`` group (``check_ranks``);
    read by workers in such a job before any ``set_epoch``, it raises
    ``ConfigError`` (its workers cannot compare: nothing would).

    Resuming: see ``docs/architecture.md``; resume at the same world size and ``num_workers``.

    Args:
        path: the pack (directory with ``manifest.json``).
        transform: applied to the decoded sample.
        target_transform: applied to the label.
        decode: ``"auto"`` (by the manifest's kind), ``"pil"``, ``"bytes"``,
            ``"text"``, or a callable on the bytes; a multi-field pack also takes
            a mapping field -> decoder (see :class:`~packdata.LMDBDataset`).
        shuffle: shuffle shard order and samples each epoch.
        seed: the shuffle seed, an integer from 0 on; must be the same on every rank.
        shuffle_buffer: records held by each reader's shuffle buffer. For a
            local pack the buffer holds views into memory-mapped shard chunks,
            not copies: 1,024 records of 100 KB keep about 100 MB of page cache
            mapped per worker, and no process memory. For a pack at a URL it
            holds copies (about 100 MB of process memory per worker), so that
            no record keeps its whole downloaded chunk alive.
        rank, world_size: this process's place in a distributed job; by default
            from :func:`~packdata.reading.ranks.resolve_rank_world`.
        drop_uneven: drop samples rather than pad so that ranks are equal.
        check_crc: check both CRC32Cs of every record (framing is always checked).
        fields, transforms, missing: a multi-field pack's fields to return,
            per-field transforms and values for fields a sample lacks, as for :class:`~packdata.LMDBDataset`.
        storage_options, cache_dir: for a pack URL (``s3://bucket/train``): fsspec
            options, and where the manifest, index and side tables are kept
            (shards stream from the URL, chunks fetched ahead; see
            :mod:`packdata.formats.tfrecord_remote`).
        check_ranks: compare the sample count, the pack's shards' checksums and
            the order options with every rank's, once, and raise
            :class:`~packdata.errors.RankMismatchError` on every rank if they
            differ (see :mod:`packdata.reading.ranks`). Pass ``False`` where the
            dataset is built on some ranks only.
    """

    pack_format = TFRECORD

    def __init__(
        self,
        path: str | os.PathLike,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        decode: str | DecodeFn | Mapping[str, str | DecodeFn] = "auto",
        *,
        shuffle: bool = True,
        seed: int = 0,
        shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER,
        rank: int | None = None,
        world_size: int | None = None,
        drop_uneven: bool = False,
        check_crc: bool = True,
        fields: Sequence[str] | None = None,
        transforms: Mapping[str, Callable[[Any], Any]] | None = None,
        missing: Mapping[str, Any] | None = None,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | os.PathLike | None = None,
        check_ranks: bool = True,
    ) -> None:
        _TFRecordView.__init__(
            self,
            path,
            transform,
            target_transform,
            decode,
            check_crc,
            fields,
            transforms,
            storage_options,
            cache_dir,
            missing,
        )
        if shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer should be at least 1, but got shuffle_buffer={shuffle_buffer}")
        self.shuffle = shuffle
        self.seed = order_number("seed", seed)
        self.shuffle_buffer = shuffle_buffer
        self._rank_given = rank, world_size
        self.rank, self.world_size = resolve_rank_world(rank, world_size)
        self.drop_uneven = drop_uneven
        self.epoch = 0
        self._epoch_calls = 0  # set_epoch calls this copy has seen
        self._shared_epoch = EpochBoard()  # persistent workers' copies read it when a pass starts
        self._position = 0  # samples this reader's stream has yielded in the current pass
        self._resume: dict[str, Any] | None = None  # a loaded state the next pass starts from
        self._after_resume = False  # the last pass was a loaded state's: the next takes set_epoch's epoch
        self._resume_from_main = False  # the loaded state was loaded in the main process (not by a worker)
        n = self.pack.manifest.num_samples
        if n == 0:  # packdata writes no empty pack: nothing to pad from, whatever the options
            raise PackFormatError(
                "pack holds no samples: an epoch would be empty",
                path=self.where,
                hint="Convert a source that holds samples",
            )
        if per_rank_count(n, self.world_size, drop_uneven) == 0:  # the options, not the pack, are wrong
            raise ConfigError(
                f"drop_uneven=True leaves no samples: {n} samples over world_size={self.world_size}",
                path=self.where,
                hint="Pass drop_uneven=False to pad instead",
            )
        self._rank_check = RankCheck(
            check_ranks,
            display_url(self._url) if self._url else os.fspath(self.path),
            samples=n,
            pack=self.pack.manifest.shards_digest(),
            seed=self.seed,
            shuffle=shuffle,
            drop_uneven=drop_uneven,
        )
        self._rank_check.note_group(self.world_size)

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` on the next iteration (call on every rank).

        A state loaded by :meth:`load_state_dict` belongs to its epoch: setting
        another epoch discards it. The epoch also reaches the copies held by
        ``persistent_workers``: each takes it when its next pass starts.
        """
        check_rank_world("TFRecordDataset", self._rank_given, (self.rank, self.world_size))
        self._rank_check("TFRecordDataset", self.world_size)
        self._use_epoch(order_number("epoch", epoch))
        self._epoch_calls += 1
        self._shared_epoch.write(epoch, self._epoch_calls)

    def _use_epoch(self, epoch: int) -> None:
        """Take ``epoch`` in this copy only."""
        if epoch != self.epoch:
            self._resume, self._position = None, 0
        self.epoch = epoch

    def _state_key(self) -> dict[str, Any]:
        """What fixes a reader's order, saved with its position and checked on load.

        The options, and the pack by its shards' checksums (a staged copy's are
        the same; a pack converted or uploaded again since has another order).
        """
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_buffer": self.shuffle_buffer,
            "num_samples": int(self.pack.manifest.num_samples),
            "num_shards": len(self._counts),
            "pack": self.pack.manifest.shards_digest(),
            "rank": self.rank,
            "world_size": self.world_size,
            "drop_uneven": self.drop_uneven,
        }

    def state_dict(self) -> dict[str, Any]:
        """This reader's position in the epoch: small and JSON-serialisable.

        A reader is one ``(rank, worker)`` stream. Its order within an epoch is
        a pure function of ``(seed, epoch, rank, world_size, worker,
        num_workers)``, so the state is the epoch and the samples the stream
        has yielded. ``StatefulDataLoader`` calls this in each worker (after
        each batch) and keeps one state per worker; called in the main process
        it describes the ``num_workers=0`` stream.
        """
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if self._resume is not None:  # loaded, not yet iterated: the loaded position
            return dict(self._resume)
        return {
            "version": 1,
            "epoch": self.epoch,
            **self._state_key(),
            "worker": worker,
            "num_workers": num_workers,
            "yielded": int(self._position),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict`` on the next iteration, in the same order.

        Load it into the reader that saved it: ``StatefulDataLoader`` does so
        in each worker. The next pass yields exactly the samples the
        interrupted pass had left, in the same order. Records already consumed
        are not read again (the shuffle buffer's draws are replayed on
        positions, not on data). The state is for that one pass: the pass
        after it reads the epoch :meth:`set_epoch` set last.

        Raises:
            ConfigError: the state was saved with other options (seed, shuffle,
                shuffle buffer, pack, rank, world size, drop_uneven), its epoch
                is not an integer from 0 on, a :meth:`state_dict` state's
                ``worker``, ``num_workers`` or ``yielded`` is not an integer, or a
                :meth:`loader_state_dict` state's ``num_workers`` or
                ``yielded_per_worker`` do not describe that many streams of
                this epoch; the worker is checked when iteration starts.
        """
        self.epoch = check_state(state_dict, self._state_key(), self.where, self._stream_lengths)
        self._resume = dict(state_dict)
        self._position = int(state_dict.get("yielded", 0))
        self._resume_from_main = get_worker_info() is None
        if self._resume_from_main:  # its workers' copies take it once, in the next pass
            self._shared_epoch.clear_taken()

    def _stream_lengths(self, num_workers: int) -> list[int]:
        """Samples each of ``num_workers`` workers' streams of this rank holds this epoch."""
        return [sum(end - first for _, first, end in self.reader_segments(w, num_workers)) for w in range(num_workers)]

    def loader_state_dict(self, batches: int, *, batch_size: int, num_workers: int = 0) -> dict[str, Any]:
        """This rank's state after a plain ``DataLoader`` yielded ``batches`` batches of this epoch.

        For training without ``StatefulDataLoader``: a ``DataLoader(self,
        batch_size=batch_size, num_workers=num_workers)`` (``drop_last=False``,
        ``in_order=True``, the defaults) takes each batch from one worker in
        turn, skipping workers that have finished, so the batch count tells
        how far each worker's stream went. Save the result, and after a
        restart call :meth:`load_state_dict` on the new dataset before
        building the loader (with the same ``batch_size`` and ``num_workers``):
        each worker then continues its own stream exactly, so the rest of the
        epoch holds exactly the remaining samples; with several workers the
        batches interleave differently (a new ``DataLoader`` starts its
        round-robin at worker 0), which ``StatefulDataLoader`` avoids.
        """
        if batch_size < 1 or batches < 0 or num_workers < 0:  # a batch size of 0 was a ZeroDivisionError
            raise ValueError(
                f"batches, batch_size and num_workers should be counts (batch_size at least 1), but got "
                f"batches={batches}, batch_size={batch_size}, num_workers={num_workers}"
            )
        lengths = self._stream_lengths(max(num_workers, 1))
        return {
            "version": 1,
            "epoch": self.epoch,
            **self._state_key(),
            "num_workers": len(lengths),
            "yielded_per_worker": loader_counts(lengths, batches, batch_size),
        }

    def __len__(self) -> int:
        """Samples this rank yields per epoch (all its workers together)."""
        return per_rank_count(self.pack.manifest.num_samples, self.world_size, self.drop_uneven)

    def shard_order(self) -> np.ndarray:
        """The shards in this epoch's order (the same on every rank and worker)."""
        if not self.shuffle:
            return np.arange(len(self._counts))
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self._counts))

    def reader_segments(self, worker: int = 0, num_workers: int = 1) -> list[tuple[int, int, int]]:
        """``(shard, first record, end record)`` ranges worker ``worker`` of this rank reads this epoch."""
        per_rank = len(self)
        base = self.rank * per_rank
        start = base + worker * per_rank // num_workers
        stop = base + (worker + 1) * per_rank // num_workers
        return stream_segments(self._counts, self.shard_order(), start, stop)

    def _runs(self, segments: list[tuple[int, int, int]]) -> Iterator[ShardRun]:
        """Each segment's shard opened, with its records' offsets, lengths and payload spans (None: parse)."""
        for shard, first, end in segments:
            reader = self._shard_reader(shard)
            try:
                reader.open()
                self.pack.check_unchanged()  # after the open: the file opened is the generation checked
                table = self._load_records(shard, payloads=self.field_spec is None)  # multi-field: parsed
            except PackFormatError:
                reader.close()
                self.pack.check_unchanged()  # a shard failing its checks because the pack changed: say so
                raise
            yield ShardRun(reader, table.offsets, table.lengths, first, end, table.payloads, shard)

    def _records(
        self, segments: list[tuple[int, int, int]], copy: bool = False
    ) -> Iterator[tuple[memoryview | bytes, int, int]]:
        """``(payload, label, sample index)`` of each record: views into mapped chunks, or ``bytes`` with ``copy``.

        ``copy`` (no shuffle buffer holds the records) lets large records be read one by one
        (see :meth:`TFRecordShardReader.stream`). A remote pack's shards stream
        through one read-ahead (:func:`~packdata.formats.tfrecord_remote.stream_ahead`),
        so the next shard's first chunks are fetched while this one is read.
        """
        runs = self._runs(segments)
        streams: Iterator[tuple[ShardRun, Iterator[memoryview | bytes]]]
        with ExitStack() as stack:
            if self._url is None:
                streams = (
                    (run, run.reader.stream(run.offsets, run.lengths, run.start, run.stop, run.payloads, copy=copy))
                    for run in runs
                )
            else:  # records copied out of the downloaded chunks: a held record must not pin its chunk
                # each chunk checked as it arrives: a copy replaced since (the remote pack changed) stops the reader;
                # closed however this reader ends: an error's traceback must not keep the read-ahead thread running
                checked = stack.enter_context(closing(stream_ahead(runs, check=self.pack.check_unchanged)))
                streams = ((run, map(bytes, data)) for run, data in checked)
            for run, data in streams:
                path, base, first = run.reader.path, int(self._first[run.shard]), run.start  # a URL: named so
                try:
                    if run.payloads is not None:  # written by packdata: payloads sliced out, labels from the index
                        labels = self.pack.index.labels[base + first : base + run.stop].tolist()
                        yield from zip(data, labels, range(base + first, base + run.stop), strict=True)
                    else:
                        for k, record in enumerate(data, first):
                            payload, label = self._parse(record, path, int(run.offsets[k]), base + k)
                            yield payload, label, base + k
                finally:
                    run.reader.close()

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        resolved, seen = (self.rank, self.world_size), self._rank_check.group
        check_rank_world("TFRecordDataset", self._rank_given, resolved, seen)  # seen: a spawned worker's
        self._rank_check("TFRecordDataset", self.world_size)  # in the main process only
        if info is not None:
            self._rank_check.refuse_unchecked("TFRecordDataset", self.rank, self.world_size)
        epoch, calls = self._shared_epoch.read()
        if self._resume is not None and self._resume_from_main and info is not None and self._shared_epoch.take(worker):
            self._resume, self._after_resume = None, True  # a worker of an earlier pass resumed from it: not again
        # a persistent worker's copy: set_epoch was called on the original since; or the pass after a loaded
        # state's (StatefulDataLoader starts one more when the state's epoch had ended): set_epoch's epoch again
        if calls != self._epoch_calls or (self._after_resume and calls):
            self._epoch_calls = calls
            self._use_epoch(epoch)
        resume, self._resume = self._resume, None
        self._after_resume = resume is not None
        self._position = 0
        if resume is not None:
            return self._named(self._resumed(resume, worker, num_workers))
        return self._named(self._iterate(worker, num_workers))

    def _iterate(self, worker: int, num_workers: int) -> Iterator[tuple[Any, Any]]:
        records = self._records(self.reader_segments(worker, num_workers), copy=not self.shuffle)
        if self.shuffle:
            rng = random.Random(f"packdata-{self.seed}-{self.epoch}-{self.rank}-{worker}")
            records = shuffled(records, self.shuffle_buffer, rng)
        if (
            self.field_spec is None
            and self.decode is resolve_decoder("bytes")
            and self.transform is None
            and self.target_transform is None
        ):
            for data, label, _ in records:  # raw bytes: no decode or transform call per sample
                self._position += 1
                yield bytes(data), label
            return
        for data, label, index in records:  # the buffer holds page-cache views; copy each payload once here
            self._position += 1
            yield self._finish(bytes(data), label, index)

    def _resumed(self, state: dict[str, Any], worker: int, num_workers: int) -> Iterator[tuple[Any, Any]]:
        """The rest of a pass from ``state``: consumed records are skipped, not read."""
        if "yielded_per_worker" in state and state.get("num_workers") == num_workers:  # from loader_state_dict
            state = {**state, "worker": worker, "yielded": state["yielded_per_worker"][worker]}
        if (state.get("worker"), state.get("num_workers")) != (worker, num_workers):
            saved = f"worker {state.get('worker')} of {state.get('num_workers')}"
            if "yielded_per_worker" in state:  # a loader_state_dict state: every worker's count, none named
                saved = f"the streams of {state.get('num_workers')} workers (loader_state_dict)"
            raise ConfigError(
                f"the reader state is {saved}, but it was loaded into worker {worker} of {num_workers}",
                path=self.where,
                hint="Resume with the num_workers the state was saved with",
            )
        segments = self.reader_segments(worker, num_workers)
        length = sum(end - first for _, first, end in segments)
        skip = int(state["yielded"])
        if not 0 <= skip <= length:
            raise ConfigError(
                f"the reader state says {skip} samples yielded, but this reader's epoch holds {length}",
                path=self.where,
                hint="Pass the state this reader saved, unchanged",
            )
        seed = f"packdata-{self.seed}-{self.epoch}-{self.rank}-{worker}"
        needed = unread_mask(length, skip, self.shuffle_buffer if self.shuffle else None, seed)
        records: Iterator[Any] = self._sparse_records(segments, needed)
        if self.shuffle:
            records = shuffled(records, self.shuffle_buffer, random.Random(seed))
        self._position = skip
        for item in itertools.islice(records, skip, None):
            data, label, index = item
            self._position += 1
            yield self._finish(bytes(data), label, index)
        if skip == length and num_workers == 1 and skip > 0:
            self.set_epoch(self.epoch + 1)  # resumed where the epoch ended: the next pass is the next epoch

    def _sparse_records(self, segments: list[tuple[int, int, int]], needed: np.ndarray) -> Iterator[Any]:
        """Like :meth:`_records`, with ``None`` in place of records not ``needed`` (those are not read)."""
        reads, spans = sparse_reads(segments, needed)
        return fill_gaps(self._records(reads), spans)

    def __repr__(self) -> str:
        return (
            f"TFRecordDataset({self.where!r}, samples={self.pack.manifest.num_samples}, "
            f"shards={len(self._counts)}, rank={self.rank}/{self.world_size})"
        )
