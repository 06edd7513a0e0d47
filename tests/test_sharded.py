"""Sharded packs: LMDB and TFRecord with many shards read back whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from packdata import LMDBDataset, TFRecordIndexedDataset, convert, verify_pack


@pytest.fixture
def texts(tmp_path: Path) -> dict[str, tuple[bytes, int]]:
    root = tmp_path / "src"
    expected = {}
    for c, cls in enumerate(("x", "y", "z")):
        (root / cls).mkdir(parents=True)
        for i in range(10):
            data = f"{cls} {i} ".encode() * (i + 1)
            (root / cls / f"{i}.txt").write_bytes(data)
            expected[f"{cls}/{i}.txt"] = (data, c)
    return expected


@pytest.mark.parametrize(("fmt", "dataset"), [("lmdb", LMDBDataset), ("tfrecord", TFRecordIndexedDataset)])
def test_sharded_round_trip(texts: dict, tmp_path: Path, fmt: str, dataset: type) -> None:
    pack = tmp_path / f"pack.{fmt}"
    result = convert(tmp_path / "src", pack, format=fmt, shard_samples=7, progress=False)
    assert result.shards == 5  # 30 samples, 7 per shard
    manifest = json.loads((pack / "manifest.json").read_text())
    assert [s["num_samples"] for s in manifest["shards"]] == [7, 7, 7, 7, 2]
    assert [s["first_index"] for s in manifest["shards"]] == [0, 7, 14, 21, 28]
    ds = dataset(pack, decode="bytes")
    assert {ds.keys[i]: ds[i] for i in range(len(ds))} == texts
    assert ds[-1] == ds[29]
    with pytest.raises(IndexError, match="out of range"):
        ds[30]
    assert verify_pack(pack, progress=False).shards == 5


def test_sharded_by_size(texts: dict, tmp_path: Path) -> None:
    convert(tmp_path / "src", tmp_path / "p.lmdb", shard_size=60, progress=False)
    ds = LMDBDataset(tmp_path / "p.lmdb", decode="bytes")
    assert len(ds.pack.manifest.shards) > 3
    assert {ds.keys[i]: ds[i] for i in range(len(ds))} == texts
