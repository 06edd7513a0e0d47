"""Commands for fast storage and the machine: stage, unstage, doctor."""

from __future__ import annotations

import json
from typing import Any

import click

from packdata.cli.common import _SIZE_HELP, _count, _friendly, _in_flags, _json_object, _mb, _size

__all__ = ["doctor", "stage", "unstage"]


def _warn(warnings: Any) -> None:
    for w in warnings:
        click.secho(f"warning [{w.code}]: {w.message}", fg="yellow", err=True)


def _rate(bytes_per_second: float) -> str:
    from packdata.units import format_rate

    return format_rate(bytes_per_second)


@click.command()
@click.argument("pack", required=False, type=click.Path(path_type=str))
@click.option(
    "--to", "to", type=click.Path(file_okay=False, path_type=str), help="Stage into this directory (local NVMe)."
)
@click.option(
    "--tmpfs", callback=_size, help="Mount (or reuse) a tmpfs of this size and stage into it, e.g. 30G. " + _SIZE_HELP
)
@click.option(
    "--mount",
    type=click.Path(file_okay=False, path_type=str),
    help="The tmpfs mount point, and the default area. Default: /mnt/packdata.",
)
@click.option("--resize", is_flag=True, help="Remount an existing tmpfs with the --tmpfs size.")
@click.option(
    "--budget", callback=_size, help="Most bytes of shards to stage (hot shards), e.g. 200GB. Default: what fits."
)
@click.option("--shards", help="Shards to stage, by number or name, comma-separated, hottest first.")
@click.option("--name", help="Folder name of the staged pack in the area. Default: the pack's name.")
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    help="Parallel copy threads. Default: up to 4; from a PACK URL, 16 range downloads at a time.",
)
@click.option("--force", is_flag=True, help="Go ahead even when the memory checks refuse the tmpfs size.")
@click.option(
    "--reserve",
    callback=_size,
    help="Memory to keep free for training in the tmpfs checks, e.g. 8G (0B: none). Default: 10% of RAM, "
    "at least 4 GiB, at most half.",
)
@click.option(
    "--status",
    is_flag=True,
    help="List staged packs, sizes, free space and memory (in PACK or --mount DIR as an area).",
)
@click.option(
    "--cache-limit",
    callback=_size,
    help="For a PACK URL: most bytes the --to folder's staged copies may hold; the least recently used copies "
    "of remote packs that no reader has open are evicted first. Default: no limit.",
)
@click.option(
    "--storage-options",
    callback=_json_object,
    help='For a PACK URL: fsspec options as JSON, e.g. \'{"anon": true}\' or \'{"endpoint_url": "http://..."}\'.',
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@_friendly
def stage(pack: str | None, shards: str | None, status: bool, as_json: bool, quiet: bool, **options: Any) -> None:
    """Copy PACK's shards to fast storage (NVMe or a sized tmpfs) and verify them.

    The staged pack, AREA/NAME, has its own manifest: staged shards point at
    the copies, shards left behind (not named by --shards, or past --budget or
    the room free in the area) at the originals, so LMDBDataset(staged) and
    TFRecordDataset(staged) read the mix. A second run copies only what is
    missing or changed.

    \b
    Examples:
      sudo packdata stage --tmpfs 30G            # prepare /mnt/packdata (memory checks first)
      packdata stage /nfs/train.lmdb             # stage into /mnt/packdata/train.lmdb
      packdata stage /nfs/train.lmdb --to /nvme/stage --budget 200GB
      packdata stage /nfs/train --tmpfs 30G --shards 0,1,2
      packdata stage s3://bucket/train.lmdb --to /nvme/cache    # once per node; every rank may call it
      packdata stage --status
      packdata unstage /mnt/packdata/train.lmdb
    """
    from packdata.staging.remote import RemoteStageResult
    from packdata.staging.stage import stage as run_stage
    from packdata.staging.status import stage_status
    from packdata.staging.tmpfs import prepare_tmpfs

    if status:
        area = options.pop("mount")
        if any(v not in (None, False) for v in options.values()) or shards or (pack and area):
            raise click.UsageError("--status takes only an optional area (PACK or --mount DIR) and --json")
        report = stage_status(pack or area)
        if as_json:
            click.echo(json.dumps(report.to_dict(), indent=1))
            return
        mem = report.memory
        click.echo(
            f"memory: {_mb(mem['mem_available'])} available of {_mb(mem['mem_total'])}, "
            f"shmem {_mb(mem['shmem'])}, swap {_mb(mem['swap_used'])} used of {_mb(mem['swap_total'])}"
        )
        if not report.areas:
            click.echo("no staging areas (prepare one: sudo packdata stage --tmpfs 30G)")
        for area in report.areas:
            mark = ", mounted by packdata" if area.mounted_by_packdata else ""
            click.echo(
                f"{area.path} ({area.fstype or '?'}{mark}): {_mb(area.used)} used of {_mb(area.size)}, "
                f"{_mb(area.free)} free"
            )
            for p in area.packs:
                state = "" if p.complete else " INCOMPLETE (stage it again)"
                if p.complete and p.damaged:
                    more = f" (and {len(p.damaged) - 1} more)" if len(p.damaged) > 1 else ""
                    state = f" DAMAGED: {p.damaged[0]}{more} (stage it again)"
                elif p.complete and p.outdated:
                    state = " OUTDATED: its origin was converted again since; this copy reads the pack as it was "
                    state += "(stage it again for the new one)"
                click.echo(
                    f"  {p.path.name}: {_count(p.shards_staged, 'shard')} staged ({_mb(p.bytes_staged)}), "
                    f"{p.shards_left} left ({_mb(p.bytes_left)}) from {p.origin}{state}"
                )
            for name, target in area.links.items():
                click.echo(f"  {name}: a link to {target}, staged there, not here (see, or unstage, it there)")
        _warn(report.warnings)
        return
    if options["to"] and (options["tmpfs"] is not None or options["mount"]):
        raise click.UsageError("--to stages into a directory; --tmpfs/--mount into a tmpfs: give one")
    if options["resize"] and options["tmpfs"] is None:
        raise click.UsageError("--resize needs --tmpfs SIZE")
    if pack is None:
        if options["tmpfs"] is None:
            raise click.UsageError("give PACK to stage, --tmpfs SIZE to prepare a staging area, or --status")
        prepared = prepare_tmpfs(
            options["tmpfs"],
            mount=options["mount"] or "/mnt/packdata",
            resize=options["resize"],
            force=options["force"],
            reserve=options["reserve"],
        )
        if as_json:
            click.echo(json.dumps(prepared.to_dict(), indent=1))
            return
        click.echo(f"tmpfs {prepared.action} at {prepared.path}: {_mb(prepared.size)}, {_mb(prepared.free)} free")
        where = "" if str(prepared.path) == "/mnt/packdata" else f" --mount {prepared.path}"
        click.echo(f"stage into it with: packdata stage PACK{where}")
        _warn(prepared.warnings)
        return
    chosen = [s.strip() for s in shards.split(",") if s.strip()] if shards is not None else None
    storage = options.pop("storage_options", None)
    result = run_stage(pack, shards=chosen, progress=not quiet, storage_options=storage, **options)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=1))
        return
    if isinstance(result, RemoteStageResult):  # a pack downloaded from object storage
        state = f"downloaded {_mb(result.bytes_downloaded)}" if result.downloaded else "already staged here"
        click.echo(f"staged {result.source} -> {result.staged}: {state} in {result.seconds:.1f}s")
        return
    click.echo(
        f"staged {result.source} -> {result.staged}: copied {_count(len(result.copied), 'shard')} "
        f"({_mb(result.bytes_copied)}, {_rate(result.bytes_copied / max(result.seconds, 1e-9))}), "
        f"{len(result.reused)} already there, in {result.seconds:.1f}s"
    )
    click.echo(f"  {_mb(result.bytes_staged)} staged, {_mb(result.free_after)} free at {result.area}")
    if result.left:
        shown = ", ".join(result.left[:5]) + (", ..." if len(result.left) > 5 else "")
        click.secho(
            f"  LEFT {_count(len(result.left), 'shard')} ({_mb(result.bytes_left)}) on the source, "
            f"read from there: {shown}",
            fg="yellow",
        )
        click.echo(f"  why: {_in_flags(result.advice)}")
    _warn(result.warnings)
    if not result.copied and not result.reused and result.left:
        raise click.ClickException(f"nothing was staged: {_in_flags(result.advice)}")


