"""Conversion from a URL: folders, tars and lists in S3, objects named or rewritten under the listing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import SECRET, faulty_s3, image_bytes, tar_with_a_hard_link
from remote_helpers import _cli, _samples, _two_classes

import packdata
from packdata.conversion.download import download_source
from packdata.errors import ConfigError, SourceError

pytest.importorskip("moto.server", reason="the tests' S3 server needs moto[server] (the dev extra)")
pytest.importorskip("s3fs", reason="s3:// needs s3fs (pip install 'packdata[s3]')")


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


def test_a_tar_at_a_url_replaced_before_its_hard_link_is_read_stops_rather_than_read_the_new_tar(
    s3, tmp_path: Path, monkeypatch
) -> None:
    """b.txt, a hard link to a.txt, is read with a ranged request of a.txt's bytes when the walk reaches it. That
    request carried no version: a tar replaced (a.txt's caption changed, same length) after the walk had read its
    members gave sample b the new tar's caption, checked only for length. It is read at the version the tar was
    opened at now (S3's If-Match): the replaced tar fails the read and the conversion stops, resumable."""
    import tarfile

    options, fs = s3
    tar_with_a_hard_link(tmp_path / "src", tmp_path / "data.tar")
    fs.put_file(str(tmp_path / "data.tar"), "packs/relinked/data.tar")
    with tarfile.open(tmp_path / "data.tar") as tar:
        caption = tar.getmember("a.txt").offset_data
    new = bytearray((tmp_path / "data.tar").read_bytes())
    new[caption : caption + 11] = b"ONE CAPTION"
    real, replaced, ranges = fs._call_s3, [], []

    async def replaced_at_the_link_read(method, *args, **kwargs):
        if method == "get_object" and kwargs.get("Key") == "relinked/data.tar":
            ranges.append(kwargs.get("Range", ""))
            if kwargs.get("Range", "").startswith(f"bytes={caption}-") and not replaced:
                replaced.append(True)
                await real("put_object", Bucket="packs", Key="relinked/data.tar", Body=bytes(new))
        return await real(method, *args, **kwargs)

    monkeypatch.setattr(fs, "_call_s3", replaced_at_the_link_read)
    with pytest.raises(SourceError, match=r"^s3://packs/relinked/data\.tar: cannot read the tar; rerun with resume"):
        packdata.convert("s3://packs/relinked/data.tar", tmp_path / "out.lmdb", storage_options=options, progress=False)
    assert replaced, ranges
    assert not (tmp_path / "out.lmdb").exists()
