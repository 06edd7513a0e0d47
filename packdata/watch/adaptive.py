"""A DataLoader whose workers are re-chosen between epochs from what the monitor measured.

``AdaptiveLoader(dataset, batch_size=64, memory_budget="8G")`` iterates like a
DataLoader; each epoch runs under :func:`packdata.monitor`, and between epochs
(never inside one) it applies the diagnosis:

- ``data-bound`` with CPUs free: raise ``num_workers`` to the count the diagnosis
  names, if the measured per-worker memory times that count fits ``memory_budget``;
- ``memory``: lower ``num_workers`` to the count the diagnosis names;
- anything else: keep the setting.

It converges instead of oscillating: a raise that did not make the next epoch at
least ``min_gain`` faster is undone and that count is never tried again, and
after two epochs without a change the setting is final. Every change is logged
with its reason (``changes``). The sampler is the caller's and is never touched,
so exactly-once and resume semantics are the DataLoader's; the chosen settings
are in :meth:`state_dict`, and with ``stateful=True`` (torchdata's
``StatefulDataLoader``) so is the position inside the epoch.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any, TextIO

from torch.utils.data import DataLoader

from packdata.errors import ConfigError
from packdata.units import parse_size
from packdata.watch.loop import EpochSummary, monitor

__all__ = ["AdaptiveLoader"]


class AdaptiveLoader:
    """Iterate ``dataset`` with a DataLoader whose ``num_workers`` adapts between epochs (see the module docstring).

    Args:
        dataset: the dataset.
        batch_size: the batch size (never changed).
        num_workers: the first epoch's worker count.
        max_workers: the most workers it may choose.
        memory_budget: bytes (or text like ``"8G"``) the workers' private memory may use in all.
        min_gain: the speed-up a raise must bring to be kept.
        stateful: use torchdata's ``StatefulDataLoader`` (mid-epoch resume).
        every: the monitor's period.
        stream: where monitor and change lines go (stderr).
        **loader_kwargs: passed to the DataLoader (``sampler``, ``collate_fn``, ``pin_memory``, ...).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        batch_size: int,
        num_workers: int = 1,
        max_workers: int = 8,
        memory_budget: int | str | None = None,
        min_gain: float = 0.05,
        stateful: bool = False,
        every: float | str = "10s",
        stream: TextIO | None = None,
        **loader_kwargs: Any,
    ) -> None:
        if "num_workers" in loader_kwargs:
            raise ConfigError("pass num_workers as AdaptiveLoader's own argument")
        self.dataset, self.batch_size, self.loader_kwargs = dataset, batch_size, loader_kwargs
        self.num_workers, self.max_workers = num_workers, max_workers
        self.memory_budget = parse_size(memory_budget) if isinstance(memory_budget, str) else memory_budget
        monitor([], every=every, memory_budget=self.memory_budget)  # its checks now, not at the first epoch
        self.min_gain, self.stateful, self.every = min_gain, stateful, every
        self.stream = stream or sys.stderr
        self.epoch = 0
        self.final = False
        self.changes: list[dict[str, Any]] = []
        self._refused: set[int] = set()
        self._last_rate: float | None = None
        self._quiet_epochs = 0
        self._loader: Any = None
        self._loader_state: dict[str, Any] | None = None

    def _kwargs(self) -> dict[str, Any]:
        """The DataLoader options for the current worker count (torch refuses the worker-only ones without)."""
        kwargs = dict(self.loader_kwargs)
        if self.num_workers == 0:
            kwargs.pop("prefetch_factor", None)
            kwargs.pop("persistent_workers", None)
        return kwargs

    def _make_loader(self) -> Any:
        kwargs = self._kwargs()
        if self.stateful:
            from torchdata.stateful_dataloader import StatefulDataLoader

            loader = StatefulDataLoader(
                self.dataset, batch_size=self.batch_size, num_workers=self.num_workers, **kwargs
            )
            if self._loader_state is not None:
                loader.load_state_dict(self._loader_state)
                self._loader_state = None
            return loader
        return DataLoader(self.dataset, batch_size=self.batch_size, num_workers=self.num_workers, **kwargs)

    def __len__(self) -> int:
        kwargs = self._kwargs()
        return len(DataLoader(self.dataset, batch_size=self.batch_size, num_workers=self.num_workers, **kwargs))

    def __iter__(self) -> Iterator[Any]:
        self._loader = self._make_loader()
        watched = monitor(self._loader, every=self.every, stream=self.stream, memory_budget=self.memory_budget)
        yield from watched
        self._loader = None
        self.epoch += 1
        self._adapt(watched.summaries[-1])

    def _adapt(self, summary: EpochSummary) -> None:
        rate = summary.samples / summary.seconds if summary.seconds else 0.0
        previous, self._last_rate = self._last_rate, rate
        last = self.changes[-1] if self.changes else None
        raised = last is not None and last["epoch"] == self.epoch - 1 and last["to"] > last["from"]
        if last is not None and raised and previous and rate < previous * (1 + self.min_gain):
            self._refused.add(last["to"])  # the raise did not pay: undo it, never try that count again
            gain = f"{rate:.0f} samples/s is not {100 * self.min_gain:.0f}% above {previous:.0f}"
            self._change(last["from"], gain)
            self.final = True
            return
        d = summary.diagnosis
        target = d.num_workers if d is not None else None
        if self.final or target is None or target == self.num_workers:
            self._quiet_epochs += 1
            self.final = self.final or self._quiet_epochs >= 2
            return
        target = max(0, min(target, self.max_workers))
        if target > self.num_workers:
            if target in self._refused:
                return
            per_worker = max((p.private for s in summary.snapshots for p in s.workers), default=0)
            if self.memory_budget is not None and per_worker * target > self.memory_budget:
                target = min(target, self.memory_budget // per_worker if per_worker else target)
                if target <= self.num_workers:
                    return
        if target != self.num_workers:
            assert d is not None
            self._change(target, d.line())

    def _change(self, workers: int, reason: str) -> None:
        self.changes.append({"epoch": self.epoch, "from": self.num_workers, "to": workers, "reason": reason})
        print(
            f"adaptive loader: num_workers {self.num_workers} -> {workers} for epoch {self.epoch}: {reason}",
            file=self.stream,
            flush=True,
        )
        self.num_workers = workers
        self._quiet_epochs = 0

    def state_dict(self) -> dict[str, Any]:
        """The chosen settings and history (and the position inside the epoch with ``stateful=True``)."""
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "num_workers": self.num_workers,
            "final": self.final,
            "changes": list(self.changes),
            "refused": sorted(self._refused),
            "last_rate": self._last_rate,
        }
        if self.stateful and self._loader is not None:
            state["loader"] = self._loader.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`: the same settings, and with ``stateful=True`` the same position."""
        self.epoch, self.num_workers, self.final = state["epoch"], state["num_workers"], state["final"]
        self.changes, self._refused = list(state["changes"]), set(state["refused"])
        self._last_rate = state["last_rate"]
        self._loader_state = state.get("loader")
