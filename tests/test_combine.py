"""Growing and combining packs: convert --append and merge, on real packs and a real concurrent reader (killed and
interrupted ones: test_combine_interrupted.py)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import assert_index_digests, flip_label, tree_digest
from conftest import classes_folder as _folder
from conftest import pack_samples as _samples
from conftest import pack_tree as _tree
from faults.hostile import rewrite_manifest

import packdata
from packdata.cli import main as cli
from packdata.errors import ConfigError, PackFormatError
from packdata.formats.lmdb_env import DATA_FILE
from packdata.pack.manifest import read_manifest


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_merge_unites_classes_by_name_and_keeps_every_sample(tmp_path: Path, fmt: str) -> None:
    a = _folder(tmp_path / "a", {"cat": ["1.jpg", "2.jpg"], "dog": ["3.jpg"]})
    b = _folder(tmp_path / "b", {"ant": ["4.jpg"], "dog": ["5.jpg", "6.jpg"]})
    packdata.convert(a, tmp_path / f"a.{fmt}", progress=False)
    packdata.convert(b, tmp_path / f"b.{fmt}", progress=False, shard_samples=2)
    result = packdata.merge_packs([tmp_path / f"a.{fmt}", tmp_path / f"b.{fmt}"], tmp_path / f"ab.{fmt}")
    assert (result.samples, result.shards) == (6, 3)
    # b's ant (0 -> 2) is renumbered: its shard is written anew; b's shard of dogs only (1 -> 1) is linked
    assert (result.rewritten, result.linked) == (1, 2)
    merged = packdata.LMDBDataset if fmt == "lmdb" else packdata.TFRecordIndexedDataset
    ds = merged(tmp_path / f"ab.{fmt}", decode="bytes")
    assert ds.classes == ["cat", "dog", "ant"]
    assert _samples(tmp_path / f"ab.{fmt}") == _samples(tmp_path / f"a.{fmt}") + _samples(tmp_path / f"b.{fmt}")
    assert packdata.verify_pack(tmp_path / f"ab.{fmt}", progress=False).records == 6


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_merge_and_append_record_their_index_digests_and_refuse_a_damaged_index(tmp_path: Path, fmt: str) -> None:
    """The manifest of a merge and of an append holds the SHA-256 of the index each wrote.

    A pack whose ``labels.i32`` lost a bit is never merged or appended to: its
    labels would be renumbered into a new index with digests of their own,
    and the damage could no longer be seen. Nothing is written then.
    """
    a = _folder(tmp_path / "a", {"cat": ["1.jpg", "2.jpg"], "dog": ["3.jpg"]})
    b = _folder(tmp_path / "b", {"ant": ["4.jpg"], "dog": ["5.jpg"]})
    c = _folder(tmp_path / "c", {"cat": ["6.jpg"], "eel": ["7.jpg"]})
    for folder in (a, b):
        packdata.convert(folder, tmp_path / f"{folder.name}.{fmt}", progress=False)
    merged = tmp_path / f"ab.{fmt}"
    packdata.merge_packs([tmp_path / f"a.{fmt}", tmp_path / f"b.{fmt}"], merged)
    assert_index_digests(merged)
    packdata.convert(c, merged, append=True, progress=False)
    assert read_manifest(merged).index_dir == "index-a1"
    assert_index_digests(merged)

    labels = flip_label(tmp_path / f"a.{fmt}")
    with pytest.raises(PackFormatError, match=re.escape(f"{labels}: sample index file labels.i32 does not match")):
        packdata.merge_packs([tmp_path / f"a.{fmt}", tmp_path / f"b.{fmt}"], tmp_path / f"x.{fmt}")
    assert not (tmp_path / f"x.{fmt}").exists() and not (tmp_path / f".x.{fmt}.partial").exists()
    labels = flip_label(merged)
    tree = _tree(merged)
    with pytest.raises(PackFormatError, match=re.escape(f"{labels}: sample index file labels.i32 does not match")):
        packdata.convert(_folder(tmp_path / "d", {"cat": ["8.jpg"]}), merged, append=True, progress=False)
    assert _tree(merged) == tree


def _set_labels(pack: Path, change: dict[int, int]) -> None:
    """Write labels into ``pack``'s ``labels.i32`` and recompute its digest, as a hostile author would."""
    from packdata.pack.index import index_digests

    path = pack / read_manifest(pack).index_dir / "labels.i32"
    labels = np.fromfile(path, dtype="<i4")
    for i, label in change.items():
        labels[i] = label
    labels.tofile(path)
    rewrite_manifest(pack, lambda d: d["index"].update(sha256=index_digests(path.parent, d["kind"])))


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
@pytest.mark.parametrize("lie", ["fewer classes", "label -3", "record disagrees"])
def test_merge_and_append_refuse_labels_that_lie(tmp_path: Path, fmt: str, lie: str) -> None:
    """Labels outside the classes once crashed a merge (IndexError) or, below -1, wrapped around to another class.

    A record whose label disagrees with the index is named when its shard is
    rewritten, never renumbered from an unchecked value. Nothing is written.
    """
    a = _folder(tmp_path / "a", {"cat": ["1.jpg"], "dog": ["2.jpg", "3.jpg"]})
    b = _folder(tmp_path / "b", {"ant": ["4.jpg"], "dog": ["5.jpg"]})
    pack, other = tmp_path / f"a.{fmt}", tmp_path / f"b.{fmt}"
    packdata.convert(a, pack, format=fmt, progress=False)
    packdata.convert(b, other, format=fmt, progress=False)
    if lie == "fewer classes":
        rewrite_manifest(pack, lambda d: d.update(classes=["cat"]))
        problem = r"sample 1 has label 1, outside \[-1, 1\)"
    elif lie == "label -3":
        _set_labels(pack, {1: -3})
        problem = r"sample 1 has label -3, outside \[-1, 2\)"
    else:
        _set_labels(pack, {1: 0})  # the record says dog (1)
        problem = r"record 1 holds label 1, the sample index says 0"
    tree = _tree(pack)
    with pytest.raises(PackFormatError, match=problem):
        packdata.merge_packs([other, pack], tmp_path / f"m.{fmt}")  # a's labels move: its shard is rewritten
    assert not (tmp_path / f"m.{fmt}").exists() and not (tmp_path / f".m.{fmt}.partial").exists()
    if lie != "record disagrees":  # an append rewrites the new samples' shards only, never the pack's
        with pytest.raises(PackFormatError, match=problem):
            packdata.convert(_folder(tmp_path / "c", {"eel": ["6.jpg"]}), pack, append=True, progress=False)
    assert _tree(pack) == tree


