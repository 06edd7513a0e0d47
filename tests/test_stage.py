"""packdata stage / unstage: copies, budgets, checksums, ENOSPC, interruption, tmpfs mounts."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from click.testing import CliRunner
from faults.hostile import rewrite_manifest
from PIL import Image

import packdata
import packdata.staging.copy as copy_module
import packdata.staging.folder as folder_module
import packdata.staging.stage as stage_module
import packdata.staging.tmpfs as tmpfs_module
from packdata.cli import main
from packdata.errors import CapacityError, ConfigError, LockedError, PackFormatError
from packdata.pack.lock import convert_lock_path, hold_lock
from packdata.pack.manifest import MANIFEST_NAME, read_manifest
from packdata.reading.datasets import LMDBDataset
from packdata.reading.streaming import TFRecordDataset
from packdata.reading.tfrecord_indexed import TFRecordIndexedDataset
from packdata.staging.marker import STAGED_FILE
from packdata.staging.stage import stage
from packdata.staging.status import stage_status
from packdata.staging.tmpfs import prepare_tmpfs
from packdata.staging.unstage import unstage
from packdata.units import format_size
from tests.conftest import assert_index_digests, flip_label, tree_digest

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="mounting a tmpfs needs root")


def _noise_jpeg(seed: int, side: int = 160) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=95)
    return out.getvalue()


@pytest.fixture
def noise_folder(tmp_path: Path) -> Path:
    """36 incompressible JPEGs (about 1.5 MB in all) in 3 classes."""
    root = tmp_path / "noise"
    for c, cls in enumerate(["a", "b", "c"]):
        (root / cls).mkdir(parents=True)
        for i in range(12):
            (root / cls / f"{i:02d}.jpg").write_bytes(_noise_jpeg(100 * c + i))
    return root


@pytest.fixture
def lmdb_pack(noise_folder: Path, tmp_path: Path) -> Path:
    return packdata.convert(noise_folder, tmp_path / "train.lmdb", shard_samples=6, progress=False).pack


@pytest.fixture
def tfrecord_pack(noise_folder: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "train"
    packdata.convert(noise_folder, dst, format="tfrecord", shard_samples=6, progress=False)
    return dst


_DIGEST_CHILD = """
import hashlib, sys
from packdata import LMDBDataset, TFRecordIndexedDataset
cls = LMDBDataset if sys.argv[2] == "lmdb" else TFRecordIndexedDataset
ds = cls(sys.argv[1], decode="bytes")
h = hashlib.sha256()
for i in range(len(ds)):
    sample, label = ds[i]
    h.update(sample + str(label).encode())
print(len(ds), h.hexdigest())
"""


def _samples_digest_in_child(pack: Path, fmt: str) -> str:
    args = [sys.executable, "-c", _DIGEST_CHILD, os.fspath(pack), fmt]
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


def _shard_bytes(pack: Path) -> int:
    return sum(shard.bytes for shard in read_manifest(pack).shards)


def _all_bytes(path: Path) -> list[tuple[bytes, int]]:
    ds = LMDBDataset(path, decode="bytes")
    return [ds[i] for i in range(len(ds))]


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


_INTERRUPTED_DELETE = """
import os, signal, sys
from packdata.staging.unstage import unstage
unlink = os.unlink
def dying(path, *args, **kwargs):  # killed as the delete comes to staged.json: no clean-up runs
    if os.path.basename(path) == "staged.json":
        os.kill(os.getpid(), signal.SIGKILL)
    unlink(path, *args, **kwargs)
os.unlink = dying
unstage(sys.argv[1])
"""


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


_INTERRUPTED_SWEEP = _INTERRUPTED_DELETE.replace(  # the same kill, in a stage
    "from packdata.staging.unstage import unstage", "from packdata.staging.stage import stage"
).replace("unstage(sys.argv[1])", "stage(sys.argv[1], to=sys.argv[2], progress=False)")


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
        r"staged\.json\): not unstage's\. A killed `packdata convert --overwrite` leaves its old pack so: the next "
        r"convert into .*nvme/train\.lmdb moves it back or removes it\. Otherwise delete it yourself$",
    ):
        unstage(converted)
    assert tree_digest(converted) == before


def test_unstage_of_an_area_keeps_an_interrupted_conversion_into_it(
    lmdb_pack: Path, noise_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed convert's ``.NAME.partial`` was taken for a killed stage's download and deleted: its work was lost."""
    from tests.test_convert import _interrupted_convert

    area = tmp_path / "nvme"
    stage(lmdb_pack, to=area, progress=False)
    _interrupted_convert(noise_folder, area / "val.lmdb", monkeypatch)
    partial = area / ".val.lmdb.partial"
    before = tree_digest(partial)
    assert unstage(area).removed == [area / "train.lmdb"]
    assert tree_digest(partial) == before
    with pytest.raises(ConfigError, match=r"is an interrupted conversion into val\.lmdb .* with --resume"):
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


@pytest.mark.root
@needs_root
def test_the_room_a_source_converted_again_frees_in_its_staged_copy_counts_for_the_new_shards(
    noise_folder: Path, tmp_path: Path, tmpfs
) -> None:
    """The old shards a source converted again no longer has were removed only after the budget was chosen: on a
    tmpfs that holds the pack once, staging it again left shards on the source the area had room for."""
    pack = tmp_path / "train"
    packdata.convert(noise_folder, pack, format="tfrecord", shard_samples=6, progress=False)
    area = tmpfs(f"{read_manifest(pack).total_bytes * 3 // 2 // 1024}k")  # room for the pack once, not twice
    assert stage(pack, to=area, progress=False).left == []
    packdata.convert(noise_folder, pack, format="tfrecord", shard_samples=12, overwrite=True, progress=False)
    again = stage(pack, to=area, progress=False)
    assert again.left == [] and len(again.copied) == 3


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
    assert result.advice == "only the shards --shards named are staged; name the others too to stage them"
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


