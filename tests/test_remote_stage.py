"""Packs in object storage staged from a real local S3 server (moto in server mode), once per node."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import SECRET, faulty_s3, flip_label, image_bytes, tree_digest
from faults.hostile import rewrite_manifest
from remote_helpers import _cli, _samples, _two_classes

import packdata
from packdata.cli import main
from packdata.conversion.upload import work_folder
from packdata.errors import CapacityError, ConfigError, PackdataError, PackFormatError, SourceError
from packdata.pack.manifest import read_manifest
from packdata.pack.urls import display_url

pytest.importorskip("moto.server", reason="the tests' S3 server needs moto[server] (the dev extra)")
pytest.importorskip("s3fs", reason="s3:// needs s3fs (pip install 'packdata[s3]')")


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
    from conftest import interrupted_convert as _interrupted_convert

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


def test_a_stage_that_fails_on_one_shard_keeps_the_shards_it_checked_and_a_rerun_fetches_only_the_rest(
    s3, remote_pack, tmp_path: Path
) -> None:
    """Every shard was checked and given its name only once all had downloaded: a request that failed for one shard
    left the others as unchecked .part files, and the rerun downloaded the whole pack again. Each shard is now
    checked and named as soon as its last byte has arrived: the rerun fetches only the shard whose request failed."""
    options, fs = s3
    _, local = remote_pack
    fs.put(str(local), "packs/resumed.lmdb", recursive=True)
    shards = sorted(p.relative_to(local).as_posix() for p in local.glob("shard-*/data.mdb"))
    assert len(shards) == 3
    cache = tmp_path / "cache"
    with faulty_s3(options) as (faulty, rules, hits):
        rules["GET", f"/packs/resumed.lmdb/{shards[1]}"] = [403, 1]
        with pytest.raises(SourceError, match=rf"^s3://packs/resumed\.lmdb: cannot read {shards[1]}; rerun to resume"):
            packdata.stage("s3://packs/resumed.lmdb", to=cache, storage_options=faulty, progress=False)
        first = {shard: hits["GET", f"/packs/resumed.lmdb/{shard}"] for shard in shards}
        packdata.stage("s3://packs/resumed.lmdb", to=cache, storage_options=faulty, progress=False)
        again = {shard: hits["GET", f"/packs/resumed.lmdb/{shard}"] - first[shard] for shard in shards}
    assert first == dict.fromkeys(shards, 1)
    assert again == {shard: int(shard == shards[1]) for shard in shards}
    assert _samples(cache / "resumed.lmdb") == _samples(local)


def test_a_shard_fetched_in_many_ranges_is_hashed_from_them_in_order_whatever_order_they_arrive_in(
    s3, remote_pack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each shard's SHA-256 is taken from its ranges as they arrive: ranges of 1 KiB from 8 threads land out of
    order, past the 8 KiB the download holds in memory (the rest are read back from the file). The staged copy is
    the pack, byte for byte, and a shard with one byte changed in its middle is still refused."""
    from packdata.staging import fetch

    options, fs = s3
    _, local = remote_pack
    monkeypatch.setattr(fetch, "_RANGE", 1024)
    fs.put(str(local), "packs/ranges.lmdb", recursive=True)
    staged = packdata.stage(
        "s3://packs/ranges.lmdb", to=tmp_path / "cache", storage_options=options, progress=False, workers=8
    ).staged
    for shard in local.glob("shard-*/data.mdb"):
        assert (staged / shard.relative_to(local)).read_bytes() == shard.read_bytes()
    assert _samples(staged) == _samples(local)
    fs.put(str(local), "packs/ranges-bad.lmdb", recursive=True)
    data = bytearray(fs.cat_file("packs/ranges-bad.lmdb/shard-00001.lmdb/data.mdb"))
    assert len(data) > 8 * 1024
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file("packs/ranges-bad.lmdb/shard-00001.lmdb/data.mdb", bytes(data))
    with pytest.raises(
        PackFormatError, match=r"s3://packs/ranges-bad\.lmdb: shard-00001\.lmdb/data\.mdb does not match"
    ):
        packdata.stage(
            "s3://packs/ranges-bad.lmdb", to=tmp_path / "cache", storage_options=options, progress=False, workers=8
        )
    assert not (tmp_path / "cache" / "ranges-bad.lmdb").exists()


