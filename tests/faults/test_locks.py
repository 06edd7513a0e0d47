"""One writer per pack: a second convert is refused, a stage past its wait, with the holder named; a dead holder
never blocks.

Holders are real processes (``python -c`` children, slowed or stopped by a
small hook in the child only) killed with real SIGKILLs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import IMAGE_EXTS, expected_samples, tree_digest

from packdata import CapacityError, ConfigError, LMDBDataset, LockedError, convert, stage, unstage, verify_pack
from packdata.cli import main
from packdata.conversion.destination import partial_path
from packdata.pack.lock import hold_lock

REPO = Path(__file__).parents[2]

_SLOW_CONVERT = """
import importlib, os, sys, time
c = importlib.import_module("packdata.conversion.convert")
local = importlib.import_module("packdata.conversion.local")
ld = importlib.import_module("packdata.conversion.load")
local._COMMIT_SAMPLES = 2
load = ld._load
held = importlib.import_module("packdata.conversion.destination").partial_path(sys.argv[2]) / "progress.json"
def slow_load(entry, opts):
    while len(sys.argv) > 4 and held.exists() and not os.path.exists(sys.argv[4]):  # held once it checkpointed
        time.sleep(0.01)
    time.sleep(float(sys.argv[3]))
    return load(entry, opts)
ld._load = slow_load
c.convert(sys.argv[1], sys.argv[2], workers=1, shard_samples=3, progress=False, resume=True)
"""

# A stage that stops for good at a chosen step: "marker" (before staged.json exists) or "copy".
_STOPPED_STAGE = """
import importlib, os, signal, sys, time
s = importlib.import_module("packdata.staging.stage")
pack, area, where, ready = sys.argv[1:5]
def stop(*args, **kwargs):
    open(ready, "w").close()
    if where == "marker":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)
if where == "marker":
    s.write_marker = stop
else:
    s.copy_all = stop
