"""Mid-epoch resume under torchrun: 2 ranks on gloo, 2 StatefulDataLoader workers each, 2 launches.

Launch 1 (``tests/resume_ddp_worker.py --phase stop``) reads the uninterrupted
epoch, then for each ``k`` stops a new loader after ``k`` batches on every rank
and saves each rank's ``loader.state_dict()`` as JSON. Launch 2 (``--phase
resume``, a new torchrun job) loads the states and finishes the epoch. Both
launches read an LMDB pack (``BlockShuffleSampler``) and a TFRecord pack
(``TFRecordDataset``) in turn, so torch is imported twice per rank, not four
times. The tests check, for each ``k``: run 1 + run 2 over both ranks is every
sample exactly once, and each rank's run 1 + run 2 is its uninterrupted order
(for LMDB also ``BlockShuffleSampler``'s own order). 40 samples over 2 ranks
and batches of 4: nothing is padded. A hang fails through the subprocess
timeout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_torchrun

import packdata

pytest.importorskip("torchdata.stateful_dataloader")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

WORKER = Path(__file__).with_name("resume_ddp_worker.py")
RUN_TIMEOUT = 100
N, BATCH, WORLD = 40, 4, 2  # 20 per rank: no padding
KEYS = sorted(f"{cls}/{i:02d}.txt" for cls, count in (("a", 23), ("b", N - 23)) for i in range(count))
# batches k -> samples each rank has taken after k batches
STOPS = {
    # 5 batches per rank: stop before the first, mid-epoch, after the last
    "lmdb": {0: 0, 2: 8, 5: 20},
    # 10 samples per worker in batches of 4, 4, 2, the workers taking turns: 6 batches per rank;
    # stop before the first, mid-epoch, after worker 0's short last batch, after the last
    "tfrecord": {0: 0, 3: 12, 5: 18, 6: 20},
}


def _torchrun(packs: dict[str, Path], phase: str, out: Path, states: Path) -> list[dict]:
    out.mkdir()
    args = [str(out), str(states), "--phase", phase, "--workers", "2", "--batch-size", str(BATCH)]
    for fmt, pack in packs.items():
        args += ["--pack", fmt, str(pack), ",".join(map(str, STOPS[fmt]))]
    run_torchrun(WORKER, args, nproc=WORLD, timeout=RUN_TIMEOUT)
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert [(r["rank"], r["world"]) for r in reports] == [(0, WORLD), (1, WORLD)]
    return reports


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[dict], Path]:
    """(launch 1 reports, launch 2 reports, states folder), one report per rank."""
    tmp = tmp_path_factory.mktemp("resume_ddp")
    root = tmp / "texts"
    for key in KEYS:
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_text(key, encoding="utf-8")  # each file holds its own key
    packs = {"lmdb": tmp / "p.lmdb", "tfrecord": tmp / "p.tf"}
    packdata.convert(root, packs["lmdb"], kind="text", shard_samples=12, progress=False)
    packdata.convert(root, packs["tfrecord"], format="tfrecord", kind="text", shard_samples=12, progress=False)
    states = tmp / "states"
    first = _torchrun(packs, "stop", tmp / "run1", states)
    second = _torchrun(packs, "resume", tmp / "run2", states)
    return first, second, states


def _check(runs: tuple[list[dict], list[dict], Path], fmt: str) -> list[dict]:
    first, second, states = runs
    reports = [report[fmt] for report in first]
    assert all((r["rank"], r["world"]) == (rank, WORLD) for rank, r in enumerate(reports))  # from torch.distributed
    full = [r["full"] for r in reports]
    assert sorted(full[0] + full[1]) == KEYS  # the uninterrupted epoch: every sample once, none padded
    for k, taken in STOPS[fmt].items():
        for rank in range(WORLD):  # a JSON state per rank, read back by launch 2
            assert json.loads((states / fmt / str(k) / f"rank{rank}.json").read_text()), (k, rank)
        before = [r["runs"][str(k)] for r in reports]
        after = [report[fmt]["runs"][str(k)] for report in second]
        assert [len(b) for b in before] == [taken] * WORLD, k
        union = [key for rank in range(WORLD) for key in before[rank] + after[rank]]
        assert sorted(union) == KEYS, f"k={k}: not every sample exactly once"
        for rank in range(WORLD):
            assert before[rank] + after[rank] == full[rank], f"k={k}, rank {rank}: not the uninterrupted order"
    return reports


def test_torchrun_lmdb_block_sampler_resume(runs: tuple[list[dict], list[dict], Path]) -> None:
    reports = _check(runs, "lmdb")
    # the loader yielded BlockShuffleSampler's own order (its indices() mapped to keys) on each rank
    assert [r["order"] for r in reports] == [r["full"] for r in reports]


def test_torchrun_tfrecord_dataset_resume(runs: tuple[list[dict], list[dict], Path]) -> None:
    _check(runs, "tfrecord")