@pytest.mark.root
@needs_root
def test_free_space_checked_before_copying(lmdb_pack: Path, tmpfs) -> None:
    area = tmpfs("800k")  # a real small disk: room for some shards, not all
    with pytest.raises(CapacityError, match=r"need .* but only .* is free.*Lower budget=SIZE"):
        stage(lmdb_pack, to=area / "stage", budget=10 << 20, progress=False)
    assert list(area.iterdir()) == []  # refused before a byte was copied: no folder, no staged.json left claiming it
    # without a budget, what fits is staged and the rest is left
    result = stage(lmdb_pack, to=area, progress=False)
    assert result.copied and result.left
    assert result.bytes_staged <= 800 << 10


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


def test_unstage_of_a_file_says_what_it_is(tmp_path: Path) -> None:
    """A regular file was called 'no such staged pack or staging area', as if it did not exist."""
    notes = tmp_path / "notes.txt"
    notes.write_text("x")
    for path, problem in ((notes, "is a regular file, not a staged pack"), (tmp_path / "gone", "no such staged pack")):
        result = CliRunner().invoke(main, ["unstage", str(path)])
        assert result.exit_code == 1
        assert (
            result.output
            == f"Error: {path}: {problem} or staging area. List staged packs with `packdata stage --status`\n"
        )
    assert notes.read_text() == "x"


@pytest.mark.root
@needs_root
def test_a_tmpfs_too_small_for_any_shard_is_refused_before_it_is_mounted(lmdb_pack: Path, tmp_path: Path) -> None:
    """--tmpfs 1K (for 1G) mounted a 4 KiB tmpfs, left it mounted, then said 'the destination disk is full'."""
    point = tmp_path / "area"
    result = CliRunner().invoke(main, ["stage", str(lmdb_pack), "--tmpfs", "1K", "--mount", str(point), "-q"])
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: {point}: a tmpfs of 1.0 KiB holds no shard of the pack (the smallest ")
    assert "Ask for a --tmpfs SIZE that holds the shards" in result.output
    assert not any(m.mountpoint == os.fspath(point) for m in packdata.host.facts.read_mounts())
    assert not point.exists()


@pytest.mark.root
@needs_root
def test_a_full_disk_is_one_line_not_a_traceback(lmdb_pack: Path, tmpfs) -> None:
    """A disk with no block left failed in the lock's record, then in staged.json, each a raw OSError."""
    area = tmpfs("1m")
    filler = area / "filler"
    with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)
    result = CliRunner().invoke(main, ["stage", str(lmdb_pack), "--to", str(area), "-q"])
    assert result.exit_code == 1, result.output
    assert result.output == (
        f"Error: {area}/train.lmdb/staged.json: no space left on {area} (tmpfs of 1.0 MiB, 0 B free) while writing "
        "staged.json of the staged pack. The source is untouched; the staged pack is left as it was, or to be "
        "completed by a rerun. Free space, stage fewer shards with --budget SIZE, or use a larger --tmpfs SIZE, "
        "then stage again\n"
    )
    assert sorted(p.name for p in area.iterdir()) == ["filler"]  # not an empty train.lmdb
    filler.unlink()
    assert stage(lmdb_pack, to=area, progress=False).copied  # the rerun the message asks for


@pytest.mark.root
@needs_root
def test_an_area_out_of_inodes_at_any_file_is_one_line_and_leaves_no_partial_index(lmdb_pack: Path, tmpfs) -> None:
    """With blocks free but no inode left (or a disk filled by another writer after the space check), the index
    copy and the manifest's write failed with a raw OSError traceback, leaving .index.partial behind."""
    for inodes in range(4, 24):  # each count runs out at a later file: the lock, index, manifest, shards
        area = tmpfs("64m", name=f"ino{inodes}", options=f"nr_inodes={inodes}")
        result = CliRunner().invoke(main, ["stage", str(lmdb_pack), "--to", str(area), "-q"])
        assert result.exit_code == 1, (inodes, result.output)
        assert result.output.startswith("Error: ") and result.output.count("\n") == 1, (inodes, result.output)
        staged = area / lmdb_pack.name
        assert not staged.exists() or not [p.name for p in staged.iterdir() if p.name.endswith(".partial")]
        _assert_full_disk_named_and_resumable(lmdb_pack, area, result.output)


def _assert_full_disk_named_and_resumable(pack: Path, area: Path, output: str) -> None:
    """A stage stopped by a full ``area``: named like a shard's copy; its staged pack (if it has a manifest)
    reads every sample of ``pack``, never a missing or partial file; once there is room a rerun completes it."""
    assert re.match(
        rf"Error: {re.escape(str(area))}/\S*: no space left on {re.escape(str(area))} \(tmpfs of 64\.0 MiB, "
        r"[0-9.]+ [KM]iB free\) while (writing \S+ of the staged pack|staging shard \d \(shard-0000\d\.lmdb, )",
        output,
    ), output
    assert "stage fewer shards with --budget SIZE" in output or "Stage fewer shards with --budget SIZE" in output
    staged = area / pack.name
    if (staged / "manifest.json").exists():
        assert _all_bytes(staged) == _all_bytes(pack), output
    subprocess.run(["mount", "-o", "remount,nr_inodes=1000", os.fspath(area)], check=True)
    stage(pack, to=area, progress=False)
    assert json.loads((staged / STAGED_FILE).read_text())["complete"]
    assert _all_bytes(staged) == _all_bytes(pack)


@pytest.mark.root
@needs_root
def test_a_read_only_area_is_named_with_the_fix_that_applies(lmdb_pack: Path, tmpfs) -> None:
    """Not 'Remove it if it is not packdata's': no lock file is there to remove."""
    area = tmpfs("1m")
    subprocess.run(["mount", "-o", "remount,ro", os.fspath(area)], check=True)
    result = CliRunner().invoke(main, ["stage", str(lmdb_pack), "--to", str(area), "-q"])
    assert result.exit_code == 1
    assert result.output == (
        f"Error: {area}/.train.lmdb.lock: cannot create the lock file: Read-only file system. "
        "Choose a destination on a writable file system\n"
    )


