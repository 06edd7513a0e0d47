"""DDP reading end to end: torchrun, 2 ranks on gloo (CPU), 2 DataLoader workers each, 2 epochs.

Each rank runs ``tests/ddp_worker.py`` and reports the SHA-1 of every sample
it read; the test maps them back to source files and checks: every sample once
per epoch across ranks, equal step counts on every rank, a new order after
``set_epoch``. A hang fails through the subprocess timeout (and pytest-timeout).
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
