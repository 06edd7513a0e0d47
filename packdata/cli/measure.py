"""Commands that measure DataLoaders: bench, tune."""

from __future__ import annotations

import functools
import json
from typing import Any

import click

from packdata.cli.common import _FiniteFloat, _friendly, _in_flags, _int_list, _mb, _output_file, _size, _write_failed
from packdata.errors import PackdataError

__all__ = ["bench", "tune"]


def _progress_line(line: str) -> None:
    click.echo(line, err=True)


_decode_option = click.option(
    "--decode",
    type=click.Choice(["bytes", "pil", "reduced", "crop"]),
    default="pil",
    show_default=True,
    help="bytes: no decoding; pil: full decode; reduced: JPEG DCT-scaled decode to the output side (bench: "
    "--size; tune: 224); crop: DecodeCrop, decoding only what the random crop needs: its rows and columns with "
    "TurboJPEG 3 (pip install 'packdata[turbo]'), else PIL's DCT scaling; bench's ceiling for crop is PIL's full "
    "decode + crop (the work DecodeCrop replaces), whichever decodes.",
)


@click.command()
@click.argument("sources", nargs=-1, required=True, type=click.Path(path_type=str))
@click.option(
    "--workers",
    callback=_int_list,
    default="0,2",
    show_default=True,
    help="num_workers values to sweep, comma-separated.",
)
@click.option(
    "--batch-size", callback=_int_list, default="64", show_default=True, help="Batch sizes to sweep, comma-separated."
)
@click.option(
    "--pin-memory/--no-pin-memory",
    default=False,
    show_default=True,
    help="Pin host memory (only with CUDA; measured off without it).",
)
@click.option(
    "--prefetch-factor",
    callback=_int_list,
    default="2",
    show_default=True,
    help="prefetch_factor values to sweep, comma-separated.",
)
@click.option("--persistent-workers", is_flag=True, help="Keep workers between epochs.")
@_decode_option
@click.option("--no-transform", is_flag=True, help="Skip the standard transform (crop to --size, flip, uint8).")
@click.option(
    "--size", type=click.IntRange(min=1), default=224, show_default=True, help="Output side of the transform."
)
@click.option(
    "--seconds",
    type=_FiniteFloat(min=0, min_open=True),
    help="Time each setting this long. Default: no time limit (--batches decides).",
)
@click.option("--batches", type=click.IntRange(min=1), help="Batches to time per setting (default: 50, at least 1 s).")
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True, help="Untimed batches first.")
@click.option(
    "--step-ms",
    type=_FiniteFloat(min=0),
    default=0,
    show_default=True,
    help="Simulated training step per batch; reports the share of time waiting for data.",
)
@click.option(
    "--cold",
    is_flag=True,
    help="Drop the page cache before each source: the WHOLE machine's cache (echo 3 > drop_caches), so it needs "
    "root and slows everything else running here for a while.",
)
@click.option(
    "--repeat",
    "repeats",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Run every setting this many times, interleaved; the table shows medians and their spread.",
)
@click.option("--wide", is_flag=True, help="All columns (MB/s, CPU time, latency percentiles, every memory figure).")
@click.option(
    "--json",
    "json_file",
    type=click.Path(dir_okay=False, path_type=str),
    callback=_output_file,
    help="Write the full result as JSON to this file ('-': stdout).",
)
@click.option(
    "--plot",
    "plot_file",
    type=click.Path(dir_okay=False, path_type=str),
    callback=_output_file,
    help="Plot throughput and peak private memory against num_workers to this file, in the format its suffix "
    "names (.png, .svg, .pdf, ...; PNG without one; needs matplotlib).",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress lines (the setting being measured) on stderr.")
@_friendly
def bench(
    sources: tuple[str, ...],
    workers: tuple[int, ...],
    batch_size: tuple[int, ...],
    pin_memory: bool,
    prefetch_factor: tuple[int, ...],
    no_transform: bool,
    json_file: str | None,
    plot_file: str | None,
    wide: bool,
    quiet: bool,
    **options: Any,
) -> None:
    """Measure DataLoader throughput and memory for each SOURCE (pack or folder).

    The in-memory decode ceiling is measured next to them (same decode,
    transform and settings on bytes already in memory), so every figure is
    also a ratio to it.

    \b
    Examples:
      packdata bench train.lmdb ./images --workers 0,2,4 --batch-size 64,128
      packdata bench train.lmdb --step-ms 50 --seconds 10
      packdata bench train.lmdb --decode reduced --json bench.json --plot bench.png
      packdata bench train.lmdb --decode crop     # DecodeCrop against PIL's full decode + crop
    """
    from packdata.measure.bench import run_bench
    from packdata.measure.plot import plot_bench
    from packdata.measure.sources import check_source

    if plot_file:
        from packdata.measure.plot import check_plot_path

        check_plot_path(plot_file)  # before minutes of measuring
    for given in sources:  # before minutes of measuring the others
        check_source(given)
    result = run_bench(
        list(sources),
        workers=workers,
        batch_sizes=batch_size,
        pin_memory=(pin_memory,),
        prefetch_factor=prefetch_factor,
        transform=None if no_transform else "standard",
        progress=None if quiet else _progress_line,
        **options,
    )
    failed = [s for s in result.sources if s.get("error") and s["name"] != "ceiling"]
    # No source opened: the error below says why, with no table of headers and no row before it, nor a plot of none.
    measured = any(s["name"] != "ceiling" and not s.get("error") for s in result.sources)
    if json_file == "-":
        click.echo(result.to_json())
    else:
        if measured:
            click.echo(result.table(wide=wide, say=functools.partial(_in_flags, also={"num_workers": "--workers"})))
        if json_file:
            try:
                result.to_json(json_file)
            except OSError as exc:
                raise _write_failed(json_file, exc) from exc
    for warning in result.warnings:
        if failed and warning == failed[0]["error"]:
            continue  # said once, as the error below
        click.secho(f"warning: {warning}", fg="yellow", err=True)
    if plot_file and measured:
        try:
            plotted = plot_bench(result, plot_file)
            click.echo(
                f"plot: {plotted}" if plotted else f"plot: none written to {plot_file}: no setting was measured",
                err=True,
            )
        except OSError as exc:
            raise _write_failed(plot_file, exc) from exc
    if failed:
        raise click.ClickException(f"could not measure {failed[0]['error']}")
    for source in result.sources:  # a source whose every setting failed was not measured: say so, exit 1
        rows = result.for_source(source["name"]) if source["name"] != "ceiling" else []
        if rows and all(r.error for r in rows):
            raise PackdataError(f"no setting could be measured: {source['name']}: {rows[0].error}")


@click.command()
@click.argument("source", type=click.Path(path_type=str))
@click.option(
    "--memory-budget",
    callback=_size,
    help="Memory the loader may use, e.g. 8GB. Default: half of MemAvailable (or of the cgroup's headroom).",
)
@click.option(
    "--device",
    default=None,
    help="Where batches go, e.g. cuda (turns on the pin_memory search). Default: cpu (pin_memory off).",
)
@click.option(
    "--batch-size",
    "batch_sizes",
    callback=_int_list,
    default="64",
    show_default=True,
    help="Your training batch size (kept); several values, comma-separated, are searched (e.g. 32,64,128).",
)
@click.option(
    "--max-workers",
    type=click.IntRange(min=0),
    help="Most workers to try. Default: the logical CPUs this process may use (affinity, CPU quota).",
)
@_decode_option
@click.option(
    "--seconds",
    type=_FiniteFloat(min=0, min_open=True),
    help="Time each trial this long. Default: no time limit (--batches decides).",
)
@click.option("--batches", type=click.IntRange(min=1), help="Batches to time per trial (default: 50, at least 1 s).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines (the trial being measured) on stderr.")
@_friendly
def tune(source: str, batch_sizes: tuple[int, ...], as_json: bool, quiet: bool, **options: Any) -> None:
    """Search DataLoader settings for SOURCE and print the best as Python.

    One variable at a time from the rule of thumb (num_workers, batch_size,
    prefetch_factor, pin_memory), rejecting any setting whose projected memory
    exceeds the budget.

    \b
    Examples:
      packdata tune train.lmdb
      packdata tune train.lmdb --batch-size 64,128 --memory-budget 8G --json
    """
    from packdata.measure.tune import run_tune

    result = run_tune(source, batch_sizes=batch_sizes, progress=None if quiet else _progress_line, **options)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=1))
        return
    for warning in result.warnings:
        click.secho(f"warning: {warning}", fg="yellow", err=True)

    def describe(label: str, trial: Any) -> None:
        click.echo(
            f"# {label}: {trial.samples_per_s:,.0f} samples/s; peak private memory in this short run "
            f"{_mb(trial.memory_peak_bytes or 0)}, projected for training {_mb(trial.projected_bytes)} "
            f"(budget {_mb(result.memory_budget)}, {result.budget_source})"
        )

    describe("recommended", result.recommended)
    click.echo(result.python(result.recommended))
    if result.runner_up is not None:
        describe("runner-up", result.runner_up)
        click.echo(result.python(result.runner_up))
        best, second = result.recommended.samples_per_s or 0.0, result.runner_up.samples_per_s or 0.0
        if best and abs(best - second) / best < result.min_gain:
            click.echo(
                f"# the two are within noise ({100 * abs(best - second) / best:.0f}% apart, under the "
                f"{100 * result.min_gain:.0f}% a step must gain): prefer the one with fewer workers, smaller "
                "batches and less memory"
            )
    click.echo(
        "# projected = workers x per-worker private memory (the largest measured) + batches in flight "
        "(workers x prefetch_factor) x batch bytes (+ the same again when pinned); a short run peaks lower"
    )
    rejected = sum(1 for t in result.trials if t.rejected)
    click.echo(f"# {len(result.trials)} settings tried, {rejected} rejected over the memory budget or failing")
