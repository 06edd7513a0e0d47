"""Where a process sits in a distributed job, and one check that every rank reads the same pack the same way.

The first time a reader shards an epoch in the main process, its sample count,
pack (its shards' checksums) and order options are compared across the ranks
of the initialised ``torch.distributed`` group, through the group's store; see
``docs/architecture.md`` (Ranks read the same pack) for why there, and why so.
"""

from __future__ import annotations

import itertools
import json
import os
from datetime import timedelta
from typing import Any

from torch.utils.data import get_worker_info

from packdata.errors import ConfigError, RankMismatchError
from packdata.pack.manifest import Manifest

__all__ = ["RankCheck", "check_rank_world", "check_same_pack", "resolve_rank_world"]

_CHECKS = itertools.count()  # this process's checks so far: every rank makes the same ones, in the same order
_SHOWN = 3  # ranks that differ from rank 0 named in the error


def pack_of(data: Any) -> tuple[str | None, str | None]:
    """``(where, shards' digest)`` of a pack dataset's pack; ``(None, None)`` for anything else (a length, a list).

    ``where`` is the pack as the dataset's errors name it: the URL the user
    passed for a pack read from object storage, not the folder its manifest is cached in.
    """
    pack = getattr(data, "pack", None)
    manifest = getattr(pack, "manifest", None)
    if not isinstance(manifest, Manifest):
        return None, None
    where = getattr(data, "where", None)
    return where if isinstance(where, str) else os.fspath(pack.path), manifest.shards_digest()  # type: ignore[union-attr]


class RankCheck:
    """A reader's facts, compared across ranks once, the first time it is called in the main process.

    Plain data: it pickles with the reader, and a ``DataLoader`` worker's copy never compares.

    Args:
        enabled: ``False`` never compares (readers built on some ranks only).
        where: this rank's pack, named in the error.
        facts: what must be equal on every rank: numbers, strings, bools, None
            (numpy's scalars taken as Python's).
    """

    def __init__(self, enabled: bool, where: str | None, **facts: Any) -> None:
        self.pending, self.where, self.meets = enabled, where, False
        self.facts = json.loads(json.dumps(facts, default=_plain))
        self.world_size: int | None = None  # the reader's, once noted: its pickled copies note the group again
        self.group: tuple[int, int] | None = None  # (rank, world size) of the group where a copy was pickled

    def __getstate__(self) -> dict[str, Any]:
        """Note the group again as the copy leaves: a spawned worker's copy sees no group of its own."""
        import torch.distributed as dist

        state = dict(self.__dict__)
        if self.world_size is not None and not self.meets:
            state["meets"] = self.pending and can_compare(self.world_size)
        if self.world_size is not None and dist.is_available() and dist.is_initialized():
            state["group"] = dist.get_rank(), dist.get_world_size()
        return state

    def __call__(self, owner: str, world_size: int) -> None:
        """Compare, unless done already or in a ``DataLoader`` worker (see :func:`_same_on_every_rank`)."""
        if self.pending and get_worker_info() is None:
            _same_on_every_rank(owner, world_size, self.where, self.facts)
            self.pending = False

    def note_group(self, world_size: int) -> None:
        """Note whether the ranks can compare now, where the reader is built, and again where it is pickled.

        Its copies in workers keep what was noted: a forked worker's as the
        reader was at the fork, a spawned one's as it was pickled to it (the
        ``DataLoader``'s iterator, in the main process, after ``init_process_group``).
        """
        self.world_size = world_size
        self.meets = self.pending and can_compare(world_size)

    def refuse_unchecked(self, owner: str, rank: int, world_size: int) -> None:
        """In a ``DataLoader`` worker: raise if the main process could have compared the ranks but never did.

        An iterable reader's passes run in its workers, where no rank meets
        another; its main process compares at ``set_epoch``. Without it nothing
        would ever be compared.

        Whether the main process could compare was noted where the reader was
        built or pickled (:meth:`note_group`); a reader built before
        ``init_process_group`` (ranks from ``RANK``/``WORLD_SIZE``) is refused in
        forked workers, which see the group their parent made since, and in
        spawned ones, whose copy was pickled once the group was made.

        Raises:
            ConfigError: naming ``set_epoch`` and ``check_ranks=False``.
        """
        if self.pending and (self.meets or can_compare(world_size)):
            raise ConfigError(
                f"{owner} is read by DataLoader workers on rank {rank} of {world_size}, but set_epoch was never "
                "called on it: the ranks never compared the pack they read, and a rank that opened another state "
                "of it would lose or repeat samples silently",
                path=self.where,
                hint="Call set_epoch(epoch) on every rank before each epoch's loader iteration (it compares the "
                "ranks once, and gives each epoch its own order), or pass check_ranks=False where the dataset is "
                "read on some ranks only",
            )


