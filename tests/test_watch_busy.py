"""The monitor on a machine whose CPUs other processes keep busy: waiting on the disk told from waiting for a CPU."""

from __future__ import annotations

import io
import mmap
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from held_cpu import cpu_held_by_another
from torch.utils.data import DataLoader, Dataset

import packdata
from packdata.watch.diagnose import Measurements, diagnose

GiB = 1 << 30

_READ = 64 << 10  # one O_DIRECT read a sample: past the page cache, to the device
_IOPS = 10  # what the cgroup lets through: each read waits about 100 ms for the throttled device


def _whole_disk(path: Path) -> str:
    """``MAJOR:MINOR`` of the disk holding ``path`` (a partition's disk: cgroups throttle whole disks)."""
    dev = os.stat(path).st_dev
    block = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not block.exists():
        pytest.skip(f"{path} is on no block device (tmpfs, overlay, a network filesystem)")
    if (block / "partition").exists():
        block = block.resolve().parent
    return (block / "dev").read_text().strip()


@pytest.fixture
def throttled_reads(tmp_path: Path) -> Iterator[Path]:
    """A cgroup whose processes read ``tmp_path``'s disk at 10 I/O a second: yields its ``cgroup.procs``."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a cgroup that throttles a disk")
    disk = _whole_disk(tmp_path)
    root = Path("/sys/fs/cgroup")
    if (root / "cgroup.controllers").is_file():
        group, file, limit = root / f"packdata-test-io-{os.getpid()}", "io.max", f"{disk} riops={_IOPS}"
        if "io" not in (root / "cgroup.subtree_control").read_text().split():
            pytest.skip("the cgroup v2 io controller is not enabled at /sys/fs/cgroup")
    else:
        group = root / "blkio" / f"packdata-test-io-{os.getpid()}"
        file, limit = "blkio.throttle.read_iops_device", f"{disk} {_IOPS}"
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a cgroup at {group}: {exc}")
    try:
        (group / file).write_text(limit)
        yield group / "cgroup.procs"
    except OSError as exc:
        pytest.skip(f"cannot throttle {disk} in {group}: {exc}")
    finally:
        group.rmdir()  # the workers have ended: the loader's iteration joined them


class _DiskReads(Dataset):
    """Each sample is one 64 KiB O_DIRECT read of a file, made by a worker that joined the throttled cgroup."""

    def __init__(self, path: Path, procs: Path, samples: int) -> None:
        self.path, self.procs, self.samples = path, procs, samples
        self._fd: int | None = None

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> int:
        if self._fd is None:
            self.procs.write_text(str(os.getpid()))
            self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            self._buf = mmap.mmap(-1, _READ)  # page-aligned, as O_DIRECT needs
        return os.preadv(self._fd, [self._buf], i * _READ)


@pytest.mark.root
@pytest.mark.timeout(120)
def test_a_loop_waiting_on_its_disk_on_cpus_another_process_holds_is_io_bound(
    tmp_path: Path, throttled_reads: Path
) -> None:
    """A loop whose worker waited on a slow disk, on CPUs another process kept busy, was 'data-bound: ... other
    processes keep the CPUs busy, and its workers wait on something else': iowait counts idle CPUs' time only,
    and its CPU was never idle. The run-queue wait of the job's processes (/proc/PID/schedstat) now tells: they
    hardly waited for a CPU and read from storage, so they wait on the disk. A real worker reads its samples
    past the page cache from a disk a cgroup throttles to 10 reads a second, on the one CPU a spinning process
    outside the job holds."""
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(64 * _READ))
    if not Path(f"/proc/{os.getpid()}/schedstat").exists():
        pytest.skip("this kernel keeps no run-queue wait per process (/proc/PID/schedstat)")
    try:
        os.close(os.open(data, os.O_RDONLY | os.O_DIRECT))
    except OSError as exc:
        pytest.skip(f"{tmp_path}'s filesystem takes no O_DIRECT reads: {exc}")
    stream = io.StringIO()
    with cpu_held_by_another():
        loader = DataLoader(_DiskReads(data, throttled_reads, 64), batch_size=4, num_workers=1)
        watched = packdata.monitor(loader, every=1, stream=stream)  # samples while the worker reads
        assert sum(1 for _ in watched) == 16
    diagnosis = watched.summaries[0].diagnosis
    assert diagnosis is not None and diagnosis.kind == "io-bound", diagnosis
    assert "from storage: its workers wait on the disk (iowait does not show it while other processes keep" in (
        diagnosis.message
    )
    assert diagnosis.next_step.startswith("stage the pack onto fast local storage: packdata stage PACK")


def _busy(**changes: float | None) -> Measurements:
    """A loop waiting 60% of the time on CPUs 100% busy, its one worker using 0.05 CPUs' worth."""
    base: dict[str, float | int | None] = dict(
        wait_share=0.6, cpu_busy=1.0, iowait=0.0, num_workers=1, cores=2, mem_available=20 * GiB,
        mem_total=32 * GiB, swap_used=0, worker_private=GiB, job_cores=0.05, read_bytes=8 << 20, cpu_wait=0.02,
    )  # fmt: skip
    return Measurements(**{**base, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "changes",
    [
        {"cpu_wait": 0.5},
        {"cpu_wait": 0.8},
        {"cpu_wait": None},
        {"read_bytes": 0},
        {"read_bytes": None},
        {"read_bytes": (1 << 20) - 1},
    ],
)
def test_a_loop_waiting_for_its_cpu_or_reading_nothing_is_not_told_its_disk_is_the_wait(
    changes: dict[str, float | None],
) -> None:
    """Workers kept from their CPU (their run-queue wait half a CPU or more each), or whose wait is unknown,
    or that read under 1 MiB from storage are told what they were: other processes keep the CPUs busy."""
    assert diagnose(_busy()).kind == "io-bound"
    diagnosis = diagnose(_busy(**changes))
    assert diagnosis.kind == "data-bound", diagnosis
    assert "other processes keep the CPUs busy, and its workers wait on something else" in diagnosis.message


_SPINS_IN_A_THREAD = """
import sys, threading, time
done = threading.Event()
def spin():
    end = time.thread_time() + 0.3
    while time.thread_time() < end:
        pass
    print(threading.get_native_id(), flush=True)
    done.wait()
sys.stdin.readline()
threading.Thread(target=spin).start()
sys.stdin.readline()
done.set()
"""


def _run_queue_wait(pid: int, tid: int) -> float:
    return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1]) / 1e9


