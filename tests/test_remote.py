"""Packs in object storage: staging from a real local S3 server (moto in server mode), once per node."""

from __future__ import annotations

import gc
import importlib.util
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import faulty_s3, flip_label, image_bytes, moto_s3, tar_with_a_hard_link, tree_digest
from faults.hostile import rewrite_manifest
from torch.utils.data import DataLoader

import packdata
from packdata.cli import main
from packdata.conversion.download import download_source
from packdata.conversion.upload import work_folder
from packdata.errors import CapacityError, ConfigError, PackdataError, PackFormatError, SourceError
from packdata.pack.manifest import read_manifest
from packdata.pack.urls import display_url

pytest.importorskip("moto.server", reason="the tests' S3 server needs moto[server] (the dev extra)")
s3fs = pytest.importorskip("s3fs", reason="s3:// needs s3fs (pip install 'packdata[s3]')")

SECRET = "never-print-this-secret-9f3c"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory):
    """A moto S3 server on loopback with dummy credentials in the environment; yields (storage_options, filesystem)."""
    env = {"AWS_ACCESS_KEY_ID": "testing-key-id", "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with moto_s3({}) as (options, fs):
            yield options, fs
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def remote_pack(s3, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A 3-shard LMDB pack converted locally and uploaded to s3://packs/train.lmdb."""
    _, fs = s3
    root = tmp_path_factory.mktemp("remote")
    src = root / "src"
    for c in ("cat", "dog"):
        (src / c).mkdir(parents=True)
        for i in range(9):
            (src / c / f"{i}.jpg").write_bytes(image_bytes(i + 10 * len(c), (40, 30)))
    local = root / "train.lmdb"
    packdata.convert(src, local, shard_samples=6, progress=False)
    fs.put(str(local), "packs/train.lmdb", recursive=True)
    return "s3://packs/train.lmdb", local


def _samples(pack: Path) -> list[tuple[str, bytes, int]]:
    ds = packdata.LMDBDataset(pack, decode="bytes")
    return [(ds.keys[i], *ds[i]) for i in range(len(ds))]


def test_stage_from_s3_downloads_verifies_and_then_reuses(s3, remote_pack, tmp_path: Path) -> None:
    options, _ = s3
    url, local = remote_pack
    result = packdata.stage(url, to=tmp_path / "cache", storage_options=options, progress=False)
    assert result.downloaded and result.staged == tmp_path / "cache" / "train.lmdb"
    assert _samples(result.staged) == _samples(local)
    assert packdata.verify_pack(result.staged, progress=False).records == 18
    again = packdata.stage(url, to=tmp_path / "cache", storage_options=options, progress=False)
    assert not again.downloaded and again.bytes_downloaded == 0
    assert not list((tmp_path / "cache").glob(".*partial*"))


@pytest.mark.parametrize("lost", ["shard-00001.lmdb/data.mdb", "index/keys.utf8"])
def test_a_staged_copy_that_lost_a_file_is_downloaded_again(s3, remote_pack, tmp_path: Path, lost: str) -> None:
    """A staged copy that lost a shard (a clean-up of the cache) was reused by the next stage, as complete: the
    reader's error said 'convert or stage it again', and staging again changed nothing."""
    options, _ = s3
    url, local = remote_pack
    staged = packdata.stage(url, to=tmp_path, storage_options=options, progress=False).staged
    (staged / lost).unlink()
    result = packdata.stage(url, to=tmp_path, storage_options=options, progress=False)
    assert result.downloaded and result.staged == staged
    assert _samples(staged) == _samples(local)


@pytest.mark.parametrize("damaged", ["shard-00001.lmdb/data.mdb", "shard-00001.lmdb/records.i64"])
def test_a_staged_copy_written_to_at_the_same_size_is_downloaded_again(
    s3, remote_pack, tmp_path: Path, damaged: str
) -> None:
    """A staged copy was reused when each file had its size: a shard (or side table) overwritten in place kept
    failing readers with '... (a staged copy: stage it again)', and staging again changed nothing."""
    options, _ = s3
    url, local = remote_pack
    staged = packdata.stage(url, to=tmp_path, storage_options=options, progress=False).staged
    data = bytearray((staged / damaged).read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
    with open(staged / damaged, "r+b") as f:  # in place: the same file, the same size
        f.write(data)
    result = packdata.stage(url, to=tmp_path, storage_options=options, progress=False)
    assert result.downloaded and result.staged == staged
    assert (staged / damaged).read_bytes() == (local / damaged).read_bytes()
    assert _samples(staged) == _samples(local)
    assert not packdata.stage(url, to=tmp_path, storage_options=options, progress=False).downloaded


def test_a_staged_copy_from_a_url_damaged_without_a_write_advises_unstaging_it_first(
    s3, remote_pack, tmp_path: Path
) -> None:
    """Damage no write made (a failing disk) leaves each file's stamp as staged, so staging again reused the
    copy, while the reader's hint said only 'a staged copy: stage it again': the damage stayed, every time."""
    from packdata.pack.files import file_stamp

    options, _ = s3
    url, local = remote_pack
    staged = packdata.stage(url, to=tmp_path, storage_options=options, progress=False).staged
    flip_label(staged)
    marker = json.loads((staged / "staged.json").read_text())
    marker["stamps"] = {rel: file_stamp(staged / rel) for rel in marker["stamps"]}  # as a failing disk leaves them
    (staged / "staged.json").write_text(json.dumps(marker))
    with pytest.raises(PackFormatError, match=r"labels\.i32: .*one staged from a URL: `packdata unstage` it first\)$"):
        packdata.LMDBDataset(staged)
    packdata.unstage(staged)
    assert packdata.stage(url, to=tmp_path, storage_options=options, progress=False).downloaded
    assert _samples(staged) == _samples(local)


def test_stage_from_s3_refuses_to_download_into_an_interrupted_conversion(
    s3, remote_pack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed convert's ``.NAME.partial`` was taken for the stage's own download: files were fetched into it."""
    from tests.test_convert import _interrupted_convert

    options, _ = s3
    url, _local = remote_pack
    src = tmp_path / "src" / "cat"
    src.mkdir(parents=True)
    for i in range(8):
        (src / f"{i}.jpg").write_bytes(image_bytes(i, (40, 30)))
    cache = tmp_path / "cache"
    _interrupted_convert(src.parent, cache / "train.lmdb", monkeypatch)
    partial = cache / ".train.lmdb.partial"
    before = tree_digest(partial)
    with pytest.raises(packdata.ConfigError, match=r"lmdb\.partial is an interrupted conversion into train\.lmdb"):
        packdata.stage(url, to=cache, storage_options=options, progress=False)
    assert tree_digest(partial) == before and not (cache / "train.lmdb").exists()


def test_a_file_without_a_digest_left_by_an_interrupted_stage_is_downloaded_again(
    s3, remote_pack, tmp_path: Path
) -> None:
    """A side table (or skip report, or an old pack's index file: no digest in the manifest) of the right size in
    the .NAME.partial of an interrupted stage was kept as downloaded, though another pack's stage (or this URL's
    before it was converted again) may have left it: the staged copy held another shard's table."""
    options, _ = s3
    url, local = remote_pack
    cache = tmp_path / "cache"
    partial = cache / ".train.lmdb.partial" / "shard-00000.lmdb"
    partial.mkdir(parents=True)
    other = (local / "shard-00001.lmdb" / "records.i64").read_bytes()
    assert (
        len(other) == (local / "shard-00000.lmdb" / "records.i64").stat().st_size
        and other != (local / "shard-00000.lmdb" / "records.i64").read_bytes()
    )
    (partial / "records.i64").write_bytes(other)  # the right size, another table
    staged = packdata.stage(url, to=cache, storage_options=options, progress=False).staged
    for rel in ("shard-00000.lmdb/records.i64", "shard-00001.lmdb/records.i64"):
        assert (staged / rel).read_bytes() == (local / rel).read_bytes(), rel
    assert _samples(staged) == _samples(local)


@pytest.mark.parametrize(
    ("store", "change"), [("s3", "larger"), ("s3", "same size"), ("memory", "larger"), ("memory", "same size")]
)
def test_a_file_without_a_digest_rewritten_at_the_url_while_staging_is_named_and_never_staged(
    s3, remote_pack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store: str, change: str
) -> None:
    """An older pack's labels.i32 (no digest in its manifest) rewritten at the URL after the stage looked its size
    up: a larger one was cut to its first bytes and a same-size one taken whole, and the staged copy read other
    labels, silently (the label range check passes)."""
    import fsspec

    from packdata.staging import remote

    options, fs = s3
    older = tmp_path / "older.lmdb"
    shutil.copytree(remote_pack[1], older)
    rewrite_manifest(older, lambda d: d["index"].pop("sha256"))
    labels = np.fromfile(older / "index" / "labels.i32", dtype="<i4")
    new = np.concatenate([labels, labels[:1]]) if change == "larger" else labels ^ 1
    url = f"s3://packs/older-{change.replace(' ', '-')}.lmdb" if store == "s3" else "memory://older/changed.lmdb"
    target, store_options = (fs, options) if store == "s3" else (fsspec.filesystem("memory"), None)
    target.put(str(older), url, recursive=True)
    check_room = remote._check_room

    def rewritten_after_the_look_up(*args, **kwargs):
        target.pipe_file(f"{url}/index/labels.i32", new.astype("<i4").tobytes())
        return check_room(*args, **kwargs)

    monkeypatch.setattr(remote, "_check_room", rewritten_after_the_look_up)
    cache = tmp_path / "cache"
    try:
        with pytest.raises(PackFormatError, match=rf"^{url}/index/labels\.i32: (is larger than|was rewritten)"):
            packdata.stage(url, to=cache, storage_options=store_options, progress=False)
    finally:
        if store == "memory":
            target.rm("/older", recursive=True)
    assert not (cache / url.rsplit("/", 1)[1]).exists()


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


_RANK = """
import json, sys
import packdata
result = packdata.stage(sys.argv[1], to=sys.argv[2], storage_options=json.loads(sys.argv[3]), progress=False)
print(json.dumps({"downloaded": result.downloaded, "n": len(packdata.LMDBDataset(result.staged))}))
"""


def test_every_rank_stages_and_one_downloads(s3, remote_pack, tmp_path: Path) -> None:
    options, _ = s3
    url, _ = remote_pack
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, url, str(tmp_path / "cache"), json.dumps(options)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outcomes = []
    for rank in ranks:
        out, err = rank.communicate(timeout=120)
        assert rank.returncode == 0, err
        outcomes.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(o["downloaded"] for o in outcomes) == [False, False, False, True]
    assert {o["n"] for o in outcomes} == {18}


def test_a_damaged_remote_shard_is_named_and_never_staged(s3, remote_pack, tmp_path: Path) -> None:
    options, fs = s3
    _, local = remote_pack
    fs.put(str(local), "packs/bad.lmdb", recursive=True)
    data = bytearray(fs.cat_file("packs/bad.lmdb/shard-00001.lmdb/data.mdb"))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file("packs/bad.lmdb/shard-00001.lmdb/data.mdb", bytes(data))
    with pytest.raises(PackFormatError, match=r"s3://packs/bad\.lmdb: shard-00001\.lmdb/data\.mdb does not match"):
        packdata.stage("s3://packs/bad.lmdb", to=tmp_path / "cache", storage_options=options, progress=False)
    assert not (tmp_path / "cache" / "bad.lmdb").exists()
    fs.put(str(local), "packs/flip.lmdb", recursive=True)  # a label bit flipped, the label still a class
    labels = np.fromfile(local / "index" / "labels.i32", dtype="<i4")
    labels[0] ^= 1
    fs.pipe_file("packs/flip.lmdb/index/labels.i32", labels.tobytes())
    with pytest.raises(PackFormatError, match=r"s3://packs/flip\.lmdb: index/labels\.i32 does not match"):
        packdata.stage("s3://packs/flip.lmdb", to=tmp_path / "cache", storage_options=options, progress=False)
    assert not (tmp_path / "cache" / "flip.lmdb").exists()


@pytest.mark.parametrize("damage", ["truncated", "empty", "missing"])
def test_a_shard_object_shorter_than_its_manifest_or_missing_is_named_by_its_url_at_stage(
    s3, remote_pack, tmp_path: Path, damage: str
) -> None:
    """A shard object cut short, emptied or deleted at the URL: stage said '... is shorter than expected (it changed
    while staging). Rerun' or blamed the network ('rerun to resume... check the credentials'); no rerun helps."""
    options, fs = s3
    url = f"s3://packs/short-{damage}.lmdb"
    fs.put(str(remote_pack[1]), url, recursive=True)
    shard = f"{url}/shard-00000.lmdb/data.mdb"
    size = fs.size(shard)
    if damage == "missing":
        fs.rm_file(shard)
    else:
        fs.pipe_file(shard, fs.cat_file(shard)[: size // 2 if damage == "truncated" else 0])
    expected = (
        "is missing" if damage == "missing" else rf"the object is {size // 2 if damage == 'truncated' else 0} bytes"
    )
    with pytest.raises(PackFormatError, match=rf"^{shard}: {expected}"):
        packdata.stage(url, to=tmp_path / "cache", storage_options=options, progress=False)
    assert not (tmp_path / "cache" / f"short-{damage}.lmdb").exists()


def test_a_remote_manifest_of_a_staged_pack_is_refused_before_a_local_path_it_names_is_read(
    s3, remote_tfrecord, tmp_path: Path
) -> None:
    """A manifest at a URL that says it is a staged pack, its shards at absolute paths: each path's folder on this
    machine was read as the shard's origin pack before the refusal, and the error told what lay there."""
    options, fs = s3
    pack = tmp_path / "staged"
    shutil.copytree(remote_tfrecord[1], pack)
    origin = tmp_path / "origin-on-this-machine"
    rewrite_manifest(pack, lambda d: (d.__setitem__("staged_from", str(origin)),
                                      d["shards"][0].__setitem__("file", str(origin / "x.tfrecord"))))  # fmt: skip
    fs.put(str(pack), "packs/staged-manifest", recursive=True)
    url = "s3://packs/staged-manifest"
    for opened in (
        lambda: packdata.TFRecordDataset(url, storage_options=options, cache_dir=tmp_path / "cache"),
        lambda: packdata.stage(url, to=tmp_path / "cache", storage_options=options, progress=False),
    ):
        with pytest.raises(PackFormatError, match=rf"^{url}/manifest\.json: is a staged pack's manifest\. ") as raised:
            opened()
        assert str(origin) not in str(raised.value)


@pytest.mark.parametrize("clash", ["side-table", "skip-report"])
def test_a_remote_manifest_naming_one_file_twice_is_refused_before_a_download(
    s3, remote_tfrecord, tmp_path: Path, clash: str
) -> None:
    """A stranger's manifest names a shard as another's offsets index, or its skip report as a shard."""
    options, fs = s3
    _, local = remote_tfrecord
    pack = tmp_path / "pack"
    shutil.copytree(local, pack)
    first, second = (s.file for s in read_manifest(pack).shards[:2])
    index = first.removesuffix(".tfrecord") + ".tfindex"
    if clash == "side-table":
        os.replace(pack / second, pack / index)
        rewrite_manifest(pack, lambda d: d["shards"][1].__setitem__("file", index))
        expected = rf"manifest names '{index}' as a side table of shard 0 and as shard 1"
    else:
        rewrite_manifest(pack, lambda d: d["skipped"].__setitem__("report", first))
        expected = rf"manifest names '{first}' as shard 0 and as the skip report"
    fs.put(str(pack), f"packs/clash-{clash}", recursive=True)
    cache = tmp_path / "cache"
    with pytest.raises(PackFormatError, match=rf"^s3://packs/clash-{clash}/manifest\.json: {expected}"):
        packdata.stage(f"s3://packs/clash-{clash}", to=cache, storage_options=options, progress=False)
    assert not cache.exists()  # no download, no copy, nor the cache folder the refused stage made


def test_a_refused_url_stage_leaves_no_folder_it_made(s3, remote_pack, tmp_path: Path) -> None:
    """It left the cache folder it made (and those above), and an empty .NAME.partial after a cache-limit refusal."""
    options, _ = s3
    url, _ = remote_pack
    cache = tmp_path / "new" / "cache"
    with pytest.raises(PackdataError, match=r"^s3://packs/nothere\.lmdb: no manifest\.json there"):
        packdata.stage("s3://packs/nothere.lmdb", to=cache, storage_options=options, progress=False)
    assert not (tmp_path / "new").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    for to in (cache, mine):
        with pytest.raises(CapacityError, match=r"the cache limit of 1,000 bytes cannot hold the pack"):
            packdata.stage(url, to=to, storage_options=options, progress=False, cache_limit=1000)
    assert not (tmp_path / "new").exists()
    assert mine.is_dir() and not any(mine.iterdir())  # a folder that was there stays


def test_a_remote_manifest_error_names_the_manifest_by_its_url(s3, remote_pack, tmp_path: Path) -> None:
    """Not the temporary file the manifest was checked in, which is gone by the time the error is read."""
    options, fs = s3
    _, local = remote_pack
    pack = tmp_path / "evil.lmdb"
    shutil.copytree(local, pack)
    rewrite_manifest(pack, lambda d: d["shards"][0].__setitem__("file", "../../etc"))
    fs.put(str(pack), "packs/evil.lmdb", recursive=True)
    out = _cli("info", "s3://packs/evil.lmdb", options=options)
    assert out.exit_code == 1 and out.output.startswith(
        "Error: s3://packs/evil.lmdb/manifest.json: manifest field 'shards[0].file' should"
    ), out.output
    assert out.output.count("\n") == 1 and "packdata-manifest-" not in out.output


@pytest.mark.parametrize("planted", ["symlink", "folder anyone may write in"])
def test_default_work_folders_are_never_ones_another_user_may_change(
    s3, remote_tfrecord, tmp_path: Path, monkeypatch, planted: str
) -> None:
    """In a shared /tmp another user may make packdata's folder first, or a link there to a folder they chose."""
    options, _ = s3
    url, local = remote_tfrecord
    shared, chosen = tmp_path / "shared-tmp", tmp_path / "chosen"
    shared.mkdir()
    chosen.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    monkeypatch.delenv("PACKDATA_TMP", raising=False)
    for kind in ("remote", "upload"):
        for name in (f"packdata-{kind}", f"packdata-{kind}-{os.getuid()}"):  # the older name, and this version's
            if planted == "symlink":
                (shared / name).symlink_to(chosen)
            else:
                (shared / name).mkdir()
                (shared / name).chmod(0o777)
    problem = "a symlink, not a folder" if planted == "symlink" else "a folder others may write in"
    with pytest.raises(ConfigError, match=rf"packdata-remote-{os.getuid()}: is {problem}: packdata keeps no files"):
        packdata.TFRecordDataset(url, storage_options=options)
    with pytest.raises(ConfigError, match=rf"packdata-upload-{os.getuid()}: is {problem}: .*PACKDATA_TMP"):
        work_folder("s3://packs/new.lmdb")
    assert not any(chosen.iterdir()) and not any(p.is_dir() and any(p.iterdir()) for p in shared.iterdir())
    for entry in shared.iterdir():
        entry.unlink() if entry.is_symlink() else entry.rmdir()
    expected = sorted(data for data, _ in packdata.TFRecordIndexedDataset(local, decode="bytes"))
    ds = packdata.TFRecordDataset(url, decode="bytes", shuffle=False, storage_options=options)
    assert sorted(data for data, _ in ds) == expected
    assert (shared / f"packdata-remote-{os.getuid()}").stat().st_mode & 0o777 == 0o700


def test_a_remote_pack_named_dot_dot_is_cached_in_its_own_folder(s3, remote_tfrecord, tmp_path: Path) -> None:
    """An object store keeps '..' as a plain name: s3://packs/dots/.. is a pack, never the cache folder's parent."""
    options, fs = s3
    _, local = remote_tfrecord
    fs.put(str(local), "packs/dots/..", recursive=True)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "notes.txt").write_text("mine")
    ds = packdata.TFRecordDataset("s3://packs/dots/..", decode="bytes", storage_options=options, cache_dir=cache)
    expected = sorted(data for data, _ in packdata.TFRecordIndexedDataset(local, decode="bytes"))
    assert sorted(data for data, _ in ds) == expected
    (tag,) = (p for p in cache.iterdir() if p.is_dir())
    assert sorted(p.name for p in cache.iterdir()) == sorted(["notes.txt", tag.name])
    assert [p.name for p in tag.iterdir() if not p.name.endswith(".lock")] == ["pack"]


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


def test_a_cached_copy_that_lost_a_file_is_downloaded_again(s3, remote_tfrecord, tmp_path: Path) -> None:
    """A clean-up of the cache (or a full disk) took an offsets index and cut the keys: not a pack to read so."""
    options, _ = s3
    url, local = remote_tfrecord
    cache = tmp_path / "cache"
    expected = sorted(data for data, _ in packdata.TFRecordIndexedDataset(local, decode="bytes"))
    ds = packdata.TFRecordDataset(url, decode="bytes", storage_options=options, cache_dir=cache)
    assert sorted(data for data, _ in ds) == expected
    next(cache.rglob("*.tfindex")).unlink()
    (keys,) = cache.rglob("keys.utf8")
    os.truncate(keys, keys.stat().st_size // 2)
    ds = packdata.TFRecordDataset(url, decode="bytes", storage_options=options, cache_dir=cache)
    assert sorted(data for data, _ in ds) == expected
    assert keys.read_bytes() == (local / "index" / "keys.utf8").read_bytes()


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
    """Once 'cannot read index/labels.i32 (OSError). Check the URL, the endpoint and the credentials'."""
    options, _ = s3
    url, _ = remote_tfrecord
    cache = tmpfs("64m", "cache", options=f"nr_inodes={inodes}")
    with pytest.raises(packdata.CapacityError, match=rf"^{re.escape(str(cache))}/.*: the destination disk is full"):
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


def test_a_url_replaces_only_its_own_staged_copy(s3, remote_pack, tmp_path: Path) -> None:
    options, _ = s3
    url, local = remote_pack
    cache = tmp_path / "cache"
    (cache / "train.lmdb").mkdir(parents=True)
    (cache / "train.lmdb" / "thesis.tex").write_text("three years of work")  # a user's folder, not a staged pack
    args = ["stage", url, "--to", str(cache), "--storage-options", json.dumps(options), "-q"]
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 1 and out.output == (
        f"Error: {cache / 'train.lmdb'}: exists and is not a staged pack. Choose another --to DIR or --name NAME; "
        "packdata only writes into packs it staged\n"
    )
    assert (cache / "train.lmdb" / "thesis.tex").read_text() == "three years of work"
    assert sorted(p.name for p in cache.iterdir()) == ["train.lmdb"]  # nothing downloaded
    (cache / "train.lmdb" / "thesis.tex").unlink()
    packdata.stage(local, to=cache, progress=False)  # a local pack's staged copy under the same name
    with pytest.raises(packdata.ConfigError, match=rf"train\.lmdb: holds a staged copy of another pack \({local}\)"):
        packdata.stage(url, to=cache, storage_options=options, progress=False)
    assert json.loads((cache / "train.lmdb" / "staged.json").read_text())["origin"] == str(local)
    packdata.unstage(cache / "train.lmdb")
    first = packdata.stage(url, to=cache, storage_options=options, progress=False)
    marker = json.loads((first.staged / "staged.json").read_text())
    (first.staged / "staged.json").write_text(json.dumps({**marker, "manifest_sha256": "0" * 64}))  # outdated
    again = packdata.stage(url, to=cache, storage_options=options, progress=False)  # its own copy: replaced
    assert again.downloaded and _samples(again.staged) == _samples(local)
    assert sorted(p.name for p in cache.iterdir()) == ["train.lmdb"]


def test_a_pack_whose_url_differs_only_in_its_user_part_never_replaces_a_staged_copy(
    remote_pack, tmp_path: Path
) -> None:
    """abfs://CONTAINER@account/train names a container: staging a second container's train into the cache took the
    first's staged copy for its own (both 'staged from abfs://account/train') and replaced it, a different pack."""
    import fsspec

    _, local = remote_pack
    memory = fsspec.filesystem("memory")  # fsspec's own in-memory store: URLs with a user part, as Azure's
    other = tmp_path / "other"
    packdata.convert(_two_classes(tmp_path / "src", seed=5), other, format="lmdb", progress=False)
    memory.put(str(local), "/alpha@account/train", recursive=True)
    memory.put(str(other), "/bravo:hunter2@account/train", recursive=True)  # a user part with a password
    cache = tmp_path / "cache"
    try:
        first = packdata.stage("memory://alpha@account/train", to=cache, progress=False)
        with pytest.raises(packdata.ConfigError, match=r"train: holds a staged copy of another pack") as refused:
            packdata.stage("memory://bravo:hunter2@account/train", to=cache, progress=False)
        assert "hunter2" not in str(refused.value)
        assert _samples(first.staged) == _samples(local)  # the first pack's copy, untouched
        again = packdata.stage("memory://alpha@account/train", to=cache, progress=False)
        assert not again.downloaded and again.staged == first.staged
        second = packdata.stage("memory://bravo:hunter2@account/train", to=cache, name="train2", progress=False)
        assert _samples(second.staged) == _samples(other)
        assert "hunter2" not in (second.staged / "staged.json").read_text()
    finally:
        memory.rm(["/alpha@account", "/bravo:hunter2@account"], recursive=True)


@pytest.mark.parametrize("name", ["../escaped", ""])
def test_a_name_that_is_not_a_plain_folder_name_is_refused_for_a_url(s3, remote_pack, tmp_path: Path, name) -> None:
    options, _ = s3
    url, _ = remote_pack
    cache = tmp_path / "cache"
    with pytest.raises(packdata.ConfigError, match=r"cache: the staged pack's name should be one plain folder name"):
        packdata.stage(url, to=cache, name=name, storage_options=options, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_messages_name_an_azure_container_and_never_a_user_part_that_may_be_a_credential() -> None:
    """abfs://CONTAINER@account/x was shown as abfs://account/x: every message about two containers' packs alike."""
    if importlib.util.find_spec("adlfs") is None:  # the message that the Azure filesystem is not installed
        out = CliRunner().invoke(main, ["verify", "abfs://c1@account/train"])
        assert out.exit_code == 1 and out.output.startswith("Error: abfs://c1@account/train: "), out.output
    assert display_url("abfs://c1@account/train") == "abfs://c1@account/train"
    assert display_url("az://c2@account.dfs.core.windows.net/x?sig=token") == "az://c2@account.dfs.core.windows.net/x"
    for url in (f"abfss://c1:{SECRET}@account/x", f"https://{SECRET}@host/x", f"s3://key:{SECRET}@bucket/x"):
        assert SECRET not in display_url(url) and display_url(url).endswith("/x")


def test_errors_never_show_credentials(s3, tmp_path: Path) -> None:
    options, _ = s3
    with pytest.raises(PackFormatError) as info:
        packdata.stage("s3://packs/nothere.lmdb", to=tmp_path / "cache", storage_options=options, progress=False)
    assert "s3://packs/nothere.lmdb: no manifest.json there" in str(info.value)
    assert SECRET not in str(info.value) and "testing-key-id" not in str(info.value)
    url = f"s3://testing-key-id:{SECRET}@packs/nothere.lmdb"
    out = CliRunner().invoke(
        main, ["stage", url, "--to", str(tmp_path / "c2"), "--storage-options", json.dumps(options), "-q"]
    )
    assert out.exit_code == 1 and SECRET not in out.output


def test_cli_stage_from_a_url(s3, remote_pack, tmp_path: Path) -> None:
    options, _ = s3
    url, _ = remote_pack
    args = ["stage", url, "--to", str(tmp_path / "cache"), "--storage-options", json.dumps(options), "-q"]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    assert "staged s3://packs/train.lmdb ->" in first.output and "downloaded" in first.output
    second = CliRunner().invoke(main, args)
    assert "already staged here" in second.output


def test_info_reads_a_remote_manifest(s3, remote_pack) -> None:
    options, _ = s3
    url, _ = remote_pack
    out = CliRunner().invoke(main, ["info", url, "--storage-options", json.dumps(options)])
    assert out.exit_code == 0, out.output
    assert "pack:     s3://packs/train.lmdb" in out.output and "samples:  18" in out.output


_HUGE_MANIFEST = """
import json, sys, tracemalloc
import packdata
from packdata.pack.manifest import schema
schema.MAX_MANIFEST_BYTES = 1 << 20  # as the real 256 MiB, at test scale
options = json.loads(sys.argv[1])
packdata.pack_info("s3://packs/train.lmdb", storage_options=options)  # every import and connection made
tracemalloc.start()
try:
    packdata.pack_info("s3://packs/huge", storage_options=options)
except packdata.PackFormatError as exc:
    print(exc)
print(tracemalloc.get_traced_memory()[1])
"""


def test_a_remote_manifest_past_the_size_limit_is_refused_without_downloading_it(s3, remote_pack) -> None:
    """A stranger's bucket whose manifest.json is huge: read up to the limit, never held whole in memory."""
    options, fs = s3
    fs.pipe_file("packs/huge/manifest.json", b'{"format": "lmdb", "pad": "' + b"x" * (64 << 20) + b'"}')
    child = subprocess.run(
        [sys.executable, "-c", _HUGE_MANIFEST, json.dumps(options)], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr[-2000:]
    message, peak = child.stdout.splitlines()
    assert message.startswith("s3://packs/huge/manifest.json: manifest is larger than 1 MiB. "), message
    assert int(peak) < 16 << 20, f"{int(peak):,} bytes held at once reading a 64 MiB manifest"


def test_convert_into_s3_uploads_the_manifest_last_and_resumes(s3, tmp_path: Path, monkeypatch) -> None:
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    src = tmp_path / "src" / "cls"
    src.mkdir(parents=True)
    for i in range(8):
        (src / f"{i}.jpg").write_bytes(image_bytes(i, (30, 20)))
    url = "s3://packs/converted.lmdb"
    import packdata.conversion.upload as upload

    real_put = fs.put_file  # fsspec caches filesystems: convert gets this very instance
    calls: list[str] = []

    def failing_put(lpath, rpath, *args, **kwargs):  # the network drops after two uploads
        calls.append(rpath)
        if len(calls) >= 3:
            raise OSError("connection reset")
        return real_put(lpath, rpath, *args, **kwargs)

    monkeypatch.setattr(fs, "put_file", failing_put)
    with pytest.raises(PackFormatError, match=r"s3://packs/converted\.lmdb: uploading .* failed"):
        packdata.convert(tmp_path / "src", url, shard_samples=3, storage_options=options, progress=False, workers=1)
    assert not fs.exists("packs/converted.lmdb/manifest.json")  # no manifest: no pack
    monkeypatch.setattr(fs, "put_file", real_put)
    result = packdata.convert(
        tmp_path / "src", url, shard_samples=3, storage_options=options, progress=False, resume=True
    )
    assert result.pack == url and result.packed == 8
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").rglob("manifest.json"))
    staged = packdata.stage(url, to=tmp_path / "cache", storage_options=options, progress=False)
    assert len(packdata.LMDBDataset(staged.staged)) == 8
    with pytest.raises(packdata.ConfigError, match="a pack already exists there"):
        packdata.convert(tmp_path / "src", url, storage_options=options, progress=False)
    assert upload.work_folder(url).name == "converted.lmdb"


def _two_classes(src: Path, seed: int) -> Path:
    """``cat/`` and ``dog/``, 5 small JPEGs each."""
    for c in ("cat", "dog"):
        (src / c).mkdir(parents=True)
        for i in range(5):
            (src / c / f"{i}.jpg").write_bytes(image_bytes(i + seed * len(c), (30, 20)))
    return src


@pytest.mark.parametrize(("fmt", "interrupted"), [("tfrecord", False), ("lmdb", False), ("tfrecord", True)])
def test_overwriting_a_url_pack_of_more_shards_removes_the_old_packs_objects_and_nothing_else(
    s3, tmp_path: Path, monkeypatch, fmt: str, interrupted: bool
) -> None:
    """convert --overwrite into a URL whose pack had more shards left the old shards (and their side tables) at
    the URL, outside any manifest: a glob of *.tfrecord read both packs' records, and they were paid for."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    src = _two_classes(tmp_path / "src", 7)
    url = f"s3://packs/shrunk-{fmt}-{interrupted}"
    root = url.removeprefix("s3://")
    packdata.convert(src, url, format=fmt, shard_samples=2, storage_options=options, progress=False)
    stranger = {f"{root}/notes.txt": b"a stranger's", f"{root}/other-00009-of-00010.tfrecord": b"not in a manifest"}
    fs.pipe(stranger)
    if interrupted:  # the old manifest ended, then the upload failed: the rerun still knows the old pack's objects
        real_put = fs.put_file

        def no_manifest(lpath, rpath, *args, **kwargs):
            if rpath.endswith("manifest.json"):
                raise OSError("connection reset")
            return real_put(lpath, rpath, *args, **kwargs)

        monkeypatch.setattr(fs, "put_file", no_manifest)
        with pytest.raises(PackFormatError, match=r"uploading manifest\.json failed"):
            packdata.convert(
                src, url, format=fmt, shard_samples=5, storage_options=options, progress=False, overwrite=True
            )
        monkeypatch.setattr(fs, "put_file", real_put)
    packdata.convert(
        src, url, format=fmt, shard_samples=5, storage_options=options, progress=False, overwrite=True, resume=True
    )
    local = tmp_path / url.rsplit("/", 1)[1]  # the same name: the same shard names
    packdata.convert(src, local, format=fmt, shard_samples=5, progress=False)
    fs.invalidate_cache()
    expected = {p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file() and p.name != "lock.mdb"}
    found = {p.removeprefix(f"{root}/") for p in fs.find(root)}
    assert found == expected | {"notes.txt", "other-00009-of-00010.tfrecord"}
    assert all(fs.cat_file(k) == v for k, v in stranger.items())


def test_an_old_object_that_cannot_be_removed_after_an_overwrite_says_the_new_pack_is_published(
    s3, tmp_path: Path, monkeypatch
) -> None:
    """The removal of the replaced pack's objects runs after the new manifest is up: its failure read as the
    conversion's ('cannot remove ...'), though the new pack was published and complete."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    src = _two_classes(tmp_path / "src", 7)
    url, root = "s3://packs/denied-removal.lmdb", "packs/denied-removal.lmdb"
    packdata.convert(src, url, shard_samples=2, storage_options=options, progress=False)
    with faulty_s3(options) as (faulty, rules, _):
        rules["DELETE", f"/{root}/shard-00004.lmdb/data.mdb"] = [403, 1]
        with pytest.raises(SourceError, match=rf"^{url}: the new pack is published, but the objects of the pack it"):
            packdata.convert(src, url, shard_samples=5, storage_options=faulty, progress=False, overwrite=True)
        staged = packdata.stage(url, to=tmp_path / "cache", storage_options=faulty, progress=False).staged
        assert len(packdata.LMDBDataset(staged)) == 10
        packdata.convert(src, url, shard_samples=5, storage_options=faulty, progress=False, overwrite=True, resume=True)
    fs.invalidate_cache()
    assert not fs.exists(f"{root}/shard-00004.lmdb/data.mdb") and fs.exists(f"{root}/shard-00001.lmdb/data.mdb")


def test_a_finished_conversion_removes_only_the_objects_its_earlier_unfinished_run_uploaded(
    s3, tmp_path: Path, monkeypatch
) -> None:
    """An interrupted run's shards that the finished pack no longer has stayed at the URL, outside any manifest."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    src = _two_classes(tmp_path / "src", 5)
    url, root = "s3://packs/strays.lmdb", "packs/strays.lmdb"
    fs.pipe({f"{root}/notes.txt": b"a stranger's", f"{root}/shard-00009.lmdb/data.mdb": b"not packdata's"})
    real_put = fs.put_file  # fsspec caches filesystems: convert gets this very instance

    def no_manifest(lpath, rpath, *args, **kwargs):  # interrupted at the end: every shard is up, no manifest
        if rpath.endswith("manifest.json"):
            raise OSError("connection reset")
        return real_put(lpath, rpath, *args, **kwargs)

    monkeypatch.setattr(fs, "put_file", no_manifest)
    with pytest.raises(PackFormatError, match=r"uploading manifest\.json failed"):
        packdata.convert(src, url, shard_samples=2, storage_options=options, progress=False)
    monkeypatch.setattr(fs, "put_file", real_put)
    fs.pipe_file(f"{root}/shard-00004.lmdb/data.mdb", b"rewritten by someone since")  # no longer what the run wrote
    result = packdata.convert(src, url, shard_samples=5, overwrite=True, storage_options=options, progress=False)
    assert result.shards == 2
    local = tmp_path / "local" / "strays.lmdb"
    packdata.convert(src, local, shard_samples=5, progress=False)
    pack = {p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file() and p.name != "lock.mdb"}
    fs.invalidate_cache()
    # the shard rewritten since the run uploaded it is not its object any more: kept, as are a stranger's
    strangers = {"notes.txt", "shard-00004.lmdb/data.mdb", "shard-00009.lmdb/data.mdb"}
    assert sorted(p.removeprefix(f"{root}/") for p in fs.find(root)) == sorted(pack | strangers)
    assert fs.cat_file(f"{root}/notes.txt") == b"a stranger's"


def test_overwrite_into_a_url_starts_over_an_interrupted_conversion(s3, tmp_path: Path, monkeypatch) -> None:
    """--overwrite never reached the work folder: its interrupted conversion refused it, hinting --overwrite."""
    from packdata.conversion import local

    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    src = _two_classes(tmp_path / "src", 10)
    url = "s3://packs/restarted.lmdb"
    monkeypatch.setattr(local, "_COMMIT_SAMPLES", 2)
    real_add = local._Packer._add

    def add(self, *args, **kwargs):  # stopped (as by Ctrl-C) after 4 samples, checkpointed
        if self.cp.samples_done >= 4:
            raise KeyboardInterrupt
        return real_add(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(local._Packer, "_add", add)
        with pytest.raises(KeyboardInterrupt):
            packdata.convert(src, url, shard_samples=2, storage_options=options, progress=False, workers=1)
    with pytest.raises(ConfigError, match="Pass --resume to continue it, or --overwrite to start again"):
        packdata.convert(src, url, shard_samples=3, storage_options=options, progress=False)
    result = packdata.convert(src, url, shard_samples=3, overwrite=True, storage_options=options, progress=False)
    assert result.packed == 10 and not result.resumed and result.shards == 4
    expected = tmp_path / "expected" / "restarted.lmdb"
    packdata.convert(src, expected, shard_samples=3, progress=False)
    fs.invalidate_cache()
    got = {p[len("packs/restarted.lmdb/") :] for p in fs.find("packs/restarted.lmdb")}
    assert got == {p.relative_to(expected).as_posix() for p in expected.rglob("*") if p.is_file()} - {
        f"shard-0000{i}.lmdb/lock.mdb" for i in range(4)
    }
    for name in got:
        assert fs.cat_file(f"packs/restarted.lmdb/{name}") == (expected / name).read_bytes(), name


def test_a_failed_manifest_upload_is_one_line_and_a_resume_completes(s3, tmp_path: Path, monkeypatch) -> None:
    """The manifest's upload, last, and the resume's look-ups of what was uploaded were not caught: a failure was
    the backend's own traceback. A resume naming another source or options uploaded the pack packed before."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    src = _two_classes(tmp_path / "src", 4)
    url = "s3://packs/last-put.lmdb"
    real_put = fs.put_file  # fsspec caches filesystems: convert gets this very instance

    def failing_put(lpath, rpath, *args, **kwargs):  # the network drops just as the manifest goes up
        if rpath.endswith("manifest.json"):
            raise ConnectionResetError("connection reset by peer")
        return real_put(lpath, rpath, *args, **kwargs)

    monkeypatch.setattr(fs, "put_file", failing_put)
    with pytest.raises(
        PackFormatError, match=r"^s3://packs/last-put\.lmdb: uploading manifest\.json failed \(ConnectionResetError\)"
    ):
        packdata.convert(src, url, storage_options=options, progress=False)
    assert not fs.exists("packs/last-put.lmdb/manifest.json")
    monkeypatch.setattr(fs, "put_file", real_put)
    real_info = fs.info

    def failing_info(path, *args, **kwargs):  # the network drops as the resume looks up what went up before
        if not path.endswith("manifest.json"):
            raise ConnectionResetError("connection reset by peer")
        return real_info(path, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(fs, "info", failing_info)
        with pytest.raises(
            SourceError, match=r"^s3://packs/last-put\.lmdb: cannot look up .* \(ConnectionResetError\)\. .*resume=True"
        ):
            packdata.convert(src, url, storage_options=options, progress=False, resume=True)
    other = _two_classes(tmp_path / "other", 9)  # a resume names another source: its pack is never uploaded
    for source, more in ((other, {}), (src, {"shard_samples": 3})):
        with pytest.raises(ConfigError, match=r"^s3://packs/last-put\.lmdb: the pack waiting in the work folder"):
            packdata.convert(source, url, storage_options=options, progress=False, resume=True, **more)
    result = packdata.convert(src, url, storage_options=options, progress=False, resume=True)
    assert result.packed == 10 and fs.exists("packs/last-put.lmdb/manifest.json")


@pytest.mark.parametrize("url", ["s3://packs/train/..", "s3://packs/.", "s3://packs/./train.lmdb"])
def test_a_destination_url_with_dot_parts_is_refused_and_no_work_folder_is_touched(
    s3, tmp_path: Path, monkeypatch, url: str
) -> None:
    """A URL ending in '..' once made the upload work folder the parent of every job's: its clean-up deleted them."""
    options, _ = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    other = tmp_path / "work" / "packdata-upload" / "0123456789abcdef" / "big.lmdb"  # another job's, resumable
    other.mkdir(parents=True)
    (other / "progress.json").write_text("{}")
    src = tmp_path / "src" / "cls"
    src.mkdir(parents=True)
    (src / "0.jpg").write_bytes(image_bytes(0, (30, 20)))
    with pytest.raises(packdata.ConfigError, match=r"cannot have '\.' or '\.\.' parts"):
        packdata.convert(tmp_path / "src", url, storage_options=options, progress=False)
    assert (other / "progress.json").read_text() == "{}"
    from packdata.conversion.upload import work_folder

    assert work_folder(url).parent.parent == tmp_path / "work" / "packdata-upload"


def test_a_missing_destination_bucket_is_named_before_anything_is_packed(s3, tmp_path: Path, monkeypatch) -> None:
    """A missing bucket was noticed only at the upload, after the whole source was packed into the work folder."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    src = _two_classes(tmp_path / "src", 3)
    with pytest.raises(SourceError, match=r"^s3://no-such-bucket/x\.lmdb: cannot write there: its bucket does not ex"):
        packdata.convert(src, "s3://no-such-bucket/x.lmdb", storage_options=options, progress=False)
    assert not list((tmp_path / "work").rglob("*.mdb"))  # nothing was packed
    packdata.convert(src, "s3://packs/write-checked.lmdb", storage_options=options, progress=False)
    fs.invalidate_cache()
    assert not [p for p in fs.find("packs/write-checked.lmdb") if ".packdata-write-check-" in p]  # none left


def test_what_s3fs_raises_for_a_refused_connection_is_transient_and_a_missing_bucket_is_not(s3) -> None:
    """Requests to a port nothing listens on (a server down) are tried again; a missing bucket is not."""
    from packdata.pack.urls import is_transient

    _, fs = s3
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    down = s3fs.S3FileSystem(
        client_kwargs={"endpoint_url": f"http://127.0.0.1:{port}"},
        config_kwargs={"retries": {"total_max_attempts": 1}},
        skip_instance_cache=True,
    )
    with pytest.raises(Exception) as refused:
        down.cat_file("packs/x")
    assert is_transient(refused.value), repr(refused.value)
    with pytest.raises(FileNotFoundError) as missing:
        fs.pipe_file("no-such-bucket/x", b"")
    assert not is_transient(missing.value)


@pytest.mark.parametrize("if_match", [True, False])
def test_an_object_rewritten_at_the_same_size_since_the_listing_is_a_changed_skip(
    s3, tmp_path: Path, monkeypatch, if_match: bool
) -> None:
    """A Ray task read the object as it was then: same size as listed, so it was packed with other bytes than listed."""
    import packdata.conversion.remote_folder as remote_folder
    import packdata.pack.urls as urls
    from packdata.conversion.sources import Skip

    options, fs = s3
    if not if_match:  # a store without If-Match: the version is looked up after the read
        for module in (urls, remote_folder):
            monkeypatch.setattr(module, "conditional_reads", lambda fs: False)
    root = f"packs/same-size-{if_match}"
    fs.pipe({f"{root}/cat/0.jpg": image_bytes(0, (30, 20)), f"{root}/cat/1.jpg": image_bytes(1, (30, 20))})
    folder = remote_folder.scan_remote_folder(f"s3://{root}", options)
    listed = [entry for entry in folder.walk() if isinstance(entry, remote_folder.RemoteSourceFile)]
    rewritten = bytearray(image_bytes(1, (30, 20)))
    rewritten[len(rewritten) // 2] ^= 0xFF
    fs.pipe_file(f"{root}/cat/1.jpg", bytes(rewritten))
    assert listed[0].remote.read("cat/0.jpg") == image_bytes(0, (30, 20))
    skip = listed[1].remote.read("cat/1.jpg")
    assert isinstance(skip, Skip) and (skip.key, skip.reason) == ("cat/1.jpg", "changed"), skip


def test_the_early_uploader_sends_only_files_inside_the_work_pack(s3, tmp_path: Path, monkeypatch) -> None:
    """A checkpoint naming a shard outside the work pack (``..``, an absolute path) uploads nothing of it."""
    options, fs = s3
    import packdata.conversion.upload as upload

    monkeypatch.setattr(upload.ShardUploader, "PERIOD", 0.005)
    (tmp_path / "secret.txt").write_text("not part of any pack")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "key.pem").write_text("not part of any pack either")
    partial = tmp_path / "work" / ".train.lmdb.partial"
    (partial / "shard-00000.lmdb").mkdir(parents=True)
    (partial / "shard-00000.lmdb" / "data.mdb").write_bytes(b"shard bytes")
    names = ["../../secret.txt", os.fspath(tmp_path / "elsewhere"), "shard-00000.lmdb"]
    (partial / "progress.json").write_text(json.dumps({"shards": [{"file": name} for name in names]}))
    with upload.ShardUploader(partial, "s3://packs/early-only-inside", options) as uploader:
        deadline = time.monotonic() + 30
        while "shard-00000.lmdb/data.mdb" not in uploader.uploaded and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # a few more looks at the checkpoint
    assert uploader.uploaded == {"shard-00000.lmdb/data.mdb": 11}
    assert fs.find("packs/early-only-inside") == ["packs/early-only-inside/shard-00000.lmdb/data.mdb"]


_AT_MANIFEST = """
import json, os, signal, sys
import s3fs
import packdata
options = json.loads(sys.argv[3])
fs = s3fs.S3FileSystem(**options)  # fsspec caches filesystems: convert gets this very instance
real_put = fs.put_file

def put(lpath, rpath, *args, **kwargs):
    if rpath.endswith("manifest.json"):
        AT_MANIFEST
    return real_put(lpath, rpath, *args, **kwargs)

fs.put_file = put
packdata.convert(sys.argv[1], sys.argv[2], overwrite=True, storage_options=options, progress=False, workers=1)
"""
_KILLED_AT_MANIFEST = _AT_MANIFEST.replace(  # killed with everything but the manifest uploaded
    "AT_MANIFEST", "os.kill(os.getpid(), signal.SIGKILL)"
)


def test_a_pack_uploaded_after_this_process_listed_the_url_is_still_ended_first(s3, tmp_path: Path) -> None:
    """fsspec's cached listing of the URL predates the pack: its manifest is still removed before any shard goes up.

    Streaming readers rely on it: an unchanged manifest after they pin a shard's
    version proves the version is their pack's.
    """
    import s3fs

    from packdata.conversion.upload import check_remote_destination, end_remote_pack

    options, fs = s3
    fs.pipe_file("packs/late.lmdb/notes.txt", b"not a pack yet")
    assert fs.ls("packs/late.lmdb") == ["packs/late.lmdb/notes.txt"]  # cached in the instance convert gets
    other = s3fs.S3FileSystem(skip_instance_cache=True, **options)  # another process, as far as caches go
    other.pipe_file("packs/late.lmdb/manifest.json", b"{}")
    assert not fs.exists("packs/late.lmdb/manifest.json")  # the stale listing
    with pytest.raises(packdata.ConfigError, match="a pack already exists there"):
        check_remote_destination("s3://packs/late.lmdb", options, overwrite=False)
    end_remote_pack("s3://packs/late.lmdb", options)
    other.invalidate_cache()
    assert not other.exists("packs/late.lmdb/manifest.json")


def _text_source(root: Path, seed: int) -> Path:
    """Two 6 MiB text files of random hex: an LMDB shard of over 10 MiB, the same size for every seed."""
    rng = np.random.default_rng(seed)
    (root / "cls").mkdir(parents=True)
    for i in range(2):
        (root / "cls" / f"{i}.txt").write_text(rng.bytes(3 << 20).hex())
    return root


def test_an_older_packs_object_of_the_same_size_is_replaced_and_a_resume_skips_only_its_own(
    s3, tmp_path: Path, monkeypatch
) -> None:
    """An old multi-part shard with the new one's size (its ETag no MD5) once stayed under the new manifest."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    old, new = _text_source(tmp_path / "old", 1), _text_source(tmp_path / "new", 2)
    packdata.convert(old, tmp_path / "old-pack" / "trust.lmdb", progress=False)
    expected = tmp_path / "new-pack" / "trust.lmdb"
    packdata.convert(new, expected, progress=False)
    shard = "shard-00000.lmdb/data.mdb"
    old_shard = tmp_path / "old-pack" / "trust.lmdb" / shard
    assert old_shard.stat().st_size == (expected / shard).stat().st_size > 10 << 20
    assert old_shard.read_bytes() != (expected / shard).read_bytes()
    fs.put(str(tmp_path / "old-pack" / "trust.lmdb"), "packs/trust.lmdb", recursive=True)
    fs.put_file(str(old_shard), f"packs/trust.lmdb/{shard}", chunksize=5 << 20)  # multi-part, as from 100 MiB on
    assert fs.info(f"packs/trust.lmdb/{shard}")["ETag"].endswith('-3"')  # an ETag that is no MD5
    url = "s3://packs/trust.lmdb"
    child = subprocess.run(
        [sys.executable, "-c", _KILLED_AT_MANIFEST, str(new), url, json.dumps(options)], capture_output=True, text=True
    )
    assert child.returncode == -9, child.stderr[-2000:]
    fs.invalidate_cache()
    assert not fs.exists("packs/trust.lmdb/manifest.json")
    before = {name: info["ETag"] for name, info in fs.find("packs/trust.lmdb", detail=True).items()}
    real_put = fs.put_file  # fsspec caches filesystems: convert gets this very instance
    puts: list[str] = []

    def counting_put(lpath, rpath, *args, **kwargs):
        puts.append(rpath)
        return real_put(lpath, rpath, *args, **kwargs)

    monkeypatch.setattr(fs, "put_file", counting_put)
    packdata.convert(new, url, overwrite=True, resume=True, storage_options=options, progress=False)
    assert puts == ["packs/trust.lmdb/manifest.json"]  # what the killed run uploaded is not sent again
    fs.invalidate_cache()
    after = {name: info["ETag"] for name, info in fs.find("packs/trust.lmdb", detail=True).items()}
    assert {k: v for k, v in after.items() if not k.endswith("manifest.json")} == before
    names = sorted(p.relative_to(expected).as_posix() for p in expected.rglob("*") if p.is_file())
    assert sorted(name[len("packs/trust.lmdb/") :] for name in after) == names
    for name in names:  # the new pack, byte for byte: the old shard of the same size is gone
        assert fs.cat_file(f"packs/trust.lmdb/{name}") == (expected / name).read_bytes(), name


def test_a_ray_task_whose_object_was_rewritten_with_the_same_size_is_not_complete(
    s3, tmp_path: Path, monkeypatch
) -> None:
    """A Ray resume trusted a multi-part object (its ETag no MD5) by its size: now by the version its task saw."""
    from packdata.conversion.ray_remote import RemoteTarget, objects_complete, upload_task_files

    options, fs = s3
    pack = tmp_path / "pack"
    (pack / "shard-00000.lmdb").mkdir(parents=True)
    rng = np.random.default_rng(3)
    (pack / "shard-00000.lmdb" / "data.mdb").write_bytes(rng.bytes(11 << 20))
    target = RemoteTarget("s3://packs/ray-task.lmdb", options)
    objects = upload_task_files(pack, "tasks", target)
    assert objects_complete(target, objects)
    other = tmp_path / "other.mdb"
    other.write_bytes(rng.bytes(11 << 20))  # another pack's shard: same size, other bytes
    fs.put_file(str(other), "packs/ray-task.lmdb/shard-00000.lmdb/data.mdb", chunksize=5 << 20)
    assert fs.info("packs/ray-task.lmdb/shard-00000.lmdb/data.mdb")["ETag"].endswith('-3"')  # multi-part
    assert not objects_complete(target, objects)  # the task runs again
    for damaged in (list(objects), {"shard-00000.lmdb/data.mdb": 7}, {"shard-00000.lmdb/data.mdb": ["a", "b", "c"]}):
        assert not objects_complete(target, damaged)  # a saved result's table of another shape: the task runs again

    def failing_info(*args, **kwargs):  # the network drops as a resume looks the objects up
        raise ConnectionResetError("connection reset by peer")

    with monkeypatch.context() as m:
        m.setattr(fs, "info", failing_info)
        with pytest.raises(SourceError, match=r"^s3://packs/ray-task\.lmdb: cannot look up .*\(ConnectionResetError\)"):
            objects_complete(target, objects)  # one line, never the backend's traceback


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_convert_into_s3_uploads_shards_as_they_close(s3, tmp_path: Path, monkeypatch, fmt: str) -> None:
    """Shards go up while the conversion runs; TFRecord shards are moved to their -of-N names at the end."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    import packdata.conversion.upload as upload

    monkeypatch.setattr(upload.ShardUploader, "PERIOD", 0.005)
    import packdata.conversion.load as load

    real_read = load._read_regular

    def slow_read(path: str, **options: bool) -> bytes:  # packing outlasts several looks of the uploader
        time.sleep(0.01)
        return real_read(path, **options)

    monkeypatch.setattr(load, "_read_regular", slow_read)
    src = tmp_path / "src" / "cls"
    src.mkdir(parents=True)
    for i in range(60):
        (src / f"{i:02d}.jpg").write_bytes(image_bytes(i, (30, 20)))
    url = f"s3://packs/early-{fmt}"
    work = upload.work_folder(url)
    real_put = fs.put_file
    while_packing: list[str] = []

    after_packing: list[str] = []

    def watching_put(lpath, rpath, *args, **kwargs):
        packing = not work.exists()  # the work pack is published when the conversion ends
        result = real_put(lpath, rpath, *args, **kwargs)  # counted once it has gone up
        (while_packing if packing else after_packing).append(rpath)
        return result

    monkeypatch.setattr(fs, "put_file", watching_put)
    packdata.convert(tmp_path / "src", url, format=fmt, shard_samples=2, storage_options=options, progress=False)
    assert while_packing and not any(p.endswith("manifest.json") for p in while_packing)
    staged = packdata.stage(url, to=tmp_path / "cache", storage_options=options, progress=False)
    local = tmp_path / "same-name" / f"early-{fmt}"  # shard names follow the pack's name
    packdata.convert(tmp_path / "src", local, format=fmt, shard_samples=2, progress=False)
    names = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    remote = sorted(p[len(f"packs/early-{fmt}/") :] for p in fs.find(f"packs/early-{fmt}"))
    assert remote == names  # no object under a temporary name is left
    assert packdata.verify_pack(staged.staged, progress=False).records == 60
    numbers = [
        int(re.search(r"-(\d{5})(?:-of-\d{5})?(?:\.lmdb/data\.mdb|\.tfrecord)$", p).group(1))
        for p in while_packing + after_packing
        if p.endswith((".tfrecord", "data.mdb"))
    ]
    assert sorted(numbers) == list(range(30))  # every shard went up once: early ones were moved, not sent again


def test_tfrecord_streams_from_s3_exactly_once_through_workers(s3, tmp_path: Path) -> None:
    options, fs = s3
    src = tmp_path / "src"
    for c in ("a", "b"):
        (src / c).mkdir(parents=True)
        for i in range(10):
            (src / c / f"{i}.jpg").write_bytes(image_bytes(i + (20 if c == "b" else 0), (30, 20)))
    local = tmp_path / "train"
    packdata.convert(src, local, format="tfrecord", shard_samples=6, progress=False)
    fs.put(str(local), "packs/stream", recursive=True)
    expected = sorted(data for data, _ in packdata.TFRecordIndexedDataset(local, decode="bytes"))
    url = "s3://packs/stream"
    for workers in (0, 2):
        ds = packdata.TFRecordDataset(
            url, decode="bytes", shuffle=True, storage_options=options, cache_dir=tmp_path / "cache"
        )
        loader = DataLoader(ds, batch_size=None, num_workers=workers)
        assert sorted(data for data, _ in loader) == expected
    with pytest.raises(packdata.ConfigError, match="random access reads local shards"):
        packdata.TFRecordIndexedDataset(url)
    ds = packdata.TFRecordDataset(url, decode="bytes", storage_options=options, cache_dir=tmp_path / "cache")
    held = list(ds._records(ds.reader_segments(0, 1)))  # what a shuffle buffer holds: copies, not chunk views
    assert len(held) == 20 and all(type(data) is bytes for data, _, _ in held)


def test_a_url_never_reads_a_local_folder_named_like_it(s3, remote_pack, remote_tfrecord, tmp_path, monkeypatch):
    """LMDBDataset('s3://packs/train.lmdb') (and open_dataset) read ./s3:/packs/train.lmdb, another pack, silently."""
    from packdata.reading.open import open_dataset

    options, _ = s3
    (lmdb_url, _), (tf_url, tf_local) = remote_pack, remote_tfrecord
    monkeypatch.chdir(tmp_path)
    (tmp_path / "src" / "c").mkdir(parents=True)
    (tmp_path / "src" / "c" / "0.txt").write_text("another pack")
    packdata.convert(tmp_path / "src", "s3:/packs/train.lmdb", progress=False)  # as a tool that mangled the URL
    with pytest.raises(ConfigError, match=r"^s3://packs/train\.lmdb: an LMDB pack is read through local files"):
        packdata.LMDBDataset(lmdb_url)
    for url, streaming, hint in ((lmdb_url, True, "Stage it first"), (tf_url, False, "Pass streaming=True")):
        with pytest.raises(ConfigError, match=rf"^{url}: a map-style dataset reads local files only\. {hint}"):
            open_dataset(url, streaming=streaming, storage_options=options)
    ds = open_dataset(tf_url, streaming=True, decode="bytes", storage_options=options, cache_dir=tmp_path / "cache")
    assert isinstance(ds, packdata.TFRecordDataset)
    assert sorted(ds) == sorted(packdata.TFRecordIndexedDataset(tf_local, decode="bytes"))


def test_a_missing_object_is_reported_without_retries(s3) -> None:
    """A shard object deleted (or listed, then 404 on GET) was named as 'bytes 0-10 could not be read after 1 tries
    (FileNotFoundError). The epoch stops here rather than skip records: check the network', in verify too."""
    from packdata.formats.remote_pack import fetch_range

    _, fs = s3
    calls = []

    class Counting:
        def cat_file(self, path, start=None, end=None):
            calls.append(path)
            return fs.cat_file(path, start=start, end=end)

    with pytest.raises(PackFormatError, match=r"^s3://packs/no-such-object: is missing \(removed, or its pack is"):
        fetch_range(Counting(), "packs/no-such-object", "s3://packs/no-such-object", 0, 10, backoff=5)
    assert len(calls) == 1


@pytest.mark.parametrize("start", [100, 700])  # 700: past the object's end, which S3 answers with an error (416)
def test_an_object_shorter_than_the_pack_says_is_named_without_retries(s3, start: int) -> None:
    """A short read was retried as a network fault, and the error pointed at the network (a range past the end:
    four tries, then 'could not be read after 4 tries (OSError)')."""
    from packdata.formats.remote_pack import fetch_range

    _, fs = s3
    fs.pipe("packs/short-object", b"x" * 675)
    calls = []

    class Counting:
        def cat_file(self, path, start=None, end=None):
            calls.append(path)
            return fs.cat_file(path, start=start, end=end)

        def info(self, path):
            return fs.info(path)

    with pytest.raises(
        PackFormatError, match=rf"the object is 675 bytes, but the pack's tables place bytes {start}-775"
    ):
        fetch_range(Counting(), "packs/short-object", "s3://packs/short-object", start, 775, backoff=0.01)
    assert len(calls) == 1


def test_remote_stream_retries_then_names_the_shard(s3, tmp_path: Path, monkeypatch) -> None:
    options, fs = s3
    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    for i in range(6):
        (src / f"{i}.jpg").write_bytes(image_bytes(i, (30, 20)))
    packdata.convert(tmp_path / "src", tmp_path / "p", format="tfrecord", progress=False)
    fs.put(str(tmp_path / "p"), "packs/flaky", recursive=True)
    failures = {"left": 2}

    def flaky(name: str, start: int) -> bool:
        if failures["left"] > 0:
            failures["left"] -= 1
            return True
        return False

    _logged(monkeypatch, fs, flaky)
    import packdata.formats.tfrecord_remote as remote

    monkeypatch.setattr(remote.RemoteShardReader, "BACKOFF", 0.01)
    ds = packdata.TFRecordDataset("s3://packs/flaky", decode="bytes", shuffle=False, storage_options=options,
                                  cache_dir=tmp_path / "cache")  # fmt: skip
    assert len(list(ds)) == 6 and failures["left"] == 0  # two dropped requests, retried: nothing lost
    failures["left"] = 100
    with pytest.raises(PackFormatError, match=r"s3://packs/flaky/p-00000-of-00001\.tfrecord: bytes 0-\d+ could not"):
        list(ds)


@pytest.fixture(scope="module")
def remote_shards(s3, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, list[tuple[str, int]]]:
    """A 7-shard TFRecord pack (40 samples, 6 a shard) uploaded to s3://packs/ahead; its (file, samples) per shard."""
    _, fs = s3
    root = tmp_path_factory.mktemp("ahead")
    for c in ("a", "b"):
        (root / "src" / c).mkdir(parents=True)
        for i in range(20):
            (root / "src" / c / f"{i:02d}.jpg").write_bytes(image_bytes(i + (40 if c == "b" else 0), (30, 20)))
    local = root / "ahead"
    packdata.convert(root / "src", local, format="tfrecord", shard_samples=6, progress=False)
    fs.put(str(local), "packs/ahead", recursive=True)
    shards = json.loads((local / "manifest.json").read_text())["shards"]
    return "s3://packs/ahead", local, [(s["file"], s["num_samples"]) for s in shards]


@pytest.fixture
def small_chunks(monkeypatch) -> None:
    """Ranged requests of about 1.5 KB (two or three records), so every shard is several chunks; fast retries."""
    import packdata.formats.tfrecord_remote as remote

    monkeypatch.setattr(remote.RemoteShardReader, "CHUNK", 1500)
    monkeypatch.setattr(remote.RemoteShardReader, "BACKOFF", 0.01)


def _logged(
    monkeypatch, fs, fail=lambda name, start: False, calls: list[tuple[str, dict]] | None = None
) -> list[tuple[str, int]]:
    """Log every ranged GET of a shard as (file name, first byte); ``fail(name, start)`` drops one.

    ``calls``, when given, gets every S3 request as (operation, arguments).
    """
    real = fs._call_s3  # fsspec caches filesystems: the dataset gets this very instance
    log: list[tuple[str, int]] = []

    async def call_s3(method, *args, **kwargs):
        if calls is not None:
            calls.append((method, kwargs))
        if method == "get_object" and kwargs["Key"].endswith(".tfrecord"):
            name, start = kwargs["Key"].rsplit("/", 1)[-1], int(kwargs["Range"].split("=")[1].split("-")[0])
            log.append((name, start))
            if fail(name, start):
                raise ConnectionResetError("reset by peer")
        return await real(method, *args, **kwargs)

    monkeypatch.setattr(fs, "_call_s3", call_s3)
    return log


@pytest.mark.parametrize("shuffle", [False, True])
def test_remote_stream_reads_ahead_without_changing_the_order(s3, remote_shards, small_chunks, tmp_path, shuffle):
    """2 ranks x 2 workers: every sample exactly once, each rank in the very order of the same pack on disk."""
    options, _ = s3
    url, local, _ = remote_shards
    expected = sorted(data for data, _ in packdata.TFRecordIndexedDataset(local, decode="bytes"))
    streamed: list[bytes] = []
    for rank in (0, 1):
        options_ = {"decode": "bytes", "shuffle": shuffle, "seed": 3, "rank": rank, "world_size": 2}
        remote = packdata.TFRecordDataset(url, storage_options=options, cache_dir=tmp_path / "c", **options_)
        here = packdata.TFRecordDataset(local, **options_)
        for ds in (remote, here):
            ds.set_epoch(1)
        got = [data for data, _ in DataLoader(remote, batch_size=None, num_workers=2)]
        assert got == [data for data, _ in DataLoader(here, batch_size=None, num_workers=2)]
        streamed += got
    assert sorted(streamed) == expected


def test_a_remote_stream_resumes_where_the_same_pack_on_disk_would(s3, remote_shards, small_chunks, tmp_path):
    options, _ = s3
    url, local, _ = remote_shards
    here = packdata.TFRecordDataset(local, decode="bytes", seed=5, shuffle_buffer=8)
    it = iter(here)
    first = [next(it)[0] for _ in range(13)]
    state, rest = here.state_dict(), [data for data, _ in it]
    remote = packdata.TFRecordDataset(
        url, decode="bytes", seed=5, shuffle_buffer=8, storage_options=options, cache_dir=tmp_path
    )
    remote.load_state_dict(state)
    got = [data for data, _ in remote]
    assert got == rest and len(first) + len(got) == 40


def test_the_next_shard_is_requested_before_the_current_one_ends(
    s3, remote_shards, small_chunks, monkeypatch, tmp_path
):
    options, fs = s3
    url, _, shards = remote_shards
    log = _logged(monkeypatch, fs)
    ds = packdata.TFRecordDataset(url, decode="bytes", shuffle=False, storage_options=options, cache_dir=tmp_path)
    it = iter(ds)
    for k, ((name, count), (following, _)) in enumerate(itertools.pairwise(shards)):
        for _ in range(count):
            next(it)  # the shard's last record is now in our hands; the reader is not asked for more
        deadline = time.monotonic() + 5
        while (following, 0) not in log and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (following, 0) in log, f"shard {k + 1}'s first range was not requested before shard {k} ended"
        assert log.index((following, 0)) > log.index((name, 0))
    assert len(list(it)) == shards[-1][1]
    assert len(log) == len(set(log))  # every range requested once


def test_a_transient_failure_at_a_shard_boundary_loses_and_repeats_nothing(
    s3, remote_shards, small_chunks, monkeypatch, tmp_path
):
    options, fs = s3
    url, local, shards = remote_shards
    expected = [data for data, _ in packdata.TFRecordDataset(local, decode="bytes", shuffle=False)]
    drops = {shards[1][0]: 2, shards[4][0]: 1}  # the first range of shards 1 and 4 fails 2 and 1 times

    def fail(name: str, start: int) -> bool:
        if start == 0 and drops.get(name, 0) > 0:
            drops[name] -= 1
            return True
        return False

    log = _logged(monkeypatch, fs, fail)
    ds = packdata.TFRecordDataset(url, decode="bytes", shuffle=False, storage_options=options, cache_dir=tmp_path)
    assert [data for data, _ in ds] == expected
    assert drops == {shards[1][0]: 0, shards[4][0]: 0} and log.count((shards[1][0], 0)) == 3


def test_a_next_shard_that_keeps_failing_ends_the_epoch_after_the_current_one(
    s3, remote_shards, small_chunks, monkeypatch, tmp_path
):
    options, fs = s3
    url, local, shards = remote_shards
    expected = [data for data, _ in packdata.TFRecordDataset(local, decode="bytes", shuffle=False)]
    _logged(monkeypatch, fs, lambda name, start: name == shards[2][0])
    ds = packdata.TFRecordDataset(url, decode="bytes", shuffle=False, storage_options=options, cache_dir=tmp_path)
    got = []
    with pytest.raises(
        PackFormatError, match=rf"s3://packs/ahead/{shards[2][0]}: bytes 0-\d+ could not be read after 4"
    ):
        for data, _ in ds:
            got.append(data)
    assert got == expected[: shards[0][1] + shards[1][1]]  # every record before the failing range, none after


def _readahead_threads(besides: set[threading.Thread] = frozenset()) -> set[threading.Thread]:
    """The read-ahead threads alive now, but those in ``besides`` (another test's reader not yet collected)."""
    return {t for t in threading.enumerate() if t.name.startswith("packdata-readahead")} - besides


def _wait_gone(threads: set[threading.Thread], limit: float = 5.0) -> bool:
    deadline = time.monotonic() + limit
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        time.sleep(0.01)
    return not any(t.is_alive() for t in threads)


def test_an_abandoned_remote_reader_leaves_no_thread_behind(s3, remote_shards, small_chunks, monkeypatch, tmp_path):
    import packdata.formats.tfrecord_remote as remote

    options, fs = s3
    url, _, shards = remote_shards
    monkeypatch.setattr(remote.RemoteShardReader, "BACKOFF", 30.0)  # a retry waiting far longer than the test
    log = _logged(monkeypatch, fs, lambda name, start: name == shards[1][0])
    ds = packdata.TFRecordDataset(url, decode="bytes", shuffle=False, storage_options=options, cache_dir=tmp_path)
    others = _readahead_threads()
    it = iter(ds)
    for _ in range(shards[0][1]):
        next(it)
    deadline = time.monotonic() + 5
    while (shards[1][0], 0) not in log and time.monotonic() < deadline:  # the read-ahead is in its backoff
        time.sleep(0.01)
    assert (shards[1][0], 0) in log
    ours = _readahead_threads(others)
    assert len(ours) == 1
    it.close()  # what a DataLoader shutting down or a training loop breaking out does
    del it
    assert _wait_gone(ours), "the read-ahead thread outlived its reader"
    assert log.count((shards[1][0], 0)) == 1  # the retry was not made


def test_a_reader_stopped_by_an_error_leaves_no_thread_behind(s3, remote_shards, small_chunks, monkeypatch, tmp_path):
    """The error's traceback (held here, as a caller logging it would) must not keep the read-ahead running."""
    import packdata.formats.tfrecord_remote as remote

    options, fs = s3
    url, _, shards = remote_shards
    monkeypatch.setattr(remote.RemoteShardReader, "BACKOFF", 0.01)
    _logged(monkeypatch, fs, lambda name, start: name in (shards[1][0], shards[2][0]))  # failing with more ahead
    ds = packdata.TFRecordDataset(url, decode="bytes", shuffle=False, storage_options=options, cache_dir=tmp_path)
    others = _readahead_threads()
    it = iter(ds)
    next(it)  # the read-ahead has started
    ours = _readahead_threads(others)
    assert len(ours) == 1
    with pytest.raises(PackFormatError, match=shards[1][0]) as raised:
        for _ in it:
            pass
    assert raised.value.__traceback__ is not None
    assert _wait_gone(ours), "the read-ahead thread outlived the error that ended its reader"


_HOLDER = """
import sys, time
from packdata.pack.lock import hold_lock
with hold_lock(sys.argv[1], what="a stage killed mid-download", target=sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_downloader_killed_with_sigkill_does_not_hang_the_other_ranks(s3, remote_pack, tmp_path: Path) -> None:
    """Ported from the storage helper's tests: the kernel drops a dead holder's flock, a waiting rank takes over."""
    import signal
    import threading

    options, _ = s3
    url, local = remote_pack
    cache = tmp_path / "cache"
    cache.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(cache / ".train.lmdb.lock")], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    results: list[object] = []
    waiter = threading.Thread(
        target=lambda: results.append(packdata.stage(url, to=cache, storage_options=options, progress=False))
    )
    waiter.start()
    waiter.join(0.7)
    assert waiter.is_alive()  # waiting on the live holder
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    waiter.join(30)
    assert not waiter.is_alive() and results
    assert _samples(cache / "train.lmdb") == _samples(local)


def test_a_wait_past_its_limit_names_the_holder(s3, remote_pack, tmp_path: Path) -> None:
    from packdata.errors import LockedError
    from packdata.pack.lock import hold_lock
    from packdata.staging.remote import stage_remote

    options, _ = s3
    url, _ = remote_pack
    cache = tmp_path / "cache"
    cache.mkdir()
    lock = cache / ".train.lmdb.lock"
    with hold_lock(lock, what="another rank", target=lock), pytest.raises(LockedError, match=f"pid {os.getpid()}"):
        stage_remote(url, to=cache, storage_options=options, progress=False, wait_seconds=0.3)


def test_an_unreachable_server_is_one_clean_line_and_a_rerun_completes(s3, remote_pack, tmp_path: Path) -> None:
    options, _ = s3
    url, _ = remote_pack
    down = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}, "config_kwargs": {"retries": {"max_attempts": 1}}}
    with pytest.raises(
        packdata.SourceError, match=r"s3://packs/train\.lmdb: cannot read manifest\.json \(\w+Error\)"
    ) as info:
        packdata.stage(url, to=tmp_path / "cache", storage_options=down, progress=False)
    assert SECRET not in str(info.value)
    out = CliRunner().invoke(main, ["info", url, "--storage-options", json.dumps(down)])
    assert out.exit_code == 1 and out.output.startswith("Error: s3://packs/train.lmdb: cannot read")
    assert packdata.stage(url, to=tmp_path / "cache", storage_options=options, progress=False).downloaded
    with pytest.raises(packdata.ConfigError, match="staged whole"):
        packdata.stage(url, to=tmp_path / "c2", budget=1000, storage_options=options, progress=False)


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
    assert sorted(p.name for p in cache.iterdir()) == [leftover.name, "second.lmdb"]


def test_a_copy_moved_aside_under_a_numbered_name_is_still_its_copys_to_evict(s3, remote_pack, tmp_path: Path) -> None:
    """``.NAME.old-PID-N`` (``.NAME.old-PID`` was taken) is NAME's: eviction skips it while NAME's lock is held."""
    options, _, cache, first, size = _staged_and_second(s3, remote_pack, tmp_path)
    aside = cache / f".train.lmdb.old-{os.getpid()}-1"
    os.rename(first, aside)  # as an eviction holding .train.lmdb.lock leaves it, deleting it
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(cache / ".train.lmdb.lock")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(packdata.CapacityError, match="cache limit"):
            packdata.stage("s3://packs/second.lmdb", to=cache, storage_options=options, progress=False,
                           cache_limit=int(1.5 * size))  # fmt: skip
        assert (aside / "staged.json").is_file() and not (cache / "second.lmdb").exists()
    finally:
        holder.kill()
        holder.wait()


def test_convert_from_a_folder_in_s3(s3, tmp_path: Path, monkeypatch) -> None:
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    src = _two_classes(tmp_path / "src", 7)
    fs.put(str(src), "packs/folder", recursive=True)
    remote = packdata.convert("s3://packs/folder", tmp_path / "r.lmdb", storage_options=options, progress=False)
    packdata.convert(src, tmp_path / "l.lmdb", progress=False)
    assert remote.packed == 10 and _samples(tmp_path / "r.lmdb") == _samples(tmp_path / "l.lmdb")
    assert not any((tmp_path / "work").rglob("*.jpg"))  # the work folder is gone once the pack is published
    with pytest.raises(packdata.SourceError, match=r"s3://packs/empty: no files there"):
        packdata.convert("s3://packs/empty", tmp_path / "e.lmdb", storage_options=options, progress=False)


def test_a_source_changed_since_an_interrupted_download_is_packed_as_it_is_now(s3, tmp_path: Path, monkeypatch):
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    old, same, gone = image_bytes(1, (20, 20)), image_bytes(2, (20, 20)), image_bytes(3, (20, 20))
    for name, data in (("cat/0.jpg", old), ("cat/1.jpg", gone), ("dog/0.jpg", same)):
        fs.pipe_file(f"packs/changed/{name}", data)
    local, _ = download_source("s3://packs/changed", options, workers=2, progress=False)  # then the run was killed
    (local / "cat" / ".1.jpg.part").write_bytes(gone)  # what a download killed in the middle left
    new = bytearray(old)
    new[-3] ^= 0xFF  # rewritten with other bytes of the same size
    fs.pipe_file("packs/changed/cat/0.jpg", bytes(new))
    fs.rm_file("packs/changed/cat/1.jpg")
    result = packdata.convert("s3://packs/changed", tmp_path / "out.lmdb", storage_options=options, progress=False)
    assert result.found == result.packed == 2
    assert _samples(tmp_path / "out.lmdb") == [("cat/0.jpg", bytes(new), 0), ("dog/0.jpg", same, 1)]
    local, _ = download_source("s3://packs/changed", options, workers=2, progress=False)
    kept = (local / "dog" / "0.jpg").stat().st_ino
    local, _ = download_source("s3://packs/changed", options, workers=2, progress=False)
    assert (local / "dog" / "0.jpg").stat().st_ino == kept  # an object unchanged since it was downloaded is kept


@pytest.fixture(scope="module")
def remote_tfrecord(s3, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A 4-shard TFRecord pack converted locally and uploaded to s3://packs/verify-tf."""
    _, fs = s3
    root = tmp_path_factory.mktemp("remote-tf")
    src = root / "src"
    for c in ("a", "b"):
        (src / c).mkdir(parents=True)
        for i in range(7):
            (src / c / f"{i}.jpg").write_bytes(image_bytes(i + (30 if c == "b" else 0), (36, 24)))
    (src / "a" / "broken.jpg").write_bytes(b"\xff\xd8\xff not a jpeg")  # a skip: the report is checked too
    local = root / "verify-tf"
    packdata.convert(src, local, format="tfrecord", shard_samples=4, progress=False)
    assert (local / "skipped.jsonl").stat().st_size
    fs.put(str(local), "packs/verify-tf", recursive=True)
    return "s3://packs/verify-tf", local


def _cli(*args: str, options: dict) -> object:
    return CliRunner().invoke(main, [*args, "--storage-options", json.dumps(options)])


def test_verify_a_remote_tfrecord_pack_checks_every_record(s3, remote_tfrecord) -> None:
    options, _ = s3
    url, local = remote_tfrecord
    result = packdata.verify_pack(url, storage_options=options, progress=False, workers=2)
    here = packdata.verify_pack(local, progress=False)
    assert (result.path, result.checks) == (url, "records")
    assert (
        (result.records, result.bytes, result.shards) == (here.records, here.bytes, here.shards) == (14, here.bytes, 4)
    )
    out = _cli("verify", url, "-q", "--json", options=options)
    assert out.exit_code == 0, out.output
    assert json.loads(out.output) == {
        "ok": True,
        "path": url,
        "records": 14,
        "bytes": here.bytes,
        "shards": 4,
        "checks": "records",
    }


def test_verify_a_remote_lmdb_pack_checks_checksums_and_says_so(s3, remote_pack) -> None:
    options, _ = s3
    url, _ = remote_pack
    result = packdata.verify_pack(url, storage_options=options, progress=False)
    assert (result.checks, result.records, result.shards) == ("checksums", 0, 3)
    out = _cli("verify", url, "-q", options=options)
    assert out.exit_code == 0, out.output
    assert out.output.startswith("ok: 3 shards,") and "Records NOT checked" in out.output
    assert f"packdata stage {url} --to DIR" in out.output


@pytest.mark.parametrize("damage", ["swap", "elsewhere"])
def test_verify_of_a_remote_lmdb_pack_checks_every_row_of_its_location_table(
    s3, remote_pack, tmp_path: Path, damage: str
) -> None:
    """records.i64 rows swapped, or one row pointing at another record (the table's size kept): a remote verify
    passed it (only the table's header was checked), a local verify of the same pack named the row."""
    options, fs = s3
    fs.put(str(remote_pack[1]), f"packs/{damage}.lmdb", recursive=True)
    table = f"packs/{damage}.lmdb/shard-00001.lmdb/records.i64"
    rows = np.frombuffer(fs.cat_file(table), dtype="<i8").reshape(-1, 3).copy()
    if damage == "swap":
        rows[[3, 4]] = rows[[4, 3]]  # after the two header rows: records 1 and 2 of the shard
    else:
        rows[3] = rows[5]  # record 1's row points at record 3's payload
    fs.pipe_file(table, rows.tobytes())
    wrong = "2 rows wrong" if damage == "swap" else "1 rows wrong"
    local = tmp_path / "local"
    fs.get(f"packs/{damage}.lmdb", str(local), recursive=True)
    with pytest.raises(PackFormatError, match=rf"records\.i64 row 1 does not point at record 1 \({wrong}\)"):
        packdata.verify_pack(local, progress=False)
    out = _cli("verify", f"s3://packs/{damage}.lmdb", "-q", options=options)
    assert out.exit_code == 1, out.output
    assert out.output.startswith(
        f"Error: s3://packs/{damage}.lmdb/shard-00001.lmdb/records.i64: "
        f"records.i64 row 1 does not point at record 1 ({wrong})"
    ), out.output


def test_verify_names_a_damaged_remote_object(s3, remote_pack, remote_tfrecord) -> None:
    options, fs = s3
    fs.put(str(remote_tfrecord[1]), "packs/bad-tf", recursive=True)
    shard = "packs/bad-tf/verify-tf-00002-of-00004.tfrecord"
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(shard, bytes(data))
    with pytest.raises(PackFormatError, match=r"s3://packs/bad-tf/verify-tf-00002-of-00004\.tfrecord: record at byte"):
        packdata.verify_pack("s3://packs/bad-tf", storage_options=options, progress=False)
    fs.put(str(remote_tfrecord[1]), "packs/noreport-tf", recursive=True)
    fs.rm_file("packs/noreport-tf/skipped.jsonl")
    with pytest.raises(PackFormatError, match=r"^s3://packs/noreport-tf: the manifest counts 1 skipped files, but"):
        packdata.verify_pack("s3://packs/noreport-tf", storage_options=options, progress=False)
    fs.put(str(remote_pack[1]), "packs/bad-verify.lmdb", recursive=True)
    mdb = "packs/bad-verify.lmdb/shard-00001.lmdb/data.mdb"
    data = bytearray(fs.cat_file(mdb))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(mdb, bytes(data))
    out = _cli("verify", "s3://packs/bad-verify.lmdb", "-q", options=options)
    assert out.exit_code == 1
    assert out.output.startswith(
        "Error: s3://packs/bad-verify.lmdb/shard-00001.lmdb/data.mdb: shard checksum does not match the manifest"
    )
    fs.rm_file("packs/bad-verify.lmdb/shard-00002.lmdb/data.mdb")
    out = _cli("verify", "s3://packs/bad-verify.lmdb", "-q", options=options)
    assert "shard-00001.lmdb/data.mdb: shard checksum" in out.output  # the first bad shard in manifest order
    fs.pipe_file(mdb, fs.cat_file("packs/train.lmdb/shard-00001.lmdb/data.mdb"))
    out = _cli("verify", "s3://packs/bad-verify.lmdb", "-q", options=options)
    assert out.output.startswith("Error: s3://packs/bad-verify.lmdb/shard-00002.lmdb/data.mdb: shard file is missing")
    fs.pipe_file("packs/bad-verify.lmdb/shard-00002.lmdb/data.mdb/part", b"x")  # a prefix where the shard was
    out = _cli("verify", "s3://packs/bad-verify.lmdb", "-q", options=options)
    assert out.output.startswith(
        "Error: s3://packs/bad-verify.lmdb/shard-00002.lmdb/data.mdb: is a folder (a prefix of other objects), not"
    ), out.output


@pytest.mark.parametrize("table", ["tfindex", "records.i64"])
def test_verify_names_a_damaged_remote_side_table_by_its_url(s3, remote_pack, remote_tfrecord, table: str) -> None:
    """A malformed .tfindex was named by its copy in verify's temporary folder, deleted by then
    ('/tmp/packdata-verify-x/pack/NAME.tfindex: offsets index is malformed'). An LMDB location table's error,
    raised while its shard streams, is named by its URL too, with its path and hint."""
    options, fs = s3
    if table == "tfindex":
        url, rel = "s3://packs/bad-tfindex", "verify-tf-00001-of-00004.tfindex"
        fs.put(str(remote_tfrecord[1]), url, recursive=True)
        fs.pipe_file(f"{url}/{rel}", fs.cat_file(f"{url}/{rel}").replace(b"\n", b" 1\n", 1))
        expected = "offsets index is malformed"
    else:
        url, rel = "s3://packs/bad-table.lmdb", "shard-00001.lmdb/records.i64"
        fs.put(str(remote_pack[1]), url, recursive=True)
        rows = np.frombuffer(fs.cat_file(f"{url}/{rel}"), dtype="<i8").reshape(-1, 3).copy()
        rows[3] = rows[5]
        fs.pipe_file(f"{url}/{rel}", rows.tobytes())
        expected = "records.i64 row 1 does not point at record 1"
    with pytest.raises(PackFormatError) as caught:
        packdata.verify_pack(url, storage_options=options, progress=False)
    assert caught.value.path == f"{url}/{rel}" and caught.value.message.startswith(expected)
    assert caught.value.hint and "packdata-verify-" not in str(caught.value)


def test_ls_and_cat_read_a_remote_pack_in_place(s3, remote_pack, remote_tfrecord, tmp_path: Path) -> None:
    from packdata.formats.contents import read_field

    options, _ = s3
    for url, local in (remote_pack, remote_tfrecord):
        listed = _cli("ls", url, "--limit", "0", "--json", options=options)
        assert listed.exit_code == 0, listed.output
        assert listed.output == CliRunner().invoke(main, ["ls", str(local), "--limit", "0", "--json"]).output
        keys = [json.loads(line)["key"] for line in listed.output.splitlines()]
        for which in (keys[0], keys[-1], "#5"):
            got = CliRunner().invoke(main, ["cat", url, which, "--storage-options", json.dumps(options)])
            assert got.exit_code == 0, got.output
            assert got.stdout_bytes == read_field(local, which) and got.stdout_bytes[:3] == b"\xff\xd8\xff"
        label = CliRunner().invoke(
            main, ["cat", url, keys[-1], "--field", "cls", "--storage-options", json.dumps(options)]
        )
        assert label.stdout_bytes == b"1"
        missing = _cli("cat", url, "nope/0.jpg", options=options)
        assert missing.exit_code == 1 and missing.output.startswith(f"Error: {url}: no sample has the key 'nope/0.jpg'")


def test_ls_never_lists_labels_of_a_damaged_index(s3, remote_tfrecord, tmp_path: Path, monkeypatch) -> None:
    """ls listed a cached copy's (or a local pack's) flipped labels.i32 as the samples' labels, silently.

    The cached copy is downloaded again; a local pack's damaged file is named.
    """
    options, _ = s3
    url, local = remote_tfrecord
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the default cache of ls and cat
    expected = _cli("ls", url, "--limit", "0", "--json", options=options).output
    assert '"label": 1' in expected

    def flip_first_label(labels: Path) -> None:
        damaged = bytearray(labels.read_bytes())
        damaged[0] ^= 0x01
        labels.write_bytes(bytes(damaged))

    (cached,) = (tmp_path / f"packdata-remote-{os.getuid()}").rglob("labels.i32")
    flip_first_label(cached)
    assert _cli("ls", url, "--limit", "0", "--json", options=options).output == expected
    assert cached.read_bytes() == (local / "index" / "labels.i32").read_bytes()
    flip_first_label(cached)
    assert _cli("cat", url, "#0", "--field", "cls", options=options).stdout_bytes == b"0"
    copy = tmp_path / "copy"
    shutil.copytree(local, copy)
    flip_first_label(copy / "index" / "labels.i32")
    out = CliRunner().invoke(main, ["ls", str(copy)])
    assert out.exit_code == 1 and out.output.startswith(f"Error: {copy / 'index' / 'labels.i32'}: "), out.output


def test_cat_of_an_lmdb_shard_without_its_location_table_says_stage_it(s3, remote_pack) -> None:
    options, fs = s3
    fs.put(str(remote_pack[1]), "packs/notable.lmdb", recursive=True)
    fs.rm_file("packs/notable.lmdb/shard-00000.lmdb/records.i64")
    out = _cli("cat", "s3://packs/notable.lmdb", "#0", options=options)
    assert out.exit_code == 1 and len(out.output.strip().splitlines()) == 1
    assert "has none that fits" in out.output and "packdata stage s3://packs/notable.lmdb --to DIR" in out.output
    assert _cli("cat", "s3://packs/notable.lmdb", "#7", options=options).exit_code == 0  # another shard has its table


def test_cat_never_prints_another_record_that_an_lmdb_location_table_points_at(s3, tmp_path: Path, monkeypatch) -> None:
    """records.i64 rows of two records of the same size swapped: cat of the first printed the second's bytes."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    url = "s3://packs/swapped.lmdb"
    _convert_to_s3(tmp_path / "src", "A", url, options, "lmdb")
    (table,) = fs.glob("packs/swapped.lmdb/*/records.i64")
    rows = np.frombuffer(fs.cat_file(table), dtype="<i8").reshape(-1, 3).copy()
    rows[[2, 3]] = rows[[3, 2]]  # after the two header rows: records 0 and 1
    fs.pipe_file(table, rows.tobytes())
    out = _cli("cat", url, "x/0.txt", options=options)
    assert out.exit_code == 1 and out.stdout_bytes == b"", out.output
    assert re.match(rf"Error: {url}/.*/data\.mdb: record 0 \(key 'x/1\.txt'\) does not match the sample", out.output)
    assert _cli("cat", url, "x/2.txt", options=options).stdout_bytes == b"Ax2" * 100  # a row of its own record


def test_a_cached_side_table_cat_finds_damaged_is_downloaded_again(
    s3, remote_pack, tmp_path: Path, monkeypatch
) -> None:
    """A cached records.i64 whose rows were swapped in place (same size, a change its stamps cannot see: within
    the timestamp tick, or a failing disk): cat named the record damaged, rightly, but every later cat and
    dataset reused the copy and named it too, though the pack at the URL is sound, until the cache was deleted."""
    from packdata.pack.files import file_stamp

    options, _ = s3
    url, local = remote_pack
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the default cache of cat
    expected = _cli("cat", url, "#0", options=options).stdout_bytes
    assert expected == packdata.LMDBDataset(local, decode="bytes")[0][0]
    (table,) = (tmp_path / f"packdata-remote-{os.getuid()}").rglob("shard-00000.lmdb/records.i64")
    rows = np.fromfile(table, dtype="<i8").reshape(-1, 3)
    rows[[2, 3]] = rows[[3, 2]]  # after the two header rows: records 0 and 1
    rows.tofile(table)
    (record,) = table.parents[1].glob(".files.json")
    stamps = json.loads(record.read_text())
    record.write_text(json.dumps({name: file_stamp(record.parent / name) for name in stamps}))
    out = _cli("cat", url, "#0", options=options)
    assert out.exit_code == 1 and out.stdout_bytes == b"", out.output
    assert re.match(
        rf"Error: {url}/shard-00000\.lmdb/data\.mdb: record 0 \(key 'cat/1\.jpg'\) does not match the sample index",
        out.output,
    ), out.output
    assert _cli("cat", url, "#0", options=options).stdout_bytes == expected
    assert table.read_bytes() == (local / "shard-00000.lmdb" / "records.i64").read_bytes()


def test_verify_ls_and_cat_never_print_credentials(s3, remote_pack, remote_tfrecord) -> None:
    options, _ = s3
    keyed = {**options, "key": "testing-key-id", "secret": SECRET}  # credentials in storage_options
    down = {
        **keyed,
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    for url, _ in (remote_pack, remote_tfrecord):
        for args in (["verify", url], ["ls", url], ["cat", url, "#0", "--field", "cls"]):
            out = _cli(*args, options=keyed)  # with progress on stderr
            assert out.exit_code == 0, out.output
            assert SECRET not in out.output and "testing-key-id" not in out.output
            secret_url = url.replace("s3://", f"s3://testing-key-id:{SECRET}@")
            for failing in ([args[0], secret_url, *args[2:]], args):
                out = _cli(*failing, options=down)
                assert out.exit_code == 1 and out.output.startswith(f"Error: {url}: cannot read manifest.json")
                assert SECRET not in out.output and "testing-key-id" not in out.output


def _write_tars(folder: Path) -> None:
    """Three WebDataset tars: 2 samples each, a link member in the second, the third cut inside a member."""
    import io
    import tarfile

    folder.mkdir(parents=True)
    for n in range(3):
        path = folder / f"data-{n:06d}.tar"
        with tarfile.open(path, "w") as tar:
            if n == 1:
                link = tarfile.TarInfo("s/link.txt")
                link.type = tarfile.SYMTYPE
                link.linkname = "/etc/passwd"
                tar.addfile(link)
            for i in range(2 * n, 2 * n + 2):
                for name, data in (
                    (f"s/{i:04d}.jpg", image_bytes(i, (24, 16))),
                    (f"s/{i:04d}.txt", f"caption {i}".encode()),
                    (f"s/{i:04d}.cls", str(i % 2).encode()),
                ):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        if n == 2:
            with tarfile.open(path) as tar:
                jpg = tar.getmembers()[-3]  # the last sample's image
            path.write_bytes(path.read_bytes()[: jpg.offset_data + jpg.size // 2])  # cut inside it


def _fields_samples(pack: Path) -> list[dict]:
    ds = packdata.LMDBDataset(pack, decode={"jpg": "bytes"})
    return [ds[i] for i in range(len(ds))]


def test_convert_tar_shards_at_a_url_streams_them_like_local_tars(s3, tmp_path: Path, monkeypatch) -> None:
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    _write_tars(tmp_path / "tars")
    fs.put(str(tmp_path / "tars"), "packs/shards", recursive=True)
    local = packdata.convert(str(tmp_path / "tars" / "data-{000000..000002}.tar"), tmp_path / "l.lmdb", progress=False)
    assert local.skipped == {"not a regular file": 1, "corrupt tar": 1}

    def no_copy(*args, **kwargs):
        raise AssertionError("a tar was copied whole")

    monkeypatch.setattr(fs, "get_file", no_copy)
    monkeypatch.setattr(fs, "get", no_copy)
    for i, pattern in enumerate(("s3://packs/shards/data-{000000..000002}.tar", "s3://packs/shards/data-*.tar")):
        out = tmp_path / f"r{i}.lmdb"
        remote = packdata.convert(pattern, out, storage_options=options, progress=False)
        assert (remote.packed, remote.skipped) == (local.packed, local.skipped) == (5, local.skipped)
        assert _fields_samples(out) == _fields_samples(tmp_path / "l.lmdb")
        assert (out / "skipped.jsonl").read_bytes() == (tmp_path / "l.lmdb" / "skipped.jsonl").read_bytes()
    assert not (tmp_path / "work").exists()
    with pytest.raises(packdata.SourceError, match=r"^s3://packs/shards/data-000003\.tar: no such tar shard"):
        packdata.convert("s3://packs/shards/data-{000000..000003}.tar", tmp_path / "x.lmdb", storage_options=options)
    cli = _cli(
        "convert", "s3://packs/shards/data-{000000..000002}.tar", str(tmp_path / "c.lmdb"), "-q", options=options
    )
    assert cli.exit_code == 0 and SECRET not in cli.output, cli.output


def test_a_failed_tar_request_stops_resumably_and_a_resume_completes(s3, tmp_path: Path, monkeypatch) -> None:
    from packdata.conversion.destination import partial_path

    options, fs = s3
    _write_tars(tmp_path / "tars")
    fs.put(str(tmp_path / "tars"), "packs/flaky-shards", recursive=True)
    real_open = fs.open

    def dropping_open(path, *args, **kwargs):
        if path.endswith("data-000001.tar"):
            raise ConnectionResetError("reset by peer")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(fs, "open", dropping_open)
    pattern, dst = "s3://packs/flaky-shards/data-{000000..000002}.tar", tmp_path / "r.lmdb"
    with pytest.raises(packdata.SourceError, match=r"^s3://packs/flaky-shards/data-000001\.tar: cannot read the tar"):
        packdata.convert(pattern, dst, storage_options=options, progress=False, shard_samples=1)
    assert partial_path(dst).exists() and not dst.exists()  # kept to resume, not published
    monkeypatch.setattr(fs, "open", real_open)
    resumed = packdata.convert(pattern, dst, storage_options=options, progress=False, shard_samples=1, resume=True)
    packdata.convert(str(tmp_path / "tars" / "data-*.tar"), tmp_path / "l.lmdb", progress=False, shard_samples=1)
    assert resumed.packed == 5 and _fields_samples(dst) == _fields_samples(tmp_path / "l.lmdb")


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_convert_a_list_at_a_url_reads_the_files_beside_it(s3, tmp_path: Path, suffix: str) -> None:
    options, fs = s3
    folder = tmp_path / "listed"
    (folder / "imgs").mkdir(parents=True)
    rows = []
    for i, label in enumerate(["zebra", "ant", "zebra", "ant"]):
        (folder / "imgs" / f"im{i}.jpg").write_bytes(image_bytes(i + 3, (20, 20)))
        rows.append({"image": f"imgs/im{i}.jpg", "label": label, "caption": f"photo {i}"})
    rows.append({"image": "imgs/missing.jpg", "label": "ant", "caption": "gone"})
    good = list(rows)
    rows += [
        {"image": "../outside/x.jpg", "label": "ant", "caption": "up"},
        {"image": "/etc/hostname.jpg", "label": "ant", "caption": "absolute"},
    ]
    for name, chosen in (("remote", rows), ("local", good)):
        listing = folder / f"{name}{suffix}"
        if suffix == ".jsonl":
            listing.write_text("".join(json.dumps(r) + "\n" for r in chosen), encoding="utf-8")
        else:
            listing.write_text("\n".join([",".join(chosen[0])] + [",".join(r.values()) for r in chosen]) + "\n")
    fs.put(str(folder), f"packs/listed{suffix}", recursive=True)
    url = f"s3://packs/listed{suffix}/remote{suffix}"
    columns = {"path_column": "image", "label_column": "label"}
    remote = packdata.convert(url, tmp_path / "r.lmdb", storage_options=options, progress=False, workers=3, **columns)
    local = packdata.convert(folder / f"local{suffix}", tmp_path / "l.lmdb", progress=False, **columns)
    assert (remote.packed, local.packed) == (4, 4) and local.skipped == {"vanished": 1}
    assert remote.skipped == {"vanished": 1, "bad path": 2}
    assert _fields_samples(tmp_path / "r.lmdb") == _fields_samples(tmp_path / "l.lmdb")
    report = (tmp_path / "r.lmdb" / "skipped.jsonl").read_text()
    assert "../outside/x" in report and "/etc/hostname" in report and SECRET not in report


def test_a_source_object_named_with_dotdot_is_in_the_skip_report_and_never_written(s3, tmp_path: Path, monkeypatch):
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    for c in ("cat", "dog"):
        for i in range(3):
            fs.pipe_file(f"packs/unsafe/{c}/{i}.jpg", image_bytes(i + 5 * len(c), (20, 20)))
    evil = image_bytes(99, (20, 20))
    fs.pipe_file("packs/unsafe/cat/../../escaped.jpg", evil)
    fs.pipe_file("packs/unsafe/dog//5.jpg", evil)
    names = sorted(p[len("packs/unsafe/") :] for p in fs.find("packs/unsafe"))
    assert "cat/../../escaped.jpg" in names and "dog//5.jpg" in names  # the store keeps both names as they are
    dst = tmp_path / "out.lmdb"
    result = packdata.convert("s3://packs/unsafe", dst, storage_options=options, progress=False)
    assert result.packed == 6 and result.skipped == {"unsafe name": 2} and result.found == 8
    lines = [json.loads(line) for line in (dst / "skipped.jsonl").read_text().splitlines()]
    assert [(line["key"], line["reason"]) for line in lines] == [
        ("cat/../../escaped.jpg", "unsafe name"),
        ("dog//5.jpg", "unsafe name"),
    ]
    assert not any(p.read_bytes() == evil for p in tmp_path.rglob("*.jpg"))
    assert not (tmp_path / "escaped.jpg").exists() and not (tmp_path / "work" / "escaped.jpg").exists()
    assert packdata.verify_pack(dst, progress=False).records == 6  # the counts add up: found = packed + skipped
    out = _cli("convert", "s3://packs/unsafe", str(tmp_path / "cli.lmdb"), "-q", options=options)
    assert out.exit_code == 0 and "SKIPPED 2" in out.output and "cat/../../escaped.jpg: unsafe name" in out.output
    assert SECRET not in out.output


def test_a_source_object_named_like_another_objects_folder_is_a_skip_not_a_traceback(s3, tmp_path: Path, monkeypatch):
    """An object store holds cat/b and cat/b/1.jpg; a disk cannot: the download died with a raw IsADirectoryError."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    fs.pipe_file("packs/clash/cat/0.jpg", image_bytes(1, (20, 20)))
    fs.pipe_file("packs/clash/cat/b", b"an object named like a folder")
    fs.pipe_file("packs/clash/cat/b/1.jpg", image_bytes(2, (20, 20)))
    result = packdata.convert("s3://packs/clash", tmp_path / "out.lmdb", storage_options=options, progress=False)
    assert (result.found, result.packed, result.skipped) == (3, 2, {"unsafe name": 1})
    detail = "an object of this name is also the folder of others: a file on disk cannot be both; not read"
    assert result.skip_examples == [{"key": "cat/b", "reason": "unsafe name", "detail": detail}]
    ds = packdata.LMDBDataset(tmp_path / "out.lmdb")
    assert [ds.keys[i] for i in range(len(ds))] == ["cat/0.jpg", "cat/b/1.jpg"]


def test_folder_markers_in_a_source_bucket_are_folders_not_unsafe_names(s3, tmp_path: Path, monkeypatch) -> None:
    """An empty ``cat/`` object (a console's "create folder") was an 'unsafe name' skip: on_error='fail' stopped."""
    from packdata.conversion.remote_folder import scan_remote_folder
    from packdata.conversion.sources import scan_source

    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    src = _two_classes(tmp_path / "src", 3)
    fs.put(str(src), "packs/marked", recursive=True)
    for marker in ("cat/", "dog/", "empty/"):
        fs.pipe_file(f"packs/marked/{marker}", b"")
    fs.invalidate_cache()
    assert "packs/marked/cat/" in fs.find("packs/marked")  # the store lists each marker as an empty object
    result = packdata.convert("s3://packs/marked", tmp_path / "out.lmdb", on_error="fail", storage_options=options)
    assert result.packed == result.found == 10 and result.skipped == {}
    walked = [(e.key, type(e).__name__) for e in scan_remote_folder("s3://packs/marked", options).walk()]
    assert walked == [(e.key, "RemoteSourceFile") for e in scan_source(src).walk()]  # the Ray engine's walk


@pytest.mark.parametrize("engine", ["local", "ray"])
def test_a_destination_url_inside_the_source_url_is_refused(s3, tmp_path: Path, monkeypatch, engine: str) -> None:
    """A pack inside its source's URL was made; a rerun then packed its manifest.json and skipped.jsonl as text."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    for i in range(3):
        fs.pipe_file(f"packs/texts/cls/{i}.txt", f"text {i}".encode())
    for dst, problem in (
        ("s3://packs/texts/out.lmdb", "destination is inside the source folder s3://packs/texts"),
        ("s3://packs/texts/", "destination is inside the source folder s3://packs/texts"),
        ("s3://packs", "the source folder s3://packs/texts is inside the destination"),
    ):
        with pytest.raises(ConfigError, match=re.escape(problem)):
            packdata.convert("s3://packs/texts", dst, storage_options=options, progress=False, engine=engine)
    fs.invalidate_cache()
    assert sorted(fs.find("packs/texts")) == [f"packs/texts/cls/{i}.txt" for i in range(3)]  # nothing written
    assert not (tmp_path / "work").exists()


_STALLED_UPLOAD = _AT_MANIFEST.replace(  # all uploaded but the manifest: waits for a line
    "AT_MANIFEST", "print('uploading', flush=True); sys.stdin.readline()"
)


def test_a_second_conversion_into_a_url_being_uploaded_is_refused(s3, tmp_path: Path, monkeypatch) -> None:
    """The work folder was locked only while packing: a second run deleted the first's pack as it was uploaded."""
    options, _ = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    first, second = _two_classes(tmp_path / "first", 2), _two_classes(tmp_path / "second", 6)
    url = "s3://packs/contested.lmdb"
    child = subprocess.Popen(
        [sys.executable, "-c", _STALLED_UPLOAD, str(first), url, json.dumps(options)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline() == "uploading\n"
        for engine in ("local", "ray"):
            with pytest.raises(
                packdata.LockedError, match=r"s3://packs/contested\.lmdb: .*packdata convert into a URL"
            ):
                packdata.convert(second, url, storage_options=options, progress=False, engine=engine)
        child.communicate("go\n", timeout=60)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 0
    expected = packdata.convert(first, tmp_path / "expected" / "contested.lmdb", progress=False)
    staged = packdata.stage(url, to=tmp_path / "cache", storage_options=options, progress=False)
    assert _samples(staged.staged) == _samples(expected.pack)


@pytest.fixture
def small_work_disk(tmp_path: Path, monkeypatch) -> Iterator[Path]:
    """PACKDATA_TMP on a 2 MiB tmpfs (root only), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount tmpfs")
    work = tmp_path / "work"
    work.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(work)], check=True)
    monkeypatch.setenv("PACKDATA_TMP", str(work))
    try:
        yield work
    finally:
        subprocess.run(["umount", "-l", str(work)], check=False)


def test_a_source_too_big_for_the_work_disk_is_refused_before_any_download(s3, small_work_disk, tmp_path) -> None:
    options, fs = s3
    for i in range(3):
        fs.pipe(f"packs/big-source/cls/{i}.txt", os.urandom(1_000_000))
    with pytest.raises(packdata.CapacityError) as refused:
        packdata.convert("s3://packs/big-source", tmp_path / "out.lmdb", storage_options=options, progress=False)
    message = str(refused.value)
    assert "the source's files need 2.9 MiB in the work folder" in message and "PACKDATA_TMP" in message
    assert not [p for p in small_work_disk.rglob("*") if p.is_file()]  # nothing was downloaded
    assert not (tmp_path / "out.lmdb").exists()
    assert len(fs.find("packs/big-source")) == 3  # the source is untouched


def test_a_full_work_disk_while_packing_for_a_url_names_the_work_folder(s3, small_work_disk, tmp_path) -> None:
    options, fs = s3
    src = tmp_path / "src" / "cls"
    src.mkdir(parents=True)
    for i in range(6):
        (src / f"{i}.txt").write_bytes(os.urandom(400_000).hex().encode()[:400_000])
    url = "s3://packs/too-big.lmdb"
    with pytest.raises(packdata.CapacityError) as full:
        packdata.convert(tmp_path / "src", url, storage_options=options, progress=False)
    message = str(full.value)
    assert "the work folder's disk filled while packing for s3://packs/too-big.lmdb" in message
    assert str(small_work_disk) in message and "PACKDATA_TMP" in message and "--resume" in message
    assert "free on its disk" in str(full.value.__cause__)  # it ran out writing a shard, past the start check
    assert not fs.exists("packs/too-big.lmdb/manifest.json")  # no manifest: no pack


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


_STALLED_URL_STAGE = """
import json, sys, threading
import packdata
from packdata.staging import remote
fetch, gate, released = remote._fetch_range, threading.Lock(), []
def stalled(*args):  # the first range waits for a line on stdin; the stage holds its locks meanwhile
    with gate:
        if not released:
            print("downloading", flush=True)
            sys.stdin.readline()
            released.append(True)
    return fetch(*args)
remote._fetch_range = stalled
packdata.stage(sys.argv[1], to=sys.argv[2], storage_options=json.loads(sys.argv[3]), progress=False)
print("staged", flush=True)
"""


def test_a_local_stage_is_refused_while_a_url_stage_downloads_into_the_same_folder(
    s3, remote_pack, tmp_path: Path
) -> None:
    """As a second local stage into the folder is: it waits, then past wait_seconds LockedError naming the holder
    and its lock file."""
    from packdata.errors import LockedError

    options, _ = s3
    url, local = remote_pack
    cache = tmp_path / "cache"
    child = subprocess.Popen(
        [sys.executable, "-c", _STALLED_URL_STAGE, url, str(cache), json.dumps(options)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdin is not None and child.stdout is not None
        assert child.stdout.readline().strip() == "downloading"
        lock = re.escape(str(cache / ".train.lmdb.lock"))
        held = rf"pid {child.pid} on host .*\(packdata stage \(download\).*{lock}\), still after waiting 0.5 s"
        with pytest.raises(LockedError, match=held):
            packdata.stage(local, to=cache, progress=False, wait_seconds=0.5)
        assert not (cache / "train.lmdb" / "staged.json").exists()  # the local stage wrote nothing
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "staged"
    finally:
        child.kill()
        child.wait()
    assert json.loads((cache / "train.lmdb" / "staged.json").read_text())["origin"] == url
    assert _samples(cache / "train.lmdb") == _samples(local)


_READ_ACROSS_A_CHANGE = """
import json, sys
import packdata
from packdata.errors import PackFormatError
from packdata.formats import tfrecord_remote
tfrecord_remote.RemoteShardReader.CHUNK = 100  # a record or two per request: most of the shard is fetched later
ds = packdata.TFRecordDataset(
    sys.argv[1], decode="bytes", shuffle=False, storage_options=json.loads(sys.argv[2]), cache_dir=sys.argv[3]
)
it = iter(ds)
print(json.dumps([next(it)[0].decode() for _ in range(2)]), flush=True)
sys.stdin.readline()  # meanwhile the pack is uploaded again and another process opens it, replacing the cache copy
read, error = [], ""
try:
    read += [data.decode() for data, _ in it]
except PackFormatError as exc:
    error = str(exc)
print(json.dumps({"read": read, "error": error}), flush=True)
"""


def _text_pack(root: Path, tag: str) -> Path:
    """A one-shard TFRecord pack ``root/changing`` of 12 text samples whose bytes start with ``tag``."""
    for c in ("x", "y"):
        (root / "src" / c).mkdir(parents=True)
        for i in range(6):
            (root / "src" / c / f"{i}.txt").write_text(f"{tag}{c}{i}" * 10)
    packdata.convert(root / "src", root / "changing", format="tfrecord", shard_samples=12, progress=False)
    return root / "changing"


def test_errors_of_a_pack_at_a_url_name_the_url_never_only_the_cache(s3, tmp_path: Path) -> None:
    """A dataset opened at a URL named its local cache folder in its errors: a path the user never gave."""
    options, fs = s3
    url, cache = "s3://packs/named-by-url", tmp_path / "cache"
    fs.put(str(_text_pack(tmp_path / "p", "A")), "packs/named-by-url", recursive=True)

    def opened(**options_: object) -> packdata.TFRecordDataset:
        return packdata.TFRecordDataset(url, shuffle=False, storage_options=options, cache_dir=cache, **options_)

    with pytest.raises(
        ConfigError, match=rf"^{url}: fields, transforms, missing and per-field decode are for multi-field"
    ):
        opened(fields=("txt",))
    with pytest.raises(PackFormatError, match=rf"^{url}: sample 'x/0\.txt' \(index 0\): "):
        next(iter(opened(decode="pil")))
    with pytest.raises(ConfigError, match=rf"^{url}: the reader state was saved with seed=5"):
        opened().load_state_dict({**opened().state_dict(), "seed": 5})
    ds = opened()
    for table in [*cache.rglob("*.tfpayload"), *cache.rglob("*.tfindex")]:
        table.unlink()  # a clean-up of the cache while the dataset is open
    with pytest.raises(PackFormatError, match=rf"^{url}/changing-00000-of-00001\.tfindex: ") as raised:
        list(ds)
    assert str(cache) not in str(raised.value)
    older = _text_pack(tmp_path / "older", "A")  # a pack whose manifest records no index digests, its index cut
    rewrite_manifest(older, lambda d: d["index"].pop("sha256"))
    os.truncate(older / "index" / "sizes.i64", 8)
    fs.put(str(older), "packs/older", recursive=True)
    with pytest.raises(PackFormatError, match=r"^s3://packs/older/index: sample index is missing or damaged"):
        packdata.TFRecordDataset("s3://packs/older", storage_options=options, cache_dir=cache)
    out = _cli("ls", "s3://packs/older", options=options)
    assert out.exit_code == 1 and out.output.startswith("Error: s3://packs/older/index: sample index is"), out.output
    damaged = _text_pack(tmp_path / "damaged", "A")  # its offsets index cut: cat reads a record through it
    (tfindex,) = damaged.glob("*.tfindex")
    os.truncate(tfindex, tfindex.stat().st_size - 8)
    fs.put(str(damaged), "packs/damaged", recursive=True)
    out = _cli("cat", "s3://packs/damaged", "x/0.txt", options=options)
    assert out.exit_code == 1 and out.output.startswith(f"Error: s3://packs/damaged/{tfindex.name}: "), out.output


def test_a_reader_whose_cache_copy_another_process_replaced_stops_with_one_clear_error(s3, tmp_path: Path) -> None:
    """The pack uploaded again, its records of the same lengths: nothing read after the replacement is the new one's."""
    options, fs = s3
    url, cache = "s3://packs/changing", tmp_path / "cache"
    first, second = _text_pack(tmp_path / "v1", "A"), _text_pack(tmp_path / "v2", "B")
    fs.put(str(first), "packs/changing", recursive=True)
    reader = subprocess.Popen(
        [sys.executable, "-c", _READ_ACROSS_A_CHANGE, url, json.dumps(options), str(cache)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert reader.stdin is not None and reader.stdout is not None
        assert json.loads(reader.stdout.readline()) == ["Ax0" * 10, "Ax1" * 10]
        fs.rm("packs/changing", recursive=True)
        fs.put(str(second), "packs/changing", recursive=True)
        fs.invalidate_cache()
        other = packdata.TFRecordDataset(url, decode="bytes", storage_options=options, cache_dir=cache)
        assert sorted(data[:1] for data, _ in other) == [b"B"] * 12  # this process reads the new pack
        reader.stdin.write("\n")
        reader.stdin.flush()
        outcome = json.loads(reader.stdout.readline())
    finally:
        reader.kill()
        reader.wait()
    assert all(data.startswith("A") for data in outcome["read"]), outcome["read"]  # never the new pack's records
    assert re.fullmatch(
        rf"{url}/manifest\.json: pack changed since the dataset was opened .* \(cached copy: "
        rf"{re.escape(str(cache))}/\w+/changing/manifest\.json\)\. Recreate the dataset .*",
        outcome["error"],
    ), outcome["error"]


def _convert_to_s3(root: Path, tag: str, url: str, options: dict, fmt: str = "tfrecord") -> None:
    """Convert 12 text samples of 300 bytes starting with ``tag`` into ``url`` (one shard), over any pack there.

    Every tag gives records of the same lengths, keys and labels: only their bytes differ.
    """
    for c in ("x", "y"):
        (root / c).mkdir(parents=True)
        for i in range(6):
            (root / c / f"{i}.txt").write_text(f"{tag}{c}{i}" * 100)
    packdata.convert(root, url, format=fmt, shard_samples=12, overwrite=True, storage_options=options,
                     progress=False)  # fmt: skip


@pytest.mark.parametrize("fmt", ["tfrecord", "lmdb"])
def test_cat_never_prints_a_record_of_a_pack_uploaded_again_after_it_read_the_index(
    s3, tmp_path: Path, monkeypatch, fmt: str
) -> None:
    """The pack converted over itself between cat's index download and its ranged read: same lengths, keys, labels."""
    import packdata.formats.contents as contents

    options, _ = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    url = f"s3://packs/cat-{fmt}"
    _convert_to_s3(tmp_path / "v1", "A", url, options, fmt)
    assert _cli("cat", url, "x/0.txt", options=options).stdout_bytes == b"Ax0" * 100
    fetch = contents.fetch_pack_skeleton

    def then_uploaded_again(*args: object) -> object:
        opened = fetch(*args)
        _convert_to_s3(tmp_path / "v2", "B", url, options, fmt)
        return opened

    monkeypatch.setattr(contents, "fetch_pack_skeleton", then_uploaded_again)
    out = _cli("cat", url, "x/0.txt", options=options)
    assert out.exit_code == 1 and out.stdout_bytes == b"", out.output
    assert re.match(rf"Error: {url}/.*: was replaced \(re-uploaded\?\) while this reader ran", out.output), out.output
    monkeypatch.setattr(contents, "fetch_pack_skeleton", fetch)
    assert _cli("cat", url, "x/0.txt", options=options).stdout_bytes == b"Bx0" * 100  # a new cat reads the new pack


@pytest.mark.parametrize("if_match", [True, False])
def test_a_shard_uploaded_again_mid_epoch_stops_the_reader_before_any_new_record(
    s3, tmp_path: Path, monkeypatch, if_match: bool
) -> None:
    """The pack converted over itself while read, records of the same lengths: the epoch once mixed both packs."""
    import packdata.formats.remote_pack as remote_pack
    import packdata.formats.tfrecord_remote as remote
    import packdata.pack.urls as urls

    options, _ = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    monkeypatch.setattr(remote.RemoteShardReader, "CHUNK", 400)  # one record a request: most are fetched later
    if not if_match:  # a store without If-Match: the version is looked up after each read
        for module in (urls, remote_pack):
            monkeypatch.setattr(module, "conditional_reads", lambda fs: False)
    url = f"s3://packs/mid-epoch-{if_match}"
    _convert_to_s3(tmp_path / "v1", "A", url, options)
    ds = packdata.TFRecordDataset(url, decode="bytes", shuffle=False, storage_options=options, cache_dir=tmp_path)
    it = iter(ds)
    read = [next(it)[0]]
    _convert_to_s3(tmp_path / "v2", "B", url, options)
    with pytest.raises(
        PackFormatError,
        match=rf"^s3://packs/mid-epoch-{if_match}/mid-epoch-{if_match}-00000-of-00001\.tfrecord: was replaced "
        r"\(re-uploaded\?\) while this reader ran\. Rebuild the dataset",
    ):
        for data, _ in it:
            read.append(data)
    assert 1 <= len(read) < 12 and all(data.startswith(b"A") for data in read), read  # never the new pack's bytes
    fresh = packdata.TFRecordDataset(url, decode="bytes", shuffle=False, storage_options=options, cache_dir=tmp_path)
    assert [data[:1] for data, _ in fresh] == [b"B"] * 12  # a dataset built again reads the new pack


def test_a_shard_replaced_mid_epoch_in_a_store_without_etags_stops_the_reader(tmp_path: Path, monkeypatch) -> None:
    """fsspec's memory store gives no ETag or modification time, only a creation time: a shard replaced there by
    another pack's of the same layout while a reader read it was streamed on, the epoch mixing both packs."""
    import fsspec

    import packdata.formats.tfrecord_remote as remote

    monkeypatch.setattr(remote.RemoteShardReader, "CHUNK", 400)  # one record a request: most are fetched later
    memory = fsspec.filesystem("memory")
    first, second = _text_pack(tmp_path / "v1", "A"), _text_pack(tmp_path / "v2", "B")
    memory.put(str(first), "/replaced/changing", recursive=True)
    try:
        ds = packdata.TFRecordDataset("memory://replaced/changing", decode="bytes", shuffle=False, cache_dir=tmp_path)
        it = iter(ds)
        read = [next(it)[0]]
        (shard,) = memory.glob("/replaced/changing/*.tfrecord")
        memory.pipe_file(shard, (second / PurePosixPath(shard).name).read_bytes())
        with pytest.raises(PackFormatError, match=r"^memory://.*\.tfrecord: was replaced \(re-uploaded\?\) while"):
            for data, _ in it:
                read.append(data)
        assert all(data.startswith(b"A") for data in read), read  # never the other pack's records
    finally:
        memory.rm("/replaced", recursive=True)


def test_a_reader_state_never_resumes_on_a_pack_uploaded_again_since(s3, tmp_path: Path, monkeypatch) -> None:
    """The pack converted over itself between a checkpoint and the restart (same counts, keys, labels): the resumed
    epoch took the new pack's records at the old pack's unread positions, mixing two packs, silently."""
    options, _ = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    url = "s3://packs/resumed"
    _convert_to_s3(tmp_path / "v1", "A", url, options)

    def opened() -> packdata.TFRecordDataset:
        return packdata.TFRecordDataset(url, decode="bytes", seed=3, storage_options=options, cache_dir=tmp_path)

    ds = opened()
    it = iter(ds)
    read = [next(it)[0] for _ in range(5)]
    state = json.loads(json.dumps(ds.state_dict()))  # as a checkpoint keeps it
    same = opened()
    same.load_state_dict(state)
    assert sorted(read + [data for data, _ in same]) == sorted(data for data, _ in opened())  # the same pack resumes
    _convert_to_s3(tmp_path / "v2", "B", url, options)
    with pytest.raises(ConfigError, match=r"the reader state was saved with pack='[0-9a-f]{16}', but this dataset"):
        opened().load_state_dict(state)
    del state["pack"]  # a state saved by packdata before it named its pack
    older = opened()
    older.load_state_dict(state)
    assert len(list(older)) == 12 - 5


def test_a_record_that_differs_from_the_index_is_named_by_its_url(s3, tmp_path: Path, monkeypatch) -> None:
    """A shard object overwritten by another pack's (same layout, other keys) before the first read: the error named
    the shard by the path it would have in the local cache copy, a file that does not exist."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    _convert_to_s3(tmp_path / "named", "A", "s3://packs/named", options)
    for c in ("u", "v"):  # keys of the same lengths as x/0.txt...
        (tmp_path / "other" / c).mkdir(parents=True)
        for i in range(6):
            (tmp_path / "other" / c / f"{i}.txt").write_text(f"B{c}{i}" * 100)
    packdata.convert(tmp_path / "other", "s3://packs/other", format="tfrecord", shard_samples=12,
                     storage_options=options, progress=False)  # fmt: skip
    (shard,) = fs.glob("packs/named/*.tfrecord")
    (table,) = fs.glob("packs/named/*.tfpayload")
    fs.rm_file(table)  # records are parsed, their keys matched with the index
    fs.pipe_file(shard, fs.cat_file(fs.glob("packs/other/*.tfrecord")[0]))
    ds = packdata.TFRecordDataset("s3://packs/named", decode="bytes", storage_options=options, cache_dir=tmp_path)
    with pytest.raises(PackFormatError) as raised:
        list(ds)
    assert str(raised.value).startswith(f"s3://{shard}: record 0 at byte offset 0 is damaged: it holds key"), raised


def test_a_pack_uploaded_again_after_the_dataset_opened_is_refused_at_its_first_read(
    s3, tmp_path: Path, monkeypatch
) -> None:
    options, _ = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    url = "s3://packs/before-read"
    _convert_to_s3(tmp_path / "v1", "A", url, options)
    ds = packdata.TFRecordDataset(url, decode="bytes", shuffle=False, storage_options=options, cache_dir=tmp_path)
    _convert_to_s3(tmp_path / "v2", "B", url, options)  # the manifest deleted, the shard replaced, a new manifest
    read = []
    with pytest.raises(PackFormatError, match=r"before-read-00000-of-00001\.tfrecord: was replaced \(re-uploaded"):
        for data, _ in ds:
            read.append(data)
    assert read == []
    table = ds._load_records(0, payloads=False)
    with pytest.raises(PackFormatError, match=r"tfrecord: was replaced"):  # a single read too
        ds._shard_reader(0).read(int(table.offsets[0]), int(table.lengths[0]))


def test_an_unchanged_remote_pack_costs_one_version_lookup_per_shard_and_no_request_per_chunk(
    s3, remote_shards, small_chunks, monkeypatch, tmp_path: Path
) -> None:
    options, fs = s3
    _, local, shards = remote_shards
    fs.put(str(local), "packs/pinned", recursive=True)  # a pack no other test has read in this process
    expected = [data for data, _ in packdata.TFRecordDataset(local, decode="bytes", shuffle=False)]
    calls: list[tuple[str, dict]] = []
    log = _logged(monkeypatch, fs, calls=calls)
    ds = packdata.TFRecordDataset(
        "s3://packs/pinned", decode="bytes", shuffle=False, storage_options=options, cache_dir=tmp_path
    )
    calls.clear()  # what opening the dataset asked for
    for epoch in (0, 1):
        log.clear()
        assert [data for data, _ in ds] == expected  # every record once, in order
        assert len(log) == len(set(log)) > len(shards)  # each chunk requested once, several a shard
        heads = sorted(kwargs["Key"] for method, kwargs in calls if method == "head_object")
        manifests = [kwargs for method, kwargs in calls if method == "get_object" and kwargs["Key"].endswith(".json")]
        if epoch == 0:  # each shard pinned at its first read: its version, then the manifest read again
            assert [key for key in heads if key.endswith(".tfrecord")] == [f"pinned/{name}" for name, _ in shards]
            assert len(manifests) == len(shards)
        else:  # pinned already: nothing but the chunks
            assert heads == [] and manifests == []
        gets = [kwargs for method, kwargs in calls if method == "get_object" and kwargs["Key"].endswith(".tfrecord")]
        assert len(gets) == len(log) and all(kwargs["IfMatch"] for kwargs in gets)  # every read from the version
        assert {method for method, _ in calls} <= {"head_object", "get_object"}
        calls.clear()


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


_KILLED_SWEEP = """
import json, os, signal, sys
import packdata
unlink = os.unlink
def dying(path, *args, **kwargs):  # killed as the delete comes to staged.json: no clean-up runs
    if os.path.basename(path) == "staged.json":
        os.kill(os.getpid(), signal.SIGKILL)
    unlink(path, *args, **kwargs)
os.unlink = dying
packdata.stage(sys.argv[1], to=sys.argv[3], storage_options=json.loads(sys.argv[2]), progress=False)
"""


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


def test_cache_limit_never_evicts_a_copy_whose_lock_another_process_holds(s3, remote_pack, tmp_path: Path) -> None:
    """A copy another process is staging, replacing or unstaging (it holds .NAME.lock) is skipped, never deleted."""
    options, local, cache, first, size = _staged_and_second(s3, remote_pack, tmp_path)
    limit = int(1.5 * size)  # one copy fits, not two: the first must go for the second
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(cache / ".train.lmdb.lock")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(packdata.CapacityError, match="cache limit"):
            packdata.stage("s3://packs/second.lmdb", to=cache, storage_options=options, progress=False,
                           cache_limit=limit)  # fmt: skip
        assert _samples(first) == _samples(local) and not (cache / "second.lmdb").exists()
    finally:
        holder.kill()
        holder.wait()
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
def checked(entry, options):  # eviction has checked the copy is unread, and has not deleted it yet
    found = evictable(entry, options)
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

    try:
        assert evictor.stdout.readline().strip() == "evicting"
        reader = threading.Thread(target=open_and_read)
        reader.start()
        deadline = time.monotonic() + 5
        while not outcome and time.monotonic() < deadline and ".readers.lock" not in _open_files():
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


def test_a_driver_that_meets_a_few_5xx_replies_completes_and_a_denied_request_is_not_tried_again(
    s3, tmp_path: Path, monkeypatch
) -> None:
    """A single 503 on a download, an upload or a manifest PUT of the local engine stopped the whole run."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    src = _two_classes(tmp_path / "src", 5)
    fs.put(str(src), "packs/flaky-local-src", recursive=True)
    read, shard = (
        ("GET", "/packs/flaky-local-src/dog/3.jpg"),
        ("PUT", "/packs/flaky-local.lmdb/shard-00001.lmdb/data.mdb"),
    )
    manifest = ("PUT", "/packs/flaky-local.lmdb/manifest.json")
    with faulty_s3(options) as (faulty, rules, hits):
        rules[read], rules[shard], rules[manifest] = [503, 2], [503, 2], [503, 2]
        result = packdata.convert(
            "s3://packs/flaky-local-src", "s3://packs/flaky-local.lmdb", shard_samples=6, storage_options=faulty,
            progress=False,
        )  # fmt: skip
        assert result.packed == 10 and rules[read][1] == rules[shard][1] == rules[manifest][1] == 0
        denied = ("PUT", "/packs/denied-local.lmdb/manifest.json")
        rules[denied] = [403, 1]
        with pytest.raises(PackFormatError, match=r"uploading manifest\.json failed \(PermissionError\)"):
            packdata.convert(src, "s3://packs/denied-local.lmdb", storage_options=faulty, progress=False)
        assert hits[denied] == 1  # access denied: not tried again
    fs.get("packs/flaky-local.lmdb", str(tmp_path / "got.lmdb"), recursive=True)
    packdata.convert(src, tmp_path / "clean.lmdb", shard_samples=6, progress=False)
    assert _samples(tmp_path / "got.lmdb") == _samples(tmp_path / "clean.lmdb")


def test_a_ray_driver_looks_objects_up_again_after_a_5xx_reply_but_not_after_a_denied_one(s3, tmp_path: Path) -> None:
    """objects_complete and place_shards (a Ray driver's resume and final moves) stopped the run on one 503."""
    from packdata.conversion.ray_remote import RemoteTarget, objects_complete, place_shards, upload_task_files
    from packdata.pack.manifest import ShardInfo

    options, _ = s3
    pack = tmp_path / "pack"
    (pack / "shard-00000.lmdb").mkdir(parents=True)
    (pack / "shard-00000.lmdb" / "data.mdb").write_bytes(b"x" * 1000)
    objects = upload_task_files(pack, "tasks", RemoteTarget("s3://packs/ray-driver.lmdb", options))
    head = ("HEAD", "/packs/ray-driver.lmdb/shard-00000.lmdb/data.mdb")
    with faulty_s3(options) as (faulty, rules, hits):
        target = RemoteTarget("s3://packs/ray-driver.lmdb", faulty)
        rules[head] = [503, 2]
        assert objects_complete(target, objects) and hits[head] == 3
        written = ShardInfo("shard-00000.lmdb", 1, 0, 1000, "")
        rules[head] = [503, 2]
        place_shards(target, [written], [written], [objects])
        assert hits[head] == 6
        rules[head] = [403, 1]
        with pytest.raises(SourceError, match=r"cannot look up the shards uploaded before \(PermissionError\)"):
            objects_complete(target, objects)
        assert hits[head] == 7


def _rewrite_after_listing(monkeypatch, fs, path: str) -> bytes:
    """Rewrite the object ``path`` at its size once the local engine has listed its source; return the new bytes."""
    import packdata.conversion.download as download

    rewritten = bytearray(fs.cat_file(path))
    rewritten[len(rewritten) // 2] ^= 0xFF
    check_room = download._check_room

    def rewrite_then_check_room(*args) -> None:  # after the listing, before the downloads
        fs.pipe_file(path, bytes(rewritten))
        check_room(*args)

    monkeypatch.setattr(download, "_check_room", rewrite_then_check_room)
    return bytes(rewritten)


@pytest.mark.parametrize("whole", [True, False])
def test_a_source_object_rewritten_at_the_same_size_before_its_download_is_a_changed_skip(
    s3, tmp_path: Path, monkeypatch, whole: bool
) -> None:
    """The local engine packed the rewritten bytes and journalled them under the version it had listed."""
    import packdata.conversion.download as download

    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    if not whole:  # an object too large to read into memory: downloaded to a file, its version looked up after
        monkeypatch.setattr(download, "_READ_WHOLE", 0)
    root = f"packs/rewritten-src-{whole}"
    fs.put(str(_two_classes(tmp_path / "src", 5)), root, recursive=True)
    rewritten = _rewrite_after_listing(monkeypatch, fs, f"{root}/dog/3.jpg")
    result = packdata.convert(f"s3://{root}", tmp_path / "got.lmdb", storage_options=options, progress=False)
    assert result.packed == 9 and result.skipped == {"changed": 1}
    assert rewritten not in [data for _, data, _ in _samples(tmp_path / "got.lmdb")]
    lines = [json.loads(line) for line in (tmp_path / "got.lmdb" / "skipped.jsonl").read_text().splitlines()]
    assert [(line["key"], line["reason"]) for line in lines] == [("dog/3.jpg", "changed")]


def test_a_grouped_object_rewritten_before_its_download_skips_its_sample_whole(s3, tmp_path: Path, monkeypatch) -> None:
    """b.txt rewritten after the listing was a 'changed' skip, and sample b was packed without its caption."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    src = tmp_path / "src"
    src.mkdir()
    for key in "abc":
        (src / f"{key}.json").write_text(json.dumps([key]), encoding="utf-8")
        (src / f"{key}.txt").write_text(f"caption {key}", encoding="utf-8")
    root = "packs/grouped-changed"
    fs.put(str(src), root, recursive=True)
    _rewrite_after_listing(monkeypatch, fs, f"{root}/b.txt")
    result = packdata.convert(f"s3://{root}", tmp_path / "got.lmdb", storage_options=options, progress=False)
    assert (result.found, result.packed, result.skipped) == (3, 2, {"changed": 1})
    assert [e["key"] for e in result.skip_examples] == ["b"]  # one skip, the sample's
    assert result.skip_examples[0]["detail"].startswith("not copied from the source: 'b.txt' (changed: ")
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "got.lmdb")] == ["a", "c"]


def test_a_class_whose_every_object_changed_before_its_download_keeps_its_label(
    s3, tmp_path: Path, monkeypatch
) -> None:
    """The class vanished from the downloaded folder, so every class after it took the label before it."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    root = "packs/class-changed"
    fs.put(str(_two_classes(tmp_path / "src", 7)), root, recursive=True)
    fs.pipe_file(f"{root}/ant/0.jpg", image_bytes(99, (30, 20)))
    _rewrite_after_listing(monkeypatch, fs, f"{root}/ant/0.jpg")
    result = packdata.convert(f"s3://{root}", tmp_path / "got.lmdb", storage_options=options, progress=False)
    assert result.packed == 10 and result.skipped == {"changed": 1}
    ds = packdata.LMDBDataset(tmp_path / "got.lmdb", decode="bytes")
    assert ds.classes == ["ant", "cat", "dog"]
    assert {key: ds[i][1] for i, key in enumerate(ds.keys)} == {
        f"{c}/{i}.jpg": {"cat": 1, "dog": 2}[c] for c in ("cat", "dog") for i in range(5)
    }


def test_a_few_5xx_replies_to_the_destination_manifest_look_ups_and_removal_are_tried_again(
    s3, tmp_path: Path, monkeypatch
) -> None:
    """A 503 on the look-up or removal of the URL's manifest (at the start, and again once packed) stopped the run."""
    options, _ = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    src = _two_classes(tmp_path / "src", 6)
    packdata.convert(src, "s3://packs/flaky-end.lmdb", storage_options=options, progress=False)  # the old pack
    head, delete = ("HEAD", "/packs/flaky-end.lmdb/manifest.json"), ("DELETE", "/packs/flaky-end.lmdb/manifest.json")
    with faulty_s3(options) as (faulty, rules, hits):
        rules[head], rules[delete] = [503, 2], [503, 2]
        result = packdata.convert(
            src, "s3://packs/flaky-end.lmdb", storage_options=faulty, overwrite=True, progress=False
        )
        assert result.packed == 10 and rules[head][1] == rules[delete][1] == 0
        rules[head], before = [403, 1], hits[head]
        with pytest.raises(SourceError, match=r"flaky-end\.lmdb: cannot reach the destination \(PermissionError\)"):
            packdata.convert(src, "s3://packs/flaky-end.lmdb", storage_options=faulty, overwrite=True, progress=False)
        assert hits[head] == before + 1  # access denied: not tried again


def test_a_dropped_tls_connection_is_transient_and_a_refused_certificate_is_not() -> None:
    """A TLS connection cut mid-reply reaches packdata as ssl.SSLEOFError when no library wraps it: it was not
    retried. A certificate that does not verify must fail at once, as before."""
    import ssl

    from packdata.pack.urls import is_transient

    dropped = OSError("read failed")
    dropped.__cause__ = ssl.SSLEOFError(8, "EOF occurred in violation of protocol")
    assert is_transient(dropped) and is_transient(ssl.SSLZeroReturnError(6, "TLS/SSL connection has been closed"))
    assert not is_transient(ssl.SSLCertVerificationError(1, "certificate verify failed"))


def test_a_source_listing_that_meets_a_few_5xx_replies_is_listed_whole(s3, tmp_path: Path) -> None:
    """The listing of a source folder at a URL was not tried again: one 503 (a busy bucket) stopped the run."""
    from packdata.conversion.remote_folder import list_folder

    options, fs = s3
    fs.put(str(_two_classes(tmp_path / "src", 3)), "packs/flaky-listing", recursive=True)
    with faulty_s3(options) as (faulty, rules, hits):
        rules["GET", "/packs"] = [503, 2]  # the ListObjectsV2 requests
        _, _, objects, refused = list_folder("s3://packs/flaky-listing", faulty)
        assert rules["GET", "/packs"][1] == 0 and hits["GET", "/packs"] >= 3
        assert (
            sorted(name for _, name, _, _ in objects)
            == sorted(f"{c}/{i}.jpg" for c in ("cat", "dog") for i in range(5))
            and not refused
        )
        rules["GET", "/packs"] = [403, 1]
        before = hits["GET", "/packs"]
        with pytest.raises(SourceError, match="cannot list the source"):
            list_folder("s3://packs/flaky-listing-denied", faulty)
        assert hits["GET", "/packs"] == before + 1  # access denied: not tried again


def test_a_hard_link_in_a_tar_at_a_url_is_read_from_the_member_it_names(s3, tmp_path: Path) -> None:
    """b.txt, a hard link to a.txt in the tar, was skipped and sample b packed without its caption; a tar at a
    URL now reads it with one ranged request for a.txt's bytes."""
    options, fs = s3
    tar_with_a_hard_link(tmp_path / "src", tmp_path / "data.tar")
    fs.put_file(str(tmp_path / "data.tar"), "packs/linked/data.tar")
    result = packdata.convert(
        "s3://packs/linked/data.tar", tmp_path / "out.lmdb", storage_options=options, progress=False
    )
    assert (result.packed, result.skipped) == (2, {})
    assert [s["txt"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")] == ["one caption", "one caption"]


def test_a_field_some_samples_of_a_pack_at_a_url_lack_is_refused_naming_the_url(tmp_path: Path) -> None:
    """TFRecordDataset(url, fields=(..., "txt")) over a pack where some samples have no txt named the local cache
    folder holding its manifest and index, not the pack the user gave; missing= reads it as locally."""
    import fsspec

    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"s{i}.jpg").write_bytes(image_bytes(i))
        if i % 2:
            (src / f"s{i}.txt").write_text(f"caption {i}", encoding="utf-8")
    pack = tmp_path / "pack"
    packdata.convert(src, pack, format="tfrecord", progress=False)
    memory = fsspec.filesystem("memory")
    memory.put(str(pack), "/fields-bucket/train", recursive=True)
    url = "memory://fields-bucket/train"
    try:
        with pytest.raises(ConfigError, match=re.escape(f"{url}: fields asks for 'txt', which 2 of the pack's 4")):
            packdata.TFRecordDataset(url, fields=("__key__", "txt"), cache_dir=tmp_path / "cache")
        ds = packdata.TFRecordDataset(
            url, fields=("__key__", "txt"), missing={"txt": None}, shuffle=False, cache_dir=tmp_path / "cache"
        )
        assert list(ds) == [("s0", None), ("s1", "caption 1"), ("s2", None), ("s3", "caption 3")]
    finally:
        memory.rm("/fields-bucket", recursive=True)


@pytest.mark.root
def test_a_stage_from_a_url_into_a_tmpfs_memory_cannot_hold_says_what_does_not_fit(
    remote_pack, tmpfs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache is a tmpfs already mounted: the refusal said 'a N tmpfs does not fit in memory ... ask for at
    most', as if a tmpfs were asked for, where what does not fit is the pack about to be written into it."""
    import fsspec

    from packdata.host import facts as system
    from packdata.staging import remote as remote_module

    _, local = remote_pack
    memory = fsspec.filesystem("memory")
    memory.put(str(local), "/tight/train", recursive=True)
    fake = tmp_path / "fake"
    (fake / "proc").mkdir(parents=True)
    # 4 GiB + 4 KiB available, and the default reserve of 4 GiB: 4 KiB may go to tmpfs, the pack needs more
    (fake / "proc" / "meminfo").write_text(
        "MemTotal: 16777216 kB\nMemAvailable: 4194308 kB\nSwapTotal: 1048576 kB\nSwapFree: 1048576 kB\n"
    )
    monkeypatch.setattr(remote_module, "gather_facts", lambda **kw: system.gather_facts(fake, **kw))
    try:
        with pytest.raises(CapacityError, match=r"[0-9.]+ [KM]iB more in this tmpfs does not fit in memory: "):
            packdata.stage("memory://tight/train", to=tmpfs("16M", "cache"), progress=False)
    finally:
        memory.rm("/tight", recursive=True)