def _plain(value: Any) -> Any:
    """A fact JSON does not hold as it is: a numpy scalar's Python value, else its type's name (no address)."""
    return value.item() if hasattr(value, "item") else type(value).__name__


def check_same_pack(dataset: Any) -> None:
    """Raise unless every rank's ``dataset`` has the same pack: call it on every rank, once, before the first epoch.

    For a dataset read through a sampler packdata does not make (``torch``'s
    ``DistributedSampler``); ``BlockShuffleSampler``, ``TokenBucketSampler`` and
    ``TFRecordDataset`` check by themselves. Does nothing without an initialised
    ``torch.distributed`` group of several ranks.

    Raises:
        RankMismatchError: naming each differing rank's sample count and pack.
    """
    import torch.distributed as dist

    path, digest = pack_of(dataset)
    # the pack's count: a TFRecordDataset's len() is its rank's share, read as the pack's in the error
    samples = dataset.pack.manifest.num_samples if digest is not None else len(dataset)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    _same_on_every_rank(type(dataset).__name__, world, path, {"samples": samples, "pack": digest})


def _same_on_every_rank(owner: str, world_size: int, where: str | None, facts: dict[str, Any]) -> None:
    """Raise on every rank unless every rank's ``facts`` equal rank 0's.

    Compares only where ``world_size`` is the initialised default group's
    (a reader of ``world_size=1``, or of a sub-group, shards across no other
    ranks of it). Every rank of the group must make the same checks in the
    same order: each waits for all the others.

    Raises:
        RankMismatchError: the facts differ (on every rank, naming them by rank and
            each rank's pack), or not every rank came within the store's timeout.
    """
    import torch.distributed as dist

    if not can_compare(world_size):
        return
    rank, key = dist.get_rank(), f"packdata/same-pack/{next(_CHECKS)}"
    mine = {"reader": owner, **facts}
    store = None
    try:
        store = _group_store()
        store.set(f"{key}/here/{rank}", "1")
        if rank == 0:
            store.set(f"{key}/0", json.dumps({"at": where, **mine}))
        first = json.loads(store.get(f"{key}/0"))
        if {k: v for k, v in first.items() if k != "at"} != mine:
            slot = store.add(f"{key}/differ", 1)
            store.set(f"{key}/differ/{slot}", json.dumps({"rank": rank, "at": where, **mine}))
        if store.add(f"{key}/arrived", 1) == world_size:
            store.set(f"{key}/done", "1")
        store.wait([f"{key}/done"])
        differ = store.add(f"{key}/differ", 0)
        shown = [json.loads(store.get(f"{key}/differ/{s}")) for s in range(1, min(differ, _SHOWN) + 1)]
    except RuntimeError as exc:  # the store's timeout (DistStoreError), or the store's host gone
        raise RankMismatchError(
            f"rank {rank} of {world_size} waited for the other ranks to compare what their {owner} reads, and "
            f"{_missing(store, key, world_size)} ({str(exc).splitlines()[0]})",
            path=where,
            hint=f"Build the {owner} on every rank, in the same order, or pass check_ranks=False where it is "
            "built on some ranks only",
        ) from exc
    if differ:
        raise _disagreement(owner, where, {"rank": 0, **first}, shown, differ)


