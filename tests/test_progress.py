"""The plain progress lines written into a log (stderr not a terminal)."""

from __future__ import annotations

import io
import re

from tqdm import tqdm

from packdata.progress import LineProgress, count_done_before


def test_a_log_gets_each_state_once_in_binary_units() -> None:
    out = io.StringIO()
    with LineProgress("stage", "B", total=3 * 2**20, every=0, file=out) as bar:
        for _ in range(3):
            bar.update(2**20)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3, lines  # the closing line is not a repeat of the last update
    assert lines[0].startswith("stage: 1.0 MiB of 3.0 MiB (33.3%), ")
    assert re.search(r"\d (B|[KMGT]iB)/s", lines[0]), lines[0]
    assert "done in" in lines[-1] and "\r" not in out.getvalue()


def test_close_says_where_it_stopped_when_no_line_did() -> None:
    out = io.StringIO()
    with LineProgress("packing", " files", total=10, every=3600, file=out) as bar:
        bar.update(4)
    assert out.getvalue().splitlines() == [out.getvalue().strip()]
    assert out.getvalue().startswith("packing: 4 of 10 files (40.0%)")


def test_work_found_done_by_an_earlier_run_is_counted_but_not_in_the_rate() -> None:
    """A resumed Ray conversion added the tasks an interrupted run finished as this run's work: a rate 10x too high."""
    out = io.StringIO()
    with LineProgress("packing", " files", total=100, initial=20, every=3600, file=out) as bar:
        count_done_before(bar, 70)
        bar.update(10)
        line = bar._line(bar._start + 2.0)
    assert line.startswith("packing: 100 of 100 files (100.0%), 5 files/s, "), line
    bar = tqdm(total=100, initial=20, file=io.StringIO(), mininterval=0)
    with bar:
        count_done_before(bar, 70)
        bar.update(10)
        assert bar.format_dict["n"] - bar.format_dict["initial"] == 10
    quiet = tqdm(disable=True)
    count_done_before(quiet, 70)
    assert quiet.n == 70
