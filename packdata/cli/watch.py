"""The monitor command: a training job's data loading, watched from a second terminal."""

from __future__ import annotations

import click

from packdata.cli.common import _FiniteFloat, _friendly

__all__ = ["monitor_command"]


@click.command(name="monitor")
@click.argument("pid", required=False, type=click.IntRange(min=1))
@click.option("--name", help="Watch the oldest process whose command line contains this (e.g. train.py).")
@click.option(
    "--interval", type=_FiniteFloat(min=0.1, max=86400), default=1.0, show_default=True, help="Seconds per sample."
)
@click.option("--count", type=click.IntRange(min=1), help="Stop after this many samples. Default: until the job ends.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per sample.")
@_friendly
def monitor_command(pid: int | None, name: str | None, interval: float, count: int | None, as_json: bool) -> None:
    """Watch a training job's data loading from a second terminal.

    The training process and its DataLoader workers (each one's private and
    file-backed memory), available memory against swap with the OOM warning,
    CPU and iowait. Redrawn in place on a terminal; one line per sample when piped.
    In the training script itself, packdata.monitor(loader) adds the step's
    waiting time and names the bottleneck.

    \b
    Examples:
      packdata monitor --name train.py
      packdata monitor 12345 --interval 5 --json >> loader.jsonl
    """
    from packdata.watch.screen import find_process, watch_process

    if (pid is None) == (name is None):
        raise click.UsageError("give the training process's PID or --name, one of them")
    watch_process(pid if pid is not None else find_process(name or ""), interval=interval, count=count, as_json=as_json)
