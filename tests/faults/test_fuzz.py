"""Seeded byte-flip fuzzing of whole packs: every flip is named by ``verify``, and readers never return other bytes.

Each case copies a clean pack, flips one bit at a random offset of one of its
files (shard data, side tables, sample index, manifest), then
checks: ``verify_pack`` raises :class:`PackdataError`, or passes only when the
pack still reads exactly as the clean one (keys, labels, payloads: a flip that
changes no meaning, such as one whitespace byte for another in a text index),
and reading every
sample through the map-style dataset (and a TFRecord pack's stream too) with
``decode="bytes"`` either returns the original payload or raises a ``PackdataError``: never a traceback of another
kind, never other bytes. Labels come from the sample index, which has no
checksum of its own: a flipped label is caught by ``verify``, and by readers only
when it leaves ``[-1, len(classes))`` (the README says so). The skip report
(``skipped.jsonl``) has no checksum either: ``verify`` checks only its line count.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
from conftest import image_bytes

from packdata import PackdataError, TFRecordDataset, TFRecordIndexedDataset, convert, verify_pack
from packdata.reading.open import open_dataset

CASES_PER_FORMAT = 150


def _pack(root: Path, fmt: str) -> Path:
    src = root / "src"
    for c, cls in enumerate(("cat", "dog")):
        (src / cls).mkdir(parents=True)
        for i in range(5):
            (src / cls / f"{i}.jpg").write_bytes(image_bytes(10 * c + i))
    (src / "cat" / "broken.jpg").write_bytes(b"not an image")  # a skip report to damage too
    pack = root / f"clean.{fmt}"
    convert(src, pack, format=fmt, shard_samples=4, progress=False)
    return pack


def _payloads(pack: Path) -> list[bytes]:
    ds = open_dataset(pack, decode="bytes")
    payloads = [ds[i][0] for i in range(len(ds))]
    if isinstance(ds, TFRecordIndexedDataset):  # the stream reads the same records its own way
        assert [bytes(data) for data, _ in TFRecordDataset(pack, decode="bytes", shuffle=False)] == payloads
    return payloads


def _content(pack: Path) -> tuple[list[str], list[int], list[bytes]]:
    ds = open_dataset(pack, decode="bytes")
    return list(ds.keys), [int(t) for t in ds.targets], _payloads(pack)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_a_flipped_bit_anywhere_is_named_never_read_as_other_bytes(tmp_path: Path, fmt: str) -> None:
    clean = _pack(tmp_path, fmt)
    expected = _payloads(clean)
    clean_content = _content(clean)
    files = sorted(
        p.relative_to(clean) for p in clean.rglob("*") if p.is_file() and p.name not in ("lock.mdb", "skipped.jsonl")
    )
    rng = random.Random(f"fuzz-{fmt}")
    for case in range(CASES_PER_FORMAT):
        pack = tmp_path / f"case{case}.{fmt}"
        shutil.copytree(clean, pack)
        target = pack / rng.choice(files)
        data = bytearray(target.read_bytes())
        offset = rng.randrange(len(data))
        data[offset] ^= 1 << rng.randrange(8)
        target.write_bytes(bytes(data))
        where = f"{target.relative_to(pack)} byte {offset}"
        try:
            verify_pack(pack, progress=False)
        except PackdataError:
            pass
        else:
            assert _content(pack) == clean_content, f"verify passed a flipped bit in {where} that changes the pack"
        try:
            got = _payloads(pack)
        except PackdataError:
            continue
        assert got == expected, f"a flipped bit in {where} was read as other bytes"
