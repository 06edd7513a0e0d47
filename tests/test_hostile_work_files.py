"""Work files a stranger can edit (a resume's progress.json, an overwrite's replaced.jsonl): nothing outside the
source is looked at, nothing outside the pack's prefix is deleted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import moto_s3

from packdata.conversion.replace import remove_replaced
from packdata.pack.urls import object_version


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on loopback; yields (storage_options, filesystem)."""
    with moto_s3({"key": "testing-key-id", "secret": "testing-secret"}) as server:
        yield server


@pytest.mark.parametrize(
    "name", ["../train2/{}", "/../train2/{}", "x/../../train2/{}", "//train2/{}", "a//../train2/{}"]
)
def test_an_edited_replaced_record_never_deletes_a_neighbouring_packs_objects(
    s3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """replaced.jsonl (beside an overwrite's work folder) names the old pack's objects to remove once the new pack
    is up. Edited to name a neighbouring pack's objects, through ``..``, ``//`` or ``x/../..``, with their true
    size and version: only the pack's own recorded object goes (the store is asked to remove nothing else), the
    neighbour's stay."""
    _, fs = s3
    for pack in ("train", "train2"):
        for obj in ("shard-00000.bin", "sub/part.bin"):
            fs.pipe_file(f"packs/{pack}/{obj}", f"{pack} {obj}".encode())
    fs.invalidate_cache()
    found = {p: (int(i["size"]), object_version(i)) for p, i in fs.find("packs", detail=True).items()}
    lines = []
    for obj in ("shard-00000.bin", "sub/part.bin"):
        size, version = found[f"packs/train2/{obj}"]
        lines.append({"name": name.format(obj), "size": size, "version": version})
    size, version = found["packs/train/shard-00000.bin"]
    lines.append({"name": "shard-00000.bin", "size": size, "version": version})  # the pack's own: removed
    work = tmp_path / "work" / "train"
    work.parent.mkdir()
    (work.parent / "replaced.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    real_rm, asked = fs.rm_file, []

    def recording_rm(path, *args, **kwargs):  # S3 keys are literal: asked for, ../ would name another object
        asked.append(path)
        return real_rm(path, *args, **kwargs)

    monkeypatch.setattr(fs, "rm_file", recording_rm)
    removed = remove_replaced(fs, "packs/train", "s3://packs/train", work, keep=set())
    fs.invalidate_cache()
    assert sorted(fs.find("packs")) == [
        "packs/train/sub/part.bin",
        "packs/train2/shard-00000.bin",
        "packs/train2/sub/part.bin",
    ]
    assert (removed, asked) == (1, ["packs/train/shard-00000.bin"])
    monkeypatch.undo()
    for obj in ("shard-00000.bin", "sub/part.bin"):
        fs.rm_file(f"packs/train2/{obj}")
    fs.rm_file("packs/train/sub/part.bin")
    assert not (work.parent / "replaced.jsonl").exists()