def test_a_shard_rewritten_at_the_url_between_two_of_its_ranges_is_refused_at_the_next_range_not_mixed(
    s3, remote_pack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another version of a shard (one byte changed near its end) uploaded once its first range has been read: the
    copy would hold the old version's first KiB and the new one's rest. Its ranges were read with no version (only a
    file without a size in the manifest was pinned), so every range of the new object was downloaded and the mix
    caught only by the manifest's SHA-256 at the end. Every range is read at the version the stage looked up now
    (S3's If-Match): the next range answers 412, no byte of the new object is taken, the shard is named at once and
    nothing is staged."""
    from packdata.staging import fetch

    options, fs = s3
    _, local = remote_pack
    root = "packs/rewritten-mid-stage.lmdb"
    fs.put(str(local), root, recursive=True)
    shard = f"{root}/shard-00001.lmdb/data.mdb"
    new = bytearray(fs.cat_file(shard))
    new[-100] ^= 0xFF
    read, rewritten, taken_after = fetch.read_at_version, [], []

    def rewritten_after_the_first_range(store_fs, path, *args, **kwargs):
        data = read(store_fs, path, *args, **kwargs)
        if path.endswith(shard):
            if rewritten:
                taken_after.append(len(data))
            else:
                fs.pipe_file(shard, bytes(new))
                rewritten.append(True)
        return data

    monkeypatch.setattr(fetch, "_RANGE", 1024)
    monkeypatch.setattr(fetch, "read_at_version", rewritten_after_the_first_range)
    cache = tmp_path / "cache"
    with pytest.raises(
        PackFormatError,
        match=rf"^s3://{root}/shard-00001\.lmdb/data\.mdb: was rewritten \(the pack at the URL changed while "
        r"staging\): nothing was staged from it",
    ):
        packdata.stage(f"s3://{root}", to=cache, storage_options=options, progress=False, workers=1)
    assert rewritten
    assert taken_after == [], "ranges of the rewritten object were downloaded"
    assert not (cache / "rewritten-mid-stage.lmdb").exists()
    assert not (cache / ".rewritten-mid-stage.lmdb.partial" / "shard-00001.lmdb" / "data.mdb").exists()


def test_a_pack_uploaded_again_by_another_client_after_this_process_listed_it_stages_the_new_pack(
    s3, tmp_path: Path
) -> None:
    """A stage looks each file's version up before it downloads; s3fs answered that look-up from a listing this
    process had cached, so a pack uploaded again by another client since was pinned at the old objects' ETags and
    refused as 'was rewritten' at every stage in this process. The look-up asks the store now."""
    import s3fs

    options, fs = s3
    root = "packs/relisted.lmdb"
    packs = []
    for seed in (0, 50):
        (tmp_path / f"src{seed}" / "a").mkdir(parents=True)
        for i in range(3):
            (tmp_path / f"src{seed}" / "a" / f"{i}.jpg").write_bytes(image_bytes(seed + i))
        packs.append(packdata.convert(tmp_path / f"src{seed}", tmp_path / f"p{seed}.lmdb", progress=False).pack)
    fs.put(str(packs[0]), root, recursive=True)
    for folder in {root, *(f.rsplit("/", 1)[0] for f in fs.find(root))}:
        fs.ls(folder, detail=True)  # this process's listings of the first pack
    other = s3fs.S3FileSystem(skip_instance_cache=True, **options)  # another client: this one's listings stay
    other.rm(root, recursive=True)
    other.put(str(packs[1]), root, recursive=True)
    staged = packdata.stage(f"s3://{root}", to=tmp_path / "cache", storage_options=options, progress=False).staged
    for file in (f for f in packs[1].rglob("*") if f.is_file()):
        assert (staged / file.relative_to(packs[1])).read_bytes() == file.read_bytes(), file


def test_a_stage_looks_up_the_files_its_manifest_gives_no_size_in_parallel(
    s3, remote_tfrecord, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The files a manifest gives no size (each TFRecord shard's .tfindex, the sample index's files) were looked up
    one request after another before the download: a pack of 1,000 shards waited for 1,000 HEADs in turn. They are
    looked up in parallel now: a second look-up begins while the first is still in flight."""
    import threading

    from packdata.staging import remote

    options, _ = s3
    url, local = remote_tfrecord
    look_up, lock, begun, second = remote.remote_object, threading.Lock(), [], threading.Event()

    def meets_another(store_fs, path, where):
        with lock:
            begun.append(path)
            if len(begun) == 2:
                second.set()
        if len(begun) == 1:
            begun.append(second.wait(30))  # the first look-up waits, up to 30 s, for a second to begin
        return look_up(store_fs, path, where)

    monkeypatch.setattr(remote, "remote_object", meets_another)
    staged = packdata.stage(url, to=tmp_path / "cache", storage_options=options, progress=False).staged
    assert True in begun, "the second look-up began only once the first had returned"
    for file in (f for f in local.rglob("*") if f.is_file()):
        assert (staged / file.relative_to(local)).read_bytes() == file.read_bytes(), file


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


_STALLED_URL_STAGE = """
import json, sys, threading
import packdata
from packdata.staging import fetch as fetching
fetch, gate, released = fetching._fetch_range, threading.Lock(), []
def stalled(*args):  # the first range waits for a line on stdin; the stage holds its locks meanwhile
    with gate:
        if not released:
            print("downloading", flush=True)
            sys.stdin.readline()
            released.append(True)
    return fetch(*args)
fetching._fetch_range = stalled
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
