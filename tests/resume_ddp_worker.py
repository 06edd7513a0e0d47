"""One rank of a DDP job that checkpoints and resumes mid-epoch, launched by ``tests/test_resume_ddp.py``.

Reads a text pack (``decode="bytes"``; each file holds its own key) with
``torchdata``'s ``StatefulDataLoader`` (``--workers`` workers per rank) on the
gloo backend; rank and world size come from ``torch.distributed``. Every step
joins an ``all_reduce``, as DDP training does, so unequal step counts hang
(and the test's timeout fails them).

- ``--pack lmdb PATH STOPS``: ``LMDBDataset`` + ``BlockShuffleSampler``.
- ``--pack tfrecord PATH STOPS``: ``TFRecordDataset`` (splits by rank and worker itself).

Each ``--pack`` is read in turn in the same launch (one torch import per rank).

Phases (``--phase``), each a separate torchrun launch:

- ``stop``: the uninterrupted epoch (``full``), then for each ``k`` in ``STOPS`` (comma-separated) a
  new loader that yields ``k`` batches and saves ``loader.state_dict()`` as
  JSON to ``STATES/FORMAT/k/rank{RANK}.json`` (``before``).
- ``resume``: for each ``k``, a new loader loads that state and finishes the
  epoch (``after``).

Writes ``OUT/rank{RANK}.json``: per format, the keys in the order the loaders yielded them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

EPOCH = 1
SEED = 7


def collate(items: list) -> list[str]:
    """A batch as its samples' keys (each text file holds its own key)."""
    return [bytes(x).decode() for x, _ in items]


def make_loader(pack: str, fmt: str, workers: int, batch_size: int) -> tuple[StatefulDataLoader, dict]:
    if fmt == "lmdb":
        from packdata import BlockShuffleSampler, LMDBDataset

        ds = LMDBDataset(pack, decode="bytes")
        sampler = BlockShuffleSampler(ds, block_size=4, window=2, seed=SEED)  # rank, world from torch.distributed
        sampler.set_epoch(EPOCH)
        loader = StatefulDataLoader(ds, sampler=sampler, batch_size=batch_size, num_workers=workers, collate_fn=collate)
        # the sampler's own order, mapped to keys: what the loader should yield
        info = {"rank": sampler.rank, "world": sampler.world_size, "order": [ds.keys[i] for i in sampler.indices()]}
        return loader, info
    from packdata import TFRecordDataset

    ds = TFRecordDataset(pack, decode="bytes", seed=SEED, shuffle_buffer=6)
    ds.set_epoch(EPOCH)
    loader = StatefulDataLoader(ds, batch_size=batch_size, num_workers=workers, collate_fn=collate)
    return loader, {"rank": ds.rank, "world": ds.world_size}


def step(batch: list[str], seen: list[str]) -> None:
    seen.extend(batch)
    dist.all_reduce(torch.ones(1))  # what DDP does every step: a collective every rank must join


def run(pack: str, fmt: str, stops: list[int], args: argparse.Namespace, states: Path) -> dict:
    """One format's phase on this rank: what it read, by ``full`` and by stop ``k``."""
    rank = dist.get_rank()
    report: dict = {"runs": {}}
    if args.phase == "stop":
        loader, info = make_loader(pack, fmt, args.workers, args.batch_size)
        report.update(info)
        full: list[str] = []
        for batch in loader:
            step(batch, full)
        report["full"] = full
        for k in stops:
            loader, _ = make_loader(pack, fmt, args.workers, args.batch_size)
            before: list[str] = []
            it = iter(loader)
            for _ in range(k):
                step(next(it), before)
            state = json.dumps(loader.state_dict())
            del it, loader
            (states / str(k)).mkdir(parents=True, exist_ok=True)
            (states / str(k) / f"rank{rank}.json").write_text(state)
            report["runs"][str(k)] = before
    else:
        for k in stops:
            loader, info = make_loader(pack, fmt, args.workers, args.batch_size)
            report.update(info)
            loader.load_state_dict(json.loads((states / str(k) / f"rank{rank}.json").read_text()))
            after: list[str] = []
            for batch in loader:
                step(batch, after)
            report["runs"][str(k)] = after
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("states")
    parser.add_argument("--pack", nargs=3, action="append", metavar=("FORMAT", "PATH", "STOPS"), required=True)
    parser.add_argument("--phase", choices=["stop", "resume"], required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    report = {"rank": rank, "world": world}
    for fmt, pack, stops in args.pack:
        report[fmt] = run(pack, fmt, [int(k) for k in stops.split(",")], args, Path(args.states) / fmt)
    dist.barrier()
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
