"""packdata stage: what is copied, copied again or refused (sources, selections, names, budgets, interrupts)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import _noise_jpeg, assert_index_digests, flip_label, help_text, tree_digest
from faults.hostile import rewrite_manifest
from stage_helpers import _all_bytes

import packdata
import packdata.staging.copy as copy_module
from packdata.cli import main
from packdata.errors import ConfigError, PackFormatError
from packdata.pack.lock import convert_lock_path, hold_lock
from packdata.pack.manifest import read_manifest
from packdata.reading.datasets import LMDBDataset
from packdata.reading.streaming import TFRecordDataset
from packdata.reading.tfrecord_indexed import TFRecordIndexedDataset
from packdata.staging.marker import STAGED_FILE
from packdata.staging.stage import stage
from packdata.staging.status import stage_status
from packdata.staging.unstage import unstage
from packdata.units import format_size


def test_stage_reads_back_byte_equal(lmdb_pack: Path, tmp_path: Path) -> None:
    source = tree_digest(lmdb_pack)
    result = stage(lmdb_pack, to=tmp_path / "nvme", progress=False)
    staged = tmp_path / "nvme" / "train.lmdb"
    assert result.staged == staged
    assert result.left == [] and len(result.copied) == 6 and result.reused == []
    assert result.bytes_copied == result.bytes_staged > 0
    manifest = read_manifest(staged)
    assert all(not Path(s.file).is_absolute() for s in manifest.shards)
    assert _all_bytes(staged) == _all_bytes(lmdb_pack)
    assert list(LMDBDataset(staged).keys) == list(LMDBDataset(lmdb_pack).keys)
    assert packdata.verify_pack(staged, progress=False).records == 36
    assert tree_digest(lmdb_pack) == source  # the source is only read
    marker = json.loads((staged / STAGED_FILE).read_text())
    assert marker["origin"] == os.fspath(lmdb_pack.resolve()) and marker["complete"]


def test_info_of_a_staged_pack_whose_origin_moved_gives_one_hint(lmdb_pack: Path, tmp_path: Path) -> None:
    """It gave two hints: the origin's "Convert a folder ... first", then "Stage the pack again"."""
    result = stage(lmdb_pack, to=tmp_path / "nvme", shards=[0], progress=False)
    assert result.copied == ["shard-00000.lmdb"] and result.left
    origin = lmdb_pack.resolve()
    os.rename(lmdb_pack, tmp_path / "moved.lmdb")
    out = CliRunner().invoke(main, ["info", str(result.staged)])
    assert out.exit_code == 1
    assert out.output.strip() == (
        f"Error: {result.staged / 'manifest.json'}: manifest field 'shards[1].file' names a shard of {origin}, "
        "which is not a readable pack: no such pack. Its origin was moved or removed: stage the pack again from "
        f"where it is now, or move it back to {origin}"
    )