s.stage(pack, to=area, progress=False)
"""


def _spawn(script: str, *args: object) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], env=env)


def _wait_for(check, proc: subprocess.Popen, what: str, timeout: float = 60) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        if proc.poll() is not None:
            pytest.fail(f"the child exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def _lock_holder(lock: Path) -> dict | None:
    try:
        return json.loads(lock.read_text())
    except (OSError, ValueError):
        return None


def _contents(pack: Path) -> dict[str, tuple[bytes, int]]:
    ds = LMDBDataset(pack, decode="bytes")
    return {ds.keys[i]: ds[i] for i in range(len(ds))}


@pytest.mark.slow
def test_a_second_convert_into_the_same_dst_is_refused_naming_the_holder(image_folder: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out.lmdb"
    lock = tmp_path / ".out.lmdb.lock"
    release = tmp_path / "release"  # the first convert holds its lock until the second has met it
    first = _spawn(_SLOW_CONVERT, image_folder, dst, 0.15, release)
    try:
        _wait_for(lambda: (partial_path(dst) / "progress.json").exists(), first, "the first checkpoint")
        holder = rf"pid {first.pid} on host {socket.gethostname()} \(packdata convert, local engine, since"
        with pytest.raises(LockedError, match=rf"out\.lmdb: {holder}.*Wait for it to finish"):
            convert(image_folder, dst, resume=True, shard_samples=3, progress=False)
        assert (_lock_holder(lock) or {}).get("pid") == first.pid
        args = ["convert", str(image_folder), str(dst), "--resume", "--shard-samples", "3", "--quiet"]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1
        assert result.output.count("\n") == 1 and result.output.startswith("Error: ")
        assert f"pid {first.pid}" in result.output
        release.touch()
        assert first.wait(timeout=60) == 0
    finally:
        first.kill()
        first.wait()
    assert _contents(dst) == expected_samples(image_folder, IMAGE_EXTS)
    verify_pack(dst, progress=False)
    assert not lock.exists() and not partial_path(dst).exists()


@pytest.mark.slow
def test_a_killed_convert_leaves_a_lock_that_the_next_run_takes_over(image_folder: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out.lmdb"
    lock = tmp_path / ".out.lmdb.lock"
    first = _spawn(_SLOW_CONVERT, image_folder, dst, 0.05)
    _wait_for(lambda: (partial_path(dst) / "progress.json").exists(), first, "the first checkpoint")
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    assert (_lock_holder(lock) or {}).get("pid") == first.pid  # left behind by the dead process
    result = convert(image_folder, dst, resume=True, shard_samples=3, progress=False)
    assert result.resumed and result.packed == 19
    assert _contents(dst) == expected_samples(image_folder, IMAGE_EXTS)
    verify_pack(dst, progress=False)
    assert not lock.exists()


@pytest.fixture
def pack(image_folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / "pack.lmdb"
    convert(image_folder, out, shard_samples=5, progress=False)
    return out


def test_a_stage_killed_before_staged_json_blocks_nothing(pack: Path, tmp_path: Path) -> None:
    area = tmp_path / "area"
    dest = area / pack.name
    ready = tmp_path / "ready"
    child = _spawn(_STOPPED_STAGE, pack, area, "marker", ready)
    assert child.wait(timeout=60) == -signal.SIGKILL and ready.exists()
    assert sorted(p.name for p in dest.iterdir()) == [".stage.lock"]  # what the dead stage left
    result = stage(pack, to=area, progress=False)  # taken over
    assert len(result.copied) == 4 and (dest / "staged.json").is_file()
    assert _contents(dest) == _contents(pack)
    assert not (dest / ".stage.lock").exists()

    child = _spawn(_STOPPED_STAGE, pack, tmp_path / "area2", "marker", tmp_path / "ready2")
    assert child.wait(timeout=60) == -signal.SIGKILL
    removed = unstage(tmp_path / "area2" / pack.name)  # the leftover is removed, not refused
    assert removed.removed == [tmp_path / "area2" / pack.name] and not (tmp_path / "area2" / pack.name).exists()


@pytest.mark.slow
def test_stage_and_unstage_refuse_while_another_stage_holds_the_target(pack: Path, tmp_path: Path) -> None:
    area = tmp_path / "area"
    dest = area / pack.name
    ready = tmp_path / "ready"
    child = _spawn(_STOPPED_STAGE, pack, area, "copy", ready)
    try:
        _wait_for(ready.exists, child, "the stage to start copying")
        holder = rf"pid {child.pid} on host {socket.gethostname()} \(packdata stage"
        with pytest.raises(LockedError, match=rf"{dest.name}: {holder}.*still after waiting 0.5 s"):
            stage(pack, to=area, progress=False, wait_seconds=0.5)
        with pytest.raises(LockedError, match=holder):
            unstage(dest)
        with pytest.raises(LockedError, match=holder):
            unstage(area)
        assert (dest / "staged.json").is_file()  # nothing was removed under the running stage
    finally:
        child.kill()
        child.wait()
    result = stage(pack, to=area, progress=False)  # the killed stage's lock is taken over
    assert (dest / "staged.json").is_file() and _contents(dest) == _contents(pack)
    assert len(result.copied) == 4
    assert unstage(area).removed == [dest]


@pytest.mark.parametrize("planted", ["user file", "hard link", "symlink", "fifo"])
def test_a_file_in_the_place_of_the_lock_is_refused_and_left_untouched(
    image_folder: Path, tmp_path: Path, planted: str
) -> None:
    dst = tmp_path / "out" / "out.lmdb"
    dst.parent.mkdir()
    lock = dst.parent / ".out.lmdb.lock"
    precious = tmp_path / "precious.txt"
    precious.write_text("not a lock\n")
    if planted == "user file":
        lock.write_text('{"my": "notes"}\n')
    elif planted == "hard link":
        os.link(precious, lock)
    elif planted == "symlink":
        lock.symlink_to(precious)
    else:
        os.mkfifo(lock)
    before = {p.name: (p.lstat().st_mode, p.lstat().st_ino) for p in dst.parent.iterdir()}
    before_digest = tree_digest(tmp_path / "out") if planted not in ("fifo", "symlink") else None
    with pytest.raises(ConfigError, match=r"\.out\.lmdb\.lock: .*(lock|symlink)"):
        convert(image_folder, dst, progress=False)
    assert {p.name: (p.lstat().st_mode, p.lstat().st_ino) for p in dst.parent.iterdir()} == before
    if before_digest is not None:
        assert tree_digest(tmp_path / "out") == before_digest
    assert precious.read_text() == "not a lock\n"


_HELD_TASK_FOLDER = """
import os, sys, time
from pathlib import Path
from packdata.conversion.ray_remote import task_folder
with task_folder() as folder:
    (folder / "pack").mkdir()
    (folder / "pack" / "data.mdb").write_bytes(b"x" * 4096)  # a half-written shard
    Path(sys.argv[1] + ".tmp").write_text(str(folder))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(600)
