"""packdata stage: the staged.json marker, the readers' and stages' locks, and other users' folders."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import lock_held_elsewhere
from stage_helpers import _all_bytes, needs_root

import packdata
import packdata.staging.folder as folder_module
from packdata.cli import main
from packdata.errors import ConfigError, LockedError
from packdata.pack.lock import convert_lock_path, hold_lock
from packdata.pack.manifest import read_manifest
from packdata.staging.marker import STAGED_FILE
from packdata.staging.stage import stage
from packdata.staging.status import stage_status
from packdata.staging.unstage import unstage


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


def test_a_stage_refused_by_the_lock_leaves_nothing_it_created(lmdb_pack: Path, tmp_path: Path) -> None:
    """Another process holds .NAME.lock past wait_seconds: LockedError, and no empty AREA/NAME is left; once it is
    free, it stages."""
    area = tmp_path / "area"
    area.mkdir()
    lock = area / f".{lmdb_pack.name}.lock"
    with lock_held_elsewhere(lock) as holder:
        held = rf"pid {holder.pid} on host .*\(another stage.*{re.escape(str(lock))}\), still after waiting 0.2 s"
        with pytest.raises(LockedError, match=held):
            stage(lmdb_pack, to=area, progress=False, wait_seconds=0.2)
        assert sorted(p.name for p in area.iterdir()) == [lock.name]  # the holder's lock file only
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


def test_a_staged_json_over_the_marker_bound_is_no_marker_and_never_read(tmp_path: Path) -> None:
    """A planted staged.json of 257 MiB (sparse: no disk used) was read whole, twice over (its bytes, then their
    text), before it was found no marker: a stranger's file in a shared area cost every `stage --status` and
    unstage half a GiB. It is now refused by its size, unread: a child's peak memory stays far under its size."""
    from packdata.pack.manifest.schema import MAX_MANIFEST_BYTES as MAX_MARKER_BYTES  # the bound read_marker keeps

    odd = tmp_path / "odd"
    odd.mkdir()
    with open(odd / STAGED_FILE, "wb") as file:
        file.truncate(MAX_MARKER_BYTES + 1)
    script = (
        "import resource, sys; from pathlib import Path; from packdata.staging.marker import read_marker;"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss;"
        "print(read_marker(Path(sys.argv[1])), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", script, str(odd)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    marker, grown_kib = done.stdout.split()
    assert marker == "None"
    assert int(grown_kib) * 1024 < MAX_MARKER_BYTES // 4, f"read_marker grew the process by {grown_kib} KiB"
