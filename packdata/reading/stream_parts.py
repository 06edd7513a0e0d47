"""The parts :class:`~packdata.reading.streaming.TFRecordDataset` is built from: its stream's record ranges, its
shuffle buffer, and the board its DataLoader workers read the epoch from."""

from __future__ import annotations

import mmap
import random
import struct
from collections.abc import Iterator
from contextlib import suppress
from typing import Any

import numpy as np
import torch

__all__ = ["EpochBoard", "shuffled", "stream_segments"]


def stream_segments(counts: np.ndarray, order: np.ndarray, start: int, stop: int) -> list[tuple[int, int, int]]:
    """``(shard, first, end)`` record ranges covering stream positions ``[start, stop)``.

    The stream is the shards in ``order`` laid end to end; positions past its
    end wrap around to its start (padding repeats the epoch's first samples).
    """
    n = int(counts.sum())
    ordered = counts[order]
    ends = np.cumsum(ordered)
    out: list[tuple[int, int, int]] = []
    while start < stop:
        position = start % n
        take = min(stop - start, n - position)
        lo, hi = position, position + take
        k = int(np.searchsorted(ends, lo, side="right"))
        while lo < hi:
            shard_start = int(ends[k] - ordered[k])
            end = min(hi, int(ends[k]))
            out.append((int(order[k]), lo - shard_start, end - shard_start))
            lo = end
            k += 1
        start += take
    return out


def shuffled(items: Iterator[Any], size: int, rng: random.Random) -> Iterator[Any]:
    """Yield ``items`` through a shuffle buffer of ``size``."""
    buffer: list[Any] = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        j = rng.randrange(size)
        yield buffer[j]
        buffer[j] = item
    rng.shuffle(buffer)
    yield from buffer


_BOARD = struct.Struct("<qq")
_BOARD_SIZE = mmap.PAGESIZE  # the epoch and calls, then one byte per DataLoader worker


class EpochBoard:
    """``(epoch, set_epoch calls)``, where a dataset's copies in ``DataLoader`` workers read it when a pass starts.

    After them, one byte per worker id says that worker already took the state
    :meth:`TFRecordDataset.load_state_dict` loaded in the main process (which
    clears them), so the workers of later passes, copied from a dataset that
    still holds that state, do not resume from it again.

    Forked workers share an anonymous shared map with the dataset (no file, no
    ``/dev/shm``). A copy pickled for a ``spawn``-ed worker carries a
    shared-memory tensor, made at the first pickling and written with the map
    from then on; a loader without workers, or with forked ones, makes none.
    """

    def __init__(self) -> None:
        self._map = mmap.mmap(-1, _BOARD_SIZE)
        self._tensor: torch.Tensor | None = None

    def _views(self) -> list[memoryview | mmap.mmap]:
        return [self._map] if self._tensor is None else [self._map, self._tensor.numpy().data]

    def write(self, epoch: int, calls: int) -> None:
        for view in self._views():
            _BOARD.pack_into(view, 0, epoch, calls)

    def read(self) -> tuple[int, int]:
        return _BOARD.unpack_from(self._views()[-1], 0)

    def clear_taken(self) -> None:
        """No worker has taken the loaded state yet."""
        for view in self._views():
            view[_BOARD.size :] = bytes(_BOARD_SIZE - _BOARD.size)

    def take(self, worker: int) -> bool:
        """Mark the loaded state taken by ``worker``; whether a worker of an earlier pass had taken it."""
        slot = _BOARD.size + worker
        if slot >= _BOARD_SIZE:  # more workers than a page holds: not tracked
            return False
        taken = self._views()[-1][slot] == 1
        for view in self._views():
            view[slot] = 1
        return taken

    def __getstate__(self) -> dict[str, Any]:
        if self._tensor is not None:
            return {"tensor": self._tensor}
        tensor = torch.frombuffer(bytearray(self._map[:]), dtype=torch.uint8)
        with suppress(RuntimeError, OSError):  # else no usable shared memory: a copy by value, as pickle makes
            tensor.share_memory_()
        if tensor.is_shared():
            self._tensor = tensor
        return {"tensor": tensor}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._map = mmap.mmap(-1, _BOARD_SIZE)
        tensor = state["tensor"]
        self._tensor = tensor if tensor.is_shared() else None
        if self._tensor is None:  # a copy by value (pickle, deepcopy): its own board, which its forked workers share
            self._map[:] = tensor.numpy().tobytes()