@pytest.mark.root
@needs_root
def test_an_area_whose_file_system_refuses_a_rename_is_one_line_and_unstage_then_stage_mends_it(
    noise_folder: Path, lmdb_pack: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A real overlay whose lower layer holds a staged copy (a container image's) refuses to rename its folders
    (EXDEV): staging it again after its source was converted again stopped with a raw OSError traceback, leaving
    .index.partial behind. Now one line names the folder and the remedy; the copy is left as it was (it reads the
    pack it was staged from), and the remedy named, unstage then stage, gives the new pack's samples."""
    lower = tmp_path / "lower"
    stage(lmdb_pack, to=lower, progress=False)
    upper, work, area = tmp_path / "upper", tmp_path / "work", tmp_path / "area"
    for folder in (upper, work, area):
        folder.mkdir()
    layers = f"lowerdir={lower},upperdir={upper},workdir={work}"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", layers, os.fspath(area)], check=True)
    request.addfinalizer(lambda: subprocess.run(["umount", "-l", os.fspath(area)], check=False))
    staged = area / lmdb_pack.name
    before = _samples_digest_in_child(staged, "lmdb")
    (noise_folder / "a" / "new.jpg").write_bytes(_noise_jpeg(999))
    packdata.convert(noise_folder, lmdb_pack, shard_samples=6, progress=False, overwrite=True)
    result = CliRunner().invoke(main, ["stage", str(lmdb_pack), "--to", str(area), "-q"])
    assert result.exit_code == 1, result.output
    assert re.fullmatch(
        rf"Error: {re.escape(str(staged / 'index'))}: cannot write the staged pack: Invalid cross-device link "
        rf"\(renaming it to {re.escape(str(staged))}/\.index\.old-\d+\)\. Its file system refuses what a stage "
        r"does \(create, rename, fsync; an overlay whose lower layer holds the copy refuses to rename its folders\): "
        r"unstage it and stage again, or stage into another --to DIR on a local file system\n",
        result.output,
    ), result.output
    assert not [p.name for p in staged.iterdir() if p.name.endswith(".partial")]
    assert _samples_digest_in_child(staged, "lmdb") == before  # as it was: the pack it was staged from
    unstage(staged)
    stage(lmdb_pack, to=area, progress=False)
    assert _all_bytes(staged) == _all_bytes(lmdb_pack) and len(_all_bytes(staged)) == 37


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


def _plant(lock: Path, kind: str, outside: Path) -> None:
    """Put a FIFO, a folder or a symlink to ``outside`` where a staged copy's ``.readers.lock`` was."""
    lock.unlink()
    if kind == "fifo":
        os.mkfifo(lock)
    elif kind == "folder":
        lock.mkdir()
    else:
        lock.symlink_to(outside)


@pytest.mark.parametrize("kind", ["fifo", "folder", "symlink"])
def test_unstage_keeps_a_copy_whose_readers_lock_is_not_a_file_and_says_why(
    lmdb_pack: Path, tfrecord_pack: Path, tmp_path: Path, kind: str
) -> None:
    """Readers never lock such a file, so nothing tells that the copy is unread: it stays, the others in the area go."""
    area = tmp_path / "nvme"
    copy = stage(lmdb_pack, to=area, progress=False).staged
    other = stage(tfrecord_pack, to=area, progress=False).staged
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"keep")
    _plant(copy / ".readers.lock", kind, outside)
    what = {"fifo": "is a FIFO", "folder": "is a folder", "symlink": "is a symlink"}[kind]
    message = f"{copy / '.readers.lock'}: {what}, not the readers' lock a stage makes: whether the copy is read"
    with pytest.raises(ConfigError, match=re.escape(message)):
        unstage(area)
    assert not other.exists() and _all_bytes(copy) == _all_bytes(lmdb_pack) and outside.read_bytes() == b"keep"
    out = CliRunner().invoke(main, ["unstage", os.fspath(copy)])
    assert out.exit_code == 1 and message in out.output and out.output.endswith("unstage the copy with --force\n")
    assert copy.is_dir()
    assert unstage(copy, force=True).removed == [copy] and not copy.exists() and outside.read_bytes() == b"keep"


@pytest.mark.timeout(60)  # opening a FIFO for writing blocks until a reader comes: a hang is the failure
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_staging_again_over_a_readers_lock_that_is_a_fifo_or_device_never_opens_it(
    lmdb_pack: Path, tmp_path: Path, kind: str
) -> None:
    from faults.hostile import opens_of

    if kind == "device" and os.geteuid() != 0:
        pytest.skip("making a device node needs root")
    copy = stage(lmdb_pack, to=tmp_path / "nvme", progress=False).staged
    lock = copy / ".readers.lock"
    lock.unlink()
    if kind == "fifo":
        os.mkfifo(lock)
    else:
        os.mknod(lock, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers: harmless if opened
    with opens_of(lock) as opens:
        again = stage(lmdb_pack, to=tmp_path / "nvme", progress=False)
        assert opens() == 0  # opening a device for writing can act on it
    assert again.copied == [] and len(again.reused) == 6 and _all_bytes(copy) == _all_bytes(lmdb_pack)
    mode = os.lstat(lock).st_mode
    assert stat.S_ISFIFO(mode) if kind == "fifo" else stat.S_ISCHR(mode)  # left as it was, never replaced


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


def test_a_tmpfs_is_never_mounted_over_a_folder_that_holds_files(
    lmdb_pack: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """``--mount DIR`` on a folder of the user's, or one holding the pack being staged: mounting would hide it."""
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.tex").write_text("three years of work")
    for point in (notes, lmdb_pack.parent):
        request.addfinalizer(lambda p=point: subprocess.run(["umount", "-l", os.fspath(p)], capture_output=True))
        with pytest.raises(ConfigError, match=r"is not an empty folder: a tmpfs mounted here would hide what it holds"):
            prepare_tmpfs(16 << 20, mount=point)
        assert not os.path.ismount(point)
    out = CliRunner().invoke(main, ["stage", "--tmpfs", "16M", "--mount", os.fspath(notes)])
    assert out.exit_code == 1 and out.output == (
        f"Error: {notes}: is not an empty folder: a tmpfs mounted here would hide what it holds. "
        "Choose a new or empty --mount DIR (the default is /mnt/packdata)\n"
    )
    assert not os.path.ismount(notes) and (notes / "thesis.tex").read_text() == "three years of work"
    assert _all_bytes(lmdb_pack)  # the pack is still there to read


def test_without_root_one_line_explains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError, match=r"needs root. Run `sudo packdata stage --tmpfs .*/dev/shm"):
        prepare_tmpfs(1 << 20, mount=tmp_path / "ram")
    out = CliRunner().invoke(main, ["stage", "--tmpfs", "1M", "--mount", os.fspath(tmp_path / "ram")])
    assert out.exit_code == 1
    assert out.output.startswith("Error: ") and out.output.count("\n") == 1 and "Traceback" not in out.output


@pytest.mark.parametrize("size", [0, -1, 1 << 64, 1 << 70, True, 1.5])
def test_a_tmpfs_size_that_means_no_limit_is_refused(tmp_path: Path, size: Any) -> None:
    """prepare_tmpfs passed any size to mount: the kernel reads size=0, and 2**70 (wrapped past 2**64 to 0),
    as a tmpfs with no limit at all, even with force=True past the memory checks."""
    with pytest.raises(ConfigError, match=r"size should be a byte count from 1 to 2\*\*63 - 1"):
        prepare_tmpfs(size, mount=tmp_path / "ram", force=True)
    assert not (tmp_path / "ram").exists()


def test_unsafe_tmpfs_size_refused_unless_forced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from packdata.host import facts as system

    proc = tmp_path / "fake" / "proc"
    proc.mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal: 8388608 kB\nMemAvailable: 2097152 kB\nSwapTotal: 0 kB\nSwapFree: 0 kB\n")
    monkeypatch.setattr(tmpfs_module, "gather_facts", lambda **kw: system.gather_facts(tmp_path / "fake", **kw))
    with pytest.raises(CapacityError, match=r"a 4.0 GiB tmpfs does not fit in memory.*force=True"):
        prepare_tmpfs(4 << 30, mount=tmp_path / "ram")
    assert not (tmp_path / "ram").exists()


@pytest.mark.root
@needs_root
@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_tmpfs_mount_stage_and_unmount(
    fmt: str, lmdb_pack: Path, tfrecord_pack: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    point = tmp_path / "area"
    request.addfinalizer(lambda: subprocess.run(["umount", "-l", os.fspath(point)], check=False))
    pack = lmdb_pack if fmt == "lmdb" else tfrecord_pack
    result = stage(pack, tmpfs=32 << 20, mount=point, progress=False)
    assert result.tmpfs is not None and result.tmpfs.action == "mounted" and result.tmpfs.mounted_by_packdata
    assert {w.code for w in result.warnings} >= {"tmpfs-volatile"}
    # read in a child process: this one must not hold files open on the tmpfs it unmounts below
    assert _samples_digest_in_child(result.staged, fmt) == _samples_digest_in_child(pack, fmt)
    again = stage(pack, tmpfs=32 << 20, mount=point, progress=False)
    assert again.tmpfs is not None and again.tmpfs.action == "reused" and again.copied == []
    resized = prepare_tmpfs(48 << 20, mount=point, resize=True)
    assert resized.action == "resized" and resized.size == 48 << 20
    # `packdata stage PACK --mount DIR` uses the area without --tmpfs
    assert stage(pack, mount=point, progress=False).copied == []
    with pytest.raises(ConfigError, match=r"a tmpfs of 48.0 MiB is mounted here, not the 64.0 MiB asked for"):
        stage(pack, tmpfs=64 << 20, mount=point, progress=False)  # once silently "reused" at 48 MiB
    out = CliRunner().invoke(main, ["stage", "--tmpfs", "64M", "--mount", os.fspath(point)])
    assert out.exit_code == 1 and ". Pass --resize to remount it at 64.0 MiB after the memory checks" in out.output
    done = unstage(point, unmount=True)
    assert done.unmounted == point
    assert not any(m.mountpoint == os.fspath(point) for m in packdata.host.facts.read_mounts())
    assert not point.exists()  # the empty mount point goes with the mount


@pytest.mark.root
@needs_root
def test_unmount_keeps_a_mount_point_folder_the_user_made(
    lmdb_pack: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """unstage --unmount removed the empty mount point even when it was the user's folder, not one packdata made."""
    point = tmp_path / "mine"
    point.mkdir()
    request.addfinalizer(lambda: subprocess.run(["umount", "-l", os.fspath(point)], check=False))
    result = stage(lmdb_pack, tmpfs=32 << 20, mount=point, progress=False)
    assert result.tmpfs is not None and result.tmpfs.action == "mounted"
    out = CliRunner().invoke(main, ["unstage", os.fspath(point), "--unmount"])
    assert out.exit_code == 0, out.output
    assert f"unmounted {point}" in out.output
    assert not any(m.mountpoint == os.fspath(point) for m in packdata.host.facts.read_mounts())
    assert point.is_dir() and not any(point.iterdir())  # the user's folder stays, as it was


@pytest.mark.root
@needs_root
def test_unmount_removes_the_folders_above_the_mount_point_that_stage_made(
    lmdb_pack: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """prepare_tmpfs made the folders above the mount point and nothing removed them: unstage left new/deeper."""
    bare, kept = tmp_path / "new" / "deeper" / "area", tmp_path / "used" / "deeper" / "area"
    for point in (bare, kept):
        request.addfinalizer(lambda p=point: subprocess.run(["umount", "-l", os.fspath(p)], check=False))
        out = CliRunner().invoke(main, ["stage", os.fspath(lmdb_pack), "--tmpfs", "32M", "--mount", os.fspath(point)])
        assert out.exit_code == 0, out.output
    (tmp_path / "used" / "notes.txt").write_text("the user's")  # put beside the folders packdata made
    for point in (bare, kept):
        out = CliRunner().invoke(main, ["unstage", os.fspath(point), "--unmount"])
        assert out.exit_code == 0 and f"unmounted {point}" in out.output, out.output
    assert not any(m.mountpoint.startswith(os.fspath(tmp_path)) for m in packdata.host.facts.read_mounts())
    assert not (tmp_path / "new").exists()  # the mount point and both folders above it
    assert sorted(p.name for p in (tmp_path / "used").iterdir()) == ["notes.txt"]  # deeper went, used holds a file


@pytest.mark.root
@needs_root
def test_a_refused_or_failed_tmpfs_mount_leaves_no_folder_it_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused size or a failed mount left the mount point's parents (and a failed mount the mount point).

    The mount fails for real: a `mount` first on PATH that exits 32 as mount(8) does when the kernel
    refuses (a size the kernel refuses is now refused before the mount)."""
    point = tmp_path / "work" / "new" / "deeper" / "area"
    (tmp_path / "work").mkdir()
    too_big = 64 * psutil.virtual_memory().total
    with pytest.raises(CapacityError, match="does not fit in memory"):
        prepare_tmpfs(too_big, mount=point)
    assert list((tmp_path / "work").iterdir()) == []
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "mount").write_text("#!/bin/sh\necho 'mount: permission denied.' >&2\nexit 32\n")
    (tools / "mount").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(
        ConfigError, match=r"`mount -t tmpfs -o size=4096,mode=1777 .*` failed: mount: permission denied"
    ):
        prepare_tmpfs(4096, mount=point, force=True)
    assert list((tmp_path / "work").iterdir()) == []
    (tmp_path / "work" / "new").mkdir()  # the user's: it stays
    with pytest.raises(ConfigError, match="failed"):
        prepare_tmpfs(4096, mount=point, force=True)
    assert [p.name for p in (tmp_path / "work").iterdir()] == ["new"] and not any((tmp_path / "work" / "new").iterdir())


@needs_root
def test_made_folders_removes_only_the_mount_points_nearest_parents_it_lists(tmp_path: Path) -> None:
    """The marker is read from a 1777 tmpfs: a folder it names that is not a nearest parent is never removed."""
    point = tmp_path / "a" / "b" / "area"
    point.mkdir(parents=True)
    listed = [point.parent, tmp_path, Path("/etc"), point / "x"]  # b, then a skipped: the chain stops at b
    (point / tmpfs_module.MADE_FILE).write_text(json.dumps({"above": [os.fspath(p) for p in listed]}))
    assert tmpfs_module.made_folders(point) == [point, point.parent]
    (point / tmpfs_module.MADE_FILE).write_text("not json")
    assert tmpfs_module.made_folders(point) == [point]
    os.chown(point / tmpfs_module.MADE_FILE, 65534, 65534)  # not root's: another user's, so nothing
    assert tmpfs_module.made_folders(point) == []


@pytest.mark.root
@needs_root
def test_enospc_on_tiny_tmpfs(lmdb_pack: Path, tmpfs, monkeypatch: pytest.MonkeyPatch) -> None:
    area = tmpfs("1M")
    source = tree_digest(lmdb_pack)
    assert read_manifest(lmdb_pack).total_bytes > 1 << 20
    # the free-space check would stop this early; pretend it saw room, as when something else fills the disk
    monkeypatch.setattr(stage_module, "_free_bytes", lambda a: 1 << 30)
    with pytest.raises(CapacityError) as info:
        stage(lmdb_pack, to=area, workers=2, progress=False)
    message = str(info.value)
    assert re.search(
        rf"no space left on {re.escape(str(area))} \(tmpfs of 1\.0 MiB, [0-9.]+ [KM]?i?B free\) "
        r"while staging shard \d \(shard-0000\d\.lmdb, [0-9.]+ KiB\)",
        message,
    ), message
    assert "partial copy was removed" in message
    staged = area / "train.lmdb"
    assert not [p for p in staged.iterdir() if p.name.endswith(".partial")]
    manifest = read_manifest(staged)
    # the shards copied and verified before the disk filled are read from the area, not left unused in it
    copies = sorted(p.name for p in staged.glob("shard-*"))
    assert copies and copies == sorted(s.file for s in manifest.shards if not Path(s.file).is_absolute())
    assert json.loads((staged / STAGED_FILE).read_text())["staged"] == copies
    for shard in manifest.shards:
        if not Path(shard.file).is_absolute():
            assert packdata.pack.files.file_sha256(staged / shard.file / "data.mdb") == shard.sha256
    assert tree_digest(lmdb_pack) == source
    assert _all_bytes(staged) == _all_bytes(lmdb_pack)


@pytest.mark.root
@needs_root
def test_tiny_tmpfs_default_budget_stages_what_fits(lmdb_pack: Path, tmpfs) -> None:
    area = tmpfs("1M")
    result = stage(lmdb_pack, to=area, progress=False)
    assert result.copied and result.left
    assert {w.code for w in result.warnings} >= {"tmpfs-volatile"}
    assert _all_bytes(result.staged) == _all_bytes(lmdb_pack)


_PREPARE_AT_ONCE = """
import os, sys, time
from packdata.staging.tmpfs import prepare_tmpfs
while not os.path.exists(sys.argv[2]):  # every child starts at the same moment
    time.sleep(0.001)
print(prepare_tmpfs(16 << 20, mount=sys.argv[1]).action)
"""


@pytest.mark.root
@needs_root
def test_stages_preparing_one_tmpfs_at_once_mount_it_once(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Two jobs on a node each asking for the area: one mounts it, the others reuse it (never a tmpfs on a tmpfs)."""
    point, go = tmp_path / "area", tmp_path / "go"
    request.addfinalizer(lambda: [subprocess.run(["umount", os.fspath(point)], capture_output=True) for _ in range(6)])
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _PREPARE_AT_ONCE, os.fspath(point), os.fspath(go)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(6)
    ]
    time.sleep(2)  # every child is waiting for the start
    go.touch()
    actions = sorted(child.communicate(timeout=60)[0].strip() for child in children)
    assert actions == ["mounted"] + ["reused"] * 5
    with open("/proc/mounts") as mounts:
        assert sum(line.split()[1] == os.fspath(point) for line in mounts) == 1


@pytest.mark.root
@needs_root
def test_cli_prepare_area_then_stage_into_it(lmdb_pack: Path, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    point = tmp_path / "area"
    request.addfinalizer(lambda: subprocess.run(["umount", "-l", os.fspath(point)], check=False))
    runner = CliRunner()
    out = runner.invoke(main, ["stage", "--tmpfs", "16M", "--mount", os.fspath(point)])
    assert out.exit_code == 0, out.output
    assert f"tmpfs mounted at {point}" in out.output and f"packdata stage PACK --mount {point}" in out.output
    out = runner.invoke(main, ["stage", "--tmpfs", "16M", "--mount", os.fspath(point)])
    assert out.exit_code == 0 and "tmpfs reused" in out.output
    out = runner.invoke(main, ["stage", os.fspath(lmdb_pack), "--mount", os.fspath(point), "-q"])
    assert out.exit_code == 0 and "copied 6 shards" in out.output, out.output
    out = runner.invoke(main, ["stage", "--status", os.fspath(point)])
    assert out.exit_code == 0 and "mounted by packdata" in out.output and "6 shards staged" in out.output
    assert _samples_digest_in_child(point / "train.lmdb", "lmdb") == _samples_digest_in_child(lmdb_pack, "lmdb")
    out = runner.invoke(main, ["unstage", os.fspath(point), "--unmount"])
    assert out.exit_code == 0 and f"unmounted {point}" in out.output, out.output


@pytest.mark.root
@needs_root
def test_staging_into_ram_checks_memory(
    lmdb_pack: Path, tmpfs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from packdata.host import facts as system

    area = tmpfs("16M")
    fake = tmp_path / "fake"
    (fake / "proc").mkdir(parents=True)
    # 4 GiB + 512 KiB available, and the default reserve of 4 GiB: 512 KiB may go to tmpfs, the pack needs more
    (fake / "proc" / "meminfo").write_text(
        "MemTotal: 16777216 kB\nMemAvailable: 4194816 kB\nSwapTotal: 1048576 kB\nSwapFree: 1048576 kB\n"
    )
    monkeypatch.setattr(stage_module, "gather_facts", lambda **kw: system.gather_facts(fake, **kw))
    # the tmpfs is there already: what does not fit is the shards to add, not 'a 1.2 MiB tmpfs' to ask for
    with pytest.raises(
        CapacityError,
        match=r": [0-9.]+ MiB more in this tmpfs does not fit in memory: .* leaving 512\.0 KiB; stage at most "
        r"512\.0 KiB into it, .*force=True",
    ):
        stage(lmdb_pack, to=area, progress=False)
    assert not list((area / "train.lmdb").glob("shard-*"))
    result = stage(lmdb_pack, to=area, force=True, progress=False)
    assert len(result.copied) == 6
    assert {"tmpfs-too-large", "swap-on-tmpfs", "tmpfs-volatile"} <= {w.code for w in result.warnings}


def test_a_stage_that_stages_nothing_says_why_and_fails(lmdb_pack: Path, tmp_path: Path) -> None:
    smallest = min(
        sum(f.stat().st_size for f in (lmdb_pack / s.file).iterdir()) for s in read_manifest(lmdb_pack).shards
    )
    out = CliRunner().invoke(
        main, ["stage", os.fspath(lmdb_pack), "--to", os.fspath(tmp_path / "nvme"), "--budget", f"{smallest - 1}B"]
    )
    assert out.exit_code == 1
    assert "copied 0 shards" in out.output and "LEFT 6 shards" in out.output
    assert "Error: nothing was staged: the budget" in out.output and "smaller --shard-size" in out.output
    one = CliRunner().invoke(
        main, ["stage", os.fspath(lmdb_pack), "--to", os.fspath(tmp_path / "nvme2"), "--budget", f"{smallest}B", "-q"]
    )
    assert one.exit_code == 0 and "copied 1 shard (" in one.output and "why: the budget" in one.output


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


_HOLDER = """
import sys
from packdata.pack.lock import hold_lock
with hold_lock(sys.argv[1], what="another stage", target=sys.argv[1]):
    print("held", flush=True)
    sys.stdin.readline()
"""


def test_a_stage_refused_by_the_lock_leaves_nothing_it_created(lmdb_pack: Path, tmp_path: Path) -> None:
    """Another process holds .NAME.lock past wait_seconds: LockedError, and no empty AREA/NAME is left; once it is
    free, it stages."""
    area = tmp_path / "area"
    area.mkdir()
    lock = area / f".{lmdb_pack.name}.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        held = rf"pid {holder.pid} on host .*\(another stage.*{re.escape(str(lock))}\), still after waiting 0.2 s"
        with pytest.raises(LockedError, match=held):
            stage(lmdb_pack, to=area, progress=False, wait_seconds=0.2)
        assert sorted(p.name for p in area.iterdir()) == [lock.name]  # the holder's lock file only
    finally:
        holder.communicate("\n", timeout=30)
    assert stage(lmdb_pack, to=area, progress=False).copied
    assert _all_bytes(area / lmdb_pack.name) == _all_bytes(lmdb_pack)


_RANK = """
import json, sys
import packdata
print("ready", flush=True)
result = packdata.stage(sys.argv[1], to=sys.argv[2], progress=False)
print(json.dumps({"copied": result.copied, "reused": result.reused}))
"""


def test_ranks_staging_one_pack_at_once_wait_and_share_one_copy(lmdb_pack: Path, tmp_path: Path) -> None:
    """Every rank of a node stages the same pack into the same area: one copies, the others wait and reuse it.

    They failed at once with LockedError while another held the lock, so a job needed a local-rank-0 guard.
    Here the ranks start while a stage holds the lock, so they all meet it.
    """
    area = tmp_path / "nvme"
    area.mkdir()
    lock = convert_lock_path(area / lmdb_pack.name)
    with hold_lock(lock, what="packdata stage", target=area / lmdb_pack.name):
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", _RANK, str(lmdb_pack), str(area)], stdout=subprocess.PIPE, text=True
            )
            for _ in range(3)
        ]
        for rank in ranks:
            assert rank.stdout is not None and rank.stdout.readline().strip() == "ready"
        time.sleep(1)  # not a timing check: lets each rank reach the lock while it is held
    outputs = [rank.communicate(timeout=120)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0, 0], outputs
    results = sorted((json.loads(out) for out in outputs), key=lambda r: -len(r["copied"]))
    shards = [Path(s.file).name for s in read_manifest(lmdb_pack).shards]
    assert results[0] == {"copied": shards, "reused": []}  # copied once, by one rank
    assert results[1:] == [{"copied": [], "reused": shards}] * 2
    staged = area / lmdb_pack.name
    assert packdata.verify_pack(staged, progress=False).records == 36
    assert _all_bytes(staged) == _all_bytes(lmdb_pack)


_STAGE_CLI = """
import sys
from packdata.cli import main
print("ready", flush=True)
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
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        time.sleep(1)  # not a timing check: lets the stage read the manifest and wait for the lock
        packdata.convert(noise_folder, lmdb_pack, shard_samples=5, overwrite=True, progress=False)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 1, err
    assert err.startswith(f"Error: {lmdb_pack}: changed while it was staged: its manifest is no longer the one"), err
    assert err.rstrip().endswith("It was converted again meanwhile: stage it again once that conversion is done")
    assert "damaged" not in err and len(err.splitlines()) == 1
    assert stage(lmdb_pack, to=area, progress=False).copied  # once it is done, it stages
    assert packdata.verify_pack(area / lmdb_pack.name, progress=False).records == 36


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
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(area / ".val.lmdb.lock")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        result = unstage(area)
        assert result.removed == [area / lmdb_pack.name] and not (area / lmdb_pack.name).exists()
        assert _all_bytes(download) == before  # the live stage's download, untouched
    finally:
        holder.communicate("\n", timeout=30)
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


@pytest.mark.parametrize("text", ['{"deploy": "staged"}', "{}", "not json", '{"origin": "/x"}'])
def test_a_folder_whose_staged_json_is_no_marker_is_neither_unstaged_nor_staged_into(
    lmdb_pack: Path, tmp_path: Path, text: str
) -> None:
    """A project's own staged.json made its folder a staged pack: unstage deleted it (or, in an area, every such
    folder), and stage overwrote its manifest.json; only a marker packdata writes (every field) counts."""
    projects = tmp_path / "projects"
    app = projects / "train.lmdb"
    app.mkdir(parents=True)
    (app / "staged.json").write_text(text)
    (app / "manifest.json").write_text("mine")
    for path in (app, projects):
        result = CliRunner().invoke(main, ["unstage", str(path)])
        assert result.exit_code == 1 and "is not a staged pack and holds none" in result.output
    result = CliRunner().invoke(main, ["stage", str(lmdb_pack), "--to", str(projects), "-q"])
    assert result.output == (
        f"Error: {app}: exists and is not a staged pack. Choose another --to DIR or --name NAME; "
        "packdata only writes into packs it staged\n"
    )
    assert sorted(p.name for p in app.iterdir()) == ["manifest.json", "staged.json"]
    assert (app / "staged.json").read_text() == text and (app / "manifest.json").read_text() == "mine"


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_staged_json_that_is_a_fifo_or_symlink_is_no_marker_and_never_read(
    lmdb_pack: Path, tmp_path: Path, kind: str
) -> None:
    """A FIFO as staged.json hung `stage --status`, doctor and stage in its read for good; a symlink was followed
    to another pack's marker. Each is one line or a report without the folder, in a child killed if it hangs."""
    area = tmp_path / "area"
    stage(lmdb_pack, to=area, progress=False)
    odd = area / "odd"
    odd.mkdir()
    if kind == "fifo":
        os.mkfifo(odd / "staged.json")
    else:
        (odd / "staged.json").symlink_to(area / lmdb_pack.name / "staged.json")
    cli = [sys.executable, "-m", "packdata.cli"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), *sys.path])}
    run = lambda *args: subprocess.run([*cli, *args], capture_output=True, text=True, timeout=60, env=env)  # noqa: E731
    status = run("stage", "--status", str(area), "--json")
    assert status.returncode == 0, status.stderr
    assert [p["path"] for p in json.loads(status.stdout)["areas"][0]["packs"]] == [str(area / lmdb_pack.name)]
    refused = run("stage", str(lmdb_pack), "--to", str(area), "--name", "odd", "-q")
    assert refused.returncode == 1 and refused.stderr.startswith(f"Error: {odd}: exists and is not a staged pack")
    unstaged = run("unstage", str(odd))
    assert unstaged.returncode == 1 and "is not a staged pack" in unstaged.stderr
    assert run("doctor", str(area / lmdb_pack.name), "--json").returncode == 0
    assert sorted(p.name for p in odd.iterdir()) == ["staged.json"]


