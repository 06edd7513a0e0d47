"""Conversion into a URL: uploads, overwrites, resumes, work folders and a store's transient failures."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import faulty_s3, image_bytes
from remote_helpers import _cli, _resume_a_refused_removal, _samples, _two_classes, changed_since_message

import packdata
from packdata.errors import ConfigError, PackFormatError, SourceError

pytest.importorskip("moto.server", reason="the tests' S3 server needs moto[server] (the dev extra)")
s3fs = pytest.importorskip("s3fs", reason="s3:// needs s3fs (pip install 'packdata[s3]')")


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


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_resume_after_the_new_manifest_is_up_only_removes_the_replaced_objects_never_unpublishing(
    s3, tmp_path: Path, monkeypatch, overwrite: bool
) -> None:
    """A publish that failed after the new manifest was up (an old object's DELETE refused) said to resume; the
    resume refused the pack at the URL without overwrite=True, and with it deleted the new pack's manifest and put it
    again: the new pack ceased to exist until then. Now the resume keeps it, uploads nothing, removes the rest."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    src = _two_classes(tmp_path / "src", 7)
    url, root = f"s3://packs/finish-removal-{overwrite}.lmdb", f"packs/finish-removal-{overwrite}.lmdb"
    packdata.convert(src, url, shard_samples=2, storage_options=options, progress=False)
    old = f"/{root}/shard-00004.lmdb/data.mdb"
    run = {"shard_samples": 5, "progress": False}
    result, sent, published = _resume_a_refused_removal(src, url, s3, old, resume=True, overwrite=overwrite, **run)
    assert result.pack == url and result.packed == 10
    local = packdata.convert(src, tmp_path / url.rsplit("/", 1)[1], **run).pack
    rest = [("DELETE", old), ("DELETE", old.replace("data.mdb", "records.i64"))]  # the rest of the old shard
    assert sent == rest  # nothing uploaded again; the new manifest never removed nor put again
    fs.invalidate_cache()
    assert fs.cat_file(f"{root}/manifest.json") == published
    assert sorted(p.removeprefix(f"{root}/") for p in fs.find(root)) == sorted(
        p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file() and p.name != "lock.mdb"
    )
    assert not any(p.is_file() for p in (tmp_path / "work").rglob("*"))  # the work folder is gone
    with pytest.raises(ConfigError, match=rf"^{url}: a pack already exists there\. Pass overwrite=True"):
        packdata.convert(src, url, storage_options=options, resume=True, **run)  # no longer this work folder's


def test_a_manifest_upload_whose_reply_was_lost_resumes_by_keeping_the_pack_it_put(
    s3, tmp_path: Path, monkeypatch
) -> None:
    """The manifest's PUT reached the store but its reply was lost: the error said to resume, and the resume was
    refused ('a pack already exists there'). The manifest there has the work folder's bytes: it is kept as it is."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    src = _two_classes(tmp_path / "src", 7)
    url, manifest = "s3://packs/lost-reply.lmdb", "packs/lost-reply.lmdb/manifest.json"
    real_put = fs.put_file  # fsspec caches filesystems: convert gets this very instance
    sent: list[str] = []

    def lost_reply(lpath, rpath, *args, **kwargs):  # the first PUT of the manifest is written, its reply lost
        sent.append(rpath)
        real_put(lpath, rpath, *args, **kwargs)
        if rpath.endswith("manifest.json") and sent.count(rpath) == 1:
            raise OSError("connection reset after the write")

    monkeypatch.setattr(fs, "put_file", lost_reply)
    with pytest.raises(PackFormatError) as raised:
        packdata.convert(src, url, shard_samples=5, storage_options=options, progress=False)
    assert str(raised.value) == (
        f"{url}: uploading manifest.json failed (OSError). Run again with resume=True: uploaded files are kept"
    )
    published, before = fs.cat_file(manifest), len(sent)
    result = packdata.convert(src, url, shard_samples=5, storage_options=options, progress=False, resume=True)
    assert result.pack == url and result.packed == 10
    assert sent[before:] == []  # nothing uploaded again
    fs.invalidate_cache()
    assert fs.cat_file(manifest) == published
    assert not any(p.is_file() for p in (tmp_path / "work").rglob("*"))  # the work folder is gone


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
    with pytest.raises(ConfigError, match="Pass resume=True to continue it, or overwrite=True to start again"):
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
    with socket.socket() as s:  # bound, never listening: connections are refused, and no server can take the port
        s.bind(("127.0.0.1", 0))
        down = s3fs.S3FileSystem(
            client_kwargs={"endpoint_url": f"http://127.0.0.1:{s.getsockname()[1]}"},
            config_kwargs={"retries": {"total_max_attempts": 1}},
            skip_instance_cache=True,
        )
        with pytest.raises(Exception) as refused:
            down.cat_file("packs/x")
    assert is_transient(refused.value), repr(refused.value)
    with pytest.raises(FileNotFoundError) as missing:
        fs.pipe_file("no-such-bucket/x", b"")
    assert not is_transient(missing.value)


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
    pattern = (  # it said 'the source's files need 2.9 MiB in the work folder, its disk has 2.0 MiB free'
        rf"{re.escape(str(small_work_disk))}/\S+: no space left on {re.escape(str(small_work_disk))} \(tmpfs of "
        r"2\.0 MiB, [0-9.]+ [KM]?i?B free\) for the source's files \(2\.9 MiB needed in the work folder\)\. Set "
        r"PACKDATA_TMP to a folder on a disk with room \(the work folder lives there\), or free space"
    )
    assert re.fullmatch(pattern, str(refused.value)), str(refused.value)
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
    pattern = (  # it said 'the work folder's disk filled while packing for URL', naming no mount or size
        rf"{re.escape(str(small_work_disk))}/\S+: no space left on {re.escape(str(small_work_disk))} \(tmpfs of "
        r"2\.0 MiB, [0-9.]+ [KM]?i?B free\) while packing for s3://packs/too-big\.lmdb in this work folder\. Free "
        r"space there and run again with resume=True, or set PACKDATA_TMP to a disk with room and run again"
    )  # the library's words: it said 'rerun with --resume', a flag of the CLI (which maps resume=True to it)
    assert re.fullmatch(pattern, str(full.value)), str(full.value)
    assert "no space left on" in str(full.value.__cause__)  # it ran out writing a shard, past the start check
    assert not fs.exists("packs/too-big.lmdb/manifest.json")  # no manifest: no pack


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


def test_a_failed_upload_says_resume_in_the_library_s_words_and_the_cli_s_flag(s3, tmp_path: Path, monkeypatch) -> None:
    """A failed upload's hint named the CLI's flag ('Rerun with --resume') to a Python caller, who passes
    resume=True; the CLI, which maps it back, still says --resume."""
    options, _ = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    src = _two_classes(tmp_path / "src", 3)
    with faulty_s3(options) as (faulty, rules, _):
        rules[("PUT", "/packs/denied-hint.lmdb/manifest.json")] = [403, 2]
        with pytest.raises(PackFormatError) as caught:
            packdata.convert(src, "s3://packs/denied-hint.lmdb", storage_options=faulty, progress=False)
        assert str(caught.value) == (
            "s3://packs/denied-hint.lmdb: uploading manifest.json failed (PermissionError). Run again with "
            "resume=True: uploaded files are kept"
        )
        said = _cli("convert", str(src), "s3://packs/denied-hint.lmdb", "-q", "--resume", options=faulty)
    assert said.exit_code == 1
    assert said.output.splitlines()[-1] == (
        "Error: s3://packs/denied-hint.lmdb: uploading manifest.json failed (PermissionError). Run again with "
        "--resume: uploaded files are kept"
    )


def _published_then_refused_removal(s3, tmp_path: Path, monkeypatch, url: str, faulty: dict, rules: dict) -> Path:
    """Convert a source into ``url`` (no relay), then over it (overwrite=True) through the relay of ``faulty``, its
    first DELETE of an old object refused after the new manifest is up: the new pack is published from the work
    folder, a resume (shard_samples=5) to finish it. Returns the source."""
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    src = _two_classes(tmp_path / "src", 7)
    packdata.convert(src, url, shard_samples=2, storage_options=s3[0], progress=False)
    rules["DELETE", f"/{url.removeprefix('s3://')}/shard-00004.lmdb/data.mdb"] = [403, 1]
    with pytest.raises(SourceError, match=r": the new pack is published, but the objects of the pack it replaced"):
        packdata.convert(src, url, storage_options=faulty, overwrite=True, shard_samples=5, progress=False)
    return src


def test_a_resume_into_a_url_reads_its_manifest_once(s3, tmp_path: Path, monkeypatch) -> None:
    """A resume whose work folder's pack is published at the URL read the URL's manifest 3 times: in the check,
    as the old pack ended and as the upload began, each time deciding anew what the pack there was."""
    options, fs = s3
    url, manifest = "s3://packs/read-once.lmdb", "/packs/read-once.lmdb/manifest.json"
    with faulty_s3(options) as (faulty, rules, hits):
        src = _published_then_refused_removal(s3, tmp_path, monkeypatch, url, faulty, rules)
        published, before = fs.cat_file(manifest), hits.copy()
        result = packdata.convert(src, url, storage_options=faulty, resume=True, shard_samples=5, progress=False)
        during = hits - before
    assert result.pack == url and result.packed == 10
    assert during["GET", manifest] == 1, sorted(during.items())
    assert during["PUT", manifest] == 0 and during["DELETE", manifest] == 0
    fs.invalidate_cache()
    assert fs.cat_file(manifest) == published


def _stranger_publishes(monkeypatch, faulty: dict, fs, manifest: str, when: str) -> bytes:
    """Have a stranger put a manifest of its own at ``manifest`` (through ``fs``, another client) right after the
    conversion's first call of ``when`` (``cat_file`` of that manifest, or ``put_file`` of anything) returns."""
    s3fs.S3FileSystem(**faulty).exists(manifest)  # botocore adds its retry mode into the options at a first request
    client = s3fs.S3FileSystem(**faulty)  # fsspec caches filesystems: the conversion gets this very instance
    real = getattr(client, when)
    stranger = b'{"a stranger": "published this"}'
    done: list[str] = []

    def then_a_stranger(path, *args, **kwargs):
        out = real(path, *args, **kwargs)
        if not done and (when == "put_file" or str(path).endswith(manifest)):
            done.append(path)
            fs.pipe_file(manifest, stranger)
        return out

    monkeypatch.setattr(client, when, then_a_stranger)
    return stranger


def test_a_manifest_replaced_after_a_resumes_check_is_refused_not_overwritten(s3, tmp_path: Path, monkeypatch) -> None:
    """A stranger's manifest put at the URL once the resume had found its own pack there: the next read found the
    pack was not its own any more, removed the stranger's manifest and put its own, without overwrite=True."""
    options, fs = s3
    url, manifest = "s3://packs/replaced-after-check.lmdb", "packs/replaced-after-check.lmdb/manifest.json"
    with faulty_s3(options) as (faulty, rules, _):
        src = _published_then_refused_removal(s3, tmp_path, monkeypatch, url, faulty, rules)
        stranger = _stranger_publishes(monkeypatch, faulty, fs, manifest, "cat_file")
        with pytest.raises(ConfigError) as raised:
            packdata.convert(src, url, storage_options=faulty, resume=True, shard_samples=5, progress=False)
    assert str(raised.value) == changed_since_message(url)
    fs.invalidate_cache()
    assert fs.cat_file(manifest) == stranger


def test_a_pack_published_at_the_url_while_a_conversion_packs_is_refused_not_overwritten(
    s3, tmp_path: Path, monkeypatch
) -> None:
    """The check found no pack at the URL; a stranger published one while the conversion packed: its manifest was
    removed (end_remote_pack looked again) and the conversion's put over it, without overwrite=True."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    src = _two_classes(tmp_path / "src", 7)
    url, manifest = "s3://packs/published-meanwhile.lmdb", "packs/published-meanwhile.lmdb/manifest.json"
    with faulty_s3(options) as (faulty, _, _):
        stranger = _stranger_publishes(monkeypatch, faulty, fs, manifest, "put_file")
        with pytest.raises(ConfigError, match=rf"^{url}: the manifest there changed since this conversion checked"):
            packdata.convert(src, url, storage_options=faulty, shard_samples=5, progress=False)
    fs.invalidate_cache()
    assert fs.cat_file(manifest) == stranger
