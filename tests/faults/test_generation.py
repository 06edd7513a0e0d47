"""A dataset opened on a pack keeps reading that generation, or fails clearly: never a mix after --overwrite."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import image_bytes
from torch.utils.data import DataLoader

from packdata import LMDBDataset, PackFormatError, convert
from packdata.reading.streaming import TFRecordDataset
from packdata.reading.tfrecord_indexed import TFRecordIndexedDataset

MAKERS = {
    "lmdb": lambda p: LMDBDataset(p, decode="bytes"),
    "tfrecord-indexed": lambda p: TFRecordIndexedDataset(p, decode="bytes"),
    "tfrecord-stream": lambda p: TFRecordDataset(p, decode="bytes", shuffle=False),
}


def _folder(root: Path, seed: int) -> Path:
    for c, cls in enumerate(["a", "b", "c"]):
        (root / cls).mkdir(parents=True)
        for i in range(8):
            (root / cls / f"{i:02d}.jpg").write_bytes(image_bytes(seed + 10 * c + i))
    return root


@pytest.mark.parametrize("reader", sorted(MAKERS))
def test_overwrite_under_forked_workers_fails_clearly(tmp_path: Path, reader: str) -> None:
    fmt = "lmdb" if reader == "lmdb" else "tfrecord"
    dst = tmp_path / f"pack.{fmt}"
    convert(_folder(tmp_path / "old", 0), dst, shard_samples=6, progress=False)
    ds = MAKERS[reader](dst)
    old = list(DataLoader(ds, batch_size=None, num_workers=0))
    convert(_folder(tmp_path / "new", 1000), dst, overwrite=True, shard_samples=6, progress=False)
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    with pytest.raises(PackFormatError, match=r"pack changed since the dataset was opened.*Recreate the dataset"):
        list(loader)
    fresh = list(DataLoader(MAKERS[reader](dst), batch_size=None, num_workers=0))  # a new dataset reads the new pack
    assert len(fresh) == len(old) and fresh != old
