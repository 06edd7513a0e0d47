"""The Ray engine's finishing steps (after every task ended): killed or stopped at any of them, a resume finishes.

Collected only by ``tests/test_ray.py``, with ``tests/ray_cases.py`` (whose fixtures it shares), in a child pytest.
A driver is SIGKILLed at an exact file-system call by an audit hook in a child process joined to the
module's Ray instance; the resume runs here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import ray_cases as cases
from remote_helpers import _resume_a_refused_removal

import packdata
from packdata.conversion.destination import partial_path
from packdata.errors import PackFormatError
from packdata.pack.manifest import read_manifest
from packdata.reading.open import open_dataset

pytestmark = pytest.mark.timeout(480)

ray_local = cases.ray_local
clean_folder = cases.clean_folder
poisoned_folder = cases.poisoned_folder
s3 = cases.s3

_OPTIONS = {"format": "tfrecord", "shard_samples": 10, "progress": False, "engine": "ray"}

_DRIVER = r"""
import json, os, signal, sys
import packdata
from packdata.errors import PackdataError
src, dst, address, event, prefix, nth, fill = sys.argv[1:]
options = json.loads(os.environ["CONVERT_OPTIONS"])
seen = []

def hook(name, args):  # at the nth such call on a file whose name starts with prefix, before the call itself
    if name != event or not args or not isinstance(args[0], (str, os.PathLike)):
        return
    if os.path.basename(os.fspath(args[0])).startswith(prefix) and not seen.count("filled"):
        seen.append(name)
        if len(seen) == int(nth) and not fill:
            os.kill(os.getpid(), signal.SIGKILL)
        if len(seen) == int(nth) and fill:  # use up the disk's blocks: the call meets a real full disk
            seen.append("filled")
            with open(fill, "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * 4096)
                        f.flush()
                except OSError:
                    pass

sys.addaudithook(hook)
try:
    packdata.convert(src, dst, resume=True, address=address, **options)
except PackdataError as exc:
    print(exc)
    sys.exit(3)
"""


def _driver(ray_local, src: Path, dst: Path, at: tuple[str, str, int], fill: Path | None = None):
    """Run a Ray conversion (resume=True) of ``src`` into ``dst`` in a child joined to this module's Ray, stopped
    at the call ``at`` (event, file name prefix, nth): SIGKILLed, or with ``fill`` its disk filled first."""
    address = ray_local.get_runtime_context().gcs_address
    event, prefix, nth = at
    return subprocess.run(
        [sys.executable, "-c", _DRIVER, str(src), str(dst), address, event, prefix, str(nth), str(fill or "")],
        cwd=Path(__file__).parents[1],
        env={**os.environ, "CONVERT_OPTIONS": json.dumps(_OPTIONS)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _files(pack: Path) -> dict[str, bytes]:
    return {p.relative_to(pack).as_posix(): p.read_bytes() for p in sorted(pack.rglob("*")) if p.is_file()}


def _assert_equal_packs(reference: Path, pack: Path) -> None:
    """Every file the same bytes (the manifest: the same content), every key and value the same."""
    want, got = _files(reference), _files(pack)
    assert sorted(want) == sorted(got)
    for name in want:
        if name != "manifest.json":
            assert got[name] == want[name], name
    assert read_manifest(pack).to_dict() == read_manifest(reference).to_dict()
    a, b = open_dataset(reference, decode="bytes"), open_dataset(pack, decode="bytes")
    assert len(a) == len(b) and [a[i] for i in range(len(a))] == [b[i] for i in range(len(b))]


# Each step after the gather, in the order a run takes them; a resume killed at the next one redoes the steps
# before it: the plan's finishing record, the manifest (each a temporary file, then its rename), the shards' final
# names (index and shard per shard), the tasks' folder, the plan
_STEPS = [
    ("open", ".ray-plan.json.tmp", 1),
    ("open", ".manifest.json.tmp", 1),
    ("os.rename", ".manifest.json.tmp", 1),
    ("os.rename", "part-", 1),
    ("os.rename", "part-", 4),
    ("os.remove", "result.json", 2),
    ("os.remove", "ray-plan.json", 1),
]


@pytest.mark.ray
def test_ray_killed_at_each_finishing_step_resumes_to_the_same_pack_without_running_a_task_again(
    ray_local, poisoned_folder: Path, tmp_path: Path
) -> None:
    """The plan and the tasks' results went before the shards had their final names and the manifest was written:
    a driver killed in between left a partial folder a resume started over (every task packed again), and a full
    disk at the manifest said to overwrite. Now the plan records what finishing needs before the manifest is
    written, and goes last: killed at each step in turn (each resume killed at the next), the last resume gives
    the uninterrupted run's pack, every shard the file the first run's tasks wrote."""
    reference = packdata.convert(poisoned_folder, tmp_path / "ref" / "out", **_OPTIONS)
    dst = tmp_path / "out"
    shards: set[tuple[int, int]] = set()
    for step in _STEPS:
        proc = _driver(ray_local, poisoned_folder, dst, step)
        assert proc.returncode == -9, f"{step}: {(proc.stdout + proc.stderr)[-3000:]}"
        assert not dst.exists()
        if not shards:  # every task ended before the first step: their shards, as written
            shards = {(p.stat().st_ino, p.stat().st_mtime_ns) for p in partial_path(dst).glob("*.tfrecord")}
            assert len(shards) == reference.shards
    result = packdata.convert(poisoned_folder, dst, resume=True, **_OPTIONS)
    assert result.resumed and result.packed_before == result.packed == reference.packed
    for name in ("found", "skipped", "skip_examples", "bytes_in", "reencoded", "shards"):
        assert getattr(result, name) == getattr(reference, name), name
    assert {(p.stat().st_ino, p.stat().st_mtime_ns) for p in dst.glob("*.tfrecord")} == shards
    assert not partial_path(dst).exists()
    _assert_equal_packs(tmp_path / "ref" / "out", dst)


@pytest.mark.ray
def test_ray_full_disk_at_the_manifest_names_the_disk_and_resumes(
    ray_local, poisoned_folder: Path, tmp_path: Path, tmpfs
) -> None:
    """A full disk as the manifest is written names the disk and says resume (it said overwrite: the tasks'
    results were already removed); the resume, once space is freed, runs no task and gives the same pack."""
    reference = packdata.convert(poisoned_folder, tmp_path / "ref" / "out", **_OPTIONS)
    disk = tmpfs("8m")
    dst = disk / "out"
    filler = disk / "filler"
    proc = _driver(ray_local, poisoned_folder, dst, ("open", ".manifest.json.tmp", 1), fill=filler)
    assert proc.returncode == 3, (proc.stdout + proc.stderr)[-3000:]
    partial = partial_path(dst)
    assert re.fullmatch(
        rf"{re.escape(str(partial))}/\.manifest\.json\.tmp: no space left on {re.escape(str(disk))} \(tmpfs of "
        r"8\.0 MiB, .*\) while writing manifest\.json of the partial pack\. Free space on that disk, then run "
        r"again with resume=True: finished shards are kept\n",
        proc.stdout,
    ), proc.stdout + proc.stderr[-3000:]
    assert not dst.exists() and not (partial / "manifest.json").exists()
    filler.unlink()
    result = packdata.convert(poisoned_folder, dst, resume=True, **_OPTIONS)
    assert result.resumed and result.packed_before == result.packed == reference.packed
    _assert_equal_packs(tmp_path / "ref" / "out", dst)


@pytest.mark.ray
def test_ray_resume_while_finishing_refuses_a_damaged_finishing_record_or_a_missing_shard(
    ray_local, clean_folder: Path, tmp_path: Path, monkeypatch
) -> None:
    """A resume that only finishes renames the shards the plan's record names: a record naming a file that no task
    writes (the manifest here) is refused, naming the plan; a shard gone since is named, nothing published."""
    from packdata.conversion import ray as ray_engine

    dst = tmp_path / "out"

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:  # stopped as finishing begins: the record and the manifest written
        m.setattr(ray_engine, "_finish", stop)
        with pytest.raises(KeyboardInterrupt):
            packdata.convert(clean_folder, dst, **_OPTIONS)
    plan = partial_path(dst) / "ray-plan.json"
    saved = json.loads(plan.read_text())
    written = saved["finishing"]["written"]
    assert written == [f"part-{n:05d}.tfrecord" for n in range(4)]
    plan.write_text(
        json.dumps({**saved, "finishing": {**saved["finishing"], "written": ["manifest.json", *written[1:]]}})
    )
    with pytest.raises(PackFormatError) as raised:
        packdata.convert(clean_folder, dst, resume=True, **_OPTIONS)
    assert str(raised.value) == (
        f"{plan}: the interrupted conversion's plan is damaged: its finishing record should name each shard as a "
        "task writes it. Start the conversion again with overwrite=True"
    )
    plan.write_text(json.dumps(saved))
    (partial_path(dst) / written[2]).unlink()
    with pytest.raises(PackFormatError) as raised:
        packdata.convert(clean_folder, dst, resume=True, **_OPTIONS)
    assert str(raised.value) == (
        f"{partial_path(dst) / 'out-00002-of-00004.tfrecord'}: the interrupted conversion's shard is missing. "
        "Start the conversion again with overwrite=True"
    )
    assert (partial_path(dst) / "manifest.json").is_file() and not dst.exists()


@pytest.mark.ray
@pytest.mark.parametrize("overwrite", [False, True])
def test_ray_resume_after_the_new_manifest_is_up_only_removes_the_replaced_objects_never_unpublishing(
    ray_local, s3, clean_folder: Path, tmp_path: Path, monkeypatch, overwrite: bool
) -> None:
    """A Ray publish that failed after the new manifest was up (an old object's DELETE refused) said to resume;
    the resume refused the pack at the URL without overwrite=True, and with it deleted the new pack's manifest and
    put it again. Now the resume keeps it, runs no task, uploads nothing and removes the rest of the old pack."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    url, root = f"s3://packs/ray-finish-removal-{overwrite}.lmdb", f"packs/ray-finish-removal-{overwrite}.lmdb"
    packdata.convert(clean_folder, url, shard_samples=5, storage_options=options, progress=False)  # 8 shards
    old = f"/{root}/shard-00007.lmdb/data.mdb"
    run = {"shard_samples": 20, "progress": False, "engine": "ray"}
    result, sent, published = _resume_a_refused_removal(
        clean_folder, url, s3, old, resume=True, overwrite=overwrite, **run
    )
    assert result.resumed and result.packed_before == result.packed == cases.N_CLASSES * cases.PER_CLASS + 1
    rest = [("DELETE", old), ("DELETE", old.replace("data.mdb", "records.i64"))]  # the rest of the old shard
    assert sent == rest  # no task ran, nothing uploaded again; the new manifest never removed nor put again
    fs.invalidate_cache()
    assert fs.cat_file(f"{root}/manifest.json") == published
    local = packdata.convert(clean_folder, tmp_path / "local" / url.rsplit("/", 1)[1], **{**run, "engine": "local"})
    assert sorted(p.removeprefix(f"{root}/") for p in fs.find(root)) == cases._files(local.pack)
    assert not any(p.is_file() for p in (tmp_path / "work").rglob("*"))  # the work folder is gone


@pytest.mark.ray
def test_ray_finishing_never_reads_the_plan_again_after_its_check(
    ray_local, clean_folder: Path, tmp_path: Path, monkeypatch
) -> None:
    """The finishing record was added to the plan read again whole, unbounded, after _prepare_partial had checked
    it: a file put in its place while the tasks ran (here a sparse 64 MiB one) was read into memory and failed
    as a raw JSONDecodeError. The plan as checked is passed down: the driver writes its own over that file."""
    from packdata.conversion import ray as ray_engine

    real_gather = ray_engine._gather
    plan = partial_path(tmp_path / "out") / "ray-plan.json"

    def gather_then_replace_the_plan(*args, **kwargs):
        gatherer = real_gather(*args, **kwargs)
        plan.unlink()
        with open(plan, "wb") as f:
            f.truncate(64 << 20)
        return gatherer

    monkeypatch.setattr(ray_engine, "_gather", gather_then_replace_the_plan)
    result = packdata.convert(clean_folder, tmp_path / "out", **_OPTIONS)
    reference = packdata.convert(clean_folder, tmp_path / "ref" / "out", **{**_OPTIONS, "engine": "local"})
    assert result.packed == reference.packed == cases.N_CLASSES * cases.PER_CLASS + 1
    _assert_equal_packs(tmp_path / "ref" / "out", tmp_path / "out")
