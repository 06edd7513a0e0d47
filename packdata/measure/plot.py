"""Plot a bench result: throughput and peak memory against ``num_workers``."""

from __future__ import annotations

import os
from pathlib import Path

from packdata.errors import ConfigError
from packdata.measure.bench import CEILING, BenchResult
from packdata.measure.loop import ConfigResult

__all__ = ["plot_bench"]


def plot_bench(result: BenchResult, path: str | os.PathLike) -> Path:
    """Plot throughput and peak memory (PSS summed over processes) against num_workers, one line per source.

    PSS rather than USS: forking a worker makes the parent's pages shared, so the
    parent's USS drops as workers start while PSS sums the processes honestly.

    Raises:
        ConfigError: matplotlib is not installed (``pip install 'packdata[plot]'``).
    """
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
    for (source, batch, pin, pf), rows in groups.items():
        rows.sort(key=lambda r: r.num_workers)
        label = Path(source).name or source
        if several:
            label += f" (batch {batch}, pin {'on' if pin else 'off'}, pf {pf})"
        x = [r.num_workers for r in rows]
        style = "--" if source == CEILING else "-"
        ax_speed.plot(x, [r.samples_per_s for r in rows], style, marker="o", label=label)
        ax_mem.plot(x, [r.memory["total"]["pss_peak"] / 2**20 for r in rows], style, marker="o", label=label)
    ax_speed.set(xlabel="num_workers", ylabel="samples/s", title="Throughput")
    ax_mem.set(xlabel="num_workers", ylabel="MiB", title="Peak memory, main + workers (PSS)")
    for ax in (ax_speed, ax_mem):
        ax.set_ylim(bottom=0)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
