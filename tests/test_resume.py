"""Resume mid-epoch: BlockShuffleSampler and TFRecordDataset states through StatefulDataLoader.

Every case stops after ``k`` batches (none, mid-epoch, the last), saves the
state as JSON, builds pack reader, sampler and loader anew, loads, finishes the
epoch, and checks the run against an uninterrupted one: the same order at the
same world size, every remaining sample exactly once at another.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from packdata import BlockShuffleSampler, LMDBDataset, TFRecordDataset, TokenBucketSampler, convert
from packdata.errors import ConfigError

torchdata = pytest.importorskip("torchdata.stateful_dataloader")
StatefulDataLoader = torchdata.StatefulDataLoader

N = 37  # samples: odd, so two ranks pad
BATCH = 4


@pytest.fixture(scope="module")
def packs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("resume")
    root = tmp / "texts"
    for cls, count in (("a", 19), ("b", N - 19)):
        (root / cls).mkdir(parents=True)
        for i in range(count):
            (root / cls / f"{i:02d}.txt").write_text(f"{cls}/{i:02d}", encoding="utf-8")
    convert(root, tmp / "p.lmdb", kind="text", shard_samples=10, progress=False)
    convert(root, tmp / "p.tf", format="tfrecord", kind="text", shard_samples=10, progress=False)
    return {"lmdb": tmp / "p.lmdb", "tfrecord": tmp / "p.tf"}


def _ids(batch: list) -> list[str]:
    data = batch[0]
    return [bytes(d).decode() for d in data]


def _collate(items: list) -> tuple[list, list]:
    return [x for x, _ in items], [y for _, y in items]


def _sampler_loader(pack: Path, rank: int, world: int, workers: int, epoch: int = 1) -> StatefulDataLoader:
    ds = LMDBDataset(pack, decode="bytes")
    sampler = BlockShuffleSampler(ds, block_size=4, window=2, seed=5, rank=rank, world_size=world)
    sampler.set_epoch(epoch)
    return StatefulDataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=workers, collate_fn=_collate)


def _interrupted(make, stop: int) -> tuple[list[str], list[str]]:
    """Samples before and after a checkpoint at batch ``stop``, the second half from a new loader."""
    loader = make()
    before: list[str] = []
    it = iter(loader)
    for _ in range(stop):
        before.extend(_ids(next(it)))
    state = json.dumps(loader.state_dict())
    del it, loader
    fresh = make()
    fresh.load_state_dict(json.loads(state))
    after = [s for batch in fresh for s in _ids(batch)]
    return before, after


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("world", [1, 2])
def test_sampler_exact_resume(packs: dict[str, Path], world: int, workers: int) -> None:
    for rank in range(world):
        make = lambda rank=rank: _sampler_loader(packs["lmdb"], rank, world, workers)  # noqa: E731
        full = [s for batch in make() for s in _ids(batch)]
        batches = -(-len(full) // BATCH)
        for stop in sorted({0, 1, batches // 2, batches - 1, batches}):
            before, after = _interrupted(make, stop)
            assert before + after == full, (rank, stop)


def test_sampler_json_state_and_plain_dataloader(packs: dict[str, Path]) -> None:
    from torch.utils.data import DataLoader

    ds = LMDBDataset(packs["lmdb"], decode="bytes")

    def make() -> tuple[BlockShuffleSampler, DataLoader]:
        sampler = BlockShuffleSampler(ds, block_size=4, window=2, seed=5)
        sampler.set_epoch(3)
        return sampler, DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=2, collate_fn=_collate)

    sampler, loader = make()
    full = [s for batch in loader for s in _ids(batch)]
    sampler, loader = make()
    before: list[str] = []
    for step, batch in enumerate(loader, 1):
        before.extend(_ids(batch))
        if step == 3:
            state = json.dumps(sampler.state_dict(consumed=step * BATCH))  # workers prefetched further
            break
    del loader
    sampler, loader = make()
    sampler.load_state_dict(json.loads(state))
    assert json.loads(state)["epoch"] == 3 and sampler.epoch == 3
    after = [s for batch in loader for s in _ids(batch)]
    assert before + after == full
    sampler.set_epoch(4)  # the next epoch is whole again
    assert len(list(sampler)) == N


@pytest.mark.parametrize("world", [1, 2])
def test_a_state_saved_after_a_short_last_batch_loads(world: int) -> None:
    """consumed=(step + 1) * batch_size, as the README saves it, ran past a short last batch:
    the state of the epoch's end was refused on load ("says 12 samples consumed, but ... holds 10")."""
    from torch.utils.data import DataLoader

    def make(rank: int) -> BlockShuffleSampler:
        sampler = BlockShuffleSampler(10 * world, block_size=4, window=2, seed=5, rank=rank, world_size=world)
        sampler.set_epoch(3)
        return sampler

    for rank in range(world):
        sampler = make(rank)
        for step, _batch in enumerate(DataLoader(range(10 * world), batch_size=4, sampler=sampler)):
            state = sampler.state_dict(consumed=(step + 1) * 4)
        assert step == 2 and state["consumed"] == [[world, 10]]
        fresh = make(rank)
        fresh.load_state_dict(json.loads(json.dumps(state)))
        assert list(fresh) == [] and fresh.epoch == 4
    elastic = BlockShuffleSampler(10 * world, block_size=4, window=2, seed=5, rank=0, world_size=3)
    elastic.load_state_dict({**state, "consumed": [[world, 4], [3, 0]]})  # 6 a rank left, over 3 ranks
    assert len(list(elastic)) == 2 * world and elastic.state_dict(consumed=8)["consumed"][-1] == [3, 2 * world]


