"""The cache limit of packs at URLs: which copies are evicted, and never a copy a reader or a lock holds."""

from __future__ import annotations

import gc
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import lock_held_elsewhere
from remote_helpers import _samples
from torch.utils.data import DataLoader

import packdata
from packdata.cli import main
from packdata.errors import PackFormatError
from packdata.pack.manifest import read_manifest

pytest.importorskip("moto.server", reason="the tests' S3 server needs moto[server] (the dev extra)")
pytest.importorskip("s3fs", reason="s3:// needs s3fs (pip install 'packdata[s3]')")


_READER = """
import sys
import packdata
ds = packdata.LMDBDataset(sys.argv[1], decode="bytes")
ds[0]
print("reading", flush=True)
sys.stdin.readline()
"""


def _staged_and_second(s3, remote_pack, tmp_path: Path) -> tuple[dict, Path, Path, Path, int]:
    """The remote pack staged into ``tmp_path/cache`` and a second one uploaded at s3://packs/second.lmdb.

    Returns the storage options, the local pack, the cache, the staged copy and its size in bytes.
    """
    options, fs = s3
    url, local = remote_pack
    fs.put(str(local), "packs/second.lmdb", recursive=True)
    cache = tmp_path / "cache"
    first = packdata.stage(url, to=cache, storage_options=options, progress=False).staged
    return options, local, cache, first, sum(p.stat().st_size for p in first.rglob("*") if p.is_file())


