"""BlockShuffleSampler: exactly once across ranks, determinism, locality, shuffle quality."""

from __future__ import annotations

import os
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch.utils.data import DataLoader, DistributedSampler

import packdata
from packdata import (
    BlockShuffleSampler,
    ConfigError,
    LMDBDataset,
    TFRecordDataset,
    TFRecordIndexedDataset,
    TokenBucketSampler,
    convert,
    shuffle_quality,
)
from packdata.formats import get_format
from packdata.reading.ranks import resolve_rank_world
from packdata.reading.samplers import block_shuffle_order


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


def test_a_negative_seed_or_epoch_is_refused_when_given_not_at_iteration(tmp_path: Path) -> None:
    """numpy's generators refuse negative seeds: a seed or epoch of -1 was taken, and the first iteration raised
    numpy's 'expected non-negative integer' (in a DataLoader worker, for the streaming dataset)."""
    with pytest.raises(ValueError, match=r"seed should be an integer from 0 on, but got seed=-1"):
        BlockShuffleSampler(10, seed=-1)
    sampler = BlockShuffleSampler(10)
    with pytest.raises(ValueError, match=r"epoch should be an integer from 0 on, but got epoch=-1"):
        sampler.set_epoch(-1)
    assert sampler.epoch == 0 and sorted(sampler) == list(range(10))
    with pytest.raises(ValueError, match=r"seed should be an integer from 0 on, but got seed=-3"):
        TokenBucketSampler([5] * 10, max_tokens=20, seed=-3)
    with pytest.raises(ValueError, match=r"epoch should be an integer from 0 on, but got epoch=-2"):
        TokenBucketSampler([5] * 10, max_tokens=20).set_epoch(-2)
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "x.txt").write_text("x")
    convert(tmp_path / "src", tmp_path / "p.tf", format="tfrecord", progress=False)
    with pytest.raises(ValueError, match=r"seed should be an integer from 0 on, but got seed=-1"):
        TFRecordDataset(tmp_path / "p.tf", seed=-1)
    with pytest.raises(ValueError, match=r"epoch should be an integer from 0 on, but got epoch=-1"):
        TFRecordDataset(tmp_path / "p.tf").set_epoch(-1)


@pytest.mark.parametrize(
    "options, problem",
    [
        ({"block_size": 2.5}, "block_size and window should be integers of at least 1, but got block_size=2.5"),
        ({"window": 1.5}, "block_size and window should be integers of at least 1, but got block_size=128, window=1.5"),
        ({"block_size": True}, "block_size and window should be integers of at least 1, but got block_size=True"),
        ({"dataset_or_length": 10.0}, "the number of samples should be an integer from 1 on, but got 10.0"),
        ({"dataset_or_length": -3}, "the number of samples should be an integer from 1 on, but got -3"),
    ],
)
def test_options_that_are_not_integers_are_refused_when_given(options: dict, problem: str) -> None:
    """A block_size of 2.5 or a window of 1.5 was taken, and the first iteration failed in numpy ('Cannot cast
    array data from dtype('float64')'); a length of 10.0 was 'object of type float has no len()'."""
    with pytest.raises(ValueError, match=re.escape(problem)):
        BlockShuffleSampler(**{"dataset_or_length": 10, **options})
    assert sorted(BlockShuffleSampler(np.int64(10))) == list(range(10))  # numpy's integers are lengths too


def test_a_block_larger_than_the_pack_is_one_block() -> None:
    """A block_size past int64 (2**80) overflowed numpy at the first iteration; any block of n or more is one block."""
    whole = BlockShuffleSampler(50, block_size=50, seed=2)
    assert list(BlockShuffleSampler(50, block_size=2**80, seed=2)) == list(whole)
    assert list(BlockShuffleSampler(50, block_size=10**6, seed=2)) == list(whole)


def test_deterministic_per_seed_and_epoch() -> None:
    s = BlockShuffleSampler(500, block_size=10, window=5, seed=3)
    first = list(s)
    assert list(s) == first
    s.set_epoch(1)
    assert list(s) != first and sorted(s) == list(range(500))
    assert list(BlockShuffleSampler(500, block_size=10, window=5, seed=4)) != first
    assert list(BlockShuffleSampler(50, shuffle=False)) == list(range(50))
    assert (s.indices(start=100) == s.indices()[100:]).all()


