"""The ``packdata`` command: thin click commands over the Python API.

Results go to stdout (``--json`` where machines read them), progress and logs to
stderr. A :class:`~packdata.errors.PackdataError` becomes one ``Error: ...``
line and exit status 1; bad options exit 2; anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any

import click

from packdata import __version__
from packdata.errors import PackdataError

__all__ = ["main"]


def _friendly(func: Callable[..., Any]) -> Callable[..., Any]:
    """Turn packdata's own errors into one line and exit 1."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except PackdataError as exc:
            raise click.ClickException(str(exc)) from exc

    return wrapper


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    from packdata.system import parse_size

    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="packdata")
def main() -> None:
    """Pack folders of small files into LMDB or TFRecord and feed PyTorch fast.

    \b
    Typical use:
      packdata convert ./images train.lmdb        # pack an ImageFolder tree
      packdata info train.lmdb                    # what is inside
      packdata verify train.lmdb                  # read and check every record
    Then in Python: packdata.LMDBDataset("train.lmdb") where ImageFolder was.
    """


@main.command()
@click.argument("src", type=click.Path(file_okay=False, path_type=str))
@click.argument("dst", type=click.Path(path_type=str))
@click.option("--format", "fmt", type=click.Choice(["lmdb", "tfrecord"]),
              help="Pack format. Default: from DST's suffix (.lmdb), else lmdb.")
@click.option("--kind", type=click.Choice(["auto", "image", "text"]), default="auto", show_default=True,
              help="What the files are; auto looks at the extensions found.")
@click.option("--workers", type=click.IntRange(min=1), help="Parallel reader threads. Default: 4 per CPU, at most 32.")
@click.option("--on-error", type=click.Choice(["skip", "fail"]), default="skip", show_default=True,
              help="On a corrupt, empty or unreadable file: skip it (listed in the summary "
                   "and in skipped.jsonl in the pack) or stop with an error.")
@click.option("--verify-images", is_flag=True, help="Fully decode every image (catches truncated files; slower).")
@click.option("--max-side", type=click.IntRange(min=1),
              help="Re-encode images whose longer side exceeds N pixels down to N, as JPEG.")
@click.option("--quality", type=click.IntRange(1, 100), default=90, show_default=True,
              help="JPEG quality for --max-side.")
@click.option("--shard-size", callback=_size, help="Start a new shard before this size, e.g. 256MB or 1GiB.")
@click.option("--shard-samples", type=click.IntRange(min=1), help="At most N samples per shard.")
@click.option("--overwrite", is_flag=True, help="Replace an existing pack at DST.")
@click.option("--resume", is_flag=True, help="Continue an interrupted conversion into DST.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@_friendly
def convert(src: str, dst: str, fmt: str | None, as_json: bool, quiet: bool, **options: Any) -> None:
    """Pack the files under SRC into the pack DST.

    First-level subfolders of SRC are classes (sorted, numbered from 0, as
    torchvision's ImageFolder does); files directly under SRC get label -1.
    SRC is never modified. DST appears only when complete: an interrupted run
    leaves a hidden .DST.partial that --resume continues.

    \b
    Examples:
      packdata convert ./imagenet/train train.lmdb
      packdata convert ./imagenet/train train --format tfrecord --shard-size 256MB
      packdata convert ./photos small.lmdb --max-side 256 --quality 90
      packdata convert ./corpus corpus.lmdb --kind text
    """
    from packdata.convert import convert as run_convert

    result = run_convert(src, dst, format=fmt, progress=not quiet, **options)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=1, ensure_ascii=False))
        return
    skipped = sum(result.skipped.values())
    click.echo(f"packed {result.packed} of {result.found} files into {result.pack} "
               f"({result.format}, {result.shards} shard{'s' * (result.shards != 1)}) in {result.seconds:.1f}s")
    click.echo(f"  bytes in {result.bytes_in / 1e6:.1f} MB, out {result.bytes_out / 1e6:.1f} MB, "
               f"{result.packed / max(result.seconds, 1e-9):.0f} files/s"
               + (f", {result.reencoded} re-encoded" if result.reencoded else ""))
    if skipped:
        reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(result.skipped.items()))
        click.secho(f"  SKIPPED {skipped} files: {reasons} (all listed in {result.pack}/skipped.jsonl)",
                    fg="yellow", err=False)
        for example in result.skip_examples[:10]:
            click.echo(f"    {example['key']}: {example['reason']}: {example['detail']}")


@main.command()
@click.argument("pack", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
@_friendly
def info(pack: str, as_json: bool) -> None:
    """Show what PACK holds: format, samples, classes, shards, bytes, version."""
    from packdata.verify import pack_info

    facts = pack_info(pack)
    if as_json:
        click.echo(json.dumps(facts, indent=1, ensure_ascii=False))
        return
    classes = facts["classes"]
    shown = ", ".join(classes[:8]) + (", ..." if len(classes) > 8 else "")
    click.echo(f"pack:     {facts['path']}")
    click.echo(f"format:   {facts['format']} ({facts['kind']}), written by packdata {facts['packdata_version']}")
    click.echo(f"samples:  {facts['num_samples']}")
    click.echo(f"classes:  {len(classes)}" + (f" ({shown})" if classes else ""))
    click.echo(f"shards:   {len(facts['shards'])}, {facts['total_bytes'] / 1e6:.1f} MB")
    skipped = facts.get("skipped") or {}
    if skipped.get("count"):
        click.echo(f"skipped:  {skipped['count']} at conversion ({skipped['by_reason']})")
    if facts.get("reencode"):
        click.echo(f"reencode: {facts['reencode']}")


@main.command()
@click.argument("pack", type=click.Path(path_type=str))
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@_friendly
def verify(pack: str, quiet: bool) -> None:
    """Read every record of PACK and check checksums, keys and labels.

    Exits 1 naming the first bad shard or record.
    """
    from packdata.verify import verify_pack

    result = verify_pack(pack, progress=not quiet)
    click.echo(f"ok: {result.records} records, {result.bytes / 1e6:.1f} MB in {result.shards} "
               f"shard{'s' * (result.shards != 1)} verified")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