def test_incremental_restage_copies_nothing(lmdb_pack: Path, tmp_path: Path) -> None:
    stage(lmdb_pack, to=tmp_path / "nvme", progress=False)
    again = stage(lmdb_pack, to=tmp_path / "nvme", progress=False)
    assert again.copied == [] and again.bytes_copied == 0
    assert len(again.reused) == 6


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_changed_source_shard_is_recopied(fmt: str, noise_folder: Path, tmp_path: Path) -> None:
    pack = tmp_path / ("train.lmdb" if fmt == "lmdb" else "train")
    packdata.convert(noise_folder, pack, format=fmt, shard_samples=6, progress=False)
    stage(pack, to=tmp_path / "nvme", progress=False)
    before = read_manifest(pack).shards
    (noise_folder / "c" / "11.jpg").write_bytes(_noise_jpeg(999))  # the last shard changes
    packdata.convert(noise_folder, pack, format=fmt, shard_samples=6, overwrite=True, progress=False)
    after = read_manifest(pack).shards
    changed = [Path(b.file).name for a, b in zip(before, after, strict=True) if a.sha256 != b.sha256]
    assert Path(after[-1].file).name in changed
    again = stage(pack, to=tmp_path / "nvme", progress=False)
    assert again.copied == changed == [Path(after[-1].file).name]  # shards are byte-stable across conversions
    assert len(again.reused) == 5
    staged = tmp_path / "nvme" / pack.name
    reader = TFRecordIndexedDataset if fmt == "tfrecord" else LMDBDataset
    x, y = reader(staged, decode="bytes"), reader(pack, decode="bytes")
    assert [x[i] for i in range(len(x))] == [y[i] for i in range(len(y))]


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_shards_a_source_converted_again_no_longer_has_are_removed_from_its_staged_copy(
    fmt: str, noise_folder: Path, tmp_path: Path
) -> None:
    """A source converted again into fewer (or other-named) shards left its old shards in the staged copy for good
    (on tmpfs: RAM), in no manifest, taking the room later stages needed; the next stage now removes them."""
    pack = tmp_path / ("train.lmdb" if fmt == "lmdb" else "train")
    packdata.convert(noise_folder, pack, format=fmt, shard_samples=6, progress=False)
    stage(pack, to=tmp_path / "nvme", progress=False)
    packdata.convert(noise_folder, pack, format=fmt, shard_samples=12, overwrite=True, progress=False)
    user_file = tmp_path / "nvme" / "notes.txt"
    user_file.write_text("mine")
    stage(pack, to=tmp_path / "nvme", progress=False)
    staged = tmp_path / "nvme" / pack.name
    mine = {".readers.lock", ".stage.lock", STAGED_FILE}
    assert sorted(p.name for p in staged.iterdir() if p.name not in mine) == sorted(p.name for p in pack.iterdir())
    assert user_file.read_text() == "mine"
    reader = TFRecordIndexedDataset if fmt == "tfrecord" else LMDBDataset
    x, y = reader(staged, decode="bytes"), reader(pack, decode="bytes")
    assert [x[i] for i in range(len(x))] == [y[i] for i in range(len(y))]


def test_a_staged_shard_folder_swapped_for_a_link_is_copied_again_not_reused(lmdb_pack: Path, tmp_path: Path) -> None:
    """A staged LMDB shard folder replaced by a link to a copy elsewhere (slow disk, another user's folder) passed
    the check file by file through the link and was kept: the staged pack read that shard from outside its area."""
    stage(lmdb_pack, to=tmp_path / "nvme", progress=False)
    shard = tmp_path / "nvme" / "train.lmdb" / "shard-00001.lmdb"
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(shard, elsewhere)
    shutil.rmtree(shard)
    shard.symlink_to(elsewhere)
    again = stage(lmdb_pack, to=tmp_path / "nvme", progress=False)
    assert again.copied == ["shard-00001.lmdb"]
    assert shard.is_dir() and not shard.is_symlink()
    assert sorted(p.name for p in elsewhere.iterdir()) == ["data.mdb", "records.i64"]
    assert _all_bytes(tmp_path / "nvme" / "train.lmdb") == _all_bytes(lmdb_pack)


def test_corrupt_staged_copy_is_recopied(lmdb_pack: Path, tmp_path: Path) -> None:
    """Documented choice: a staged copy failing its checksum is replaced on the next run."""
    stage(lmdb_pack, to=tmp_path / "nvme", progress=False)
    data = tmp_path / "nvme" / "train.lmdb" / "shard-00002.lmdb" / "data.mdb"
    with open(data, "r+b") as f:
        f.seek(5000)
        f.write(b"\xff" * 64)
    again = stage(lmdb_pack, to=tmp_path / "nvme", progress=False)
    assert again.copied == ["shard-00002.lmdb"]
    assert _all_bytes(tmp_path / "nvme" / "train.lmdb") == _all_bytes(lmdb_pack)


def test_damaged_source_is_never_staged(lmdb_pack: Path, tmp_path: Path) -> None:
    data = lmdb_pack / "shard-00001.lmdb" / "data.mdb"
    with open(data, "r+b") as f:
        f.seek(6000)
        f.write(b"\xab" * 32)
    with pytest.raises(PackFormatError, match=r"shard 1 does not match the manifest.*packdata verify"):
        stage(lmdb_pack, to=tmp_path / "nvme", progress=False)
    staged = tmp_path / "nvme" / "train.lmdb"
    assert not (staged / "shard-00001.lmdb").exists()
    assert not [p for p in staged.iterdir() if p.name.endswith(".partial")]
    # the interim manifest still reads correctly: it points at the originals
    assert len(LMDBDataset(staged, decode="bytes")) == 36


