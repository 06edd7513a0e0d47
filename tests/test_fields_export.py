"""ls, cat and export of multi-field packs: round trips, escaped keys, keys that leave the folder, a full disk."""

from __future__ import annotations

import dataclasses
import filecmp
import json
import os
import re
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import flip_label, image_bytes
from faults.hostile import rewrite_manifest
from fields_helpers import KEYS, _fields_of, _grouped, _same_tree

import packdata
from packdata.cli import main as cli
from packdata.formats.contents import export_pack, list_samples, read_field
from packdata.pack.manifest import read_manifest


def test_ls_cat_export_round_trip(tmp_path: Path) -> None:
    src = _grouped(tmp_path / "src")
    (src / "lonely.jpg").unlink()
    pack = tmp_path / "out.lmdb"
    runner = CliRunner()
    done = runner.invoke(cli, ["convert", str(src), str(pack), "-q", "--layout", "grouped"])
    assert done.exit_code == 0, done.output
    listed = runner.invoke(cli, ["ls", str(pack), "--json", "--limit", "0"])
    rows = [json.loads(line) for line in listed.output.splitlines()]
    assert sorted(r["key"] for r in rows) == sorted([*KEYS, "dogs.v2/d"])
    assert rows[0]["fields"] == {n: len(d) for n, d in _fields_of(src, rows[0]["key"]).items()}
    shown = runner.invoke(cli, ["cat", str(pack), "café", "--field", "txt"])
    assert shown.exit_code == 0 and shown.stdout_bytes == (src / "café.txt").read_bytes()
    assert read_field(pack, "#0", "jpg") == (src / f"{rows[0]['key']}.jpg").read_bytes()
    missing = runner.invoke(cli, ["cat", str(pack), "nope"])
    assert missing.exit_code == 1 and "no sample has the key 'nope'" in missing.output
    for odd, said in [("#²", "no sample has the key '#²'"), ("#" + "9" * 5000, "index 999999999999999999... is out")]:
        refused = runner.invoke(cli, ["cat", str(pack), odd])  # a raw ValueError each (isdigit takes '²'; int() 4,300)
        assert refused.exit_code == 1 and said in refused.output, refused.output
    out = tmp_path / "exported"
    done = runner.invoke(cli, ["export", str(pack), str(out)])
    assert done.exit_code == 0, done.output
    comparison = filecmp.dircmp(src, out)
    assert _same_tree(comparison), comparison.report_full_closure()


def test_ls_and_convert_show_keys_with_newlines_and_control_characters_escaped(tmp_path: Path) -> None:
    """A key holding a newline prints as one line, quoted; an escape sequence never reaches the terminal raw."""
    odd = "cat\x1b[2J"
    keys = [f"{odd}/a\nb.jpg", f"{odd}/tab\there.jpg", "dog/plain café.jpg"]
    for k, key in enumerate(keys):
        (tmp_path / "src" / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / key).write_bytes(image_bytes(k))
    bad = f"{odd}/bad\nname.jpg"
    (tmp_path / "src" / bad).write_bytes(b"not an image")
    pack = tmp_path / "out.lmdb"
    runner = CliRunner()
    done = runner.invoke(cli, ["convert", str(tmp_path / "src"), str(pack), "--verify-images"])
    assert done.exit_code == 0, done.output
    assert f"    {bad!r}: corrupt image: " in done.output
    assert "\x1b" not in done.output
    listed = runner.invoke(cli, ["ls", str(pack)])
    assert listed.exit_code == 0 and "\x1b" not in listed.output, listed.output
    columns = [line.split("\t") for line in listed.output.splitlines()]
    assert [c[1] for c in columns] == [repr(keys[0]), repr(keys[1]), keys[2]]  # one line each; plain keys as they are
    assert [c[2] for c in columns] == [f"0 ({odd!r})", f"0 ({odd!r})", "1 (dog)"]
    rows = [json.loads(line) for line in runner.invoke(cli, ["ls", str(pack), "--json"]).output.splitlines()]
    assert [row["key"] for row in rows] == keys  # JSON: exact