def _missing(store: Any, key: str, world_size: int) -> str:
    """Which ranks never came to the check ``key``, and for how long they were waited for, as the error says it."""
    try:
        missing = [r for r in range(world_size) if not store.check([f"{key}/here/{r}"])]
        waited = f" within {store.timeout}"
    except (AttributeError, RuntimeError):  # no store made, or its host gone: nothing to ask
        return "not all came"
    if not missing:
        return f"not all came{waited}"
    return f"rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} never came{waited}"


def can_compare(world_size: int) -> bool:
    """Whether this process's ranks can compare a reader of ``world_size``: see :func:`_same_on_every_rank`."""
    import torch.distributed as dist

    if world_size < 2 or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != world_size:
        return False
    default_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    if default_store is not None:
        return default_store() is not None  # the MPI backend makes none
    return _LAUNCHER_STORE.issubset(os.environ)


_LAUNCHER_STORE = {"TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"}  # torchrun's: the group's env:// store


def _group_store() -> Any:
    """The store the default group was made with, or a client of the one torchrun's group met at.

    torch's ``_get_default_store`` is private, but it is the group's own store
    (whatever ``init_method`` or launcher made it) with the group's timeout;
    torch 2.1 to 2.13 have it. A torch without it: under ``torchrun``, whose
    ranks' ``env://`` group meets at ``MASTER_ADDR:MASTER_PORT``, a client of
    that store (keys under a prefix of packdata's own), waiting as long as the
    group does (:func:`_group_timeout`).
    """
    import torch.distributed as dist

    default_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    if default_store is not None:
        return default_store()
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    client = dist.TCPStore(host, port, is_master=False, timeout=_group_timeout(), wait_for_workers=False)
    return dist.PrefixStore("packdata", client)


