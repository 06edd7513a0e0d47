"""The training monitor: diagnoses from recorded measurements and controlled loops; the second-terminal view."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import psutil
import pytest
import torch
from click.testing import CliRunner
from held_cpu import cpu_held_by_another
from torch.utils.data import DataLoader, Dataset

import packdata
from packdata.cli import main
from packdata.host.gpus import nvml_gpus
from packdata.watch.diagnose import Diagnosis, Measurements, diagnose
from packdata.watch.loop import EpochSummary

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


def test_iowait_is_not_blamed_on_a_job_that_read_nothing_from_storage() -> None:
    """iowait is the machine's: 'io-bound: the pack's storage cannot keep up -> stage the pack' was said of a
    job whose every read hit the page cache while another process wrote a checkpoint."""
    cached = diagnose(_m(wait_share=0.5, iowait=0.35, read_bytes=0))
    assert cached.kind == "io-bound" and "the job read nothing from storage" in cached.message
    assert "packdata stage" not in cached.next_step and "find the process doing the I/O" in cached.next_step
    for read in (64 << 20, None):  # it read from storage, or its reads are unknown: stage the pack
        assert "packdata stage PACK" in diagnose(_m(wait_share=0.5, iowait=0.35, read_bytes=read)).next_step


def test_the_probe_counts_what_the_job_reads_from_storage_not_the_page_cache(tmp_path: Path) -> None:
    """The job's reads from storage (/proc/PID/io) since the previous sample, the figure the diagnosis needs."""
    from packdata.watch.probe import SystemProbe

    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(8 << 20))
    code = textwrap.dedent(
        f"""
        import os, sys
        for line in sys.stdin:
            fd = os.open({str(data)!r}, os.O_RDONLY)
            if line.strip() == "cold":
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache: read from the disk
            while os.read(fd, 1 << 20):
                pass
            os.close(fd)
            print("done", flush=True)
        """
    )
    job = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert job.stdin is not None and job.stdout is not None
    try:
        probe = SystemProbe(job.pid, gpus=False, packs=False)
        figures = []
        for how in ("cold", "cached"):
            job.stdin.write(how + "\n")
            job.stdin.flush()
            assert job.stdout.readline() == "done\n"
            figures.append(probe.sample().read_bytes)
    finally:
        job.kill()
        job.wait()
    if figures[0] == 0:
        pytest.skip(f"{tmp_path} is not on a block device the kernel counts reads of (tmpfs, a network filesystem)")
    assert figures[0] is not None and figures[0] >= 8 << 20 and figures[1] == 0


_READ_THEN_WAIT = """
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache: read from the disk
while os.read(fd, 1 << 20):
    pass
print("done", flush=True)
sys.stdin.read()
"""

_STARTS_A_WORKER = """
import subprocess, sys
worker = subprocess.Popen([sys.executable, "-c", *sys.argv[1:]], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
print(worker.stdout.readline().decode().strip(), flush=True)
sys.stdin.readline()
worker.stdin.close()
worker.wait()  # reaped: the kernel adds what it read to this process's /proc/PID/io
print("reaped", flush=True)
sys.stdin.read()
"""


