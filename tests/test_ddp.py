"""DDP reading end to end: torchrun, 2 ranks on gloo (CPU), 2 DataLoader workers each, 2 epochs.

Each rank runs ``tests/ddp_worker.py`` and reports the SHA-1 of every sample
it read; the test maps them back to source files and checks: every sample once
per epoch across ranks, equal step counts on every rank, a new order after
``set_epoch``. A hang fails through the subprocess timeout (and pytest-timeout).
Ranks that open a pack on either side of an append (or of any change) are
refused on every rank; a pack and its staged copy read as one.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import run_torchrun
from PIL import Image

import packdata

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WORKER = Path(__file__).with_name("ddp_worker.py")
RUN_TIMEOUT = 240
N_CLASSES, PER_CLASS = 4, 10  # 40 samples: divisible by 2 ranks, so nothing is padded


@pytest.fixture
def source(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    for c in range(N_CLASSES):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(PER_CLASS):
            pixels = np.random.default_rng(1000 * c + i).integers(0, 255, (6, 6, 3), dtype=np.uint8)
            out = io.BytesIO()
            Image.fromarray(pixels).save(out, format="PNG")
            (root / f"c{c}" / f"{i:02d}.png").write_bytes(out.getvalue())
    return root


def _digests(root: Path) -> dict[str, str]:
    """SHA-1 of each source file's bytes -> its key (all files differ)."""
    out = {hashlib.sha1(p.read_bytes()).hexdigest(): p.relative_to(root).as_posix() for p in root.rglob("*.png")}
    assert len(out) == N_CLASSES * PER_CLASS
    return out


def _torchrun(pack: Path, fmt: str, out: Path, *extra: str) -> list[dict]:
    out.mkdir()
    args = [str(pack), str(out), "--format", fmt, "--workers", "2", "--epochs", "2", *extra]
    run_torchrun(WORKER, args, timeout=RUN_TIMEOUT)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _check(reports: list[dict], digests: dict[str, str]) -> None:
    assert [r["rank"] for r in reports] == [0, 1] and all(r["world"] == 2 for r in reports)
    orders = []
    for epoch in range(2):
        seen = [digests[d] for r in reports for d in r["epochs"][epoch]["digests"]]  # KeyError: a foreign sample
        assert sorted(seen) == sorted(digests.values()), f"epoch {epoch}: not every sample exactly once"
        steps = [r["epochs"][epoch]["steps"] for r in reports]
        # equal, or DDP would hang; an iterable loader's last batch per worker may be short, so not always 20 / 4
        assert steps[0] == steps[1] >= 5, f"epoch {epoch}: step counts per rank {steps}"
        assert [len(r["epochs"][epoch]["digests"]) for r in reports] == [20, 20]
        orders.append([r["epochs"][epoch]["digests"] for r in reports])
    assert orders[0] != orders[1], "set_epoch did not change the order"
    assert all(orders[0][r] != orders[1][r] for r in range(2)), "a rank saw the same order in both epochs"


def test_ddp_lmdb_distributed_sampler(source: Path, tmp_path: Path) -> None:
    packdata.convert(source, tmp_path / "pack.lmdb", shard_samples=12, progress=False)
    _check(_torchrun(tmp_path / "pack.lmdb", "lmdb", tmp_path / "out"), _digests(source))


def test_ddp_tfrecord_dataset(source: Path, tmp_path: Path) -> None:
    packdata.convert(source, tmp_path / "pack", format="tfrecord", shard_samples=6, progress=False)
    _check(_torchrun(tmp_path / "pack", "tfrecord", tmp_path / "out"), _digests(source))


@pytest.mark.parametrize("fmt", ["block", "token", "tfrecord"])
def test_a_reader_built_before_init_process_group_is_refused_not_read_by_every_rank(
    source: Path, tmp_path: Path, fmt: str
) -> None:
    """Built with no RANK/WORLD_SIZE and no group yet (mp.spawn scripts), it took rank 0 of 1: each rank read all."""
    pack = tmp_path / ("pack" if fmt == "tfrecord" else "pack.lmdb")
    packdata.convert(source, pack, format="tfrecord" if fmt == "tfrecord" else "lmdb", progress=False)
    reports = _torchrun(pack, fmt, tmp_path / "out", "--before-init", "--workers", "0", "--epochs", "1")
    for r, report in enumerate(reports):
        assert report["epochs"] == [], f"rank {r} read {len(report['epochs'][0]['digests'])} samples"
        assert f"torch.distributed says rank {r} of 2" in report["error"]
        assert "init_process_group" in report["error"]


