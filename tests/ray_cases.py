"""The Ray conversion engine: same pack content as the local engine, clean failures, resume.

Collected only by ``tests/test_ray.py``, which runs this file in a child pytest (see there why).
Ray tests share one local Ray instance with 2 CPUs (module fixture: starting
Ray costs seconds). The plan and missing-Ray tests need no running Ray.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import assert_index_digests, moto_s3
from PIL import Image

import packdata
from packdata.cli import main
from packdata.conversion.destination import partial_path
from packdata.conversion.sources import Skip, SourceFile, scan_source
from packdata.errors import CapacityError, ConfigError, EngineError, PackFormatError, SourceError
from packdata.pack.manifest import read_manifest
from packdata.reading.datasets import LMDBDataset

pytestmark = pytest.mark.timeout(240)

N_CLASSES, PER_CLASS = 3, 12


def _tiny_jpeg(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (8 + seed % 5, 10, 3), dtype=np.uint8)).save(out, format="JPEG")
    return out.getvalue()


@pytest.fixture
def clean_folder(tmp_path: Path) -> Path:
    """3 classes x 12 tiny JPEGs of different sizes, one unlabelled JPEG at the root."""
    root = tmp_path / "src"
    for c in range(N_CLASSES):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(PER_CLASS):
            (root / f"class{c}" / f"img{i:03d}.jpg").write_bytes(_tiny_jpeg(100 * c + i))
    (root / "top.jpg").write_bytes(_tiny_jpeg(7))
    return root


@pytest.fixture
def poisoned_folder(clean_folder: Path) -> Path:
    """The clean folder plus a corrupt JPEG, an empty file and a non-image in the walk."""
    (clean_folder / "class1" / "img005x.jpg").write_bytes(b"\xff\xd8\xff not really a jpeg")
    (clean_folder / "class2" / "empty.jpg").write_bytes(b"")
    (clean_folder / "class0" / "notes.txt").write_text("not an image")
    return clean_folder


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray instance with 2 CPUs for the whole module; convert reuses it."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'packdata[ray]')")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


def _lmdb_content(pack: Path) -> list[tuple[str, int, bytes]]:
    ds = LMDBDataset(pack, decode="bytes")
    return [(ds.keys[i], int(ds.targets[i]), *ds[i]) for i in range(len(ds))]


def _assert_same_pack(local: Path, ray_pack: Path) -> None:
    """Same samples, keys, labels, order, index, skip report and manifest facts."""
    a, b = read_manifest(local), read_manifest(ray_pack)
    for name in ("format", "kind", "classes", "num_samples", "fields", "skipped", "source", "reencode", "index"):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("labels.i32", "sizes.i64", "keys.utf8", "key_offsets.i64"):
        assert (local / "index" / name).read_bytes() == (ray_pack / "index" / name).read_bytes(), name
    assert (local / "skipped.jsonl").read_bytes() == (ray_pack / "skipped.jsonl").read_bytes()
    stems = tuple(Path(s.file).stem + "." for s in b.shards)  # a shard and, for TFRecord, its .tfindex
    assert sorted(p.name for p in ray_pack.iterdir() if not p.name.startswith(stems)) == [
        "index",
        "manifest.json",
        "skipped.jsonl",
    ]
    first = 0
    for shard in b.shards:
        assert shard.first_index == first and shard.num_samples > 0
        first += shard.num_samples


@pytest.mark.ray
@pytest.mark.parametrize(
    "limits",
    [{"shard_samples": 7}, {"shard_size": 4000}, {}, {"shard_samples": 9, "max_side": 6, "verify_images": True}],
    ids=["samples", "bytes", "default", "reencode"],
)
def test_ray_lmdb_matches_local(ray_local, poisoned_folder: Path, tmp_path: Path, limits: dict) -> None:
    local = packdata.convert(poisoned_folder, tmp_path / "local.lmdb", progress=False, **limits)
    result = packdata.convert(poisoned_folder, tmp_path / "ray.lmdb", progress=False, engine="ray", **limits)
    _assert_same_pack(tmp_path / "local.lmdb", tmp_path / "ray.lmdb")
    assert _lmdb_content(tmp_path / "local.lmdb") == _lmdb_content(tmp_path / "ray.lmdb")
    assert result.packed == local.packed == N_CLASSES * PER_CLASS + 1
    assert result.found == local.found
    assert result.skipped == local.skipped == {"corrupt image": 1, "empty": 1, "not image": 1}
    assert result.skip_examples == local.skip_examples
    assert [e["key"] for e in result.skip_examples] == ["class1/img005x.jpg", "class2/empty.jpg"]
    assert not partial_path(tmp_path / "ray.lmdb").exists()
    assert result.reencoded == local.reencoded == (result.packed if "max_side" in limits else 0)
    # "bytes in" is what was read from the source in both engines, re-encoded or not
    keys = packdata.LMDBDataset(tmp_path / "ray.lmdb", decode="bytes").keys
    assert result.bytes_in == local.bytes_in == sum((poisoned_folder / key).stat().st_size for key in keys)
    assert packdata.verify_pack(tmp_path / "ray.lmdb", progress=False).records == result.packed


@pytest.mark.ray
def test_ray_manifest_records_the_digest_of_each_index_file(ray_local, clean_folder: Path, tmp_path: Path) -> None:
    """The Ray engine's manifest holds each index file's SHA-256, as the local engine's does."""
    packdata.convert(clean_folder, tmp_path / "ray.lmdb", shard_samples=10, progress=False, engine="ray")
    assert len(assert_index_digests(tmp_path / "ray.lmdb")) == 4


