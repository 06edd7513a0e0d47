"""A CPU held by a spinning process that is no descendant of the test's (the monitor must not count it as the
job's): the tests of the monitor on a busy machine share it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

__all__ = ["cpu_held_by_another"]

_HOLD_CPU = (
    "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nprint('on', flush=True)\nwhile True:\n    pass\n"
)


@contextlib.contextmanager
def cpu_held_by_another() -> Iterator[int]:
    """Yields one of this process's CPUs on which another process spins; this thread (and the processes it
    starts meanwhile) runs on that CPU only. Skips without ``sched_setaffinity``."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("needs sched_setaffinity to share one CPU with another process")
    allowed = os.sched_getaffinity(0)
    cpu = min(allowed)
    # started through a shell that exits at once: the holder is no process of this job's, only on its CPU
    shell = [sys.executable, "-c", _HOLD_CPU, str(cpu)]
    starter = subprocess.Popen(["sh", "-c", '"$@" & echo "$!"', "sh", *shell], stdout=subprocess.PIPE, text=True)
    assert starter.stdout is not None
    said = {starter.stdout.readline().strip(), starter.stdout.readline().strip()}  # its pid, and 'on' once it spins
    starter.stdout.close()
    starter.wait()
    holder = int(next(line for line in said if line != "on"))
    try:
        assert "on" in said
        os.sched_setaffinity(0, {cpu})  # this thread, and the workers it forks
        try:
            yield cpu
        finally:
            os.sched_setaffinity(0, allowed)
    finally:
        os.kill(holder, signal.SIGKILL)