def test_a_stage_caught_or_killed_writing_its_first_marker_is_a_stage_not_a_foreign_folder(
    lmdb_pack: Path, tmp_path: Path
) -> None:
    """Between .stage.lock and staged.json a stage holds .staged.json.partial: a second stage (another rank) then
    said 'exists and is not a staged pack' instead of naming the stage at work, and once one was killed there,
    stage and unstage refused the folder for good."""
    area = tmp_path / "nvme"
    dest = area / lmdb_pack.name
    area.mkdir()
    with folder_module.locked(dest):  # a live stage, as it writes its first marker
        (dest / ".staged.json.partial").write_text("{")
        with pytest.raises(LockedError, match=rf"^{re.escape(str(dest))}: pid {os.getpid()} on host .* is writing it"):
            stage(lmdb_pack, to=area, progress=False, wait_seconds=0)
    (dest / ".stage.lock").touch()  # killed there: its lock and .staged.json.partial stay
    assert sorted(p.name for p in dest.iterdir()) == [".stage.lock", ".staged.json.partial"]
    assert unstage(area).removed == [dest] and not dest.exists()
    dest.mkdir()
    (dest / ".stage.lock").touch()
    (dest / ".staged.json.partial").write_text("{")
    assert stage(lmdb_pack, to=area, progress=False).copied
    assert ".staged.json.partial" not in [p.name for p in dest.iterdir()]


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