@pytest.mark.timeout(60)
def test_a_processs_run_queue_wait_counts_its_threads_not_its_first_one_alone() -> None:
    """The probe read a process's run-queue wait from /proc/PID/schedstat, its first thread's alone: a training
    process (or worker) whose other thread waited for its CPU read as waiting for none. A real process's second
    thread spins for 0.3 s of CPU on the one CPU a spinning process outside the job holds, its first thread
    asleep: the probe's wait counts the second thread's."""
    from packdata.watch.probe import SystemProbe

    if not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat").exists():
        pytest.skip("this kernel keeps no run-queue wait per thread (/proc/PID/task/TID/schedstat)")
    with cpu_held_by_another():  # the job started here runs on the held CPU, held throughout
        job = subprocess.Popen(
            [sys.executable, "-c", _SPINS_IN_A_THREAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert job.stdin is not None and job.stdout is not None
        try:
            started = time.monotonic()  # the sample's span lies within started..ended
            probe = SystemProbe(job.pid, gpus=False, packs=False)
            job.stdin.write("\n")
            job.stdin.flush()
            tid = int(job.stdout.readline())  # spun, now asleep
            thread_waited = _run_queue_wait(job.pid, tid)
            snap = probe.sample()
            ended = time.monotonic()
        finally:
            job.kill()
            job.wait()
    assert thread_waited > 0.05, "the thread never waited for the held CPU"
    assert snap.cpu_wait is not None and snap.cpu_wait * (ended - started) >= thread_waited


_THREADS = """
import sys, threading
done = threading.Event()
for _ in range(int(sys.argv[1])):
    threading.Thread(target=done.wait).start()
print("ready", flush=True)
sys.stdin.readline()
done.set()
"""


def test_a_process_of_many_threads_has_the_run_queue_wait_of_its_oldest_threads_read() -> None:
    """A process of more threads than THREADS_READ has that many threads' waits read, its first thread's among
    them: a process of 10,000 threads costs a sample 256 file reads."""
    from packdata.host.processes import THREADS_READ, run_queue_waits

    job = subprocess.Popen(
        [sys.executable, "-c", _THREADS, str(THREADS_READ + 40)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert job.stdin is not None and job.stdout is not None
    try:
        assert job.stdout.readline() == "ready\n"
        assert len(os.listdir(f"/proc/{job.pid}/task")) == THREADS_READ + 41
        waits = run_queue_waits(job.pid)
    finally:
        job.kill()
        job.wait()
    assert waits is not None and len(waits) == THREADS_READ and job.pid in waits


class _Decoding(Dataset):
    """Each sample burns 15 ms of CPU, as a decode does."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> int:
        end = time.process_time() + 0.015
        while time.process_time() < end:
            pass
        return i


@pytest.mark.timeout(120)
def test_the_workers_that_exit_as_an_epoch_ends_have_their_run_queue_wait_counted() -> None:
    """The epoch's last span (its last period, or the whole epoch after the first batch) read its workers'
    run-queue wait as unknown: a DataLoader without persistent workers ends them as the epoch ends, before the
    monitor's last sample, and the kernel adds a reaped child's wait nowhere. The monitor now reads their wait
    at the epoch's last batch. Two real epochs of a worker decoding on the one CPU a spinning process outside
    the job holds: each epoch's last sample counts the wait of its worker, which had exited, and not the
    training process's (no longer the loading one), whose whole life's wait once read as 11 CPUs' worth."""
    if not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat").exists():
        pytest.skip("this kernel keeps no run-queue wait per thread (/proc/PID/task/TID/schedstat)")
    with cpu_held_by_another():  # this thread, and the workers it forks
        loader = DataLoader(_Decoding(), batch_size=4, num_workers=1, persistent_workers=False)
        watched = packdata.monitor(loader, every=3600, stream=io.StringIO())
        for _ in range(2):
            assert sum(1 for _ in watched) == 8
    for summary in watched.summaries:
        first, last = summary.snapshots[0], summary.snapshots[-1]
        assert first.workers and not last.workers  # the worker had exited by the last sample
        # waited, and at most a CPU's worth for each of its two threads (its result queue's feeder thread)
        assert last.cpu_wait is not None and 0 < last.cpu_wait <= 2, last