def test_sampler_end_of_epoch_state_moves_to_next_epoch() -> None:
    sampler = BlockShuffleSampler(N, block_size=4, window=2, seed=5)
    sampler.set_epoch(2)
    list(sampler)
    state = sampler.state_dict()
    fresh = BlockShuffleSampler(N, block_size=4, window=2, seed=5)
    fresh.load_state_dict(state)
    assert list(fresh) == [] and fresh.epoch == 3
    reference = BlockShuffleSampler(N, block_size=4, window=2, seed=5)
    reference.set_epoch(3)
    assert list(fresh) == list(reference)


@pytest.mark.parametrize(
    "consumed",
    [
        [[0, 5], [2, 0]],  # a world of no rank: was a ZeroDivisionError
        [[-2, 5], [2, 0]],  # was numpy's "can only specify one unknown dimension"
        [[2, -5]],
        [[2, 5.7]],  # was read as 5
        [["2", "5"]],  # was read as 2 and 5
        [[True, 0], [2, 0]],
        [[2, 5, 9]],  # was "too many values to unpack"
        None,  # was "'NoneType' object is not iterable"
        [],
        [[10**7, 0], [2, 0]],  # a layout of 10**7 ranks was allocated (2**40 of them: 8 TB, the process killed)
        [[3, 1000], [2, 0]],  # more than a rank held at that world size: a ValueError
    ],
)
def test_a_malformed_sampler_state_is_refused_and_the_sampler_left_as_it_was(consumed: object) -> None:
    sampler = BlockShuffleSampler(N, block_size=4, window=2, seed=5, rank=0, world_size=2)
    state = {**sampler.state_dict(), "epoch": 3, "consumed": consumed}
    sampler.set_epoch(1)
    before = list(sampler)
    with pytest.raises(ConfigError, match=r"the sampler state('s consumed should be| says consumed=1000)"):
        sampler.load_state_dict(state)
    assert sampler.epoch == 1 and list(sampler) == before


@pytest.mark.parametrize("epoch", [None, -1, "1", 1.5, True])
def test_a_sampler_state_with_a_bad_epoch_is_refused_at_load(epoch: object) -> None:
    """A negative epoch loaded, then failed in numpy's generator at iteration; "1" and 1.5 loaded as 1."""
    state = {**BlockShuffleSampler(N, seed=5).state_dict(), "epoch": epoch}
    with pytest.raises(ConfigError, match=r"the sampler state's epoch should be an integer from 0 on, but got epoch="):
        BlockShuffleSampler(N, seed=5).load_state_dict(state)


