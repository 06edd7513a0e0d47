"""TokenBucketSampler and the padding collate, over lengths and over a text pack."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import packdata
from packdata.errors import ConfigError
from packdata.formats.contents import export_pack
from packdata.reading.open import open_dataset
from packdata.reading.text import PadCollate, TokenBucketSampler, pad_collate, sample_lengths


@pytest.fixture
def lengths() -> np.ndarray:
    return np.random.default_rng(1).integers(1, 300, size=997)


def _check(sampler: TokenBucketSampler, lengths: np.ndarray, budget: int) -> list[list[int]]:
    batches = list(sampler)
    for batch in batches:
        assert batch
        assert len(batch) * max(int(lengths[i]) for i in batch) <= budget
    flat = sorted(i for batch in batches for i in batch)
    assert flat == list(range(len(lengths)))  # every sample exactly once
    assert len(sampler) == len(batches)
    return batches


@pytest.mark.parametrize("budget", [300, 1000, 4096])
@pytest.mark.parametrize("shuffle", [True, False])
def test_token_buckets_stay_under_budget_and_cover_every_sample_once(lengths, budget, shuffle) -> None:
    sampler = TokenBucketSampler(lengths, budget, shuffle=shuffle, bucket_size=100)
    _check(sampler, lengths, budget)
    for epoch in (1, 2):
        sampler.set_epoch(epoch)
        _check(sampler, lengths, budget)


def test_token_buckets_are_tight_and_deterministic(lengths) -> None:
    a = TokenBucketSampler(lengths, 4096, seed=3)
    b = TokenBucketSampler(lengths, 4096, seed=3)
    assert list(a) == list(b)
    a.set_epoch(1)
    assert list(a) != list(b)
    padded = sum(len(batch) * max(lengths[batch]) for batch in a)
    assert padded < 1.25 * lengths.sum()  # sorting within buckets keeps padding small


def test_token_buckets_max_samples_and_length_scale(lengths) -> None:
    sampler = TokenBucketSampler(lengths, 10_000, max_samples=8)
    assert max(len(b) for b in _check(sampler, lengths, 10_000)) <= 8
    scaled = TokenBucketSampler(lengths, 100, length_scale=0.25)
    _check(scaled, np.ceil(lengths * 0.25), 100)


def test_token_buckets_reject_or_isolate_oversize_samples() -> None:
    lengths = [5, 50, 7, 200, 3]
    with pytest.raises(ConfigError, match=r"1 samples are longer than max_tokens=100 \(sample 3 has 200"):
        TokenBucketSampler(lengths, 100)
    sampler = TokenBucketSampler(lengths, 100, oversize="alone", shuffle=False)
    batches = list(sampler)
    assert [3] in batches
    assert sorted(i for b in batches for i in b) == [0, 1, 2, 3, 4]


def test_a_length_past_int64_once_scaled_stays_oversize() -> None:
    """A size near 2**63 times length_scale wrapped to -2**63 when cast back to int64: the longest sample
    fitted every batch's budget and was batched with the others (sizes.i64 of a pack without digests)."""
    sampler = TokenBucketSampler([5, 2**62, 7], 100, length_scale=4.0, oversize="alone", shuffle=False)
    assert [1] in list(sampler) and sampler.lengths.min() >= 1


def test_token_buckets_over_no_samples_are_refused() -> None:
    """No lengths gave an epoch of no batches, silently (BlockShuffleSampler refuses a length of 0)."""
    with pytest.raises(ValueError, match="the dataset should hold at least one sample, but got length=0"):
        TokenBucketSampler([], 100)


@pytest.mark.parametrize(
    "options, problem",
    [
        ({"length_scale": float("nan")}, "length_scale should be a positive finite number, but got length_scale=nan"),
        ({"length_scale": float("inf")}, "length_scale should be a positive finite number, but got length_scale=inf"),
        ({"max_samples": 0}, "max_samples should be at least 1 or None, but got max_samples=0"),
        ({"max_samples": -1}, "max_samples should be at least 1 or None, but got max_samples=-1"),
    ],
)
def test_token_buckets_refuse_a_scale_or_cap_that_would_break_the_budget(options: dict, problem: str) -> None:
    """A length_scale of NaN or inf made every length -2**63, so all 10 samples of 5 bytes came as one batch
    under a budget of 20; max_samples=0 meant no cap, -1 a cap of one sample."""
    with pytest.raises(ValueError, match=re.escape(problem)):
        TokenBucketSampler([5] * 10, 20, **options)


