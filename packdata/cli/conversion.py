"""Commands that write packs: convert (and convert --append), merge."""

from __future__ import annotations

import sys
from typing import Any

import click

from packdata.cli.common import _SIZE_HELP, _count, _friendly, _json_object, _json_text, _mb, _size
from packdata.formats import FORMATS
from packdata.units import shown as _shown

__all__ = ["convert", "merge"]


def _echo_missing_fields(missing: dict[str, int]) -> None:
    """Say which fields some of the pack's samples lack: a reader asking for one must be told what to read there."""
    if missing:
        lacking = ", ".join(f"{_shown(name)} ({_count(n, 'sample')})" for name, n in missing.items())
        click.secho(
            f"  FIELDS SOME SAMPLES LACK: {lacking}; a dataset whose fields= asks for one needs missing= for them",
            fg="yellow",
        )


def _names(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in (value or "").split(",") if v.strip())


@click.command()
@click.argument("src", type=click.Path(path_type=str))
@click.argument("dst", type=click.Path(path_type=str))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS, case_sensitive=False),
    callback=lambda ctx, param, value: value.lower() if value else value,
    help="Pack format. Default: from DST's suffix (.lmdb; .tfrecord or .tfrecords), else lmdb.",
)
@click.option(
    "--kind",
    type=click.Choice(["auto", "image", "text"]),
    default="auto",
    show_default=True,
    help="What the files are; auto looks at the extensions found.",
)
@click.option(
    "--layout",
    type=click.Choice(["auto", "classes", "grouped"]),
    default="auto",
    show_default=True,
    help="A folder's layout: classes (one file per sample), grouped (files sharing a stem are one "
    "multi-field sample: 0001.jpg + 0001.json), auto (grouped when some stem has several files).",
)
@click.option("--require", callback=_names, help="Grouped files or a list: fields every sample needs, e.g. jpg,json.")
@click.option("--path-column", default="path", show_default=True, help="A list file's column of file paths.")
@click.option("--label-column", help="A list file's column of labels (class names or integers).")
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    help="Most parallel reader threads (a warm source of small files is read in the writer's own thread when that "
    "measures faster). Default: 4 per CPU this process may use, at most 32; with --engine ray, 4 per task.",
)
@click.option(
    "--on-error",
    type=click.Choice(["skip", "fail"]),
    default="skip",
    show_default=True,
    help="On a corrupt, empty or unreadable file: skip it (listed in the summary "
    "and in skipped.jsonl in the pack) or stop with an error.",
)
@click.option("--verify-images", is_flag=True, help="Fully decode every image (catches truncated files; slower).")
@click.option(
    "--max-side",
    type=click.IntRange(min=1),
    help="Re-encode images whose longer side exceeds N pixels down to N, as JPEG (a 16-bit image, "
    "which JPEG would clip, or one of several frames is kept as it is, with a warning). "
    "Default: off (bytes kept as they are).",
)
@click.option(
    "--quality", type=click.IntRange(1, 100), default=90, show_default=True, help="JPEG quality for --max-side."
)
@click.option(
    "--shard-size",
    callback=_size,
    help="Start a new shard before this size, e.g. 256MB or 1GiB. Default: 256MB (the unit stage copies); with "
    "--engine ray, none (--shard-samples decides). " + _SIZE_HELP,
)
@click.option(
    "--shard-samples",
    type=click.IntRange(min=1),
    help="At most N samples per shard. Default: no limit (--shard-size decides); with --engine ray and no "
    "--shard-size, 10,000 (one task a shard).",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing pack at DST.")
@click.option("--resume", is_flag=True, help="Continue an interrupted conversion into DST.")
@click.option(
    "--append",
    is_flag=True,
    help="Add SRC's samples to the existing pack DST as new shards (classes united by name; "
    "existing shards untouched; readers opened before keep working).",
)
@click.option(
    "--engine",
    type=click.Choice(["local", "ray"]),
    default="local",
    show_default=True,
    help="local: reader threads in this process. ray: one Ray task per shard "
    "(pip install 'packdata[ray]'); a local SRC and DST's folder must be on storage every node sees "
    "(into a DST URL, each task uploads its own shard).",
)
@click.option(
    "--address",
    help="With --engine ray: the Ray cluster to join (e.g. auto, ray://head:10001). "
    "Default: start a local Ray instance.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option(
    "--storage-options", callback=_json_object, help="For an SRC or DST URL (s3://...): fsspec options as JSON."
)
@_friendly
def convert(src: str, dst: str, fmt: str | None, as_json: bool, quiet: bool, **options: Any) -> None:
    """Pack the files under SRC (a folder, a .csv/.tsv/.jsonl list, or WebDataset tars) into DST.

    First-level subfolders of SRC are classes (sorted, numbered from 0, as
    torchvision's ImageFolder does); files directly under SRC get label -1.
    Files sharing a stem (0001.jpg, 0001.json, 0001.seg.png) become one
    multi-field sample (--layout grouped). A list file names one file per row
    (--path-column), a label (--label-column), and other columns as fields.
    SRC is never modified. DST appears only when complete: an interrupted run
    leaves a hidden .DST.partial that --resume continues.

    \b
    Examples:
      packdata convert ./imagenet/train train.lmdb
      packdata convert ./coco-captions caps.lmdb --layout grouped --require jpg,txt
      packdata convert train.csv train.lmdb --path-column image --label-column label
      packdata convert 'shards/data-{000000..000099}.tar' train.lmdb   # WebDataset tars
      packdata convert ./train s3://bucket/train.lmdb                  # packed locally, uploaded, manifest last
      packdata convert ./imagenet/train train --format tfrecord --shard-size 256MB
      packdata convert ./photos small.lmdb --max-side 256 --quality 90
      packdata convert ./corpus corpus.lmdb --kind text
      packdata convert /nfs/train /nfs/train.lmdb --engine ray --address auto
      packdata convert /nfs/train s3://bucket/train.lmdb --engine ray   # tasks upload their shards
    """
    from packdata.conversion.convert import convert as run_convert
    from packdata.host.allocator import keep_freed_memory

    if options.get("address") and options.get("engine") != "ray":
        raise click.UsageError("--address needs --engine ray")
    keep_freed_memory()  # this process converts, then ends: freed batches are reused, not faulted in again

    try:
        result = run_convert(src, dst, format=fmt, progress=not quiet, **options)
    except KeyboardInterrupt:
        if options.get("append"):  # the pack reads as before the append, or with all of it: never in between
            message = f"the append into {dst} did not finish; rerun with --append --resume to complete it"
        else:
            message = f"nothing was published at {dst}; rerun with --resume to continue"
        click.echo(f"\nInterrupted: {message}.", err=True)
        sys.exit(130)
    if as_json:
        click.echo(_json_text(result.to_dict(), indent=1))
        return
    skipped = sum(result.skipped.values())
    noun = "sample" if result.kind == "fields" else "file"
    click.echo(
        f"packed {result.packed:,} of {_count(result.found, noun)} into {result.pack} "
        f"({result.format}, {_count(result.shards, 'shard')}) in {result.seconds:.1f}s"
    )
    click.echo(
        f"  bytes in {_mb(result.bytes_in)}, out {_mb(result.bytes_out)}, "
        f"{result.rate:,.0f} {noun}s/s" + (f", {result.reencoded:,} re-encoded" if result.reencoded else "")
    )
    if skipped:
        reasons = ", ".join(f"{n:,} {reason}" for reason, n in sorted(result.skipped.items()))
        click.secho(
            f"  SKIPPED {_count(skipped, noun)}: {reasons} (all listed in {result.pack}/skipped.jsonl)",
            fg="yellow",
            err=False,
        )
        for example in result.skip_examples[:10]:
            click.echo(f"    {_shown(example['key'])}: {example['reason']}: {_shown(example['detail'])}")
    _echo_missing_fields(result.missing_fields)


@click.command()
@click.argument("packs", nargs=-1, required=True, type=click.Path(path_type=str))
@click.option("-o", "--output", "out", required=True, type=click.Path(path_type=str), help="The merged pack to create.")
@click.option(
    "--on-duplicate",
    type=click.Choice(["error", "rename"]),
    default="error",
    show_default=True,
    help="A key in two packs: stop, or keep the later one as KEY~N (rewrites its shards).",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing pack at OUTPUT.")
@_friendly
def merge(packs: tuple[str, ...], out: str, on_duplicate: str, overwrite: bool) -> None:
    """Merge PACKS (same format and kind) into one new pack.

    Shards are hard-linked where the packs share a filesystem, copied
    otherwise; classes are united by name (the first pack's keep their numbers).

    \b
    Examples:
      packdata merge part1.lmdb part2.lmdb -o all.lmdb
      packdata merge a.lmdb b.lmdb -o ab.lmdb --on-duplicate rename
    """
    from packdata.conversion.combine import merge_packs

    if len(packs) < 2:
        raise click.UsageError(f"merge needs at least two PACKS, but got {len(packs)}")
    result = merge_packs(packs, out, on_duplicate=on_duplicate, overwrite=overwrite)
    click.echo(
        f"merged {len(packs)} packs into {result.pack}: "
        f"{_count(result.samples, 'sample')} in {_count(result.shards, 'shard')} "
        f"({result.linked} linked, {result.copied} copied, {result.rewritten} rewritten"
        + (f"; {_count(result.renamed_keys, 'key')} renamed" if result.renamed_keys else "")
        + ")"
    )
    _echo_missing_fields(result.missing_fields)