def test_an_epoch_is_not_held_as_python_ints() -> None:
    """The order was turned into one list of Python ints per epoch: 36 bytes a sample, 3.6 GB for 100 M samples.

    Now only the int64 order (8 bytes a sample) is held, and a window at a time as Python ints.
    """
    import tracemalloc

    n = 2_000_000
    sampler = BlockShuffleSampler(n, rank=0, world_size=1, seed=3)
    tracemalloc.start()
    try:
        stream = iter(sampler)
        first = next(stream)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 12 * n and peak < 24 * n, (held / n, peak / n)
    assert [first, *stream] == block_shuffle_order(n, block_size=128, window=32, seed=3, epoch=0).tolist()


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


def test_a_world_of_several_ranks_without_this_ones_rank_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """WORLD_SIZE without RANK, or world_size= without rank= (no process group), gave rank 0 on every process:
    each rank then read the same slice, every sample of it once per rank and the others never."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"rank should be given for world_size=2, but got none"):
        BlockShuffleSampler(10)
    with pytest.raises(ValueError, match=r"rank should be given for world_size=2, but got none"):
        TokenBucketSampler([5] * 10, max_tokens=20)
    assert resolve_rank_world(1) == (1, 2)  # the rank given, the world from the environment
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ValueError, match=r"rank should be given for world_size=4, but got none"):
        resolve_rank_world(None, 4)
    assert resolve_rank_world(None, 1) == (0, 1)
    monkeypatch.setenv("WORLD_SIZE", "two")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"WORLD_SIZE should be an integer, but got WORLD_SIZE='two'"):
        resolve_rank_world()


@pytest.mark.parametrize("name", ["RANK", "LOCAL_RANK"])
def test_a_rank_other_than_0_without_a_world_size_is_refused(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """RANK=1 (or LOCAL_RANK=1) without WORLD_SIZE read as rank 0 of 1: that process read every sample."""
    for variable in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv(name, "0")
    assert resolve_rank_world() == (0, 1)
    monkeypatch.setenv(name, "1")
    with pytest.raises(ValueError, match=rf"world_size should be given with {name}='1', but got none"):
        BlockShuffleSampler(10)
    with pytest.raises(ValueError, match=rf"world_size should be given with {name}='1'"):
        TokenBucketSampler([5] * 10, max_tokens=20)
    assert resolve_rank_world(1, 2) == (1, 2)


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


# -- read-ahead hints --------------------------------------------------------------------------------------------


def _resident_share(path: Path, start: int, length: int) -> float:
    """The share of the pages of ``path[start:start + length]`` in the page cache (mincore over a map)."""
    import ctypes
    import ctypes.util
    import mmap

    from packdata.formats.residency import buffer_address

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
    page = mmap.PAGESIZE
    first = start // page * page
    size = start + length - first
    vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        assert libc.mincore(buffer_address(view) + first, size, vec) == 0
        view.release()
    return sum(v & 1 for v in vec) / len(vec)


@pytest.fixture
def big_texts(tmp_path: Path) -> Path:
    """3,000 texts of 6-10 KB (about 25 MB of records in one LMDB shard)."""
    root = tmp_path / "big"
    (root / "c").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(3000):
        (root / "c" / f"{i:04d}.txt").write_text("x" * int(rng.integers(6000, 10000)), encoding="utf-8")
    return root


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_record_spans_point_at_the_records(small_texts: Path, tmp_path: Path, fmt: str) -> None:
    from packdata.pack.manifest import read_manifest

    pack = tmp_path / f"p.{fmt}"
    convert(small_texts, pack, format=fmt, shard_samples=9, progress=False)
    manifest = read_manifest(pack)
    form = get_format(fmt)
    for shard in manifest.shards:
        spans = form.record_spans(pack / shard.file, shard.bytes)
        assert spans is not None and len(spans[0]) == shard.num_samples
        data = (pack / form.data_name(shard.file)).read_bytes()
        ds = LMDBDataset(pack, decode="bytes") if fmt == "lmdb" else TFRecordIndexedDataset(pack, decode="bytes")
        for j, (offset, length) in enumerate(zip(*spans, strict=True)):
            assert ds[shard.first_index + j][0] in data[offset : offset + length]
    if fmt == "lmdb":  # without its table a shard gives no spans (and no hints), not an error
        (pack / manifest.shards[0].file / "records.i64").unlink()
        assert form.record_spans(pack / manifest.shards[0].file, manifest.shards[0].bytes) is None
    else:  # from the mapped record table, as the .tfindex says; without the table, from the .tfindex
        from packdata.formats.tfrecord_tables import payload_path, read_index

        shard = pack / manifest.shards[0].file
        offsets, lengths = form.record_spans(shard, manifest.shards[0].bytes)
        assert not offsets.flags.owndata  # a view of the mapped table, not a parsed copy
        expected = read_index(shard, size=manifest.shards[0].bytes)
        assert offsets.tolist() == expected[0].tolist() and lengths.tolist() == expected[1].tolist()
        assert form.record_spans(shard, manifest.shards[0].bytes + 1) is None  # a table for another size: no hints
        payload_path(shard).unlink()
        offsets, lengths = form.record_spans(shard, manifest.shards[0].bytes)
        assert offsets.tolist() == expected[0].tolist() and lengths.tolist() == expected[1].tolist()


def test_merged_ranges_cover_every_span_and_join_small_gaps() -> None:
    from packdata.reading.readahead import _merged

    starts = np.array([5000, 0, 100, 1_000_000, 1_000_050])
    ends = starts + np.array([10, 50, 50, 10, 100])
    assert _merged(starts, ends, gap=4096) == [(0, 150), (5000, 10), (1_000_000, 150)]
    assert _merged(starts, ends, gap=10) == [(0, 50), (100, 50), (5000, 10), (1_000_000, 10), (1_000_050, 100)]
    assert _merged(starts, ends, gap=10**6) == [(0, 1_000_150)]


def test_read_ahead_brings_the_next_window_into_the_page_cache(big_texts: Path, tmp_path: Path) -> None:
    from packdata.reading.readahead import ReadAhead

    pack = tmp_path / "big.lmdb"
    convert(big_texts, pack, progress=False)
    ds = LMDBDataset(pack, decode="bytes")
    shard = ds.pack.manifest.shards[0]
    data = pack / shard.file / "data.mdb"
    fd = os.open(data, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    size = data.stat().st_size
    if _resident_share(data, 0, size) > 0.2:
        pytest.skip("the kernel kept the shard's pages: cannot start cold here")
    offsets, lengths = get_format("lmdb").record_spans(pack / shard.file, shard.bytes)
    asked = (int(offsets[0]), int(offsets[999] + lengths[999] - offsets[0]))
    rest = (int(offsets[2000]), int(offsets[-1] - offsets[2000]))
    hints = ReadAhead(ds.pack.path, ds.pack.manifest)
    hints.advise(list(range(0, 1000)))
    hints.close()
    assert hints.advised_bytes >= int(lengths[:1000].sum())
    # WILLNEED starts the reads and returns; some hosts reclaim unused cache pages within a second, so the
    # pages are looked for as they arrive, not after a wait
    best_asked = best_rest = 0.0
    deadline = time.monotonic() + 10  # ends as soon as 90% is in: the bound is only for a loaded disk
    while best_asked < 0.9 and time.monotonic() < deadline:
        best_asked = max(best_asked, _resident_share(data, *asked))
        best_rest = max(best_rest, _resident_share(data, *rest))
    assert best_asked >= 0.3, best_asked
    assert best_rest < 0.1, best_rest  # what was not asked for stays on disk


def test_sampler_order_is_the_same_with_and_without_read_ahead(small_texts: Path, tmp_path: Path) -> None:
    import pickle

    convert(small_texts, tmp_path / "p.lmdb", shard_samples=9, progress=False)
    ds = LMDBDataset(tmp_path / "p.lmdb", decode="bytes")
    on = BlockShuffleSampler(ds, block_size=4, window=2, seed=3)
    off = BlockShuffleSampler(ds, block_size=4, window=2, seed=3, read_ahead=False)
    assert list(on) == list(off) and on._read_ahead is not None and off._read_ahead is None
    assert on._read_ahead.advised_bytes >= 0
    copy = pickle.loads(pickle.dumps(on))  # the thread and files stay behind
    assert copy._read_ahead is None and list(copy) == list(off)
    on._read_ahead.close()


def _make_cold(pack: Path) -> None:
    """Evict the pack's shards from the page cache, or skip the test where the kernel keeps them (tmpfs)."""
    for data in pack.glob("shard-*/data.mdb"):
        fd = os.open(data, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        if _resident_share(data, 0, data.stat().st_size) > 0.5:
            pytest.skip("the kernel kept the shards' pages (tmpfs?): cannot make the pack cold here")


def test_read_ahead_keeps_few_shard_files_open(small_texts: Path, tmp_path: Path, monkeypatch) -> None:
    """The hint thread kept every cold shard's data file and record table open until it idled: two descriptors a
    shard in the training process, which a pack of thousands of shards ran out of."""
    from packdata.reading.readahead import ReadAhead

    monkeypatch.setattr(ReadAhead, "OPEN_FILES", 4)
    monkeypatch.setattr(ReadAhead, "IDLE", 30.0)  # the thread, and the files it keeps, stay while this test looks
    pack = tmp_path / "p.lmdb"
    convert(small_texts, pack, shard_samples=2, progress=False)  # 20 shards
    _make_cold(pack)
    hints = ReadAhead(pack, LMDBDataset(pack).pack.manifest)
    try:
        hints.advise(list(range(40)))
        deadline = time.monotonic() + 10
        while hints.advised_bytes == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # the hint covers every shard in one pass
        shard_files = [
            target
            for fd in os.listdir("/proc/self/fd")
            if (target := os.path.realpath(f"/proc/self/fd/{fd}")).startswith(str(pack.resolve()))
        ]
        assert hints.advised_bytes > 0 and 1 <= len(shard_files) <= 2 * 4, shard_files
    finally:
        hints.close()


_HINTS_OUT_OF_FILES = """
import os, resource, sys, time
from pathlib import Path
from packdata.pack.manifest import read_manifest
from packdata.reading.readahead import ReadAhead

pack = Path(sys.argv[1])
hints = ReadAhead(pack, read_manifest(pack))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    os.close(held.pop())  # one left: the thread opens shard 0's data file, and its records.i64 is out of files
hints.advise([0, 1])
time.sleep(0.5)
for fd in held:
    os.close(fd)
hints.advise(list(range(40)))  # every shard, cold: hinted once the thread takes it
hints.close()  # the thread hints every queued window, then ends
print("advised", hints.advised_bytes)
"""


def test_read_ahead_out_of_files_skips_the_hint_and_keeps_hinting(small_texts: Path, tmp_path: Path) -> None:
    """A record table that could not be mapped for want of descriptors (a CapacityError since e10a135) ended the
    hint thread with a traceback, and the sampler, thinking it alive, queued every later window for no one."""
    import subprocess
    import sys

    pack = tmp_path / "p.lmdb"
    convert(small_texts, pack, shard_samples=2, progress=False)  # 20 shards
    _make_cold(pack)
    done = subprocess.run(
        [sys.executable, "-c", _HINTS_OUT_OF_FILES, str(pack)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "Exception in thread" not in done.stderr, done.stderr
    assert done.stdout.startswith("advised ") and int(done.stdout.split()[1]) > 0, done.stdout + done.stderr


def test_warm_shards_get_no_hints_and_cold_ones_do(small_texts: Path, tmp_path: Path, monkeypatch) -> None:
    """Hints are for pages not in memory: on a warm pack the sampler asks nothing (no thread, no system call)."""
    from packdata.reading.readahead import ReadAhead

    monkeypatch.setattr(ReadAhead, "IDLE", 0.05)
    monkeypatch.setattr(ReadAhead, "RECHECK", 3600.0)  # the verdicts outlast this part however slow the machine
    convert(small_texts, tmp_path / "p.lmdb", shard_samples=9, progress=False)
    pack = tmp_path / "p.lmdb"
    for data in pack.glob("shard-*/data.mdb"):
        data.read_bytes()  # warm
    hints = ReadAhead(pack, LMDBDataset(pack).pack.manifest)
    hints.advise(list(range(40)))  # the thread asks the kernel once per shard: all warm
    hints.close()
    assert hints.advised_bytes == 0
    hints.advise(list(range(40)))  # known warm: nothing queued, no thread started
    assert hints._thread is None
    monkeypatch.setattr(ReadAhead, "RECHECK", 0.5)
    hints = ReadAhead(pack, LMDBDataset(pack).pack.manifest)
    hints.advise(list(range(40)))  # warm again, verdicts for 0.5 s
    hints.close()
    assert hints.advised_bytes == 0
    _make_cold(pack)
    time.sleep(0.6)  # the warm verdicts expire: the kernel is asked again
    hints.advise(list(range(40)))
    hints.close()
    assert hints.advised_bytes > 0


@pytest.mark.timeout(60)  # a FIFO opened for reading blocks until a writer comes: a hang is the failure
@pytest.mark.parametrize("damage", ["fifo", "negative offsets", "past the end"])
def test_read_ahead_skips_a_shard_that_lies_and_hints_the_others(
    small_texts: Path, tmp_path: Path, damage: str
) -> None:
    """A shard whose data file is a FIFO (never opened) or whose table points outside the file: no error, no hang.

    That shard's records get no hint inside any file (past the end: at most one page the kernel ignores),
    and the other shards' records are all still hinted.
    """
    from packdata.reading.readahead import ReadAhead

    convert(small_texts, tmp_path / "p.lmdb", shard_samples=9, progress=False)
    pack = tmp_path / "p.lmdb"
    hints = ReadAhead(pack, LMDBDataset(pack).pack.manifest)
    _make_cold(pack)  # hints are due
    first = sorted(pack.glob("shard-*.lmdb"))[0]
    if damage == "fifo":
        (first / "data.mdb").unlink()
        os.mkfifo(first / "data.mdb")
    else:
        table = np.fromfile(first / "records.i64", dtype="<i8").reshape(-1, 3)
        table[2:, 0] = -4096 if damage == "negative offsets" else 1 << 40
        table[2:, 1] = -1 if damage == "negative offsets" else 4096
        table.tofile(first / "records.i64")
    hints.advise(list(range(40)))
    hints.close()
    assert hints._thread is None
    others = [p for p in sorted(pack.glob("shard-*.lmdb")) if p != first]
    wanted = sum(int(np.fromfile(p / "records.i64", dtype="<i8").reshape(-1, 3)[2:, 1].sum()) for p in others)
    room = sum((p / "data.mdb").stat().st_size for p in others)
    assert wanted <= hints.advised_bytes <= room + (4096 if damage == "past the end" else 0)


def test_an_idle_read_ahead_leaves_no_thread(small_texts: Path, tmp_path: Path, monkeypatch) -> None:
    import threading

    from packdata.reading.readahead import ReadAhead

    monkeypatch.setattr(ReadAhead, "IDLE", 0.05)
    monkeypatch.setattr(ReadAhead, "RECHECK", 0.0)  # the shards' residency is asked anew at each window
    others = set(threading.enumerate())  # another test's read-ahead may still be idling out
    convert(small_texts, tmp_path / "p.lmdb", shard_samples=9, progress=False)
    sampler = BlockShuffleSampler(LMDBDataset(tmp_path / "p.lmdb"), block_size=4, window=2)
    _make_cold(tmp_path / "p.lmdb")  # a warm shard gets no hints

    def hint_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "packdata-sampler-hints" and t not in others]

    def settled() -> int:
        """The bytes hinted once the hint threads have ended on their own (each joined; 60 s: it never ends)."""
        for thread in hint_threads():
            thread.join(60)
        return sampler._read_ahead.advised_bytes

    assert len(list(sampler)) == 40
    first = settled()
    assert first > 0 and hint_threads() == []  # the hints were given, then an idle thread ended on its own
    _make_cold(tmp_path / "p.lmdb")  # the hints brought the pages in
    assert len(list(sampler)) == 40
    assert settled() > first and hint_threads() == []  # and it started again when needed


def _iterate_in_child(sampler: BlockShuffleSampler, out: Any) -> None:
    """A forked child's epoch of ``sampler``: what its read-ahead did (hints given, windows left queued)."""
    assert len(list(sampler)) == 40
    hints = sampler._read_ahead
    assert hints is not None
    hints.close()  # its thread ends once every queued window is hinted
    out.put((hints.advised_bytes, hints._queue.qsize()))


def test_a_sampler_iterated_in_a_forked_child_hints_there(small_texts: Path, tmp_path: Path) -> None:
    """The read-ahead's thread, lock and files were the parent's after a fork: the child queued every window
    for a thread that does not run there (no hint given, the queue growing each epoch), and a lock the parent's
    thread held at the fork blocked the child's first hint forever. The child now starts afresh."""
    import multiprocessing

    convert(small_texts, tmp_path / "p.lmdb", shard_samples=9, progress=False)
    sampler = BlockShuffleSampler(LMDBDataset(tmp_path / "p.lmdb"), block_size=4, window=2)
    next(iter(sampler))  # the parent's hint thread runs
    hints = sampler._read_ahead
    assert hints is not None and hints._thread is not None
    _make_cold(tmp_path / "p.lmdb")  # a warm shard gets no hints
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    child = context.Process(target=_iterate_in_child, args=(sampler, out))
    with hints._lock:  # as the parent's thread holds it for a moment whenever it starts or ends
        child.start()
    child.join(timeout=30)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0
    advised, left = out.get(timeout=5)
    assert advised > 0 and left == 0


def test_the_first_block_is_asked_for_alone_before_its_window(small_texts: Path, tmp_path: Path, monkeypatch) -> None:
    """The first batch waits on the first block's reads: they go to the kernel before the rest of the window's."""
    from packdata.reading.readahead import ReadAhead

    convert(small_texts, tmp_path / "p.lmdb", shard_samples=9, progress=False)
    ds = LMDBDataset(tmp_path / "p.lmdb", decode="bytes")
    asked: list[list[int]] = []
    monkeypatch.setattr(ReadAhead, "advise", lambda self, indices: asked.append(list(indices)))
    sampler = BlockShuffleSampler(ds, block_size=4, window=3, seed=5)
    order = list(sampler)
    assert asked[0] == order[:4]  # the first block, alone
    assert asked[1] == order[:12] and asked[2] == order[12:24]  # then its window, then the next


def test_a_state_saved_by_more_ranks_than_samples_loads_into_fewer() -> None:
    """The bound on a state's world sizes (the samples, or this sampler's world) refused a genuine state of 64
    ranks over 10 samples loaded by 2 ranks; world sizes up to 2**20 now load whatever the pack's size."""
    saved = BlockShuffleSampler(10, world_size=64, rank=0, read_ahead=False)
    next(iter(saved))
    resumed = BlockShuffleSampler(10, world_size=2, rank=0, read_ahead=False)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.state_dict()["consumed"][0] == [64, 1]


@pytest.mark.parametrize(("rank", "world"), [("0", "0"), ("2", "2")])
def test_a_rank_or_world_out_of_range_from_the_environment_names_the_variables(
    monkeypatch: pytest.MonkeyPatch, rank: str, world: str
) -> None:
    """WORLD_SIZE=0 said 'but got world_size=0', an argument the user never passed; the launcher's variables
    are named now. A value given as an argument is named as before."""
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(ValueError, match=re.escape(f"(from the environment: RANK={rank!r}, WORLD_SIZE={world!r})")):
        BlockShuffleSampler(10)
    with pytest.raises(ValueError, match=r"but got world_size=0$"):
        resolve_rank_world(0, 0)


def test_a_state_saved_on_a_pack_converted_again_since_is_refused(small_texts: Path, tmp_path: Path) -> None:
    """The state named the pack only by its sample count: after 'convert --overwrite' of other texts (same count)
    between the checkpoint and the restart, the rest of the epoch read the new pack at the positions the old one's
    order left unread, two packs mixed in one epoch, silently."""
    pack = tmp_path / "p.lmdb"
    convert(small_texts, pack, shard_samples=9, progress=False)
    sampler = BlockShuffleSampler(LMDBDataset(pack), block_size=4, window=2, read_ahead=False)
    it = iter(sampler)
    for _ in range(5):
        next(it)
    state = sampler.state_dict()
    again = BlockShuffleSampler(LMDBDataset(pack), block_size=4, window=2)  # the same pack: resumes
    again.load_state_dict(state)
    assert len(list(again)) == 35
    staged = packdata.stage(pack, to=tmp_path / "cache", progress=False).staged  # a staged copy resumes too
    BlockShuffleSampler(LMDBDataset(staged), block_size=4, window=2).load_state_dict(state)
    BlockShuffleSampler(40, block_size=4, window=2).load_state_dict(state)  # over a length: nothing to compare
    (small_texts / "a" / "00.txt").write_text("edited", encoding="utf-8")
    convert(small_texts, pack, shard_samples=9, overwrite=True, progress=False)
    other = BlockShuffleSampler(LMDBDataset(pack), block_size=4, window=2)
    with pytest.raises(ConfigError, match=r"^the sampler state was saved over the pack with shards '[0-9a-f]{16}'"):
        other.load_state_dict(state)
    other.load_state_dict({k: v for k, v in state.items() if k != "pack"})  # saved before states named their pack