def test_token_buckets_split_evenly_across_ranks(lengths) -> None:
    ranks = [TokenBucketSampler(lengths, 2000, rank=r, world_size=3, seed=5) for r in range(3)]
    counts = {len(list(s)) for s in ranks}
    assert len(counts) == 1  # every rank steps the same number of times
    seen = sorted(i for s in ranks for b in s for i in b)
    assert set(seen) == set(range(len(lengths)))  # padding repeats some batches, loses none
    dropped = [TokenBucketSampler(lengths, 2000, rank=r, world_size=3, seed=5, drop_last=True) for r in range(3)]
    flat = [i for s in dropped for b in s for i in b]
    assert len(flat) == len(set(flat))


@pytest.mark.parametrize(("samples", "max_tokens", "world"), [(3, 1000, 3), (4, 20, 5), (6, 10, 7)])
def test_token_buckets_pad_every_rank_when_batches_are_fewer_than_ranks(samples, max_tokens, world) -> None:
    """1 batch over 3 ranks, 1 over 5, 3 over 7: every rank still steps once, and no sample is lost."""
    ranks = [TokenBucketSampler([5] * samples, max_tokens, rank=r, world_size=world) for r in range(world)]
    assert [len(list(s)) for s in ranks] == [len(s) for s in ranks] == [1] * world
    assert sorted({i for s in ranks for b in s for i in b}) == list(range(samples))


def test_token_buckets_refuse_a_drop_last_that_leaves_no_batch() -> None:
    """1 batch over 3 ranks with drop_last: an error, not an epoch of 0 steps on every rank."""
    sampler = TokenBucketSampler([5] * 3, 1000, rank=0, world_size=3, drop_last=True)
    with pytest.raises(ConfigError, match=r"drop_last=True leaves no batches: epoch 0 has 1 over world_size=3"):
        list(sampler)


def test_pad_collate_pads_to_the_longest() -> None:
    padded, lengths, labels = pad_collate([(b"abc", 0), ("é", 1), (torch.tensor([7], dtype=torch.uint8), 2)])
    assert padded.dtype == torch.uint8 and padded.shape == (3, 3)
    assert padded.tolist() == [[97, 98, 99], [0xC3, 0xA9, 0], [7, 0, 0]]
    assert lengths.tolist() == [3, 2, 1] and labels.tolist() == [0, 1, 2]
    ids, _, _ = PadCollate(pad_value=-1, dtype=torch.int64)([([1, 2], 0), ([3], 0)])
    assert ids.tolist() == [[1, 2], [3, -1]]


def test_pad_collate_keeps_every_token_id_whatever_sample_comes_first() -> None:
    """The padded dtype was the first sample's: token ids after a bytes sample wrapped round in uint8
    (70000 became 112), and after an empty list they became float32."""
    padded, lengths, _ = pad_collate([(b"ab", 0), (torch.tensor([70000]), 1)])
    assert padded.dtype == torch.int64 and padded.tolist() == [[97, 98], [70000, 0]]
    padded, lengths, _ = pad_collate([([], 0), ([5, 300], 1)])
    assert padded.dtype == torch.int64 and padded.tolist() == [[0, 0], [5, 300]] and lengths.tolist() == [0, 2]


@pytest.mark.parametrize("pad_value", [-1, -100, 300])
def test_pad_collate_pads_bytes_with_a_value_a_byte_cannot_hold(pad_value: int) -> None:
    """Bytes padded with -1 or -100 (an ignore index) came back uint8 with 255 or 156 where the padding was,
    values real bytes take (156 is in UTF-8's continuation bytes); 300 raised torch's overflow error."""
    padded, lengths, _ = PadCollate(pad_value=pad_value)([(b"ab", 0), ("\u00e9\u0153", 1)])
    assert padded.dtype == torch.int64 and lengths.tolist() == [2, 4]
    assert padded.tolist() == [[97, 98, pad_value, pad_value], [0xC3, 0xA9, 0xC5, 0x93]]
    assert PadCollate(pad_value=255)([(b"ab", 0), (b"c", 1)])[0].dtype == torch.uint8  # fits: kept


def test_pad_collate_refuses_a_dtype_that_cannot_hold_the_ids_or_the_pad() -> None:
    """PadCollate(dtype=torch.uint8) wrapped token id 300 round to 44, and pad_value=-1 to 255, silently."""
    with pytest.raises(ValueError, match=r"dtype=torch.uint8 cannot hold sample 0 \(values 2 to 300\)"):
        PadCollate(dtype=torch.uint8)([([300, 2], 0), ([1], 1)])
    with pytest.raises(ValueError, match=r"dtype=torch\.uint8 cannot hold pad_value=-1"):
        PadCollate(pad_value=-1, dtype=torch.uint8)
    padded, _, _ = PadCollate(dtype=torch.int16)([([300, 2], 0), ([], 1)])
    assert padded.dtype == torch.int16 and padded.tolist() == [[300, 2], [0, 0]]