def test_the_probe_counts_a_workers_reads_once_when_it_is_reaped(tmp_path: Path) -> None:
    """A worker's reads from storage counted in the sample that saw it running counted again in the next one
    once its parent reaped it: the kernel adds a reaped child's I/O to its parent's /proc/PID/io, and the probe
    summed each process's counter. The probe now reads the tree's total. A real job starts a worker that reads
    8 MiB from the disk, then reaps it between two samples: the second sample counts none of it."""
    from packdata.watch.probe import SystemProbe

    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(8 << 20))
    os.sync()  # written back: the worker's reads go to the disk once the pages are dropped
    job = subprocess.Popen(
        [sys.executable, "-c", _STARTS_A_WORKER, _READ_THEN_WAIT, str(data)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert job.stdin is not None and job.stdout is not None
    try:
        probe = SystemProbe(job.pid, gpus=False, packs=False)
        assert job.stdout.readline() == "done\n"
        running = probe.sample()
        job.stdin.write("\n")
        job.stdin.flush()
        assert job.stdout.readline() == "reaped\n"
        reaped = probe.sample()
    finally:
        job.kill()
        job.wait()
    if running.read_bytes == 0:
        pytest.skip(f"{tmp_path} is not on a block device the kernel counts reads of (tmpfs, a network filesystem)")
    assert running.read_bytes is not None and running.read_bytes >= 8 << 20
    assert reaped.read_bytes == 0


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


@pytest.mark.parametrize("collate", [None, list])
def test_samples_are_counted_whatever_the_collate(collate: Any) -> None:
    """A batch left a list of (sample, label) pairs (collate_fn=list) was counted by its first pair: 2
    samples a batch of 4, so every rate the monitor reported was half of the truth (32x at batch 64)."""
    pairs = [(torch.zeros(3), i) for i in range(16)]
    watched = packdata.monitor(DataLoader(pairs, batch_size=4, collate_fn=collate), every="60s", stream=io.StringIO())
    assert sum(1 for _ in watched) == 4
    assert watched.summaries[0].samples == 16


@pytest.mark.parametrize("collate", [None, list])
@pytest.mark.parametrize("kind", ["text", "dict", "image"])
def test_samples_that_are_strings_dicts_or_images_are_counted_one_each(kind: str, collate: Any) -> None:
    """A batch of strings (the default collate of text samples) was counted in characters, a list of dicts
    (collate_fn=list) by its first field's length, and a list of PIL images as one sample."""
    from PIL import Image

    make = {
        "text": lambda i: f"a text of some length {i}",
        "dict": lambda i: {"txt": b"x" * 1000, "cls": i},
        "image": lambda i: Image.new("RGB", (8, 8)),
    }[kind]
    if kind == "image" and collate is None:
        collate = lambda batch: batch  # noqa: E731 - the default collate cannot stack PIL images
    samples = [make(i) for i in range(16)]
    watched = packdata.monitor(DataLoader(samples, batch_size=4, collate_fn=collate), every="60s", stream=io.StringIO())
    assert sum(1 for _ in watched) == 4
    assert watched.summaries[0].samples == 16


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


def _start_slowly(worker_id: int) -> None:
    time.sleep(1)  # the worker's start-up (imports, opening files): far longer than all the steps after it


@pytest.mark.parametrize("persistent", [False, True])
def test_a_loop_that_waits_only_for_its_workers_to_start_is_named_start_up_not_data_bound(persistent: bool) -> None:
    """An epoch whose only wait was its first batch (the workers starting) was diagnosed data-bound ('decoding
    is the limit -> decode less', or more workers, which start slower still): its wait share counted the start.
    The wait after the first batch decides now; a start-up that recurs each epoch advises persistent workers."""
    stream = io.StringIO()
    loader = DataLoader(
        _Instant(), batch_size=4, num_workers=1, worker_init_fn=_start_slowly, persistent_workers=persistent
    )
    watched = packdata.monitor(loader, every=3600, stream=stream)
    for _ in watched:
        time.sleep(0.03)  # a step far longer than the worker takes for its next batch of 4 indices
    diagnosis = watched.summaries[0].diagnosis
    assert diagnosis is not None and diagnosis.kind == "start-up", diagnosis
    if persistent:
        assert diagnosis.next_step == (
            "the steps after the first do not wait: nothing to change per step (longer epochs amortise it)"
        )
    else:
        assert (
            diagnosis.next_step
            == "keep the workers from one epoch to the next: DataLoader(..., persistent_workers=True)"
        )
    assert "for the first batch and" in diagnosis.message and "diagnosis: start-up: the step waits" in stream.getvalue()


class _CollatedHere:
    """A loader wrapper that collates in the training process, after the workers: 30 ms of CPU a batch."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader, self.num_workers = loader, loader.num_workers

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            end = time.thread_time() + 0.03
            while time.thread_time() < end:
                pass
            yield batch


def test_a_loop_held_up_by_work_in_the_training_process_is_not_told_to_add_workers_or_decode_less() -> None:
    """A loop whose workers kept up while work done in the training process after them (a collate, a transform)
    held each step up was 'data-bound': 'decoding is the limit -> decode less' on busy CPUs, 'num_workers=N' on
    idle ones, neither of which helps. The monitor now times how long its own thread is runnable inside next():
    through half of the wait or more, it names the main process."""
    stream = io.StringIO()
    watched = packdata.monitor(
        _CollatedHere(DataLoader(_Instant(), batch_size=4, num_workers=1)), every=3600, stream=stream
    )
    assert sum(1 for _ in watched) == 16
    diagnosis = watched.summaries[0].diagnosis
    assert diagnosis is not None and diagnosis.kind == "main-process-bound", diagnosis
    assert "the training process was busy itself (computing, or waiting for its CPU) through" in diagnosis.message
    assert diagnosis.next_step == (
        "move that work into the workers (the dataset's __getitem__ or the DataLoader's collate_fn): more "
        "workers, or decoding less in them, would not help"
    )
    assert "diagnosis: main-process-bound: the step waits" in stream.getvalue()


class _Waiting(_Instant):
    def __getitem__(self, i: int) -> int:
        time.sleep(0.05)  # the worker waits on storage or the network, using no CPU
        return i

    def __len__(self) -> int:
        return 32


@pytest.mark.timeout(120)
def test_a_loop_whose_cpus_another_process_holds_is_not_told_to_decode_less() -> None:
    """A loop whose workers waited on something else than their CPU, on CPUs another process kept busy, was
    'data-bound: ... CPUs 100% busy: decoding is the limit -> decode less': the busy share is the CPUs', whoever
    uses them. The CPU time of the job's own processes now tells. Here the job runs on one CPU another process
    spins on."""
    stream = io.StringIO()
    with cpu_held_by_another():  # this thread, and the worker it forks
        watched = packdata.monitor(DataLoader(_Waiting(), batch_size=4, num_workers=1), every=3600, stream=stream)
        assert sum(1 for _ in watched) == 8
    diagnosis = watched.summaries[0].diagnosis
    assert diagnosis is not None and diagnosis.kind == "data-bound", diagnosis
    assert (
        "CPUs' worth: other processes keep the CPUs busy, and its workers wait on something else" in diagnosis.message
    )
    assert diagnosis.next_step == (
        "find what else runs on the job's CPUs (top, pidstat -u) and move it or give the job CPUs of its own; "
        "decoding less would not help"
    )


def test_an_epoch_shorter_than_the_period_reports_its_workers_and_their_memory() -> None:
    """An epoch that ended before its first period was summed up from one sample taken after the loop, when
    the workers had exited: 'epoch: ..., 0 workers' beside a diagnosis of '1 worker', and no per-worker
    memory for AdaptiveLoader's memory_budget check."""
    stream = io.StringIO()
    watched = packdata.monitor(DataLoader(_Instant(), batch_size=4, num_workers=1), every=3600, stream=stream)
    assert sum(1 for _ in watched) == 16
    epoch_line = stream.getvalue().splitlines()[0]
    assert epoch_line.startswith("epoch: 16 steps") and ", 1 worker, private " in epoch_line, epoch_line
    workers = [p for s in watched.summaries[0].snapshots for p in s.workers]
    assert workers and all(w.private > 0 for w in workers)


_TRAINING = """
import sys, time
from torch.utils.data import DataLoader, RandomSampler
import packdata

ds = packdata.LMDBDataset(sys.argv[1], decode="bytes")
sampler = RandomSampler(ds, replacement=True, num_samples=1_000_000)
for step, _ in enumerate(DataLoader(ds, batch_size=8, sampler=sampler, num_workers=2)):
    if step == 1:  # batches come in turn from workers 0 and 1: both have started and opened the pack
        print("ready", flush=True)
    time.sleep(0.01)
"""


def test_cli_monitor_finds_a_real_job_its_workers_and_its_staged_pack(tmp_path: Path) -> None:
    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    for i in range(4):
        (src / f"{i}.txt").write_text(f"doc {i}")
    packdata.convert(tmp_path / "src", tmp_path / "p.lmdb", progress=False)
    staged = packdata.stage(tmp_path / "p.lmdb", to=tmp_path / "fast", progress=False).staged
    job = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_TRAINING), str(staged)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert job.stdout is not None and job.stdout.readline().strip() == "ready"
        out = CliRunner().invoke(main, ["monitor", str(job.pid), "--count", "2", "--interval", "0.3", "--json"])
        assert out.exit_code == 0, out.output
        samples = [json.loads(line) for line in out.output.splitlines()]
        last = samples[-1]
        workers = [p for p in last["processes"] if p["role"] == "worker"]
        assert last["pid"] == job.pid and len(workers) == 2
        assert all(p["private"] > 0 for p in last["processes"]) and last["mem_available"] > 0
        assert {"path": str(staged), "staged": True, "origin": str((tmp_path / "p.lmdb").resolve())} in last["packs"]
        seen = [(g.index, g.name, g.total_bytes) for g in nvml_gpus() or []]  # [] without NVML: nothing breaks
        assert [(g["index"], g["name"], g["total_bytes"]) for g in last["gpus"]] == seen
        lines = CliRunner().invoke(main, ["monitor", str(job.pid), "--count", "1", "--interval", "0.2"])
        assert "2 workers, private" in lines.output and "cpu" in lines.output
    finally:
        job.kill()
        job.wait()
    gone = CliRunner().invoke(main, ["monitor", "--name", "no-such-training-script-xyz.py"])
    assert gone.exit_code == 1 and "no running process has" in gone.output


def test_monitor_escapes_a_packs_path_and_origin_on_a_terminal(tmp_path: Path) -> None:
    """The monitor's screen printed a pack's folder name and the origin from its staged.json (a stranger's pack
    may hold any) raw on the terminal: an escape sequence in them ran. Now they are quoted and escaped; only the
    screen's own redraw sequence reaches the terminal. A real job, and the monitor on a real pseudo-terminal."""
    import pty

    pack = tmp_path / "pack\x1b[31mred"
    pack.mkdir()
    (pack / "manifest.json").write_text("{}")
    (pack / "staged.json").write_text(json.dumps({"origin": "/data/\x1b]0;pwned\x07p.lmdb"}))
    (pack / "data.mdb").write_bytes(b"x")
    holds = f"f = open({str(pack / 'data.mdb')!r}, 'rb')\nprint('ready', flush=True)\nimport time\ntime.sleep(60)"
    job = subprocess.Popen([sys.executable, "-c", holds], stdout=subprocess.PIPE, text=True)
    leader, follower = pty.openpty()
    try:
        assert job.stdout is not None and job.stdout.readline() == "ready\n"
        monitor = [sys.executable, "-m", "packdata.cli", "monitor", str(job.pid), "--count", "1", "--interval", "0.2"]
        done = subprocess.run(monitor, stdout=follower, stderr=subprocess.PIPE, text=True, timeout=120)
        os.set_blocking(leader, False)
        screen = os.read(leader, 1 << 20)
    finally:
        os.close(follower)
        os.close(leader)
        job.kill()
        job.wait()
    assert done.returncode == 0, done.stderr
    assert screen.startswith(b"\x1b[H\x1b[2J") and screen.count(b"\x1b") == 2, screen
    text = screen.decode()
    assert f"pack:   {str(pack)!r}, staged from '/data/\\x1b]0;pwned\\x07p.lmdb'" in text, text


def test_monitor_by_name_never_takes_the_process_that_started_it() -> None:
    """`sudo packdata monitor --name x`, timeout or a script: the parent's command line holds x too."""
    token = "no-such-training-script-7f3a.py"
    child = [sys.executable, "-m", "packdata.cli", "monitor", "--name", token, "--count", "1", "--interval", "0.1"]
    parent = "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)"
    run = subprocess.run([sys.executable, "-c", parent, *child], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1, run.stdout
    assert run.stderr == f"Error: no running process has '{token}' in its command line. Pass its PID instead\n"


@pytest.mark.parametrize("pid", ["0", "-5"])
def test_monitor_refuses_a_pid_no_process_can_have(pid: str) -> None:
    """0 said 'process 0 has ended' with exit 0 (psutil takes pid 0), -5 was psutil's raw ValueError."""
    out = CliRunner().invoke(main, ["monitor", "--count", "1", "--", pid])
    assert out.exit_code == 2 and f"Invalid value for '[PID]': {pid} is not in the range x>=1." in out.output


@pytest.mark.parametrize("interval", ["1e300", "86401"])
def test_monitor_refuses_an_interval_no_sleep_takes(interval: str) -> None:
    """--interval 1e300 was taken, and the first sleep raised OverflowError ('timestamp out of range for platform
    time_t'), a traceback. It is now at most a day: exit 2 naming the option, before anything is watched."""
    out = CliRunner().invoke(main, ["monitor", str(os.getpid()), "--interval", interval, "--count", "1"])
    assert out.exit_code == 2 and "Invalid value for '--interval'" in out.output and "<=86400" in out.output


@pytest.mark.parametrize("every", ["soon", "nan", "inf", 0])
def test_monitor_refuses_a_bad_period(every: Any) -> None:
    """'nan' and 'inf' were taken: no period report ever came."""
    with pytest.raises(packdata.ConfigError, match="every should be"):
        packdata.monitor([], every=every)


@pytest.mark.parametrize("budget", [0, -1])
def test_monitor_refuses_a_memory_budget_that_is_not_positive(budget: int) -> None:
    """0 was taken, and every epoch was diagnosed ``memory``."""
    with pytest.raises(packdata.ConfigError, match="memory_budget should be"):
        packdata.monitor([], memory_budget=budget)


def test_monitor_refuses_a_log_it_cannot_write_before_the_loop(tmp_path: Path) -> None:
    """A log in a missing folder raised FileNotFoundError at the first report, minutes into the training."""
    log = tmp_path / "missing" / "loader.jsonl"
    with pytest.raises(packdata.ConfigError, match=r"missing/loader\.jsonl: cannot write the log"):
        packdata.monitor([torch.zeros(2)], log=log)


def test_a_log_that_fails_mid_loop_stops_logging_not_the_training(tmp_path: Path) -> None:
    log = tmp_path / "loader.jsonl"
    stream = io.StringIO()
    watched = packdata.monitor([torch.zeros(2)] * 3, log=log, every="60s", stream=stream)
    log.unlink(missing_ok=True)
    log.mkdir()  # the report cannot append to a folder
    assert len(list(watched)) == 3
    assert watched.summaries[0].steps == 3
    assert f"could not write {log}" in stream.getvalue() and "logging stopped" in stream.getvalue()


class _Burn2(_Instant):
    """96 samples of 4 ms of CPU each."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> int:
        end = time.process_time() + 0.004
        while time.process_time() < end:
            pass
        return i


def test_adaptive_loader_over_three_real_epochs_never_oscillates() -> None:
    stream = io.StringIO()
    loader = packdata.AdaptiveLoader(_Burn2(), batch_size=8, num_workers=1, max_workers=2, stream=stream)
    seen = []
    for _ in range(3):
        seen.append(sorted(i for batch in loader for i in batch.tolist()))
    assert all(epoch == list(range(96)) for epoch in seen)  # every sample once per epoch, whatever the workers
    assert len(loader.changes) <= 2  # a raise, and at most its undo
    if loader.changes:  # the machine had free CPU after epoch 1 (not saturated by other work)
        first = loader.changes[0]
        assert (first["from"], first["to"]) == (1, 2) and "data-bound" in first["reason"]
        assert "adaptive loader: num_workers 1 -> 2" in stream.getvalue()


def _summary(rate: float, diagnosis: Diagnosis) -> EpochSummary:
    return EpochSummary(steps=10, samples=int(rate), seconds=1.0, wait_seconds=0.5, diagnosis=diagnosis)


def test_adaptive_decisions_raise_keep_then_settle() -> None:
    loader = packdata.AdaptiveLoader([], batch_size=1, num_workers=1, max_workers=8, stream=io.StringIO())
    more = Diagnosis("data-bound", "waits", "num_workers=3", 3)
    loader.epoch = 1
    loader._adapt(_summary(100, more))
    assert loader.num_workers == 3
    loader.epoch = 2
    loader._adapt(_summary(180, Diagnosis("data-bound", "cpu saturated", "decode less")))  # the raise paid
    assert loader.num_workers == 3 and not loader.final
    loader.epoch = 3
    loader._adapt(_summary(181, Diagnosis("compute-bound", "", "")))
    assert loader.final and [c["to"] for c in loader.changes] == [3]
    loader.epoch = 4
    loader._adapt(_summary(100, more))  # final: no more changes
    assert loader.num_workers == 3


def test_adaptive_decisions_undo_a_raise_that_did_not_pay_and_respect_memory() -> None:
    loader = packdata.AdaptiveLoader([], batch_size=1, num_workers=2, max_workers=8, stream=io.StringIO())
    loader.epoch = 1
    loader._adapt(_summary(100, Diagnosis("data-bound", "", "num_workers=4", 4)))
    loader.epoch = 2
    loader._adapt(_summary(102, Diagnosis("data-bound", "", "num_workers=6", 6)))  # +2%: not worth it
    assert loader.num_workers == 2 and loader.final and [c["to"] for c in loader.changes] == [4, 2]
    low = packdata.AdaptiveLoader([], batch_size=1, num_workers=4, stream=io.StringIO())
    low.epoch = 1
    low._adapt(_summary(100, Diagnosis("memory", "OOM risk", "num_workers 4 -> 2", 2)))
    assert low.num_workers == 2 and "memory: OOM risk" in low.changes[0]["reason"]


def test_adaptive_loader_resumes_mid_epoch_exactly() -> None:
    def make() -> packdata.AdaptiveLoader:
        return packdata.AdaptiveLoader(_Instant(), batch_size=4, num_workers=0, stateful=True, stream=io.StringIO())

    loader = make()
    list(loader)  # epoch 1
    epoch2 = iter(loader)
    head = [next(epoch2).tolist() for _ in range(5)]
    state = loader.state_dict()
    rest = [b.tolist() for b in epoch2]
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.num_workers == state["num_workers"] and resumed.epoch == 1  # epoch 2's settings, whatever they were
    again = [b.tolist() for b in resumed]
    assert again == rest and sorted(i for b in head + again for i in b) == list(range(64))


class _Hoarding(_Instant):
    """Every sample keeps 4 MiB alive: a transform that leaks until the job outgrows its budget."""

    kept: ClassVar[list[bytes]] = []

    def __getitem__(self, i: int) -> int:
        self.kept.append(b"x" * (4 << 20))  # written, so resident (not lazily zeroed pages)
        return i


def test_a_job_outgrowing_its_memory_budget_is_diagnosed_memory() -> None:
    stream = io.StringIO()
    watched = packdata.monitor(DataLoader(_Hoarding(), batch_size=4), every="10s", stream=stream, memory_budget="200M")
    try:
        assert sum(1 for _ in watched) == 16  # 64 samples: 256 MiB kept in this process
    finally:
        _Hoarding.kept.clear()
    diagnosis = watched.summaries[0].diagnosis
    assert diagnosis is not None and diagnosis.kind == "memory", diagnosis
    assert "of its 200.0 MiB budget" in diagnosis.message and "pin_memory=False" in diagnosis.next_step


def test_the_epoch_cpu_weighs_each_sample_by_the_time_it_covers() -> None:
    """The epoch's CPU share was the plain mean of its samples: a 10 s period at 95% and the 0.1 s tail at 5%
    made 50%, 'CPUs idle, add workers', for an epoch whose CPUs were saturated."""
    from packdata.watch.probe import Snapshot

    watched = packdata.monitor([], stream=io.StringIO())
    epoch = EpochSummary(steps=10, samples=40, seconds=10.1, wait_seconds=8.0)

    def snap(at: float, busy: float) -> Snapshot:
        return Snapshot(at, 32 * GiB, 20 * GiB, 0, None, busy, 0.0, 8, [])

    watched._report(snap(1010.0, 0.95), epoch, epoch, final=False)
    watched._report(snap(1010.1, 0.05), epoch, epoch, final=True, started=1000.0)
    assert epoch.diagnosis is not None and epoch.diagnosis.kind == "data-bound"
    assert "decoding is the limit" in epoch.diagnosis.message and "CPUs 94% busy" in epoch.diagnosis.message


def test_the_cpu_share_counts_the_cpus_the_job_may_run_on(tmp_path: Path) -> None:
    """The CPU share came from /proc/stat's aggregate line: a job confined to 2 of 8 CPUs (a cpuset, taskset)
    that saturated them read 25% busy, 'CPUs idle: more workers', against its 2 usable cores. And an interval
    without a clock tick read 100% busy: it keeps the last measured share."""
    from packdata.watch.probe import SystemProbe

    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text("MemTotal: 1000000 kB\nMemAvailable: 800000 kB\n")

    def write(busy: int, idle: int) -> None:  # cpu0 and cpu1 busy, cpu2..cpu7 idle, for that many jiffies
        rows = [[busy, 0, 0, 0, 0, 0, 0, 0]] * 2 + [[0, 0, 0, idle, 0, 0, 0, 0]] * 6
        total = [sum(column) for column in zip(*rows, strict=True)]
        lines = [" ".join(["cpu", *map(str, total)])] + [
            " ".join([f"cpu{i}", *map(str, r)]) for i, r in enumerate(rows)
        ]
        (proc / "stat").write_text("\n".join([*lines, "intr 0", ""]))

    write(0, 0)
    confined = SystemProbe(root=str(tmp_path), gpus=False, packs=False, cpus={0, 1})
    whole = SystemProbe(root=str(tmp_path), gpus=False, packs=False, cpus=range(8))
    write(100, 100)
    assert confined.sample().cpu_busy == 1.0
    assert whole.sample().cpu_busy == 0.25
    # no clock tick since (two samples within 10 ms, an epoch's tail): 'CPUs 100% busy' was read from 0 / 1
    assert whole.sample().cpu_busy == 0.25 and whole.sample().iowait == 0.0


def test_the_cpu_share_counts_the_cgroup_cpu_quota(tmp_path: Path) -> None:
    """A container held to 2 CPUs (cpu.max) on a 64-CPU machine that used its 2 read 3% busy, 'CPUs idle:
    more workers': the share is now the cgroup's CPU time against its quota when that is larger."""
    from packdata.watch.probe import SystemProbe

    (tmp_path / "proc" / str(os.getpid())).mkdir(parents=True)
    (tmp_path / "proc" / "meminfo").write_text("MemTotal: 1000000 kB\nMemAvailable: 800000 kB\n")
    (tmp_path / "proc" / str(os.getpid()) / "cgroup").write_text("0::/job\n")
    job = tmp_path / "sys/fs/cgroup/job"
    job.mkdir(parents=True)
    (job / "cpu.max").write_text("200000 100000\n")

    def write(busy: int, usage_s: int) -> None:  # cpu0 and cpu1 busy, cpu2..cpu63 idle; the cgroup's usage
        rows = [[busy, 0, 0, 0, 0, 0, 0, 0]] * 2 + [[0, 0, 0, busy, 0, 0, 0, 0]] * 62
        lines = [" ".join([f"cpu{i}", *map(str, r)]) for i, r in enumerate(rows)]
        (tmp_path / "proc" / "stat").write_text("\n".join(["cpu 0 0 0 0 0 0 0 0", *lines, "intr 0", ""]))
        (job / "cpu.stat").write_text(f"usage_usec {usage_s * 10**6}\nuser_usec 0\nsystem_usec 0\n")

    write(0, 0)
    probe = SystemProbe(root=str(tmp_path), gpus=False, packs=False, cpus=range(64))
    time.sleep(0.05)
    write(100, 3600)  # more than 2 CPUs' worth of the time since: its quota used up
    snap = probe.sample()
    assert snap.cpu_busy == 1.0 and snap.cores <= 2
    diagnosis = diagnose(_m(wait_share=0.5, cpu_busy=snap.cpu_busy, cores=snap.cores))
    assert "decoding is the limit" in diagnosis.message and diagnosis.num_workers is None


@contextlib.contextmanager
def _job_in_cgroup(groups: list[Path], code: str) -> Iterator[int]:
    """A Python job running ``code`` once it is in the cgroup ``groups`` (the ``cgroup`` fixture's), yielding its
    pid once it prints ``ready``."""
    waits = "import sys\nsys.stdin.readline()\n"  # until it is in the cgroup: its memory is charged there
    job = subprocess.Popen(
        [sys.executable, "-c", waits + code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        for group in groups:
            (group / "cgroup.procs").write_text(str(job.pid))
        assert job.stdin is not None and job.stdout is not None
        job.stdin.write("go\n")
        job.stdin.flush()
        assert job.stdout.readline() == "ready\n"
        yield job.pid
    finally:
        job.kill()
        job.wait()


@pytest.mark.root
@pytest.mark.timeout(60)
def test_monitor_counts_the_cores_and_cpu_quota_of_the_watched_job(cgroup: Any) -> None:
    """packdata monitor PID counted the cores of its own process: a job in a cgroup held to 0.1 CPU showed the
    machine's cores, and its CPU share against all of them. A real cgroup (v2 cpu.max, or v1 cpu and cpuacct)."""
    spin = "print('ready', flush=True)\nwhile True: pass"
    with _job_in_cgroup(cgroup(**{"cpu.max": "10000 100000"}), spin) as pid:
        out = CliRunner().invoke(main, ["monitor", str(pid), "--json", "--count", "1", "--interval", "0.5"])
    assert out.exit_code == 0, out.output
    sample = json.loads(out.output)
    assert sample["cores"] == 1  # 0.1 CPU's quota, whatever the machine has
    assert sample["cpu_busy"] >= 0.5  # it spins at its quota: the machine's share alone was 0.1 / cores


@pytest.mark.root
@pytest.mark.timeout(60)
def test_monitor_reads_the_memory_limit_of_the_watched_job(cgroup: Any) -> None:
    """packdata monitor PID read the cgroup memory limit of its own process: run from outside a job's container
    it showed none, and judged the OOM risk against the whole machine's memory."""
    sleep = "print('ready', flush=True)\nimport time\ntime.sleep(60)"
    with _job_in_cgroup(cgroup(**{"memory.max": str(256 << 20)}), sleep) as pid:
        out = CliRunner().invoke(main, ["monitor", str(pid), "--json", "--count", "1", "--interval", "0.1"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["cgroup_limit"] == 256 << 20


@pytest.mark.root
@pytest.mark.timeout(60)
def test_the_memory_available_to_a_job_is_cut_to_its_cgroup_headroom(cgroup: Any) -> None:
    """Available memory was the machine's MemAvailable: a job holding 200 MiB of its cgroup's 256 MiB read
    gigabytes available, and the OOM warning (available under 10% of the limit) could never fire."""
    holds = "held = b'x' * (200 << 20)\nprint('ready', flush=True)\nimport time\ntime.sleep(60)"
    with _job_in_cgroup(cgroup(**{"memory.max": str(256 << 20)}), holds) as pid:
        out = CliRunner().invoke(main, ["monitor", str(pid), "--json", "--count", "1", "--interval", "0.1"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["mem_available"] < 56 << 20


@pytest.mark.root
@pytest.mark.timeout(60)
def test_monitor_refuses_a_job_whose_memory_it_cannot_read() -> None:
    """Watching another user's job without root drew '0 workers, private 0 B' every interval, as if the job
    held no memory: its /proc files are unreadable. Now one line says so. Run as nobody in a forked child."""
    if os.geteuid() != 0:
        pytest.skip("needs root to become another user")
    import importlib
    import pwd
    import traceback

    from packdata.watch.screen import watch_process

    importlib.import_module("encodings.ascii")  # the probe reads /proc/stat as ASCII: imported while we may

    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # nothing is imported from here on: the interpreter's files are not nobody's to read
        try:
            nobody = pwd.getpwnam("nobody")
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            out = io.StringIO()
            watch_process(job.pid, interval=0.1, count=1, stream=out)
            said = f"no error; printed {out.getvalue()!r}"
        except packdata.ConfigError as exc:
            said = str(exc)
        except BaseException:
            said = traceback.format_exc()
        os.write(write, said.encode())
        os._exit(0)
    os.close(write)
    try:
        os.waitpid(child, 0)
        with os.fdopen(read, "rb") as f:
            said = f.read().decode()
    finally:
        job.kill()
        job.wait()
    assert said == (
        f"cannot read the memory of process {job.pid} (a process of user root). "
        "Run packdata monitor as that user, or as root"
    )


@pytest.mark.root
@pytest.mark.timeout(60)
def test_monitor_stops_when_the_jobs_pid_is_taken_by_a_new_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The job ended and a new process took its pid: packdata monitor went on watching the stranger as the job.
    The kernel's next pid is set (ns_last_pid, root) so a new process really gets the ended job's pid."""
    import threading

    from packdata.watch import screen

    last_pid = Path("/proc/sys/kernel/ns_last_pid")
    if os.geteuid() != 0 or not os.access(last_pid, os.W_OK):
        pytest.skip("needs root and a writable /proc/sys/kernel/ns_last_pid to hand a pid on")
    probed, real_memory = threading.Event(), screen.process_memory

    def memory(*args: Any, **kwargs: Any) -> Any:  # the real read; the test learns when the watcher holds the job
        read = real_memory(*args, **kwargs)
        probed.set()
        return read

    monkeypatch.setattr(screen, "process_memory", memory)
    job = subprocess.Popen(["sleep", "60"])
    out = io.StringIO()
    watcher = threading.Thread(
        target=screen.watch_process, args=(job.pid,), kwargs={"interval": 3, "count": 1, "stream": out}
    )
    watcher.start()
    assert probed.wait(30)  # the job ends only once the watcher has read it (its last look before sampling)
    job.kill()
    job.wait()
    stranger = None
    try:
        for _ in range(20):  # another process on the machine may start in between and take it: again
            last_pid.write_text(str(job.pid - 1))
            stranger = subprocess.Popen(["sleep", "60"])
            if stranger.pid == job.pid:
                break
            stranger.kill()
            stranger.wait()
        else:
            pytest.skip("could not hand the pid on: the machine starts processes too fast")
        watcher.join()
    finally:
        if stranger is not None:
            stranger.kill()
            stranger.wait()
    assert out.getvalue() == f"process {job.pid} has ended\n"


@pytest.mark.root
@pytest.mark.timeout(60)
def test_a_new_process_started_in_the_ended_jobs_clock_tick_is_not_the_job() -> None:
    """The fresh-clone CI saw packdata monitor sample a stranger as the job: psutil tells processes apart by
    pid and start time, counted in 10 ms ticks, and a new process given the ended job's pid within one tick
    (181 of 200 handovers here) had both. The watcher now holds a pidfd on the job itself."""
    from packdata.watch import screen

    last_pid = Path("/proc/sys/kernel/ns_last_pid")
    if os.geteuid() != 0 or not os.access(last_pid, os.W_OK) or not hasattr(os, "pidfd_open"):
        pytest.skip("needs root, a writable /proc/sys/kernel/ns_last_pid and pidfd_open to hand a pid on")
    for _ in range(50):  # until the stranger has the job's pid and, as psutil reads it, its start time
        job = subprocess.Popen(["sleep", "60"])
        process, pidfd = psutil.Process(job.pid), screen._open_pidfd(job.pid)
        assert pidfd is not None
        job.kill()
        job.wait()
        last_pid.write_text(str(job.pid - 1))
        stranger = subprocess.Popen(["sleep", "60"])
        try:
            same = stranger.pid == job.pid and psutil.Process(stranger.pid).create_time() == process.create_time()
            if same:
                assert not screen._running(process, pidfd)
                return
        finally:
            os.close(pidfd)
            stranger.kill()
            stranger.wait()
    pytest.skip("no new process got the job's pid within its clock tick in 50 tries")


@pytest.mark.timeout(60)
def test_monitor_json_keeps_stdout_json_when_the_job_ends() -> None:
    """'packdata monitor PID --json >> loader.jsonl' appended 'process PID has ended' to the JSONL file when the
    job ended: a line no JSON reader takes. The note now goes to stderr."""
    job = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    command = [sys.executable, "-m", "packdata.cli", "monitor", str(job.pid), "--json", "--interval", "0.3"]
    monitor = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert monitor.stdout is not None and job.stdin is not None
        first = monitor.stdout.readline()  # the job ends once the monitor has written a record, not at a set time
        job.stdin.close()
        rest, err = monitor.communicate(timeout=60)
    finally:
        job.wait()
        if monitor.poll() is None:
            monitor.kill()
            monitor.wait()
    assert monitor.returncode == 0, err
    records = [json.loads(line) for line in (first + rest).splitlines()]
    assert records and all(r["pid"] == job.pid for r in records)
    assert err == f"process {job.pid} has ended\n"


@pytest.mark.timeout(30)
def test_monitor_stops_when_the_job_has_ended_but_is_not_reaped() -> None:
    """A job that ended is a zombie until its parent reaps it: psutil.pid_exists() is true for it, so
    packdata monitor drew 0 workers and 0 B forever instead of saying the job had ended."""
    import psutil

    job = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        while psutil.Process(job.pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.05)
        out = CliRunner().invoke(main, ["monitor", str(job.pid), "--interval", "0.1"])
        assert out.exit_code == 0 and out.output == f"process {job.pid} has ended\n"
    finally:
        job.wait()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_adaptive_loader_has_a_length_with_worker_only_options(num_workers: int) -> None:
    """len(AdaptiveLoader(..., prefetch_factor=4)) built a DataLoader with those options and no workers, and
    torch raised 'prefetch_factor option could only be specified in multiprocessing' (the epochs ran)."""
    from packdata.watch.adaptive import AdaptiveLoader

    loader = AdaptiveLoader(
        list(range(10)),
        batch_size=4,
        num_workers=num_workers,
        prefetch_factor=4,
        persistent_workers=True,
        stream=io.StringIO(),
    )
    assert len(loader) == 3
    batches = list(loader)
    assert len(batches) == 3 and sorted(int(x) for b in batches for x in b) == list(range(10))


@pytest.mark.parametrize("options", [{"memory_budget": 0}, {"every": "nan"}])
def test_adaptive_loader_refuses_bad_options_when_built(options: dict[str, Any]) -> None:
    """They were taken, and only the first epoch's monitor refused them (or, before, misread them)."""
    from packdata.watch.adaptive import AdaptiveLoader

    with pytest.raises(packdata.ConfigError):
        AdaptiveLoader(list(range(8)), batch_size=4, **options)