@pytest.mark.ray
def test_ray_takes_relative_paths_from_the_drivers_working_directory(
    ray_local, clean_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relative SRC and DST reached the tasks as they were, read in the tasks' own working directory (where Ray
    started them, or on another machine): every task failed ('the conversion this task belongs to is gone')."""
    monkeypatch.chdir(tmp_path)  # the module's Ray workers started in the test run's working directory
    packdata.convert("src", "ray.lmdb", shard_samples=10, progress=False, engine="ray")
    packdata.convert("src", "local.lmdb", shard_samples=10, progress=False)
    _assert_same_pack(tmp_path / "local.lmdb", tmp_path / "ray.lmdb")


@pytest.mark.ray
def test_ray_shards_equal_local_without_skips(ray_local, clean_folder: Path, tmp_path: Path) -> None:
    """Without read-time skips the plan cuts shards exactly where the local engine rolls them."""
    for name, engine in (("local.lmdb", "local"), ("ray.lmdb", "ray")):
        packdata.convert(clean_folder, tmp_path / name, shard_size=3000, progress=False, engine=engine)
    a, b = read_manifest(tmp_path / "local.lmdb"), read_manifest(tmp_path / "ray.lmdb")
    assert [(s.file, s.num_samples, s.first_index) for s in a.shards] == [
        (s.file, s.num_samples, s.first_index) for s in b.shards
    ]
    assert len(b.shards) > 3


@pytest.mark.ray
def test_ray_tfrecord_matches_local(ray_local, clean_folder: Path, tmp_path: Path) -> None:
    """TFRecord shards are byte-identical to the local engine's (same boundaries, same names)."""
    from packdata.formats import tfrecord

    (clean_folder / "class0" / "broken.jpg").write_bytes(b"broken")
    for name, engine in (("local", "local"), ("ray", "ray")):
        packdata.convert(
            clean_folder / "class1",
            tmp_path / f"{name}-c1",
            format="tfrecord",
            shard_samples=5,
            progress=False,
            engine=engine,
        )
        packdata.convert(
            clean_folder, tmp_path / name, format="tfrecord", shard_samples=5, progress=False, engine=engine
        )
    a, b = read_manifest(tmp_path / "local-c1"), read_manifest(tmp_path / "ray-c1")
    assert [asdict(s) | {"file": s.file.replace("local", "x")} for s in a.shards] == [
        asdict(s) | {"file": s.file.replace("ray", "x")} for s in b.shards
    ]
    _assert_same_pack(tmp_path / "local", tmp_path / "ray")
    samples = {}
    for name in ("local", "ray"):
        manifest = read_manifest(tmp_path / name)
        assert [s.file for s in manifest.shards] == [
            f"{name}-{i:05d}-of-{len(manifest.shards):05d}.tfrecord" for i in range(len(manifest.shards))
        ]
        samples[name] = [
            (i, s.key, s.label, s.data)
            for shard in manifest.shards
            for i, s in tfrecord.iter_shard_samples(shard.path(tmp_path / name), shard.first_index)
        ]
    assert samples["local"] == samples["ray"]
    assert packdata.verify_pack(tmp_path / "ray", progress=False).records == len(samples["ray"])
    assert len(samples["ray"]) == N_CLASSES * PER_CLASS + 1


