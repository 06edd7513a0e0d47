"""packdata unstage and status: copies moved aside, removed, listed and named."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import _noise_jpeg, killed_at_staged_json_delete, lock_held_elsewhere, packdata_as_nobody, tree_digest
from stage_helpers import _all_bytes

import packdata
import packdata.staging.folder as folder_module
from packdata.cli import main
from packdata.errors import ConfigError, PackFormatError
from packdata.pack.manifest import MANIFEST_NAME, read_manifest
from packdata.reading.datasets import LMDBDataset
from packdata.staging.marker import STAGED_FILE
from packdata.staging.stage import stage
from packdata.staging.status import stage_status
from packdata.staging.unstage import unstage
from packdata.units import format_size


def _shard_bytes(pack: Path) -> int:
    return sum(shard.bytes for shard in read_manifest(pack).shards)


def test_a_copy_an_unstage_left_aside_is_removed_by_the_next_stage(lmdb_pack: Path, tmp_path: Path) -> None:
    """An unstage killed between renaming the copy aside and deleting it leaves ``.NAME.old-PID`` (on tmpfs: RAM)."""
    stage(lmdb_pack, to=tmp_path / "nvme", progress=False)
    staged = tmp_path / "nvme" / "train.lmdb"
    aside = staged.with_name(".train.lmdb.old-4242")
    shutil.copytree(staged, aside)
    unrelated = staged.with_name(".other.lmdb.old-4242")  # another pack's: not this stage's to remove
    unrelated.mkdir()
    stage(lmdb_pack, to=tmp_path / "nvme", progress=False)
    assert not aside.exists() and unrelated.is_dir()
    assert _all_bytes(staged) == _all_bytes(lmdb_pack)


_INTERRUPTED_DELETE = killed_at_staged_json_delete(
    "from packdata.staging.unstage import unstage", "unstage(sys.argv[1])"
)


def test_an_unstage_killed_mid_delete_leaves_a_copy_the_area_unstage_still_knows(
    lmdb_pack: Path, tmp_path: Path
) -> None:
    """The copy goes aside, then its files: staged.json last, so a delete killed at any point leaves it marked."""
    copy = stage(lmdb_pack, to=tmp_path / "nvme", progress=False).staged
    child = subprocess.run([sys.executable, "-c", _INTERRUPTED_DELETE, str(copy)], timeout=120)
    assert child.returncode == -signal.SIGKILL
    (aside,) = (tmp_path / "nvme").glob(".train.lmdb.old-*")
    assert sorted(p.name for p in aside.iterdir()) == ["staged.json"] and not copy.exists()
    assert unstage(tmp_path / "nvme").removed == [aside]
    assert list((tmp_path / "nvme").iterdir()) == []


_INTERRUPTED_SWEEP = killed_at_staged_json_delete(  # the same kill, in a stage
    "from packdata.staging.stage import stage", "stage(sys.argv[1], to=sys.argv[2], progress=False)"
)


def test_a_stage_killed_while_it_sweeps_a_copy_left_aside_leaves_it_marked(lmdb_pack: Path, tmp_path: Path) -> None:
    """The next stage of NAME deletes a copy an unstage left aside as unstage does: staged.json last."""
    copy = stage(lmdb_pack, to=tmp_path / "nvme", progress=False).staged
    aside = copy.with_name(".train.lmdb.old-4242")
    os.rename(copy, aside)  # as an unstage killed after moving it aside leaves it
    child = subprocess.run([sys.executable, "-c", _INTERRUPTED_SWEEP, str(lmdb_pack), str(copy.parent)], timeout=120)
    assert child.returncode == -signal.SIGKILL
    assert sorted(p.name for p in aside.iterdir()) == ["staged.json"]
    assert aside in unstage(tmp_path / "nvme").removed and not aside.exists()


@pytest.mark.parametrize("suffix", ["old-4242", "partial"])
def test_unstage_of_a_copy_moved_aside_points_at_its_area(lmdb_pack: Path, tmp_path: Path, suffix: str) -> None:
    """Such a copy is NAME's, under NAME's lock: taken for a pack, it was deleted under a lock of its own name."""
    copy = stage(lmdb_pack, to=tmp_path / "nvme", progress=False).staged
    aside = copy.with_name(f".train.lmdb.{suffix}")
    os.rename(copy, aside)
    before = tree_digest(aside)
    with pytest.raises(ConfigError, match=r"is train.lmdb's copy moved aside .* Run `packdata unstage .*nvme`"):
        unstage(aside)
    assert tree_digest(aside) == before and not aside.with_name(f"..train.lmdb.{suffix}.lock").exists()
    assert unstage(tmp_path / "nvme").removed == [aside]


def test_unstage_of_a_folder_named_as_moved_aside_that_is_no_staged_copy_says_so(
    lmdb_pack: Path, tmp_path: Path
) -> None:
    """A killed ``convert --overwrite``'s old pack: the hint was its area, whose unstage finds no staged pack there."""
    converted = tmp_path / "nvme" / ".train.lmdb.old-77"
    shutil.copytree(lmdb_pack, converted)
    before = tree_digest(converted)
    with pytest.raises(
        ConfigError,
        match=r"nvme/\.train\.lmdb\.old-77: is named as train\.lmdb moved aside, but is no staged copy \(it holds no "
        r"staged\.json\): not unstage's\. A killed conversion with overwrite \(`packdata convert --overwrite`\) leaves "
        r"its old pack so: the next "
        r"convert into .*nvme/train\.lmdb moves it back or removes it\. Otherwise delete it yourself$",
    ):
        unstage(converted)
    assert tree_digest(converted) == before


