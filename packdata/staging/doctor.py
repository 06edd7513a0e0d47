"""``packdata doctor``: one screen of machine facts, warnings, and first DataLoader settings for a pack.

The facts come from :mod:`packdata.host` (memory, swap, cgroup limit, tmpfs
use, CPUs, GPUs). For a pack it adds what decides read speed before any
benchmark: how many shards there are against the ``ranks x workers`` that will
read them, how uneven the shards are, and whether the files sit on a network
or spinning filesystem (then ``packdata stage`` it first).

The recommended first ``num_workers`` is about 3/4 of the physical cores this
process may use, cut to what half the usable memory holds at
:data:`packdata.host.cores.WORKER_BYTES` per worker (the same estimate ``packdata tune`` starts
from); ``pin_memory`` is recommended when a CUDA GPU is present. ``packdata
tune`` measures from there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packdata.errors import ConfigError
from packdata.formats import get_format
from packdata.host.cores import recommend_workers, usable_cores
from packdata.host.facts import SystemFacts, find_mount, gather_facts, is_network_fs, is_rotational, read_mounts
from packdata.host.memory import SafetyWarning, memory_warnings
from packdata.pack.manifest import read_manifest
from packdata.pack.urls import display_url, is_url
from packdata.staging.marker import read_marker
from packdata.staging.status import damaged_shards
from packdata.units import format_size

__all__ = ["DoctorReport", "PackReport", "doctor"]

_SKEW_LIMIT = 1.5
_SHARDS_PER_READER = 2


@dataclass
class PackReport:
    """What the doctor found about one pack."""

    path: str
    format: str
    num_samples: int
    shards: int
    total_bytes: int
    shard_bytes_min: int
    shard_bytes_median: int
    shard_bytes_max: int
    skew: float  # largest shard over the median, the last (usually partial) shard left out
    readers: int  # ranks x workers that will read it
    fstype: str | None
    network: bool | None
    rotational: bool | None
    staged_from: str | None  # the origin when this is a staged pack
    shards_elsewhere: int  # shards read from outside the pack (left behind by a partial stage)


@dataclass
class DoctorReport:
    """Facts, warnings and recommendations; :meth:`lines` renders one screen."""

    facts: SystemFacts
    warnings: list[SafetyWarning]
    num_workers: int
    pin_memory: bool
    reasons: list[str]
    cores: int
    pack: PackReport | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "facts": self.facts.to_dict(),
            "warnings": [dataclasses.asdict(w) for w in self.warnings],
            "recommended": {"num_workers": self.num_workers, "pin_memory": self.pin_memory, "reasons": self.reasons},
            "cores": self.cores,
            "pack": dataclasses.asdict(self.pack) if self.pack else None,
            "notes": self.notes,
        }

    def lines(self) -> list[str]:
        """The report as lines of text for a terminal."""
        f, mem, fs = self.facts, self.facts.memory, format_size
        out = [
            f"memory:   {fs(mem.mem_available)} available of {fs(mem.mem_total)}, shmem {fs(mem.shmem)}, "
            f"swap {fs(mem.swap_used)} used of {fs(mem.swap_total)}",
        ]
        cg = f.cgroup
        if cg.version is not None:
            limit = fs(cg.limit) if cg.limit is not None else "none"
            out.append(f"cgroup:   v{cg.version}, limit {limit}, usage {fs(cg.usage or 0)}")
        for t in f.tmpfs:
            out.append(f"tmpfs:    {t.mountpoint}: {fs(t.used_bytes)} used of {fs(t.size_bytes)}")
        allowed = f" ({f.cpus_allowed} allowed)" if f.cpus_allowed is not None else ""
        quota = f", cgroup quota {f.cpu_quota:g} CPUs" if f.cpu_quota is not None else ""
        out.append(f"cpus:     {f.cpu_physical} physical, {f.cpu_logical} logical{allowed}{quota}, {self.cores} usable")
        if f.gpus:
            for g in f.gpus:
                out.append(f"gpu {g.index}:    {g.name}, {fs(g.free_bytes)} free of {fs(g.total_bytes)}")
        else:
            out.append("gpus:     none found (NVML and torch.cuda)")
        p = self.pack
        if p is not None:
            where = p.fstype or "unknown"
            if p.network:
                where += ", network"
            if p.rotational:
                where += ", rotational disk"
            samples = f"{p.num_samples:,} sample{'s' * (p.num_samples != 1)}"
            out.append(f"pack:     {p.path} ({p.format}, {samples}, {fs(p.total_bytes)}, on {where})")
            out.append(
                f"shards:   {p.shards:,} for {p.readers:,} reader{'s' * (p.readers != 1)}; "
                f"sizes {fs(p.shard_bytes_min)} / "
                f"{fs(p.shard_bytes_median)} / {fs(p.shard_bytes_max)} (min / median / max), skew {p.skew:.2f}"
            )
            if p.staged_from:
                out.append(f"staged:   from {p.staged_from}, {p.shards_elsewhere} shards still read from there")
        out.append(f"start with: DataLoader(..., num_workers={self.num_workers}, pin_memory={self.pin_memory})")
        out.extend(f"  - {r}" for r in self.reasons)
        out.extend(f"note: {n}" for n in self.notes)
        out.extend(f"warning [{w.code}]: {w.message}" for w in self.warnings)
        return out


def _pack_report(
    path: Path, ranks: int, workers: int, root: str | os.PathLike
) -> tuple[PackReport, list[SafetyWarning]]:
    manifest = read_manifest(path)
    sizes = [s.bytes for s in manifest.shards]
    body = sizes[:-1] if len(sizes) >= 3 else sizes
    median = int(statistics.median(body)) if body else 0
    skew = max(body) / median if body and median else 1.0
    mounts = read_mounts(root)
    mount = None
    with contextlib.suppress(LookupError):
        mount = find_mount(path, mounts)
    elsewhere = [s for s in manifest.shards if Path(s.file).is_absolute()]
    marker = read_marker(path)
    origin = (marker.get("origin") or None) if marker else None
    report = PackReport(
        path=os.fspath(path),
        format=manifest.format,
        num_samples=manifest.num_samples,
        shards=len(sizes),
        total_bytes=sum(sizes),
        shard_bytes_min=min(sizes, default=0),
        shard_bytes_median=median,
        shard_bytes_max=max(sizes, default=0),
        skew=round(skew, 3),
        readers=ranks * max(workers, 1),
        fstype=mount.fstype if mount else None,
        network=is_network_fs(mount.fstype) if mount else None,
        rotational=is_rotational(path, root),
        staged_from=origin,
        shards_elsewhere=len(elsewhere),
    )
    warnings: list[SafetyWarning] = []
    if manifest.staged_from is not None and (damaged := damaged_shards(path, manifest)):
        more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
        warnings.append(
            SafetyWarning(
                "staged-damaged",
                f"a staged shard changed since it was staged: {damaged[0]}{more}, so readers fail on it; "
                f"stage it again: packdata stage {manifest.staged_from} --to {path.parent} --name {path.name}",
            )
        )
    if ranks > manifest.num_samples:  # each rank is padded to one sample a step: the extra ones are repeats
        n, repeats = manifest.num_samples, ranks - manifest.num_samples
        warnings.append(
            SafetyWarning(
                "more-ranks-than-samples",
                f"the pack holds {n:,} samples for {ranks:,} ranks: every epoch repeats {repeats:,} samples so that "
                "each rank reads one (with drop_last=True no rank reads any); run fewer ranks or pack more samples",
            )
        )
    readers = report.readers
    streams = get_format(manifest.format).streams_by_shard
    if streams and report.shards < readers:
        warnings.append(
            SafetyWarning(
                "few-shards",
                f"{report.shards} shards for {readers} readers ({ranks} ranks x {max(workers, 1)} workers): "
                "readers share shards by record ranges and shuffling by shard order mixes little; convert with "
                f"more shards (--shard-size or --shard-samples), at least {readers * _SHARDS_PER_READER}",
            )
        )
    elif streams and report.shards % readers and report.shards < 8 * readers:
        warnings.append(
            SafetyWarning(
                "uneven-shards",
                f"{report.shards} shards do not divide among {readers} readers: some readers get one shard more "
                f"per epoch; a multiple of {readers} shards balances them",
            )
        )
    if skew > _SKEW_LIMIT:
        warnings.append(
            SafetyWarning(
                "shard-skew",
                f"the largest shard is {skew:.1f}x the median ({format_size(max(body))} vs {format_size(median)}): "
                "readers of large shards finish last; convert with --shard-size for even shards",
            )
        )
    if report.network:
        warnings.append(
            SafetyWarning(
                "network-fs",
                f"the pack sits on a network filesystem ({report.fstype}): every epoch crosses the network; "
                f"stage it on local disk or RAM first: packdata stage {path} --to /local/nvme (or --tmpfs SIZE)",
            )
        )
    if report.rotational:
        warnings.append(
            SafetyWarning(
                "rotational-disk",
                "the pack sits on a spinning disk: random reads seek; stage it onto NVMe or tmpfs "
                f"(packdata stage {path} --to DIR), or read it sequentially with TFRecordDataset",
            )
        )
    if elsewhere:
        warnings.append(
            SafetyWarning(
                "partly-staged",
                f"{len(elsewhere)} of {report.shards} shards are read from their originals "
                f"({Path(elsewhere[0].file).parent}); a larger staging budget would hold them",
            )
        )
    return report, warnings


def doctor(
    pack: str | os.PathLike | None = None,
    *,
    ranks: int = 1,
    workers: int | None = None,
    root: str | os.PathLike = "/",
    include_gpus: bool = True,
    reserve: int | None = None,
) -> DoctorReport:
    """Facts, warnings and first DataLoader settings for this machine and, when given, ``pack``.

    Args:
        pack: a pack to examine (shards, skew, filesystem).
        ranks: distributed ranks that will read the pack.
        workers: DataLoader workers per rank (default: the recommended number).
        root: filesystem root holding ``proc/`` and ``sys/`` (tests pass crafted trees).
        include_gpus: probe GPUs (NVML, else torch.cuda).
        reserve: memory kept free in the memory checks (default: see :mod:`packdata.host.memory`).

    Raises:
        PackFormatError: ``pack`` is not a readable pack.
        ConfigError: ``pack`` is a URL (a pack in object storage is looked at once staged).
        ValueError: ``ranks`` or ``workers`` is negative.
    """
    if isinstance(pack, str) and is_url(pack):
        shown = display_url(pack)
        raise ConfigError(
            f"{shown}: doctor looks at a pack on this machine's disks (its file system and shards)",
            hint=f"Stage it first (packdata stage {shown} --to DIR) and run doctor on the staged copy",
        )
    if ranks < 1:
        raise ValueError(f"ranks should be at least 1, but got ranks={ranks}")
    if workers is not None and workers < 0:
        raise ValueError(f"workers should be at least 0, but got workers={workers}")
    facts = gather_facts(root, path=pack, include_gpus=include_gpus)
    warnings = memory_warnings(facts, reserve=reserve)
    cores = usable_cores(facts)
    num_workers, why = recommend_workers(facts, cores=cores)
    pin = bool(facts.gpus)
    reasons = [
        why,
        "pin_memory=True: a CUDA GPU is present, pinned batches copy asynchronously"
        if pin
        else "pin_memory=False: no CUDA GPU found",
    ]
    report = DoctorReport(facts, warnings, num_workers, pin, reasons, cores)
    if pack is not None:
        report.pack, extra = _pack_report(Path(pack), ranks, num_workers if workers is None else workers, root)
        report.warnings.extend(extra)
        if not get_format(report.pack.format).streams_by_shard:
            report.notes.append("LMDBDataset reads by index: the shard count matters little to it (TFRecord streams)")
    target = pack if pack is not None else "PACK"
    report.notes.append(f"measure from here: packdata tune {target}" + (" --device cuda" if facts.gpus else ""))
    return report