@pytest.mark.parametrize("index", ["symlink", "missing"])
def test_a_source_whose_index_is_not_its_own_folder_is_refused_before_a_copy(
    lmdb_pack: Path, tmp_path: Path, index: str
) -> None:
    """Once staged without a word, as a 'complete' pack that no reader could open (no index)."""
    os.rename(lmdb_pack / "index", lmdb_pack / "index-real")
    if index == "symlink":  # inside the pack, so the source itself still reads
        (lmdb_pack / "index").symlink_to("index-real")
    kind = "is not a folder of the pack (it is a symlink)" if index == "symlink" else "is missing"
    with pytest.raises(PackFormatError, match=rf"train\.lmdb/index: the sample index folder {re.escape(kind)}"):
        stage(lmdb_pack, to=tmp_path / "nvme", progress=False)
    assert not (tmp_path / "nvme").exists()  # nothing copied, no staged.json, no folder


@pytest.mark.parametrize("file", ["labels.i32", "keys.utf8"])
def test_a_source_missing_an_index_file_is_refused_naming_it_before_a_copy(
    lmdb_pack: Path, tmp_path: Path, file: str
) -> None:
    """Once "index/labels.i32: cannot be opened" with no hint, after leaving staged.json and .index.partial behind."""
    (lmdb_pack / "index" / file).unlink()
    result = CliRunner().invoke(main, ["stage", str(lmdb_pack), "--to", str(tmp_path / "nvme")])
    assert result.exit_code == 1
    expected = f"Error: {lmdb_pack / 'index' / file}: sample index file {file} is missing. Convert the pack again"
    assert result.output.strip() == expected
    assert not (tmp_path / "nvme").exists()  # nothing copied, no staged.json, no folder


def test_a_manifest_naming_one_file_twice_is_refused_before_a_copy(tfrecord_pack: Path, tmp_path: Path) -> None:
    """A stranger's manifest names shard 1 as shard 0's offsets index: both would be copied to one name."""
    first, second = (s.file for s in read_manifest(tfrecord_pack).shards[:2])
    clash = first.removesuffix(".tfrecord") + ".tfindex"
    (tfrecord_pack / clash).unlink()
    os.rename(tfrecord_pack / second, tfrecord_pack / clash)
    rewrite_manifest(tfrecord_pack, lambda d: d["shards"][1].__setitem__("file", clash))
    before = tree_digest(tfrecord_pack)
    expected = rf"manifest\.json: manifest names '{clash}' as a side table of shard 0 and as shard 1"
    with pytest.raises(PackFormatError, match=expected):
        stage(tfrecord_pack, to=tmp_path / "nvme", progress=False)
    assert not (tmp_path / "nvme").exists()  # nothing copied, no folder
    assert tree_digest(tfrecord_pack) == before


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_a_staged_index_is_checked_against_the_source_manifest(fmt: str, noise_folder: Path, tmp_path: Path) -> None:
    """The staged manifest keeps the source's index digests, and a damaged source index is never staged.

    Neither when copied anew nor when a staged copy damaged the same way is
    already there (equal to its source, unequal to the manifest): a stage never
    makes a damaged index look sound.
    """
    pack = tmp_path / ("train.lmdb" if fmt == "lmdb" else "train")
    packdata.convert(noise_folder, pack, format=fmt, shard_samples=6, progress=False)
    stage(pack, to=tmp_path / "nvme", progress=False)
    staged = tmp_path / "nvme" / pack.name
    assert assert_index_digests(staged) == assert_index_digests(pack)
    labels = flip_label(pack)
    damaged = re.escape(f"{labels}: sample index file labels.i32 does not match its SHA-256 in the manifest")
    with pytest.raises(PackFormatError, match=rf"{damaged}\. .*packdata verify"):
        stage(pack, to=tmp_path / "nvme", progress=False)
    (staged / "index" / "labels.i32").write_bytes(labels.read_bytes())  # the staged copy damaged alike
    with pytest.raises(PackFormatError, match=damaged):
        stage(pack, to=tmp_path / "nvme", progress=False)
    with pytest.raises(PackFormatError, match=damaged):
        stage(pack, to=tmp_path / "elsewhere", progress=False)