def _data_file(pack: Path, number: int) -> Path:
    """The data file of shard ``number`` of ``pack``."""
    manifest = read_manifest(pack)
    shard = pack / manifest.shards[number].file
    return shard / DATA_FILE if manifest.format == "lmdb" else shard


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
@pytest.mark.parametrize(
    ("placed", "damage"), [("linked", "extended"), ("rewritten", "extended"), ("rewritten", "replaced")]
)
def test_merge_refuses_a_shard_that_differs_from_its_manifest(
    tmp_path: Path, fmt: str, placed: str, damage: str
) -> None:
    """A shard whose size or SHA-256 is not its manifest's was merged: verify failed on the result, or,
    where the shard was rewritten (labels renumbered), the result got a checksum of its own and verified
    ``ok`` with bytes the pack's manifest never vouched for. Now the shard is named and nothing is written.
    """
    a = _folder(tmp_path / "a", {"cat": ["1.jpg"], "dog": ["2.jpg", "3.jpg"]})
    b = _folder(tmp_path / "b", {"ant": ["4.jpg"], "dog": ["5.jpg"]})
    for folder in (a, b):
        packdata.convert(folder, tmp_path / f"{folder.name}.{fmt}", format=fmt, progress=False)
    victim = tmp_path / ("a" if placed == "linked" else "b")  # a's shard is linked, b's rewritten (ant: 0 -> 2)
    shard = _data_file(victim.with_suffix(f".{fmt}"), 0)
    if damage == "extended":
        with open(shard, "ab") as f:
            f.write(b"\0" * 10)
        problem = "shard is .* bytes, the manifest says"
    else:  # the shard of another conversion: same keys, labels and sizes, other bytes
        data = bytearray((victim / "dog" / "5.jpg").read_bytes())
        data[-3] ^= 1  # inside the JPEG's entropy data: same size
        (victim / "dog" / "5.jpg").write_bytes(bytes(data))
        other = tmp_path / f"other.{fmt}"
        packdata.convert(victim, other, format=fmt, progress=False)
        shutil.copyfile(_data_file(other, 0), shard)
        problem = "shard checksum does not match the manifest"
    tree = tree_digest(victim.with_suffix(f".{fmt}"))
    with pytest.raises(PackFormatError, match=problem) as caught:
        packdata.merge_packs([tmp_path / f"a.{fmt}", tmp_path / f"b.{fmt}"], tmp_path / f"ab.{fmt}")
    assert Path(caught.value.path) == shard
    assert not (tmp_path / f"ab.{fmt}").exists() and not (tmp_path / f".ab.{fmt}.partial").exists()
    assert tree_digest(victim.with_suffix(f".{fmt}")) == tree


@pytest.mark.parametrize(("fmt", "planted"), [("tfrecord", "symlink"), ("tfrecord", "FIFO"), ("lmdb", "FIFO")])
def test_merge_takes_only_a_packs_own_regular_side_tables(tmp_path: Path, fmt: str, planted: str) -> None:
    """A side table that was a link or a FIFO was hard-linked into the merged pack; across file systems
    a copy read the link's target outside the pack (a device: without end) or failed with a raw error.

    Nothing is written then, and the file outside is left as it was.
    """
    a = _folder(tmp_path / "a", {"cat": ["1.jpg"]})
    b = _folder(tmp_path / "b", {"cat": ["2.jpg"]})
    pack, other = tmp_path / f"a.{fmt}", tmp_path / f"b.{fmt}"
    packdata.convert(a, pack, format=fmt, progress=False)
    packdata.convert(b, other, format=fmt, progress=False)
    shard = other / read_manifest(other).shards[0].file
    side = shard / "records.i64" if fmt == "lmdb" else shard.with_suffix(".tfindex")
    outside = tmp_path / "outside"
    outside.write_bytes(side.read_bytes())
    side.unlink()
    if planted == "FIFO":
        os.mkfifo(side)
    else:
        side.symlink_to(outside)
    with pytest.raises(PackFormatError, match=re.escape(f"{side}: shard file is a {planted}, not a regular file")):
        packdata.merge_packs([pack, other], tmp_path / f"m.{fmt}")
    assert not (tmp_path / f"m.{fmt}").exists() and not (tmp_path / f".m.{fmt}.partial").exists()


@pytest.mark.parametrize("planted", ["symlink", "FIFO"])
def test_merge_reads_only_a_packs_own_regular_skip_report(tmp_path: Path, planted: str) -> None:
    """The skip report was opened by path once is_file() said so: a link to another file of the pack (one
    leading out is refused as the manifest's) was read into the merged report as skips, and a FIFO was passed
    over without a word. Either is refused, naming it."""
    pack, other = tmp_path / "a.lmdb", tmp_path / "b.lmdb"
    packdata.convert(_folder(tmp_path / "a", {"cat": ["1.jpg"]}), pack, progress=False)
    packdata.convert(_folder(tmp_path / "b", {"cat": ["2.jpg"]}), other, progress=False)
    report = other / read_manifest(other).skipped["report"]
    report.unlink()
    if planted == "FIFO":
        os.mkfifo(report)
    else:
        report.symlink_to(other / "index" / "keys.utf8")
    with pytest.raises(PackFormatError, match=re.escape(str(report))):
        packdata.merge_packs([pack, other], tmp_path / "m.lmdb")
    assert not (tmp_path / "m.lmdb").exists()


