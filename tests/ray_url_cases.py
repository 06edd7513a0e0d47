"""The Ray conversion engine into and from object storage: a moto S3 server on loopback, no storage shared with
the workers.

Collected only by ``tests/test_ray.py``, with ``tests/ray_cases.py`` (whose fixtures and helpers it shares), in a
child pytest (see there why).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray_cases as cases
from conftest import faulty_s3
from ray_cases import (
    N_CLASSES,
    PER_CLASS,
    SECRET,
    _assert_same_pack,
    _download,
    _files,
    _lmdb_content,
    _tiny_jpeg,
)
from remote_helpers import changed_since_message

import packdata
from packdata.conversion.destination import partial_path
from packdata.errors import ConfigError, EngineError, PackFormatError, SourceError
from packdata.pack.manifest import read_manifest

pytestmark = pytest.mark.timeout(240)

ray_local = cases.ray_local
clean_folder = cases.clean_folder
poisoned_folder = cases.poisoned_folder
grouped_folder = cases.grouped_folder
s3 = cases.s3


@pytest.mark.ray
@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_ray_into_s3_equals_local(ray_local, s3, clean_folder: Path, tmp_path: Path, monkeypatch, fmt: str) -> None:
    """Tasks upload their shards themselves; the pack at the URL equals the local engine's, byte for byte."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    (clean_folder / "class0" / "notes.txt").write_text("not an image")  # a walk-time skip in the report
    url = f"s3://packs/ray-{fmt}"
    result = packdata.convert(
        clean_folder, url, format=fmt, shard_samples=8, storage_options=options, progress=False, engine="ray"
    )
    local = tmp_path / "same-name" / f"ray-{fmt}"  # shard names follow the pack's name
    expected = packdata.convert(clean_folder, local, format=fmt, shard_samples=8, progress=False)
    got = _download(fs, url, tmp_path / "got" / f"ray-{fmt}")
    assert result.pack == url and result.packed == expected.packed == N_CLASSES * PER_CLASS + 1
    assert result.skipped == expected.skipped == {"not image": 1} and result.shards == 5
    assert _files(got) == _files(local)  # nothing under a temporary name is left at the URL
    for name in _files(local):
        assert (got / name).read_bytes() == (local / name).read_bytes(), name
    assert packdata.verify_pack(got, progress=False).records == result.packed
    assert not any(p.is_file() for p in (tmp_path / "work").rglob("*"))  # the driver's work folder is gone
    assert not any(SECRET.encode() in (got / name).read_bytes() for name in _files(got))


@pytest.mark.ray
def test_ray_into_a_missing_bucket_is_named_before_any_task_runs(
    ray_local, s3, clean_folder: Path, tmp_path: Path, monkeypatch
) -> None:
    """A missing bucket failed each task's upload (after its shard was packed), then the run, as a task failure."""
    from packdata.conversion.upload import work_folder

    options, _ = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    url = "s3://no-such-bucket/ray.lmdb"
    with pytest.raises(SourceError, match=r"^s3://no-such-bucket/ray\.lmdb: cannot write there: its bucket does not"):
        packdata.convert(clean_folder, url, shard_samples=8, storage_options=options, progress=False, engine="ray")
    assert not partial_path(work_folder(url)).exists()  # no task was planned


