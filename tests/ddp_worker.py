"""One rank of a DDP reading job, launched by ``tests/test_ddp.py`` through torchrun.

Reads a pack for several epochs with a real DataLoader (``--workers`` worker
processes per rank) on the gloo backend, and writes what it saw to
``OUT/rank{RANK}.json``: per epoch, the SHA-1 of every sample's bytes in the
order the loader yielded them, and the number of steps. The samples are hashed
in the DataLoader workers (the ``decode`` function), so the JSON proves which
records were really read.

- ``--format lmdb``: ``LMDBDataset`` + ``DistributedSampler`` (``set_epoch`` each epoch).
- ``--format tfrecord``: ``TFRecordDataset``, which splits shards by rank and
  worker itself (``set_epoch`` each epoch).
- ``--format block``: ``LMDBDataset`` + ``BlockShuffleSampler``;
  ``--format token``: ``LMDBDataset`` + ``TokenBucketSampler``.
- ``--before-init``: build the loader before ``init_process_group``, with
  ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` unset (as ``mp.spawn`` scripts that pass the rank
  to ``init_process_group`` run), and write the ``PackdataError`` the first
  epoch raises, if any, as ``error``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from packdata.errors import PackdataError


def sha1(data: bytes) -> str:
    """The decode step: a sample's identity, computed in the DataLoader worker."""
    return hashlib.sha1(data).hexdigest()


def _loader(pack: str, fmt: str, workers: int, batch_size: int) -> tuple[DataLoader, object]:
    if fmt in ("lmdb", "block", "token"):
        from packdata.reading.datasets import LMDBDataset
        from packdata.reading.samplers import BlockShuffleSampler
        from packdata.reading.text import TokenBucketSampler

        dataset = LMDBDataset(pack, decode=sha1)
        if fmt == "token":
            batches = TokenBucketSampler(dataset, max_tokens=4096, max_samples=batch_size, seed=0)
            return DataLoader(dataset, batch_sampler=batches, num_workers=workers), batches
        if fmt == "lmdb":
            sampler = DistributedSampler(dataset, shuffle=True, seed=0)
        else:
            sampler = BlockShuffleSampler(dataset, block_size=4, window=2, seed=0)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers), sampler
    from packdata.reading.streaming import TFRecordDataset

    dataset = TFRecordDataset(pack, decode=sha1, shuffle=True, seed=0, shuffle_buffer=8)
    return DataLoader(dataset, batch_size=batch_size, num_workers=workers), dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("pack")
    parser.add_argument("out")
    parser.add_argument("--format", choices=["lmdb", "tfrecord", "block", "token"], required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--before-init", action="store_true")
    args = parser.parse_args()

    if args.before_init:
        rank, world = int(os.environ.pop("RANK")), int(os.environ.pop("WORLD_SIZE"))
        del os.environ["LOCAL_RANK"]
        loader, epoch_owner = _loader(args.pack, args.format, args.workers, args.batch_size)
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        loader, epoch_owner = _loader(args.pack, args.format, args.workers, args.batch_size)
    report: dict = {"rank": rank, "world": world, "pid": os.getpid(), "epochs": []}
    try:
        for epoch in range(args.epochs):
            epoch_owner.set_epoch(epoch)  # type: ignore[attr-defined]
            seen: list[str] = []
            steps = 0
            for digests, _labels in loader:
                seen.extend(digests)
                steps += 1
                # what DDP does every step: a collective every rank must join
                dist.all_reduce(torch.ones(1))
            report["epochs"].append({"epoch": epoch, "steps": steps, "digests": seen})
    except PackdataError as exc:
        if not args.before_init:
            raise
        report["error"] = str(exc)
    dist.barrier()
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