def test_sampler_state_checks_order_options() -> None:
    state = BlockShuffleSampler(N, seed=5).state_dict()
    with pytest.raises(ConfigError, match=r"seed=5.*seed=6"):
        BlockShuffleSampler(N, seed=6).load_state_dict(state)
    with pytest.raises(ConfigError, match="num_samples"):
        BlockShuffleSampler(N + 1, seed=5).load_state_dict(state)


def _elastic(before_world: int, after_world: int, steps: list[int]) -> None:
    """Run an epoch across world sizes (``steps[i]`` samples per rank in phase i, None: to the end)."""
    worlds = [before_world, after_world]
    seen: Counter[int] = Counter()
    states = [None] * before_world
    for phase, world in enumerate(worlds):
        taken = steps[phase] if phase < len(steps) else None
        new_states = []
        lengths = set()
        for rank in range(world):
            sampler = BlockShuffleSampler(N, block_size=4, window=2, seed=5, rank=rank, world_size=world)
            sampler.set_epoch(1)
            if phase:
                sampler.load_state_dict(json.loads(json.dumps(states[0])))  # any rank's state: ranks are in lockstep
            order = list(sampler)
            lengths.add(len(order))
            order = order if taken is None else order[:taken]
            seen.update(order)
            new_states.append(sampler.state_dict(consumed=len(order)))
        assert len(lengths) == 1  # equal per-rank counts, so DDP never waits
        states = new_states
    assert set(seen) == set(range(N))
    repeats = sum(seen.values()) - N
    assert repeats <= before_world - 1 + after_world - 1  # padding only