@pytest.mark.ray
def test_ray_into_s3_removes_only_the_shards_its_earlier_unfinished_run_uploaded(
    ray_local, s3, clean_folder: Path, tmp_path: Path, monkeypatch
) -> None:
    """A first run's task uploads that the finished pack (other shard limits) does not have stayed at the URL."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    url, root = "s3://packs/ray-strays.lmdb", "packs/ray-strays.lmdb"
    fs.pipe_file(f"{root}/shard-00009.lmdb/data.mdb", b"a stranger's")
    real_put = fs.put_file  # fsspec caches filesystems: the driver gets this very instance

    def no_manifest(lpath, rpath, *args, **kwargs):  # the driver is stopped at the end: no manifest
        if rpath.endswith("manifest.json"):
            raise OSError("connection reset")
        return real_put(lpath, rpath, *args, **kwargs)

    monkeypatch.setattr(fs, "put_file", no_manifest)
    with pytest.raises(PackFormatError, match=r"uploading manifest\.json failed"):
        packdata.convert(clean_folder, url, shard_samples=8, storage_options=options, progress=False, engine="ray")
    monkeypatch.setattr(fs, "put_file", real_put)
    fs.invalidate_cache()
    assert fs.exists(f"{root}/shard-00004.lmdb/data.mdb")  # the first run's five shards are up
    result = packdata.convert(
        clean_folder, url, shard_samples=20, overwrite=True, storage_options=options, progress=False, engine="ray"
    )
    assert result.shards == 2
    local = tmp_path / "local" / "ray-strays.lmdb"
    packdata.convert(clean_folder, local, shard_samples=20, progress=False)
    fs.invalidate_cache()
    left = sorted(p.removeprefix(f"{root}/") for p in fs.find(root))
    assert left == sorted([*_files(local), "shard-00009.lmdb/data.mdb"])  # the stranger's object stays


@pytest.mark.ray
def test_ray_into_s3_refuses_a_pack_published_while_its_tasks_ran_and_keeps_it(
    ray_local, s3, clean_folder: Path, tmp_path: Path, monkeypatch
) -> None:
    """The Ray driver's upload_pack decided anew what the URL held (check_remote_destination's answer was not
    passed on): a stranger's manifest published there while the tasks ran was taken for an old pack and removed,
    and the conversion's put in its place, without overwrite=True. Now it acts on what the check found."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    url, manifest = "s3://packs/ray-published-meanwhile.lmdb", "packs/ray-published-meanwhile.lmdb/manifest.json"
    stranger = b'{"a stranger": "published this"}'
    import packdata.conversion.ray as ray_engine

    real_upload = ray_engine.upload_pack
    published: list[str] = []

    def a_stranger_publishes_first(*args, **kwargs):  # the tasks are done; the driver's upload is next
        fs.pipe_file(manifest, stranger)
        published.append(manifest)
        return real_upload(*args, **kwargs)

    monkeypatch.setattr(ray_engine, "upload_pack", a_stranger_publishes_first)
    with pytest.raises(ConfigError) as raised:
        packdata.convert(clean_folder, url, shard_samples=8, storage_options=options, progress=False, engine="ray")
    assert published == [manifest]
    assert str(raised.value) == changed_since_message(url)
    fs.invalidate_cache()
    assert fs.cat_file(manifest) == stranger


_DRIVER = """
import json, sys
import packdata
packdata.convert(sys.argv[1], sys.argv[2], shard_samples=1, storage_options=json.loads(sys.argv[3]),
                 progress=False, engine="ray", address=sys.argv[4])
"""


@pytest.mark.ray
def test_ray_into_s3_killed_driver_leaves_no_manifest_and_resume_reruns_only_unfinished(
    ray_local, s3, clean_folder: Path, tmp_path: Path, monkeypatch
) -> None:
    """A driver killed mid-run leaves no manifest at the URL; resume reruns only tasks without complete objects."""
    from packdata.conversion.ray_tasks import TASKS_DIR
    from packdata.conversion.upload import work_folder

    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    url = "s3://packs/killed.lmdb"
    tasks = partial_path(work_folder(url)) / TASKS_DIR
    address = ray_local.get_runtime_context().gcs_address
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, str(clean_folder), url, json.dumps(options), address],
        cwd=Path(__file__).parents[1],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    while len(list(tasks.glob("*/result.json"))) < 3 and driver.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    driver.send_signal(signal.SIGKILL)
    output = driver.communicate(timeout=60)[0]
    assert driver.returncode == -signal.SIGKILL, output.decode(errors="replace")[-2000:]
    fs.invalidate_cache()
    assert not fs.exists("packs/killed.lmdb/manifest.json")  # no manifest: no pack
    done = sorted(tasks.glob("*/result.json"))
    assert len(done) >= 3
    mtimes = {p["name"]: p["LastModified"] for p in fs.find("packs/killed.lmdb", detail=True).values()}
    first, lost = done[0].parent.name, done[1].parent.name
    fs.rm_file(f"packs/killed.lmdb/shard-{lost}.lmdb/data.mdb")  # a saved task whose upload is gone runs again

    result = packdata.convert(
        clean_folder, url, shard_samples=1, storage_options=options, progress=False, engine="ray", resume=True
    )
    assert result.resumed and result.packed == N_CLASSES * PER_CLASS + 1
    after = {p["name"]: p["LastModified"] for p in fs.find("packs/killed.lmdb", detail=True).values()}
    kept = f"packs/killed.lmdb/shard-{first}.lmdb/data.mdb"
    assert after[kept] == mtimes[kept]  # a finished task was not run again
    assert f"packs/killed.lmdb/shard-{lost}.lmdb/data.mdb" in after
    packdata.convert(clean_folder, tmp_path / "local.lmdb", shard_samples=1, progress=False)
    got = _download(fs, url, tmp_path / "got" / "killed.lmdb")
    _assert_same_pack(tmp_path / "local.lmdb", got)
    assert _lmdb_content(tmp_path / "local.lmdb") == _lmdb_content(got)
    assert SECRET.encode() not in output


