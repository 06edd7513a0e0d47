"""Samplers for map-style packs.

:class:`BlockShuffleSampler` shuffles with locality: it cuts ``0..N-1`` into
blocks of consecutive indices, shuffles the blocks, and shuffles samples only
inside a window of consecutive (shuffled) blocks. A cold page cache or a network
disk then serves each window from ``window`` contiguous runs instead of
``window * block_size`` scattered 4 KB faults, while samples still travel the
whole pack (see :func:`shuffle_quality`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Sized
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from torch.utils.data import Sampler

from packdata.errors import ConfigError
from packdata.pack.manifest import Manifest
from packdata.reading.ranks import RankCheck, check_rank_world, pack_of, resolve_rank_world
from packdata.reading.readahead import ReadAhead

__all__ = [
    "BlockShuffleSampler",
    "ShuffleQuality",
    "block_shuffle_order",
    "shuffle_quality",
]


def order_number(name: str, value: Any) -> int:
    """``value``, checked as the seed or epoch of a shuffle: an integer from 0 on (numpy's generators refuse less).

    Raises:
        ValueError: naming ``name`` and the value.
    """
    if not _natural(value):
        raise ValueError(f"{name} should be an integer from 0 on, but got {name}={value!r}")
    return value


def _natural(value: object) -> bool:
    """Whether ``value`` is an integer from 0 on (Python's or numpy's; not a bool)."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and int(value) >= 0


def per_rank_count(n: int, world_size: int, drop_last: bool) -> int:
    """Samples each rank gets per epoch: ``ceil(n / world)`` padded, ``floor`` when dropping."""
    return n // world_size if drop_last else math.ceil(n / world_size)


def block_shuffle_order(
    n: int,
    *,
    block_size: int,
    window: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    rank: int = 0,
    world_size: int = 1,
    drop_last: bool = False,
) -> np.ndarray:
    """The indices rank ``rank`` visits in ``epoch``: a pure function of its arguments.

    The whole-pack order is computed identically on every rank (blocks
    shuffled from ``(seed, epoch)``, then samples shuffled inside each window of
    ``window`` blocks), padded by repeating its start (or cut, with
    ``drop_last``) to a multiple of ``world_size``, and rank ``r`` takes the
    ``r``-th contiguous slice, so each rank reads its own windows. Resuming
    mid-epoch is ``order[start:]``.
    """
    if shuffle:
        rng = np.random.default_rng([seed, epoch])
        block_size = min(block_size, max(n, 1))  # one block either way; a huge one would overflow numpy's int64
        num_blocks = math.ceil(n / block_size)
        perm = rng.permutation(num_blocks)
        starts = perm * block_size
        sizes = np.minimum(starts + block_size, n) - starts
        ends = np.cumsum(sizes)
        order = np.repeat(starts - (ends - sizes), sizes) + np.arange(n)  # the blocks laid end to end
        cut = 0
        for w in range(0, num_blocks, window):
            stop = int(ends[min(w + window, num_blocks) - 1])
            rng.shuffle(order[cut:stop])
            cut = stop
    else:
        order = np.arange(n)
    per_rank = per_rank_count(n, world_size, drop_last)
    total = per_rank * world_size
    if total > n:
        order = np.concatenate([order, np.resize(order, total - n)])
    return order[rank * per_rank : (rank + 1) * per_rank]


def _layout(order: np.ndarray, world_size: int, drop_last: bool) -> np.ndarray:
    """``order`` padded by repeating its start (or cut) to ``world_size`` equal contiguous slices."""
    total = per_rank_count(len(order), world_size, drop_last) * world_size
    if total > len(order):
        return np.concatenate([order, np.resize(order, total - len(order))])
    return order[:total]


_MOST_RANKS = 1 << 20
"""World sizes a saved state may name whatever the pack's size (its layout is 8 bytes a rank: 8 MiB)."""


def _is_phase(phase: object, most: int) -> bool:
    """Whether ``phase`` is a ``[world_size, consumed]`` pair of a sampler state, world sizes at most ``most``."""
    if not isinstance(phase, list | tuple) or len(phase) != 2 or not all(_natural(v) for v in phase):
        return False
    return 1 <= phase[0] <= most


class ResumablePass:
    """A sampler's pass over an epoch, resumable from a loaded position: the ``__iter__`` both samplers share.

    The sampler provides ``_stream()`` (this rank's items for the current phase
    of the epoch, from its start) and ``_iterate(items)`` (yields them, adding
    one to ``_yielded`` each), and sets ``_history``, ``_start``, ``_yielded``
    and ``_pending`` as :meth:`BlockShuffleSampler.load_state_dict` does.
    """

    epoch: int
    rank: int
    world_size: int
    _rank_given: tuple[int | None, int | None]
    _rank_check: RankCheck
    _history: list[list[int]]  # [world_size, consumed] of this epoch's earlier phases
    _start: int  # position in this rank's stream where the current (or pending) pass starts
    _yielded: int  # position reached by the current pass
    _pending: bool  # a loaded position the next pass starts from

    def _stream(self) -> Any:
        raise NotImplementedError

    def _iterate(self, items: Any) -> Iterator[Any]:
        raise NotImplementedError

    def _load_position(self, state: dict[str, Any], samples: int, unit: str) -> None:
        """Take a state's ``epoch`` and ``consumed`` for the next pass (``unit`` names what is counted).

        The last ``[world_size, consumed]`` phase is the position when it is this
        world size's; otherwise it is an earlier phase too and the position is 0.

        Raises:
            ConfigError: they are malformed, or do not fit this epoch; the sampler is then left as it was.
        """
        phases, epoch = state.get("consumed"), state.get("epoch")
        most = max(samples, self.world_size, _MOST_RANKS)  # a layout holds a world's ranks: bounded
        if not isinstance(phases, list) or not phases or not all(_is_phase(p, most) for p in phases):
            raise ConfigError(
                f"the sampler state's consumed should be a non-empty list of [world_size, {unit}] pairs of integers "
                f"(world_size from 1 to {most}, {unit} from 0 on), but got {str(phases)[:80]}",
                hint="Pass the state state_dict() returned, unchanged",
            )
        try:
            epoch = order_number("epoch", epoch)
        except ValueError as exc:
            raise ConfigError(
                f"the sampler state's {exc}", hint="Pass the state state_dict() returned, unchanged"
            ) from None
        pairs = [[int(w), int(c)] for w, c in phases]
        history, position = (pairs[:-1], pairs[-1][1]) if pairs[-1][0] == self.world_size else (pairs, 0)
        before = self.epoch, self._history
        self.epoch, self._history = int(epoch), history
        try:  # nothing changes unless the whole state fits this epoch
            length = len(self._stream())
            if position > length:
                raise ValueError(f"says {position} {unit} consumed, but this rank's epoch holds {length}")
        except ValueError as exc:
            self.epoch, self._history = before
            if isinstance(exc, ConfigError):  # drop_last leaves this epoch nothing
                raise
            raise ConfigError(f"the sampler state {exc}", hint="Pass the state this rank saved, unchanged") from None
        self._start = self._yielded = position
        self._pending = True

    def _pass(self, owner: str) -> Iterator[Any]:
        """The next pass: the whole epoch, or the rest of a loaded one."""
        check_rank_world(owner, self._rank_given, (self.rank, self.world_size))
        self._rank_check(owner, self.world_size)
        resumed, self._pending = self._pending, False
        if not resumed:
            self._history, self._start = [], 0  # a new pass over the whole epoch
        stream = self._stream()
        if resumed and self._start >= len(stream):  # resumed where the epoch ended
            self._history, self._start, self._yielded = [], 0, 0
            self.epoch += 1
            return iter([])
        self._yielded = self._start
        return self._iterate(stream[self._start :])


class ShuffleQuality(NamedTuple):
    """How far an order moves samples from their pack order (see :func:`shuffle_quality`)."""

    displacement: float  # mean |order[k] - k| / n: 0 in pack order, about 1/3 for a uniform shuffle
    correlation: float  # Spearman correlation of position and index: 1 in pack order, about 0 uniform


def shuffle_quality(order: np.ndarray | list[int]) -> ShuffleQuality:
    """Measure a permutation of ``0..n-1`` against pack order and a uniform shuffle.

    ``displacement`` says how far samples travel from their pack position (a
    uniform shuffle gives about 1/3, pack order 0); ``correlation`` says how much
    of pack order survives (about 0 uniform, 1 in pack order). A block shuffle
    over many blocks scores close to a uniform shuffle on both, while a shuffle
    buffer of ``b`` samples over pack order scores about ``b / 3n`` and ``1``.
    """
    order = np.asarray(order, dtype=np.int64)
    n = len(order)
    if n < 2:
        return ShuffleQuality(0.0, 1.0)
    positions = np.arange(n)
    displacement = float(np.abs(order - positions).mean() / n)
    ranks = np.empty(n, dtype=np.int64)
    ranks[np.argsort(order, kind="stable")] = positions  # ties (padding) broken by position
    correlation = float(np.corrcoef(positions, ranks)[0, 1])
    return ShuffleQuality(displacement, correlation)


class BlockShuffleSampler(ResumablePass, Sampler[int]):
    """Locality-aware shuffling for map-style packs (LMDB, indexed TFRecord), DDP-aware.

    Each epoch, blocks of ``block_size`` consecutive indices are shuffled, then
    samples are shuffled inside each window of ``window`` consecutive blocks,
    so a batch mixes samples from ``window`` places in the pack and storage is
    read in runs of about ``block_size`` records. Like ``DistributedSampler``,
    every rank computes the same whole-pack order, pads it by repeating its
    start (or drops its tail with ``drop_last=True``) so every rank gets
    ``len(self)`` samples, and takes its own contiguous slice: an epoch visits
    each sample exactly once across ranks (plus at most ``world_size - 1``
    repeats when padding). Call :meth:`set_epoch` before each epoch.

    The order is :func:`block_shuffle_order` of ``(seed, epoch, rank,
    world_size)``: the state is just ``seed`` and ``epoch``.

    Resuming (also at another world size): :meth:`state_dict` / :meth:`load_state_dict`;
    see ``docs/architecture.md``.

    Args:
        dataset_or_length: a sized dataset, or the number of samples.
        block_size: consecutive indices per block (default 128).
        window: blocks shuffled together (default 32: 4,096 samples).
        seed: the shuffle seed, an integer from 0 on; must be the same on every rank.
        shuffle: ``False`` visits pack order (still split across ranks).
        rank, world_size: default from :func:`~packdata.reading.ranks.resolve_rank_world`.
        drop_last: drop the tail instead of padding to equal per-rank counts.
        read_ahead: given a pack dataset (``LMDBDataset``, ``TFRecordIndexedDataset``),
            ask the kernel for the next window's records while the current one
            is read (:class:`~packdata.reading.readahead.ReadAhead`), so a cold
            page cache is filled in long sequential reads. Hints only: what is
            read does not change.
        check_ranks: in a job with an initialised ``torch.distributed`` group,
            the first iteration compares the pack (sample count, shards'
            checksums) and the order options with every rank's, once, and
            raises :class:`~packdata.errors.RankMismatchError` on every rank if
            they differ (see :mod:`packdata.reading.ranks`). Pass ``False`` where
            the sampler is built on some ranks only.
    """

    def __init__(
        self,
        dataset_or_length: Sized | int,
        *,
        block_size: int = 128,
        window: int = 32,
        seed: int = 0,
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        read_ahead: bool = True,
        check_ranks: bool = True,
    ) -> None:
        if isinstance(dataset_or_length, numbers.Number) and not _natural(dataset_or_length):
            raise ValueError(f"the number of samples should be an integer from 1 on, but got {dataset_or_length!r}")
        n = int(dataset_or_length) if _natural(dataset_or_length) else len(dataset_or_length)  # type: ignore[arg-type]
        pack = getattr(dataset_or_length, "pack", None)
        manifest = getattr(pack, "manifest", None)
        self._pack: tuple[Path, Manifest] | None = None  # the pack to read ahead in
        if read_ahead and isinstance(manifest, Manifest):
            self._pack = (Path(pack.path), manifest)  # type: ignore[union-attr]
        where, self._pack_digest = pack_of(dataset_or_length)
        self._read_ahead: ReadAhead | None = None
        if n < 1:
            raise ValueError(f"the dataset should hold at least one sample, but got length={n}")
        if not (_natural(block_size) and _natural(window)) or block_size < 1 or window < 1:  # else numpy fails later
            raise ValueError(
                f"block_size and window should be integers of at least 1, but got block_size={block_size!r}, "
                f"window={window!r}"
            )
        self.num_samples_total = n
        self.block_size = int(block_size)
        self.window = int(window)
        self.seed = order_number("seed", seed)
        self.shuffle = shuffle
        self._rank_given = rank, world_size
        self.rank, self.world_size = resolve_rank_world(rank, world_size)
        self.drop_last = drop_last
        self.epoch = 0
        if per_rank_count(n, self.world_size, drop_last) == 0:
            raise ValueError(f"drop_last=True leaves no samples: {n} samples over world_size={self.world_size}")
        self._history: list[list[int]] = []  # [world_size, consumed] of this epoch's earlier phases
        self._start = 0  # position in this rank's stream where the current (or pending) pass starts
        self._yielded = 0  # position reached by the current pass
        self._pending = False  # a loaded position the next pass starts from
        self._rank_check = RankCheck(
            check_ranks,
            where,
            samples=n,
            pack=self._pack_digest,
            seed=self.seed,
            shuffle=shuffle,
            block_size=self.block_size,
            window=self.window,
            drop_last=drop_last,
        )

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` on the next iteration (call on every rank).

        A position loaded by :meth:`load_state_dict` belongs to its epoch:
        setting another epoch discards it.
        """
        order_number("epoch", epoch)
        check_rank_world("BlockShuffleSampler", self._rank_given, (self.rank, self.world_size))
        if epoch != self.epoch:
            self._history, self._start, self._yielded, self._pending = [], 0, 0, False
        self.epoch = epoch

    def _stream(self) -> np.ndarray:
        """This rank's whole stream for the current phase of the epoch (all of it, from position 0)."""
        if not self._history:
            return self.indices()
        order = self._order()
        worlds = [w for w, _ in self._history] + [self.world_size]
        layout = _layout(order, worlds[0], self.drop_last)
        consumed = np.zeros(self.num_samples_total, dtype=bool)
        for (world, taken), next_world in zip(self._history, worlds[1:], strict=True):
            grid = layout.reshape(world, -1)
            if not 0 <= taken <= grid.shape[1]:
                raise ValueError(
                    f"says consumed={taken} at world_size={world}, but its ranks held {grid.shape[1]} samples each"
                )
            consumed[grid[:, :taken].ravel()] = True
            rest = grid[:, taken:].ravel()
            if next_world == world:
                layout = rest
                continue
            rest = rest[~consumed[rest]]
            _, first = np.unique(rest, return_index=True)
            layout = _layout(rest[np.sort(first)], next_world, self.drop_last)
        per = len(layout) // self.world_size
        return layout[self.rank * per : (self.rank + 1) * per]

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """This rank's position in the epoch: small, JSON-serialisable.

        Args:
            consumed: samples training has taken from the current iteration
                (for a plain ``DataLoader``: ``steps * batch_size``; a count
                past the end of the iteration, as a short last batch gives,
                is its end). By default the samples this sampler has
                yielded, which is what ``StatefulDataLoader`` needs (it
                snapshots the sampler as it hands each batch's indices out).

        Returns:
            ``{"epoch", "seed", "consumed": [[world_size, samples], ...], ...}``
            plus the options that fix the order and the pack (its shards'
            checksums, None over a length), checked on load.
        """
        if consumed is not None and consumed < 0:
            raise ValueError(f"consumed should be at least 0, but got consumed={consumed}")
        position = self._yielded
        if consumed is not None:  # the stream's length: the full epoch's unless this epoch changed world size
            position = min(self._start + consumed, len(self._stream()) if self._history else len(self))
        return {
            "version": 1,
            "epoch": self.epoch,
            "seed": self.seed,
            "num_samples": self.num_samples_total,
            "block_size": self.block_size,
            "window": self.window,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "rank": self.rank,
            "world_size": self.world_size,
            "consumed": [*([w, c] for w, c in self._history), [self.world_size, int(position)]],
            "pack": self._pack_digest,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict`` (from :meth:`state_dict`) on the next iteration.

        Sets the epoch to the saved one. At the same world size the next pass
        yields exactly the indices the interrupted pass had left, in order; at
        another world size, every remaining sample once (see the class
        docstring). A pass that starts where an epoch ended yields nothing and
        moves the sampler to the next epoch.

        Raises:
            ConfigError: the state was saved by a sampler with another order
                (seed, number of samples, block size, window, shuffle, drop_last, or a
                pack converted again since: its shards' checksums), or is not one
                :meth:`state_dict` returned (its epoch or counts malformed or out of
                range); the sampler is then left as it was.
        """
        for name, mine in (
            ("seed", self.seed),
            ("num_samples", self.num_samples_total),
            ("block_size", self.block_size),
            ("window", self.window),
            ("shuffle", self.shuffle),
            ("drop_last", self.drop_last),
        ):
            if state_dict.get(name) != mine:
                raise ConfigError(
                    f"the sampler state was saved with {name}={state_dict.get(name)!r}, but this sampler has "
                    f"{name}={mine!r}",
                    hint=f"Build the sampler with {name}={state_dict.get(name)!r} to resume this epoch",
                )
        saved = state_dict.get("pack")  # None: saved over a length, or by packdata before states named their pack
        if saved is not None and self._pack_digest is not None and saved != self._pack_digest:
            raise ConfigError(
                f"the sampler state was saved over the pack with shards {saved!r}, but this sampler's pack has "
                f"{self._pack_digest!r}: it was converted again since, so the saved position is another order's",
                hint="Start the epoch again (do not load this state), or resume on the pack the state was saved on",
            )
        self._load_position(state_dict, self.num_samples_total, "samples")

    def _iterate(self, order: np.ndarray) -> Iterator[int]:
        """Yield ``order`` a window at a time (as Python ints only a window at a time: 100 M of them are 3.6 GB)."""
        hints = self._hints()
        span = self.block_size * self.window
        for start in range(0, len(order), span):
            if hints is not None:  # the window after the one starting here
                if start == 0:  # and this one, first: its reads are the first to wait,
                    hints.advise(order[: self.block_size])  # its first block before the rest: the first batch
                    hints.advise(order[:span])
                hints.advise(order[start + span : start + 2 * span])
            for index in order[start : start + span].tolist():
                self._yielded += 1
                yield index

    def _hints(self) -> ReadAhead | None:
        """The read-ahead of this sampler's pack, made in the process that iterates it (None without a pack)."""
        if self._pack is None:
            return None
        if self._read_ahead is None:
            self._read_ahead = ReadAhead(*self._pack)
        return self._read_ahead

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_read_ahead"] = None  # its thread and files stay in this process
        return state

    def indices(self, start: int = 0) -> np.ndarray:
        """This rank's order for the current epoch, from position ``start`` on."""
        return self._order(rank=self.rank, world_size=self.world_size, drop_last=self.drop_last)[start:]

    def _order(self, **split: Any) -> np.ndarray:
        """This epoch's whole-pack order, or one rank's slice of it with ``rank``/``world_size``/``drop_last``."""
        return block_shuffle_order(
            self.num_samples_total,
            block_size=self.block_size,
            window=self.window,
            seed=self.seed,
            epoch=self.epoch,
            shuffle=self.shuffle,
            **split,
        )

    def __iter__(self) -> Iterator[int]:
        return self._pass("BlockShuffleSampler")

    def __len__(self) -> int:
        return per_rank_count(self.num_samples_total, self.world_size, self.drop_last)