@click.command()
@click.argument("path", type=click.Path(path_type=str))
@click.option("--unmount", is_flag=True, help="Also unmount the area's tmpfs (only one packdata mounted).")
@click.option("--force", is_flag=True, help="Remove staged packs that datasets still read (they then fail).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@_friendly
def unstage(path: str, unmount: bool, force: bool, as_json: bool) -> None:
    """Remove the staged pack PATH (or every staged pack in the area PATH); originals are never touched.

    \b
    Examples:
      packdata unstage /mnt/packdata/train.lmdb
      sudo packdata unstage /mnt/packdata --unmount
    """
    from packdata.staging.unstage import unstage as run_unstage

    result = run_unstage(path, unmount=unmount, force=force)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=1))
        return
    for removed in result.removed:
        click.echo(f"removed {removed}")
    click.echo(f"freed {_mb(result.bytes_freed)}" + (f", unmounted {result.unmounted}" if result.unmounted else ""))


@click.command()
@click.argument("pack", required=False, type=click.Path(path_type=str))
@click.option("--ranks", type=click.IntRange(min=1), default=1, show_default=True, help="Ranks that will read PACK.")
@click.option("--workers", type=click.IntRange(min=0), help="DataLoader workers per rank. Default: the recommendation.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_friendly
def doctor(pack: str | None, ranks: int, workers: int | None, as_json: bool) -> None:
    """Memory, swap, cgroup, tmpfs, CPU and GPU facts with warnings; for PACK also shards and first settings.

    \b
    Examples:
      packdata doctor
      packdata doctor train.lmdb --ranks 8 --json
    """
    from packdata.staging.doctor import doctor as run_doctor

    report = run_doctor(pack, ranks=ranks, workers=workers)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=1))
        return
    for line in report.lines():
        click.echo(line)
