"""BlockShuffleSampler: exactly once across ranks, determinism, locality, shuffle quality."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import DataLoader, DistributedSampler

from packdata import BlockShuffleSampler, LMDBDataset, TFRecordIndexedDataset, convert, shuffle_quality
from packdata.reading.samplers import block_shuffle_order, resolve_rank_world


@pytest.fixture
def small_texts(tmp_path: Path) -> Path:
    root = tmp_path / "texts"
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True)
        for i in range(20):
            (root / cls / f"{i:02d}.txt").write_text(f"{cls}:{i}", encoding="utf-8")
    return root


@pytest.mark.parametrize("n", [1, 7, 100, 1001])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_exactly_once_across_ranks(n: int, world: int, drop_last: bool) -> None:
    if drop_last and n < world:
        with pytest.raises(ValueError, match="leaves no samples"):
            BlockShuffleSampler(n, world_size=world, rank=0, drop_last=True)
        return
    samplers = [
        BlockShuffleSampler(n, block_size=8, window=4, seed=1, rank=r, world_size=world, drop_last=drop_last)
        for r in range(world)
    ]
    orders = [list(s) for s in samplers]
    assert {len(o) for o in orders} == {len(samplers[0])}
    counts = Counter(i for o in orders for i in o)
    if drop_last:
        assert len(counts) == world * (n // world) and max(counts.values()) == 1
    else:
        assert set(counts) == set(range(n))
        assert sum(counts.values()) - n == world * len(orders[0]) - n < world


def test_deterministic_per_seed_and_epoch() -> None:
    s = BlockShuffleSampler(500, block_size=10, window=5, seed=3)
    first = list(s)
    assert list(s) == first
    s.set_epoch(1)
    assert list(s) != first and sorted(s) == list(range(500))
    assert list(BlockShuffleSampler(500, block_size=10, window=5, seed=4)) != first
    assert list(BlockShuffleSampler(50, shuffle=False)) == list(range(50))
    assert (s.indices(start=100) == s.indices()[100:]).all()


def test_windows_read_few_blocks() -> None:
    block, window = 16, 4
    order = block_shuffle_order(4096, block_size=block, window=window, seed=0, epoch=0)
    for w in range(0, 4096, block * window):
        assert len(set(order[w : w + block * window] // block)) == window  # one window: 4 runs of storage


def test_shuffle_quality_close_to_full_random() -> None:
    n = 100_000
    block = shuffle_quality(block_shuffle_order(n, block_size=128, window=32, seed=0, epoch=0))
    uniform = shuffle_quality(np.random.default_rng(0).permutation(n))
    identity = shuffle_quality(np.arange(n))
    assert abs(uniform.displacement - 1 / 3) < 0.01 and abs(uniform.correlation) < 0.02
    assert abs(block.displacement - uniform.displacement) < 0.02 and abs(block.correlation) < 0.05
    assert identity.displacement == 0 and identity.correlation == pytest.approx(1)


def test_resolve_rank_world(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert resolve_rank_world() == (0, 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert resolve_rank_world() == (1, 3) and resolve_rank_world(0, None) == (0, 3)
    with pytest.raises(ValueError, match="world_size should be at least 1"):
        resolve_rank_world(0, 0)
    assert BlockShuffleSampler(10).world_size == 3


def test_with_lmdb_and_indexed_tfrecord_loaders(small_texts: Path, tmp_path: Path) -> None:
    convert(small_texts, tmp_path / "p.lmdb", shard_samples=9, progress=False)
    convert(small_texts, tmp_path / "p.tf", format="tfrecord", shard_samples=9, progress=False)
    lmdb_ds = LMDBDataset(tmp_path / "p.lmdb", decode="text")
    tf_ds = TFRecordIndexedDataset(tmp_path / "p.tf", decode="text")
    everything = sorted(f"{c}:{i}" for c in "ab" for i in range(20))
    for ds in (lmdb_ds, tf_ds):
        seen = []
        for rank in range(2):
            sampler = BlockShuffleSampler(ds, block_size=4, window=2, rank=rank, world_size=2)
            loader = DataLoader(ds, batch_size=6, sampler=sampler, num_workers=2, multiprocessing_context="fork")
            seen += [text for texts, _ in loader for text in texts]
        assert sorted(seen) == everything
    dist = DistributedSampler(tf_ds, num_replicas=2, rank=1, shuffle=True)
    assert len([tf_ds[i] for i in dist]) == 20