@pytest.mark.ray
def test_ray_on_error_fail_names_the_file(ray_local, poisoned_folder: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out.lmdb"
    with pytest.raises(SourceError, match=r"class1/img005x\.jpg: corrupt image.*on_error='skip'"):
        packdata.convert(poisoned_folder, dst, on_error="fail", shard_samples=5, progress=False, engine="ray")
    assert not dst.exists()
    assert not partial_path(dst).exists()


@pytest.mark.ray
def test_ray_task_failure_names_the_shard_then_resume(ray_local, clean_folder: Path, tmp_path: Path) -> None:
    """A task that fails for good names its shard and files, leaves no DST, and --resume finishes the job."""
    from packdata.conversion.ray_tasks import TASKS_DIR

    dst = tmp_path / "out.lmdb"
    partial = partial_path(dst)
    # a regular file where the last task's LMDB environment must go: creating it fails (a ConfigError: no retry);
    # with 2 CPUs, two earlier tasks have finished before the last one starts
    with pytest.raises(EngineError) as failed:
        _convert_with_blocked_shard(clean_folder, dst, blocked="shard-00003.lmdb")
    message = str(failed.value)
    assert "shard task 3 (7 files, class2/img006.jpg .. top.jpg) failed for good" in message
    assert "cannot write the destination" in message and "resume=True" in message
    assert not dst.exists() and partial.is_dir()
    done = {p.parent.name: (partial / f"shard-{p.parent.name}.lmdb" / "data.mdb").stat().st_mtime_ns
            for p in (partial / TASKS_DIR).glob("*/result.json")}  # fmt: skip
    assert done
    kept = sum(json.loads((partial / TASKS_DIR / n / "result.json").read_text())["samples"] for n in done)

    (partial / "shard-00003.lmdb").unlink()
    (partial / "shard-00042.lmdb").mkdir()  # a stray from some other run: must not end up in the pack
    result = packdata.convert(clean_folder, dst, shard_samples=10, resume=True, progress=False, engine="ray")
    assert result.resumed and result.shards == 4
    assert result.packed_before == kept > 0  # the finished tasks' samples: not this run's work, not in its rate
    for number, mtime in done.items():  # finished tasks were not run again
        assert (dst / f"shard-{number}.lmdb" / "data.mdb").stat().st_mtime_ns == mtime
    packdata.convert(clean_folder, tmp_path / "local.lmdb", shard_samples=10, progress=False)
    _assert_same_pack(tmp_path / "local.lmdb", dst)
    assert _lmdb_content(tmp_path / "local.lmdb") == _lmdb_content(dst)


@pytest.mark.ray
def test_ray_full_destination_disk_is_one_line_and_resumes(ray_local, tmp_path: Path, tmpfs) -> None:
    """The driver's gather closed its index files on the full disk in a finally: that OSError replaced the error.
    A task's write onto the full disk names it, as the local engine does (it was a bare EngineError of ENOSPC),
    whether the task met it as a bare OSError or as a writer's CapacityError (beginning a TFRecord shard)."""
    src = tmp_path / "src"
    rng = np.random.default_rng(5)
    for c in ("a", "b"):
        (src / c).mkdir(parents=True)
        for i in range(6):
            (src / c / f"{i}.txt").write_text(rng.bytes(150_000).hex())
    disk = tmpfs("2m")  # a failed task's partial TFRecord shard leaves it full to the last page
    options = {"format": "tfrecord", "shard_samples": 3, "progress": False, "engine": "ray"}
    with pytest.raises(
        CapacityError,
        match=rf"no space left on {re.escape(str(disk))} \(tmpfs of 2\.0 MiB, .* while writing .*\. "
        "Free space on that disk, then run again with resume=True",
    ):
        packdata.convert(src, disk / "out", **options)
    subprocess.run(["mount", "-o", "remount,size=32m", os.fspath(disk)], check=True)
    result = packdata.convert(src, disk / "out", resume=True, **options)
    packdata.convert(src, tmp_path / "out", **options)
    assert result.resumed and result.packed == 12
    _assert_same_pack(tmp_path / "out", disk / "out")
    assert _files(disk / "out") == _files(tmp_path / "out")
    for name in _files(tmp_path / "out"):
        if name != "manifest.json":
            assert (disk / "out" / name).read_bytes() == (tmp_path / "out" / name).read_bytes(), name


@pytest.mark.ray
def test_ray_resume_refuses_a_file_of_a_finished_task_rewritten_since(
    ray_local, clean_folder: Path, tmp_path: Path
) -> None:
    """A file a finished task packed, rewritten under its name before the resume, was not looked at: the task's
    result was kept (its part of the walk, names and labels, had not changed), so the pack held the old image
    beside shards of the source as it is now. Each task now records the size and time of its first and last file
    packed, and a resume stats those of every task it keeps: one that differs is refused, naming it, as on the
    local engine, the partial kept."""
    from packdata.conversion.ray_tasks import TASKS_DIR

    dst = tmp_path / "out.lmdb"
    with pytest.raises(EngineError):
        _convert_with_blocked_shard(clean_folder, dst, blocked="shard-00003.lmdb")
    partial = partial_path(dst)
    done = sorted((partial / TASKS_DIR).glob("*/result.json"))
    assert done
    walk = sorted(str(p) for p in clean_folder.rglob("*.jpg"))  # class0/..., class1/..., class2/..., top.jpg
    path = walk[10 * int(done[0].parent.name)]  # the finished task's first file
    size = os.stat(path).st_size
    Path(path).write_bytes(_tiny_jpeg(999) + b"\0")
    (partial / "shard-00003.lmdb").unlink()
    with pytest.raises(SourceError) as raised:
        packdata.convert(clean_folder, dst, shard_samples=10, resume=True, progress=False, engine="ray")
    assert str(raised.value) == (
        f"{path}: a file packed before the interruption changed since ({size} bytes then, "
        f"{Path(path).stat().st_size} bytes now; or its modification time differs). Restore it as it was and "
        "resume, or start again with overwrite=True"
    )
    assert partial.is_dir() and not dst.exists()


def _convert_with_blocked_shard(src: Path, dst: Path, blocked: str) -> None:
    """Start a Ray conversion whose partial folder already holds a file at ``blocked``."""
    from packdata.conversion.load import _Options
    from packdata.conversion.ray_gather import _prepare_partial

    partial = partial_path(dst)
    _prepare_partial(
        partial, dst, _Options("lmdb", "image", "skip", False, None, 90, None, 10), overwrite=False, resume=False
    )
    (partial / blocked).write_bytes(b"")
    packdata.convert(src, dst, shard_samples=10, resume=True, progress=False, engine="ray")


def _interrupted_tfrecord_run(src: Path, dst: Path) -> Path:
    """A Ray TFRecord conversion of ``src`` into ``dst`` whose last task failed for good; its partial folder."""
    from packdata.conversion.load import _Options
    from packdata.conversion.ray_gather import _prepare_partial

    partial = partial_path(dst)
    opts = _Options("tfrecord", "image", "skip", False, None, 90, None, 10)
    _prepare_partial(partial, dst, opts, overwrite=False, resume=False)
    (partial / "part-00003.tfindex").mkdir()  # the last task cannot write its index: it fails for good
    with pytest.raises(EngineError):
        packdata.convert(src, dst, format="tfrecord", shard_samples=10, resume=True, progress=False, engine="ray")
    (partial / "part-00003.tfindex").rmdir()
    return partial


@pytest.mark.ray
def test_ray_resume_reruns_a_task_whose_saved_result_names_another_shard(
    ray_local, clean_folder: Path, tmp_path: Path
) -> None:
    """A result.json naming a file outside the partial folder, or another task's fragment, is never used."""
    from packdata.conversion.ray_tasks import TASKS_DIR

    dst = tmp_path / "out"
    partial = _interrupted_tfrecord_run(clean_folder, dst)
    victim = {tmp_path / "victim.tfrecord": b"someone's records", tmp_path / "victim.tfindex": b"0 17\n"}
    for path, data in victim.items():
        path.write_bytes(data)
    results = {int(p.parent.name): p for p in (partial / TASKS_DIR).glob("*/result.json")}
    assert len(results) >= 2  # with 2 CPUs, two tasks had finished when the last one started
    first, second = sorted(results)[:2]
    saved = {n: json.loads(results[n].read_text()) for n in (first, second)}
    saved[first]["shard"]["file"] = "../victim.tfrecord"  # outside the partial folder
    saved[second]["number"] = first  # the first task's fragment again, in place of its own
    for n, data in saved.items():
        results[n].write_text(json.dumps(data))
    packdata.convert(clean_folder, dst, format="tfrecord", shard_samples=10, resume=True, progress=False, engine="ray")
    assert {path: path.read_bytes() for path in victim} == victim  # still there, unchanged
    packdata.convert(clean_folder, tmp_path / "local", format="tfrecord", shard_samples=10, progress=False)
    _assert_same_pack(tmp_path / "local", dst)
    assert packdata.verify_pack(dst, progress=False).records == N_CLASSES * PER_CLASS + 1


@pytest.mark.ray
def test_ray_resume_reruns_a_task_whose_saved_shard_was_altered_or_cut(
    ray_local, clean_folder: Path, tmp_path: Path
) -> None:
    """A saved shard was trusted because it existed: a flipped byte or a cut file was published as the pack."""
    from packdata.conversion.ray_tasks import TASKS_DIR

    dst = tmp_path / "out"
    partial = _interrupted_tfrecord_run(clean_folder, dst)
    done = sorted(int(p.parent.name) for p in (partial / TASKS_DIR).glob("*/result.json"))
    assert len(done) >= 2  # with 2 CPUs, two tasks had finished when the last one started
    altered, cut = (partial / f"part-{n:05d}.tfrecord" for n in done[:2])
    jpeg = (clean_folder / "class0" / "img000.jpg").read_bytes()
    data = bytearray(altered.read_bytes())
    at = data.index(jpeg) + len(jpeg) // 2
    data[at] ^= 0xFF  # one byte of an image, same size (a record's CRC would catch it only when read)
    altered.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:-10])
    packdata.convert(clean_folder, dst, format="tfrecord", shard_samples=10, resume=True, progress=False, engine="ray")
    packdata.convert(clean_folder, tmp_path / "local", format="tfrecord", shard_samples=10, progress=False)
    _assert_same_pack(tmp_path / "local", dst)
    assert packdata.verify_pack(dst, progress=False).records == N_CLASSES * PER_CLASS + 1
    pairs = zip(read_manifest(dst).shards, read_manifest(tmp_path / "local").shards, strict=True)
    for ours, local in pairs:  # shard names follow the pack's name
        assert (dst / ours.file).read_bytes() == (tmp_path / "local" / local.file).read_bytes(), ours.file