@pytest.mark.root
@needs_root
def test_a_destination_another_user_owns_is_refused_even_with_a_marker(lmdb_pack: Path, tmp_path: Path) -> None:
    """In a tmpfs area (mode 1777) any user could make AREA/NAME with a copied staged.json, and root's stage wrote
    into it: a folder its owner may rename or swap for links at any moment while root writes there."""
    area = tmp_path / "area"
    area.mkdir(mode=0o1777)
    area.chmod(0o1777)
    dest = area / lmdb_pack.name
    stage(lmdb_pack, to=tmp_path / "real", progress=False)
    dest.mkdir()
    shutil.copy(tmp_path / "real" / lmdb_pack.name / "staged.json", dest / "staged.json")
    os.chown(dest / "staged.json", 65534, 65534)
    os.chown(dest, 65534, 65534)
    result = CliRunner().invoke(main, ["stage", str(lmdb_pack), "--to", str(area), "-q"])
    assert result.output == (
        f"Error: {dest}: belongs to another user (uid 65534), who could swap its files for links while packdata "
        "writes there. Choose another --to DIR or --name NAME, or stage it as that user\n"
    )
    assert sorted(p.name for p in dest.iterdir()) == ["staged.json"] and sorted(p.name for p in area.iterdir()) == [
        lmdb_pack.name
    ]
    os.chown(dest, 0, 0)
    os.chown(dest / "staged.json", 0, 0)  # the user's own folder and marker: staged into
    assert stage(lmdb_pack, to=area, progress=False).copied


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