def test_a_tfrecord_dataset_built_before_init_process_group_is_refused_in_spawned_workers_without_set_epoch(
    source: Path, tmp_path: Path
) -> None:
    """As above, read by 2 spawned workers a rank and no set_epoch: a spawned worker sees no group, so its
    copy compares with the group where the loader pickled it, and refuses instead of reading all 40 samples."""
    packdata.convert(source, tmp_path / "pack", format="tfrecord", progress=False)
    args = ["--before-init", "--spawn", "--no-set-epoch", "--epochs", "1"]
    reports = _torchrun(tmp_path / "pack", "tfrecord", tmp_path / "out", *args)
    for r, report in enumerate(reports):
        assert report["epochs"] == [], f"rank {r} read {len(report['epochs'][0]['digests'])} samples"
        shown = f"TFRecordDataset was built as rank 0 of 1, but torch.distributed says rank {r} of 2: it was built "
        assert shown + "before init_process_group" in report["error"], report["error"]
        assert "Build it after init_process_group, or pass rank= and world_size=" in report["error"]


def _extra_source(tmp_path: Path) -> Path:
    """8 more samples (2 a class, keys not in ``source``) to append: 48 in all, 24 a rank."""
    root = tmp_path / "more"
    for c in range(N_CLASSES):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(2):
            pixels = np.random.default_rng(5000 + 10 * c + i).integers(0, 255, (6, 6, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"c{c}" / f"more{i}.png")
    return root


@pytest.mark.parametrize("fmt", ["block", "token", "tfrecord", "lmdb"])
def test_ranks_that_open_a_pack_on_either_side_of_an_append_both_raise(source: Path, tmp_path: Path, fmt: str) -> None:
    """Rank 0 opened 40 samples, rank 1 48: each would cut its own view into halves, losing and repeating samples."""
    pack = tmp_path / ("pack" if fmt == "tfrecord" else "pack.lmdb")
    packdata.convert(source, pack, format="tfrecord" if fmt == "tfrecord" else "lmdb", progress=False)
    more = _extra_source(tmp_path)
    # the group's timeout bounds the collectives a silent disagreement leaves unmatched (or a hang in the check)
    reports = _torchrun(pack, fmt, tmp_path / "out", "--append", str(more), "--epochs", "1", "--timeout", "60")
    for r, report in enumerate(reports):
        assert report["epochs"] == [], f"rank {r} read {len(report['epochs'][0]['digests'])} samples"
        error = report["error"]
        assert error.startswith(f"{pack}: the ranks of this job disagree on what their "), error
        assert "rank 0 has samples=40, pack='" in error and "rank 1 has samples=48, pack='" in error, error
        assert "append to it or convert it again between jobs" in error


@pytest.mark.parametrize("fmt", ["block", "lmdb"])
def test_ranks_reading_a_pack_and_its_staged_copy_pass_the_check_and_read_every_sample_once(
    source: Path, tmp_path: Path, fmt: str
) -> None:
    """The same shards at another path are the same pack: rank 1 reads a staged copy, nothing is refused."""
    packdata.convert(source, tmp_path / "pack.lmdb", shard_samples=12, progress=False)
    staged = packdata.stage(tmp_path / "pack.lmdb", to=tmp_path / "cache").staged
    reports = _torchrun(tmp_path / "pack.lmdb", fmt, tmp_path / "out", "--rank1-pack", str(staged))
    _check(reports, _digests(source))


@pytest.mark.parametrize(("check_ranks", "store"), [(True, "group"), (False, "group"), (True, "torchrun")])
def test_a_sampler_iterated_on_one_rank_only_raises_after_the_group_timeout_and_never_hangs(
    source: Path, tmp_path: Path, check_ranks: bool, store: str
) -> None:
    """Rank 1 never iterates its sampler: rank 0 waits for it the group's timeout (10 s here), then names it.

    ``torchrun``: as a torch without the private default store, whose ranks meet
    at torchrun's store: it waits the group's timeout too, not torch's default
    30 minutes (the run's own timeout would fail the test). With
    ``check_ranks=False`` rank 0 reads its half and nothing is compared.
    """
    packdata.convert(source, tmp_path / "pack.lmdb", progress=False)
    args = ["--only-rank0", "--epochs", "1", "--timeout", "10", *([] if check_ranks else ["--no-check-ranks"])]
    args += ["--public-store"] if store == "torchrun" else []
    reports = _torchrun(tmp_path / "pack.lmdb", "block", tmp_path / "out", *args)
    assert reports[1]["epochs"] == [] and "error" not in reports[1]
    if not check_ranks:
        assert "error" not in reports[0] and len(reports[0]["epochs"][0]["digests"]) == 20
        return
    error = reports[0]["error"]
    assert error.startswith(f"{tmp_path / 'pack.lmdb'}: rank 0 of 2 waited for the other ranks to compare "), error
    assert "what their BlockShuffleSampler reads, and rank 1 never came within 0:00:10 (" in error, error
    assert "pass check_ranks=False where it is built on some ranks only" in error
