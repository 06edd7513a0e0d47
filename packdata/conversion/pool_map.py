"""A function over items in a thread pool, results in input order, memory bounded: the read pipeline's engine.

:func:`ordered_map` runs a chunk of items per task and keeps a bounded number of
chunks in flight, tuned as it runs (:class:`_InFlight`): none (the caller's
thread reads) where threads only take the GIL from the writer, more where reads
wait on storage. Both engines' read pipeline (:mod:`packdata.conversion.load`)
and :class:`~packdata.conversion.writer.PackWriter`'s encoding run on it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

__all__ = ["ordered_map"]

T = TypeVar("T")
R = TypeVar("R")


def ordered_map(
    fn: Callable[[T], R], items: Iterator[T], pool: ThreadPoolExecutor, depth: int, chunk: int = 16
) -> Iterator[tuple[T, R]]:
    """``fn`` over ``items`` in the pool, a chunk per task, yielding ``(item, result)`` in input order.

    At most ``depth`` chunks are in flight, so memory stays bounded whatever
    the number of items; how many, or none (``fn`` then runs in the caller's
    thread), is tuned as it runs (:class:`_InFlight`). An exception from ``fn``
    is raised where its item's result is due.
    """
    pending: deque[tuple[list[T], Future[tuple[list[R], float]]]] = deque()
    in_flight = _InFlight(depth)

    def resolve(item: tuple[list[T], Future[tuple[list[R], float]]]) -> Iterator[tuple[T, R]]:
        batch, future = item
        results, seconds = future.result()
        in_flight.done(seconds)
        yield from zip(batch, results, strict=True)

    for batch in _chunks(items, chunk):
        if in_flight.limit == 0 and not pending:  # no hand-off between threads: each costs the GIL twice
            results, seconds = _apply(fn, batch)
            in_flight.done(seconds)
            yield from zip(batch, results, strict=True)
            continue
        pending.append((batch, pool.submit(_apply, fn, batch)))
        while len(pending) >= max(1, in_flight.limit):
            yield from resolve(pending.popleft())
    while pending:
        yield from resolve(pending.popleft())


class _InFlight:
    """How many chunks to keep in flight, or none (the caller's thread runs them): tried as it runs, the faster kept.

    More reads in flight pay where each waits on storage (a cold disk, a
    network filesystem); on a warm page cache the reads are Python work under
    the GIL, and threads only take it from the writer (8 reader threads
    convert small files about 1.5x slower than 2 on 2 cores, and 2 about 1.35x
    slower than none). So it starts at 2 and, one window of ``window`` chunks
    at a time, tries none, or twice as many, keeping a trial only if chunks came
    at least 10% faster. None is tried only while an item took under
    :attr:`CHEAP` seconds (served from memory: no wait for threads to overlap;
    a window of remote reads one at a time would cost minutes), and a failed
    try waits twice as long each time; a failed doubling is tried again
    ``patience`` windows later. From none it tries threads again every
    ``patience`` windows (storage can change: a cold source warms up, a slow one gets busy).
    """

    CHEAP = 200e-6

    def __init__(
        self, most: int, window: int = 32, patience: int = 16, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.most, self.window, self.patience, self._clock = max(1, most), window, patience, clock
        self.limit = min(2, self.most)
        self._threaded = self.limit  # the count with threads to try again from none
        self._count, self._since = 0, clock()
        self._trial_from: tuple[int, float] | None = None  # (limit before the trial, its rate)
        self._wait = 1  # windows before the next doubling, or (at none) the next try of threads
        self._none_wait, self._none_backoff = 1, patience  # windows before the next try of none
        self._item_seconds = 0.0  # summed over the window's chunks

    def done(self, item_seconds: float = 0.0) -> None:
        """Count one chunk taken by the caller, whose items took ``item_seconds`` each; judge or start a trial."""
        self._count += 1
        self._item_seconds += item_seconds
        if self._count < self.window:
            return
        now = self._clock()
        cheap = self._item_seconds / self._count < self.CHEAP
        rate, self._count, self._since, self._item_seconds = self._count / max(now - self._since, 1e-9), 0, now, 0.0
        if self._trial_from is not None and not self._judge(*self._trial_from, rate):
            return
        if self.limit == 0:
            self._wait -= 1
            if self._wait <= 0 or not cheap:  # items turned slow (a cold part of the source): threads at once
                self._try(self._threaded, rate)
        else:
            self._wait, self._none_wait = self._wait - 1, self._none_wait - 1
            if self._none_wait <= 0 and cheap:
                self._try(0, rate)
            elif self._wait <= 0 and self.limit < self.most:
                self._try(min(self.most, 2 * self.limit), rate)

    def _try(self, limit: int, rate: float) -> None:
        self._trial_from, self.limit = (self.limit, rate), limit

    def _judge(self, before: int, before_rate: float, rate: float) -> bool:
        """End a trial: keep its limit if it paid, else go back, and schedule the next; True when more in flight paid.

        (The next doubling is then tried at once, so a slow source climbs to ``most`` in as many windows.)
        """
        self._trial_from, trial = None, self.limit
        kept = rate >= 1.1 * before_rate
        if not kept:
            self.limit = before
        if self.limit:
            self._threaded = self.limit
        if (trial == 0 and not kept) or (before == 0 and kept):  # none was the slower: try it less often
            self._none_wait, self._none_backoff = self._none_backoff, 2 * self._none_backoff
        if self.limit == 0 or (not kept and trial > before > 0):  # at none, or a doubling that did not pay
            self._wait = self.patience
        return kept and trial > before  # more in flight paid: try more at once


def _apply(fn: Callable[[T], R], batch: list[T]) -> tuple[list[R], float]:
    """``fn`` over ``batch``, and the seconds it took an item on average."""
    start = time.perf_counter()
    results = [fn(item) for item in batch]
    return results, (time.perf_counter() - start) / len(batch)


def _chunks(items: Iterator[T], size: int) -> Iterator[list[T]]:
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
