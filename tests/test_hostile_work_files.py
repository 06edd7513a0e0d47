"""Work files a stranger can edit (a resume's progress.json, an overwrite's replaced.jsonl): nothing outside the
source is looked at, nothing outside the pack's prefix is deleted."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import interrupted_convert, moto_s3

from packdata import LMDBDataset, PackFormatError, convert
from packdata.conversion.destination import partial_path
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


@pytest.mark.parametrize("probe", ["outside", "dotdot", "link", "fifo", "unpacked"])
def test_a_resume_stats_only_files_the_interrupted_conversion_packed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, probe: str
) -> None:
    """progress.json's probes (files a resume stats to find a source rewritten since) edited to name a file outside
    the source (an absolute path, or one through ``..``), a link in the source to a file outside, a FIFO, or a
    source file not packed yet: the resume stat'ed any of them (a FIFO's open would hang; the message told the size
    of a file outside). It now refuses the checkpoint as damaged, naming it and the probe, before any stat: the
    partial is kept, nothing is published, and --overwrite packs the source."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"{i}.txt").write_text(f"t{i}", encoding="utf-8")
    secret = tmp_path / "secret.txt"
    secret.write_text("not the source's", encoding="utf-8")
    dst = tmp_path / "out.lmdb"
    interrupted_convert(src, dst, monkeypatch, after=5)
    progress = partial_path(dst) / "progress.json"
    state = json.loads(progress.read_bytes())
    if probe == "outside":
        named = str(secret)
    elif probe == "dotdot":
        named = f"{src}/../secret.txt"
    elif probe == "link":
        named = str(src / "9.txt")  # walked after the packed part
        os.symlink(secret, named)
    elif probe == "fifo":
        named = str(tmp_path / "fifo")
        os.mkfifo(named)
    else:
        named = str(src / "7.txt")
    state["probes"].append([named, 1, 0])
    progress.write_text(json.dumps(state), encoding="utf-8")
    checkpoint = progress.read_bytes()
    message = (
        f"{progress}: the interrupted conversion's checkpoint is damaged: probes names {named!r}, which is not a file "
        "the interrupted conversion packed (a resume looks only at those). Start the conversion again with --overwrite"
    )
    with pytest.raises(PackFormatError) as raised:
        convert(src, dst, progress=False, resume=True)
    assert str(raised.value) == message
    assert progress.read_bytes() == checkpoint and not dst.exists()
    assert secret.read_text(encoding="utf-8") == "not the source's"
    convert(src, dst, progress=False, overwrite=True)
    assert len(LMDBDataset(dst)) == (9 if probe == "link" else 8)