def test_merge_links_shards_refuses_or_renames_duplicate_keys(tmp_path: Path) -> None:
    a = _folder(tmp_path / "a", {"cat": ["1.jpg", "2.jpg"]})
    packdata.convert(a, tmp_path / "a.lmdb", progress=False)
    packdata.convert(a, tmp_path / "a2.lmdb", progress=False)
    with pytest.raises(ConfigError, match=r"key 'cat/1\.jpg' .* already in an earlier pack"):
        packdata.merge_packs([tmp_path / "a.lmdb", tmp_path / "a2.lmdb"], tmp_path / "x.lmdb")
    assert not (tmp_path / "x.lmdb").exists() and not (tmp_path / ".x.lmdb.partial").exists()
    said = CliRunner().invoke(
        cli, ["merge", str(tmp_path / "a.lmdb"), str(tmp_path / "a2.lmdb"), "-o", str(tmp_path / "x.lmdb")]
    )
    assert said.exit_code == 1
    assert said.output.endswith(". Pass --on-duplicate rename to keep both as KEY~N\n"), said.output  # said once
    result = packdata.merge_packs(
        [tmp_path / "a.lmdb", tmp_path / "a2.lmdb"], tmp_path / "x.lmdb", on_duplicate="rename"
    )
    assert (result.linked, result.rewritten, result.renamed_keys) == (1, 1, 2)
    data = tmp_path / "x.lmdb" / "shard-00000.lmdb" / DATA_FILE
    assert os.stat(data).st_ino == os.stat(tmp_path / "a.lmdb" / "shard-00000.lmdb" / DATA_FILE).st_ino
    assert list(packdata.LMDBDataset(tmp_path / "x.lmdb").keys) == [
        "cat/1.jpg",
        "cat/2.jpg",
        "cat/1.jpg~1",
        "cat/2.jpg~1",
    ]
    assert packdata.verify_pack(tmp_path / "x.lmdb", progress=False).records == 4


def test_merge_and_export_never_write_inside_a_pack_they_read(tmp_path: Path) -> None:
    """merge -o A/x.lmdb and export A A/files wrote a pack, or files, into A's own folder."""
    a = _folder(tmp_path / "a", {"cat": ["1.jpg"], "dog": ["2.jpg"]})
    b = _folder(tmp_path / "b", {"cat": ["3.jpg"]})
    packdata.convert(a, tmp_path / "a.lmdb", progress=False)
    packdata.convert(b, tmp_path / "b.lmdb", progress=False)
    before = {p: tree_digest(tmp_path / p) for p in ("a.lmdb", "b.lmdb")}
    for pack, inner in (("a.lmdb", "a.lmdb/x.lmdb"), ("b.lmdb", "b.lmdb/index/x")):
        out = tmp_path / inner
        result = CliRunner().invoke(cli, ["merge", str(tmp_path / "a.lmdb"), str(tmp_path / "b.lmdb"), "-o", str(out)])
        assert result.exit_code == 1
        expected = (
            f"Error: {out}: the merged pack would be inside the pack {tmp_path / pack}. Choose an output outside it"
        )
        assert result.output == expected + "\n"
    result = CliRunner().invoke(cli, ["export", str(tmp_path / "a.lmdb"), str(tmp_path / "a.lmdb" / "files")])
    assert result.exit_code == 1
    assert result.output == (
        f"Error: {tmp_path / 'a.lmdb' / 'files'}: export destination is inside the pack being exported. "
        "Choose a folder outside it\n"
    )
    assert {p: tree_digest(tmp_path / p) for p in ("a.lmdb", "b.lmdb")} == before
    assert sorted(os.listdir(tmp_path / "a.lmdb")) == sorted(os.listdir(tmp_path / "b.lmdb"))  # nothing added


def test_merge_and_append_refuse_an_input_that_is_their_output_its_work_folder_or_inside_it(tmp_path: Path) -> None:
    """merge a.lmdb .ab.lmdb.partial -o ab.lmdb read the input's manifest, then deleted it as its own work folder."""
    packdata.convert(_folder(tmp_path / "a", {"cat": ["1.jpg"]}), tmp_path / "a.lmdb", progress=False)
    b = _folder(tmp_path / "b", {"dog": ["2.jpg"]})
    work = tmp_path / ".ab.lmdb.partial"
    packdata.convert(b, work, progress=False)
    packdata.convert(b, tmp_path / "c.lmdb", progress=False)
    os.rename(tmp_path / "c.lmdb", work / "inner.lmdb")
    before = tree_digest(tmp_path)
    a, out = tmp_path / "a.lmdb", tmp_path / "ab.lmdb"
    cases = [
        ([str(a), str(work), "-o", str(out)], f"the input {work} is its work folder {work}"),
        ([str(a), str(work / "inner.lmdb"), "-o", str(out)], f"the input {work / 'inner.lmdb'} lies inside its work"),
        ([str(work / "inner.lmdb"), str(a), "-o", str(a), "--overwrite"], f"the input {a} is the destination {a}"),
    ]
    for args, expected in cases:
        result = CliRunner().invoke(cli, ["merge", *args])
        assert result.exit_code == 1 and expected in result.output, result.output
        assert result.output.endswith("Choose a destination apart from the inputs\n")
        assert tree_digest(tmp_path) == before
    # an append converts beside the pack into .a.lmdb.append (via ..a.lmdb.append.partial), deleting what a run left
    shutil.copytree(b, tmp_path / ".a.lmdb.append")
    shutil.copytree(b, tmp_path / "..a.lmdb.append.partial")
    before = tree_digest(tmp_path)
    for src, expected in (
        (tmp_path / ".a.lmdb.append", "is the destination"),
        (tmp_path / "..a.lmdb.append.partial", "is its work folder"),
        (tmp_path / ".a.lmdb.append" / "dog", "lies inside the destination"),
    ):
        result = CliRunner().invoke(cli, ["convert", str(src), str(a), "--append", "-q"])
        assert result.exit_code == 1 and expected in result.output, result.output
        assert tree_digest(tmp_path) == before
    shutil.copytree(b, tmp_path / ".c.lmdb.partial")  # and a plain convert deletes its own work folder first
    result = CliRunner().invoke(
        cli, ["convert", str(tmp_path / ".c.lmdb.partial"), str(tmp_path / "c.lmdb"), "--overwrite", "-q"]
    )
    assert result.exit_code == 1 and "is its work folder" in result.output, result.output
    assert (tmp_path / ".c.lmdb.partial" / "dog").is_dir()


