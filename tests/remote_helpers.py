"""Helpers shared by the tests of packs in object storage (tests/test_remote_*.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from conftest import faulty_s3, image_bytes

import packdata
from packdata.cli import main
from packdata.errors import SourceError


def changed_since_message(url: str) -> str:
    """The one line a conversion into ``url`` refuses with when the manifest there is no longer the one it found."""
    return (
        f"{url}: the manifest there changed since this conversion checked the destination (another conversion "
        "published there?): it was not overwritten. Run again to check it anew (with resume=True, nothing packed is "
        "lost); pass overwrite=True to replace it"
    )


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


def _convert_to_s3(
    root: Path, tag: str, url: str, options: dict, fmt: str = "tfrecord", shard_samples: int = 12
) -> None:
    """Convert 12 text samples of 300 bytes starting with ``tag`` into ``url`` (``shard_samples`` a shard), over it.

    Every tag gives records of the same lengths, keys and labels: only their bytes differ.
    """
    for c in ("x", "y"):
        (root / c).mkdir(parents=True)
        for i in range(6):
            (root / c / f"{i}.txt").write_text(f"{tag}{c}{i}" * 100)
    packdata.convert(root, url, format=fmt, shard_samples=shard_samples, overwrite=True, storage_options=options,
                     progress=False)  # fmt: skip


def _resume_a_refused_removal(
    src: Path, url: str, s3: tuple[dict, Any], old: str, **options: Any
) -> tuple[Any, list[tuple[str, str]], bytes]:
    """Convert ``src`` into ``url`` with overwrite=True, the store refusing once the DELETE of the old pack's object
    ``old`` (a path on the store) after the new manifest is up; the error checked, resume as it says (``options``
    hold resume=True and the conversion's). Returns the resume's result, the PUTs and DELETEs it sent (the write
    check's left out) and the manifest's bytes before it."""
    storage, fs = s3
    first = {k: v for k, v in options.items() if k not in ("resume", "overwrite")}
    with faulty_s3(storage) as (faulty, rules, hits):
        rules["DELETE", old] = [403, 1]
        with pytest.raises(SourceError) as raised:
            packdata.convert(src, url, storage_options=faulty, overwrite=True, **first)
        assert str(raised.value) == (
            f"{url}: the new pack is published, but the objects of the pack it replaced could not all be removed "
            "(PermissionError). Check the URL, the endpoint and the credentials (environment, profile or "
            "storage_options), then rerun with resume=True to remove the rest (nothing is uploaded again)"
        )
        published = fs.cat_file(f"{url.removeprefix('s3://')}/manifest.json")
        before = hits.copy()
        result = packdata.convert(src, url, storage_options=faulty, **options)
        during = hits - before
    sent = [key for key in during if key[0] in ("PUT", "DELETE") and "/.packdata-write-check-" not in key[1]]
    return result, sorted(sent), published