def test_partial_staging_with_budget_reads_the_mix(lmdb_pack: Path, tmp_path: Path) -> None:
    first_two = sum(f.stat().st_size for n in (0, 1) for f in (lmdb_pack / f"shard-0000{n}.lmdb").iterdir())
    budget = first_two + 10
    result = stage(lmdb_pack, to=tmp_path / "nvme", budget=budget, progress=False)
    assert result.copied == ["shard-00000.lmdb", "shard-00001.lmdb"]
    assert result.left == [f"shard-0000{i}.lmdb" for i in range(2, 6)]
    staged = tmp_path / "nvme" / "train.lmdb"
    manifest = read_manifest(staged)
    assert [Path(s.file).is_absolute() for s in manifest.shards] == [False] * 2 + [True] * 4
    assert Path(manifest.shards[3].file) == (lmdb_pack / "shard-00003.lmdb").resolve()
    assert _all_bytes(staged) == _all_bytes(lmdb_pack)


def test_hot_shards_in_given_order(tfrecord_pack: Path, tmp_path: Path) -> None:
    result = stage(tfrecord_pack, to=tmp_path / "nvme", shards=[4, "train-00001-of-00006.tfrecord"], progress=False)
    assert result.copied == ["train-00004-of-00006.tfrecord", "train-00001-of-00006.tfrecord"]
    assert len(result.left) == 4
    # the others were left as asked, not for want of room ('the budget (66.7 GiB) holds no more shards')
    assert result.advice == "only the shards asked for (shards=LIST) are staged; name the others too to stage them"
    staged = tmp_path / "nvme" / "train"
    assert (staged / "train-00004-of-00006.tfindex").is_file()
    assert (staged / "train-00004-of-00006.tfpayload").is_file()  # the payload table travels too
    streamed = sorted(sample for sample, _ in TFRecordDataset(staged, decode="bytes"))
    assert streamed == sorted(sample for sample, _ in TFRecordDataset(tfrecord_pack, decode="bytes"))
    a, b = TFRecordIndexedDataset(staged, decode="bytes"), TFRecordIndexedDataset(tfrecord_pack, decode="bytes")
    assert [a[i] for i in range(len(a))] == [b[i] for i in range(len(b))]
    del a, b  # a copy still read is not changed
    # a narrower selection later removes the copies it no longer wants
    again = stage(tfrecord_pack, to=tmp_path / "nvme", shards=[1], progress=False)
    assert again.copied == [] and again.reused == ["train-00001-of-00006.tfrecord"]
    size = again.bytes_staged
    tight = stage(tfrecord_pack, to=tmp_path / "nvme", shards=[1, 2], budget=size, progress=False)
    assert tight.advice.startswith(f"the budget ({format_size(size)}) holds no more shards: the smallest left is ")
    assert not (staged / "train-00004-of-00006.tfrecord").exists()
    assert not (staged / "train-00004-of-00006.tfpayload").exists()


def test_bad_shard_selection_names_the_choices(lmdb_pack: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"shards should be numbers from 0 to 5 or shard names, but got 'x'"):
        stage(lmdb_pack, to=tmp_path / "nvme", shards=["x"], progress=False)
    # '²' passes str.isdigit and 5,000 digits int()'s limit: each was a raw ValueError; none named no shard at all
    for value in ("²", "9" * 5000):
        with pytest.raises(ConfigError, match=r"shards should be numbers from 0 to 5 or shard names, but got '[²9]"):
            stage(lmdb_pack, to=tmp_path / "nvme", shards=[value], progress=False)
    for value in ("", ","):  # '' staged every shard, ',' none ('nothing was staged')
        result = CliRunner().invoke(main, ["stage", str(lmdb_pack), "--to", str(tmp_path / "nvme"), "--shards", value])
        assert result.exit_code == 1
        assert result.output.startswith("Error: --shards should name at least one shard, but got none. "), result.output
    # the command line named the keyword argument (shards should be ...), not the flag
    result = CliRunner().invoke(main, ["stage", str(lmdb_pack), "--to", str(tmp_path / "nvme"), "--shards", "abc"])
    assert result.exit_code == 1
    said = "Error: --shards should be numbers from 0 to 5 or shard names, but got 'abc'. The pack's shards are "
    assert result.output.startswith(said), result.output
    assert not list((tmp_path / "nvme").rglob("*.mdb"))
    with pytest.raises(ConfigError, match="either to="):
        stage(lmdb_pack, to=tmp_path / "nvme", tmpfs=1 << 20, progress=False)