@pytest.mark.ray
@pytest.mark.parametrize(
    ("damaged", "error"),
    [
        ("{", r"ray-plan.json: the interrupted conversion's plan is damaged: not JSON"),
        ("[1]", r"other options: \[1\]"),
        ('+{"version": 2}', r"ray-plan.json: the interrupted conversion's plan is damaged: it holds 'version', which"),
        ("-engine", r"ray-plan.json: the interrupted conversion's plan is damaged: it lacks 'engine', but every plan"),
        ('+{"engine": "local"}', r"ray-plan.json: the interrupted conversion's plan is damaged: its engine is 'local'"),
    ],
)
def test_ray_resume_names_a_damaged_plan(clean_folder: Path, tmp_path: Path, damaged: str, error: str) -> None:
    """ray-plan.json is read before Ray starts: a damaged one was a raw JSONDecodeError or AttributeError."""
    from packdata.conversion.load import _Options
    from packdata.conversion.ray_gather import _prepare_partial
    from packdata.errors import ConfigError, PackFormatError

    dst = tmp_path / "out.lmdb"
    _prepare_partial(
        partial_path(dst),
        dst,
        _Options("lmdb", "image", "skip", False, None, 90, None, 10),
        overwrite=False,
        resume=False,
    )
    plan = partial_path(dst) / "ray-plan.json"  # "+{...}": those fields added to (or set in) the plan written
    written = json.loads(plan.read_text())  # "-name": that field removed from it
    if damaged[0] == "+":
        damaged = json.dumps({**written, **json.loads(damaged[1:])})
    elif damaged[0] == "-":
        damaged = json.dumps({key: value for key, value in written.items() if key != damaged[1:]})
    plan.write_text(damaged)
    with pytest.raises((PackFormatError, ConfigError), match=rf"{error}.*overwrite=True"):
        packdata.convert(clean_folder, dst, shard_samples=10, resume=True, progress=False, engine="ray")


def _resume_refuses_by_size(src: Path, dst: Path, path: Path, size: int, problem: str, **options: Any) -> None:
    """With ``path`` replaced by a sparse file of ``size`` zero bytes, a resume into ``dst`` is refused naming it:
    ``problem``, a bound below ``size``, then overwrite=True; the file is left as it was, nothing published."""
    path.unlink()
    with open(path, "wb") as f:
        f.truncate(size)
    with pytest.raises(PackFormatError) as raised:
        packdata.convert(src, dst, shard_samples=10, resume=True, progress=False, engine="ray", **options)
    message = str(raised.value)
    head, tail = (re.escape(part) for part in problem.split("{}"))
    assert re.fullmatch(
        rf"{re.escape(str(path))}: {head}[0-9]+{tail}\. Start the conversion again with overwrite=True", message
    ), message
    assert int(message.split("more than the ")[1].split(" ")[0]) < size
    assert path.stat().st_size == size and not dst.exists()


@pytest.mark.ray
def test_ray_resume_names_a_plan_longer_than_packdata_writes_never_read_whole(
    clean_folder: Path, tmp_path: Path
) -> None:
    """ray-plan.json was read whole whatever its size (a 10 GB file in its place taken into memory), then refused
    only as not JSON. A plan holds this run's options, classes and source, and a finishing record (a name per shard,
    counts, skip lines), each less than a manifest: one longer than that is refused by its size, naming it."""
    from packdata.conversion.load import _Options
    from packdata.conversion.ray_gather import _prepare_partial
    from packdata.pack.manifest.schema import MAX_MANIFEST_BYTES

    dst = tmp_path / "out.lmdb"
    opts = _Options("lmdb", "image", "skip", False, None, 90, None, 10)
    _prepare_partial(partial_path(dst), dst, opts, overwrite=False, resume=False)
    plan = partial_path(dst) / "ray-plan.json"
    problem = "the interrupted conversion's plan is damaged: it holds more than the {} bytes packdata writes there"
    _resume_refuses_by_size(clean_folder, dst, plan, 2 * MAX_MANIFEST_BYTES + (1 << 20), problem)


@pytest.mark.ray
def test_ray_resume_reruns_only_the_task_whose_saved_result_is_longer_than_its_task_writes(
    ray_local, clean_folder: Path, tmp_path: Path
) -> None:
    """A task's result.json longer than its task writes (read to that bound, no further) was refused with
    overwrite=True, which threw every finished task away, though a damaged result only ran its task again. Now
    that task runs again, as for a damaged one, and the other finished tasks are kept."""
    from packdata.conversion.ray_tasks import TASKS_DIR

    dst = tmp_path / "out"
    partial = _interrupted_tfrecord_run(clean_folder, dst)
    done = sorted(int(p.parent.name) for p in (partial / TASKS_DIR).glob("*/result.json"))
    assert len(done) >= 2  # with 2 CPUs, two tasks had finished when the last one started
    shards = {n: (partial / f"part-{n:05d}.tfrecord").stat() for n in done}
    oversized = partial / TASKS_DIR / f"{done[0]:05d}" / "result.json"
    oversized.unlink()
    with open(oversized, "wb") as f:
        f.truncate(5 << 20)  # sparse: over result_most (4 MiB and a name per field), never read whole
    result = packdata.convert(
        clean_folder, dst, format="tfrecord", shard_samples=10, resume=True, progress=False, engine="ray"
    )
    assert result.resumed and result.packed_before == 10 * (len(done) - 1)  # each kept task packed 10
    files = [dst / shard.file for shard in read_manifest(dst).shards]
    for n, before in shards.items():  # the kept tasks' shards are the files they wrote; the other was written again
        after = files[n].stat()
        assert ((after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)) == (n != done[0]), n
    packdata.convert(clean_folder, tmp_path / "local", format="tfrecord", shard_samples=10, progress=False)
    _assert_same_pack(tmp_path / "local", dst)


@pytest.mark.ray
def test_ray_resume_reruns_a_task_whose_saved_result_does_not_add_up(
    ray_local, clean_folder: Path, tmp_path: Path
) -> None:
    """A result.json's counts are added into the pack: one of the wrong type or disagreeing is never used,
    even with its digest made again (anyone can)."""
    from packdata.conversion.ray_tasks import TASKS_DIR, load_result, save_result

    dst = tmp_path / "out"
    partial = _interrupted_tfrecord_run(clean_folder, dst)
    results = {int(p.parent.name): p for p in (partial / TASKS_DIR).glob("*/result.json")}
    assert len(results) >= 2  # with 2 CPUs, two tasks had finished when the last one started
    first, second = sorted(results)[:2]
    saved = {n: load_result(results[n], most=1 << 30) for n in (first, second)}
    assert saved[first]["samples"] == saved[first]["shard"]["num_samples"] == 10
    saved[first]["samples"] = "10"  # a string: a raw TypeError in the gather
    saved[second]["samples"] = saved[second]["shard"]["num_samples"] = 9  # one sample short of its index
    saved[second]["skipped"] = {"lost": 1}  # so the entries still add up
    for n, data in saved.items():
        save_result(results[n].parent, data)
    packdata.convert(clean_folder, dst, format="tfrecord", shard_samples=10, resume=True, progress=False, engine="ray")
    packdata.convert(clean_folder, tmp_path / "local", format="tfrecord", shard_samples=10, progress=False)
    _assert_same_pack(tmp_path / "local", dst)
    assert packdata.verify_pack(dst, progress=False).records == N_CLASSES * PER_CLASS + 1