def _group_timeout() -> timedelta:
    """The default group's timeout (``init_process_group(timeout=)``), else ``torch``'s default of 30 minutes.

    torch keeps it in each backend's options (``_timeout``, private too, but
    older than ``_get_default_store``); a torch without them gives its default.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    try:
        group = dist.distributed_c10d._get_default_group()
        for device in getattr(group, "_device_types", [torch.device("cpu")]):
            timeout = group._get_backend(device).options._timeout
            if isinstance(timeout, timedelta):
                return timeout
    except (AttributeError, RuntimeError, ValueError):  # no such call, or no backend for the device
        pass
    return default_pg_timeout


def _disagreement(
    owner: str, where: str | None, first: dict[str, Any], shown: list[dict[str, Any]], differ: int
) -> RankMismatchError:
    """The error naming rank 0's facts and the first differing ranks', the facts that differ only."""
    names = [k for k in first if k not in ("rank", "at") and any(s.get(k) != first[k] for s in shown)]

    def facts(entry: dict[str, Any]) -> str:
        return ", ".join(f"{k}={entry.get(k)!r}" for k in names) + (f" ({entry['at']})" if entry.get("at") else "")

    ranks = "; ".join(f"rank {s['rank']} has {facts(s)}" for s in shown)
    more = f"; and {differ - len(shown)} more ranks differ" if differ > len(shown) else ""
    if "reader" in names:
        hint = "Build the same readers on every rank, in the same order"
    elif {"samples", "pack"} & set(names):
        hint = (
            "Open the pack on every rank from the same state: append to it or convert it again between jobs, "
            "or give the job a staged copy (packdata stage)"
        )
    else:
        hint = "Pass the same seed and options on every rank"
    return RankMismatchError(
        f"the ranks of this job disagree on what their {owner} reads: rank 0 has {facts(first)}; {ranks}{more}: "
        "each rank would split its own view, so samples would be lost or read twice",
        path=where,
        hint=hint,
    )


def resolve_rank_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """This process's ``(rank, world_size)``.

    Arguments win; else an initialised ``torch.distributed`` group; else the
    ``RANK`` and ``WORLD_SIZE`` environment variables (set by ``torchrun``);
    else ``(0, 1)``. A world of several ranks needs this process's rank from
    one of them: rank 0 on every process would read every sample once per rank.
    So does a ``RANK`` or ``LOCAL_RANK`` other than 0 without ``WORLD_SIZE``.

    Raises:
        ValueError: the values are out of range, not integers, or the rank of a
            world of several ranks (or the world of a rank other than 0) is not known.
    """
    given_rank, given_world = rank, world_size
    if rank is None or world_size is None:
        found_rank, found_world = None, 1
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            found_rank, found_world = dist.get_rank(), dist.get_world_size()
        elif "WORLD_SIZE" in os.environ:
            found_world = _environment_int("WORLD_SIZE")
            found_rank = _environment_int("RANK") if "RANK" in os.environ else None
        elif world_size is None:
            for name in ("RANK", "LOCAL_RANK"):
                if name in os.environ and _environment_int(name) != 0:
                    raise ValueError(
                        f"world_size should be given with {name}={os.environ[name]!r}, but got none: no world_size= "
                        "argument, no initialised torch.distributed group and no WORLD_SIZE environment variable"
                    )
        world_size = found_world if world_size is None else world_size
        if rank is None and found_rank is None and world_size > 1:
            raise ValueError(
                f"rank should be given for world_size={world_size}, but got none: no rank= argument, no "
                "initialised torch.distributed group and no RANK environment variable"
            )
        rank = (found_rank or 0) if rank is None else rank
    if world_size < 1:
        raise ValueError(f"world_size should be at least 1, but got world_size={world_size}{_env_note(given_world)}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank should be in [0, {world_size - 1}], but got rank={rank}{_env_note(given_rank)}")
    return rank, world_size


def _env_note(given: int | None) -> str:
    """Where a rank or world size came from, when the environment gave it (the user typed no such argument)."""
    import torch.distributed as dist

    if given is not None or (dist.is_available() and dist.is_initialized()) or "WORLD_SIZE" not in os.environ:
        return ""
    return f" (from the environment: RANK={os.environ.get('RANK')!r}, WORLD_SIZE={os.environ['WORLD_SIZE']!r})"


def check_rank_world(
    owner: str,
    given: tuple[int | None, int | None],
    resolved: tuple[int, int],
    seen: tuple[int, int] | None = None,
) -> None:
    """Raise unless ``torch.distributed``, if initialised, still gives the ``(rank, world_size)`` found at construction.

    ``given`` are the ``rank=``/``world_size=`` arguments, ``resolved`` what
    :func:`resolve_rank_world` made of them. A reader built before
    ``init_process_group`` by a launcher that sets no ``RANK``/``WORLD_SIZE``
    (``mp.spawn``) took rank 0 of 1, so every rank would read every sample.
    ``seen``: in a process with no group of its own (a spawned ``DataLoader``
    worker), the ``(rank, world_size)`` of the group where the reader was
    pickled to it (:attr:`RankCheck.group`).

    Raises:
        ConfigError: naming both places.
    """
    import torch.distributed as dist

    if None not in given:
        return
    if dist.is_available() and dist.is_initialized():
        now = resolve_rank_world(*given)
    elif seen is not None:
        now = (seen[0] if given[0] is None else given[0], seen[1] if given[1] is None else given[1])
    else:
        return
    if now != resolved:
        raise ConfigError(
            f"{owner} was built as rank {resolved[0]} of {resolved[1]}, but torch.distributed says rank {now[0]} "
            f"of {now[1]}: it was built before init_process_group, and each rank would read the wrong samples",
            hint="Build it after init_process_group, or pass rank= and world_size=",
        )


def _environment_int(name: str) -> int:
    """The integer environment variable ``name`` (``RANK``, ``WORLD_SIZE``), or ValueError naming it."""
    try:
        return int(os.environ[name])
    except ValueError:
        raise ValueError(f"{name} should be an integer, but got {name}={os.environ[name]!r}") from None