def test_token_buckets_from_a_text_pack(tmp_path: Path) -> None:
    root = tmp_path / "texts"
    for c, cls in enumerate(["neg", "pos"]):
        (root / cls).mkdir(parents=True)
        for i in range(15):
            (root / cls / f"doc{i:02d}.txt").write_text(f"{cls} document {i} café " * (1 + (7 * i + c) % 9))
    packdata.convert(root, tmp_path / "t.lmdb", progress=False)
    dataset = packdata.LMDBDataset(tmp_path / "t.lmdb", decode="bytes")
    lengths = sample_lengths(dataset)
    assert lengths.tolist() == [len(dataset.raw(i)[0]) for i in range(len(dataset))]
    budget = 600
    sampler = TokenBucketSampler(dataset, budget, bucket_size=16)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=pad_collate, num_workers=2)
    seen = []
    for padded, lens, _ in loader:
        assert padded.numel() <= budget
        assert lens.max() == padded.shape[1]
        seen.extend(lens.tolist())
    assert sorted(seen) == sorted(lengths.tolist())


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_a_size_changed_in_the_index_is_named_not_batched_on(tmp_path: Path, fmt: str) -> None:
    """sizes.i64 (field_sizes.i64 in a multi-field pack) was used unchecked: a flipped bit made a sample 4 bytes
    longer or shorter in its bucket, so batches broke the token budget, or a high bit blamed the sample as
    longer than max_tokens. Both files have a SHA-256 in the manifest: checked when the lengths are taken."""
    root = tmp_path / "texts"
    (root / "a").mkdir(parents=True)
    for i in range(8):
        (root / "a" / f"{i}.txt").write_text("x" * (10 + i))
    packdata.convert(root, tmp_path / "t", format=fmt, progress=False)
    sizes = tmp_path / "t" / "index" / "sizes.i64"
    raw = bytearray(sizes.read_bytes())
    raw[8 * 3] ^= 0x04  # sample 3: 13 bytes read as 9
    sizes.write_bytes(bytes(raw))
    with pytest.raises(
        packdata.PackFormatError, match=r"index/sizes\.i64: sample index file sizes\.i64 does not match"
    ):
        TokenBucketSampler(open_dataset(tmp_path / "t", decode="bytes"), 100)
    with packdata.PackWriter(tmp_path / "f", format=fmt) as w:
        for i in range(4):
            w.write({"__key__": f"{i}", "txt": "y" * (10 + i)})
    pairs = tmp_path / "f" / "index" / "field_sizes.i64"
    raw = bytearray(pairs.read_bytes())
    raw[16 * 2 + 8] ^= 0x04  # sample 2's txt: 12 bytes read as 8
    pairs.write_bytes(bytes(raw))
    with pytest.raises(packdata.PackFormatError, match=r"sample index file field_sizes\.i64 does not match"):
        sample_lengths(open_dataset(tmp_path / "f"), "txt")


def test_sample_lengths_rejects_other_objects() -> None:
    with pytest.raises(TypeError, match="lengths should be a pack dataset"):
        sample_lengths(object())


def test_token_buckets_take_rank_and_world_from_torchrun_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once every rank got every batch (RANK=1 WORLD_SIZE=2 -> 61 of 61); the rule is BlockShuffleSampler's."""
    lengths = [10 + (7 * i) % 50 for i in range(120)]
    monkeypatch.setenv("WORLD_SIZE", "2")
    ranks = []
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        sampler = TokenBucketSampler(lengths, 200, seed=1, drop_last=True)
        assert (sampler.rank, sampler.world_size) == (int(rank), 2)
        ranks.append([i for batch in sampler for i in batch])
    assert not set(ranks[0]) & set(ranks[1])  # each batch goes to one rank
    everything = TokenBucketSampler(lengths, 200, seed=1, rank=0, world_size=1)
    assert len(ranks[0]) + len(ranks[1]) <= sum(len(b) for b in everything)


def test_a_text_saved_with_a_byte_order_mark_decodes_without_it_and_keeps_it_in_the_pack(tmp_path: Path) -> None:
    """A .txt file an editor saved as 'UTF-8 with BOM' decoded to '\\ufeffhello': a tokenizer read U+FEFF as the
    text's first character. The str now starts at the text (Python's utf-8-sig); the pack keeps the file's bytes
    (decode='bytes' and export give them as they were), and a mark past the start stays in the str."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"\xef\xbb\xbfhello")
    (src / "b.txt").write_bytes("mid\ufeffdle".encode())
    packdata.convert(src, tmp_path / "out.lmdb", progress=False)
    assert [text for text, _ in packdata.LMDBDataset(tmp_path / "out.lmdb")] == ["hello", "mid\ufeffdle"]
    assert packdata.LMDBDataset(tmp_path / "out.lmdb", decode="bytes")[0][0] == b"\xef\xbb\xbfhello"
    export_pack(tmp_path / "out.lmdb", tmp_path / "back")
    assert (tmp_path / "back" / "a.txt").read_bytes() == b"\xef\xbb\xbfhello"