def test_merge_adds_up_skips_counted_without_reasons(tmp_path: Path) -> None:
    """A pack whose manifest holds skipped.count alone merged into one that verify said had lost samples."""
    for name in ("a", "b"):
        folder = _folder(tmp_path / name, {"cat": [f"{name}.jpg"]})
        (folder / "cat" / f"{name}-bad.jpg").write_bytes(b"not an image")
        packdata.convert(folder, tmp_path / f"{name}.lmdb", progress=False)
    rewrite_manifest(tmp_path / "b.lmdb", lambda data: data["skipped"].pop("by_reason"))
    assert packdata.verify_pack(tmp_path / "b.lmdb", progress=False).records == 1
    packdata.merge_packs([tmp_path / "a.lmdb", tmp_path / "b.lmdb"], tmp_path / "ab.lmdb")
    assert packdata.verify_pack(tmp_path / "ab.lmdb", progress=False).records == 2
    assert read_manifest(tmp_path / "ab.lmdb").skipped == {"count": 2, "report": "skipped.jsonl"}
    info = CliRunner().invoke(cli, ["info", str(tmp_path / "ab.lmdb")])
    assert "skipped:  2 at conversion (reasons not recorded; listed in skipped.jsonl)" in info.output
    packdata.merge_packs([tmp_path / "a.lmdb", tmp_path / "a.lmdb"], tmp_path / "aa.lmdb", on_duplicate="rename")
    assert read_manifest(tmp_path / "aa.lmdb").skipped["by_reason"] == {"corrupt image": 2}


def test_merge_keeps_the_record_of_reencoded_images(tmp_path: Path) -> None:
    """The merged manifest dropped reencode: info on a merge of re-encoded packs no longer said they were."""
    for name, max_side in (("a", 32), ("b", 32), ("c", None)):
        folder = _folder(tmp_path / name, {"cat": [f"{name}1.jpg", f"{name}2.jpg"]})
        packdata.convert(folder, tmp_path / f"{name}.lmdb", max_side=max_side, quality=80, progress=False)
    packs = [tmp_path / f"{name}.lmdb" for name in "abc"]
    packdata.merge_packs(packs[:2], tmp_path / "ab.lmdb")
    assert read_manifest(tmp_path / "ab.lmdb").reencode == {"max_side": 32, "quality": 80, "count": 4}
    info = CliRunner().invoke(cli, ["info", str(tmp_path / "ab.lmdb")])
    assert "reencode: 4 images re-encoded as JPEG to at most 32 px (quality 80)" in info.output
    packdata.merge_packs(packs, tmp_path / "abc.lmdb")  # c kept its bytes: the settings are not the whole pack's
    assert read_manifest(tmp_path / "abc.lmdb").reencode == {"count": 4}
    info = CliRunner().invoke(cli, ["info", str(tmp_path / "abc.lmdb")])
    assert "reencode: 4 images re-encoded as JPEG (packs merged with different settings, or none" in info.output
    packdata.merge_packs([packs[2], packs[2]], tmp_path / "cc.lmdb", on_duplicate="rename")
    assert read_manifest(tmp_path / "cc.lmdb").reencode is None


def test_convert_over_a_killed_merges_work_folder_does_not_call_it_a_conversion(tmp_path: Path) -> None:
    """convert into the output of a merge killed before its publish said 'an interrupted conversion ... Pass
    --resume to continue it': nothing of a merge can be continued."""
    for name in ("a", "b"):
        packdata.convert(_folder(tmp_path / name, {"cat": [f"{name}.jpg"]}), tmp_path / f"{name}.lmdb", progress=False)
    killed = textwrap.dedent(
        """
        import os, signal, sys
        import packdata
        from packdata.conversion import combine
        combine._publish = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)  # killed at its last step
        packdata.merge_packs(sys.argv[1:3], sys.argv[3])
        """
    )
    out = tmp_path / "ab.lmdb"
    args = [sys.executable, "-c", killed, str(tmp_path / "a.lmdb"), str(tmp_path / "b.lmdb"), str(out)]
    done = subprocess.run(args, cwd=Path(__file__).parent.parent, check=False)
    assert done.returncode == -signal.SIGKILL and (tmp_path / ".ab.lmdb.partial" / "manifest.json").is_file()
    result = CliRunner().invoke(cli, ["convert", str(tmp_path / "a"), str(out), "-q"])
    assert result.exit_code == 1
    assert result.output == (
        f"Error: {out}: an interrupted merge or conversion into {out} left {tmp_path / '.ab.lmdb.partial'}, "
        "with no checkpoint to continue from. Pass --overwrite to start again\n"
    )
    assert CliRunner().invoke(cli, ["convert", str(tmp_path / "a"), str(out), "-q", "--overwrite"]).exit_code == 0


