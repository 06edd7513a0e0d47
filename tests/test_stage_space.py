"""packdata stage into tmpfs and small areas: mounts, free space, full disks, read-only and failing file systems."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from click.testing import CliRunner
from conftest import _noise_jpeg, tree_digest
from stage_helpers import _all_bytes, needs_root

import packdata
import packdata.staging.stage as stage_module
import packdata.staging.tmpfs as tmpfs_module
from packdata.cli import main
from packdata.errors import CapacityError, ConfigError
from packdata.pack.manifest import read_manifest
from packdata.staging.marker import STAGED_FILE
from packdata.staging.stage import stage
from packdata.staging.tmpfs import prepare_tmpfs
from packdata.staging.unstage import unstage

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


@pytest.mark.root
@needs_root
def test_the_advice_for_shards_left_fits_the_area_staged_into(lmdb_pack: Path, tmpfs) -> None:
    """A stage --to DIR that left shards for want of room advised '--tmpfs SIZE --resize', which --to refuses."""
    size = r"[0-9.]+ (?:B|KiB|MiB)"
    tail = (
        ", or convert with a smaller shard size (shards are the unit stage copies; `packdata convert --shard-size`)\n"
    )
    folder = tmpfs("800k", name="folder")  # given as --to DIR: a folder stage cannot resize
    out = CliRunner().invoke(main, ["stage", str(lmdb_pack), "--to", str(folder), "-q"])
    assert out.exit_code == 0, out.output
    why = re.escape("  why: the budget (") + size + re.escape(f": what {folder} has free) holds no more shards: ")
    more = re.escape(f". Stage more with more free space at {folder} (or --to DIR on a bigger disk)")
    assert re.search(why + "the smallest left is " + size + more + re.escape(tail), out.output), out.output
    area = tmpfs("800k", name="area")  # a tmpfs area (--mount), as --tmpfs SIZE mounts: --resize grows it
    out = CliRunner().invoke(main, ["stage", str(lmdb_pack), "--mount", str(area), "-q"])
    assert out.exit_code == 0, out.output
    why = re.escape("  why: the budget (") + size + re.escape(f": what {area} has free) holds no more shards: ")
    more = re.escape(". Stage more with a bigger tmpfs (--tmpfs SIZE with --resize)")
    assert re.search(why + "the smallest left is " + size + more + re.escape(tail), out.output), out.output


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
        r"[0-9.]+ [KM]iB free(, no inodes free)?\) while "
        r"(writing \S+ of the staged pack|staging shard \d \(shard-0000\d\.lmdb, )",
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


@pytest.mark.root
@pytest.mark.parametrize(("asked", "said"), [("30GB", "30GB"), ("1G", "1G"), ("1536MiB", "1536M")])
def test_without_root_the_command_to_run_as_root_can_be_pasted(tmp_path: Path, asked: str, said: str) -> None:
    """The hint said 'Run `sudo packdata stage --tmpfs 27.9 GiB --mount M`': pasted, '--tmpfs 27.9' and a stray
    argument 'GiB' (refused), and 27.9 GiB is not the 30GB asked for. Run as the user nobody (setpriv)."""
    import shutil

    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run the command as another user")
    area = Path("/tmp") / f"packdata-not-root-{os.getpid()}"  # a folder nobody may create; never made here
    as_nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", sys.executable, "-m"]
    run = subprocess.run(
        [*as_nobody, "packdata.cli", "stage", "--tmpfs", asked, "--mount", str(area), "--force"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        timeout=120,
    )
    assert (run.returncode, run.stdout) == (1, ""), run.stderr[-2000:]
    assert run.stderr == (
        f"Error: {area}: mounting a tmpfs needs root. Run `sudo packdata stage --tmpfs {said} --mount {area}` once, "
        "or stage into RAM without mounting: `packdata stage PACK --to /dev/shm`\n"
    )
    assert not area.exists()


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


@pytest.mark.root
@needs_root
def test_a_staging_area_a_full_disk_refuses_names_the_disk(lmdb_pack: Path, tmpfs) -> None:
    """--to DIR whose folder a full disk refused said 'DIR: the destination disk is full (No space left on
    device). Free space and rerun', naming no disk; it is named as a full stage is, with the stage's hint."""
    disk = tmpfs("4m", name="full", options="nr_inodes=1")
    area = disk / "area"
    result = CliRunner().invoke(main, ["stage", str(lmdb_pack), "--to", str(area), "-q"])
    pattern = (
        rf"Error: {re.escape(str(area))}: no space left on {re.escape(str(disk))} \(tmpfs of 4\.0 MiB, 4\.0 MiB "
        r"free, no inodes free\) while writing area \(the staging area's folder\)\. The source is untouched; the "
        r"staged pack is left as it was, or to be completed by a rerun\. Free space, stage fewer shards with "
        r"--budget SIZE, or use a larger --tmpfs SIZE, then stage again\n"
    )
    assert result.exit_code == 1 and re.fullmatch(pattern, result.output), result.output
    assert os.listdir(disk) == []