def test_export_of_an_imagefolder_pack_gives_the_source_back(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for c in ("a", "b"):
        (src / c).mkdir(parents=True)
        for i in range(3):
            (src / c / f"{i}.jpg").write_bytes(image_bytes(i + ord(c)))
    packdata.convert(src, tmp_path / "p.lmdb", progress=False)
    result = export_pack(tmp_path / "p.lmdb", tmp_path / "back")
    assert result.samples == 6 and not result.refused
    assert _same_tree(filecmp.dircmp(src, tmp_path / "back"))
    assert [r["class"] for r in list_samples(tmp_path / "p.lmdb")] == ["a"] * 3 + ["b"] * 3


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_cat_and_export_give_what_a_dataset_reads_from_the_index_or_refuse(tmp_path: Path, fmt: str) -> None:
    """They read records alone: a label the index (which datasets read) no longer shares was exported and cat as it was.

    A pack written before the manifest held index digests: only reading the records against the index tells.
    """
    src = tmp_path / "src"
    for c in ("a", "b"):
        (src / c).mkdir(parents=True)
        for i in range(3):
            (src / c / f"{i}.jpg").write_bytes(image_bytes(i + ord(c)))
    pack = packdata.convert(src, tmp_path / "p", format=fmt, progress=False).pack
    rewrite_manifest(pack, lambda d: d["index"].pop("sha256"))
    flip_label(pack)  # sample 0 (a/0.jpg): label 1 in the index, 0 in its record
    assert next(iter(list_samples(pack)))["label"] == 1
    if fmt == "lmdb":
        assert packdata.LMDBDataset(pack, decode="bytes")[0][1] == 1  # what training sees
    out = CliRunner().invoke(cli, ["cat", str(pack), "#0", "--field", "cls"])
    assert out.exit_code == 1 and "record 0 (key 'a/0.jpg') does not match the sample index" in out.output
    out = CliRunner().invoke(cli, ["export", str(pack), str(tmp_path / "back")])
    assert out.exit_code == 1 and "record 0 (key 'a/0.jpg') does not match the sample index" in out.output
    assert not any((tmp_path / "back").rglob("*.jpg"))


def test_export_refuses_keys_that_leave_the_folder(tmp_path: Path) -> None:
    with packdata.PackWriter(tmp_path / "evil.lmdb") as writer:
        writer.write({"__key__": "../escape", "txt": "x"})
        writer.write({"__key__": "/abs/path", "txt": "y"})
        writer.write({"__key__": "fine/one", "txt": "z"})
        writer.write({"__key__": "fine/one.txt/x", "txt": "a folder where a file is"})
    result = export_pack(tmp_path / "evil.lmdb", tmp_path / "out")
    assert result.samples == 1
    assert [r["key"] for r in result.refused] == ["../escape", "/abs/path", "fine/one.txt/x"]
    assert not (tmp_path / "escape.txt").exists()
    assert (tmp_path / "out" / "fine" / "one.txt").read_text() == "z"


def test_export_of_a_multi_field_pack_refuses_a_key_whose_last_part_holds_a_dot(tmp_path: Path) -> None:
    """A key written with a dot in its last part ('a.b', by PackWriter before it refused them) was exported as
    a.b.txt and a.b.cls, which a grouped convert, a tar and WebDataset read back as key 'a' with fields 'b.txt' and
    'b.cls': another sample, without a word. Now such a key is refused and listed with what it would read back as;
    a dot in a folder of the key is fine."""
    with packdata.PackWriter(tmp_path / "dots.lmdb") as writer:
        for sample in (
            {"__key__": "a.b", "txt": "x", "cls": 3},
            {"__key__": "c", "txt": "y"},
            {"__key__": "v1.2/d.e", "txt": "z"},
            {"__key__": "v1.2/.f", "txt": "hidden"},
            {"__key__": "v1.2/g", "txt": "w"},
        ):  # as PackWriter wrote them before it checked keys: an older pack export still meets
            encoded = writer._encode({**sample, "__key__": "unchecked"})
            writer._append(dataclasses.replace(encoded, key=sample["__key__"]))
    result = export_pack(tmp_path / "dots.lmdb", tmp_path / "out")
    assert (result.samples, result.files) == (2, 2)
    assert result.refused == [
        {"key": "a.b", "reason": "the key's last part holds a dot: its files a.b.FIELD read back as key 'a'"},
        {
            "key": "v1.2/d.e",
            "reason": "the key's last part holds a dot: its files v1.2/d.e.FIELD read back as key 'v1.2/d'",
        },
        {
            "key": "v1.2/.f",
            "reason": "the key's last part starts with a dot: its files v1.2/.f.FIELD are hidden and "
            "read back as no sample",
        },
    ]
    assert sorted(path.relative_to(tmp_path / "out").as_posix() for path in (tmp_path / "out").rglob("*.txt")) == [
        "c.txt",
        "v1.2/g.txt",
    ]
    back = packdata.convert(tmp_path / "out", tmp_path / "back.lmdb", layout="grouped", progress=False).pack
    assert [sample["__key__"] for sample in packdata.LMDBDataset(back)] == ["c", "v1.2/g"]
    done = CliRunner().invoke(cli, ["export", str(tmp_path / "dots.lmdb"), str(tmp_path / "cli")])
    assert done.exit_code == 1 and "a.b: the key's last part holds a dot: its files a.b.FIELD read back as key 'a'" in (
        done.output
    )


def test_export_refuses_a_key_the_file_system_rejects_and_goes_on(tmp_path: Path) -> None:
    with packdata.PackWriter(tmp_path / "long.lmdb") as writer:
        writer.write({"__key__": "a", "txt": "first"})
        writer.write({"__key__": "x" * 300, "txt": "a name too long for the file system"})
        writer.write({"__key__": "d/" + "y" * 300, "txt": "its folder is made, then removed"})
        writer.write({"__key__": "z", "txt": "last"})
    result = export_pack(tmp_path / "long.lmdb", tmp_path / "out")
    assert (result.samples, result.files) == (2, 2)
    assert [r["key"] for r in result.refused] == ["x" * 300, "d/" + "y" * 300]
    assert all("the file system refuses its files (File name too long)" in r["reason"] for r in result.refused)
    assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == ["a.txt", "z.txt"]
    done = CliRunner().invoke(cli, ["export", str(tmp_path / "long.lmdb"), str(tmp_path / "cli")])
    assert done.exit_code == 1 and "exported 2 samples as 2 files" in done.output  # refusals exit 1, listed
    assert f"{'x' * 300}: the file system refuses its files (File name too long)" in done.output
    assert done.exception is None or isinstance(done.exception, SystemExit)


def test_export_of_a_key_of_many_folders_writes_it_without_running_out_of_stack(tmp_path: Path) -> None:
    """A key of 1,500 parts (3,000 bytes: a path Linux takes): Path.mkdir(parents=True) recursed once a folder."""
    deep = "d/" * 1500 + "leaf"
    with packdata.PackWriter(tmp_path / "deep.lmdb") as writer:
        writer.write({"__key__": deep, "txt": "deep"})
        writer.write({"__key__": "d/" * 1499 + "e", "txt": "beside it, in folders already made"})
        writer.write({"__key__": "z", "txt": "last"})
    try:
        result = export_pack(tmp_path / "deep.lmdb", tmp_path / "out")
        assert (result.samples, result.files, result.refused) == (3, 3, [])
        assert (tmp_path / "out" / f"{deep}.txt").read_text() == "deep"
        assert (tmp_path / "out" / ("d/" * 1499 + "e.txt")).read_text() == "beside it, in folders already made"
        assert (tmp_path / "out" / "z.txt").read_text() == "last"
    finally:  # shutil.rmtree (pytest's clean-up of old temporary folders) recurses once per level: a crash later
        subprocess.run(["rm", "-rf", str(tmp_path / "out")], check=True)


def test_export_onto_a_full_disk_stops_with_one_capacity_error(tmp_path: Path) -> None:
    """A real 1 MiB tmpfs: two samples of 400 KB fit, the third fills it. The error said 'OUT: the disk is full
    (No space left on device) after 2 samples were exported', naming no disk; it names it as every full disk is."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    with packdata.PackWriter(tmp_path / "p.lmdb") as writer:
        for key in ("a", "b", "c"):
            writer.write({"__key__": key, "txt": key * 400_000})
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=True)
    try:
        done = CliRunner().invoke(cli, ["export", str(tmp_path / "p.lmdb"), str(disk / "out")])
        assert done.exit_code == 1
        pattern = (
            rf"Error: {re.escape(str(disk / 'out' / 'c.txt'))}: no space left on {re.escape(str(disk))} \(tmpfs of "
            r"1\.0 MiB, [0-9.]+ KiB free\) while writing c\.txt of the export, after 2 samples were exported\. "
            r"Free space, delete the partial export and run it again\n"
        )
        assert re.fullmatch(pattern, done.output), done.output
        assert sorted(p.name for p in (disk / "out").iterdir()) == ["a.txt", "b.txt"]  # c's partly written file is gone
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.root
def test_export_whose_folder_a_full_disk_refuses_names_the_disk(tmp_path: Path, tmpfs) -> None:
    """A real tmpfs without an inode to spare: the export's folder said 'OUT: the destination disk is full (No
    space left on device). Free space and rerun', naming no disk; it is named as every full disk is."""
    with packdata.PackWriter(tmp_path / "p.lmdb") as writer:
        writer.write({"__key__": "a", "txt": "a"})
    disk = tmpfs("1m", options="nr_inodes=1")
    done = CliRunner().invoke(cli, ["export", str(tmp_path / "p.lmdb"), str(disk / "out")])
    pattern = (
        rf"Error: {re.escape(str(disk / 'out'))}: no space left on {re.escape(str(disk))} \(tmpfs of 1\.0 MiB, "
        r"1\.0 MiB free, no inodes free\) while writing out \(the export's folder\)\. Free space, then export again\n"
    )
    assert done.exit_code == 1 and re.fullmatch(pattern, done.output), done.output
    assert os.listdir(disk) == []


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_export_of_a_multi_field_pack_tarred_in_name_order_is_a_webdataset_shard_of_the_same_samples(
    tmp_path: Path, fmt: str
) -> None:
    """The KEY.FIELD files `packdata export` writes, put in a tar in name order, are a shard the webdataset package
    reads: the same keys (spaces, unicode, a class folder with a dot), each with the same fields and bytes as the
    pack's dataset reads (a field some samples lack included); a label its class folder gives stays the folder."""
    wds = pytest.importorskip("webdataset")
    src = _grouped(tmp_path / "src")
    pack = packdata.convert(src, tmp_path / "p", format=fmt, layout="grouped", progress=False).pack
    done = CliRunner().invoke(cli, ["export", str(pack), str(tmp_path / "out")])
    assert done.exit_code == 0, done.output
    files = [path for path in (tmp_path / "out").rglob("*") if path.is_file()]
    names = sorted(path.relative_to(tmp_path / "out").as_posix() for path in files)
    with tarfile.open(tmp_path / "shard.tar", "w") as tar:
        for name in names:
            tar.add(tmp_path / "out" / name, arcname=name)
    read = {sample.pop("__key__"): sample for sample in wds.WebDataset(str(tmp_path / "shard.tar"), shardshuffle=False)}
    ds = (
        packdata.LMDBDataset(pack, decode="bytes")
        if fmt == "lmdb"
        else packdata.TFRecordIndexedDataset(pack, decode="bytes")
    )
    classes = read_manifest(pack).classes
    assert sorted(read) == sorted([*KEYS, "lonely", "dogs.v2/d"])
    for sample in ds:
        key, label = sample.pop("__key__"), sample.pop("cls", -1)
        assert {name: read[key][name] for name in read[key] if not name.startswith("__")} == sample, key
        assert (classes[label] if label >= 0 else None) == (key.split("/")[0] if "/" in key else None)


def _samples(pack: Path) -> dict[str, dict]:
    """Every sample of ``pack`` as its dataset reads it, by key: its fields' stored bytes and its label (-1: none).

    A single-field pack's one field is named as a grouped convert names it: its key's extension, lower-cased.
    """
    out = {}
    for row, sample in zip(list_samples(pack), packdata.LMDBDataset(pack, decode="bytes"), strict=True):
        if isinstance(sample, tuple):  # (bytes, label)
            sample = {"__key__": row["key"], row["key"].rpartition("/")[2].partition(".")[2].lower(): sample[0]}
            sample["cls"] = row["label"]
        key = sample.pop("__key__")
        out[key] = {"cls": -1, **sample}
    return out


def _files(folder: Path) -> dict[str, bytes | None]:
    """Every file and folder under ``folder`` by its path there: a file's bytes, a folder's None."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else None for p in folder.rglob("*")}


def test_a_grouped_export_refuses_a_key_whose_first_folder_would_relabel_it_and_converts_back_exactly(
    tmp_path: Path,
) -> None:
    """A grouped convert reads an export's first-level folders as classes, numbered in name order: in a pack whose
    keys lie in class folders, a PackWriter sample 'x/y' without a label came back labelled 3 (folder x's number),
    'cats/3' with label 1 (cats being class 0) was skipped as a label conflict, and a class none of whose samples
    was exported ('dogs') shifted the numbers of the classes after it ('owls/2' came back labelled 1). Now every
    class folder is made before any sample, a sample whose first folder would read back as another label is
    refused, and export, convert, export gives the same files and each exported sample's fields and label byte
    for byte."""
    with packdata.PackWriter(tmp_path / "p.lmdb", classes=["cats", "dogs", "owls"]) as writer:
        writer.write({"__key__": "cats/1", "txt": "a cat", "cls": 0})
        writer.write({"__key__": "cats/3", "txt": "labelled as a dog", "cls": 1})
        writer.write({"__key__": "owls/2", "txt": "an owl", "npy": np.arange(3), "cls": 2})
        writer.write({"__key__": "plain", "txt": "no label"})
        writer.write({"__key__": "top", "json": {"a": 1}, "cls": 1})
        writer.write({"__key__": "x/y", "txt": "no label, in a folder"})
    result = export_pack(tmp_path / "p.lmdb", tmp_path / "out")
    why = "a grouped convert reads its first folder {!r} as its class (label {}: first-level folders are classes, "
    why += "numbered in name order), but it has {}"
    assert result.refused == [
        {"key": "cats/3", "reason": why.format("cats", 0, "label 1")},
        {"key": "x/y", "reason": why.format("x", 3, "no label")},
    ]
    assert (result.samples, result.files) == (4, 6)
    back = packdata.convert(tmp_path / "out", tmp_path / "back.lmdb", layout="grouped", progress=False)
    assert back.skipped == {}
    original = _samples(tmp_path / "p.lmdb")
    assert _samples(back.pack) == {key: original[key] for key in ("cats/1", "owls/2", "plain", "top")}
    export_pack(back.pack, tmp_path / "again")
    assert _files(tmp_path / "again") == _files(tmp_path / "out")
    done = CliRunner().invoke(cli, ["export", str(tmp_path / "p.lmdb"), str(tmp_path / "cli")])
    assert done.exit_code == 1 and f"x/y: {why.format('x', 3, 'no label')}" in done.output, done.output


def test_a_single_field_pack_exported_as_grouped_files_converts_back_to_its_samples_and_exports_the_same(
    tmp_path: Path,
) -> None:
    """A class-folder pack exported with layout='grouped' wrote cats/1.jpg.image: a grouped convert read it back as
    field 'jpg.image' (bytes, not an image), and 'dogs/3.JPG.image' exported again as 'dogs/3.jpg.image'. Now its
    files are named as a grouped convert reads them (cats/1.jpg: key cats/1, field jpg), and export, convert, export
    gives the same files, each sample's bytes and label."""
    src = tmp_path / "src"
    for rel, seed, fmt in [("cats/1.jpg", 1, "JPEG"), ("dogs/2.png", 2, "PNG"), ("dogs/3.JPG", 3, "JPEG")]:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(image_bytes(seed, fmt=fmt))
    (src / "top.jpg").write_bytes(image_bytes(4))  # a file at the top: no class
    pack = packdata.convert(src, tmp_path / "p.lmdb", progress=False).pack
    assert read_manifest(pack).kind == "image"
    result = export_pack(pack, tmp_path / "out", layout="grouped")
    assert (result.samples, result.files, result.refused) == (4, 4, [])
    back = packdata.convert(tmp_path / "out", tmp_path / "back.lmdb", layout="grouped", progress=False).pack
    original = {key.partition(".")[0]: sample for key, sample in _samples(pack).items()}
    assert _samples(back) == original
    assert sorted(original) == ["cats/1", "dogs/2", "dogs/3", "top"]
    export_pack(back, tmp_path / "again")
    assert _files(tmp_path / "again") == _files(tmp_path / "out")
    assert sorted(_files(tmp_path / "out")) == ["cats", "cats/1.jpg", "dogs", "dogs/2.png", "dogs/3.jpg", "top.jpg"]