def test_merge_makes_the_missing_folders_of_its_output(tmp_path: Path) -> None:
    """As convert does: merge failed on its lock file ('No such file or directory') before making them."""
    packdata.convert(_folder(tmp_path / "a", {"cat": ["1.jpg"]}), tmp_path / "a.lmdb", progress=False)
    packdata.convert(_folder(tmp_path / "b", {"dog": ["2.jpg"]}), tmp_path / "b.lmdb", progress=False)
    out = tmp_path / "new" / "folders" / "ab.lmdb"
    result = CliRunner().invoke(cli, ["merge", str(tmp_path / "a.lmdb"), str(tmp_path / "b.lmdb"), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(out.parent)) == ["ab.lmdb"]
    assert packdata.verify_pack(out, progress=False).records == 2


def test_merge_refuses_a_tfrecord_shard_without_its_offsets_index(tmp_path: Path) -> None:
    """It was linked 'when present', then the writer's rename of the missing index raised FileNotFoundError."""
    for name in ("a", "b"):
        packdata.convert(
            _folder(tmp_path / name, {name: ["1.jpg"]}), tmp_path / f"{name}.tf", format="tfrecord", progress=False
        )
    index = next((tmp_path / "a.tf").glob("*.tfindex"))
    index.unlink()
    result = CliRunner().invoke(
        cli, ["merge", str(tmp_path / "a.tf"), str(tmp_path / "b.tf"), "-o", str(tmp_path / "ab")]
    )
    assert result.exit_code == 1
    assert result.output == f"Error: {index}: shard file is missing. The pack is damaged: convert it again\n"
    assert sorted(os.listdir(tmp_path)) == ["a", "a.tf", "b", "b.tf"]


def test_merge_of_multi_field_packs_remaps_fields(tmp_path: Path) -> None:
    with packdata.PackWriter(tmp_path / "a.lmdb") as w:
        w.write({"__key__": "a1", "txt": "hello", "json": {"n": 1}})
    with packdata.PackWriter(tmp_path / "b.lmdb") as w:
        w.write({"__key__": "b1", "json": {"n": 2}, "npy": b"\x93NUMPY-not-checked-here"})
        w.write({"__key__": "b2", "txt": "bye", "cls": 1})
    packdata.merge_packs([tmp_path / "a.lmdb", tmp_path / "b.lmdb"], tmp_path / "ab.lmdb")
    ds = packdata.LMDBDataset(tmp_path / "ab.lmdb", decode="bytes")
    assert ds.pack.manifest.fields == ["json", "txt", "npy"]
    assert [ds.pack.index.sample_fields(i) for i in range(3)] == [
        {"json": 8, "txt": 5},
        {"json": 8, "npy": 23},
        {"txt": 3},
    ]
    assert ds[2] == {"__key__": "b2", "txt": b"bye", "cls": 1}
    assert packdata.verify_pack(tmp_path / "ab.lmdb", progress=False).records == 3


def test_merge_refuses_mixed_formats(tmp_path: Path) -> None:
    a = _folder(tmp_path / "a", {"cat": ["1.jpg"]})
    packdata.convert(a, tmp_path / "a.lmdb", progress=False)
    packdata.convert(a, tmp_path / "a.tfrecord", progress=False)
    with pytest.raises(ConfigError, match="Merge packs of one format: convert this one's source again with format="):
        packdata.merge_packs([tmp_path / "a.lmdb", tmp_path / "a.tfrecord"], tmp_path / "x.lmdb")


def test_a_merge_of_packs_of_another_format_or_kind_says_which_differs_and_what_to_do(tmp_path: Path) -> None:
    """Packs of one format and two kinds were told 'is a lmdb pack of fields samples, the first is lmdb/image ...
    (convert one again with format=FORMAT, `packdata convert --format FORMAT`)': a format was no fix."""
    a = _folder(tmp_path / "a", {"cat": ["1.jpg"]})
    grouped = tmp_path / "grouped"
    grouped.mkdir()
    (grouped / "s0.jpg").write_bytes((a / "cat" / "1.jpg").read_bytes())
    (grouped / "s0.txt").write_text("a cat\n")
    images, fields, records = tmp_path / "a.lmdb", tmp_path / "fields.lmdb", tmp_path / "a.tfrecord"
    packdata.convert(a, images, progress=False)
    packdata.convert(grouped, fields, layout="grouped", progress=False)
    packdata.convert(a, records, format="tfrecord", progress=False)
    runner = CliRunner()
    kinds = runner.invoke(cli, ["merge", str(images), str(fields), "-o", str(tmp_path / "x.lmdb")])
    assert (kinds.exit_code, kinds.stdout) == (1, "")
    assert kinds.stderr == (
        f"Error: {fields}: holds multi-field samples, but the first pack ({images}) holds image samples. "
        "Merge packs of one kind: images with images, texts with texts, multi-field samples (a grouped convert's) "
        "with multi-field samples\n"
    )
    formats = runner.invoke(cli, ["merge", str(images), str(records), "-o", str(tmp_path / "x.lmdb")])
    assert (formats.exit_code, formats.stdout) == (1, "")
    assert formats.stderr == (
        f"Error: {records}: is a tfrecord pack, but the first pack ({images}) is lmdb. Merge packs of one format: "
        f"convert this one's source again with format='lmdb' (`packdata convert SRC DST --format lmdb`)\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "a.lmdb", "a.tfrecord", "fields.lmdb", "grouped"]


_READER = """
import sys, time
import packdata
ds = packdata.LMDBDataset(sys.argv[1], decode="bytes")
first = ds[0][0]  # opened and reading before the append
print("ready", flush=True)
sys.stdin.readline()  # the append happens now
print(len(ds), sorted(ds.keys[i] for i in range(len(ds))), all(ds[i][0] for i in range(len(ds))), flush=True)
"""


def test_append_keeps_old_shards_and_a_reader_opened_before(tmp_path: Path) -> None:
    a = _folder(tmp_path / "a", {"cat": ["1.jpg", "2.jpg"], "dog": ["3.jpg"]})
    b = _folder(tmp_path / "b", {"ant": ["4.jpg"], "dog": ["5.jpg"]})
    pack = tmp_path / "p.lmdb"
    packdata.convert(a, pack, progress=False)
    before = _samples(pack)
    old_shard = pack / "shard-00000.lmdb" / DATA_FILE
    stat = os.stat(old_shard)
    reader = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_READER), str(pack)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    assert reader.stdout is not None and reader.stdin is not None
    assert reader.stdout.readline().strip() == "ready"
    in_process = packdata.LMDBDataset(pack, decode="bytes")
    result = packdata.convert(b, pack, append=True, progress=False)
    reader.stdin.write("go\n")
    reader.stdin.flush()
    out, _ = reader.communicate(timeout=60)
    assert reader.returncode == 0
    assert out.strip() == "3 ['cat/1.jpg', 'cat/2.jpg', 'dog/3.jpg'] True"
    assert [in_process[i][0] for i in range(3)] == [data for _, data, _ in before]
    assert result.packed == 2
    after = _samples(pack)
    assert after[:3] == before
    assert sorted(after[3:]) == [("ant/4.jpg", (b / "ant" / "4.jpg").read_bytes(), "ant"),
                                 ("dog/5.jpg", (b / "dog" / "5.jpg").read_bytes(), "dog")]  # fmt: skip
    assert packdata.LMDBDataset(pack).classes == ["cat", "dog", "ant"]
    now = os.stat(old_shard)
    assert (now.st_ino, now.st_mtime_ns, now.st_size) == (stat.st_ino, stat.st_mtime_ns, stat.st_size)
    assert packdata.verify_pack(pack, progress=False).records == 5


def test_append_of_another_kind_is_refused_before_any_file_is_packed(tmp_path: Path) -> None:
    """Images appended to a text pack were all packed ('packing: 60 of 60 files') before the kinds were compared."""
    docs = tmp_path / "docs" / "news"
    docs.mkdir(parents=True)
    (docs / "a.txt").write_text("alpha", encoding="utf-8")
    pack = tmp_path / "docs.lmdb"
    packdata.convert(tmp_path / "docs", pack, progress=False)
    before = tree_digest(pack)
    images = _folder(tmp_path / "images", {"cat": ["1.jpg", "2.jpg"]})
    result = CliRunner().invoke(cli, ["convert", str(images), str(pack), "--append"])  # with its progress line
    assert result.exit_code == 1
    assert result.output == (
        f"Error: {pack}: the source holds image samples, the pack text. "
        "Append a source of the pack's kind, or convert this one into a pack of its own\n"
    )
    assert tree_digest(pack) == before and sorted(os.listdir(tmp_path)) == ["docs", "docs.lmdb", "images"]


def test_append_refuses_repeated_keys_and_cleans_leftovers(tmp_path: Path) -> None:
    a = _folder(tmp_path / "a", {"cat": ["1.jpg"]})
    pack = tmp_path / "p.lmdb"
    packdata.convert(a, pack, progress=False)
    with pytest.raises(ConfigError, match=r"repeat key 'cat/1\.jpg'"):
        packdata.convert(a, pack, append=True, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["a", "p.lmdb"]
    (pack / "shard-a7-00000-of-00001.lmdb").mkdir()  # what an append killed before its manifest leaves
    (pack / "index-a7").mkdir()
    c = _folder(tmp_path / "c", {"cat": ["9.jpg"]})
    packdata.convert(c, pack, append=True, progress=False)
    names = sorted(os.listdir(pack))
    assert "shard-a7-00000-of-00001.lmdb" not in names and "index-a7" not in names
    assert packdata.verify_pack(pack, progress=False).records == 2
    runner = CliRunner()
    done = runner.invoke(cli, ["convert", str(c), str(pack), "--append", "-q"])
    assert done.exit_code == 1 and "repeat key 'cat/9.jpg'" in done.output


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_append_removes_only_the_exact_names_an_interrupted_append_writes(tmp_path: Path, fmt: str) -> None:
    """A user's index-a1-backup folder in the pack was deleted as an append's leftover: its name began 'index-aN'."""
    pack = tmp_path / f"p.{fmt}"
    packdata.convert(_folder(tmp_path / "a", {"cat": ["1.jpg"]}), pack, progress=False)
    shard = "shard-a7-00000-of-00001" + (".lmdb" if fmt == "lmdb" else ".tfrecord")
    made = [shard, "index-a7", ".append-a7.partial", ".index-a7.partial"]  # what appends killed before took effect left
    made += [] if fmt == "lmdb" else ["shard-a7-00000-of-00001.tfindex", "shard-a7-00000-of-00001.tfpayload"]
    mine = [
        "index-a1-backup",
        "index-a1.partial",
        ".append-a1",
        "shard-a1-notes",
        f"{shard}.bak",
        "shard-a1-00000-of-1",
    ]
    for name in made + mine:
        (pack / name).mkdir()
        (pack / name / "kept.txt").write_text("a user's file")
    packdata.convert(_folder(tmp_path / "c", {"cat": ["9.jpg"]}), pack, append=True, progress=False)
    names = set(os.listdir(pack))
    assert names.isdisjoint(made) and names.issuperset(mine)
    assert all((pack / name / "kept.txt").read_text() == "a user's file" for name in mine)
    ds = (packdata.LMDBDataset if fmt == "lmdb" else packdata.TFRecordIndexedDataset)(pack, decode="bytes")
    assert sorted(ds.keys) == ["cat/1.jpg", "cat/9.jpg"]


def test_cli_merge(tmp_path: Path) -> None:
    a = _folder(tmp_path / "a", {"cat": ["1.jpg"]})
    b = _folder(tmp_path / "b", {"cat": ["2.jpg"]})
    packdata.convert(a, tmp_path / "a.lmdb", progress=False)
    packdata.convert(b, tmp_path / "b.lmdb", progress=False)
    runner = CliRunner()
    done = runner.invoke(cli, ["merge", str(tmp_path / "a.lmdb"), str(tmp_path / "b.lmdb"), "-o", str(tmp_path / "m")])
    assert done.exit_code == 0, done.output
    assert "2 samples in 2 shards (2 linked, 0 copied, 0 rewritten)" in done.output


def _text_pack(root: Path, cls: str, files: int) -> Path:
    """A pack of ``files`` 40 KB texts in class ``cls`` (random: no two alike)."""
    (root / cls).mkdir(parents=True)
    for i in range(files):
        (root / cls / f"{i}.txt").write_text(os.urandom(20_000).hex(), encoding="utf-8")
    packdata.convert(root, root.with_suffix(".lmdb"), progress=False)
    return root.with_suffix(".lmdb")


@pytest.mark.parametrize(("first", "second"), [(40, 2), (8, 40)], ids=["copied", "rewritten"])
def test_merge_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path: Path, tmpfs, first: int, second: int) -> None:
    """A shard copied onto another, full disk was a raw OSError (ENOSPC); one rewritten said to rerun with --resume."""
    a, b = _text_pack(tmp_path / "a", "cat", first), _text_pack(tmp_path / "b", "dog", second)  # dog's labels change
    disk = tmpfs("1500k")
    result = CliRunner().invoke(cli, ["merge", str(a), str(b), "-o", str(disk / "m.lmdb")])
    assert result.exit_code == 1
    assert re.fullmatch(
        rf"Error: {re.escape(str(disk / 'm.lmdb'))}: no space left on {re.escape(str(disk))} \(tmpfs of 1\.5 MiB, "
        r"[0-9.]+ [KM]?i?B free\) while merging: nothing was published\. Free space on its disk \(shards are copied "
        r"there from another disk\), then merge again\n",
        result.output,
    ), result.output
    assert os.listdir(disk) == []


def test_append_to_a_pack_that_is_a_mount_point_is_refused_before_anything_is_written(tmp_path: Path, tmpfs) -> None:
    """The new shards are converted beside the pack and renamed in: into a pack that is a file system of its
    own that rename failed (EXDEV) as a traceback, after the append's plan and a converted sibling were written.
    """
    packdata.convert(_folder(tmp_path / "a", {"cat": ["1.jpg"]}), tmp_path / "a.lmdb", progress=False)
    pack = tmpfs("20m", name="p.lmdb")
    shutil.copytree(tmp_path / "a.lmdb", pack, dirs_exist_ok=True)
    tree, around = tree_digest(pack), sorted(os.listdir(tmp_path))
    result = CliRunner().invoke(
        cli, ["convert", str(_folder(tmp_path / "b", {"dog": ["2.jpg"]})), str(pack), "--append"]
    )
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f"Error: {pack}: is a mount point") and result.output.count("\n") == 1
    assert tree_digest(pack) == tree and sorted(os.listdir(pack)) == sorted(os.listdir(tmp_path / "a.lmdb"))
    assert sorted(os.listdir(tmp_path)) == sorted([*around, "b"])