"""


def _task_holder(tmp: Path, ready: Path) -> tuple[subprocess.Popen, Path]:
    """A child process inside ``task_folder()`` (as a Ray task is) and the folder it holds."""
    child = subprocess.Popen(
        [sys.executable, "-c", _HELD_TASK_FOLDER, str(ready)], env={**os.environ, "PACKDATA_TMP": str(tmp)}
    )
    _wait_for(ready.exists, child, "the task folder")
    return child, Path(ready.read_text())


def test_a_ray_task_removes_folders_only_of_dead_tasks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A killed task's folder (lock not held, over a minute old) is swept by the next task; nothing else is."""
    from packdata.conversion.ray_remote import task_folder

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("PACKDATA_TMP", str(tmp))
    old = time.time() - 3600
    dead, dead_folder = _task_holder(tmp, tmp_path / "ready1")
    dead.kill()
    dead.wait()
    os.utime(dead_folder / ".task.lock", (old, old))
    young, young_folder = _task_holder(tmp, tmp_path / "ready2")  # killed a moment ago: within the grace
    young.kill()
    young.wait()
    alive, alive_folder = _task_holder(tmp, tmp_path / "ready3")
    try:
        os.utime(alive_folder / ".task.lock", (old, old))  # old, but its holder runs
        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / ".task.lock").write_text("")
        os.utime(outside / ".task.lock", (old, old))
        (tmp / "packdata-task-link").symlink_to(outside)  # a link is never followed
        (tmp / "packdata-task-nolock").mkdir()  # no lock file: not judged
        with task_folder() as mine:
            assert mine.parent == tmp and (mine / ".task.lock").is_file()
            assert not dead_folder.exists()
            assert (young_folder / "pack" / "data.mdb").is_file()
            assert (alive_folder / "pack" / "data.mdb").is_file()
        assert not mine.exists()
        assert (outside / ".task.lock").exists() and (tmp / "packdata-task-link").is_symlink()
        assert (tmp / "packdata-task-nolock").is_dir()
    finally:
        alive.kill()
        alive.wait()


_OUT_OF_DESCRIPTORS = """
import os, resource, sys
from pathlib import Path
from packdata.pack.lock import exclude_readers
copy = Path(sys.argv[1])
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1, hard))
try:
    while True:
        os.open(os.devnull, os.O_RDONLY)  # fill every free number below the limit: the next open fails (EMFILE)
except OSError:
    pass
with exclude_readers(copy) as free:
    print(free)
"""


def test_a_readers_lock_that_cannot_be_opened_keeps_the_copy_quietly(tmp_path: Path) -> None:
    """A regular lock this process may not open (another user's copy; no descriptors left): read, not an error."""
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / ".readers.lock").touch()
    done = subprocess.run(
        [sys.executable, "-c", _OUT_OF_DESCRIPTORS, str(copy)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"  # kept, as while a reader holds it


@pytest.fixture
def read_only_later(tmpfs) -> Iterator[tuple[Path, Callable[[], None]]]:
    """A real tmpfs, and a call that turns its path read-only while a file on it is open for writing.

    ``mount -o remount,ro`` of the tmpfs itself is refused (busy) while the lock file is open for writing, as a
    volume the kernel turns read-only is not: the folder gets a read-only bind mount of itself on top, through
    which the lock file's path still names the same inode and its unlink gets EROFS. Unmounted afterwards.
    """
    folder = tmpfs("1m", name="vol")
    over: list[Path] = []

    def turn_read_only() -> None:
        subprocess.run(["mount", "--bind", os.fspath(folder), os.fspath(folder)], check=True)
        over.append(folder)
        subprocess.run(["mount", "-o", "remount,ro,bind", os.fspath(folder)], check=True)

    yield folder, turn_read_only
    for point in over:
        subprocess.run(["umount", os.fspath(point)], check=True)


def test_a_lock_file_a_read_only_volume_keeps_never_replaces_the_error_raised(
    read_only_later: tuple[Path, Callable[[], None]],
) -> None:
    """The unlink of a lock file, in hold_lock's finally, raised EROFS where the volume turned read-only under a
    stage, and that OSError replaced the stage's own error (its CapacityError). The error propagating is now
    raised, and the lock file is left (the next run takes it over)."""
    folder, turn_read_only = read_only_later
    lock = folder / ".out.lock"
    with pytest.raises(CapacityError) as caught, hold_lock(lock, what="a test", target=folder / "out"):
        turn_read_only()
        raise CapacityError("the stage's own error", path=folder / "out", hint="Free space")
    assert str(caught.value) == f"{folder / 'out'}: the stage's own error. Free space"
    assert lock.is_file()


def test_a_lock_file_a_read_only_volume_keeps_is_named_when_nothing_else_failed(
    read_only_later: tuple[Path, Callable[[], None]],
) -> None:
    """Where the block under the lock finished, a lock file that cannot be removed is named in one line, not
    raised as a bare OSError."""
    folder, turn_read_only = read_only_later
    lock = folder / ".out.lock"
    with pytest.raises(ConfigError) as caught, hold_lock(lock, what="a test", target=folder / "out"):
        turn_read_only()
    assert str(caught.value) == (
        f"{lock}: cannot remove the lock file: Read-only file system. The work under it is done, and the next run "
        "takes over a lock file left behind; remove it once its file system is writable again"
    )
    assert lock.is_file()