@pytest.mark.ray
def test_ray_resume_never_stats_a_file_a_saved_result_probes_outside_its_task(
    ray_local, clean_folder: Path, tmp_path: Path
) -> None:
    """A result.json edited to probe a file outside its task (here outside the source) is never stat'ed: the
    task is run again, as for any result that does not add up, and the pack is the uninterrupted run's."""
    from packdata.conversion.ray_tasks import TASKS_DIR, load_result, save_result

    dst = tmp_path / "out"
    partial = _interrupted_tfrecord_run(clean_folder, dst)
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"not the source's")
    results = sorted((partial / TASKS_DIR).glob("*/result.json"))
    assert results
    for result in results:
        saved = load_result(result, most=1 << 30)
        assert saved is not None
        saved["probes"] = [[str(secret), 1, secret.stat().st_mtime_ns]]  # a size it lacks: a stat would tell its own
        save_result(result.parent, saved)  # its digest made again: anyone can
    packdata.convert(clean_folder, dst, format="tfrecord", shard_samples=10, resume=True, progress=False, engine="ray")
    packdata.convert(clean_folder, tmp_path / "local", format="tfrecord", shard_samples=10, progress=False)
    _assert_same_pack(tmp_path / "local", dst)


@pytest.mark.ray
@pytest.mark.parametrize("rel", ["index/labels.i32", "skipped.jsonl"])
def test_ray_resume_reruns_a_task_whose_saved_fragment_changed(
    ray_local, poisoned_folder: Path, tmp_path: Path, rel: str
) -> None:
    """A byte flipped in a saved index fragment or skip list (a label, a key) was published as found."""
    from packdata.conversion.ray_tasks import TASKS_DIR

    dst = tmp_path / "out"
    partial = _interrupted_tfrecord_run(poisoned_folder, dst)
    saved = sorted(p.parent / rel for p in (partial / TASKS_DIR).glob("*/result.json"))
    fragment = next(p for p in saved if p.stat().st_size)  # task 1 holds the first skips
    data = bytearray(fragment.read_bytes())
    data[data.find(b'"key": "') + 8 if rel == "skipped.jsonl" else 0] ^= 1  # label 0 -> 1; key class... -> blass...
    fragment.write_bytes(bytes(data))
    options = {"format": "tfrecord", "shard_samples": 10, "progress": False}
    packdata.convert(poisoned_folder, dst, resume=True, engine="ray", **options)
    packdata.convert(poisoned_folder, tmp_path / "local", **options)
    _assert_same_pack(tmp_path / "local", dst)


@pytest.mark.ray
def test_ray_resume_rejects_other_options(ray_local, clean_folder: Path, tmp_path: Path) -> None:
    from packdata.conversion.load import _Options
    from packdata.conversion.ray_gather import _prepare_partial
    from packdata.errors import ConfigError

    dst = tmp_path / "out.lmdb"
    opts = _Options("lmdb", "image", "skip", False, None, 90, None, 10)
    _prepare_partial(partial_path(dst), dst, opts, overwrite=False, resume=False)
    with pytest.raises(ConfigError, match=r"other options.*overwrite=True"):
        packdata.convert(clean_folder, dst, shard_samples=11, resume=True, progress=False, engine="ray")
    with pytest.raises(ConfigError, match=r"interrupted conversion.*resume=True"):
        packdata.convert(clean_folder, dst, shard_samples=10, progress=False, engine="ray")


_RESUME = {"format": "tfrecord", "shard_samples": 10, "resume": True, "progress": False, "engine": "ray"}


def _interrupted_ray_run(folder: Path, dst: Path) -> list[str]:
    """A Ray conversion of ``folder`` into ``dst`` whose last task failed for good; the names of its saved tasks."""
    from packdata.conversion.load import _Options
    from packdata.conversion.publish import source_identity
    from packdata.conversion.ray_gather import _prepare_partial
    from packdata.conversion.ray_tasks import TASKS_DIR

    partial = partial_path(dst)
    opts = _Options("tfrecord", "image", "skip", False, None, 90, None, 10)
    source = scan_source(folder)  # the plan as the run writes it
    places = source_identity(source)
    _prepare_partial(partial, dst, opts, overwrite=False, resume=False, classes=source.classes, places=places)
    (partial / "part-00003.tfindex").mkdir()  # the last task cannot write its index: it fails for good
    with pytest.raises(EngineError):
        packdata.convert(folder, dst, **_RESUME)
    (partial / "part-00003.tfindex").rmdir()
    return sorted(p.name for p in (partial / TASKS_DIR).iterdir())


@pytest.mark.ray
def test_ray_resume_refuses_a_source_whose_classes_changed(ray_local, clean_folder: Path, tmp_path: Path) -> None:
    """The plan kept no classes: a class folder added since renumbered every class the saved tasks had labelled."""
    dst = tmp_path / "out"
    saved = _interrupted_ray_run(clean_folder, dst)
    (clean_folder / "aaa").mkdir()
    (clean_folder / "aaa" / "x.jpg").write_bytes(_tiny_jpeg(1))
    message = "the source's classes changed since the interrupted conversion (class 0 was 'class0', is now 'aaa')"
    with pytest.raises(SourceError, match=re.escape(message)):
        packdata.convert(clean_folder, dst, **_RESUME)
    assert sorted(p.name for p in (partial_path(dst) / "tasks").iterdir()) == saved and not dst.exists()


@pytest.mark.ray
def test_ray_resume_refuses_another_source_with_the_same_names(ray_local, clean_folder: Path, tmp_path: Path) -> None:
    """The plan did not record which source it read: a run of v1 resumed from v2 (the same names and classes,
    other bytes) kept v1's finished tasks beside v2's. It is refused now, naming both, the saved tasks kept."""
    other = tmp_path / "v2"
    shutil.copytree(clean_folder, other)
    dst = tmp_path / "out"
    saved = _interrupted_ray_run(clean_folder, dst)
    message = f"the interrupted conversion read another source ({clean_folder.resolve()}; this run reads {other})"
    with pytest.raises(ConfigError, match=re.escape(message)):
        packdata.convert(other, dst, **_RESUME)
    assert sorted(p.name for p in (partial_path(dst) / "tasks").iterdir()) == saved and not dst.exists()
    assert packdata.convert(clean_folder, dst, **_RESUME).resumed


