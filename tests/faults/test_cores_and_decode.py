"""One usable-cores rule for doctor and recommend_loader_kwargs; one decode vocabulary for bench and tune."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

import packdata
from packdata.cli import main
from packdata.errors import ConfigError
from packdata.host.cores import usable_cores
from packdata.host.facts import CgroupMemory, MemoryInfo, SystemFacts, gather_facts
from packdata.measure.bench import run_bench
from packdata.measure.tune import recommend_loader_kwargs, run_tune
from packdata.staging.doctor import doctor

GiB = 1 << 30


def _smt_host(tmp: Path, allowed: str, *, cpu_max: str = "max 100000") -> Path:
    """A fake root: a 16-core host with 2 hyperthreads per core (CPU n and n + 16 are siblings), 64 GiB."""
    root = tmp / "fakeroot"
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "meminfo").write_text("MemTotal: 67108864 kB\nMemAvailable: 62914560 kB\n")
    (root / "proc" / "self" / "status").write_text(f"Name:\tpython\nCpus_allowed_list:\t{allowed}\n")
    (root / "proc" / "self" / "cgroup").write_text("0::/job\n")
    (root / "proc" / "self" / "mounts").write_text("/dev/vda1 / ext4 rw 0 0\n")
    job = root / "sys" / "fs" / "cgroup" / "job"
    job.mkdir(parents=True)
    (job / "cpu.max").write_text(f"{cpu_max}\n")
    for cpu in range(32):
        topology = root / "sys" / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{cpu % 16}\n")
    return root


@pytest.mark.parametrize(
    ("allowed", "cpu_max", "cores"),
    [
        ("0-7", "max 100000", 8),  # 8 CPUs on 8 distinct cores
        ("0-3,16-19", "max 100000", 4),  # 8 CPUs, hyperthread pairs of 4 cores
        ("0-31", "max 100000", 16),  # the whole host
        ("0-31", "250000 100000", 2),  # a cgroup quota of 2.5 CPUs caps the cpuset
    ],
)
def test_doctor_and_recommend_loader_kwargs_count_the_same_cores(
    tmp_path: Path, allowed: str, cpu_max: str, cores: int
) -> None:
    root = _smt_host(tmp_path, allowed, cpu_max=cpu_max)
    report = doctor(root=root, include_gpus=False)
    kwargs = recommend_loader_kwargs(None, batch_size=4, memory_budget=64 * GiB, root=root)
    assert report.cores == usable_cores(root=root) == cores
    assert report.num_workers == kwargs["num_workers"] == max(1, 3 * cores // 4)
    assert f"3/4 of {cores} usable physical cores" in report.reasons[0]


def test_cores_fall_back_to_threads_per_core_without_a_topology(tmp_path: Path) -> None:
    facts = SystemFacts(MemoryInfo(64 * GiB, 60 * GiB), CgroupMemory(None, None), cpu_physical=16, cpu_logical=32)
    facts.cpus_allowed = 8  # no topology: 8 CPUs at 2 threads per core are taken for 4 cores
    assert usable_cores(facts) == 4
    facts.cpu_quota = 1.5
    assert usable_cores(facts) == 1


def test_the_real_machine_has_at_least_one_usable_core() -> None:
    facts = gather_facts(include_gpus=False)
    assert facts.cpus_allowed is None or facts.cpus_allowed >= 1
    assert 1 <= usable_cores(facts) <= max(facts.cores_allowed or 1, facts.cpu_physical)


@pytest.fixture
def pack(image_folder: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "images.lmdb"
    packdata.convert(image_folder, dst, progress=False)
    return dst


def test_bench_and_tune_say_bytes_and_reject_none(pack: Path) -> None:
    result = run_bench(pack, workers=0, batch_sizes=2, batches=1, warmup=0, decode="bytes")
    assert [r.error for r in result.results] == [None, None] and result.settings["decode"] == "bytes"
    with pytest.raises(ConfigError, match=r"decode should be 'bytes', 'pil', 'reduced', 'crop' or a callable.*'none'"):
        run_bench(pack, workers=0, batch_sizes=2, batches=1, decode="none")
    with pytest.raises(ConfigError, match=r"but got decode='none'"):
        run_tune(pack, memory_budget=GiB, batch_sizes=(2,), batches=1, decode="none")


def test_cli_decode_choices_are_bytes_pil_reduced(pack: Path) -> None:
    ok = CliRunner().invoke(main, ["bench", str(pack), "--workers", "0", "--batch-size", "2", "--batches", "1"])
    assert ok.exit_code == 0, ok.output
    for command in ("bench", "tune"):
        bad = CliRunner().invoke(main, [command, str(pack), "--decode", "none"])
        assert bad.exit_code == 2
        assert "'none' is not one of 'bytes', 'pil', 'reduced'" in bad.output
    good = CliRunner().invoke(
        main, ["bench", str(pack), "--decode", "bytes", "--workers", "0", "--batch-size", "2", "--batches", "1"]
    )
    assert good.exit_code == 0, good.output


def test_doctor_shows_the_allowed_cpus_and_the_quota(tmp_path: Path) -> None:
    root = _smt_host(tmp_path, "0-7", cpu_max="250000 100000")
    text = "\n".join(doctor(root=root, include_gpus=False).lines())
    assert "logical (8 allowed), cgroup quota 2.5 CPUs, 2 usable" in text
