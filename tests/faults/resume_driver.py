"""Kill conversions at chosen instants, then resume them: run as a script by test_resume_torture.

``python resume_driver.py PLAN.json`` reads a plan: ``src``, ``format``,
``shard_samples``, ``commit_samples`` (the local engine's commit size, made tiny
so checkpoints are frequent), ``engine``, and ``scenarios``: each a ``dst`` and
a list of ``kills`` applied to successive runs into it. A kill is
``["after" | "before", n]`` (SIGKILL the run right after, or right before, its
n-th ``os.replace`` of a path beside or inside DST: every checkpoint save,
TFRecord shard rename, manifest write and publish rename is one) or ``["closed", n]`` (SIGKILL the run once
its n-th shard is closed, right before the checkpoint that lists it is saved) or ``["at", seconds]`` (SIGKILL a
run whose reads are slowed from outside, after that many seconds) or
``["tasks-rmtree", 0]`` (the Ray driver dies while deleting its task results). After its kills a
scenario resumes with no kill until a run finishes; ``["after", 0]`` runs once
without a kill and reports how many ``os.replace`` calls a whole run makes.

Each run is a real process: forked from this driver (which never starts a
thread, so the fork is safe), it converts with ``resume=True`` and either dies
by SIGKILL or exits 0 after writing its ``ConvertResult`` to ``DST.result.json``.
The driver prints one JSON line: per scenario, the outcome of every run.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import sys
import time
import traceback

convert_module = importlib.import_module("packdata.conversion.convert")
local_module = importlib.import_module("packdata.conversion.local")
load_module = importlib.import_module("packdata.conversion.load")
importlib.import_module("packdata.formats.lmdb")  # imported once here, not in every forked run
importlib.import_module("packdata.formats.tfrecord")


def _child(plan: dict, dst: str, kill: list, slow: float) -> None:
    """Runs in the forked process: convert, dying where ``kill`` says."""
    side, n = kill
    calls = 0
    real_replace = os.replace

    scope = os.path.dirname(os.path.abspath(dst)) + os.sep  # only the conversion's own renames count

    closed = 0  # shards closed so far (a shard closes in a thread: the checkpoint listing it is saved after)

    def replace(a, b, *args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal calls
        if not os.path.abspath(a).startswith(scope):  # Ray's own files, if any
            return real_replace(a, b, *args, **kwargs)
        calls += 1
        if side == "before" and calls == n:
            os.kill(os.getpid(), signal.SIGKILL)
        if side == "closed" and closed >= n and os.path.basename(b) == "progress.json":
            os.kill(os.getpid(), signal.SIGKILL)  # the n-th shard is closed, no checkpoint lists it yet
        real_replace(a, b, *args, **kwargs)
        if side == "after" and calls == n:
            os.kill(os.getpid(), signal.SIGKILL)

    os.replace = replace  # type: ignore[assignment]
    if side == "closed":
        writer = importlib.import_module("packdata.formats").shard_writer(plan["format"])
        real_close = writer.close

        def close(self):  # type: ignore[no-untyped-def]
            nonlocal closed
            done = real_close(self)
            closed += 1
            return done

        writer.close = close
    if side == "tasks-rmtree":  # the Ray driver, killed while deleting its task results
        real_rmtree = shutil.rmtree

        def rmtree(path, *args, **kwargs):  # type: ignore[no-untyped-def]
            if os.path.basename(os.fspath(path)) == "tasks":
                real_rmtree(os.path.join(path, "00000", "index"))
                os.kill(os.getpid(), signal.SIGKILL)
            real_rmtree(path, *args, **kwargs)

        shutil.rmtree = rmtree  # type: ignore[assignment]
    local_module._COMMIT_SAMPLES = plan["commit_samples"]
    if slow:
        load = load_module._load

        def slow_load(entry, opts):  # type: ignore[no-untyped-def]
            time.sleep(slow)
            return load(entry, opts)

        load_module._load = slow_load
    result = convert_module.convert(
        plan["src"],
        dst,
        format=plan["format"],
        shard_samples=plan["shard_samples"],
        workers=2,
        progress=False,
        resume=True,
        engine=plan.get("engine", "local"),
    )
    out = result.to_dict()
    out["replace_calls"] = calls
    # written whole or not at all: a kill from outside may land right here (os.rename: os.replace is counted)
    with open(dst + ".result.json.tmp", "w", encoding="utf-8") as f:
        json.dump(out, f)
    os.rename(dst + ".result.json.tmp", dst + ".result.json")


def _run(plan: dict, dst: str, kill: list) -> str:
    """One run in a forked process; returns ``killed``, ``done``, ``absent`` or ``exit N``."""
    slow = plan.get("slow", 0.004) if kill[0] == "at" else 0.0
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            _child(plan, dst, kill, slow)
        except BaseException:
            traceback.print_exc()
            code = 3
        os._exit(code)
    if kill[0] == "at":
        deadline = time.monotonic() + kill[1]
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return _outcome(status)
            time.sleep(0.002)
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return _outcome(status)


def _outcome(status: int) -> str:
    if os.WIFSIGNALED(status):
        return "killed" if os.WTERMSIG(status) == signal.SIGKILL else f"signal {os.WTERMSIG(status)}"
    code = os.WEXITSTATUS(status)
    return "done" if code == 0 else f"exit {code}"


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as f:
        plan = json.load(f)
    report = []
    for scenario in plan["scenarios"]:
        dst = scenario["dst"]
        outcomes = []
        for kill in scenario["kills"]:
            if os.path.exists(dst):  # a kill after the publish rename: the pack is complete
                break
            outcomes.append(_run(plan, dst, kill))
        for _ in range(3):  # then resume without a kill
            if os.path.exists(dst + ".result.json") or outcomes[-1:] not in ([], ["killed"]):
                break
            if os.path.exists(dst):
                break
            outcomes.append(_run(plan, dst, ["after", 0]))
        report.append(outcomes)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