def test_unstage_of_an_area_keeps_an_interrupted_conversion_into_it(
    lmdb_pack: Path, noise_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed convert's ``.NAME.partial`` was taken for a killed stage's download and deleted: its work was lost."""
    from conftest import interrupted_convert as _interrupted_convert

    area = tmp_path / "nvme"
    stage(lmdb_pack, to=area, progress=False)
    _interrupted_convert(noise_folder, area / "val.lmdb", monkeypatch)
    partial = area / ".val.lmdb.partial"
    before = tree_digest(partial)
    assert unstage(area).removed == [area / "train.lmdb"]
    assert tree_digest(partial) == before
    with pytest.raises(
        ConfigError,
        match=r"is an interrupted conversion into val\.lmdb .*\. Finish it with resume \(`packdata convert \.\.\. ",
    ):
        unstage(partial)
    assert tree_digest(partial) == before
    done = packdata.convert(noise_folder, area / "val.lmdb", resume=True, progress=False)
    assert done.packed == 36 and not partial.exists()


def test_a_copy_moved_aside_whose_name_holds_a_newline_is_still_its_names(lmdb_pack: Path, tmp_path: Path) -> None:
    """A copy an older packdata staged as ``a\\nb``, moved aside: never taken for a pack, deleted under its own lock."""
    copy = stage(lmdb_pack, to=tmp_path / "nvme", progress=False).staged
    aside = copy.with_name(".a\nb.old-4242")
    os.rename(copy, aside)
    before = tree_digest(aside)
    with pytest.raises(ConfigError, match=r"is a\nb's copy moved aside .* Run `packdata unstage .*nvme`"):
        unstage(aside)
    assert tree_digest(aside) == before
    assert unstage(tmp_path / "nvme").removed == [aside]


def test_unstage_moves_the_copy_aside_past_a_leftover_under_its_own_pid(lmdb_pack: Path, tmp_path: Path) -> None:
    """A killed process whose pid this reuses left ``.NAME.old-PID`` full of files: unstage still removes it."""
    copy = stage(lmdb_pack, to=tmp_path / "nvme", progress=False).staged
    leftover = copy.with_name(f".train.lmdb.old-{os.getpid()}")
    (leftover / "sub").mkdir(parents=True)
    (leftover / "sub" / "data.mdb").write_bytes(b"left by a killed unstage")
    outside = tmp_path / "outside"
    (outside / "keep").mkdir(parents=True)
    (outside / "keep" / "data.mdb").write_bytes(b"not the area's")
    link = copy.with_name(".train.lmdb.old-99999999")
    link.symlink_to(outside / "keep")
    other = copy.with_name(".train.lmdb.old-1x")  # not an aside's name: left alone
    other.mkdir()
    result = unstage(copy)  # moves the copy aside past the leftover, then sweeps the leftover under NAME's lock
    assert sorted(result.removed) == sorted([copy, leftover, link]) and not copy.exists()
    assert result.bytes_freed >= len(b"left by a killed unstage") + _shard_bytes(lmdb_pack)
    assert sorted(p.name for p in copy.parent.iterdir()) == [other.name]
    assert (outside / "keep" / "data.mdb").read_bytes() == b"not the area's"  # the link went, never its target


_KILLED_UNSTAGE = """
import os, sys, time
from packdata.staging.unstage import unstage
rename = os.rename
def stalled(src, dst):  # the copy is moved aside; the process is killed before its delete ends
    rename(src, dst)
    print("deleting", flush=True)
    time.sleep(60)
os.rename = stalled
unstage(sys.argv[1])
"""

_HOLDS_LOCK = """
import sys, time
from pathlib import Path
from packdata.pack.lock import convert_lock_path, hold_lock
with hold_lock(convert_lock_path(sys.argv[1]), what="packdata unstage", target=sys.argv[1]):
    print("holding", flush=True)
    time.sleep(60)
"""


def _child(script: str, arg: Path, says: str) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", script, os.fspath(arg)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == says
    return child


def test_unstage_of_an_area_removes_the_copy_an_unstage_killed_mid_delete_left(
    lmdb_pack: Path, tfrecord_pack: Path, tmp_path: Path
) -> None:
    """A killed unstage leaves ``.NAME.old-PID`` and no NAME (on tmpfs: RAM for good); unstaging the area sweeps it.

    Only under NAME's lock: the aside of a live unstage holding it stays. A ``.NAME.old-PID``
    that is no staged copy (a killed ``convert --overwrite``'s old pack) is never the area's to remove.
    """
    area = tmp_path / "nvme"
    copy = stage(lmdb_pack, to=area, progress=False).staged
    other = stage(tfrecord_pack, to=area, progress=False).staged
    staged = tree_digest(copy)
    child = _child(_KILLED_UNSTAGE, copy, "deleting")
    child.kill()  # SIGKILL between the rename and the end of the delete: no clean-up runs
    child.wait()
    leftover = copy.with_name(f".train.lmdb.old-{child.pid}")
    assert tree_digest(leftover).items() >= staged.items() and not copy.exists()  # the whole copy, aside
    converted = area / f".val.lmdb.old-{child.pid}"  # a pack, not a staged copy: its convert moves it back
    shutil.copytree(lmdb_pack, converted)
    pack = tree_digest(converted)
    result = unstage(area)
    assert sorted(result.removed) == sorted([other, leftover])
    assert result.bytes_freed >= _shard_bytes(lmdb_pack) + _shard_bytes(tfrecord_pack)
    assert sorted(p.name for p in area.iterdir()) == [converted.name]  # and no .train.lmdb.lock made or kept
    assert tree_digest(converted) == pack

    copy = stage(lmdb_pack, to=area, progress=False).staged  # a live owner: its aside is kept
    stage(tfrecord_pack, to=area, progress=False)
    staged = tree_digest(copy)
    holder = _child(_HOLDS_LOCK, copy, "holding")
    aside = copy.with_name(f".train.lmdb.old-{holder.pid}")
    os.rename(copy, aside)  # as the holder, an unstage, does before deleting it
    try:
        result = unstage(area)
    finally:
        holder.kill()
        holder.wait()
    assert result.removed == [other] and tree_digest(aside) == staged
    assert unstage(area).removed == [aside] and sorted(p.name for p in area.iterdir()) == [converted.name]


def test_a_restaged_index_is_never_moved_aside_onto_a_leftover(lmdb_pack: Path, tmp_path: Path) -> None:
    """``.index.old.partial`` that a killed run left and could not be removed no longer fails the index's swap.

    The old index goes aside under a free ``.index.old-PID`` name; the
    ``.index.old-PID`` a run killed mid-swap left is swept, holding the stage's lock as stage does.
    """
    copy = stage(lmdb_pack, to=tmp_path / "nvme", progress=False).staged
    (copy / "index" / "labels.i32").write_bytes(b"\0" * 8)  # damaged: the next stage copies the index again
    blocker = copy / ".index.old.partial"
    (blocker / "index").mkdir(parents=True)
    (blocker / "index" / "labels.i32").write_bytes(b"left by a killed stage")
    killed = copy / f".index.old-{os.getpid()}"
    killed.mkdir()
    (killed / "labels.i32").write_bytes(b"left mid-swap")
    with folder_module.locked(copy):  # as stage calls it, after remove_leftovers could not remove the blocker
        folder_module.copy_index(lmdb_pack.resolve(), copy, read_manifest(lmdb_pack))
    assert tree_digest(copy / "index") == tree_digest(lmdb_pack / "index")
    assert (blocker / "index" / "labels.i32").read_bytes() == b"left by a killed stage"  # remove_leftovers' to remove
    assert not killed.exists() and not list(copy.glob(".index.old-*"))
    stage(lmdb_pack, to=tmp_path / "nvme", progress=False)
    assert not blocker.exists() and _all_bytes(copy) == _all_bytes(lmdb_pack)


def test_unstage_of_a_file_says_what_it_is(tmp_path: Path) -> None:
    """A regular file was called 'no such staged pack or staging area', as if it did not exist."""
    notes = tmp_path / "notes.txt"
    notes.write_text("x")
    for path, problem in ((notes, "is a regular file, not a staged pack"), (tmp_path / "gone", "no such staged pack")):
        result = CliRunner().invoke(main, ["unstage", str(path)])
        assert result.exit_code == 1
        assert result.output == (
            f"Error: {path}: {problem} or staging area. "
            "List staged packs with stage_status() (`packdata stage --status`)\n"
        )
    assert notes.read_text() == "x"


def test_status_marks_a_whole_staged_copy_whose_origin_was_converted_again_outdated(
    noise_folder: Path, lmdb_pack: Path, tmp_path: Path
) -> None:
    """A copy holding every shard reads on by itself after its origin is converted again: the pack as it was
    staged, whole (never a mix). `stage --status` said nothing of it, as if it were the origin's current copy."""
    staged = stage(lmdb_pack, to=tmp_path / "nvme", progress=False).staged
    before = _all_bytes(staged)
    assert stage_status(staged.parent).areas[0].packs[0].outdated is False
    (noise_folder / "a" / "new.jpg").write_bytes(_noise_jpeg(999))
    packdata.convert(noise_folder, lmdb_pack, shard_samples=6, progress=False, overwrite=True)
    assert stage_status(staged.parent).areas[0].packs[0].outdated is True
    out = CliRunner().invoke(main, ["stage", "--status", str(staged.parent)])
    assert (
        f"  train.lmdb: 6 shards staged ({format_size(read_manifest(staged).total_bytes)}), 0 left (0 B) from "
        f"{lmdb_pack.resolve()} OUTDATED: its origin was converted again since; this copy reads the pack as it was "
        "(stage it again for the new one)\n"
    ) in out.output, out.output
    assert _all_bytes(staged) == before and len(before) == 36  # the pack as it was, whole
    stage(lmdb_pack, to=tmp_path / "nvme", progress=False)
    assert stage_status(staged.parent).areas[0].packs[0].outdated is False
    assert "OUTDATED" not in CliRunner().invoke(main, ["stage", "--status", str(staged.parent)]).output
    assert _all_bytes(staged) == _all_bytes(lmdb_pack) and len(_all_bytes(staged)) == 37


def test_status_and_unstage(lmdb_pack: Path, tfrecord_pack: Path, tmp_path: Path) -> None:
    area = tmp_path / "nvme"
    stage(lmdb_pack, to=area, progress=False)
    stage(tfrecord_pack, to=area, budget=1, progress=False)
    status = stage_status(area)
    packs = {p.path.name: p for p in status.areas[0].packs}
    assert packs["train.lmdb"].shards_staged == 6 and packs["train"].shards_left == 6
    assert status.memory["mem_total"] > 0
    json.dumps(status.to_dict())
    result = unstage(area / "train.lmdb")
    assert result.removed == [area / "train.lmdb"] and result.bytes_freed > 0
    assert lmdb_pack.exists() and (lmdb_pack / "manifest.json").exists()
    with pytest.raises(ConfigError, match="is not a tmpfs that packdata mounted"):
        unstage(area, unmount=True)
    unstage(area)
    assert list(area.iterdir()) == []


def test_status_lists_a_link_to_a_pack_staged_elsewhere_apart_and_unstage_never_deletes_through_it(
    lmdb_pack: Path, tfrecord_pack: Path, tmp_path: Path
) -> None:
    """A symlink in the area to a pack staged in another area was listed by `stage --status` as one of the area's
    staged packs, which `unstage AREA` then said the area did not hold."""
    elsewhere = stage(lmdb_pack, to=tmp_path / "other", progress=False).staged
    area = tmp_path / "nvme"
    own = stage(tfrecord_pack, to=area, progress=False).staged
    (area / "linked.lmdb").symlink_to(elsewhere)
    (area / "loop").symlink_to(area / "loop")  # a link that leads nowhere is no staged pack either
    status = stage_status(area).areas[0]
    assert [p.path for p in status.packs] == [own]
    assert status.links == {"linked.lmdb": os.fspath(elsewhere)}
    out = CliRunner().invoke(main, ["stage", "--status", os.fspath(area)])
    assert out.exit_code == 0, out.output
    assert f"  linked.lmdb: a link to {elsewhere}, staged there, not here (see, or unstage, it there)\n" in out.output
    assert "  train: 6 shards staged" in out.output and "  linked.lmdb: 6 shards" not in out.output
    assert [p.path for p in stage_status(area / "linked.lmdb").areas[0].packs] == [elsewhere]  # where it leads
    out = CliRunner().invoke(main, ["unstage", os.fspath(area / "linked.lmdb")])
    assert (
        out.exit_code == 1
        and f"is a symlink; unstage the staged pack itself. Run `packdata unstage {elsewhere}`" in (out.output)
    )
    assert unstage(area).removed == [own]
    assert (area / "linked.lmdb").is_symlink() and _all_bytes(elsewhere) == _all_bytes(lmdb_pack)
    with pytest.raises(ConfigError, match="is not a staged pack and holds none"):
        unstage(area)
    assert _all_bytes(elsewhere) == _all_bytes(lmdb_pack) and (elsewhere / STAGED_FILE).is_file()


def test_cli_stage_status_unstage(lmdb_pack: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    out = runner.invoke(
        main, ["stage", os.fspath(lmdb_pack), "--to", os.fspath(tmp_path / "nvme"), "-q", "--budget", "600KB"]
    )
    assert out.exit_code == 0, out.output
    assert "copied" in out.output and "LEFT" in out.output
    out = runner.invoke(main, ["stage", "--status", os.fspath(tmp_path / "nvme"), "--json"])
    assert out.exit_code == 0 and json.loads(out.output)["areas"][0]["packs"][0]["shards_left"] > 0
    out = runner.invoke(main, ["stage", os.fspath(lmdb_pack), "--to", "x", "--tmpfs", "1G"])
    assert out.exit_code == 2
    out = runner.invoke(main, ["stage", os.fspath(lmdb_pack), "--budget", "3 apples"])
    assert out.exit_code == 2 and "invalid size '3 apples'" in out.output
    out = runner.invoke(main, ["unstage", os.fspath(tmp_path / "nvme" / "train.lmdb")])
    assert out.exit_code == 0 and "removed" in out.output


def test_unstaging_an_area_leaves_a_live_downloads_partial_and_removes_a_killed_ones(
    lmdb_pack: Path, tmp_path: Path
) -> None:
    """A stage from a URL writes staged.json into .NAME.partial just before its rename, holding .NAME.lock.

    Unstaging the area must not take that download for a pack (and delete it under another lock); once no
    stage holds NAME's lock, the partial is a killed stage's leftover and goes with the area.
    """
    area = tmp_path / "area"
    stage(lmdb_pack, to=area, progress=False)
    download = area / ".val.lmdb.partial"
    shutil.copytree(area / lmdb_pack.name, download)  # a finished download: files, staged.json, readers' lock
    before = _all_bytes(download)
    with lock_held_elsewhere(area / ".val.lmdb.lock"):
        result = unstage(area)
        assert result.removed == [area / lmdb_pack.name] and not (area / lmdb_pack.name).exists()
        assert _all_bytes(download) == before  # the live stage's download, untouched
    assert unstage(area).removed == [download] and not download.exists()
    assert not (area / "val.lmdb").exists() and not (area / ".val.lmdb.lock").exists()


def test_unstaging_an_area_reads_dot_names_as_no_ones_temporaries(lmdb_pack: Path, tmp_path: Path) -> None:
    """``....old-1`` and ``...partial`` would name ``..`` and ``.`` as NAME: nothing outside the area is locked."""
    area = tmp_path / "outer" / "area"
    stage(lmdb_pack, to=area, progress=False)
    for name in ("....old-1", "...old-2", "...partial"):  # staged copies by their content, with hostile names
        shutil.copytree(area / lmdb_pack.name, area / name)

    def outside() -> list[list[str]]:
        return [sorted(p.name for p in folder.iterdir()) for folder in (tmp_path, tmp_path / "outer")]

    around = outside()
    result = unstage(area)
    assert sorted(p.name for p in result.removed) == sorted(["....old-1", "...old-2", "...partial", lmdb_pack.name])
    assert outside() == around
    assert sorted(p.name for p in area.iterdir()) == []  # each removed as a staged pack, under its own lock


def test_status_and_unstage_name_an_entry_they_cannot_stat(tmp_path: Path) -> None:
    """An entry of the area that cannot be stat'ed (``/proc/1/cwd`` of ``stage --status /proc/1`` without the
    right to trace, a path past PATH_MAX) was a traceback from Path.is_dir; it is one line naming it.

    Here the entry's whole path is longer than the kernel takes, while the area's is not.
    """
    area = tmp_path
    while len(str(area)) < 3850:
        area /= "d" * 200
    area.mkdir(parents=True)
    folder = os.open(area, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.mkdir("e" * 250, dir_fd=folder)
    finally:
        os.close(folder)
    entry = area / ("e" * 250)
    for args in (["stage", "--status", str(area)], ["unstage", str(area)], ["unstage", str(area), "--unmount"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1, (args, result.output)
        hint = "Name a staging area or staged pack that you may read"
        assert result.output == f"Error: {entry}: cannot be read (File name too long). {hint}\n"


def test_status_and_doctor_name_a_staged_shard_deleted_or_truncated_since(
    lmdb_pack: Path, tfrecord_pack: Path, tmp_path: Path
) -> None:
    """Both said a staged pack was whole after a shard of it was deleted or truncated; readers failed on it."""
    area = tmp_path / "nvme"
    stage(lmdb_pack, to=area, progress=False)
    stage(tfrecord_pack, to=area, progress=False)
    shutil.rmtree(area / "train.lmdb" / "shard-00001.lmdb")
    shard = area / "train" / "train-00002-of-00006.tfrecord"
    full = shard.stat().st_size
    os.truncate(shard, 1000)
    result = CliRunner().invoke(main, ["stage", "--status", str(area)])
    assert result.exit_code == 0, result.output
    assert " DAMAGED: shard-00001.lmdb is missing (stage it again)\n" in result.output
    assert f" DAMAGED: {shard.name} is 1000 bytes, the manifest says {full} (stage it again)\n" in result.output
    report = json.loads(CliRunner().invoke(main, ["doctor", str(area / "train"), "--json"]).output)
    (warning,) = [w for w in report["warnings"] if w["code"] == "staged-damaged"]
    assert f"{shard.name} is 1000 bytes" in warning["message"]
    assert f"packdata stage {tfrecord_pack} --to {area} --name train" in warning["message"]
    stage(lmdb_pack, to=area, progress=False)  # what the line says to do
    stage(tfrecord_pack, to=area, progress=False)
    assert "DAMAGED" not in CliRunner().invoke(main, ["stage", "--status", str(area)]).output
    report = json.loads(CliRunner().invoke(main, ["doctor", str(area / "train"), "--json"]).output)
    assert "staged-damaged" not in [w["code"] for w in report["warnings"]]


def test_a_damaged_staged_copy_advises_staging_it_again(lmdb_pack: Path, tmp_path: Path) -> None:
    """A staged copy whose sample index or record was damaged after staging said 'run packdata verify on the pack,
    then convert it again': its origin may be sound, and staging again is what mends the copy."""
    staged = stage(lmdb_pack, to=tmp_path / "area", progress=False).staged
    labels = staged / read_manifest(staged).index_dir / "labels.i32"
    data = bytearray(labels.read_bytes())
    data[0] ^= 1
    labels.write_bytes(bytes(data))
    with pytest.raises(
        PackFormatError,
        match=r"labels\.i32: .*\(a staged copy: stage it again; one staged from a URL: `packdata unstage` it first\)$",
    ):
        LMDBDataset(staged)
    stage(lmdb_pack, to=tmp_path / "area", progress=False)
    assert [label for _, label in LMDBDataset(staged, decode="bytes")] == [
        label for _, label in LMDBDataset(lmdb_pack, decode="bytes")
    ]


def test_a_folder_a_stage_left_without_its_manifest_advises_staging_again(lmdb_pack: Path, tmp_path: Path) -> None:
    """A stage killed after its marker but before its first manifest left staged.json alone (with what it had
    copied): opening it said 'Convert a folder with `packdata convert SRC DST` first', of a pack that exists."""
    staged = stage(lmdb_pack, to=tmp_path / "area", progress=False).staged
    (staged / MANIFEST_NAME).unlink()  # the state a kill between staged.json and manifest.json leaves
    with pytest.raises(
        PackFormatError,
        match=r"area/train\.lmdb: not a packdata pack \(no manifest\.json\)\. A stage into it was interrupted before "
        r"its manifest was written: stage the pack again$",
    ):
        LMDBDataset(staged)
    stage(lmdb_pack, to=tmp_path / "area", progress=False)
    assert len(LMDBDataset(staged)) == len(LMDBDataset(lmdb_pack))


@pytest.mark.root
def test_unstage_of_another_users_staged_pack_says_whose_folder_it_is(tmp_path: Path) -> None:
    """As a user who may not write the area (root's, mode 755), unstage said 'cannot create the lock file: Permission
    denied. Choose a destination on a writable file system': unstage has no destination, and no file system is at
    fault."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run the command as another user")
    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    (src / "a.jpg").write_bytes(_noise_jpeg(0))
    pack = packdata.convert(tmp_path / "src", tmp_path / "train.lmdb", progress=False).pack
    area = Path(tempfile.mkdtemp(prefix="packdata_area_"))  # one nobody may search, outside tmp_path's
    try:
        area.chmod(0o755)
        staged = stage(pack, to=area, progress=False).staged
        before = tree_digest(area)
        run = packdata_as_nobody("unstage", str(staged))
        assert (run.returncode, run.stdout) == (1, ""), run.stderr[-2000:]
        assert run.stderr == (
            f"Error: {area}/.{staged.name}.lock: cannot create the lock file: Permission denied. "
            f"{area} is not this user's to write (uid 0's): "
            "run it as its owner, or choose a folder this user may write\n"
        )
        assert tree_digest(area) == before
    finally:
        shutil.rmtree(area)