def test_merge_overwrite_of_a_pack_that_is_a_mount_point_is_refused_and_leaves_it(tmp_path: Path, tmpfs) -> None:
    """Overwrite renames the old pack aside: a mount point cannot be renamed, and that was a traceback (EBUSY)."""
    a = _folder(tmp_path / "a", {"cat": ["1.jpg"]})
    b = _folder(tmp_path / "b", {"dog": ["2.jpg"]})
    for folder in (a, b):
        packdata.convert(folder, folder.with_suffix(".lmdb"), progress=False)
    pack = tmpfs("20m", name="p.lmdb")
    shutil.copytree(tmp_path / "a.lmdb", pack, dirs_exist_ok=True)
    tree, around = tree_digest(pack), sorted(os.listdir(tmp_path))
    result = CliRunner().invoke(
        cli, ["merge", str(tmp_path / "a.lmdb"), str(tmp_path / "b.lmdb"), "-o", str(pack), "--overwrite"]
    )
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f"Error: {pack}: destination is a mount point") and result.output.count("\n") == 1
    assert tree_digest(pack) == tree and sorted(os.listdir(tmp_path)) == around


@pytest.mark.timeout(120)  # the union was quadratic: hours for these classes, a hang is the failure
def test_merge_unites_a_million_classes_at_once(tmp_path: Path) -> None:
    """Each class was looked for in the list of all united so far (and its number again): a merge of packs with
    many classes hung. Now they are united in one pass, numbered as before."""
    for name, classes in (("a", {"cat": ["1.jpg"]}), ("b", {"dog": ["2.jpg"]})):
        packdata.convert(_folder(tmp_path / name, classes), tmp_path / f"{name}.lmdb", progress=False)
    many = [f"c{i}" for i in range(1_000_000)]
    rewrite_manifest(tmp_path / "b.lmdb", lambda d: d.update(classes=d["classes"] + many))
    packdata.merge_packs([tmp_path / "a.lmdb", tmp_path / "b.lmdb"], tmp_path / "ab.lmdb")
    merged = packdata.LMDBDataset(tmp_path / "ab.lmdb", decode="bytes")
    assert merged.classes == ["cat", "dog", *many] and [label for _, label in merged] == [0, 1]


