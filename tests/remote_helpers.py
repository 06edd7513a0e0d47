"""Helpers shared by the tests of packs in object storage (tests/test_remote_*.py)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from conftest import image_bytes

import packdata
from packdata.cli import main


def _samples(pack: Path) -> list[tuple[str, bytes, int]]:
    ds = packdata.LMDBDataset(pack, decode="bytes")
    return [(ds.keys[i], *ds[i]) for i in range(len(ds))]


def _two_classes(src: Path, seed: int) -> Path:
    """``cat/`` and ``dog/``, 5 small JPEGs each."""
    for c in ("cat", "dog"):
        (src / c).mkdir(parents=True)
        for i in range(5):
            (src / c / f"{i}.jpg").write_bytes(image_bytes(i + seed * len(c), (30, 20)))
    return src


_HOLDER = """
import sys, time
from packdata.pack.lock import hold_lock
with hold_lock(sys.argv[1], what="a stage killed mid-download", target=sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


def _cli(*args: str, options: dict) -> object:
    return CliRunner().invoke(main, [*args, "--storage-options", json.dumps(options)])


def _convert_to_s3(root: Path, tag: str, url: str, options: dict, fmt: str = "tfrecord") -> None:
    """Convert 12 text samples of 300 bytes starting with ``tag`` into ``url`` (one shard), over any pack there.

    Every tag gives records of the same lengths, keys and labels: only their bytes differ.
    """
    for c in ("x", "y"):
        (root / c).mkdir(parents=True)
        for i in range(6):
            (root / c / f"{i}.txt").write_text(f"{tag}{c}{i}" * 100)
    packdata.convert(root, url, format=fmt, shard_samples=12, overwrite=True, storage_options=options,
                     progress=False)  # fmt: skip
