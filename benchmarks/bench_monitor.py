"""The monitor's cost on a training loop: 5 ms steps with and without ``packdata.monitor``, interleaved.

    python benchmarks/bench_monitor.py [--steps 400] [--repeats 5]

Target: under 1% of a 5 ms step. The loader is a list of ready batches, so all
the difference is the monitor's own work (two clock reads and two reads of its
thread's /proc/thread-self/schedstat per step and one
system sample per period, by default every 10 s; ``--every 1s`` samples ten times as often).
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

import packdata


def _loop(batches: list[int], step_s: float, every: str | None) -> float:
    source = packdata.monitor(batches, every=every, stream=io.StringIO()) if every else batches
    start = time.perf_counter()
    for _ in source:
        end = time.perf_counter() + step_s
        while time.perf_counter() < end:  # a busy step: sleep's granularity would swamp the difference
            pass
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--every", default="10s")
    args = parser.parse_args()
    batches = list(range(args.steps))
    plain, watched = [], []
    for _ in range(args.repeats):
        plain.append(_loop(batches, 0.005, None))
        watched.append(_loop(batches, 0.005, args.every))
    overhead = (statistics.median(watched) - statistics.median(plain)) / statistics.median(plain)
    print(
        f"{args.steps} steps of 5 ms, every={args.every}, {args.repeats} repeats: "
        f"plain {statistics.median(plain):.3f} s, monitored {statistics.median(watched):.3f} s: "
        f"overhead {100 * overhead:+.2f}% (target < 1%)"
    )


if __name__ == "__main__":
    main()