@pytest.mark.root
@needs_root
@pytest.mark.parametrize("planted", ["staged.json", ".stage.lock"])
def test_a_marker_another_user_put_into_a_shared_area_never_makes_unstage_delete_the_area(
    lmdb_pack: Path, tmp_path: Path, planted: str
) -> None:
    """In a shared area (mode 1777, like /dev/shm), a staged.json (or a lone .stage.lock) another user wrote made
    the area itself read as a staged pack: `unstage AREA` deleted the whole folder, the users' files in it too.
    A marker or lock counts only when the folder's owner wrote it."""
    area = tmp_path / "shm"
    area.mkdir()
    area.chmod(0o1777)
    if planted == "staged.json":
        stage(lmdb_pack, to=area, progress=False)
        (area / "notes.txt").write_text("mine")
        shutil.copy(area / lmdb_pack.name / STAGED_FILE, area / STAGED_FILE)
    else:
        (area / planted).write_text("")
    os.chown(area / planted, 65534, 65534)  # as `nobody` writes it
    assert area not in [p.path for p in stage_status(area).areas[0].packs]
    if planted == "staged.json":
        assert unstage(area).removed == [area / lmdb_pack.name]
        assert sorted(p.name for p in area.iterdir()) == ["notes.txt", STAGED_FILE]
    else:
        with pytest.raises(ConfigError, match="is not a staged pack and holds none"):
            unstage(area)
        assert [p.name for p in area.iterdir()] == [planted]


