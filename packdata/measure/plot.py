"""Plot a bench result: throughput and peak memory against ``num_workers``."""

from __future__ import annotations

import os
from pathlib import Path

from packdata.errors import ConfigError
from packdata.measure.bench import CEILING, BenchResult
from packdata.measure.loop import ConfigResult

__all__ = ["check_plot_path", "plot_bench"]


def check_plot_path(path: str | os.PathLike) -> None:
    """Refuse, before a bench runs, a plot matplotlib could not write: no matplotlib, or a format it does not know.

    Raises:
        ConfigError: matplotlib is not installed, or ``path``'s suffix is not one of its formats.
    """
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError as exc:
        raise ConfigError("plotting needs matplotlib", hint="pip install 'packdata[plot]'") from exc
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix and suffix not in formats:  # without one, matplotlib writes a PNG
        raise ConfigError(
            f"a plot is written as one of {', '.join(formats)} (by its suffix), not {suffix}",
            path=path,
            hint="Name it like bench.png",
        )


def plot_bench(result: BenchResult, path: str | os.PathLike) -> Path | None:
    """Plot throughput and peak private memory against num_workers: measured points only, one series per source.

    Memory is the table's "private mem" (peak USS of the main process plus the
    workers); a caption names the batch size, decode and machine.

    Returns:
        The plot written, or None where no setting of a source (the ceiling
        aside) was measured: nothing is written then.

    Raises:
        ConfigError: matplotlib is not installed (``pip install 'packdata[plot]'``).
    """
    if all(r.error or r.source == CEILING for r in result.results):
        return None  # nothing measured to plot: no empty axes, no legend without labels
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("plotting needs matplotlib", hint="pip install 'packdata[plot]'") from exc
    fig, (ax_speed, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2))
    groups: dict[tuple[str, int, bool, int], list[ConfigResult]] = {}
    for r in result.results:
        if not r.error:
            groups.setdefault((r.source, r.batch_size, r.pin_memory, r.prefetch_factor), []).append(r)
    several = len({k[1:] for k in groups}) > 1
    measured: set[int] = set()
    for (source, batch, pin, pf), rows in groups.items():
        rows.sort(key=lambda r: r.num_workers)
        label = Path(source).name or source
        if several:
            label += f" (batch {batch}, pin {'on' if pin else 'off'}, pf {pf})"
        x = [r.num_workers for r in rows]
        marker = "s" if source == CEILING else "o"
        speed = [r.samples_per_s for r in rows]
        spread = [
            [r.samples_per_s - r.samples_per_s_min for r in rows],
            [r.samples_per_s_max - r.samples_per_s for r in rows],
        ]
        ax_speed.errorbar(x, speed, yerr=spread, fmt=marker, capsize=3, label=label)  # points: no line between
        private = [(r.memory["main"]["uss_peak"] + r.memory["workers"]["uss_peak"]) / 2**20 for r in rows]
        ax_mem.plot(x, private, marker, linestyle="none", label=label)
        measured.update(x)
    ax_speed.set(xlabel="num_workers", ylabel="samples/s (median, bars: min-max)", title="Throughput")
    ax_mem.set(xlabel="num_workers", ylabel="MiB", title="Peak private memory, main + workers (USS)")
    for ax in (ax_speed, ax_mem):
        ax.set_ylim(bottom=0)
        ax.set_xticks(sorted(measured))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    settings, system = result.settings, result.system
    batches = sorted({k[1] for k in groups})
    fig.text(
        0.01,
        0.01,
        f"batch size {', '.join(map(str, batches))}; decode {settings.get('decode')}; "
        f"{system.get('cpus_logical')} logical CPUs, {system.get('memory_total', 0) / 2**30:.0f} GiB RAM; "
        f"torch {system.get('torch')}",
        fontsize=8,
    )
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
