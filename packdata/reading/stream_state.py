"""The resume states of :class:`~packdata.reading.streaming.TFRecordDataset`: checked when loaded, and replayed.

A state is small and JSON-serialisable: the options and pack that fix a
reader's order (its key), the epoch, and how far the reader's stream went (one
reader's ``yielded``, or a plain ``DataLoader``'s ``yielded_per_worker``).
:func:`check_state` refuses one that does not fit the dataset it is loaded
into; :func:`loader_counts` turns a plain ``DataLoader``'s batch count into
each worker's count; :func:`unread_mask` and :func:`sparse_reads` find the
records a resumed pass must still read, so consumed ones are never read again.
"""

from __future__ import annotations

import itertools
import numbers
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from packdata.errors import ConfigError
from packdata.reading.stream_parts import shuffled

__all__ = ["check_state", "fill_gaps", "loader_counts", "sparse_reads", "unread_mask"]


def check_state(
    state: dict[str, Any], key: dict[str, Any], where: str, stream_lengths: Callable[[int], list[int]]
) -> int:
    """Refuse a state that does not fit the dataset whose order ``key`` holds; returns its epoch.

    ``stream_lengths(num_workers)``: the samples each worker's stream holds this epoch.

    Raises:
        ConfigError: see :meth:`~packdata.reading.streaming.TFRecordDataset.load_state_dict`.
    """
    for name, mine in key.items():
        if name == "pack" and name not in state:  # saved by packdata before the state named its pack
            continue
        if state.get(name) != mine:
            raise ConfigError(
                f"the reader state was saved with {name}={state.get(name)!r}, but this dataset has {name}={mine!r}",
                path=where,
                hint="Resume with the options, pack and world size the state was saved with",
            )
    epoch = state.get("epoch")
    if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 0:  # numpy's ints pass
        raise ConfigError(
            f"the reader state's epoch should be a number from 0 on, but got {epoch!r}",
            path=where,
            hint="Pass the state state_dict or loader_state_dict returned, unchanged",
        )
    if "yielded_per_worker" in state:
        _check_loader_state(state, where, stream_lengths)
    else:  # one reader's: its place and count are numbers (a "0" or 5.9 was compared as given, or cut to 5)
        for name, least in (("worker", 0), ("num_workers", 1), ("yielded", 0)):
            value = state.get(name)
            if type(value) is not int or value < least:
                raise ConfigError(
                    f"the reader state's {name} should be an integer from {least} on, but got {value!r}",
                    path=where,
                    hint="Pass the state state_dict returned, unchanged",
                )
    return int(epoch)


def _check_loader_state(state: dict[str, Any], where: str, stream_lengths: Callable[[int], list[int]]) -> None:
    """Refuse a ``loader_state_dict`` state whose counts do not fit its workers' streams of this epoch."""
    streams = state.get("num_workers")
    if type(streams) is not int or streams < 1:
        raise ConfigError(
            f"the reader state's num_workers should be a positive number of workers, but got {streams!r}",
            path=where,
            hint="Pass the state loader_state_dict returned, unchanged",
        )
    counts = state["yielded_per_worker"]
    if not isinstance(counts, list) or len(counts) != streams:
        got = f"a list of {len(counts)}" if isinstance(counts, list) else type(counts).__name__
        raise ConfigError(
            f"the reader state's yielded_per_worker should be a list of {streams} counts (num_workers={streams}), "
            f"but got {got}",
            path=where,
            hint="Pass the state loader_state_dict returned, unchanged",
        )
    for worker, (count, length) in enumerate(zip(counts, stream_lengths(streams), strict=True)):
        if type(count) is not int or not 0 <= count <= length:
            raise ConfigError(
                f"the reader state's yielded_per_worker should be from 0 to {length} for worker {worker} "
                f"(the samples its stream holds this epoch), but got yielded_per_worker[{worker}]={count!r}",
                path=where,
                hint="Pass the state loader_state_dict returned, unchanged",
            )


def loader_counts(lengths: list[int], batches: int, batch_size: int) -> list[int]:
    """Samples each worker's stream (of ``lengths``) gave after a plain ``DataLoader`` yielded ``batches`` batches.

    The loader takes each batch from one worker in turn, skipping workers that have finished.
    """
    streams = len(lengths)
    left = [-(-length // batch_size) for length in lengths]
    taken = [0] * streams
    worker = 0
    for _ in range(batches):
        if not any(left):
            break
        while not left[worker]:
            worker = (worker + 1) % streams
        taken[worker] += 1
        left[worker] -= 1
        worker = (worker + 1) % streams
    return [min(t * batch_size, n) for t, n in zip(taken, lengths, strict=True)]


def unread_mask(length: int, skip: int, shuffle_buffer: int | None, seed: str) -> np.ndarray:
    """Which of a stream's ``length`` records a pass that already yielded ``skip`` of them has left.

    With a shuffle buffer (``shuffle_buffer``, seeded from ``seed``) its draws are replayed on positions.
    """
    needed = np.ones(length, dtype=bool)
    if shuffle_buffer is not None:
        positions = shuffled(iter(range(length)), shuffle_buffer, random.Random(seed))
        needed[list(itertools.islice(positions, skip))] = False
    else:
        needed[:skip] = False
    return needed


def sparse_reads(
    segments: list[tuple[int, int, int]], needed: np.ndarray
) -> tuple[list[tuple[int, int, int]], list[tuple[np.ndarray, int, int]]]:
    """The record ranges to read for the ``needed`` records of ``segments``, and each segment's span.

    Each segment is read from its first needed record to its last; its span is
    ``(mask, lo, hi)`` for :func:`fill_gaps`.
    """
    position = 0
    reads: list[tuple[int, int, int]] = []
    spans: list[tuple[np.ndarray, int, int]] = []
    for shard, first, end in segments:
        mask = needed[position : position + end - first]
        position += end - first
        hits = np.flatnonzero(mask)
        lo, hi = (int(hits[0]), int(hits[-1]) + 1) if len(hits) else (0, 0)
        if hi > lo:
            reads.append((shard, first + lo, first + hi))
        spans.append((mask, lo, hi))
    return reads, spans


def fill_gaps(records: Iterator[Any], spans: list[tuple[np.ndarray, int, int]]) -> Iterator[Any]:
    """The records :func:`sparse_reads` chose, with ``None`` in place of each record not needed."""
    for mask, lo, hi in spans:
        yield from itertools.repeat(None, lo)
        for k, record in zip(range(lo, hi), records, strict=False):
            yield record if mask[k] else None
        yield from itertools.repeat(None, len(mask) - hi)
