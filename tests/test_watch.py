"""The training monitor: diagnoses from recorded measurements and controlled loops; the second-terminal view."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from torch.utils.data import DataLoader, Dataset

import packdata
from packdata.cli import main
from packdata.watch.diagnose import Measurements, diagnose

GiB = 1 << 30


def _m(**changes: float) -> Measurements:
    base = dict(
        wait_share=0.02,
        cpu_busy=0.3,
        iowait=0.01,
        num_workers=2,
        cores=8,
        mem_available=20 * GiB,
        mem_total=32 * GiB,
        swap_used=0,
        worker_private=GiB,
    )
    return Measurements(**{**base, **changes})  # type: ignore[arg-type]


def test_diagnoses_from_recorded_measurements() -> None:
    assert diagnose(_m()).kind == "compute-bound"
    io = diagnose(_m(wait_share=0.5, iowait=0.35))
    assert io.kind == "io-bound" and "packdata stage PACK --to /nvme/cache" in io.next_step
    cpu = diagnose(_m(wait_share=0.4, cpu_busy=0.95))
    assert cpu.kind == "data-bound" and "DecodeJPEG" in cpu.next_step
    idle = diagnose(_m(wait_share=0.41, cpu_busy=0.25))
    assert idle.kind == "data-bound" and idle.next_step.startswith("num_workers=8")
    assert "the step waits 41% of the time while 2 workers" in idle.message
    tight = diagnose(_m(wait_share=0.41, cpu_busy=0.25, mem_available=int(5.5 * GiB), worker_private=GiB))
    assert tight.next_step == "num_workers=4 (memory allows 4)"
    oom = diagnose(_m(mem_available=int(1.2 * GiB), swap_used=3 * GiB, num_workers=8))
    assert oom.kind == "memory" and "num_workers 8 -> 4 or pin_memory=False" in oom.next_step
    assert diagnose(_m(mem_available=GiB // 2, cgroup_limit=8 * GiB)).kind == "memory"  # 0.5 of an 8 GiB container


class _Instant(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> int:
        return i


class _Burning(_Instant):
    """Each sample burns 15 ms of CPU: one worker cannot keep up with a step that takes nothing."""

    def __getitem__(self, i: int) -> int:
        end = time.process_time() + 0.015
        while time.process_time() < end:
            pass
        return i


def test_a_slow_step_is_compute_bound(tmp_path: Path) -> None:
    stream = io.StringIO()
    watched = packdata.monitor(
        DataLoader(_Instant(), batch_size=4), every="0.05s", log=tmp_path / "l.jsonl", stream=stream
    )
    for _ in watched:
        time.sleep(0.03)  # the step: far longer than loading a batch
    summary = watched.summaries[0]
    assert summary.steps == 16 and summary.samples == 64 and summary.wait_share < 0.1
    assert summary.diagnosis is not None and summary.diagnosis.kind == "compute-bound"
    records = [json.loads(line) for line in (tmp_path / "l.jsonl").read_text().splitlines()]
    assert records[-1]["type"] == "epoch" and {r["type"] for r in records[:-1]} == {"period"}
    assert "diagnosis: compute-bound" in stream.getvalue()


def test_a_cpu_burning_dataset_with_one_worker_is_data_bound() -> None:
    stream = io.StringIO()
    watched = packdata.monitor(DataLoader(_Burning(), batch_size=4, num_workers=1), every="10s", stream=stream)
    assert sum(1 for _ in watched) == 16
    summary = watched.summaries[0]
    assert summary.wait_share > 0.5
    assert summary.diagnosis is not None and summary.diagnosis.kind == "data-bound", summary.diagnosis


_TRAINING = """
import time
import torch
from torch.utils.data import DataLoader, Dataset

class Data(Dataset):
    def __len__(self):
        return 10_000
    def __getitem__(self, i):
        return torch.zeros(2000)

print("ready", flush=True)
for _ in DataLoader(Data(), batch_size=8, num_workers=2):
    time.sleep(0.01)
"""


def test_cli_monitor_finds_a_real_job_and_its_workers() -> None:
    job = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_TRAINING)], stdout=subprocess.PIPE, text=True)
    try:
        assert job.stdout is not None and job.stdout.readline().strip() == "ready"
        time.sleep(1.5)  # the workers start
        out = CliRunner().invoke(main, ["monitor", str(job.pid), "--count", "2", "--interval", "0.3", "--json"])
        assert out.exit_code == 0, out.output
        samples = [json.loads(line) for line in out.output.splitlines()]
        last = samples[-1]
        workers = [p for p in last["processes"] if p["role"] == "worker"]
        assert last["pid"] == job.pid and len(workers) == 2
        assert all(p["private"] > 0 for p in last["processes"]) and last["mem_available"] > 0
        lines = CliRunner().invoke(main, ["monitor", str(job.pid), "--count", "1", "--interval", "0.2"])
        assert "2 workers, private" in lines.output and "cpu" in lines.output
    finally:
        job.kill()
        job.wait()
    gone = CliRunner().invoke(main, ["monitor", "--name", "no-such-training-script-xyz.py"])
    assert gone.exit_code == 1 and "no running process has" in gone.output


def test_monitor_refuses_a_bad_period() -> None:
    with pytest.raises(packdata.ConfigError, match="every should be"):
        packdata.monitor([], every="soon")
