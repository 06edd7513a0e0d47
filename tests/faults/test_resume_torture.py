"""Kill a conversion at every checkpoint boundary and at random instants; ``--resume`` gives the clean pack.

The kills are real SIGKILLs of real processes (see ``resume_driver.py``): right
after and right before every ``os.replace`` of a run (each checkpoint save,
TFRecord shard rename, manifest write and the publish rename), chains of such
kills on one destination (a run killed, the resumed run killed, ...), and
SIGKILLs from outside at seeded random times. Every resumed pack must equal the
uninterrupted one: records (key, bytes, label), index, skip report, manifest
counts, and ``verify_pack`` must pass.
"""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import IMAGE_EXTS, expected_samples, image_bytes

from packdata import LMDBDataset, TFRecordIndexedDataset, verify_pack
from packdata.conversion.destination import partial_path
from packdata.pack.manifest import manifest_checksum, read_manifest

DRIVER = Path(__file__).with_name("resume_driver.py")
REPO = Path(__file__).parents[2]
DST_NAME = {"lmdb": "out.lmdb", "tfrecord": "out.tfrecord"}
INDEX_FILES = ("labels.i32", "sizes.i64", "keys.utf8", "key_offsets.i64")


@pytest.fixture
def small_source(tmp_path: Path) -> Path:
    """3 classes x 9 tiny JPEGs, one at the root, and four files that are skipped for four reasons."""
    root = tmp_path / "src"
    for c in range(3):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(9):
            (root / f"c{c}" / f"{i:02d}.jpg").write_bytes(image_bytes(50 * c + i, size=(8, 6)))
    (root / "top.jpg").write_bytes(image_bytes(7, size=(8, 6)))
    (root / "c0" / "03x.jpg").write_bytes(b"\xff\xd8\xff not a jpeg")  # corrupt image
    (root / "c1" / "04x.jpg").write_bytes(b"")  # empty
    (root / "c1" / ".hidden.jpg").write_bytes(image_bytes(3))  # hidden
    (root / "c2" / "notes.txt").write_text("not an image")  # not image
    return root


