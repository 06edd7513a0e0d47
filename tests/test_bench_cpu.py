"""bench's CPU time per sample and the monitor's job CPU: every process of the tree counted, the ended ones whole
and once."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import psutil
import pytest
import torch
from torch.utils.data import Dataset

from packdata.host.processes import tree_cpu_seconds
from packdata.measure.loop import LoaderConfig, measure_loader
from packdata.measure.memory import _MemorySampler

_BURN_AND_EXIT = """
import time
end = time.process_time() + 0.3
while time.process_time() < end:
    pass
"""


def test_cpu_seconds_count_a_worker_that_started_and_ended_between_two_readings() -> None:
    """cpu_seconds() counted a worker only as last seen at a reading or a memory sample, so a worker that
    started and ended between two (an epoch shorter than the sampling interval, workers not persistent) was
    not counted at all, and one seen once lost what it spent after. Its parent's children's times hold it."""
    sampler = _MemorySampler()
    before = sampler.cpu_seconds()
    subprocess.run([sys.executable, "-c", _BURN_AND_EXIT], check=True)  # 0.3 s of CPU at least, then reaped
    assert sampler.cpu_seconds() - before >= 0.3


class _Burns(Dataset):
    """Each sample costs ``ms`` of CPU in the process that reads it."""

    def __init__(self, samples: int, ms: float) -> None:
        self.samples, self.ms = samples, ms

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> torch.Tensor:
        end = time.process_time() + self.ms / 1000
        while time.process_time() < end:
            pass
        return torch.zeros(1)


@pytest.mark.timeout(120)
def test_bench_cpu_per_sample_counts_the_workers_of_epochs_that_ended_between_samples() -> None:
    """bench's cpu_ms_per_sample read low with short epochs (workers not persistent): the workers of each
    epoch that began and ended between two memory samples were never counted (here 3.6 ms for samples that
    cost 2 ms each in the workers and 6.0 ms in all by the kernel's count). With no memory sample in the timed
    window, every sample's 20 ms of CPU in its worker counts: at least half of it per sample, whatever batches
    were prefetched at the window's edges (at most one epoch's)."""
    dataset = _Burns(16, 20.0)  # 2 batches an epoch: 10 epochs, 20 workers started and ended in the window
    config = LoaderConfig(num_workers=2, batch_size=8, persistent_workers=False)
    result = measure_loader(dataset, config, batches=20, warmup=1, sample_interval=3600)
    assert result.samples == 160
    assert result.cpu_ms_per_sample >= 10


_BURN_THEN_WAIT = """
import sys, time
end = time.process_time() + 0.3
while time.process_time() < end:
    pass
print("burnt", flush=True)
sys.stdin.read()  # ends when its stdin closes
"""

_START_AND_REAP = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
print(child.stdout.readline().strip(), flush=True)
sys.stdin.readline()
child.stdin.close()
child.wait()  # this process reaps it: its times move into this process's children's times
print("reaped", flush=True)
sys.stdin.read()
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reaper", ["this process", "its parent"])
def test_a_process_reaped_while_the_tree_is_read_counts_once(reaper: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """tree_cpu_seconds read the running descendants from /proc, then the reaped ones' times: a worker read
    live and reaped by this process before its children's times were read counted twice (0.3 s of CPU counted
    0.6 s), and a fork server's worker reaped after the fork server was read and before the worker was, not at
    all. The tree is now read again while a process was reaped during a reading. A real process that burnt
    0.3 s of CPU ends and is reaped in the middle of a reading (by this process right after its times were
    read; by its parent, this process's child, right after the parent's were): that reading counts it once,
    as a reading after the reap does."""
    script = [sys.executable, "-c", _BURN_THEN_WAIT]
    if reaper == "its parent":
        script = [sys.executable, "-c", _START_AND_REAP, _BURN_THEN_WAIT]
    child = subprocess.Popen(script, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    assert child.stdout.readline().strip() == "burnt"
    reaped = []

    def reap() -> None:  # the burner ends and is reaped: by this process, or by its parent here a child of ours
        assert child.stdin is not None and child.stdout is not None
        if reaper == "this process":
            child.stdin.close()
            child.wait()
        else:
            child.stdin.write("\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "reaped"
        reaped.append(True)

    cpu_times = psutil.Process.cpu_times

    def read_then_reap(process: psutil.Process) -> Any:
        times = cpu_times(process)
        if process.pid == child.pid and not reaped:
            reap()
        return times

    try:
        monkeypatch.setattr(psutil.Process, "cpu_times", read_then_reap)
        while_reaped = tree_cpu_seconds(psutil.Process())
        monkeypatch.undo()
        after = tree_cpu_seconds(psutil.Process())
    finally:
        child.kill()
        child.wait()
    assert reaped == [True]
    assert after - 0.1 <= while_reaped <= after, (while_reaped, after)
