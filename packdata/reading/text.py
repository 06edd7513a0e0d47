"""Batches of text under a token budget, from the lengths in the pack's index.

Padding a batch to its longest sample wastes compute on pad tokens, and a fixed
batch size either runs out of memory on long samples or starves the device on
short ones. :class:`TokenBucketSampler` builds batches whose padded size
(samples x longest sample) stays under ``max_tokens``, grouping samples of
similar length. It reads the lengths from the pack's sample index
(``dataset.pack.index.sizes``: every payload's byte length, stored at pack
time), so it starts instantly and never reads a record.

Lengths are UTF-8 **bytes**: exact for byte-level models, and an upper bound
on characters. For a subword tokenizer, pass ``length_scale`` (about 0.25 for
English BPE: 4 bytes per token) or your own ``lengths`` array of token counts.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from packdata.errors import ConfigError
from packdata.pack.index import FIELD_FILES, SIZES_FILE
from packdata.reading.loader import label_tensor
from packdata.reading.ranks import RankCheck, check_rank_world, pack_of, resolve_rank_world
from packdata.reading.samplers import ResumablePass, order_number

__all__ = ["PadCollate", "TokenBucketSampler", "pad_collate", "sample_lengths"]


def sample_lengths(dataset: Any, field: str | None = None) -> np.ndarray:
    """Every sample's payload length in bytes, from a pack dataset's index (no record read).

    Args:
        dataset: a pack dataset (anything with ``.pack.index.sizes``), or a
            sequence of lengths.
        field: in a multi-field pack, the field whose sizes count (e.g. ``"txt"``);
            a sample without it counts 0. Required there.

    Raises:
        TypeError: ``dataset`` has no stored lengths.
        ConfigError: a multi-field pack without ``field``, or a field it lacks.
        PackFormatError: the index file of the sizes does not match its SHA-256 in the manifest.
    """
    pack = getattr(dataset, "pack", None)
    if pack is not None and hasattr(pack, "index"):
        check = getattr(pack, "check_index_file", lambda name: None)  # a size with a flipped bit is named, not used
        names = getattr(pack.index, "field_names", [])
        if not names and field is None:
            check(SIZES_FILE)
            return np.asarray(pack.index.sizes, dtype=np.int64)
        if field is None or field not in names:
            raise ConfigError(
                f"field should name the field to measure, one of {', '.join(names) or 'none'}, but got field={field!r}",
                hint="Multi-field packs store each field's size: name the text field, e.g. field='txt'",
            )
        for name in FIELD_FILES:
            check(name)
        return np.maximum(pack.index.field_sizes(field), 0)
    if isinstance(dataset, (np.ndarray, Sequence, torch.Tensor)):
        return np.asarray(dataset, dtype=np.int64)
    raise TypeError(
        f"lengths should be a pack dataset (with .pack.index.sizes) or a sequence of lengths, "
        f"but got {type(dataset).__name__}"
    )


class TokenBucketSampler(ResumablePass, Sampler[list[int]]):
    """Batch sampler: batches of similar-length samples, each under a token budget.

    Use as ``DataLoader(ds, batch_sampler=TokenBucketSampler(ds, max_tokens=8192),
    collate_fn=packdata.pad_collate)``. Every batch satisfies
    ``len(batch) * max(lengths[batch]) <= max_tokens`` (its size once padded),
    and each epoch yields every sample exactly once (across ranks: plus the
    whole batches repeated to pad, with ``drop_last=False``; see below).

    Each epoch it shuffles the samples (seeded by ``seed`` and
    :meth:`set_epoch`), cuts the order into buckets of ``bucket_size`` samples,
    sorts each bucket by length, packs it greedily into batches, and shuffles
    the batch order, so batches are tight but not in length order.

    With several ranks (``world_size``), every rank builds the same batches
    and takes every ``world_size``-th one; the batch count is cut to a
    multiple of ``world_size`` (``drop_last=True``) or padded by repeating
    batches from the start (``drop_last=False``: at most ``world_size - 1``
    whole batches read twice an epoch) so all ranks step together.

    Resuming mid-epoch, also at another world size: :meth:`state_dict` /
    :meth:`load_state_dict`, as for
    :class:`~packdata.reading.samplers.BlockShuffleSampler`, counted in batches.

    Args:
        lengths: a pack dataset (its index gives the lengths) or a sequence of lengths.
        field: with a multi-field pack, the field whose stored size is the length (e.g. ``"txt"``).
        max_tokens: the budget of a padded batch.
        length_scale: multiply byte lengths by this (e.g. 0.25 for about 4 bytes per
            token); lengths are rounded up.
        max_samples: at most this many samples per batch.
        bucket_size: samples sorted together; larger buckets pad less but mix less.
        shuffle: shuffle samples and batches each epoch; otherwise keep index order.
        seed: base seed of the shuffle, an integer from 0 on.
        oversize: what to do with a sample longer than ``max_tokens``: ``"error"``
            (default) or ``"alone"`` (a batch of its own, over budget).
        rank, world_size: this process's place in a distributed job; by default from
            :func:`~packdata.reading.ranks.resolve_rank_world` (``torch.distributed``, else ``RANK``/``WORLD_SIZE``).
        drop_last: with several ranks, drop the batches that do not divide evenly.
        check_ranks: at the first iteration, compare the sample count (and a pack
            dataset's pack) and the options with every rank's, as
            :class:`~packdata.reading.samplers.BlockShuffleSampler` does; pass
            ``False`` where the sampler is built on some ranks only.

    Raises:
        PackFormatError: the pack's index of sizes is damaged (see :func:`sample_lengths`).
        ConfigError: a sample is longer than ``max_tokens`` and ``oversize="error"``;
            on iteration, ``drop_last=True`` leaves an epoch no batch.
    """

    def __init__(
        self,
        lengths: Any,
        max_tokens: int,
        *,
        length_scale: float = 1.0,
        max_samples: int | None = None,
        bucket_size: int = 1000,
        shuffle: bool = True,
        seed: int = 0,
        oversize: str = "error",
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        field: str | None = None,
        check_ranks: bool = True,
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens should be at least 1, but got max_tokens={max_tokens}")
        if not 0 < length_scale < math.inf:  # NaN or inf made every length -2**63: one batch of everything
            raise ValueError(f"length_scale should be a positive finite number, but got length_scale={length_scale}")
        if max_samples is not None and max_samples < 1:  # 0 was no cap at all, -1 a cap of one
            raise ValueError(f"max_samples should be at least 1 or None, but got max_samples={max_samples}")
        if bucket_size < 1:
            raise ValueError(f"bucket_size should be at least 1, but got bucket_size={bucket_size}")
        if oversize not in ("error", "alone"):
            raise ValueError(f"oversize should be 'error' or 'alone', but got oversize={oversize!r}")
        self._rank_given = rank, world_size
        rank, world_size = resolve_rank_world(rank, world_size)
        raw = sample_lengths(lengths, field)
        if not len(raw):  # as BlockShuffleSampler: an epoch of no batches would end a training loop silently
            raise ValueError("the dataset should hold at least one sample, but got length=0")
        # clipped below int64's end: a length past 2**63 cast back wrapped to -2**63, a sample that fits anywhere
        self.lengths = np.clip(np.ceil(raw * length_scale), 1, 2**62).astype(np.int64)
        self.max_tokens = int(max_tokens)
        self.max_samples = max_samples
        self.bucket_size = bucket_size
        self.shuffle = shuffle
        self.seed = order_number("seed", seed)
        self.oversize = oversize
        self.world_size = world_size
        self.rank = rank
        self.drop_last = drop_last
        self.epoch = 0
        too_long = np.flatnonzero(self.lengths > self.max_tokens)
        if len(too_long) and oversize == "error":
            first = int(too_long[0])
            raise ConfigError(
                f"{len(too_long)} samples are longer than max_tokens={self.max_tokens} "
                f"(sample {first} has {int(self.lengths[first])}, the longest {int(self.lengths.max())})",
                hint="Raise max_tokens, truncate long samples, or pass oversize='alone' to give each its own batch",
            )
        self._cache: tuple[int, list[list[int]]] | None = None
        self._history: list[list[int]] = []  # [world_size, batches consumed] of this epoch's earlier phases
        self._start = 0  # batch of this rank's stream where the current (or pending) pass starts
        self._yielded = 0  # batch reached by the current pass
        self._pending = False  # a loaded position the next pass starts from
        where, digest = pack_of(lengths)
        self._order_facts = {  # what fixes the batches: compared across ranks, and with a loaded state
            "samples": len(self.lengths),
            "pack": digest,
            "lengths": hashlib.sha256(self.lengths.tobytes()).hexdigest()[:16],
            "field": field,
            "seed": self.seed,
            "shuffle": shuffle,
            "max_tokens": self.max_tokens,
            "length_scale": length_scale,
            "max_samples": max_samples,
            "bucket_size": bucket_size,
            "drop_last": drop_last,
        }
        self._rank_check = RankCheck(check_ranks, where, **self._order_facts)

    def set_epoch(self, epoch: int) -> None:
        """Use the shuffle of ``epoch`` (call before each epoch, as with DistributedSampler).

        A position loaded by :meth:`load_state_dict` belongs to its epoch:
        setting another epoch discards it.
        """
        check_rank_world("TokenBucketSampler", self._rank_given, (self.rank, self.world_size))
        order_number("epoch", epoch)
        if epoch != self.epoch:
            self._history, self._start, self._yielded, self._pending = [], 0, 0, False
        self.epoch = epoch

    def _pack(self, order: np.ndarray) -> list[list[int]]:
        batches: list[list[int]] = []
        cap = self.max_samples or len(order) or 1
        lengths = self.lengths
        for start in range(0, len(order), self.bucket_size):
            bucket = order[start : start + self.bucket_size]
            bucket = bucket[np.argsort(lengths[bucket], kind="stable")]
            batch: list[int] = []
            longest = 0
            for index in bucket.tolist():
                length = int(lengths[index])
                grown = max(longest, length)
                if batch and ((len(batch) + 1) * grown > self.max_tokens or len(batch) >= cap):
                    batches.append(batch)
                    batch, grown = [], length
                batch.append(index)
                longest = grown
            if batch:
                batches.append(batch)
        return batches

    def batches(self) -> list[list[int]]:
        """All batches of this epoch for every rank (before splitting by rank)."""
        if self._cache is not None and self._cache[0] == self.epoch:
            return self._cache[1]
        n = len(self.lengths)
        rng = np.random.default_rng([self.seed, self.epoch])
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        batches = self._pack(order)
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        self._cache = (self.epoch, batches)
        return batches

    def _layout(self, ids: list[int], world_size: int) -> list[int]:
        """Batch ids cut (``drop_last``) or padded by repeating their start to a multiple of ``world_size``."""
        if self.drop_last:
            return ids[: len(ids) - len(ids) % world_size]
        total = math.ceil(len(ids) / world_size) * world_size
        return ids + list(itertools.islice(itertools.cycle(ids), total - len(ids)))

    def _rank_batches(self) -> list[list[int]]:
        batches = self.batches()
        layout = self._layout(list(range(len(batches))), self.world_size)
        if not layout:
            raise ConfigError(
                f"drop_last=True leaves no batches: epoch {self.epoch} has {len(batches)} over "
                f"world_size={self.world_size}",
                hint="Pass drop_last=False to pad instead, or lower max_tokens",
            )
        return [batches[b] for b in layout[self.rank :: self.world_size]]

    def _stream(self) -> list[list[int]]:
        """This rank's batches for the current phase of the epoch (all of them, from its start).

        Rank ``r`` takes every ``world_size``-th batch from ``r``, so ``k`` steps
        of every rank consumed the layout's first ``k * world_size`` batches; the
        rest, deduplicated, is laid out again for the next phase's world size.
        """
        if not self._history:
            return self._rank_batches()
        batches = self.batches()
        worlds = [w for w, _ in self._history] + [self.world_size]
        layout = self._layout(list(range(len(batches))), worlds[0])
        for (world, taken), next_world in zip(self._history, worlds[1:], strict=True):
            if taken > len(layout) // world:
                raise ValueError(
                    f"says {taken} batches consumed at world_size={world}, but its ranks held {len(layout) // world}"
                )
            done = set(layout[: taken * world])
            layout = self._layout([b for b in dict.fromkeys(layout[taken * world :]) if b not in done], next_world)
        return [batches[b] for b in layout[self.rank :: self.world_size]]

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """This rank's position in the epoch, in batches: small, JSON-serialisable.

        Args:
            consumed: batches training has taken from the current iteration
                (for a plain ``DataLoader``: its steps; a count past the end of
                the iteration is its end). By default the batches this sampler
                has yielded, which is what ``StatefulDataLoader`` needs.
        """
        if consumed is not None and consumed < 0:
            raise ValueError(f"consumed should be at least 0, but got consumed={consumed}")
        position = self._yielded if consumed is None else min(self._start + consumed, len(self._stream()))
        return {
            "version": 1,
            "epoch": self.epoch,
            "order": dict(self._order_facts),
            "rank": self.rank,
            "world_size": self.world_size,
            "consumed": [*([w, c] for w, c in self._history), [self.world_size, int(position)]],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict`` (from :meth:`state_dict`) on the next iteration.

        Sets the epoch to the saved one. At the same world size the next pass
        yields exactly the batches the interrupted pass had left; at another,
        every remaining batch once (plus at most ``world_size - 1`` padding
        repeats, or cut with ``drop_last``). A pass that starts where an epoch
        ended yields nothing and moves the sampler to the next epoch.

        Raises:
            ConfigError: the state was saved by a sampler with other batches
                (lengths, pack, options), or is not one :meth:`state_dict`
                returned; the sampler is then left as it was.
        """
        saved = state_dict.get("order")
        if saved != self._order_facts:
            names = sorted(
                k for k in self._order_facts if not isinstance(saved, dict) or saved.get(k) != self._order_facts[k]
            )
            raise ConfigError(
                f"the sampler state was saved by a TokenBucketSampler with other {', '.join(names)}: its batches "
                "differ",
                hint="Build the sampler over the same pack with the same options to resume this epoch",
            )
        self._load_position(state_dict, len(self.lengths), "batches")

    def __iter__(self) -> Iterator[list[int]]:
        return self._pass("TokenBucketSampler")

    def _iterate(self, batches: list[list[int]]) -> Iterator[list[int]]:
        for batch in batches:
            self._yielded += 1
            yield batch

    def __len__(self) -> int:
        return len(self._rank_batches())


def _as_codes(sample: Any) -> torch.Tensor:
    if isinstance(sample, torch.Tensor):
        return sample.reshape(-1)
    if isinstance(sample, str):
        sample = sample.encode("utf-8")
    if isinstance(sample, (bytes, bytearray, memoryview)):
        return (
            torch.frombuffer(bytearray(sample), dtype=torch.uint8) if len(sample) else torch.zeros(0, dtype=torch.uint8)
        )
    if not len(sample):  # torch.as_tensor([]) is float32: token ids are integers
        return torch.zeros(0, dtype=torch.int64)
    return torch.as_tensor(sample).reshape(-1)


def _holds(dtype: torch.dtype, value: float) -> bool:
    """Whether ``dtype`` holds ``value`` as it is (a float dtype holds any number)."""
    if dtype.is_floating_point or dtype.is_complex:
        return True
    if dtype == torch.bool:
        return value in (0, 1)
    info = torch.iinfo(dtype)
    return info.min <= value <= info.max


class PadCollate:
    """Pad variable-length samples to the batch's longest: ``(padded, lengths, labels)``.

    Samples are 1-D tensors or sequences of token ids, or ``str``/``bytes``
    (taken as UTF-8 byte values, for byte-level models; tokenize in the
    dataset's ``transform`` otherwise). ``padded`` is ``(N, longest)`` of the
    dtype all samples and ``pad_value`` fit in (``uint8`` for bytes, ``int64`` for
    bytes padded with -1) or ``dtype``; ``lengths`` and
    ``labels`` are int64 ``(N,)``.

    ``packdata.pad_collate`` is ``PadCollate()`` (pad with 0, keep the samples'
    dtype), ready to pass as ``collate_fn``; build a ``PadCollate(...)`` for
    other options.

    Args:
        pad_value: the value padding positions get.
        dtype: cast the padded tensor to this dtype (``ValueError`` where it cannot
            hold ``pad_value`` or a sample's values: nothing wraps round).
    """

    def __init__(self, pad_value: int = 0, dtype: torch.dtype | None = None) -> None:
        if dtype is not None and not _holds(dtype, pad_value):
            raise ValueError(f"dtype={dtype} cannot hold pad_value={pad_value}: pass a wider dtype, or None")
        self.pad_value = pad_value
        self.dtype = dtype

    def __call__(self, batch: Sequence[tuple[Any, Any]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not batch:
            raise ValueError("pad_collate got an empty batch")
        codes = [_as_codes(sample) for sample, _ in batch]
        lengths = torch.tensor([len(c) for c in codes], dtype=torch.int64)
        dtype = self.dtype or functools.reduce(torch.promote_types, (c.dtype for c in codes))  # 70000 fits
        if self.dtype is None and not _holds(dtype, self.pad_value):  # pad_value=-1 after bytes: not 255
            dtype = torch.promote_types(dtype, torch.int64)
        for i, c in enumerate(codes if self.dtype is not None else ()):
            low, high = (c.min().item(), c.max().item()) if len(c) else (0, 0)
            if not (_holds(dtype, low) and _holds(dtype, high)):  # a token id 300 would wrap to 44 in uint8
                raise ValueError(f"dtype={dtype} cannot hold sample {i} (values {low} to {high}): pass a wider dtype")
        padded = torch.full((len(codes), int(lengths.max()) if len(codes) else 0), self.pad_value, dtype=dtype)
        for i, c in enumerate(codes):
            padded[i, : len(c)] = c.to(dtype)
        return padded, lengths, label_tensor(batch, "pad_collate")

    def __repr__(self) -> str:
        return f"PadCollate(pad_value={self.pad_value}, dtype={self.dtype})"


pad_collate = PadCollate()
"""The default :class:`PadCollate`: pad with 0, keep the samples' dtype."""