def test_status_of_the_area_given_by_mount(lmdb_pack: Path, tmp_path: Path) -> None:
    """`stage --status --mount DIR` (the option that names the area everywhere else) was refused as a usage error."""
    area = tmp_path / "area"
    stage(lmdb_pack, to=area, progress=False)
    out = CliRunner().invoke(main, ["stage", "--status", "--mount", str(area)])
    assert out.exit_code == 0, out.output
    assert f"{lmdb_pack.name}: 6 shards staged" in out.output and str(area) in out.output
    both = CliRunner().invoke(main, ["stage", "--status", "--mount", str(area), str(area)])
    assert both.exit_code == 2 and "--status takes only an optional area (PACK or --mount DIR)" in both.output


def test_a_failed_mount_command_is_named_in_one_line(tmp_path: Path) -> None:
    """mount's stderr of several lines was put in the error as it was: a message of several lines, where
    packdata's errors are one ('... failed: mount: /x: wrong fs type\\n       dmesg(1) may have ...')."""
    from packdata.staging.tmpfs import run_mount

    script = ["sh", "-c", "echo 'mount: /x: wrong fs type.' >&2; echo '       dmesg(1) may have more.' >&2; exit 32"]
    with pytest.raises(ConfigError) as raised:
        run_mount(script, tmp_path, "Check the mount")
    assert "\n" not in str(raised.value)
    assert str(raised.value).endswith("failed: mount: /x: wrong fs type.; dmesg(1) may have more. Check the mount")


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