def _drive(tmp_path: Path, src: Path, fmt: str, scenarios: list[dict[str, Any]], **plan: Any) -> list[list[str]]:
    """Run the kill driver over ``scenarios``; the outcome of every run, per scenario."""
    path = tmp_path / f"plan-{len(list(tmp_path.glob('plan-*')))}.json"
    path.write_text(
        json.dumps(
            {"src": str(src), "format": fmt, "shard_samples": 4, "commit_samples": 2, "scenarios": scenarios, **plan}
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(DRIVER), str(path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    outcomes = json.loads(proc.stdout.splitlines()[-1])
    assert all(set(runs) <= {"killed", "done"} for runs in outcomes), proc.stderr[-4000:]
    return outcomes


def _content(pack: Path, fmt: str) -> dict[str, Any]:
    """Everything a reader can see of a pack, for comparison."""
    ds = LMDBDataset(pack, decode="bytes") if fmt == "lmdb" else TFRecordIndexedDataset(pack, decode="bytes")
    manifest = read_manifest(pack)
    return {
        "records": [(ds.keys[i], *ds[i]) for i in range(len(ds))],
        "index": {name: (pack / "index" / name).read_bytes() for name in INDEX_FILES},
        "skip_report": (pack / "skipped.jsonl").read_bytes(),
        "num_samples": manifest.num_samples,
        "skipped": manifest.skipped,
        "source": manifest.source,
        "shards": [(s.file, s.num_samples, s.first_index) for s in manifest.shards],
        "files": sorted(p.name for p in pack.iterdir() if p.name not in {"index"}),
    }


def _check_all(
    tmp_path: Path, fmt: str, scenarios: list[dict[str, Any]], outcomes: list[list[str]], clean: dict[str, Any]
) -> int:
    """Every scenario's pack equals the clean one; returns how many kills landed."""
    kills = 0
    reference = json.loads((tmp_path / f"clean-{fmt}").with_suffix(".result").read_text())
    for scenario, runs in zip(scenarios, outcomes, strict=True):
        dst = Path(scenario["dst"])
        where = f"{scenario['kills']} -> {runs}"
        assert set(runs) <= {"killed", "done"}, where
        kills += runs.count("killed")
        assert dst.is_dir() and not partial_path(dst).exists(), where
        if runs[-1] == "done":  # a run that finishes leaves no lock file (a killed one may: it is taken over)
            assert not (dst.parent / f".{dst.name}.lock").exists(), where
        assert _content(dst, fmt) == clean, where
        verify_pack(dst, progress=False)
        result_file = Path(f"{dst}.result.json")
        if result_file.exists():  # the summary of the run that finished: nothing lost, nothing hidden
            result = json.loads(result_file.read_text())
            for name in ("found", "packed", "skipped"):
                assert result[name] == reference[name], (name, where)
    return kills


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_kill_anywhere_then_resume_gives_the_clean_pack(small_source: Path, tmp_path: Path, fmt: str) -> None:
    # An uninterrupted run through the same driver: the reference, and how many replaces a run makes.
    clean_dst = tmp_path / "clean" / DST_NAME[fmt]
    clean_dst.parent.mkdir()
    assert _drive(tmp_path, small_source, fmt, [{"dst": str(clean_dst), "kills": [["after", 0]]}]) == [["done"]]
    clean_result = json.loads(Path(f"{clean_dst}.result.json").read_text())
    (tmp_path / f"clean-{fmt}.result").write_text(json.dumps(clean_result))
    clean = _content(clean_dst, fmt)
    expected = expected_samples(small_source, IMAGE_EXTS)
    del expected["c0/03x.jpg"]  # the corrupt one
    assert {k: (data, label) for k, data, label in clean["records"]} == expected
    assert clean_result["found"] == clean_result["packed"] + sum(clean_result["skipped"].values()) == 32
    events = clean_result["replace_calls"]
    assert events > 20  # checkpoints are frequent: tiny shards and commits

    rng = random.Random(f"resume-torture-{fmt}")
    plans: list[list[list[Any]]] = []
    plans += [[["after", n]] for n in range(1, events + 1)]  # right after every checkpoint, rename, publish
    plans += [[["before", n]] for n in range(1, events + 1)]  # right before each: the work in between is lost
    plans.append([["after", 1]] * (events + 2))  # every run killed after its first save, until done
    plans.append([["before", 2]] * (events + 2))  # every run killed after one save, before the next
    plans += [[["after", rng.randint(1, 6)] for _ in range(4)] for _ in range(4)]  # mixed chains
    plans.append([["at", rng.uniform(0.005, 0.15)] for _ in range(12)])  # random instants, from outside
    plans += [[["at", rng.uniform(0.005, 0.15)]] for _ in range(6)]
    scenarios = []
    for number, kills in enumerate(plans):
        (tmp_path / f"s{number}").mkdir()
        scenarios.append({"dst": str(tmp_path / f"s{number}" / DST_NAME[fmt]), "kills": kills})
    outcomes = _drive(tmp_path, small_source, fmt, scenarios)
    kills = _check_all(tmp_path, fmt, scenarios, outcomes, clean)
    assert kills >= 4 * events  # the kills landed (a kill past a run's last replace lets it finish)


def _edit_manifest(pack: Path, edit: Any) -> None:
    path = pack / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    data["checksum"] = manifest_checksum(data)
    path.write_text(json.dumps(data))


def test_verify_names_a_pack_whose_counts_disagree(small_source: Path, tmp_path: Path) -> None:
    from packdata import PackFormatError, convert

    pack = tmp_path / "out.lmdb"
    convert(small_source, pack, progress=False)
    verify_pack(pack, progress=False)
    # What an interrupted run used to publish: a file counted, its sample nowhere, no skip.
    _edit_manifest(pack, lambda m: m["source"].update(files_found=m["source"]["files_found"] + 1))
    with pytest.raises(PackFormatError, match=r"manifest\.json: .*counted 33 source files.*28 samples and 4 skips"):
        verify_pack(pack, progress=False)
    _edit_manifest(pack, lambda m: m["source"].update(files_found=m["source"]["files_found"] - 1))
    lines = (pack / "skipped.jsonl").read_bytes().splitlines(keepends=True)
    (pack / "skipped.jsonl").write_bytes(b"".join(lines[1:]))  # a skip the report does not list
    with pytest.raises(PackFormatError, match=r"skipped\.jsonl: skip report lists 3 files, the manifest counts 4"):
        verify_pack(pack, progress=False)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_driver_killed_then_resumed_gives_the_clean_pack(small_source: Path, tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'packdata[ray]')")
    rng = random.Random("resume-torture-ray")
    for fmt in ("tfrecord", "lmdb"):
        clean_dst = tmp_path / f"clean-{fmt}" / DST_NAME[fmt]
        clean_dst.parent.mkdir()
        clean_run = [{"dst": str(clean_dst), "kills": [["after", 0]]}]
        assert _drive(tmp_path, small_source, fmt, clean_run, engine="ray") == [["done"]]
        (tmp_path / f"clean-{fmt}.result").write_text(Path(f"{clean_dst}.result.json").read_text())
        clean = _content(clean_dst, fmt)
        # After the first rename of the finishing steps (a TFRecord shard, or the LMDB manifest),
        # and at a random instant while tasks run.
        plans = [[["after", 1]], [["at", rng.uniform(1.0, 4.0)]]]
        if fmt == "tfrecord":  # killed while deleting the task results, one index fragment already gone
            plans.append([["tasks-rmtree", 0]])
        scenarios = []
        for number, kills in enumerate(plans):
            (tmp_path / f"ray-{fmt}-{number}").mkdir()
            scenarios.append({"dst": str(tmp_path / f"ray-{fmt}-{number}" / DST_NAME[fmt]), "kills": kills})
        outcomes = _drive(tmp_path, small_source, fmt, scenarios, engine="ray")
        assert _check_all(tmp_path, fmt, scenarios, outcomes, clean) >= 1


def _grouped_source(root: Path) -> Path:
    """24 image + caption (+ mask) groups, one with a corrupt image, one without its caption."""
    root.mkdir()
    for i in range(24):
        (root / f"{i:03d}.jpg").write_bytes(image_bytes(i, size=(8, 6)) if i != 5 else b"\xff\xd8\xff broken")
        if i != 9:
            (root / f"{i:03d}.txt").write_text(f"caption {i}")
        if i % 3 == 0:
            (root / f"{i:03d}.seg.png").write_bytes(image_bytes(100 + i, size=(8, 6), fmt="PNG"))
    return root


def _tar_source(root: Path) -> str:
    import tarfile

    root.mkdir()
    for shard in range(3):
        with tarfile.open(root / f"data-{shard:06d}.tar", "w") as tar:
            for i in range(8):
                for field, data in (("jpg", image_bytes(shard * 8 + i, size=(8, 6))), ("txt", b"t%d" % i)):
                    info = tarfile.TarInfo(f"s{shard}/{i:03d}.{field}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return str(root / "data-{000000..000002}.tar")


def _fields_content(pack: Path, fmt: str = "lmdb") -> dict[str, Any]:
    ds = LMDBDataset(pack, decode="bytes") if fmt == "lmdb" else TFRecordIndexedDataset(pack, decode="bytes")
    manifest = read_manifest(pack)
    return {
        "records": [ds[i] for i in range(len(ds))],
        "index": sorted((p.name, p.read_bytes()) for p in (pack / "index").iterdir()),
        "skip_report": (pack / "skipped.jsonl").read_bytes(),
        "manifest": {k: v for k, v in manifest.to_dict().items() if k not in ("packdata_version", "shards")},
        # LMDB pages of records cut back at a resume are reused, not freed: bytes and checksums may differ
        "shards": [
            (s.file, s.num_samples, s.first_index) + ((s.bytes, s.sha256) if fmt == "tfrecord" else ())
            for s in manifest.shards
        ],
        "files": sorted(p.name for p in pack.iterdir()),
    }


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["grouped", "tars"])
def test_multi_field_sources_killed_then_resumed_give_the_clean_pack(tmp_path: Path, layout: str) -> None:
    src = str(_grouped_source(tmp_path / "src")) if layout == "grouped" else _tar_source(tmp_path / "src")
    clean_dst = tmp_path / "clean" / "out.lmdb"
    clean_dst.parent.mkdir()
    assert _drive(tmp_path, Path(src), "lmdb", [{"dst": str(clean_dst), "kills": [["after", 0]]}]) == [["done"]]
    clean = _fields_content(clean_dst)
    events = json.loads(Path(f"{clean_dst}.result.json").read_text())["replace_calls"]
    assert events > 10 and len(clean["records"]) == (23 if layout == "grouped" else 24)
    rng = random.Random(f"resume-torture-{layout}")
    plans: list[list[list[Any]]] = [[["after", n]] for n in range(1, events + 1)]
    plans += [[["before", n]] for n in range(1, events + 1, 2)]
    plans += [[["at", rng.uniform(0.005, 0.1)] for _ in range(6)] for _ in range(3)]
    scenarios = []
    for number, kills in enumerate(plans):
        (tmp_path / f"s{number}").mkdir()
        scenarios.append({"dst": str(tmp_path / f"s{number}" / "out.lmdb"), "kills": kills})
    outcomes = _drive(tmp_path, Path(src), "lmdb", scenarios)
    for scenario, runs in zip(scenarios, outcomes, strict=True):
        dst = Path(scenario["dst"])
        assert dst.is_dir() and not partial_path(dst).exists(), runs
        got = _fields_content(dst)
        for part in clean:
            assert got[part] == clean[part], (part, scenario["kills"], runs, got[part] if part == "manifest" else "")
        verify_pack(dst, progress=False)
    assert sum(runs.count("killed") for runs in outcomes) >= events


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_tfrecord_grouped_conversion_killed_between_a_shard_close_and_its_checkpoint_resumes_to_the_clean_pack(
    tmp_path: Path,
) -> None:
    """A multi-field TFRecord conversion (a grouped folder: Examples of several fields, a record table without
    spans) SIGKILLed once each shard is closed (its index and record table's header written) but before the
    checkpoint listing it is saved, once per shard and chained, then around every third replace: each resume
    gives the uninterrupted run's pack, shards byte for byte."""
    src = _grouped_source(tmp_path / "src")
    clean_dst = tmp_path / "clean" / "out.tfrecord"
    clean_dst.parent.mkdir()
    assert _drive(tmp_path, src, "tfrecord", [{"dst": str(clean_dst), "kills": [["after", 0]]}]) == [["done"]]
    clean = _fields_content(clean_dst, "tfrecord")
    events = json.loads(Path(f"{clean_dst}.result.json").read_text())["replace_calls"]
    assert len(clean["records"]) == 23 and len(clean["shards"]) == 6
    plans: list[list[list[Any]]] = [[["closed", n]] for n in range(1, 7)]  # the 6th: the last, closed by finish
    plans.append([["closed", 1]] * 4)  # 4 runs, each killed after its first close (of the shard it resumed)
    plans += [[[side, n]] for n in range(1, events + 1, 3) for side in ("after", "before")]  # and in between
    scenarios = []
    for number, kills in enumerate(plans):
        (tmp_path / f"s{number}").mkdir()
        scenarios.append({"dst": str(tmp_path / f"s{number}" / "out.tfrecord"), "kills": kills})
    outcomes = _drive(tmp_path, src, "tfrecord", scenarios)
    assert all(runs[0] == "killed" for runs in outcomes[:7]), outcomes[:7]  # each kill at a close landed
    for scenario, runs in zip(scenarios, outcomes, strict=True):
        dst = Path(scenario["dst"])
        assert dst.is_dir() and not partial_path(dst).exists(), runs
        got = _fields_content(dst, "tfrecord")
        for part in clean:
            assert got[part] == clean[part], (part, scenario["kills"], runs)
        verify_pack(dst, progress=False)