def test_append_to_a_pack_whose_names_count_too_many_appends_is_refused_before_converting(tmp_path: Path) -> None:
    """index-a999...9 (230 digits): the next append's names were too long for the file system, a traceback
    (ENAMETOOLONG) after the source was converted, whose copy was left beside the pack."""
    packdata.convert(_folder(tmp_path / "a", {"cat": ["1.jpg"]}), tmp_path / "a.lmdb", progress=False)
    pack, name = tmp_path / "a.lmdb", "index-a" + "9" * 230
    (pack / "index").rename(pack / name)
    rewrite_manifest(pack, lambda d: d["index"].update(dir=name))
    tree, around = tree_digest(pack), sorted(os.listdir(tmp_path))
    result = CliRunner().invoke(
        cli, ["convert", str(_folder(tmp_path / "b", {"ant": ["2.jpg"]})), str(pack), "--append"]
    )
    assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
    assert result.output.startswith(f"Error: {pack / 'manifest.json'}: the pack's names (index.dir or a shard's file)")
    assert tree_digest(pack) == tree and sorted(os.listdir(tmp_path)) == sorted([*around, "b"])


def test_append_through_a_symbolic_link_to_a_pack_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """An append takes its lock (and converts) beside the path given: through a link that was beside the link,
    so an append through the link and one through the pack's own path held two locks and wrote into one pack
    at once (both named their files shard-a1-..., index-a1). Refused, as convert and merge refuse a linked DST."""
    pack = tmp_path / "a.lmdb"
    packdata.convert(_folder(tmp_path / "a", {"cat": ["1.jpg"]}), pack, progress=False)
    link = tmp_path / "link.lmdb"
    link.symlink_to(pack.name)
    tree, around = tree_digest(pack), sorted(os.listdir(tmp_path))
    result = CliRunner().invoke(
        cli, ["convert", str(_folder(tmp_path / "b", {"dog": ["2.jpg"]})), str(link), "--append"]
    )
    assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
    assert result.output.startswith(f"Error: {link}: destination is a symbolic link (to 'a.lmdb')")
    assert tree_digest(pack) == tree and sorted(os.listdir(tmp_path)) == sorted([*around, "b"])


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_merge_refuses_a_rename_that_would_make_a_key_too_long_before_anything_is_written(
    tmp_path: Path, fmt: str
) -> None:
    """A key of the most bytes a pack holds (65535), in two packs merged with on_duplicate='rename': KEY~1 did
    not fit, a traceback (RecordError) for LMDB as its shard was rewritten; a TFRecord pack was published with a
    key no other packdata tool writes. Refused now while planning, naming the pack and the sample."""
    key = "k" * 65535
    packs = [tmp_path / f"{name}.{fmt}" for name in ("a", "b")]
    for pack, text in zip(packs, ("a", "b"), strict=True):
        packdata.write_pack([{"__key__": key, "txt": text}], pack, format=fmt)
    around = sorted(os.listdir(tmp_path))
    result = CliRunner().invoke(cli, ["merge", *map(str, packs), "-o", str(tmp_path / "m"), "--on-duplicate", "rename"])
    assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
    assert (
        result.output.startswith(f"Error: {packs[1]}: key 'kkk")
        and "(sample 0) is already in an earlier pack" in result.output
    )
    assert "renamed 'KEY~1' it would be 65537 bytes in UTF-8, more than the 65535 a key may hold" in result.output
    assert sorted(os.listdir(tmp_path)) == around


