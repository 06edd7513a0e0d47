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
- ``--append SRC``: rank 0 builds its loader, then runs ``convert SRC PACK
  --append``, then rank 1 builds its own, and the ``PackdataError`` the first
  epoch raises, if any, is written as ``error``. ``--rank1-pack PATH``: rank 1
  opens PATH (a staged copy) instead of PACK. With either, ``--format lmdb``
  calls ``check_same_pack`` before the first epoch (``DistributedSampler`` checks nothing).
- ``--only-rank0``: rank 0 alone reads (a loader iterated on some ranks
  only, as an evaluation on rank 0), with no collective a step; rank 1 reads
  nothing, and the ranks meet at no barrier after. ``--no-check-ranks``: build
  the ``BlockShuffleSampler`` with ``check_ranks=False``.
- ``--timeout S``: the process group's timeout (its store's too).
- ``--spawn``: the ``TFRecordDataset``'s loader starts its workers with
  ``multiprocessing_context="spawn"``; ``--no-set-epoch``: never call ``set_epoch``.
- ``--public-store``: as a torch without the private ``_get_default_store``
  (removed once the group is made): the ranks meet at torchrun's store.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from packdata.conversion.convert import convert
from packdata.errors import PackdataError


def sha1(data: bytes) -> str:
    """The decode step: a sample's identity, computed in the DataLoader worker."""
    return hashlib.sha1(data).hexdigest()


def _loader(
    pack: str, fmt: str, workers: int, batch_size: int, check_ranks: bool = True, spawn: bool = False
) -> tuple[DataLoader, object, object]:
    if fmt in ("lmdb", "block", "token"):
        from packdata.reading.datasets import LMDBDataset
        from packdata.reading.samplers import BlockShuffleSampler
        from packdata.reading.text import TokenBucketSampler

        dataset = LMDBDataset(pack, decode=sha1)
        if fmt == "token":
            batches = TokenBucketSampler(dataset, max_tokens=4096, max_samples=batch_size, seed=0)
            return DataLoader(dataset, batch_sampler=batches, num_workers=workers), batches, dataset
        if fmt == "lmdb":
            sampler = DistributedSampler(dataset, shuffle=True, seed=0)
        else:
            sampler = BlockShuffleSampler(dataset, block_size=4, window=2, seed=0, check_ranks=check_ranks)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers), sampler, dataset
    from packdata.reading.streaming import TFRecordDataset

    dataset = TFRecordDataset(pack, decode=sha1, shuffle=True, seed=0, shuffle_buffer=8)
    context = "spawn" if spawn and workers else None
    return (
        DataLoader(dataset, batch_size=batch_size, num_workers=workers, multiprocessing_context=context),
        dataset,
        dataset,
    )


def _open_around_append(args: argparse.Namespace, rank: int) -> tuple[DataLoader, object, object]:
    """Rank 0's loader over the pack before ``convert SRC PACK --append``, rank 1's after it."""
    if rank == 0:
        built = _loader(args.pack, args.format, args.workers, args.batch_size)
        convert(args.append, args.pack, append=True, progress=False)
        _launcher_store().set("ddp-worker/appended", "1")
    else:  # waits at torchrun's store: the group's short --timeout bounds the check, not how long an append takes
        _launcher_store().wait(["ddp-worker/appended"])
        built = _loader(args.pack, args.format, args.workers, args.batch_size)
    return built


def _launcher_store() -> dist.TCPStore:
    """A client of torchrun's store (``MASTER_ADDR``/``MASTER_PORT``), waiting as long as torch's default 30 minutes
    (the test's run timeout fails a hang first)."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(minutes=30), wait_for_workers=False)


def _meet(rank: int, world: int) -> None:
    """Wait at torchrun's store until every rank is up: ranks whose start load set apart by more than the group's
    short --timeout (their imports) then never fail init_process_group, which waits for its peers that long."""
    store = _launcher_store()
    store.set(f"ddp-worker/up/{rank}", "1")
    store.wait([f"ddp-worker/up/{r}" for r in range(world)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("pack")
    parser.add_argument("out")
    parser.add_argument("--format", choices=["lmdb", "tfrecord", "block", "token"], required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--before-init", action="store_true")
    parser.add_argument("--append")
    parser.add_argument("--rank1-pack")
    parser.add_argument("--only-rank0", action="store_true")
    parser.add_argument("--no-check-ranks", dest="check_ranks", action="store_false")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--public-store", action="store_true")
    parser.add_argument("--spawn", action="store_true")
    parser.add_argument("--no-set-epoch", dest="set_epoch", action="store_false")
    args = parser.parse_args()

    timeout = timedelta(seconds=args.timeout)
    if args.before_init:
        rank, world = int(os.environ.pop("RANK")), int(os.environ.pop("WORLD_SIZE"))
        del os.environ["LOCAL_RANK"]
        loader, epoch_owner, dataset = _loader(args.pack, args.format, args.workers, args.batch_size, spawn=args.spawn)
        _meet(rank, world)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    else:
        _meet(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
        dist.init_process_group("gloo", timeout=timeout)
        if args.public_store:
            del dist.distributed_c10d._get_default_store
        rank, world = dist.get_rank(), dist.get_world_size()
        if args.append:
            loader, epoch_owner, dataset = _open_around_append(args, rank)
        else:
            pack = args.rank1_pack if args.rank1_pack and rank == 1 else args.pack
            loader, epoch_owner, dataset = _loader(pack, args.format, args.workers, args.batch_size, args.check_ranks)
    report: dict = {"rank": rank, "world": world, "pid": os.getpid(), "epochs": []}
    try:
        if args.format == "lmdb" and (args.append or args.rank1_pack):
            from packdata.reading.ranks import check_same_pack

            check_same_pack(dataset)  # DistributedSampler checks nothing
        for epoch in range(0 if args.only_rank0 and rank != 0 else args.epochs):
            if args.set_epoch:
                epoch_owner.set_epoch(epoch)  # type: ignore[attr-defined]
            seen: list[str] = []
            steps = 0
            for digests, _labels in loader:
                seen.extend(digests)
                steps += 1
                if not args.only_rank0:  # what DDP does every step: a collective every rank must join
                    dist.all_reduce(torch.ones(1))
            report["epochs"].append({"epoch": epoch, "steps": steps, "digests": seen})
    except PackdataError as exc:
        if not (args.before_init or args.append or args.only_rank0):
            raise
        report["error"] = str(exc)
    if not args.only_rank0:
        dist.barrier()
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
