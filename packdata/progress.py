"""Progress on stderr for long work: a bar on a terminal, one plain line every few seconds in a log.

On a terminal :func:`progress` is a tqdm bar with the total, percent, rate and
ETA. When stderr is not a terminal (piped into a log, a CI job, a batch
system) a bar's carriage-return updates would write tens of thousands of
updates into one log line, so it prints one plain line every
``PACKDATA_PROGRESS_SECONDS`` (default 10) seconds instead, and one at the end,
the way pip and uv behave::

    packing: 12,345 of 100,000 files (12.3%), 1,234 files/s, 43.5 MiB/s, ETA 0:01:11

``total`` may be unknown at first and set later (a walk counted in the background).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, TextIO

from tqdm import tqdm

from packdata.units import format_rate, format_size

__all__ = ["LineProgress", "count_done_before", "progress"]

_ENV_SECONDS = "PACKDATA_PROGRESS_SECONDS"


def _eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class LineProgress:
    """tqdm's interface (``update``, ``total``, ``set_postfix_str``, ``close``, ``with``) as periodic log lines.

    Args:
        desc: what is counted, first on each line.
        unit: the unit counted (``" files"``, ``"B"``).
        total: the count when done, if known.
        initial: the count already done (a resumed run).
        every: seconds between lines.
        file: where lines go (stderr).
        nbytes: a callable giving bytes processed so far, for an MB/s figure.
    """

    def __init__(
        self,
        desc: str,
        unit: str,
        total: float | None = None,
        initial: float = 0,
        every: float = 10.0,
        file: TextIO | None = None,
        nbytes: Any = None,
    ) -> None:
        self.desc, self.unit, self.total = desc, unit, total
        self.n = initial
        self._initial = initial
        self._every = every
        self._file = file or sys.stderr
        self._start = self._last = time.monotonic()
        self._postfix = ""
        self._lock = threading.Lock()
        self._closed = False
        self._nbytes = nbytes
        self._written: float | None = None  # the count the last line showed

    def update(self, n: float = 1) -> None:
        with self._lock:
            self.n += n
            now = time.monotonic()
            if now - self._last >= self._every:
                self._last = now
                self._write(now)

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self._postfix = text

    def count_done_before(self, n: float) -> None:
        """Add ``n`` done by an earlier run (found done on resume): counted, but not in this run's rate."""
        with self._lock:
            self.n += n
            self._initial += n

    def refresh(self) -> None:
        """Nothing to redraw: lines are written on their schedule."""

    def _line(self, now: float) -> str:
        done = self.n - self._initial
        elapsed = max(now - self._start, 1e-9)
        rate = done / elapsed
        if self.unit.strip() == "B":
            count = format_size(int(self.n)) + (f" of {format_size(int(self.total))}" if self.total else "")
            speed = format_rate(rate)
        else:
            count = f"{int(self.n):,}" + (f" of {int(self.total):,}" if self.total else "") + self.unit
            speed = f"{rate:,.0f}{self.unit}/s"
        parts = [count + (f" ({100 * self.n / self.total:.1f}%)" if self.total else ""), speed]
        if self._nbytes is not None:
            parts.append(format_rate(self._nbytes() / elapsed))
        if self._postfix:
            parts.append(self._postfix)
        if self.total and rate > 0 and self.n < self.total:
            parts.append(f"ETA {_eta((self.total - self.n) / rate)}")
        elif self.total and self.n >= self.total:
            parts.append(f"done in {_eta(elapsed)}")
        return f"{self.desc}: " + ", ".join(parts)

    def _write(self, now: float) -> None:
        self._written = self.n
        print(self._line(now), file=self._file, flush=True)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                if self._written != self.n:  # the last line already said this: no repeat
                    self._write(time.monotonic())

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def count_done_before(bar: Any, n: float) -> None:
    """Add ``n`` done by an earlier run to a :func:`progress` display, leaving it out of the rate.

    As ``initial=`` does for work known at the start; this is for work found
    done as a run goes (a resumed run's finished tasks, met in plan order).
    """
    if isinstance(bar, LineProgress):
        bar.count_done_before(n)
        return
    bar.n += n
    if not bar.disable:  # tqdm's rate: (n - initial) / elapsed, smoothed over n - last_print_n between prints
        bar.initial += n
        bar.last_print_n += n
        bar.refresh()


def progress(
    *,
    desc: str,
    unit: str,
    total: float | None = None,
    initial: float = 0,
    disable: bool = False,
    nbytes: Any = None,
    file: TextIO | None = None,
) -> Any:
    """A progress display: a tqdm bar on a terminal, :class:`LineProgress` lines otherwise (see the module docstring).

    Args:
        desc, unit, total, initial: as tqdm's.
        disable: show nothing (``-q``).
        nbytes: a callable giving bytes processed so far (adds MB/s).
        file: the stream (default stderr).
    """
    stream = file or sys.stderr
    if disable:
        return tqdm(disable=True)
    if not getattr(stream, "isatty", lambda: False)():
        every = float(os.environ.get(_ENV_SECONDS, "10") or 10)
        return LineProgress(desc, unit, total=total, initial=initial, every=every, file=stream, nbytes=nbytes)
    scale = {"unit_scale": True, "unit_divisor": 1000} if unit.strip() == "B" else {"unit_scale": True}
    return tqdm(
        desc=desc,
        unit=unit,
        total=total,
        initial=initial,
        file=stream,
        dynamic_ncols=True,
        **scale,  # type: ignore[arg-type]
    )
