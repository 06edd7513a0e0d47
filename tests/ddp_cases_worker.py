"""One rank of several short DDP reading cases, launched once by ``tests/test_ddp_cases.py`` through torchrun.

Every rank runs the cases of ``CONFIG`` (a JSON file) in order, on the gloo
backend, and writes ``OUT/rank{RANK}.json``: per case, what its loader yielded
(the samples' identities, per epoch) or the ``PackdataError`` it raised. Ranks
meet at torchrun's store before ``init_process_group`` and after each case, so one
case's refusal never leaks into the next, and the group's timeout bounds only the
checks under test, never how far apart load sets the ranks' start or their cases.

Cases (``kind``):

- ``sampler``: ``LMDBDataset`` (``TFRecordIndexedDataset`` with ``tfrecord``)
  + torch's ``DistributedSampler`` (``drop_last``, ``num_workers``,
  ``multiprocessing_context``, ``persistent_workers``, ``epochs`` with
  ``set_epoch``); the batches go through ``__getitems__``.
  A single-field pack yields each sample's SHA-1 (computed in the worker's
  decode), a multi-field pack its ``__key__``.
- ``url_pack``: a ``TFRecordDataset`` at a URL (``storage_options``), ``url``
  on every rank but rank 1, which opens ``other`` (another pack), then
  ``check_same_pack``: it must refuse, naming each rank's URL.
- ``stream``: a ``TFRecordDataset`` read by 2 workers per rank, with or without
  ``set_epoch``, ``check_ranks``, ``context``, ``persistent`` and ``epochs`` as given;
  with ``before_init``, the dataset is built before ``init_process_group``.
- ``public_store``: as a torch without the private ``_get_default_store``
  (removed for the case), a ``BlockShuffleSampler`` whose seed is 1 on rank 1
  only: the check must still refuse, through torchrun's store.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from packdata.errors import PackdataError
from packdata.reading.datasets import LMDBDataset
from packdata.reading.tfrecord_indexed import TFRecordIndexedDataset


def sha1(data: bytes) -> str:
    """The decode step: a sample's identity, computed in the DataLoader worker."""
    return hashlib.sha1(data).hexdigest()


def as_list(batch: list[Any]) -> list[Any]:
    """Collate: the samples as they came (a multi-field sample's bytes do not stack)."""
    return batch


def _identity(sample: Any) -> str:
    return sample["__key__"] if isinstance(sample, dict) else sample[0]


def _sampler_case(case: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    fields = case.get("fields", False)
    reader = TFRecordIndexedDataset if case.get("tfrecord") else LMDBDataset
    dataset = reader(case["pack"], decode="bytes" if fields else sha1)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0, drop_last=case["drop_last"])
    workers = case["num_workers"]
    loader = DataLoader(
        dataset,
        batch_size=4,
        sampler=sampler,
        num_workers=workers,
        collate_fn=as_list,
        multiprocessing_context=case.get("context") if workers else None,
        persistent_workers=case.get("persistent", False),
    )
    epochs = []
    for epoch in range(case.get("epochs", 1)):
        sampler.set_epoch(epoch)
        seen, steps = [], 0
        for batch in loader:
            seen += [_identity(sample) for sample in batch]
            steps += 1
        epochs.append({"seen": seen, "steps": steps})
    return {"epochs": epochs}


def _url_pack_case(case: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    from packdata.reading.ranks import check_same_pack
    from packdata.reading.streaming import TFRecordDataset

    cache = out / f"cache{rank}"
    cache.mkdir(exist_ok=True)
    url = case["other"] if rank == 1 else case["url"]
    check_same_pack(TFRecordDataset(url, storage_options=case["storage_options"], cache_dir=cache))
    return {}


def _stream_dataset(case: dict[str, Any]) -> Any:
    from packdata.reading.streaming import TFRecordDataset

    return TFRecordDataset(case["pack"], decode=sha1, shuffle_buffer=8, check_ranks=case["check_ranks"])


def _stream_case(case: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    dataset = case["built"] if "built" in case else _stream_dataset(case)
    loader = DataLoader(
        dataset,
        batch_size=4,
        num_workers=2,
        collate_fn=as_list,
        multiprocessing_context=case.get("context"),
        persistent_workers=case.get("persistent", False),
    )
    epochs = []
    for epoch in range(case.get("epochs", 1)):
        if case["set_epoch"]:
            dataset.set_epoch(epoch)
        epochs.append({"seen": [digest for batch in loader for digest, _ in batch]})
    return {"epochs": epochs}


def _public_store_case(case: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    from packdata.reading.samplers import BlockShuffleSampler

    private = dist.distributed_c10d._get_default_store
    del dist.distributed_c10d._get_default_store
    try:
        sampler = BlockShuffleSampler(LMDBDataset(case["pack"]), block_size=4, seed=1 if rank == 1 else 0)
        return {"indices": list(sampler)}
    finally:
        dist.distributed_c10d._get_default_store = private


def _meet(name: str, rank: int, world: int) -> None:
    """Wait at torchrun's store (``MASTER_ADDR``/``MASTER_PORT``) until every rank set the key ``name``: as long as
    torch's default 30 minutes (the test's run timeout fails a hang first), not the group's 60 s, which ranks whose
    start (their imports) or case load delays by more than that would otherwise fail at init or at a barrier."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(minutes=30), wait_for_workers=False)
    store.set(f"ddp-cases/{name}/{rank}", "1")
    store.wait([f"ddp-cases/{name}/{r}" for r in range(world)])


CASES = {
    "sampler": _sampler_case,
    "stream": _stream_case,
    "url_pack": _url_pack_case,
    "public_store": _public_store_case,
}


def main() -> None:
    config, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    for case in config.values():  # built from torchrun's RANK and WORLD_SIZE, before the group exists
        if case.get("before_init"):
            case["built"] = _stream_dataset(case)
    _meet("up", int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    report: dict[str, Any] = {"rank": rank, "world": dist.get_world_size(), "cases": {}}
    for name, case in config.items():
        try:
            result = CASES[case["kind"]](case, rank, out)
        except PackdataError as exc:
            result = {"error": str(exc)}
        report["cases"][name] = result
        _meet(f"done/{name}", rank, report["world"])
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