def test_refuses_to_write_into_a_folder_it_did_not_stage(lmdb_pack: Path, tmp_path: Path) -> None:
    (tmp_path / "nvme" / "train.lmdb").mkdir(parents=True)
    (tmp_path / "nvme" / "train.lmdb" / "precious.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"train.lmdb: exists and is not a staged pack"):
        stage(lmdb_pack, to=tmp_path / "nvme", progress=False)
    with pytest.raises(ConfigError, match="is not a staged pack"):
        unstage(tmp_path / "nvme" / "train.lmdb")
    assert (tmp_path / "nvme" / "train.lmdb" / "precious.txt").exists()


@pytest.mark.parametrize("to", ["train.lmdb", "train.lmdb/sub/deeper"])
def test_a_destination_inside_the_source_pack_is_refused_and_the_pack_untouched(
    lmdb_pack: Path, tmp_path: Path, to: str
) -> None:
    before = tree_digest(lmdb_pack), sorted(p.relative_to(lmdb_pack) for p in lmdb_pack.rglob("*"))
    out = CliRunner().invoke(main, ["stage", str(lmdb_pack), "--to", str(tmp_path / to), "-q"])
    assert out.exit_code == 1, out.output
    assert out.output == (
        f"Error: {tmp_path / to / 'train.lmdb'}: the staging destination is inside the pack being staged "
        f"({lmdb_pack}). Give a --to DIR outside the pack; stage never writes into its source\n"
    )
    assert (tree_digest(lmdb_pack), sorted(p.relative_to(lmdb_pack) for p in lmdb_pack.rglob("*"))) == before
    with pytest.raises(ConfigError, match=r"train\.lmdb: the staging destination is inside the pack being staged"):
        stage(lmdb_pack, to=tmp_path / to, progress=False)
    with pytest.raises(ConfigError, match=r"the staging destination holds the pack being staged"):
        stage(lmdb_pack, to=tmp_path.parent, name=tmp_path.name, progress=False)
    assert (tree_digest(lmdb_pack), sorted(p.relative_to(lmdb_pack) for p in lmdb_pack.rglob("*"))) == before


@pytest.mark.parametrize("name", ["../escaped", "{tmp}/elsewhere/abs", "", ".", "..", "a\nb", "a\tb", "a\x7fb"])
def test_a_name_that_is_not_a_plain_folder_name_is_refused(lmdb_pack: Path, tmp_path: Path, name: str) -> None:
    name = name.format(tmp=tmp_path)
    area = tmp_path / "area"
    area.mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    out = CliRunner().invoke(main, ["stage", str(lmdb_pack), "--to", str(area), "--name", name, "-q"])
    assert out.exit_code == 1, out.output
    assert out.output == (
        f"Error: {area}: the staged pack's name should be one plain folder name inside the area, but got {name!r}. "
        "Pass --name NAME without '/' or control characters (such as --name train.lmdb): the staged pack is AREA/NAME\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == before and list(area.iterdir()) == []
    with pytest.raises(ConfigError, match=r"area: the staged pack's name should be one plain folder name"):
        stage(lmdb_pack, to=area, name=name, progress=False)


@pytest.mark.parametrize("name", [".y.partial", ".y.old-123", ".y.old-123-2"])
def test_a_name_packdata_gives_its_temporaries_is_refused(lmdb_pack: Path, tmp_path: Path, name: str) -> None:
    """Such a pack was y's temporary to unstage: refused by its path, and removed by the area's even while read."""
    area = tmp_path / "area"
    with pytest.raises(
        ConfigError,
        match=rf"area: the staged pack's name '{re.escape(name)}' cannot be unstaged: it is how packdata names y's "
        r"copy moved aside or being downloaded\. Choose another name=NAME \(such as name=y\)",
    ):
        stage(lmdb_pack, to=area, name=name, progress=False)
    assert not area.exists()


def test_a_tfrecord_shard_without_its_offsets_index_is_refused_not_staged(tfrecord_pack: Path, tmp_path: Path) -> None:
    """The .tfindex was copied only 'when present': the staged copy then failed every read."""
    index = sorted(tfrecord_pack.glob("*.tfindex"))[1]
    kept = index.read_bytes()
    index.unlink()
    with pytest.raises(PackFormatError, match=re.escape(f"{index}: shard 1's .tfindex file is missing")):
        stage(tfrecord_pack, to=tmp_path / "fast" / "area", progress=False)
    assert not (tmp_path / "fast").exists()  # it left fast/area/train, empty: the folders this run made go
    (tmp_path / "fast").mkdir()
    (tmp_path / "fast" / "mine").mkdir()  # a folder that was there before stays, empty or not
    for to in (tmp_path / "fast", tmp_path / "fast" / "mine"):
        with pytest.raises(PackFormatError, match=re.escape(f"{index}: shard 1's .tfindex file is missing")):
            stage(tfrecord_pack, to=to, progress=False)
    assert sorted(p.name for p in (tmp_path / "fast").rglob("*")) == ["mine"]
    index.write_bytes(kept)
    for table in tfrecord_pack.glob("*.tfpayload"):  # the payload tables are accelerators: optional
        table.unlink()
    staged = stage(tfrecord_pack, to=tmp_path / "fast", progress=False).staged
    assert len(TFRecordIndexedDataset(staged, decode="bytes")) == len(TFRecordIndexedDataset(tfrecord_pack))


def test_a_staged_copy_whose_origin_was_converted_again_says_so_and_never_mixes_the_two(
    noise_folder: Path, lmdb_pack: Path, tmp_path: Path
) -> None:
    """A copy staged with shards left at the origin, whose origin was then converted again (other samples): opening
    it was refused, but as 'should name a shard of its origin pack ... The manifest is damaged or was not written by
    packdata: convert the pack again', sending the user to convert a sound pack. It now says the pack was converted
    again since it was staged, and to stage it again; staging it again gives the new pack's samples alone."""
    staged = stage(lmdb_pack, to=tmp_path / "nvme", shards=[0], progress=False).staged
    (noise_folder / "a" / "new.jpg").write_bytes(_noise_jpeg(999))
    packdata.convert(noise_folder, lmdb_pack, shard_samples=6, progress=False, overwrite=True)
    origin = lmdb_pack.resolve()
    message = (
        rf"{re.escape(str(staged / 'manifest.json'))}: manifest field 'shards\[(\d)\]\.file' names shard "
        rf"shard-0000\1\.lmdb of {re.escape(str(origin))}, which now lists it with another checksum or size: the "
        rf"pack was converted again since it was staged\. Stage it again \(packdata stage {re.escape(str(origin))} "
        r"\.\.\.\); its staged shards are of the pack as it was"
    )
    with pytest.raises(PackFormatError) as info:
        LMDBDataset(staged)
    assert re.fullmatch(message, str(info.value)), str(info.value)
    status = CliRunner().invoke(main, ["stage", "--status", str(staged.parent)])
    assert re.search(f"DAMAGED: its manifest cannot be read: {message} \\(stage it again\\)", status.output), (
        status.output
    )
    stage(lmdb_pack, to=tmp_path / "nvme", shards=[0], progress=False)
    assert _all_bytes(staged) == _all_bytes(lmdb_pack) and len(_all_bytes(staged)) == 37


def test_interrupt_leaves_no_staged_looking_shard(
    lmdb_pack: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = copy_module.copy_file
    calls = {"n": 0}

    def flaky(src, tmp, stop, bar):
        calls["n"] += 1
        if calls["n"] == 5:
            tmp.write_bytes(src.read_bytes()[:1000])  # half a file, then Ctrl-C
            raise KeyboardInterrupt
        return real(src, tmp, stop, bar)

    monkeypatch.setattr(copy_module, "copy_file", flaky)
    with pytest.raises(KeyboardInterrupt):
        stage(lmdb_pack, to=tmp_path / "nvme", workers=1, progress=False)
    staged = tmp_path / "nvme" / "train.lmdb"
    assert not [p for p in staged.iterdir() if p.name.endswith(".partial")]
    manifest = read_manifest(staged)
    for shard in manifest.shards:  # every shard the manifest names as staged is complete
        if not Path(shard.file).is_absolute():
            assert packdata.pack.files.file_sha256(staged / shard.file / "data.mdb") == shard.sha256
    assert _all_bytes(staged) == _all_bytes(lmdb_pack)
    assert not json.loads((staged / STAGED_FILE).read_text())["complete"]
    monkeypatch.setattr(copy_module, "copy_file", real)
    again = stage(lmdb_pack, to=tmp_path / "nvme", progress=False)
    assert len(again.copied) + len(again.reused) == 6 and again.copied
    assert json.loads((staged / STAGED_FILE).read_text())["complete"]


_SLOW_CHILD = """
import importlib, sys, time
s = importlib.import_module("packdata.staging.copy")
real = s.copy_file
s.CHUNK = 4096
def slow(src, tmp, stop, bar):
    orig = bar.update
    def update(n):
        time.sleep(0.02)
        orig(n)
    bar.update = update
    return real(src, tmp, stop, bar)
s.copy_file = slow
importlib.import_module("packdata.staging.stage").stage(sys.argv[1], to=sys.argv[2], workers=2, progress=False)
"""


def test_killed_stage_leaves_no_half_shard(lmdb_pack: Path, tmp_path: Path) -> None:
    dest = tmp_path / "nvme"
    args = [sys.executable, "-c", _SLOW_CHILD, os.fspath(lmdb_pack), os.fspath(dest)]
    child = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
    staged = dest / "train.lmdb"
    deadline = time.monotonic() + 60
    while child.poll() is None and time.monotonic() < deadline and not list(staged.glob(".*.partial/data.mdb")):
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    _, errors = child.communicate()
    assert list(staged.glob(".*.partial")), f"the child should have been killed mid-copy: {errors}"
    manifest = read_manifest(staged)
    for shard in manifest.shards:
        if not Path(shard.file).is_absolute():
            assert packdata.pack.files.file_sha256(staged / shard.file / "data.mdb") == shard.sha256
    assert _all_bytes(staged) == _all_bytes(lmdb_pack)
    status = stage_status(dest)
    assert [p.complete for p in status.areas[0].packs] == [False]
    again = stage(lmdb_pack, to=dest, progress=False)
    assert not list(staged.glob(".*.partial"))
    assert len(again.copied) + len(again.reused) == 6
    assert _all_bytes(staged) == _all_bytes(lmdb_pack)


def test_a_stage_that_stages_nothing_says_why_and_fails(lmdb_pack: Path, tmp_path: Path) -> None:
    smallest = min(
        sum(f.stat().st_size for f in (lmdb_pack / s.file).iterdir()) for s in read_manifest(lmdb_pack).shards
    )
    out = CliRunner().invoke(
        main, ["stage", os.fspath(lmdb_pack), "--to", os.fspath(tmp_path / "nvme"), "--budget", f"{smallest - 1}B"]
    )
    assert out.exit_code == 1
    assert "copied 0 shards" in out.output and "LEFT 6 shards" in out.output
    assert out.output.endswith(
        f"Error: nothing was staged: the budget ({format_size(smallest - 1)}) holds no more shards: the smallest "
        f"left is {format_size(smallest)}. Stage more with a bigger --budget SIZE, or convert with a smaller "
        "shard size (shards are the unit stage copies; `packdata convert --shard-size`)\n"
    )
    one = CliRunner().invoke(
        main, ["stage", os.fspath(lmdb_pack), "--to", os.fspath(tmp_path / "nvme2"), "--budget", f"{smallest}B", "-q"]
    )
    assert one.exit_code == 0 and "copied 1 shard (" in one.output and "why: the budget" in one.output


def test_stage_help_names_every_reason_a_shard_is_left_behind() -> None:
    """The help said shards are left behind '(over --budget)', but a stage without --budget leaves those past the
    room free in the area, and one with --shards those it does not name (the tests above)."""
    taught = (
        "The staged pack, AREA/NAME, has its own manifest: staged shards point at the copies, shards left behind "
        "(not named by --shards, or past --budget or the room free in the area) at the originals, so "
        "LMDBDataset(staged) and TFRecordDataset(staged) read the mix. A second run copies only what is missing or "
        "changed."
    )
    assert help_text("stage").count(taught) == 1


def test_lmdb_and_tfrecord_share_one_default_shard_size(noise_folder: Path, tmp_path: Path) -> None:
    """LMDB used to write one shard whatever the size, so staging into a smaller area staged nothing."""
    from packdata.formats import DEFAULT_SHARD_BYTES, get_format

    assert get_format("lmdb").default_shard_bytes == get_format("tfrecord").default_shard_bytes
    assert DEFAULT_SHARD_BYTES == 256 * 10**6
    result = packdata.convert(noise_folder, tmp_path / "p.lmdb", progress=False, shard_size=500_000)
    assert result.shards > 1  # the rule the default feeds: a new shard before the size is exceeded


@pytest.mark.parametrize("size", ["256", "0G", "30"])
def test_unitless_or_zero_sizes_are_refused_by_every_size_option(lmdb_pack: Path, tmp_path: Path, size: str) -> None:
    for args in (
        ["convert", os.fspath(lmdb_pack), os.fspath(tmp_path / "x.lmdb"), "--shard-size", size],
        ["stage", "--tmpfs", size, "--mount", os.fspath(tmp_path / "ram")],
        ["stage", os.fspath(lmdb_pack), "--to", os.fspath(tmp_path / "n"), "--budget", size],
    ):
        out = CliRunner().invoke(main, args)
        assert out.exit_code == 2, (args, out.output)
        assert "has no unit" in out.output or "is zero" in out.output
    assert not (tmp_path / "ram").exists() and not (tmp_path / "x.lmdb").exists()


_STAGE_CLI = """
import sys
from packdata.cli import main

def hook(event, args):  # the stage has read the manifest and tries the lock another process holds
    if event == "open" and str(args[0]).endswith(".lock") and not hooked:
        hooked.append(args[0])
        print("at the lock", flush=True)

hooked = []
sys.addaudithook(hook)
main(sys.argv[1:])
"""


def test_a_source_converted_again_while_it_is_staged_is_named_changed_not_damaged(
    noise_folder: Path, lmdb_pack: Path, tmp_path: Path
) -> None:
    """A stage waits for another rank's; meanwhile the source is converted again: its files no longer match the
    manifest the stage read. It said 'The source pack is damaged: run packdata verify', sending the user after a
    pack that verifies; it says the source changed."""
    area = tmp_path / "nvme"
    area.mkdir()
    lock = convert_lock_path(area / lmdb_pack.name)
    with hold_lock(lock, what="packdata stage", target=area / lmdb_pack.name):
        child = subprocess.Popen(
            [sys.executable, "-c", _STAGE_CLI, "stage", str(lmdb_pack), "--to", str(area), "-q"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None and child.stdout.readline().strip() == "at the lock"  # a set wait lost it
        packdata.convert(noise_folder, lmdb_pack, shard_samples=5, overwrite=True, progress=False)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 1, err
    assert err.startswith(f"Error: {lmdb_pack}: changed while it was staged: its manifest is no longer the one"), err
    assert err.rstrip().endswith("It was converted again meanwhile: stage it again once that conversion is done")
    assert "damaged" not in err and len(err.splitlines()) == 1
    assert stage(lmdb_pack, to=area, progress=False).copied  # once it is done, it stages
    assert packdata.verify_pack(area / lmdb_pack.name, progress=False).records == 36


def test_staging_again_keeps_a_copy_a_dataset_reads_unless_nothing_changes(lmdb_pack: Path, tmp_path: Path) -> None:
    """A stage with a larger budget replaced the manifest of a copy a dataset read, whose next read then failed
    ('pack changed since the dataset was opened'); a stage from a URL and unstage keep a copy that is read."""
    area = tmp_path / "nvme"
    budget = str(3 * read_manifest(lmdb_pack).shards[0].bytes + 100) + "B"
    assert stage(lmdb_pack, to=area, budget=int(budget[:-1]), progress=False).left
    dataset = LMDBDataset(area / lmdb_pack.name)
    dataset[0]
    result = CliRunner().invoke(main, ["stage", str(lmdb_pack), "--to", str(area), "-q"])
    assert result.exit_code == 1
    assert result.output == (
        f"Error: {area / lmdb_pack.name}: is still read (a dataset holds it), and staging it again would change its "
        "shards under its readers. Stage again once its readers are done, or stage under another --name NAME\n"
    )
    assert [dataset[i][1] for i in range(len(dataset))] == [i // 12 for i in range(36)]  # reads on, all of it
    again = CliRunner().invoke(main, ["stage", str(lmdb_pack), "--to", str(area), "--budget", budget, "-q"])
    assert again.exit_code == 0, again.output  # the same copy: nothing changes under its readers
    del dataset
    assert not stage(lmdb_pack, to=area, progress=False).left