@pytest.mark.parametrize("before_world,after_world", [(2, 1), (1, 2), (2, 3), (3, 2)])
@pytest.mark.parametrize("taken", [0, 5, 18])
def test_sampler_elastic_every_remaining_sample_once(before_world: int, after_world: int, taken: int) -> None:
    per_rank = -(-N // before_world)
    _elastic(before_world, after_world, [min(taken, per_rank)])


def test_sampler_elastic_exactly_once_without_padding() -> None:
    # 36 samples split evenly at 1, 2 and 3 ranks: no padding, so each sample is visited exactly once
    seen: Counter[int] = Counter()
    state = None
    for world, taken in ((2, 5), (3, 2), (1, None)):
        for rank in range(world):
            sampler = BlockShuffleSampler(36, block_size=4, window=2, seed=5, rank=rank, world_size=world)
            if state is not None:
                sampler.load_state_dict(state)
            order = list(sampler)[:taken]
            seen.update(order)
            next_state = sampler.state_dict(consumed=len(order))
        state = json.loads(json.dumps(next_state))
    assert seen == Counter(range(36))


def _token_loaders(pack: Path, world: int, workers: int, states: list[str] | None = None) -> list:
    """One StatefulDataLoader per rank over TokenBucketSampler batches of up to 6 samples (4 bytes each, budget 24)."""
    ds = LMDBDataset(pack, decode="bytes")
    loaders = []
    for rank in range(world):
        sampler = TokenBucketSampler(ds, 24, bucket_size=8, seed=5, rank=rank, world_size=world, check_ranks=False)
        sampler.set_epoch(1)
        loader = StatefulDataLoader(ds, batch_sampler=sampler, num_workers=workers, collate_fn=_collate)
        if states is not None:
            loader.load_state_dict(json.loads(states[0]))  # every rank consumed the same steps: any rank's state
        loaders.append(loader)
    return loaders


@pytest.mark.parametrize(("before_world", "after_world"), [(1, 1), (2, 2), (2, 3), (3, 1)])
@pytest.mark.parametrize("workers", [0, 2])
def test_token_bucket_resume_visits_every_remaining_sample_also_at_another_world_size(
    packs: dict[str, Path], before_world: int, after_world: int, workers: int
) -> None:
    full = [[_ids(batch) for batch in loader] for loader in _token_loaders(packs["lmdb"], before_world, 0)]
    seen: Counter[str] = Counter()
    states = []
    for loader in _token_loaders(packs["lmdb"], before_world, workers):
        it = iter(loader)
        for _ in range(2):
            seen.update(_ids(next(it)))  # 2 steps of every rank
        states.append(json.dumps(loader.state_dict()))
        del it
    rest = [[_ids(batch) for batch in loader] for loader in _token_loaders(packs["lmdb"], after_world, workers, states)]
    for after in rest:
        seen.update(s for batch in after for s in batch)
    assert set(seen) == {f"{c}/{i:02d}" for c, count in (("a", 19), ("b", N - 19)) for i in range(count)}
    assert sum(seen.values()) - N <= 6 * (before_world - 1 + after_world - 1)  # whole padding batches only
    if before_world == after_world:  # the same ranks continue exactly
        assert [full[r][2:] for r in range(after_world)] == rest


def test_token_bucket_state_for_a_plain_dataloader_counts_batches(packs: dict[str, Path]) -> None:
    from torch.utils.data import DataLoader

    ds = LMDBDataset(packs["lmdb"], decode="bytes")
    sampler = TokenBucketSampler(ds, 24, bucket_size=8, seed=5)
    full = [_ids(batch) for batch in DataLoader(ds, batch_sampler=sampler, collate_fn=_collate)]
    state = json.dumps(sampler.state_dict(consumed=3))
    resumed = TokenBucketSampler(ds, 24, bucket_size=8, seed=5)
    resumed.load_state_dict(json.loads(state))
    assert [_ids(batch) for batch in DataLoader(ds, batch_sampler=resumed, collate_fn=_collate)] == full[3:]
    with pytest.raises(ConfigError, match="other max_tokens"):
        TokenBucketSampler(ds, 30, bucket_size=8, seed=5).load_state_dict(json.loads(state))


def test_sampler_resume_in_fresh_process(packs: dict[str, Path], tmp_path: Path) -> None:
    make = lambda: _sampler_loader(packs["lmdb"], 1, 2, 2)  # noqa: E731
    full = [s for batch in make() for s in _ids(batch)]
    loader = make()
    it = iter(loader)
    before = [s for _ in range(2) for s in _ids(next(it))]
    (tmp_path / "state.json").write_text(json.dumps(loader.state_dict()))
    del it, loader
    script = f"""
import json, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_resume import _ids, _sampler_loader
from pathlib import Path
loader = _sampler_loader(Path({str(packs["lmdb"])!r}), 1, 2, 2)
loader.load_state_dict(json.loads(Path({str(tmp_path / "state.json")!r}).read_text()))
print(json.dumps([s for batch in loader for s in _ids(batch)]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    after = json.loads(done.stdout.strip().splitlines()[-1])
    assert before + after == full


def _tf_loader(pack: Path, rank: int, world: int, workers: int, epoch: int = 1, **kw) -> StatefulDataLoader:
    ds = TFRecordDataset(pack, decode="bytes", seed=5, shuffle_buffer=6, rank=rank, world_size=world, **kw)
    ds.set_epoch(epoch)
    return StatefulDataLoader(ds, batch_size=BATCH, num_workers=workers, collate_fn=_collate)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("world", [1, 2])
def test_tfrecord_exact_resume(packs: dict[str, Path], world: int, workers: int, shuffle: bool) -> None:
    epoch: list[str] = []
    for rank in range(world):
        make = lambda rank=rank: _tf_loader(packs["tfrecord"], rank, world, workers, shuffle=shuffle)  # noqa: E731
        full = [s for batch in make() for s in _ids(batch)]
        epoch.extend(full)
        batches = len(list(make()))
        for stop in sorted({0, 1, batches // 2, batches - 1, batches}):
            before, after = _interrupted(make, stop)
            assert before + after == full, (rank, stop)
    counts = Counter(epoch)
    assert len(counts) == N and sum(counts.values()) - N == (world - N % world) % world  # padding only


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_tfrecord_state_saved_after_the_epoch_reads_the_next_epoch(
    packs: dict[str, Path], workers: int, persistent: bool
) -> None:
    """A state saved once the epoch ended, loaded with set_epoch(next): StatefulDataLoader makes a pass of the
    loaded state, finds it finished and starts another; that one read the loaded epoch's order again."""

    def make(epoch: int) -> StatefulDataLoader:
        ds = TFRecordDataset(packs["tfrecord"], decode="bytes", seed=5, shuffle_buffer=6, rank=0, world_size=1)
        ds.set_epoch(epoch)
        return StatefulDataLoader(
            ds, batch_size=BATCH, num_workers=workers, persistent_workers=persistent, collate_fn=_collate
        )

    loader = make(1)
    first = [s for batch in loader for s in _ids(batch)]
    state = json.loads(json.dumps(loader.state_dict()))
    expected = [s for batch in make(2) for s in _ids(batch)]
    assert sorted(first) == sorted(expected) and first != expected
    loader = make(2)
    loader.load_state_dict(state)
    assert [s for batch in loader for s in _ids(batch)] == expected


def test_tfrecord_state_is_per_worker_and_json(packs: dict[str, Path]) -> None:
    loader = _tf_loader(packs["tfrecord"], 0, 1, 2)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    workers = state["_snapshot"]["_worker_snapshots"]
    yielded = sorted(w["dataset_state"]["yielded"] for w in workers.values())
    assert yielded == [BATCH, 2 * BATCH]  # worker 0 gave batches 1 and 3, worker 1 batch 2
    assert {w["dataset_state"]["epoch"] for w in workers.values()} == {1}


def test_tfrecord_resume_reads_no_consumed_record(packs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    ds = TFRecordDataset(packs["tfrecord"], decode="bytes", seed=5, shuffle_buffer=6)
    full = [bytes(x).decode() for x, _ in ds]
    state = {**ds.state_dict(), "yielded": 30}
    fresh = TFRecordDataset(packs["tfrecord"], decode="bytes", seed=5, shuffle_buffer=6)
    fresh.load_state_dict(json.loads(json.dumps(state)))
    read: list[tuple[int, int, int]] = []
    original = TFRecordDataset._records

    def spy(self, segments):
        read.extend(segments)
        return original(self, segments)

    monkeypatch.setattr(TFRecordDataset, "_records", spy)
    assert [bytes(x).decode() for x, _ in fresh] == full[30:]
    assert sum(end - first for _, first, end in read) < N - 20  # only the tail and what the buffer still held


def test_tfrecord_state_checks_options(packs: dict[str, Path]) -> None:
    state = TFRecordDataset(packs["tfrecord"], decode="bytes", seed=5).state_dict()
    with pytest.raises(ConfigError, match="seed=5"):
        TFRecordDataset(packs["tfrecord"], decode="bytes", seed=6).load_state_dict(state)
    with pytest.raises(ConfigError, match="world_size"):
        TFRecordDataset(packs["tfrecord"], decode="bytes", seed=5, rank=0, world_size=2).load_state_dict(state)


def test_tfrecord_resume_in_fresh_process(packs: dict[str, Path], tmp_path: Path) -> None:
    make = lambda: _tf_loader(packs["tfrecord"], 1, 2, 2)  # noqa: E731
    full = [s for batch in make() for s in _ids(batch)]
    loader = make()
    it = iter(loader)
    before = [s for _ in range(3) for s in _ids(next(it))]
    (tmp_path / "state.json").write_text(json.dumps(loader.state_dict()))
    del it, loader
    script = f"""
import json, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_resume import _ids, _tf_loader
from pathlib import Path
loader = _tf_loader(Path({str(packs["tfrecord"])!r}), 1, 2, 2)
loader.load_state_dict(json.loads(Path({str(tmp_path / "state.json")!r}).read_text()))
print(json.dumps([s for batch in loader for s in _ids(batch)]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    after = json.loads(done.stdout.strip().splitlines()[-1])
    assert before + after == full


@pytest.mark.parametrize("workers", [0, 2])
def test_tfrecord_plain_dataloader_resume(packs: dict[str, Path], workers: int) -> None:
    from torch.utils.data import DataLoader

    def make() -> tuple[TFRecordDataset, DataLoader]:
        ds = TFRecordDataset(packs["tfrecord"], decode="bytes", seed=5, shuffle_buffer=6)
        ds.set_epoch(2)
        return ds, DataLoader(ds, batch_size=BATCH, num_workers=workers, collate_fn=_collate)

    full = [s for batch in make()[1] for s in _ids(batch)]
    for stop in (0, 3, 9, 10):  # 9: past worker 0's short last batch
        ds, loader = make()
        before: list[str] = []
        for step, batch in enumerate(loader):
            if step == stop:
                break
            before.extend(_ids(batch))
        state = json.dumps(ds.loader_state_dict(stop, batch_size=BATCH, num_workers=workers))
        del loader
        ds, loader = make()
        ds.load_state_dict(json.loads(state))
        after = [s for batch in loader for s in _ids(batch)]
        if workers == 0:
            assert before + after == full, stop
        else:  # each worker continues exactly, but a plain DataLoader restarts its round-robin at worker 0
            assert sorted(before + after) == sorted(full), stop


def test_a_loader_state_loaded_into_another_number_of_workers_names_both(packs: dict[str, Path]) -> None:
    ds = TFRecordDataset(packs["tfrecord"], decode="bytes", seed=5)
    ds.load_state_dict(ds.loader_state_dict(3, batch_size=BATCH, num_workers=2))
    with pytest.raises(
        ConfigError, match=r"is the streams of 2 workers \(loader_state_dict\), but it was loaded into worker 0 of 1"
    ):
        next(iter(ds))


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_tfrecord_loaded_state_resumes_one_pass_of_workers(packs: dict[str, Path], context: str) -> None:
    """The state stayed in the main process's dataset, so every later pass's workers resumed from it again:
    each later epoch (the same epoch number, or no set_epoch) read only the samples after the checkpoint."""
    from torch.utils.data import DataLoader

    ds = TFRecordDataset(packs["tfrecord"], decode="bytes", shuffle=False)
    loader = DataLoader(ds, batch_size=BATCH, num_workers=2, collate_fn=_collate, multiprocessing_context=context)
    full = [s for batch in loader for s in _ids(batch)]
    ds.load_state_dict(ds.loader_state_dict(3, batch_size=BATCH, num_workers=2))
    after = [s for batch in loader for s in _ids(batch)]
    assert len(after) == N - 3 * BATCH
    for _ in range(2):
        assert sorted(s for batch in loader for s in _ids(batch)) == sorted(full)
        ds.set_epoch(0)


@pytest.mark.parametrize(
    ("counts", "problem"),
    [
        ([0], "a list of 2 counts"),  # shorter than the workers: an IndexError in worker 1
        ([0, 0, 0], "a list of 2 counts"),  # longer: the extra count was ignored
        ([-1, 0], "from 0 to"),  # negative: worker 0 replayed more than it read
        ([0, 10**9], "from 0 to"),  # more than the worker's stream holds
        ([0, "3"], "from 0 to"),
        ({"0": 0}, "a list of 2 counts"),
    ],
)
def test_a_loader_state_with_bad_yielded_per_worker_is_refused_at_load(
    packs: dict[str, Path], counts: object, problem: str
) -> None:
    """A state whose counts do not fit the workers failed in a worker (IndexError) or skipped samples."""
    from torch.utils.data import DataLoader

    ds = TFRecordDataset(packs["tfrecord"], decode="bytes", seed=5, shuffle_buffer=6)
    state = {**ds.loader_state_dict(3, batch_size=BATCH, num_workers=2), "yielded_per_worker": counts}
    fresh = TFRecordDataset(packs["tfrecord"], decode="bytes", seed=5, shuffle_buffer=6)
    with pytest.raises(ConfigError, match=rf"yielded_per_worker should be {problem}.*but got"):
        fresh.load_state_dict(state)
        list(DataLoader(fresh, batch_size=BATCH, num_workers=2, collate_fn=_collate))


@pytest.mark.parametrize("workers", [0, -1, "2", True])
def test_a_loader_state_with_bad_num_workers_is_refused_at_load(packs: dict[str, Path], workers: object) -> None:
    ds = TFRecordDataset(packs["tfrecord"], decode="bytes", seed=5, shuffle_buffer=6)
    state = {**ds.loader_state_dict(3, batch_size=BATCH, num_workers=2), "num_workers": workers}
    with pytest.raises(ConfigError, match=r"num_workers should be a positive number of workers, but got"):
        TFRecordDataset(packs["tfrecord"], decode="bytes", seed=5, shuffle_buffer=6).load_state_dict(state)


@pytest.mark.parametrize(
    "field, value",
    [("yielded", "3"), ("yielded", 3.9), ("yielded", None), ("yielded", True), ("worker", "0"), ("num_workers", 0)],
)
def test_a_reader_state_with_a_bad_count_or_worker_is_refused_at_load(
    packs: dict[str, Path], field: str, value: object
) -> None:
    """A reader state's yielded of 3.9 or True resumed after 3 or 1 samples, "3" too, None raised a bare TypeError,
    and a worker of "0" was refused at iteration as 'worker 0 of 1 ... loaded into worker 0 of 1'."""
    ds = TFRecordDataset(packs["tfrecord"], decode="bytes", seed=5, shuffle_buffer=6)
    it = iter(ds)
    for _ in range(3):
        next(it)
    state = {**ds.state_dict(), field: value}
    fresh = TFRecordDataset(packs["tfrecord"], decode="bytes", seed=5, shuffle_buffer=6)
    with pytest.raises(ConfigError, match=rf"the reader state's {field} should be an integer from [01] on, but got"):
        fresh.load_state_dict(state)


@pytest.mark.parametrize("counts", [(3, 0, 2), (-1, BATCH, 2), (3, BATCH, -2)])
def test_a_loader_state_of_impossible_counts_is_refused(packs: dict[str, Path], counts: tuple[int, int, int]) -> None:
    """loader_state_dict(3, batch_size=0) raised a bare ZeroDivisionError; -1 batches read as none, -2 workers as 1."""
    batches, batch_size, workers = counts
    ds = TFRecordDataset(packs["tfrecord"], decode="bytes", seed=5, shuffle_buffer=6)
    with pytest.raises(ValueError, match=r"batches, batch_size and num_workers should be counts .*, but got batches="):
        ds.loader_state_dict(batches, batch_size=batch_size, num_workers=workers)


@pytest.mark.parametrize("epoch", ["missing", None, -1, "1", 1.0, True])
def test_a_reader_state_with_a_bad_epoch_is_refused_at_load(packs: dict[str, Path], epoch: object) -> None:
    """A missing or non-integer epoch was a bare KeyError or TypeError (or ValueError) from load_state_dict."""
    ds = TFRecordDataset(packs["tfrecord"], decode="bytes", seed=5, shuffle_buffer=6)
    state = ds.loader_state_dict(3, batch_size=BATCH, num_workers=2)
    if epoch == "missing":
        del state["epoch"]
    else:
        state["epoch"] = epoch
    with pytest.raises(ConfigError, match=r"epoch should be a number from 0 on, but got"):
        TFRecordDataset(packs["tfrecord"], decode="bytes", seed=5, shuffle_buffer=6).load_state_dict(state)
    state["epoch"] = np.int64(0)  # an epoch set from numpy (set_epoch keeps what it is given) still loads
    TFRecordDataset(packs["tfrecord"], decode="bytes", seed=5, shuffle_buffer=6).load_state_dict(state)