@pytest.mark.ray
def test_ray_from_an_s3_folder_equals_local(ray_local, s3, poisoned_folder: Path, tmp_path: Path, monkeypatch) -> None:
    """Tasks read the objects in place (nothing is copied on the driver); the pack is the local folder's."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    (poisoned_folder / "class1" / ".hidden.jpg").write_bytes(_tiny_jpeg(3))
    fs.put(str(poisoned_folder), "packs/src-folder", recursive=True)
    limits = {"shard_samples": 7, "max_side": 9}
    result = packdata.convert(
        "s3://packs/src-folder", tmp_path / "ray.lmdb", storage_options=options, progress=False, engine="ray", **limits
    )
    local = packdata.convert(poisoned_folder, tmp_path / "local.lmdb", progress=False, **limits)
    assert not (tmp_path / "work").exists()  # no copy of the source was made on the driver
    _assert_same_pack(tmp_path / "local.lmdb", tmp_path / "ray.lmdb")
    assert _lmdb_content(tmp_path / "local.lmdb") == _lmdb_content(tmp_path / "ray.lmdb")
    assert result.packed == local.packed == N_CLASSES * PER_CLASS + 1 and result.found == local.found
    assert result.skipped == local.skipped and result.skip_examples == local.skip_examples
    assert result.bytes_in == local.bytes_in and result.reencoded == local.reencoded > 0
    assert read_manifest(tmp_path / "ray.lmdb").classes == ["class0", "class1", "class2"]


@pytest.mark.ray
def test_ray_names_an_object_rewritten_or_removed_since_the_listing(
    ray_local, s3, clean_folder: Path, tmp_path: Path, monkeypatch
) -> None:
    """An object rewritten between the driver's listing and its task's read was packed as it then was, silently.

    The size caught a rewrite of another length; one of the same length is caught by its ETag (If-Match).
    """
    from packdata.conversion import scan as conversion_scan

    options, fs = s3
    fs.put(str(clean_folder), "packs/changing", recursive=True)
    same_size = bytearray((clean_folder / "class1" / "img002.jpg").read_bytes())
    same_size[len(same_size) // 2] ^= 0xFF  # other bytes in the image data, same length
    same_size = bytes(same_size)
    real_scan = conversion_scan.scan_remote_folder

    def scan_then_change(*args, **kwargs):  # listed by the driver, then changed before any task reads it
        scanned = real_scan(*args, **kwargs)
        fs.pipe_file("packs/changing/class0/img003.jpg", _tiny_jpeg(50) + _tiny_jpeg(51))
        fs.pipe_file("packs/changing/class1/img002.jpg", same_size)  # only its ETag tells
        fs.rm_file("packs/changing/class2/img007.jpg")
        return scanned

    monkeypatch.setattr(conversion_scan, "scan_remote_folder", scan_then_change)
    dst = tmp_path / "changing.lmdb"
    result = packdata.convert(
        "s3://packs/changing", dst, shard_samples=10, storage_options=options, progress=False, engine="ray"
    )
    assert result.skipped == {"changed": 2, "vanished": 1} and result.packed == N_CLASSES * PER_CLASS - 2
    assert [(e["key"], e["reason"]) for e in result.skip_examples] == [
        ("class0/img003.jpg", "changed"),
        ("class1/img002.jpg", "changed"),
        ("class2/img007.jpg", "vanished"),
    ]
    assert not {"class0/img003.jpg", "class1/img002.jpg"} & {row[0] for row in _lmdb_content(dst)}


@pytest.mark.ray
def test_ray_resume_reruns_a_finished_task_whose_object_was_rewritten_at_the_url_since(
    ray_local, s3, clean_folder: Path, tmp_path: Path
) -> None:
    """A source folder at a URL is read in place by the tasks. An object a finished task packed, rewritten at the
    URL (same size: only its ETag tells) before the resume, was not looked at: the task's result was kept, and the
    pack held the old image. A task's fingerprint now holds each object's size and version as listed, so the
    resume reruns that task, and the pack is the one of the source as it is now."""
    from packdata.conversion.load import _Options
    from packdata.conversion.ray_gather import _prepare_partial
    from packdata.conversion.ray_tasks import TASKS_DIR

    options, fs = s3
    fs.put(str(clean_folder), "packs/rewritten", recursive=True)
    dst = tmp_path / "out.lmdb"
    partial = partial_path(dst)
    opts = _Options("lmdb", "image", "skip", False, None, 90, None, 10)
    _prepare_partial(partial, dst, opts, overwrite=False, resume=False)
    (partial / "shard-00003.lmdb").write_bytes(b"")  # the last task fails for good
    run = {"shard_samples": 10, "storage_options": options, "progress": False, "engine": "ray", "resume": True}
    with pytest.raises(EngineError):
        packdata.convert("s3://packs/rewritten", dst, **run)
    done = sorted((partial / TASKS_DIR).glob("*/result.json"))
    assert done
    walk = sorted(p.relative_to(clean_folder).as_posix() for p in clean_folder.rglob("*.jpg"))
    name = walk[10 * int(done[0].parent.name)]  # the finished task's first object
    new = bytearray((clean_folder / name).read_bytes())
    new[len(new) // 2] ^= 0xFF  # other bytes in the image data, same length
    fs.pipe_file(f"packs/rewritten/{name}", bytes(new))
    (partial / "shard-00003.lmdb").unlink()
    packdata.convert("s3://packs/rewritten", dst, **run)
    assert {row[0]: row[2] for row in _lmdb_content(dst)}[name] == bytes(new)


@pytest.mark.ray
def test_ray_from_an_s3_folder_into_s3_skips_unsafe_names(
    ray_local, s3, clean_folder: Path, tmp_path: Path, monkeypatch
):
    """Objects named with '..' or empty parts are never read: skip report lines, as the local engine has them."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    fs.put(str(clean_folder), "packs/unsafe-src", recursive=True)
    fs.pipe_file("packs/unsafe-src/class0/../../escaped.jpg", _tiny_jpeg(99))
    fs.pipe_file("packs/unsafe-src/class2//5.jpg", _tiny_jpeg(98))
    url = "s3://packs/from-s3.lmdb"
    result = packdata.convert(
        "s3://packs/unsafe-src", url, shard_samples=10, storage_options=options, progress=False, engine="ray"
    )
    local = tmp_path / "local" / "from-s3.lmdb"
    expected = packdata.convert(
        "s3://packs/unsafe-src", local, shard_samples=10, storage_options=options, progress=False
    )
    assert result.skipped == expected.skipped == {"unsafe name": 2} and result.found == expected.found
    got = _download(fs, url, tmp_path / "got" / "from-s3.lmdb")
    _assert_same_pack(local, got)
    assert _lmdb_content(local) == _lmdb_content(got)
    lines = [json.loads(line) for line in (got / "skipped.jsonl").read_text().splitlines()]
    assert [(line["key"], line["reason"]) for line in lines] == [
        ("class0/../../escaped.jpg", "unsafe name"),
        ("class2//5.jpg", "unsafe name"),
    ]
    assert not (tmp_path / "escaped.jpg").exists() and SECRET not in (got / "skipped.jsonl").read_text()