@pytest.mark.parametrize("command", ["convert", "merge", "append"])
def test_a_destination_that_ends_in_dotdot_is_refused_before_any_folder_is_made(tmp_path: Path, command: str) -> None:
    """DST 'out/new/..' names out, but packdata takes its lock and its partial pack beside the last name: convert
    and merge made out/new, then said 'destination already exists' (or, over a pack, that 'index/....lock' in it
    is not part of a pack); an append through 'p.lmdb/index/..' said its own sibling pack would be inside the pack."""
    packdata.convert(_folder(tmp_path / "a", {"cat": ["1.jpg"]}), tmp_path / "a.lmdb", progress=False)
    packdata.convert(_folder(tmp_path / "b", {"dog": ["2.jpg"]}), tmp_path / "b.lmdb", progress=False)
    dst = tmp_path / ("a.lmdb/index/.." if command == "append" else "out/new/..")
    tree, around = tree_digest(tmp_path / "a.lmdb"), sorted(os.listdir(tmp_path))
    args = {
        "convert": ["convert", str(tmp_path / "a"), str(dst)],
        "merge": ["merge", str(tmp_path / "a.lmdb"), str(tmp_path / "b.lmdb"), "-o", str(dst)],
        "append": ["convert", str(tmp_path / "b"), str(dst), "--append"],
    }[command]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
    assert result.output.startswith(f"Error: {dst}: destination ends in '..'"), result.output
    assert sorted(os.listdir(tmp_path)) == around and tree_digest(tmp_path / "a.lmdb") == tree


def test_a_merge_whose_destination_appears_meanwhile_never_says_its_result_was_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Something that does not take the lock makes the destination while a merge writes: the refusal said 'The new
    pack is left in .NAME.partial', a folder the merge had just deleted. It now says nothing was published."""
    from packdata.conversion import combine

    a = packdata.convert(_folder(tmp_path / "a", {"cat": ["1.jpg"]}), tmp_path / "a.lmdb", progress=False).pack
    b = packdata.convert(_folder(tmp_path / "b", {"dog": ["2.jpg"]}), tmp_path / "b.lmdb", progress=False).pack
    out = tmp_path / "out.lmdb"
    write_manifest = combine.write_manifest

    def then_someone_makes_the_destination(folder: Path, manifest: Any) -> None:
        write_manifest(folder, manifest)
        out.mkdir()  # another program, which takes no lock

    monkeypatch.setattr(combine, "write_manifest", then_someone_makes_the_destination)
    with pytest.raises(ConfigError, match=r"destination appeared while converting\. Nothing was published") as raised:
        packdata.merge_packs([a, b], out)
    assert ".partial" not in str(raised.value)
    assert not (tmp_path / ".out.lmdb.partial").exists() and list(out.iterdir()) == []
