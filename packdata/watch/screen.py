"""``packdata monitor``: a training job's data loading seen from a second terminal.

The ``watch 'nvidia-smi && free -mh'`` of the Linux data-loading guide, done for
data loading: the training process and its DataLoader workers with each one's
private and file-backed memory, available memory against swap in use (with the
OOM warning), CPU and iowait. On a terminal the screen is redrawn in place;
piped, one line per interval; ``--json`` gives one JSON object per interval.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from typing import TextIO

import psutil

from packdata.errors import ConfigError
from packdata.host.processes import process_memory
from packdata.units import format_size, shown
from packdata.watch.diagnose import MEMORY_LOW
from packdata.watch.probe import Snapshot, SystemProbe

__all__ = ["find_process", "render", "watch_process"]


def find_process(name: str) -> int:
    """The pid of the oldest process whose command line contains ``name`` (not this one, nor its ancestors).

    The processes that started this one (``sudo packdata monitor --name x``, a
    shell script, ``timeout``) hold ``name`` in their command lines too.

    Raises:
        ConfigError: no such process.
    """
    me = psutil.Process()
    mine = {me.pid} | {p.pid for p in me.parents()}
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "create_time"]):
        cmdline = " ".join(proc.info.get("cmdline") or [])
        if proc.info["pid"] not in mine and name in cmdline and "packdata monitor" not in cmdline:
            found.append((proc.info.get("create_time") or 0.0, proc.info["pid"]))
    if not found:
        raise ConfigError(f"no running process has {name!r} in its command line", hint="Pass its PID instead")
    return min(found)[1]


def _oom_warning(snap: Snapshot) -> str | None:
    total = min(snap.mem_total, snap.cgroup_limit or snap.mem_total)
    if snap.mem_available < MEMORY_LOW * total or (snap.swap_used and snap.mem_available < snap.swap_used):
        return (
            f"OOM risk: {format_size(snap.mem_available)} available, {format_size(snap.swap_used)} swap in use: "
            "fewer DataLoader workers, or pin_memory=False"
        )
    return None


def _read(snap: Snapshot) -> str:
    return f", job read {format_size(snap.read_bytes)} from storage" if snap.read_bytes is not None else ""


def render(snap: Snapshot, pid: int) -> list[str]:
    """The screen for one sample."""
    limit = f", cgroup limit {format_size(snap.cgroup_limit)}" if snap.cgroup_limit else ""
    lines = [
        f"packdata monitor: pid {pid}  {time.strftime('%H:%M:%S', time.localtime(snap.time))}",
        f"memory: {format_size(snap.mem_available)} available of {format_size(snap.mem_total)}, "
        f"swap {format_size(snap.swap_used)} in use{limit}",
        f"cpu:    {100 * snap.cpu_busy:.0f}% busy, iowait {100 * snap.iowait:.0f}% ({snap.cores} usable cores)"
        + _read(snap),
        f"{'pid':>8} {'role':<7} {'private':>10} {'file-backed':>12}  command",
    ]
    lines += [
        f"{p.pid:>8} {p.role:<7} {format_size(p.private):>10} {format_size(p.file_backed):>12}  {shown(p.cmdline[:60])}"
        for p in snap.processes
    ]
    workers = snap.workers
    lines.append(
        f"{len(workers)} workers, {format_size(sum(p.private for p in snap.processes))} private in all "
        "(file-backed pages are page cache: shared, reclaimable)"
    )
    for g in snap.gpus:
        busy = f"{100 * g['utilization']:.0f}% busy" if g.get("utilization") is not None else "busy: unknown"
        used = g["total_bytes"] - g["free_bytes"]
        lines.append(
            f"gpu {g['index']}: {shown(g['name'])}, {busy}, {format_size(used)} of {format_size(g['total_bytes'])}"
        )
    if not snap.gpus:
        lines.append("gpus:   none seen through NVML (pip install nvidia-ml-py on a GPU machine)")
    for p in snap.packs:
        origin = f", staged from {shown(str(p['origin']))}" if p["staged"] else ""  # from a pack's staged.json
        lines.append(f"pack:   {shown(p['path'])}{origin}")
    warning = _oom_warning(snap)
    if warning:
        lines.append(f"WARNING {warning}")
    return lines


def _one_line(snap: Snapshot, pid: int) -> str:
    warning = _oom_warning(snap)
    return (
        f"{time.strftime('%H:%M:%S', time.localtime(snap.time))} pid {pid}: {len(snap.workers)} workers, private "
        f"{format_size(sum(p.private for p in snap.processes))}, available {format_size(snap.mem_available)}, "
        f"swap {format_size(snap.swap_used)}, cpu {100 * snap.cpu_busy:.0f}%, iowait {100 * snap.iowait:.0f}%"
        + _read(snap)
        + (f"; WARNING {warning}" if warning else "")
    )


def _open_pidfd(pid: int) -> int | None:
    """A handle on process ``pid`` itself (Linux 5.3+), which a new process later given the same pid does not
    take over; None where the kernel or Python has none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _running(process: psutil.Process, pidfd: int | None) -> bool:
    """Whether ``process`` still runs: one that ended and was not yet reaped (a zombie) has ended, and so has
    one whose pid a new process now holds. A pidfd turns readable when its process ends, exactly; without
    one, ``is_running`` compares start times, which cannot tell apart two processes started in one 10 ms tick."""
    if pidfd is not None:
        return not select.select([pidfd], [], [], 0)[0]
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def watch_process(
    pid: int, *, interval: float = 1.0, count: int | None = None, as_json: bool = False, stream: TextIO | None = None
) -> None:
    """Sample ``pid``'s job every ``interval`` seconds until it ends (or ``count`` samples).

    ``as_json`` writes one JSON object a line to ``stream``, and the note that the job ended to stderr.
    """
    out = stream or sys.stdout
    try:
        probe = SystemProbe(pid)
        pidfd = _open_pidfd(pid)
    except psutil.NoSuchProcess:
        raise ConfigError(f"no process {pid}", hint="Check the PID, or pass --name") from None
    try:
        if process_memory(probe.process) is None and _running(probe.process, pidfd):  # not ours: it would read 0 B
            raise ConfigError(
                f"cannot read the memory of process {pid} (a process of user {probe.process.username()})",
                hint="Run packdata monitor as that user, or as root",
            )
        _sample_until_ended(probe, pidfd, interval=interval, count=count, as_json=as_json, out=out)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _sample_until_ended(
    probe: SystemProbe, pidfd: int | None, *, interval: float, count: int | None, as_json: bool, out: TextIO
) -> None:
    """``watch_process``'s loop: a sample of ``probe``'s job each ``interval``, until it ends or ``count``."""
    pid = probe.process.pid
    tty = out.isatty() and not as_json
    n = 0
    while count is None or n < count:
        time.sleep(interval)
        if not _running(probe.process, pidfd):  # with --json a note, not a record: stdout stays one JSON object a line
            print(f"process {pid} has ended", file=sys.stderr if as_json else out, flush=True)
            return
        snap = probe.sample()
        if as_json:
            print(json.dumps({"pid": pid, **snap.to_dict()}), file=out, flush=True)
        elif tty:
            print("\x1b[H\x1b[2J" + "\n".join(render(snap, pid)), file=out, flush=True)
        else:
            print(_one_line(snap, pid), file=out, flush=True)
        n += 1
