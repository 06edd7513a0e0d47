"""Runs the Ray engine tests (``tests/ray_cases.py``, ``tests/ray_url_cases.py``, ``tests/ray_finish_cases.py``)
in a child pytest.

A Ray driver exits its whole process with status 1 and no Python exception when
it loses its raylet or GCS (Ray's own ``QuickExit``): run in this process, one
such loss ended the entire suite mid-line with no report (seen once in CI, at
``test_ray_on_error_fail_names_the_file``). In a child, the loss fails this one
test, and the failure carries the child's report and the error lines of Ray's
own logs, so the cause can be read.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("ray_cases.py")
FILES = [str(CASES), str(CASES.with_name("ray_url_cases.py")), str(CASES.with_name("ray_finish_cases.py"))]
RAY_LOGS = ("raylet.out", "raylet.err", "gcs_server.out", "gcs_server.err")


def _ray_log_errors(temp_dir: Path, limit: int = 40) -> str:
    """Warning, error and fatal lines from the Ray sessions under ``temp_dir``, plus any crash dump."""
    lines = []
    for log in sorted(temp_dir.glob("ray/session_*/logs/*")):
        if log.name not in RAY_LOGS and not log.name.startswith("python-core-driver"):
            continue
        with log.open(errors="replace") as f:
            for line in f:
                if " W " in line or " E " in line or " C " in line or " F " in line or "*** " in line:
                    lines.append(f"{log.name}: {line.rstrip()[:400]}")
    return "\n".join(lines[-limit:]) or "(no error lines in Ray's logs)"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ray_engine_cases_in_a_child_pytest() -> None:
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'packdata[ray]')")
    # Ray puts unix sockets under its temp folder: keep the path short (sun_path holds 107 bytes)
    with tempfile.TemporaryDirectory(prefix="ray-") as ray_tmp:
        env = {**os.environ, "RAY_TMPDIR": ray_tmp}
        command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *FILES]
        proc = subprocess.run(
            command, cwd=CASES.parents[1], env=env, capture_output=True, text=True, timeout=840, check=False
        )
        if proc.returncode != 0:
            report = (proc.stdout + proc.stderr)[-6000:]
            pytest.fail(
                f"the Ray engine tests exited with status {proc.returncode}:\n{report}\n"
                f"--- Ray's logs ---\n{_ray_log_errors(Path(ray_tmp))}",
                pytrace=False,
            )
    assert " passed" in proc.stdout, proc.stdout[-2000:]
