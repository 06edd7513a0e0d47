"""The cache of a pack at a URL: its index and side tables, links planted in it, killed and shared downloads."""

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

import numpy as np
import pytest
from conftest import killed_at_staged_json_delete
from faults.hostile import rewrite_manifest
from remote_helpers import _samples, _two_classes

import packdata
from packdata.errors import CapacityError, ConfigError, PackFormatError

pytest.importorskip("moto.server", reason="the tests' S3 server needs moto[server] (the dev extra)")
pytest.importorskip("s3fs", reason="s3:// needs s3fs (pip install 'packdata[s3]')")


def test_an_index_file_rewritten_at_the_url_while_a_cache_copies_it_is_named_never_cached_mixed(
    remote_tfrecord, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An older pack (no index digests in its manifest) at a URL outside S3 whose sizes.i64 was rewritten after the
    cache looked its files up and before it read that one: the copy held the old labels.i32 beside the new
    sizes.i64, cached under the old manifest, silently (nothing checks the index files against each other)."""
    import fsspec

    from packdata.formats import remote_pack

    older = tmp_path / "older"
    shutil.copytree(remote_tfrecord[1], older)
    rewrite_manifest(older, lambda d: d["index"].pop("sha256"))
    sizes = np.fromfile(older / "index" / "sizes.i64", dtype="<i8")
    url, store = "memory://older-skeleton/verify-tf", fsspec.filesystem("memory")
    store.put(str(older), url, recursive=True)
    copy_within = remote_pack._copy_within

    def rewritten_after_the_look_up(*args, **kwargs):  # while labels.i32, the first file, is copied
        store.pipe_file(f"{url}/index/sizes.i64", (sizes + 1).astype("<i8").tobytes())
        return copy_within(*args, **kwargs)

    monkeypatch.setattr(remote_pack, "_copy_within", rewritten_after_the_look_up)
    cache = tmp_path / "cache"
    try:
        with pytest.raises(
            PackFormatError,
            match=rf"^{url}/index/sizes\.i64: was rewritten or removed while the pack's index and side tables were "
            r"copied \(the pack at the URL changed\): nothing was cached from it\. Open it again once",
        ):
            packdata.TFRecordDataset(url, decode="bytes", cache_dir=cache)
    finally:
        store.rm("/older-skeleton", recursive=True)
    assert not list(cache.rglob("manifest.json")) and not list(cache.rglob(".files.json"))


def _plant(at: Path, kind: str, target: Path) -> None:
    """A ``"symlink"`` to ``target``, or a ``"file"``, where the cache wants a folder of its own."""
    if kind == "symlink":
        at.symlink_to(target)
    else:
        at.write_text("not a folder")


@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_a_link_planted_at_a_cache_entrys_folder_is_never_written_through(
    s3, remote_tfrecord, tmp_path: Path, kind: str
) -> None:
    """A link at the cache's tag folder led the copy's swap into a folder elsewhere: its PACK folder was deleted."""
    import hashlib

    options, _ = s3
    url, local = remote_tfrecord
    cache, outside = tmp_path / "cache", tmp_path / "outside"
    (outside / "verify-tf").mkdir(parents=True)
    (outside / "verify-tf" / "mine.txt").write_text("not the cache's")
    cache.mkdir()
    tag = cache / hashlib.sha256(url.encode()).hexdigest()[:16]
    _plant(tag, kind, outside)
    ds = packdata.TFRecordDataset(url, decode="bytes", storage_options=options, cache_dir=cache)
    assert sorted(ds) == sorted(packdata.TFRecordIndexedDataset(local, decode="bytes"))
    assert sorted(p.name for p in outside.rglob("*")) == ["mine.txt", "verify-tf"]
    assert tag.is_dir() and not tag.is_symlink() and (tag / "verify-tf" / "manifest.json").is_file()


def test_two_packs_whose_urls_differ_only_in_their_user_part_are_cached_apart(remote_tfrecord, tmp_path) -> None:
    """abfs://CONTAINER@account/train names a container: two such packs shared one cache folder, so opening the
    second replaced the first's copy under its reader ('pack changed since the dataset was opened'), every time."""
    import fsspec

    _, local = remote_tfrecord
    memory = fsspec.filesystem("memory")  # fsspec's own in-memory store: URLs with a user part, as Azure's
    other = tmp_path / "other"
    packdata.convert(_two_classes(tmp_path / "src", seed=5), other, format="tfrecord", progress=False)
    for container, pack in (("c1", local), ("c2", other)):
        memory.put(str(pack), f"/{container}@account/train", recursive=True)
    try:
        first, second = (
            packdata.TFRecordDataset(f"memory://{c}@account/train", decode="bytes", cache_dir=tmp_path / "cache")
            for c in ("c1", "c2")
        )
        assert sorted(first) == sorted(packdata.TFRecordIndexedDataset(local, decode="bytes"))
        assert sorted(second) == sorted(packdata.TFRecordIndexedDataset(other, decode="bytes"))
    finally:
        memory.rm(["/c1@account", "/c2@account"], recursive=True)


@pytest.mark.parametrize("record", ["as_written", "empty", "partial"])
def test_a_cached_copy_that_lost_a_file_is_downloaded_again(s3, remote_tfrecord, tmp_path: Path, record: str) -> None:
    """A clean-up of the cache (or a full disk) took an offsets index and cut the keys: not a pack to read so.

    empty, partial: the copy's .files.json of {} (or one naming only some files) made it count as intact whatever
    it held: an empty record checks nothing."""
    options, _ = s3
    url, local = remote_tfrecord
    cache = tmp_path / "cache"
    expected = sorted(data for data, _ in packdata.TFRecordIndexedDataset(local, decode="bytes"))
    ds = packdata.TFRecordDataset(url, decode="bytes", storage_options=options, cache_dir=cache)
    assert sorted(data for data, _ in ds) == expected
    lost = next(cache.rglob("*.tfindex"))
    lost.unlink()
    (keys,) = cache.rglob("keys.utf8")
    os.truncate(keys, keys.stat().st_size // 2)
    if record != "as_written":
        (files,) = cache.rglob(".files.json")
        stamps = json.loads(files.read_text())
        kept = {n: s for n, s in stamps.items() if record == "partial" and "keys" not in n and ".tfindex" not in n}
        assert record == "empty" or kept
        files.write_text(json.dumps(kept))
    ds = packdata.TFRecordDataset(url, decode="bytes", storage_options=options, cache_dir=cache)
    assert sorted(data for data, _ in ds) == expected
    assert keys.read_bytes() == (local / "index" / "keys.utf8").read_bytes() and lost.exists()


@pytest.mark.parametrize("name", ["labels.i32", "keys.utf8"])
def test_a_cached_index_file_damaged_since_its_download_is_downloaded_again(
    s3, remote_tfrecord, tmp_path: Path, name: str
) -> None:
    """One flipped byte in a cached copy's index (same size, so the copy was reused) failed every later open
    with 'does not match its SHA-256 ... convert it again', blaming a sound remote pack. It is downloaded again."""
    options, _ = s3
    url, local = remote_tfrecord
    cache = tmp_path / "cache"
    expected = sorted(packdata.TFRecordIndexedDataset(local, decode="bytes"))
    assert sorted(packdata.TFRecordDataset(url, decode="bytes", storage_options=options, cache_dir=cache)) == expected
    (cached,) = cache.rglob(name)
    damaged = bytearray(cached.read_bytes())
    damaged[len(damaged) // 2] ^= 0x01
    cached.write_bytes(bytes(damaged))
    ds = packdata.TFRecordDataset(url, decode="bytes", storage_options=options, cache_dir=cache)
    assert sorted(ds) == expected
    (cached,) = cache.rglob(name)
    assert cached.read_bytes() == (local / "index" / name).read_bytes()


@pytest.mark.parametrize("stamped", [False, True])
def test_a_cached_side_table_edited_at_the_same_size_is_downloaded_again(
    s3, remote_tfrecord, tmp_path: Path, stamped: bool
) -> None:
    """A cached copy was reused while each file kept its size: a record table whose payload spans were edited in
    place (each still inside its record) gave every later epoch payloads one byte short, silently.

    stamped: the change is one the stamps cannot see (within the timestamp tick, or a failing disk). The record
    the table misplaces is named damaged (never a wrong payload), but every later dataset named it too, though
    the pack at the URL is sound (verify passes), until the cache was found and deleted."""
    from packdata.pack.files import file_stamp

    options, _ = s3
    url, local = remote_tfrecord
    cache = tmp_path / "cache"
    expected = sorted(packdata.TFRecordIndexedDataset(local, decode="bytes"))
    assert sorted(packdata.TFRecordDataset(url, decode="bytes", storage_options=options, cache_dir=cache)) == expected
    table = sorted(cache.rglob("*.tfpayload"))[0]
    rows = np.fromfile(table, dtype="<i8").reshape(-1, 3)
    rows[2:, 2] -= 1  # every payload one byte shorter: still inside its record
    rows.tofile(table)
    if stamped:
        (record,) = cache.rglob(".files.json")
        stamps = json.loads(record.read_text())
        record.write_text(json.dumps({name: file_stamp(record.parent / name) for name in stamps}))
        with pytest.raises(
            PackFormatError,
            match=rf"^{url}/{local.name}-00000-of-00004\.tfpayload: the payload table does not point at the payload "
            rf"of the record at byte offset \d+ of {local.name}-00000-of-00004\.tfrecord, and the record is sound .*"
            r"the table is damaged, not the shard \(cached copy: .*\)\. Open the pack again: its cached copy is not",
        ):
            list(packdata.TFRecordDataset(url, decode="bytes", storage_options=options, cache_dir=cache))
    ds = packdata.TFRecordDataset(url, decode="bytes", storage_options=options, cache_dir=cache)
    assert sorted(ds) == expected
    assert table.read_bytes() == (local / table.relative_to(next(cache.iterdir()) / local.name)).read_bytes()


@pytest.mark.root
@pytest.mark.parametrize("inodes", [6, 9])  # the disk fills at an index file, at a side table
def test_a_full_cache_while_opening_a_remote_pack_names_the_cache(s3, remote_tfrecord, tmpfs, inodes: int) -> None:
    """Once 'cannot read index/labels.i32 (OSError). Check the URL, the endpoint and the credentials', then 'FILE:
    the destination disk is full (No space left on device). Free space and rerun', naming no disk."""
    options, _ = s3
    url, _ = remote_tfrecord
    cache = tmpfs("64m", "cache", options=f"nr_inodes={inodes}")
    pattern = (
        rf"^{re.escape(str(cache))}/(\S+): no space left on {re.escape(str(cache))} \(tmpfs of 64\.0 MiB, [0-9.]+ "
        r"MiB free, no inodes free\) while writing \S+ \(the pack's index and side tables, copied from the URL\)\. "
        r"Free space there, or pass cache_dir=DIR on a larger disk$"
    )
    with pytest.raises(packdata.CapacityError, match=pattern):
        packdata.TFRecordDataset(url, storage_options=options, cache_dir=cache)


@pytest.mark.root
def test_a_strangers_huge_side_table_stops_before_it_fills_the_cache(s3, remote_tfrecord, tmpfs) -> None:
    """A side table of a stranger's pack 24 MiB long, a cache of 16 MiB: the copy filled the disk (on a tmpfs
    /tmp: memory) and only then stopped, leaving it full. It now stops while a twentieth of the disk is free,
    and removes what it wrote."""
    options, fs = s3
    _, local = remote_tfrecord
    fs.put(str(local), "packs/huge-table", recursive=True)
    table = next(p for p in fs.find("packs/huge-table") if p.endswith(".tfindex"))
    fs.pipe(table, b"0 16\n" * (24 << 20 >> 5) * 6)  # 24 MiB of lines
    cache = tmpfs("16m", "cache")
    with pytest.raises(packdata.CapacityError, match=r"huge-table: the pack's index and side tables do not fit"):
        packdata.TFRecordDataset("s3://packs/huge-table", storage_options=options, cache_dir=cache)
    usage = shutil.disk_usage(cache)
    assert usage.free > usage.total - (1 << 20), usage  # the tag folder and its lock are left


def _open_at_once(url: str, options: dict, cache: str, barrier, out) -> None:
    """One rank: wait for the others, open the remote stream into the shared cache, send back its sorted samples."""
    try:
        barrier.wait(timeout=60)
        ds = packdata.TFRecordDataset(url, decode="bytes", storage_options=options, cache_dir=cache)
        out.put(("ok", sorted(data for data, _ in ds)))
    except Exception as exc:
        out.put(("error", f"{type(exc).__name__}: {exc}"))


def test_ranks_opening_a_remote_pack_on_a_fresh_cache_share_one_download(
    s3, remote_tfrecord, tmp_path: Path, monkeypatch
) -> None:
    import multiprocessing

    from packdata.formats import remote_pack

    options, _ = s3
    url, local = remote_tfrecord
    log = tmp_path / "downloads"
    download = remote_pack.download_skeleton

    def slow_download(*args, **kwargs):  # every rank that downloads is still at it when the first one finishes
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.3)
        return download(*args, **kwargs)

    monkeypatch.setattr(remote_pack, "download_skeleton", slow_download)
    ctx = multiprocessing.get_context("fork")  # the patched download reaches the ranks
    barrier, out = ctx.Barrier(8), ctx.Queue()
    ranks = [
        ctx.Process(target=_open_at_once, args=(url, options, str(tmp_path / "cache"), barrier, out)) for _ in range(8)
    ]
    for rank in ranks:
        rank.start()
    outcomes = [out.get(timeout=90) for _ in ranks]
    for rank in ranks:
        rank.join(timeout=30)
    expected = sorted(data for data, _ in packdata.TFRecordIndexedDataset(local, decode="bytes"))
    assert [status for status, _ in outcomes] == ["ok"] * 8, [why for status, why in outcomes if status != "ok"]
    assert all(samples == expected for _, samples in outcomes)
    assert len(log.read_text().split()) == 1  # one rank downloaded; the others waited and used its copy
    assert not list((tmp_path / "cache").rglob(".*partial*")) and not list((tmp_path / "cache").rglob(".*old*"))


_KILLED_DOWNLOAD = """
import json, sys, time
import packdata
from packdata.formats import remote_pack
download = remote_pack.download_skeleton
def stalled(*args, **kwargs):  # the partial copy is written; the process is killed before it renames it
    download(*args, **kwargs)
    print("downloaded", flush=True)
    time.sleep(60)
remote_pack.download_skeleton = stalled
packdata.TFRecordDataset(sys.argv[1], storage_options=json.loads(sys.argv[2]), cache_dir=sys.argv[3])
"""


def test_a_partial_copy_left_by_a_killed_download_is_removed_by_the_next_one(
    s3, remote_tfrecord, tmp_path: Path
) -> None:
    options, _ = s3
    url, local = remote_tfrecord
    cache = tmp_path / "cache"
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_DOWNLOAD, url, json.dumps(options), str(cache)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "downloaded"
    child.kill()  # SIGKILL: no clean-up runs
    child.wait()
    (stale,) = cache.rglob(".verify-tf.partial-*")
    assert stale.name == f".verify-tf.partial-{child.pid}" and (stale / "manifest.json").is_file()
    outside = tmp_path / "outside"
    (outside / "keep").mkdir(parents=True)
    (outside / "keep" / "data.bin").write_bytes(b"not the cache's")
    link = stale.with_name(".verify-tf.partial-99999999")
    link.symlink_to(outside / "keep")
    other = stale.with_name(".verify-tf.partial-1x")  # not a partial's name: left alone
    other.mkdir()
    ds = packdata.TFRecordDataset(url, decode="bytes", shuffle=False, storage_options=options, cache_dir=cache)
    assert sorted(data for data, _ in ds) == sorted(
        data for data, _ in packdata.TFRecordIndexedDataset(local, decode="bytes")
    )
    assert not stale.exists() and not os.path.lexists(link) and other.is_dir()
    assert (outside / "keep" / "data.bin").read_bytes() == b"not the cache's"  # the link went, never its target


@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_a_download_folder_that_is_a_link_or_a_file_is_replaced_never_written_through(
    s3, remote_pack, tmp_path: Path, kind: str
) -> None:
    """A link (or a file) planted at the cache's .NAME.partial: the download goes into a folder of its own."""
    options, _ = s3
    url, local = remote_pack
    cache, outside = tmp_path / "cache", tmp_path / "outside"
    cache.mkdir()
    outside.mkdir()
    _plant(cache / ".train.lmdb.partial", kind, outside)
    staged = packdata.stage(url, to=cache, storage_options=options, progress=False).staged
    assert not staged.is_symlink() and staged.parent == cache
    assert not any(outside.iterdir())  # nothing was downloaded through the link
    assert not os.path.lexists(cache / ".train.lmdb.partial")
    assert _samples(staged) == _samples(local)


@pytest.mark.root
@pytest.mark.parametrize("inodes", [5, 12])  # the disk fills at a shard's file, at the index folder
def test_a_read_only_or_full_cache_is_one_line_and_a_rerun_resumes(s3, remote_pack, tmpfs, inodes: int) -> None:
    """A cache that fills up after the room check (its files: another stage into it) stops with one line, which
    named the partial folder alone ('.train.lmdb.partial: the destination disk is full'), not the disk."""
    options, _ = s3
    url, local = remote_pack
    ro, full = tmpfs("1m", "ro", options="ro"), tmpfs("64m", "full", options=f"nr_inodes={inodes}")
    with pytest.raises(ConfigError, match=r"ro/cache: cannot write the destination \(Read-only file system\)"):
        packdata.stage(url, to=ro / "cache", storage_options=options, progress=False)
    with pytest.raises(  # the disk named as a local stage names it, and the remedy of a pack staged whole
        CapacityError,
        match=rf"no space left on {re.escape(str(full))} \(tmpfs of 64\.0 MiB, .* free\) while writing "
        r".* of the staged pack\. A pack is staged whole from a URL: free space or stage into another cache, "
        r"then stage again \(what was downloaded is kept\)$",
    ):
        packdata.stage(url, to=full, storage_options=options, progress=False)
    subprocess.run(["mount", "-o", "remount,nr_inodes=1000", str(full)], check=True)
    staged = packdata.stage(url, to=full, storage_options=options, progress=False)
    assert _samples(staged.staged) == _samples(local)


@pytest.mark.root
def test_a_cache_folder_a_full_disk_refuses_names_the_disk(s3, remote_pack, tmpfs) -> None:
    """A cache whose folder a full disk refused said 'CACHE: the destination disk is full (No space left on
    device). Free space and rerun', naming no disk; it is named as a full stage from a URL is, with its hint."""
    options, _ = s3
    url, _ = remote_pack
    disk = tmpfs("4m", "full", options="nr_inodes=1")
    cache = disk / "cache"
    pattern = (
        rf"{re.escape(str(cache))}: no space left on {re.escape(str(disk))} \(tmpfs of 4\.0 MiB, 4\.0 MiB free, "
        r"no inodes free\) while writing cache \(the staging area's folder\)\. A pack is staged whole from a URL: "
        r"free space or stage into another cache, then stage again \(what was downloaded is kept\)"
    )
    with pytest.raises(CapacityError) as caught:
        packdata.stage(url, to=cache, storage_options=options, progress=False)
    assert re.fullmatch(pattern, str(caught.value)), str(caught.value)
    assert os.listdir(disk) == []


_KILLED_SWAP = """
import json, os, sys, time
import packdata
rename = os.rename
def stalled(src, dst):  # the old copy is moved aside; the process is killed before the new one takes its name
    rename(src, dst)
    if ".old-" in os.fspath(dst):
        print("swapping", flush=True)
        time.sleep(60)
os.rename = stalled
url, options, cache, how = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
if how == "stage":
    packdata.stage(url, to=cache, storage_options=options, progress=False)
else:
    packdata.TFRecordDataset(url, storage_options=options, cache_dir=cache)
"""


_KILLED_SWEEP = killed_at_staged_json_delete(
    "import json\nimport packdata",
    "packdata.stage(sys.argv[1], to=sys.argv[3], storage_options=json.loads(sys.argv[2]), progress=False)",
)


def test_a_stage_killed_while_it_sweeps_an_old_copy_leaves_it_marked(s3, remote_pack, tmp_path: Path) -> None:
    """The next stage of NAME deletes an old copy a killed swap left as unstage does: staged.json last."""
    options, _ = s3
    url, _ = remote_pack
    cache = tmp_path / "cache"
    entry = packdata.stage(url, to=cache, storage_options=options, progress=False).staged
    aside = entry.with_name(".train.lmdb.old-4242")
    os.rename(entry, aside)  # as a stage killed between the renames of its swap leaves it
    child = subprocess.run([sys.executable, "-c", _KILLED_SWEEP, url, json.dumps(options), str(cache)], timeout=120)
    assert child.returncode == -signal.SIGKILL
    assert sorted(p.name for p in aside.iterdir()) == ["staged.json"]
    assert packdata.unstage(cache).removed == [aside] and not aside.exists()


@pytest.mark.parametrize("how", ["cache", "stage"])
def test_an_old_copy_left_by_a_process_killed_mid_swap_is_removed_by_the_next_one(
    s3, remote_pack, remote_tfrecord, tmp_path: Path, how: str
) -> None:
    """A kill between the two renames of a swap leaves the whole old copy as .NAME.old-PID; the next swap removes it."""
    options, _ = s3
    url, local = remote_pack if how == "stage" else remote_tfrecord
    cache = tmp_path / "cache"
    if how == "stage":
        entry = packdata.stage(url, to=cache, storage_options=options, progress=False).staged
        marker = json.loads((entry / "staged.json").read_text())
        (entry / "staged.json").write_text(json.dumps({**marker, "manifest_sha256": "0" * 64}))  # an outdated copy
    else:
        packdata.TFRecordDataset(url, storage_options=options, cache_dir=cache)
        (entry,) = cache.glob("*/verify-tf")
        (entry / "manifest.json").write_bytes((entry / "manifest.json").read_bytes() + b" ")  # an outdated copy
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SWAP, url, json.dumps(options), str(cache), how],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "swapping"
    child.kill()  # SIGKILL between the renames: no clean-up runs
    child.wait()
    stale = entry.with_name(f".{entry.name}.old-{child.pid}")
    assert stale.is_dir() and not entry.exists()
    outside = tmp_path / "outside"
    (outside / "keep").mkdir(parents=True)
    (outside / "keep" / "data.bin").write_bytes(b"not the cache's")
    link = entry.with_name(f".{entry.name}.old-99999999")
    link.symlink_to(outside / "keep")
    other = entry.with_name(f".{entry.name}.old-1x")  # not an old copy's name: left alone
    other.mkdir()
    if how == "stage":
        packdata.stage(url, to=cache, storage_options=options, progress=False)
        assert _samples(entry) == _samples(local)
    else:
        ds = packdata.TFRecordDataset(url, decode="bytes", shuffle=False, storage_options=options, cache_dir=cache)
        assert sorted(data for data, _ in ds) == sorted(
            data for data, _ in packdata.TFRecordIndexedDataset(local, decode="bytes")
        )
    assert not stale.exists() and not os.path.lexists(link) and other.is_dir()
    assert (outside / "keep" / "data.bin").read_bytes() == b"not the cache's"  # the link went, never its target
