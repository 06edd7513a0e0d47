"""packdata doctor: facts and warnings from crafted /proc and /sys trees, pack checks, the CLI."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

import packdata
from packdata.cli import main
from packdata.host.cores import WORKER_BYTES
from packdata.pack.manifest import read_manifest, write_manifest
from packdata.staging.doctor import doctor
from packdata.staging.stage import stage

GiB, MiB = 1 << 30, 1 << 20


def _root(
    tmp: Path,
    *,
    total: int,
    available: int,
    swap_total: int = 0,
    swap_free: int = 0,
    cgroup_limit: int | None = None,
    cgroup_usage: int = 0,
    mounts: str = "",
) -> Path:
    """A fake filesystem root with proc/meminfo, proc/self/cgroup (v2), sys/fs/cgroup and mounts."""
    root = tmp / "fakeroot"
    (root / "proc" / "self").mkdir(parents=True)
    kb = 1024
    (root / "proc" / "meminfo").write_text(
        f"MemTotal: {total // kb} kB\nMemFree: {available // kb} kB\nMemAvailable: {available // kb} kB\n"
        f"Shmem: 1024 kB\nSwapTotal: {swap_total // kb} kB\nSwapFree: {swap_free // kb} kB\n"
    )
    (root / "proc" / "self" / "cgroup").write_text("0::/job/step\n")
    step = root / "sys" / "fs" / "cgroup" / "job" / "step"
    step.mkdir(parents=True)
    (step / "memory.max").write_text("max\n")
    (step / "memory.current").write_text(f"{cgroup_usage}\n")
    (step.parent / "memory.max").write_text(f"{cgroup_limit}\n" if cgroup_limit else "max\n")
    (step.parent / "memory.current").write_text(f"{cgroup_usage}\n")
    (root / "proc" / "self" / "mounts").write_text(mounts or "/dev/vda1 / ext4 rw 0 0\n")
    return root


@pytest.fixture
def tf_pack(image_folder: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "data" / "train"
    packdata.convert(image_folder, dst, format="tfrecord", shard_samples=4, progress=False)
    return dst


def test_healthy_machine_has_no_memory_warnings(tmp_path: Path) -> None:
    root = _root(tmp_path, total=64 * GiB, available=60 * GiB)
    report = doctor(root=root, include_gpus=False)
    assert report.warnings == []
    assert report.facts.memory.mem_available == 60 * GiB
    cores = report.cores
    assert report.num_workers == max(1, 3 * cores // 4)
    assert report.pin_memory is False and "no CUDA GPU" in report.reasons[1]
    json.dumps(report.to_dict())


def test_pressure_swap_and_cgroup_limit_warn(tmp_path: Path) -> None:
    root = _root(
        tmp_path,
        total=64 * GiB,
        available=2 * GiB,
        swap_total=8 * GiB,
        swap_free=4 * GiB,
        cgroup_limit=16 * GiB,
        cgroup_usage=16 * GiB - 200 * MiB,
    )
    report = doctor(root=root, include_gpus=False)
    codes = [w.code for w in report.warnings]
    assert "oom-near" in codes and "cgroup-limit" in codes
    cgroup = next(w for w in report.warnings if w.code == "cgroup-limit")
    assert "16.0 GiB" in cgroup.message and "64.0 GiB" in cgroup.message
    assert report.facts.cgroup.limit == 16 * GiB and report.facts.cgroup.version == 2
    # 200 MiB of cgroup headroom: half of it holds no 160 MiB worker
    assert report.num_workers == (100 * MiB) // WORKER_BYTES == 0
    assert "memory caps it" in report.reasons[0]
    text = "\n".join(report.lines())
    assert "warning [oom-near]" in text and "cgroup:   v2, limit 16.0 GiB" in text


def test_pack_on_network_fs_with_too_few_shards(tf_pack: Path, tmp_path: Path) -> None:
    mounts = f"/dev/vda1 / ext4 rw 0 0\nfiler:/export {tmp_path / 'data'} nfs4 rw,relatime 0 0\n"
    root = _root(tmp_path, total=64 * GiB, available=60 * GiB, mounts=mounts)
    report = doctor(tf_pack, ranks=4, workers=2, root=root, include_gpus=False)
    assert report.pack is not None
    assert report.pack.shards == 5 and report.pack.readers == 8
    assert report.pack.fstype == "nfs4" and report.pack.network is True
    codes = {w.code for w in report.warnings}
    assert {"few-shards", "network-fs"} <= codes
    few = next(w for w in report.warnings if w.code == "few-shards")
    assert "5 shards for 8 readers (4 ranks x 2 workers)" in few.message and "at least 16" in few.message
    net = next(w for w in report.warnings if w.code == "network-fs")
    assert f"packdata stage {tf_pack}" in net.message


def test_uneven_and_skewed_shards(tf_pack: Path, tmp_path: Path) -> None:
    root = _root(tmp_path, total=64 * GiB, available=60 * GiB)
    report = doctor(tf_pack, ranks=2, workers=1, root=root, include_gpus=False)
    assert "uneven-shards" in {w.code for w in report.warnings}  # 5 shards among 2 readers
    manifest = read_manifest(tf_pack)
    manifest.shards[1] = dataclasses.replace(manifest.shards[1], bytes=manifest.shards[1].bytes * 10)
    write_manifest(tf_pack, manifest)
    report = doctor(tf_pack, ranks=1, workers=1, root=root, include_gpus=False)
    skew = next(w for w in report.warnings if w.code == "shard-skew")
    assert report.pack is not None and report.pack.skew > 5
    assert "--shard-size" in skew.message


def test_partly_staged_pack_is_reported(tf_pack: Path, tmp_path: Path) -> None:
    result = stage(tf_pack, to=tmp_path / "nvme", shards=[0], progress=False)
    root = _root(tmp_path, total=64 * GiB, available=60 * GiB)
    report = doctor(result.staged, root=root, include_gpus=False)
    assert report.pack is not None
    assert report.pack.staged_from == os.fspath(tf_pack.resolve()) and report.pack.shards_elsewhere == 4
    assert "partly-staged" in {w.code for w in report.warnings}


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="ranks should be at least 1, but got ranks=0"):
        doctor(ranks=0)
    with pytest.raises(packdata.PackFormatError, match="no such pack"):
        doctor(tmp_path / "missing", include_gpus=False)


def test_cli_doctor_prints_counts_as_every_command_does(tmp_path: Path) -> None:
    """It printed '(lmdb, 1001 samples, ...)' and 'shards:   1 for 1 readers'."""
    notes = tmp_path / "src" / "notes"
    notes.mkdir(parents=True)
    for i in range(1001):
        (notes / f"{i:04d}.txt").write_text(f"note {i}")
    packdata.convert(tmp_path / "src", tmp_path / "p.lmdb", progress=False)
    out = CliRunner().invoke(main, ["doctor", os.fspath(tmp_path / "p.lmdb"), "--workers", "1"])
    assert out.exit_code == 0, out.output
    assert "(lmdb, 1,001 samples, " in out.output and "shards:   1 for 1 reader; sizes " in out.output, out.output


def test_cli_doctor(tf_pack: Path) -> None:
    runner = CliRunner()
    out = runner.invoke(main, ["doctor", os.fspath(tf_pack), "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["pack"]["shards"] == 5 and "num_workers" in data["recommended"]
    out = runner.invoke(main, ["doctor", os.fspath(tf_pack), "--ranks", "2"])
    assert out.exit_code == 0 and "start with: DataLoader(" in out.output and "memory:" in out.output
    out = runner.invoke(main, ["doctor", "/nonexistent/pack"])
    assert out.exit_code == 1 and out.output.startswith("Error: ")
    out = runner.invoke(main, ["doctor", "s3://key:secret@bucket/train.lmdb"])  # once 'no such pack' at 's3:/...'
    assert out.exit_code == 1 and out.output == (
        "Error: s3://bucket/train.lmdb: doctor looks at a pack on this machine's disks (its file system and "
        "shards). Stage it first (packdata stage s3://bucket/train.lmdb --to DIR) and run doctor on the staged copy\n"
    )


def test_doctor_warns_of_more_ranks_than_samples(tmp_path: Path) -> None:
    """--ranks 8 for a pack of 6 samples said nothing: a DistributedSampler-style split pads each rank to one sample,
    so 2 samples are read twice each epoch (and drop_last leaves every rank none)."""
    (tmp_path / "src" / "notes").mkdir(parents=True)
    for i in range(6):
        (tmp_path / "src" / "notes" / f"{i}.txt").write_text(f"note {i}")
    pack = packdata.convert(tmp_path / "src", tmp_path / "p.lmdb", progress=False).pack
    said = (
        "warning [more-ranks-than-samples]: the pack holds 6 samples for 8 ranks: every epoch repeats 2 samples so "
        "that each rank reads one (with drop_last=True no rank reads any); run fewer ranks or pack more samples"
    )
    out = CliRunner().invoke(main, ["doctor", os.fspath(pack), "--ranks", "8"])
    assert out.exit_code == 0, out.output
    assert said in out.output.splitlines()
    for ranks in ("6", "1"):
        out = CliRunner().invoke(main, ["doctor", os.fspath(pack), "--ranks", ranks])
        assert out.exit_code == 0 and "more-ranks-than-samples" not in out.output, out.output