@pytest.mark.ray
def test_cli_engine_ray(ray_local, poisoned_folder: Path, tmp_path: Path) -> None:
    dst = tmp_path / "cli.lmdb"
    result = CliRunner().invoke(
        main, ["convert", str(poisoned_folder), str(dst), "--engine", "ray", "-q", "--json", "--shard-samples", "8"]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["packed"] == N_CLASSES * PER_CLASS + 1 and summary["shards"] == 5
    assert len(LMDBDataset(dst)) == summary["packed"]


@pytest.fixture
def grouped_folder(tmp_path: Path) -> Path:
    """Groups whose fields appear late (json from sample 6, seg.png from 11), cls labels past the class
    folders, a group missing its jpg and an unreadable jpg: the driver must renumber each task's fields."""
    root = tmp_path / "grouped"
    (root / "cats").mkdir(parents=True)
    for i in range(16):
        folder = root / "cats" if i % 4 == 0 else root
        stem = folder / f"s{i:02d}"
        (stem.parent / f"{stem.name}.txt").write_text(f"caption {i}", encoding="utf-8")
        if i != 9:
            (stem.parent / f"{stem.name}.jpg").write_bytes(_tiny_jpeg(i) if i != 13 else b"\xff\xd8 broken")
        if i >= 6:
            (stem.parent / f"{stem.name}.json").write_text(json.dumps({"n": i}), encoding="utf-8")
        if i >= 11:
            (stem.parent / f"{stem.name}.seg.png").write_bytes(_tiny_jpeg(50 + i))
        if i % 4 == 1:
            (stem.parent / f"{stem.name}.cls").write_text(str(i % 3 + 1), encoding="utf-8")
    return root


def _fields_content(pack: Path) -> list[tuple[int, dict]]:
    ds = LMDBDataset(pack, decode="bytes")
    return [(int(ds.targets[i]), ds[i]) for i in range(len(ds))]


def _assert_same_fields_pack(local: Path, ray_pack: Path) -> None:
    _assert_same_pack(local, ray_pack)
    a, b = read_manifest(local), read_manifest(ray_pack)
    assert a.codecs == b.codecs and a.field_counts == b.field_counts and a.field_counts
    for name in ("field_sizes.i64", "field_offsets.i64"):
        assert (local / "index" / name).read_bytes() == (ray_pack / "index" / name).read_bytes(), name
    assert _fields_content(local) == _fields_content(ray_pack)


@pytest.mark.ray
def test_ray_grouped_folder_matches_local(ray_local, grouped_folder: Path, tmp_path: Path) -> None:
    options = {"layout": "grouped", "require": ("jpg",), "shard_samples": 4, "progress": False}
    local = packdata.convert(grouped_folder, tmp_path / "local.lmdb", **options)
    result = packdata.convert(grouped_folder, tmp_path / "ray.lmdb", engine="ray", **options)
    _assert_same_fields_pack(tmp_path / "local.lmdb", tmp_path / "ray.lmdb")
    assert result.packed == local.packed == 14 and result.skipped == local.skipped
    assert result.missing_fields == local.missing_fields and local.missing_fields  # some samples lack a field
    manifest = read_manifest(tmp_path / "ray.lmdb")
    assert manifest.fields == ["jpg", "txt", "json", "seg.png"]  # first appearance over the whole walk (cls: labels)
    assert manifest.classes == ["cats", "1", "2", "3"]
    assert len(manifest.shards) > 2
    assert packdata.verify_pack(tmp_path / "ray.lmdb", progress=False).records == 14


@pytest.mark.ray
def test_ray_skips_a_grouped_sample_with_a_file_left_unread_as_local_does(
    ray_local, grouped_folder: Path, tmp_path: Path
) -> None:
    """A FIFO s03.txt was skipped alone and sample s03 packed without its caption, on either engine."""
    (grouped_folder / "s03.txt").unlink()
    os.mkfifo(grouped_folder / "s03.txt")
    options = {"layout": "grouped", "shard_samples": 4, "progress": False}
    local = packdata.convert(grouped_folder, tmp_path / "local.lmdb", **options)
    result = packdata.convert(grouped_folder, tmp_path / "ray.lmdb", engine="ray", **options)
    _assert_same_fields_pack(tmp_path / "local.lmdb", tmp_path / "ray.lmdb")
    assert result.skipped == local.skipped and result.skipped["not a regular file"] == 1
    assert "s03" not in LMDBDataset(tmp_path / "ray.lmdb").keys
    said = [e["detail"] for e in result.skip_examples if e["key"] == "s03"]
    assert said == ["file 's03.txt' (a FIFO) is left unread: the sample is skipped whole"]


def _finished_fields_task(grouped_folder: Path, tmp_path: Path) -> tuple[Path, dict]:
    """The first task of a grouped folder, run here as a Ray worker runs it: its partial folder and result."""
    from packdata.conversion.layouts import scan_grouped
    from packdata.conversion.load import _Options
    from packdata.conversion.ray_tasks import TASKS_DIR, plan_tasks, run_shard_task

    partial = tmp_path / "partial"
    (partial / TASKS_DIR).mkdir(parents=True)
    task = next(plan_tasks(scan_grouped(grouped_folder), shard_samples=4, shard_size=None))
    opts = _Options("lmdb", "fields", "skip", False, None, 90, None, 4)
    return partial, run_shard_task(task, str(partial), opts, 1)


def _gather_refuses_changed_field_sizes(grouped_folder: Path, tmp_path: Path, change, error: str) -> None:
    """A finished task's field_sizes.i64 changed by ``change`` (its recorded digest updated, as if the task had
    written it so) is named by the gather with ``error``."""
    from packdata.conversion.ray_gather import _Gatherer
    from packdata.errors import PackFormatError
    from packdata.pack.files import file_sha256

    partial, result = _finished_fields_task(grouped_folder, tmp_path)
    assert len(result["field_names"]) == 4
    sizes = partial / "tasks" / "00000" / "index" / "field_sizes.i64"
    change(sizes)
    result["fragment_files"]["index/field_sizes.i64"] = [sizes.stat().st_size, file_sha256(sizes)]
    gatherer = _Gatherer(partial, "fields")
    try:
        with pytest.raises(PackFormatError, match=rf"00000/index/field_sizes.i64: {error}"):
            gatherer.add(result)
    finally:
        gatherer.close()


def _set_pair_value(position: int, value: int):
    def change(sizes: Path) -> None:
        pairs = np.fromfile(sizes, dtype="<i8")
        pairs[position] = value
        pairs.tofile(sizes)

    return change


@pytest.mark.ray
@pytest.mark.parametrize("number", [-1, 4])
def test_ray_gather_names_a_fragment_with_an_out_of_range_field_number(
    grouped_folder: Path, tmp_path: Path, number: int
) -> None:
    """A task's field number indexes its field names: -1 picked the last one unseen, 4 was a raw IndexError."""
    change = _set_pair_value(0, number)
    _gather_refuses_changed_field_sizes(grouped_folder, tmp_path, change, f"field number {number} is out of")


@pytest.mark.ray
def test_ray_gather_names_a_fragment_with_a_negative_field_size(grouped_folder: Path, tmp_path: Path) -> None:
    """A negative field size was appended into the pack as found, and only its reader refused the pack."""
    change = _set_pair_value(1, -5)
    _gather_refuses_changed_field_sizes(grouped_folder, tmp_path, change, "field size -5 is negative")


@pytest.mark.ray
def test_ray_gather_names_a_field_sizes_fragment_cut_between_pairs(grouped_folder: Path, tmp_path: Path) -> None:
    """A field_sizes.i64 of an odd number of int64s stopped the gather with numpy's raw reshape ValueError."""

    def cut(sizes: Path) -> None:
        sizes.write_bytes(sizes.read_bytes()[:-8])

    _gather_refuses_changed_field_sizes(grouped_folder, tmp_path, cut, r"\d+ bytes: not a whole number of .* pairs")


@pytest.mark.ray
def test_ray_resume_reruns_a_task_whose_saved_result_was_changed(
    ray_local, poisoned_folder: Path, tmp_path: Path
) -> None:
    """Nothing checked result.json's own content: a skip reason changed in it (counts kept) was published."""
    from packdata.conversion.ray_tasks import TASKS_DIR

    dst = tmp_path / "out"
    partial = _interrupted_tfrecord_run(poisoned_folder, dst)
    results = sorted((partial / TASKS_DIR).glob("*/result.json"))
    path = next(p for p in results if json.loads(p.read_text())["skipped"])
    text = path.read_text()
    reason = next(iter(json.loads(text)["skipped"]))
    path.write_text(text.replace(f'"{reason}"', f'"{reason[:-1]}?"'))  # same counts, another reason
    options = {"format": "tfrecord", "shard_samples": 10, "progress": False}
    packdata.convert(poisoned_folder, dst, resume=True, engine="ray", **options)
    packdata.convert(poisoned_folder, tmp_path / "local", **options)
    _assert_same_pack(tmp_path / "local", dst)


def test_ray_gather_names_a_fragment_changed_since_its_task_ended(grouped_folder: Path, tmp_path: Path) -> None:
    """A byte flipped in a finished task's labels.i32 was appended as another label."""
    from packdata.conversion.ray_gather import _Gatherer
    from packdata.errors import PackFormatError

    partial, result = _finished_fields_task(grouped_folder, tmp_path)
    labels = partial / "tasks" / "00000" / "index" / "labels.i32"
    data = bytearray(labels.read_bytes())
    data[0] ^= 1
    labels.write_bytes(bytes(data))
    gatherer = _Gatherer(partial, "fields")
    try:
        with pytest.raises(PackFormatError, match=r"00000/index/labels.i32: this task's fragment file .*resume=True"):
            gatherer.add(result)
    finally:
        gatherer.close()


@pytest.mark.ray
def test_ray_list_file_matches_local(ray_local, tmp_path: Path) -> None:
    images = tmp_path / "imgs"
    images.mkdir()
    rows = ["image,label,caption"]
    for i in range(11):
        (images / f"im{i}.jpg").write_bytes(_tiny_jpeg(i))
        rows.append(f"imgs/im{i}.jpg,{'zebra' if i % 3 else 'ant'},photo {i}")
    rows.append("imgs/missing.jpg,ant,gone")
    listing = tmp_path / "train.csv"
    listing.write_text("\n".join(rows) + "\n", encoding="utf-8")
    options = {"path_column": "image", "label_column": "label", "shard_samples": 3, "progress": False}
    for name, engine in (("local.tfrecord", "local"), ("ray.tfrecord", "ray")):
        packdata.convert(listing, tmp_path / name, engine=engine, **options)
    _assert_same_pack(tmp_path / "local.tfrecord", tmp_path / "ray.tfrecord")
    for name in ("field_sizes.i64", "field_offsets.i64"):
        assert (tmp_path / "local.tfrecord" / "index" / name).read_bytes() == (
            tmp_path / "ray.tfrecord" / "index" / name
        ).read_bytes()
    local = list(packdata.TFRecordDataset(tmp_path / "local.tfrecord", decode="bytes"))
    assert local == list(packdata.TFRecordDataset(tmp_path / "ray.tfrecord", decode="bytes"))
    assert sorted(sample["caption"] for sample in local) == sorted(f"photo {i}".encode() for i in range(11))


@pytest.mark.ray
def test_ray_resume_reruns_a_finished_task_whose_list_labels_changed(ray_local, tmp_path: Path) -> None:
    """A task's saved result was matched to the plan by its keys only: a list edited after the interruption
    (two rows' labels swapped, the same classes) kept the finished task's old labels beside the new ones."""
    (tmp_path / "t").mkdir()
    labels = ["ant", "ant", "bee", "bee", "ant", "bee"]
    for i in range(6):
        (tmp_path / "t" / f"{i}.txt").write_text(f"t{i}", encoding="utf-8")

    def write_list() -> None:
        rows = [f"t/{i}.txt,{label}" for i, label in enumerate(labels)]
        (tmp_path / "l.csv").write_text("\n".join(["path,label", *rows]) + "\n", encoding="utf-8")

    write_list()
    from packdata.conversion.lists import scan_list
    from packdata.conversion.load import _Options
    from packdata.conversion.ray_gather import _prepare_partial
    from packdata.conversion.ray_tasks import TASKS_DIR

    dst = tmp_path / "out"
    partial = partial_path(dst)
    source = scan_list(tmp_path / "l.csv", label_column="label")
    opts = _Options("tfrecord", source.kind, "skip", False, None, 90, None, 2)
    _prepare_partial(partial, dst, opts, overwrite=False, resume=False, classes=source.classes, source=source.root)
    (partial / "part-00002.tfindex").mkdir()  # the last task cannot write its index: the others' results stay
    options = {"format": "tfrecord", "label_column": "label", "shard_samples": 2, "progress": False, "engine": "ray"}
    with pytest.raises(EngineError):
        packdata.convert(tmp_path / "l.csv", dst, resume=True, **options)
    (partial / "part-00002.tfindex").rmdir()
    for task in ("00000", "00001"):  # the finished tasks' results, kept for the resume (the failed one's may be too)
        assert (partial / TASKS_DIR / task / "result.json").is_file()
    labels[0], labels[2] = "bee", "ant"  # a row of each finished task
    write_list()
    packdata.convert(tmp_path / "l.csv", dst, resume=True, **options)
    ds = packdata.TFRecordIndexedDataset(dst, decode="bytes")
    assert [ds.classes[ds.targets[i]] for i in range(6)] == labels


@pytest.mark.ray
def test_ray_tasks_in_flight_when_one_fails_for_good_end_and_are_kept(ray_local, tmp_path: Path) -> None:
    """A task failing for good cancelled every task still in flight, so those were packed again by the resume,
    however far they had got (and a test counting on the finished tasks' results failed by chance when one was
    still running). The tasks in flight now end, for up to DRAIN_SECONDS, before the error is raised: each keeps
    its shard and result for the resume; only those still running then are cancelled (never a finished one)."""
    from packdata.conversion.load import _Options
    from packdata.conversion.ray_gather import _prepare_partial
    from packdata.conversion.ray_tasks import TASKS_DIR

    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    for i in range(8):
        (src / f"{i}.txt").write_text(f"t{i}", encoding="utf-8")
    dst = tmp_path / "out"
    partial = partial_path(dst)
    opts = _Options("tfrecord", "text", "skip", False, None, 90, None, 2)
    _prepare_partial(partial, dst, opts, overwrite=False, resume=False)
    (partial / "part-00000.tfindex").mkdir()  # the first task fails for good at once; three more are in flight
    options = {"format": "tfrecord", "shard_samples": 2, "progress": False, "engine": "ray"}
    with pytest.raises(EngineError, match=r"shard task 0 .* failed for good"):
        packdata.convert(tmp_path / "src", dst, resume=True, **options)
    assert sorted(p.parent.name for p in (partial / TASKS_DIR).glob("*/result.json")) == ["00001", "00002", "00003"]
    (partial / "part-00000.tfindex").rmdir()
    assert packdata.convert(tmp_path / "src", dst, resume=True, **options).packed == 8


def test_ray_refuses_tar_shards(tmp_path: Path) -> None:
    import tarfile

    from packdata.errors import ConfigError

    for i in range(4):
        with tarfile.open(tmp_path / f"data-{i}.tar", "w") as tar:
            info = tarfile.TarInfo(f"s{i}.txt")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(ConfigError, match="the Ray engine packs local folders and list files"):
        packdata.convert(str(tmp_path / "data-{0..3}.tar"), tmp_path / "x.lmdb", engine="ray", progress=False)


def test_cli_address_needs_engine_ray(clean_folder: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["convert", str(clean_folder), str(tmp_path / "x.lmdb"), "--address", "auto"])
    assert result.exit_code == 2
    assert "--address needs --engine ray" in result.output


def test_missing_ray_says_how_to_install(clean_folder: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(EngineError, match=r"needs Ray, which is not installed\. Install it with: pip install"):
        packdata.convert(clean_folder, tmp_path / "x.lmdb", engine="ray", progress=False)
    result = CliRunner().invoke(main, ["convert", str(clean_folder), str(tmp_path / "x.lmdb"), "--engine", "ray"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "pip install 'packdata[ray]'" in lines[0]
    assert not (tmp_path / "x.lmdb").exists() and not partial_path(tmp_path / "x.lmdb").exists()


def test_unknown_engine(clean_folder: Path, tmp_path: Path) -> None:
    from packdata.errors import ConfigError

    with pytest.raises(ConfigError, match="engine should be 'local' or 'ray', but got engine='spark'"):
        packdata.convert(clean_folder, tmp_path / "x.lmdb", engine="spark")


# -- the plan (no Ray needed) --------------------------------------------------------------------------------------


def test_plan_is_a_deterministic_partition(poisoned_folder: Path) -> None:
    from packdata.conversion.ray_tasks import plan_tasks

    source = scan_source(poisoned_folder)
    walk = list(source.walk())
    plan = list(plan_tasks(source, shard_samples=5, shard_size=None))
    assert [e for task in plan for e in task.entries] == walk
    assert [t.number for t in plan] == list(range(len(plan)))
    assert all(t.files == 5 for t in plan[:-1]) and 0 < plan[-1].files <= 5
    assert all(t.files == sum(isinstance(e, SourceFile) for e in t.entries) for t in plan)
    assert [t.fingerprint for t in plan] == [
        t.fingerprint for t in plan_tasks(source, shard_samples=5, shard_size=None)
    ]
    assert any(isinstance(e, Skip) for t in plan for e in t.entries)  # walk-time skips travel with their task


def test_plan_by_bytes(clean_folder: Path) -> None:
    from packdata.conversion.ray_tasks import plan_tasks

    source = scan_source(clean_folder)
    plan = list(plan_tasks(source, shard_samples=None, shard_size=2500))
    for task in plan:
        sizes = [Path(e.path).stat().st_size for e in task.entries if isinstance(e, SourceFile)]
        assert sum(sizes) <= 2500 or len(sizes) == 1
    assert sum(t.files for t in plan) == N_CLASSES * PER_CLASS + 1
    big = list(plan_tasks(source, shard_samples=None, shard_size=1))
    assert [t.files for t in big] == [1] * (N_CLASSES * PER_CLASS + 1)  # a file over the limit gets its own task


# -- into and from object storage (a moto S3 server on loopback; no storage shared with the workers) ----------------

SECRET = "never-print-this-ray-secret-5b1d"


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on loopback; yields (storage_options with the credentials in them, filesystem).

    The credentials travel in ``storage_options`` (not the environment): Ray's
    workers started before this fixture, so the tasks can only have them from
    the options the driver passes.
    """
    with moto_s3({"key": "ray-testing-key-id", "secret": SECRET}) as (options, fs):
        yield options, fs


def _download(fs, url: str, to: Path) -> Path:
    """Every object of the pack at ``url``, copied as files into ``to``."""
    root = url.removeprefix("s3://")
    fs.invalidate_cache()
    for path in fs.find(root):
        target = to / path[len(root) + 1 :]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(fs.cat_file(path))
    return to


def _files(pack: Path) -> list[str]:
    return sorted(p.relative_to(pack).as_posix() for p in pack.rglob("*") if p.is_file() and p.name != "lock.mdb")
