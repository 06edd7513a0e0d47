"""Exactly once under DDP, and the rank check's messages: one torchrun of 3 ranks (gloo, CPU) runs every case.

``tests/ddp_cases_worker.py`` runs the cases in order on each rank; each test
below asserts on its case's part of the reports. One torchrun start for all of
them (each start costs seconds). Keys are compared as exact sorted lists across
the ranks: a sample lost or read twice fails, not only a wrong count.
"""

from __future__ import annotations

import collections
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import image_bytes, moto_s3, run_torchrun
from torch.utils.data import DistributedSampler

import packdata

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

WORKER = Path(__file__).with_name("ddp_cases_worker.py")
RANKS = 3
SAMPLES = 40  # over 3 ranks: DistributedSampler pads 2 (drop_last=False) or leaves 1 out (drop_last=True)
FIELD_SAMPLES = 23  # a multi-field pack: pads 1, or leaves 2 out


def _sampler_cases(single: Path, fields: Path) -> dict[str, dict[str, Any]]:
    """The DistributedSampler cases: drop_last both ways, spawn, persistent workers over 2 epochs, multi-field.

    ``tf_*``: the same through ``TFRecordIndexedDataset`` (its ``__getitems__``) over the TFRecord packs
    ``single`` and ``fields`` were converted to (the same paths without ``.lmdb``).
    """
    plain = {"kind": "sampler", "pack": str(single), "num_workers": 2}
    tfrecord = {**plain, "tfrecord": True, "pack": str(single.with_suffix(""))}
    return {
        "tf_keep_last": {**tfrecord, "drop_last": False},
        "tf_fields": {**tfrecord, "pack": str(fields.with_suffix("")), "drop_last": True, "fields": True},
        "keep_last": {**plain, "drop_last": False},
        "drop_last": {**plain, "drop_last": True},
        "spawn_persistent": {**plain, "drop_last": False, "context": "spawn", "persistent": True, "epochs": 2},
        "fields": {**plain, "pack": str(fields), "drop_last": True, "fields": True},
        "fields_keep_last": {**plain, "pack": str(fields), "drop_last": False, "fields": True, "num_workers": 0},
        "public_store": {"kind": "public_store", "pack": str(single)},
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The packs, the cases, and each rank's report of one torchrun."""
    root = tmp_path_factory.mktemp("ddp_cases")
    single, grouped = root / "src", root / "grouped"
    digests = {}
    for i in range(SAMPLES):
        data = image_bytes(i, fmt="PNG")
        (single / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        (single / f"c{i % 3}" / f"{i:02d}.png").write_bytes(data)
        digests[hashlib.sha1(data).hexdigest()] = f"c{i % 3}/{i:02d}.png"
    grouped.mkdir()
    for i in range(FIELD_SAMPLES):
        (grouped / f"s{i:02d}.txt").write_text(f"caption {i}")
        (grouped / f"s{i:02d}.json").write_text(json.dumps({"n": i}))
    packdata.convert(single, root / "pack.lmdb", shard_samples=7, progress=False)
    packdata.convert(grouped, root / "fields.lmdb", shard_samples=5, progress=False)
    packdata.convert(grouped, root / "fields", format="tfrecord", shard_samples=5, progress=False)
    packdata.convert(single, root / "pack", format="tfrecord", shard_samples=7, progress=False)
    packdata.convert(grouped, root / "other", format="tfrecord", progress=False)
    cases = _sampler_cases(root / "pack.lmdb", root / "fields.lmdb")
    for name, set_epoch, check_ranks in [("never_set", False, True), ("set", True, True), ("unchecked", False, False)]:
        cases[f"stream_{name}"] = {"kind": "stream", "pack": str(root / "pack"), "set_epoch": set_epoch}
        cases[f"stream_{name}"]["check_ranks"] = check_ranks
    cases["stream_built_before_init"] = {**cases["stream_never_set"], "before_init": True}
    cases["stream_built_before_init_spawn"] = {**cases["stream_built_before_init"], "context": "spawn"}
    cases["stream_spawn_persistent"] = {**cases["stream_set"], "context": "spawn", "persistent": True, "epochs": 2}
    with moto_s3({"key": "ddp-testing-key-id", "secret": "ddp-testing-secret"}) as (options, fs):
        fs.put(str(root / "pack"), "packs/train", recursive=True)
        fs.put(str(root / "other"), "packs/other", recursive=True)
        cases["url_pack"] = {"kind": "url_pack", "url": "s3://packs/train", "other": "s3://packs/other"}
        cases["url_pack"]["storage_options"] = options
        (root / "cases.json").write_text(json.dumps(cases))
        (root / "out").mkdir()
        run_torchrun(WORKER, [str(root / "cases.json"), str(root / "out")], nproc=RANKS, timeout=360)
    reports = [json.loads((root / "out" / f"rank{r}.json").read_text()) for r in range(RANKS)]
    assert [r["rank"] for r in reports] == list(range(RANKS)) and all(r["world"] == RANKS for r in reports)
    return {"cases": cases, "reports": reports, "digests": digests}


def _dataset(case: dict[str, Any]) -> Any:
    """The case's dataset, opened here: a sample's key from its index."""
    reader = packdata.TFRecordIndexedDataset if case.get("tfrecord") else packdata.LMDBDataset
    return reader(case["pack"], decode="bytes")


def _expected(case: dict[str, Any], epoch: int, key_of: Any) -> list[str]:
    """The keys torch's DistributedSampler gives all ranks together (its padding included), sorted."""
    n, drop_last = len(_dataset(case)), case["drop_last"]
    keys = []
    for rank in range(RANKS):
        sampler = DistributedSampler(range(n), num_replicas=RANKS, rank=rank, shuffle=True, seed=0, drop_last=drop_last)
        sampler.set_epoch(epoch)
        keys += [key_of(i) for i in sampler]
    return sorted(keys)


def _seen(run: dict[str, Any], name: str, epoch: int) -> list[list[str]]:
    results = [report["cases"][name] for report in run["reports"]]
    assert all("error" not in result for result in results), results
    return [result["epochs"][epoch]["seen"] for result in results]


@pytest.mark.parametrize("name", ["keep_last", "drop_last", "spawn_persistent", "tf_keep_last"])
def test_lmdb_under_distributed_sampler_reads_every_sample_once_across_ranks(run: dict[str, Any], name: str) -> None:
    """40 samples over 3 ranks, 2 workers, batches through __getitems__: torch's split, exactly, and nothing else."""
    case = run["cases"][name]
    dataset = _dataset(case)
    key_of = {i: run["digests"][hashlib.sha1(dataset[i][0]).hexdigest()] for i in range(len(dataset))}.__getitem__
    orders = []
    for epoch in range(case.get("epochs", 1)):
        seen = _seen(run, name, epoch)
        keys = sorted(run["digests"][d] for rank in seen for d in rank)  # KeyError: a foreign sample
        assert keys == _expected(case, epoch, key_of)
        counts = collections.Counter(keys)
        if case["drop_last"]:  # one sample left out, none twice
            assert len(counts) == SAMPLES - 1 and set(counts.values()) == {1}
        else:  # every sample, two of them twice (the padding)
            assert len(counts) == SAMPLES and sorted(counts.values()) == [1] * (SAMPLES - 2) + [2, 2]
        assert [len(rank) for rank in seen] == [len(keys) // RANKS] * RANKS
        orders.append(seen)
    if len(orders) == 2:  # persistent workers took set_epoch's new order
        assert orders[0] != orders[1]


@pytest.mark.parametrize("name", ["fields", "fields_keep_last", "tf_fields"])
def test_a_multi_field_pack_under_distributed_sampler_reads_every_sample_once(run: dict[str, Any], name: str) -> None:
    """23 multi-field samples over 3 ranks: each sample's ``__key__``, exactly as the sampler split them."""
    case = run["cases"][name]
    dataset = _dataset(case)
    keys = sorted(key for rank in _seen(run, name, 0) for key in rank)
    assert keys == _expected(case, 0, lambda i: dataset[i]["__key__"])
    counts = collections.Counter(keys)
    if case["drop_last"]:
        assert len(counts) == FIELD_SAMPLES - 2 and set(counts.values()) == {1}
    else:
        assert len(counts) == FIELD_SAMPLES and sorted(counts.values()) == [1] * (FIELD_SAMPLES - 1) + [2]


def test_check_same_pack_over_a_pack_at_a_url_names_the_url(run: dict[str, Any]) -> None:
    """Rank 1 streams another pack: every rank refuses naming each rank's URL, not its cached manifest's folder."""
    for rank, report in enumerate(run["reports"]):
        error = report["cases"]["url_pack"].get("error", "")
        shown = "s3://packs/other" if rank == 1 else "s3://packs/train"
        assert error.startswith(f"{shown}: the ranks of this job disagree on what their TFRecordDataset reads"), error
        assert "(s3://packs/train); rank 1 has samples=" in error and "(s3://packs/other):" in error, error
        assert "cache" not in error, error


def test_check_same_pack_over_a_tfrecord_dataset_names_the_pack_s_sample_count(run: dict[str, Any]) -> None:
    """The packs hold 40 and 23 samples: the error says so, not each rank's share of them (14 and 8 over 3 ranks)."""
    for report in run["reports"]:
        error = report["cases"]["url_pack"].get("error", "")
        assert "rank 0 has samples=40, pack='" in error and "rank 1 has samples=23, pack='" in error, error


def test_a_torch_without_its_private_default_store_still_compares_under_torchrun(run: dict[str, Any]) -> None:
    """Without torch's private _get_default_store, the ranks meet at torchrun's store: rank 1's seed is refused."""
    pack = run["cases"]["public_store"]["pack"]
    for report in run["reports"]:
        error = report["cases"]["public_store"].get("error", "")
        assert error.startswith(f"{pack}: the ranks of this job disagree on what their BlockShuffleSampler"), error
        assert f"rank 0 has seed=0 ({pack}); rank 1 has seed=1 ({pack})" in error, error
        assert "Pass the same seed and options on every rank" in error


def test_a_tfrecord_dataset_read_by_workers_without_set_epoch_is_refused_on_every_rank(run: dict[str, Any]) -> None:
    """2 workers a rank and no set_epoch: the ranks would never compare their pack. With set_epoch, or
    check_ranks=False, every sample is read once (40 over 3 ranks: 14 a rank, 2 repeated to pad)."""
    _refused_for_no_set_epoch(run, "stream_never_set")
    for name in ("stream_set", "stream_unchecked"):
        seen = _seen(run, name, 0)
        counts = collections.Counter(run["digests"][d] for rank in seen for d in rank)
        assert len(counts) == SAMPLES and sorted(counts.values()) == [1] * (SAMPLES - 2) + [2, 2]
        assert [len(rank) for rank in seen] == [14] * RANKS


@pytest.mark.parametrize("name", ["stream_built_before_init", "stream_built_before_init_spawn"])
def test_a_tfrecord_dataset_built_before_init_process_group_read_by_workers_without_set_epoch_is_refused(
    run: dict[str, Any], name: str
) -> None:
    """Built from torchrun's RANK/WORLD_SIZE before the group existed: its forked workers see the group since,
    and its spawned workers' copies were pickled once the group was made, so they are refused alike."""
    _refused_for_no_set_epoch(run, name)


def _refused_for_no_set_epoch(run: dict[str, Any], name: str) -> None:
    pack = run["cases"][name]["pack"]
    for rank, report in enumerate(run["reports"]):
        error = report["cases"][name].get("error", "")
        shown = f"{pack}: TFRecordDataset is read by DataLoader workers on rank {rank} of 3, but set_epoch was never"
        assert shown in error, error
        assert "Call set_epoch(epoch) on every rank before each epoch's loader iteration" in error
        assert "or pass check_ranks=False where the dataset is read on some ranks only" in error


def test_tfrecord_dataset_persistent_spawn_workers_read_every_sample_once_each_epoch(run: dict[str, Any]) -> None:
    """3 ranks, 2 spawned persistent workers each, set_epoch(0) then (1): each epoch every sample once across
    ranks (2 repeated to pad 40 to 42), 14 a rank, and a new order in epoch 1."""
    orders = []
    for epoch in range(2):
        seen = _seen(run, "stream_spawn_persistent", epoch)
        counts = collections.Counter(run["digests"][d] for rank in seen for d in rank)
        assert len(counts) == SAMPLES and sorted(counts.values()) == [1] * (SAMPLES - 2) + [2, 2]
        assert [len(rank) for rank in seen] == [14] * RANKS
        orders.append(seen)
    assert all(orders[0][rank] != orders[1][rank] for rank in range(RANKS))