@pytest.mark.ray
def test_ray_refuses_grouped_files_at_a_url(ray_local, s3, grouped_folder: Path) -> None:
    from packdata.errors import ConfigError

    options, fs = s3
    fs.put(str(grouped_folder), "packs/grouped-src", recursive=True)
    with pytest.raises(ConfigError, match=r"s3://packs/grouped-src: .* are grouped files; the Ray engine reads class"):
        packdata.convert(
            "s3://packs/grouped-src", "/nonexistent/x.lmdb", storage_options=options, progress=False, engine="ray"
        )


@pytest.mark.ray
def test_ray_tasks_retry_a_5xx_reply_but_not_a_denied_request(
    ray_local, s3, clean_folder: Path, tmp_path: Path, monkeypatch
) -> None:
    """A 503 on a task's read or upload stopped the run (only OSError was retried, and Ray reruns the whole task)."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    fs.put(str(clean_folder), "packs/flaky-src", recursive=True)
    read, upload = ("GET", "/packs/flaky-src/class1/img004.jpg"), ("PUT", "/packs/flaky.lmdb/shard-00001.lmdb/data.mdb")
    with faulty_s3(options) as (faulty, rules, hits):
        rules[read], rules[upload] = [503, 2], [503, 2]
        result = packdata.convert(
            "s3://packs/flaky-src", "s3://packs/flaky.lmdb", shard_samples=20, storage_options=faulty,
            progress=False, engine="ray",
        )  # fmt: skip
        assert result.packed == N_CLASSES * PER_CLASS + 1 and result.skipped == {}
        assert rules[read][1] == rules[upload][1] == 0 and hits[upload] == 3
        denied = ("PUT", "/packs/denied.lmdb/shard-00000.lmdb/data.mdb")
        rules[denied] = [403, 1]
        with pytest.raises(EngineError, match=r"uploading shard-00000.lmdb/data.mdb failed \(PermissionError\)"):
            packdata.convert(
                clean_folder, "s3://packs/denied.lmdb", shard_samples=20, storage_options=faulty,
                progress=False, engine="ray",
            )  # fmt: skip
        assert hits[denied] == 1  # access denied: not tried again, by packdata or by Ray
    got = _download(fs, "s3://packs/flaky.lmdb", tmp_path / "got" / "flaky.lmdb")
    packdata.convert(clean_folder, tmp_path / "local" / "flaky.lmdb", shard_samples=20, progress=False)
    assert _lmdb_content(got) == _lmdb_content(tmp_path / "local" / "flaky.lmdb")


@pytest.mark.ray
@pytest.mark.parametrize("refused", ["index/labels.i32", "manifest.json"])
def test_ray_into_s3_failed_upload_resumes_by_uploading_without_running_a_task_again(
    ray_local, s3, clean_folder: Path, tmp_path: Path, monkeypatch, refused: str
) -> None:
    """The driver's upload (index, skip report, manifest) ran after the plan was removed: a failed one said resume,
    but the resume found no plan and ran every task again. Now the plan (never uploaded) stays until the upload
    ends: the store refusing one object, the resume only uploads, and the pack at the URL is the local engine's."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    url, root = f"s3://packs/upfail-{refused[:5]}.lmdb", f"/packs/upfail-{refused[:5]}.lmdb"
    run = {"shard_samples": 10, "progress": False, "engine": "ray"}
    with faulty_s3(options) as (faulty, rules, hits):
        rules[("PUT", f"{root}/{refused}")] = [403, 1]
        with pytest.raises(PackFormatError) as raised:
            packdata.convert(clean_folder, url, storage_options=faulty, **run)
        assert str(raised.value) == (
            f"{url}: uploading {refused} failed (PermissionError). Run again with resume=True: uploaded files are kept"
        )
        shard_puts = {key: n for key, n in hits.items() if key[0] == "PUT" and "/shard-" in key[1]}
        assert len(shard_puts) == 8 and set(shard_puts.values()) == {1}  # each task uploaded its shard's 2 once
        result = packdata.convert(clean_folder, url, storage_options=faulty, resume=True, **run)
        assert {key: n for key, n in hits.items() if key[0] == "PUT" and "/shard-" in key[1]} == shard_puts
        assert hits[("PUT", f"{root}/{refused}")] == 2 and rules[("PUT", f"{root}/{refused}")][1] == 0
        assert not any("ray-plan" in path for _, path in hits)  # the plan is never uploaded
    assert result.resumed and result.packed_before == result.packed == N_CLASSES * PER_CLASS + 1
    local = tmp_path / "local" / f"upfail-{refused[:5]}.lmdb"
    packdata.convert(clean_folder, local, shard_samples=10, progress=False)
    got = _download(fs, url, tmp_path / "got" / local.name)
    assert _files(got) == _files(local)
    _assert_same_pack(local, got)
    assert _lmdb_content(local) == _lmdb_content(got)
    assert not any(p.is_file() for p in (tmp_path / "work").rglob("*"))  # the work folder is gone