def test_cache_limit_evicts_the_least_recently_used_copy_nobody_reads(s3, remote_pack, tmp_path: Path) -> None:
    options, local, cache, first, size = _staged_and_second(s3, remote_pack, tmp_path)
    packdata.stage(local, to=cache, name="local-copy", progress=False)  # a local pack's copy: never evicted
    limit = int(2.5 * size)  # the local copy and one remote copy fit, not two
    reader = subprocess.Popen(
        [sys.executable, "-c", _READER, str(first)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert reader.stdout is not None and reader.stdout.readline().strip() == "reading"
        with pytest.raises(packdata.CapacityError, match="cache limit"):  # its only candidate has a live reader
            packdata.stage("s3://packs/second.lmdb", to=cache, storage_options=options, progress=False,
                           cache_limit=limit)  # fmt: skip
        assert first.is_dir() and not (cache / "second.lmdb").exists()
    finally:
        reader.communicate("done\n", timeout=30)
    result = packdata.stage("s3://packs/second.lmdb", to=cache, storage_options=options, progress=False,
                            cache_limit=limit)  # fmt: skip
    assert result.downloaded and not first.exists() and (cache / "local-copy").is_dir()
    with pytest.raises(packdata.ConfigError, match="cache_limit=SIZE applies to packs staged from a URL"):
        packdata.stage(local, to=cache, name="x", cache_limit=limit, progress=False)


def test_a_copy_whose_url_had_a_user_part_is_never_evicted_by_a_look_at_another_pack(remote_pack, tmp_path) -> None:
    """Eviction looked for a copy's origin at the URL its staged.json shows, without the user part: the copy of
    memory://alpha@account/train, whose origin is gone (the last copy), was evicted as 'still there' because another
    pack lies at memory://account/train."""
    import fsspec

    _, local = remote_pack
    memory = fsspec.filesystem("memory")
    memory.put(str(local), "/alpha@account/train", recursive=True)
    cache = tmp_path / "cache"
    try:
        first = packdata.stage("memory://alpha@account/train", to=cache, progress=False).staged
        size = sum(p.stat().st_size for p in first.rglob("*") if p.is_file())
        memory.rm("/alpha@account", recursive=True)  # the origin gone: the staged copy is the last one
        memory.put(str(local), "/account/train", recursive=True)  # another pack where the shown URL points
        memory.put(str(local), "/account/second", recursive=True)
        with pytest.raises(packdata.CapacityError, match="cache limit"):
            packdata.stage("memory://account/second", to=cache, progress=False, cache_limit=int(1.5 * size))
        assert _samples(first) == _samples(local)
    finally:
        memory.rm([p for p in ("/alpha@account", "/account") if memory.exists(p)], recursive=True)


def test_a_pack_larger_than_the_cache_limit_evicts_nothing(s3, remote_pack, tmp_path: Path) -> None:
    options, local, cache, first, _ = _staged_and_second(s3, remote_pack, tmp_path)
    incoming = read_manifest(local).total_bytes
    with pytest.raises(packdata.CapacityError, match=rf"cache limit of {incoming // 2:,} bytes cannot hold the pack"):
        packdata.stage("s3://packs/second.lmdb", to=cache, storage_options=options, progress=False,
                       cache_limit=incoming // 2)  # fmt: skip
    assert _samples(first) == _samples(local)  # the copy another job may read next is kept


def test_replacing_a_copy_that_is_a_link_deletes_the_link_never_what_it_leads_to(
    s3, remote_pack, tmp_path: Path
) -> None:
    """A staged copy's name in the cache made a link to a copy elsewhere (a user sharing one): when the pack
    changed at its origin, the stage moved the link aside and deleted through it, emptying the folder outside
    the cache, and left the link behind. The link goes, never what it leads to."""
    options, fs = s3
    _, local = remote_pack
    url = "s3://packs/linked.lmdb"
    fs.put(str(local), url.removeprefix("s3://"), recursive=True)
    cache = tmp_path / "cache"
    copy = packdata.stage(url, to=cache, storage_options=options, progress=False).staged
    elsewhere = tmp_path / "elsewhere" / copy.name
    elsewhere.parent.mkdir()
    os.rename(copy, elsewhere)
    copy.symlink_to(elsewhere)
    before = sorted(p.relative_to(elsewhere) for p in elsewhere.rglob("*"))
    newer = tmp_path / "newer.lmdb"  # the same samples in 2 shards: another manifest
    packdata.convert(local.parent / "src", newer, shard_samples=9, progress=False)
    fs.rm(url.removeprefix("s3://"), recursive=True)
    fs.put(str(newer), url.removeprefix("s3://"), recursive=True)
    result = packdata.stage(url, to=cache, storage_options=options, progress=False)
    assert result.downloaded and not copy.is_symlink() and _samples(copy) == _samples(local)
    assert sorted(p.relative_to(elsewhere) for p in elsewhere.rglob("*")) == before
    assert _samples(elsewhere) == _samples(local)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == [copy.name]


def test_eviction_moves_a_copy_aside_past_a_leftover_under_its_own_pid(s3, remote_pack, tmp_path: Path) -> None:
    """A killed process whose pid this one reuses left ``.NAME.old-PID`` full of files: the copy is still evicted."""
    options, local, cache, first, size = _staged_and_second(s3, remote_pack, tmp_path)
    leftover = cache / f".train.lmdb.old-{os.getpid()}"
    (leftover / "sub").mkdir(parents=True)
    (leftover / "sub" / "data.mdb").write_bytes(b"left by a killed eviction")
    result = packdata.stage("s3://packs/second.lmdb", to=cache, storage_options=options, progress=False,
                            cache_limit=int(1.5 * size))  # fmt: skip
    assert result.downloaded and not first.exists() and _samples(result.staged) == _samples(local)
    assert (leftover / "sub" / "data.mdb").read_bytes() == b"left by a killed eviction"  # not this eviction's
    assert sorted(p.name for p in cache.iterdir()) == [".train.lmdb.evicted", leftover.name, "second.lmdb"]


def test_a_copy_moved_aside_under_a_numbered_name_is_still_its_copys_to_evict(s3, remote_pack, tmp_path: Path) -> None:
    """``.NAME.old-PID-N`` (``.NAME.old-PID`` was taken) is NAME's: eviction skips it while NAME's lock is held."""
    options, _, cache, first, size = _staged_and_second(s3, remote_pack, tmp_path)
    aside = cache / f".train.lmdb.old-{os.getpid()}-1"
    os.rename(first, aside)  # as an eviction holding .train.lmdb.lock leaves it, deleting it
    with lock_held_elsewhere(cache / ".train.lmdb.lock"):
        with pytest.raises(packdata.CapacityError, match="cache limit"):
            packdata.stage("s3://packs/second.lmdb", to=cache, storage_options=options, progress=False,
                           cache_limit=int(1.5 * size))  # fmt: skip
        assert (aside / "staged.json").is_file() and not (cache / "second.lmdb").exists()


def test_cache_limit_never_evicts_a_copy_whose_lock_another_process_holds(s3, remote_pack, tmp_path: Path) -> None:
    """A copy another process is staging, replacing or unstaging (it holds .NAME.lock) is skipped, never deleted."""
    options, local, cache, first, size = _staged_and_second(s3, remote_pack, tmp_path)
    limit = int(1.5 * size)  # one copy fits, not two: the first must go for the second
    with lock_held_elsewhere(cache / ".train.lmdb.lock"):
        with pytest.raises(packdata.CapacityError, match="cache limit"):
            packdata.stage("s3://packs/second.lmdb", to=cache, storage_options=options, progress=False,
                           cache_limit=limit)  # fmt: skip
        assert _samples(first) == _samples(local) and not (cache / "second.lmdb").exists()
    result = packdata.stage("s3://packs/second.lmdb", to=cache, storage_options=options, progress=False,
                            cache_limit=limit)  # fmt: skip
    assert result.downloaded and not first.exists() and _samples(result.staged) == _samples(local)


_KILLED_BEFORE_RENAME = """
import json, os, sys, time
import packdata
rename = os.rename
def stalled(src, dst):  # the copy is complete in .NAME.partial; the process is killed before it takes its name
    if os.fspath(src).endswith(".partial"):
        print("renaming", flush=True)
        time.sleep(60)
    rename(src, dst)
os.rename = stalled
packdata.stage(sys.argv[1], to=sys.argv[2], storage_options=json.loads(sys.argv[3]), progress=False)
"""


def test_cache_limit_never_evicts_the_partial_copy_of_the_pack_being_staged(s3, remote_pack, tmp_path: Path) -> None:
    """A stage killed before its rename leaves a complete .NAME.partial; the next stage of NAME resumes it."""
    options, _ = s3
    url, local = remote_pack
    cache = tmp_path / "cache"
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_BEFORE_RENAME, url, str(cache), json.dumps(options)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "renaming"
    child.kill()
    child.wait()
    partial = cache / ".train.lmdb.partial"
    size = sum(p.stat().st_size for p in partial.rglob("*") if p.is_file())
    result = packdata.stage(url, to=cache, storage_options=options, progress=False, cache_limit=int(1.5 * size))
    unhashed = [p for p in local.rglob("*") if p.name in ("records.i64", "skipped.jsonl")]  # no digest: again
    assert (result.files, result.bytes_downloaded) == (len(unhashed), sum(p.stat().st_size for p in unhashed))
    assert _samples(result.staged) == _samples(local) and not partial.exists()  # resumed: no shard downloaded again


def _in_own_pid_namespace() -> list[str]:
    """A command prefix running a process in a PID namespace of its own, as a container sharing the cache would be.

    There no ``/proc`` scan sees this test's processes: only the readers' lock tells it the copy is read.
    """
    for prefix in (
        ["unshare", "--pid", "--fork", "--mount-proc"],
        ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"],
    ):
        if shutil.which("unshare") and subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix
    pytest.skip("needs unshare and PID namespaces (root, or unprivileged user namespaces)")


_STAGE_WITH_LIMIT = """
import json, os, shutil, sys
import packdata
from packdata.staging import cache as stage_cache
url, cache, options, limit, stall = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
def wait():  # for a line on stdin
    print("evicting", flush=True)
    sys.stdin.readline()
evictable, rename, rmtree = stage_cache._evictable, os.rename, shutil.rmtree
def checked(entry, *args):  # eviction has checked the copy is unread, and has not deleted it yet
    found = evictable(entry, *args)
    wait()
    return found
def moved(src, dst):  # the copy about to leave its path, its locks held
    if ".old-" in os.fspath(dst):
        wait()
    rename(src, dst)
def deleted(path, *args, **kwargs):  # (before readers' locks, it was deleted where it was)
    if os.path.basename(path) == "train.lmdb":
        wait()
    rmtree(path, *args, **kwargs)
if stall == "check":
    stage_cache._evictable = checked
elif stall == "delete":
    os.rename, shutil.rmtree = moved, deleted
try:
    packdata.stage(url, to=cache, storage_options=options, progress=False, cache_limit=limit or None)
    print("staged", flush=True)
except (packdata.CapacityError, packdata.LockedError) as exc:
    print(f"refused: {exc}", flush=True)
"""


def _stage_second(
    cache: Path, options: dict, limit: int, *, stall: str = "", url: str = "s3://packs/second.lmdb"
) -> subprocess.Popen:
    """``stage URL --cache-limit LIMIT`` (0: none) into ``cache``, in a PID namespace of its own.

    ``stall``: ``"check"`` or ``"delete"``, where eviction waits for a line on stdin (it prints ``evicting``).
    """
    script = [sys.executable, "-c", _STAGE_WITH_LIMIT, url, str(cache), json.dumps(options)]
    return subprocess.Popen(
        [*_in_own_pid_namespace(), *script, str(limit), stall or "run"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_cache_limit_keeps_a_copy_a_dataset_opened_but_has_not_read_yet(s3, remote_pack, tmp_path: Path) -> None:
    """A dataset holds its staged copy from construction; once it is garbage collected, the copy may go."""
    options, local, cache, first, size = _staged_and_second(s3, remote_pack, tmp_path)
    limit = int(1.5 * size)  # one copy fits, not two: the first must go for the second
    ds = packdata.LMDBDataset(first, decode="bytes")  # built, no shard opened yet
    out, _ = _stage_second(cache, options, limit).communicate(timeout=120)
    assert out.startswith("refused:") and "cache limit" in out, out
    assert first.is_dir() and not (cache / "second.lmdb").exists()
    assert [ds[i] for i in range(len(ds))] == list(packdata.LMDBDataset(local, decode="bytes"))
    assert not (local / ".readers.lock").exists()  # a pack not staged from a URL: nothing created in it
    del ds
    gc.collect()
    out, _ = _stage_second(cache, options, limit).communicate(timeout=120)
    assert out.strip() == "staged" and not first.exists() and _samples(cache / "second.lmdb") == _samples(local)


def test_cache_limit_keeps_a_copy_spawned_workers_read_while_it_runs(s3, remote_pack, tmp_path: Path) -> None:
    """Eviction runs mid-epoch (each worker has opened only the first shard): the epoch reads every sample once."""
    options, local, cache, first, size = _staged_and_second(s3, remote_pack, tmp_path)
    limit = int(1.5 * size)
    ds = packdata.LMDBDataset(first, decode="bytes")
    loader = DataLoader(ds, batch_size=1, num_workers=2, multiprocessing_context="spawn", collate_fn=list)
    batches = iter(loader)
    read = [*next(batches), *next(batches)]  # shard 0 of 3 only (6 samples a shard; 4 batches prefetched at most)
    lock = os.stat(first / ".readers.lock")
    inode = f"{os.major(lock.st_dev):02x}:{os.minor(lock.st_dev):02x}:{lock.st_ino} "
    holders = [line for line in Path("/proc/locks").read_text().splitlines() if inode in line]
    assert len(holders) == 3 and all("FLOCK  ADVISORY  READ" in h for h in holders), holders  # this one, each worker
    out, _ = _stage_second(cache, options, limit).communicate(timeout=120)
    read += itertools.chain.from_iterable(batches)
    assert out.startswith("refused:") and "cache limit" in out, out
    assert sorted(read) == sorted(packdata.LMDBDataset(local, decode="bytes"))
    del batches, loader, ds  # its workers are gone with the iterator
    gc.collect()
    out, _ = _stage_second(cache, options, limit).communicate(timeout=120)
    assert out.strip() == "staged" and not first.exists()


def _open_during_eviction(evictor: subprocess.Popen, copy: Path) -> object:
    """Open a dataset on ``copy`` and read a sample while ``evictor`` is stalled; what that gave (sample or error)."""
    assert evictor.stdin is not None and evictor.stdout is not None
    outcome: list[object] = []
    opened = []  # alive until the eviction is over

    def open_and_read() -> None:
        try:
            opened.append(packdata.LMDBDataset(copy, decode="bytes"))
            outcome.append(opened[0][0])
        except PackFormatError as exc:
            outcome.append(exc)

    lock = os.path.realpath(copy / ".readers.lock")  # this copy's: another dataset of the process may hold one
    try:
        assert evictor.stdout.readline().strip() == "evicting"
        reader = threading.Thread(target=open_and_read)
        reader.start()
        deadline = time.monotonic() + 60  # a guard: it reads, or waits on the lock, however loaded the machine
        while not outcome and time.monotonic() < deadline and lock not in _open_files().splitlines():
            time.sleep(0.01)  # until it has read, or waits on the readers' lock eviction holds
        evictor.stdin.write("\n")
        evictor.stdin.flush()
        evictor.communicate(timeout=60)
        reader.join(30)
    finally:
        evictor.kill()
        evictor.wait()
    (found,) = outcome
    return found


def test_a_dataset_opened_just_after_evictions_check_keeps_its_copy(s3, remote_pack, tmp_path: Path) -> None:
    """Opened between eviction's check that nobody reads the copy and its deletion: the copy stays, the reads work."""
    options, local, cache, first, size = _staged_and_second(s3, remote_pack, tmp_path)
    found = _open_during_eviction(_stage_second(cache, options, int(1.5 * size), stall="check"), first)
    assert found == packdata.LMDBDataset(local, decode="bytes")[0]
    assert first.is_dir() and not (cache / "second.lmdb").exists()


def test_a_dataset_opened_while_its_copy_is_evicted_says_so(s3, remote_pack, tmp_path: Path) -> None:
    """Opened as eviction deletes the copy: one clear error naming the copy and what to do."""
    options, _, cache, first, size = _staged_and_second(s3, remote_pack, tmp_path)
    found = _open_during_eviction(_stage_second(cache, options, int(1.5 * size), stall="delete"), first)
    assert not first.exists() and (cache / "second.lmdb").is_dir()
    assert isinstance(found, PackFormatError), found
    assert str(found) == (
        f"{first}: the staged copy was evicted from its cache (a stage with a cache limit needed the room) or "
        "unstaged. Stage the pack again, then recreate the dataset"
    )


def test_a_copy_opened_after_its_eviction_names_the_eviction_until_it_is_staged_again(
    s3, remote_pack, tmp_path: Path
) -> None:
    """A dataset opened on a copy a cache limit had evicted said 'no such pack. Convert a folder with `packdata
    convert SRC DST` first'. Eviction now leaves .NAME.evicted beside it, so the refusal names the eviction and
    says to open the URL again; staging it again removes that mark, and a copy unstaged since is plainly missing."""
    options, _, cache, first, size = _staged_and_second(s3, remote_pack, tmp_path)
    packdata.stage("s3://packs/second.lmdb", to=cache, storage_options=options, progress=False,
                   cache_limit=int(1.5 * size))  # fmt: skip
    assert not first.exists() and (cache / ".train.lmdb.evicted").is_file()
    with pytest.raises(PackFormatError) as refused:
        packdata.LMDBDataset(first)
    assert str(refused.value) == (
        f"{first}: no such pack: the staged copy was evicted from its cache (a stage with a cache limit needed the "
        "room). Open the pack's URL again, or stage it again, to fetch a new copy"
    )
    again = packdata.stage(remote_pack[0], to=cache, storage_options=options, progress=False).staged
    assert again == first and not (cache / ".train.lmdb.evicted").exists()
    packdata.unstage(first)
    with pytest.raises(PackFormatError, match=re.escape(f"{first}: no such pack. Convert a folder")):
        packdata.LMDBDataset(first)


def test_unstage_removes_the_eviction_mark_of_a_copy_no_longer_there_and_only_packdata_s(
    s3, remote_pack, tmp_path: Path
) -> None:
    """Eviction's .NAME.evicted marks stayed behind an unstage: of the cache, which removed every copy in it, and
    of a copy staged since into an evicted copy's name (a local pack's: only a stage of the URL removed the mark).
    Unstage now removes the mark once no copy stands at NAME; a link, folder or file with content of that name is
    not packdata's mark and is kept (the link's target untouched)."""
    options, local, cache, first, size = _staged_and_second(s3, remote_pack, tmp_path)
    packdata.stage("s3://packs/second.lmdb", to=cache, storage_options=options, progress=False,
                   cache_limit=int(1.5 * size))  # fmt: skip
    mark = cache / ".train.lmdb.evicted"
    assert not first.exists() and mark.is_file()
    packdata.stage(local, to=cache, name="train.lmdb", progress=False)  # a local pack's copy, in the evicted name
    assert mark.is_file()
    packdata.unstage(first)
    assert not first.exists() and not mark.exists()
    packdata.stage(remote_pack[0], to=cache, storage_options=options, progress=False,
                   cache_limit=int(1.5 * size))  # fmt: skip
    assert (cache / ".second.lmdb.evicted").is_file()
    target = tmp_path / "target"
    target.write_text("kept")
    (cache / ".gone.lmdb.evicted").symlink_to(target)
    (cache / ".folder.lmdb.evicted").mkdir()
    (cache / ".notes.lmdb.evicted").write_text("a user's")
    packdata.unstage(cache)
    left = sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock"))
    assert left == [".folder.lmdb.evicted", ".gone.lmdb.evicted", ".notes.lmdb.evicted"]
    assert target.read_text() == "kept"


def _open_files() -> str:
    """The paths this process has open, one a line."""
    links = (f"/proc/self/fd/{fd}" for fd in os.listdir("/proc/self/fd"))
    return "\n".join(os.readlink(link) for link in links if os.path.exists(link))


def test_a_copy_read_by_a_dataset_is_not_replaced_by_a_newer_version(s3, remote_pack, tmp_path: Path) -> None:
    """The pack changes at its origin while a dataset reads its copy: the copy stays until the dataset is gone."""
    options, fs = s3
    _, local = remote_pack
    fs.put(str(local), "packs/changing.lmdb", recursive=True)
    cache = tmp_path / "cache"
    copy = packdata.stage("s3://packs/changing.lmdb", to=cache, storage_options=options, progress=False).staged
    ds = packdata.LMDBDataset(copy, decode="bytes")
    read = [ds[0]]  # shard 0 of 3 opened, the others not yet
    newer = tmp_path / "newer.lmdb"  # the same samples in 2 shards: another manifest
    packdata.convert(local.parent / "src", newer, shard_samples=9, progress=False)
    fs.rm("packs/changing.lmdb", recursive=True)
    fs.put(str(newer), "packs/changing.lmdb", recursive=True)
    out, _ = _stage_second(cache, options, 0, url="s3://packs/changing.lmdb").communicate(timeout=120)
    assert out.startswith(f"refused: {copy}: holds a copy of an older version of s3://packs/changing.lmdb that is "
                          "still read"), out  # fmt: skip
    read += [ds[i] for i in range(1, len(ds))]
    assert read == list(packdata.LMDBDataset(local, decode="bytes"))
    assert len(packdata.LMDBDataset(copy).pack.manifest.shards) == 3 and not (cache / ".changing.lmdb.partial").exists()
    del ds
    gc.collect()
    out, _ = _stage_second(cache, options, 0, url="s3://packs/changing.lmdb").communicate(timeout=120)
    assert out.strip() == "staged", out
    assert len(packdata.LMDBDataset(copy).pack.manifest.shards) == 2 and _samples(copy) == _samples(local)
    assert [p.name for p in cache.iterdir()] == ["changing.lmdb"]  # the old copy deleted, nothing aside


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_copy_whose_readers_lock_is_not_a_file_is_neither_evicted_nor_replaced(
    s3, remote_pack, tmp_path: Path, kind: str
) -> None:
    """Readers never lock a FIFO or folder there, so nothing tells the copy is unread: it stays, the error says why."""
    options, fs = s3
    _, local, cache, first, size = _staged_and_second(s3, remote_pack, tmp_path)
    url = f"s3://packs/planted-{kind}.lmdb"
    fs.put(str(local), url.removeprefix("s3://"), recursive=True)
    copy = packdata.stage(url, to=cache, storage_options=options, progress=False).staged
    for lock in (first / ".readers.lock", copy / ".readers.lock"):
        lock.unlink()
        os.mkfifo(lock) if kind == "fifo" else lock.mkdir()
    what = "a FIFO" if kind == "fifo" else "a folder"
    with pytest.raises(packdata.CapacityError, match="cache limit") as evicting:
        packdata.stage("s3://packs/second.lmdb", to=cache, storage_options=options, progress=False,
                       cache_limit=int(2.5 * size))  # fmt: skip
    assert f"{first / '.readers.lock'}: is {what}, not the readers' lock a stage makes" in str(evicting.value)
    assert not (cache / "second.lmdb").exists()
    newer = tmp_path / "newer.lmdb"  # the same samples in 2 shards: another manifest
    packdata.convert(local.parent / "src", newer, shard_samples=9, progress=False)
    fs.rm(url.removeprefix("s3://"), recursive=True)
    fs.put(str(newer), url.removeprefix("s3://"), recursive=True)
    message = f"{copy / '.readers.lock'}: is {what}, not the readers' lock a stage makes: whether the copy is read"
    with pytest.raises(packdata.ConfigError, match=re.escape(message)):
        packdata.stage(url, to=cache, storage_options=options, progress=False)
    assert _samples(first) == _samples(local) and _samples(copy) == _samples(local)
    assert len(packdata.LMDBDataset(copy).pack.manifest.shards) == 3


_UNSTAGE = """
import sys
import packdata
try:
    packdata.unstage(sys.argv[1])
    print("unstaged", flush=True)
except packdata.LockedError as exc:
    print(f"refused: {exc}", flush=True)
"""


def _unstage_elsewhere(copy: Path) -> str:
    """What ``unstage COPY`` says, run in a PID namespace of its own (no /proc scan sees this test's readers)."""
    command = [*_in_own_pid_namespace(), sys.executable, "-c", _UNSTAGE, str(copy)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120).stdout


@pytest.mark.parametrize("origin", ["url", "local"])
def test_unstage_keeps_a_copy_a_dataset_reads(s3, remote_pack, tmp_path: Path, origin: str) -> None:
    """unstage refuses a copy a dataset holds, which reads on; once the dataset is gone, the copy is removed."""
    options, _ = s3
    url, local = remote_pack
    source = url if origin == "url" else local  # a local pack's copy holds a readers' lock too
    copy = packdata.stage(source, to=tmp_path / "cache", storage_options=options, progress=False).staged
    ds = packdata.LMDBDataset(copy, decode="bytes")
    read = [ds[0]]  # shard 0 of 3 opened, the others not yet
    assert _unstage_elsewhere(copy) == (
        f"refused: {copy}: is still read (a dataset holds it, or a process has its files open), so it is not "
        "removed. Stop its readers and unstage again, or pass force=True (its readers then stop with an error)\n"
    )
    read += [ds[i] for i in range(1, len(ds))]
    assert read == list(packdata.LMDBDataset(local, decode="bytes"))
    del ds
    gc.collect()
    assert _unstage_elsewhere(copy) == "unstaged\n"
    assert list(copy.parent.iterdir()) == []


def test_cli_unstage_force_removes_a_copy_a_dataset_reads(s3, remote_pack, tmp_path: Path) -> None:
    """``packdata unstage`` names --force; with it the copy goes, and the dataset's next shard says so."""
    options, _ = s3
    url, _ = remote_pack
    copy = packdata.stage(url, to=tmp_path / "cache", storage_options=options, progress=False).staged
    ds = packdata.LMDBDataset(copy, decode="bytes")
    first = ds[0]
    out = CliRunner().invoke(main, ["unstage", str(copy)])
    assert out.exit_code == 1 and out.output.endswith("or pass --force (its readers then stop with an error)\n")
    assert copy.is_dir()
    out = CliRunner().invoke(main, ["unstage", str(copy), "--force"])
    assert out.exit_code == 0 and not copy.exists(), out.output
    assert ds[0] == first  # shard 0's open files stay valid
    with pytest.raises(PackFormatError, match=r"the staged copy was evicted from its cache .* or unstaged"):
        ds[len(ds) - 1]
