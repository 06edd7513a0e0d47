"""The ``packdata`` command: thin click commands over the Python API.

Results go to stdout (``--json`` where machines read them), progress and logs to
stderr. A :class:`~packdata.errors.PackdataError` becomes one ``Error: ...``
line and exit status 1; bad options exit 2; anything else is a bug and keeps
its traceback.
"""

# Over ~500 lines: one thin click command per API function; their option lists, not logic, make it long.

from __future__ import annotations

import functools
import json
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import click

from packdata._version import __version__
from packdata.errors import PackdataError
from packdata.formats import FORMATS
from packdata.units import SIZE_RULE

__all__ = ["as_flags", "main"]


def as_flags(message: str, flags: dict[str, str]) -> str:
    """Say a library message in flags: ``overwrite=True`` -> ``--overwrite``, ``to=DIR`` -> ``--to DIR``.

    ``flags`` maps keyword arguments to the command's options (``{"to": "--to"}``);
    other words are left as they are.
    """

    def flag(match: re.Match[str]) -> str:
        option = flags.get(match.group(1))
        if option is None:
            return match.group(0)
        value = match.group(2)
        return option if value == "True" else f"{option} {value.strip(chr(39))}"

    return _KEYWORD.sub(flag, message)


_KEYWORD = re.compile(r"(?<![\w.-])([a-z][a-z0-9_]*)=('[^']*'|[^\s,;)]+)")


def _friendly(func: Callable[..., Any]) -> Callable[..., Any]:
    """Turn packdata's own errors into one line, in flags rather than keyword arguments, and exit 1.

    A newline, tab or control character in the message (a path, a key) is escaped.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except PackdataError as exc:
            command = click.get_current_context().command
            flags = {
                opt.lstrip("-").replace("-", "_"): opt
                for param in command.params
                if isinstance(param, click.Option)
                for opt in param.opts[:1]
            }
            message = as_flags(str(exc), flags)
            raise click.ClickException("".join(c if c.isprintable() else repr(c)[1:-1] for c in message)) from exc

    return wrapper


_ZERO_OK = {"reserve"}  # sizes where 0 means something (keep nothing free)
_SIZE_HELP = f"Sizes need a unit: {SIZE_RULE}."


def _shown(text: str) -> str:
    """``text`` for one line of output: as it is, or quoted and escaped if it holds a newline, tab or control.

    A key or file name from a pack or a source may hold any of them: raw, one
    sample would print as two lines, or a terminal escape sequence would run.
    """
    return text if text.isprintable() else repr(text)


def _count(n: int, noun: str) -> str:
    """``1 shard``, ``2 shards``."""
    return f"{n} {noun}{'s' * (n != 1)}"


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    from packdata.units import parse_size

    try:
        return parse_size(value, zero_ok=param.name in _ZERO_OK)
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


def _names(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in (value or "").split(",") if v.strip())


@main.command()
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
@click.option("--workers", type=click.IntRange(min=1), help="Parallel reader threads. Default: 4 per CPU, at most 32.")
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
    help="Re-encode images whose longer side exceeds N pixels down to N, as JPEG. "
    "Default: off (bytes kept as they are).",
)
@click.option(
    "--quality", type=click.IntRange(1, 100), default=90, show_default=True, help="JPEG quality for --max-side."
)
@click.option(
    "--shard-size",
    callback=_size,
    help="Start a new shard before this size, e.g. 256MB or 1GiB. Default: 256MB (the unit stage copies). "
    + _SIZE_HELP,
)
@click.option(
    "--shard-samples",
    type=click.IntRange(min=1),
    help="At most N samples per shard. Default: no limit (--shard-size decides).",
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
@click.option("--storage-options", help="For an SRC or DST URL (s3://...): fsspec options as JSON.")
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
        if options.get("storage_options"):
            options["storage_options"] = json.loads(options["storage_options"])
        result = run_convert(src, dst, format=fmt, progress=not quiet, **options)
    except KeyboardInterrupt:
        if options.get("append"):  # the pack reads as before the append, or with all of it: never in between
            message = f"the append into {dst} did not finish; rerun with --append --resume to complete it"
        else:
            message = f"nothing was published at {dst}; rerun with --resume to continue"
        click.echo(f"\nInterrupted: {message}.", err=True)
        sys.exit(130)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=1, ensure_ascii=False))
        return
    skipped = sum(result.skipped.values())
    noun = "samples" if result.kind == "fields" else "files"
    click.echo(
        f"packed {result.packed} of {result.found} {noun} into {result.pack} "
        f"({result.format}, {result.shards} shard{'s' * (result.shards != 1)}) in {result.seconds:.1f}s"
    )
    click.echo(
        f"  bytes in {_mb(result.bytes_in)}, out {_mb(result.bytes_out)}, "
        f"{result.packed / max(result.seconds, 1e-9):.0f} files/s"
        + (f", {result.reencoded} re-encoded" if result.reencoded else "")
    )
    if skipped:
        reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(result.skipped.items()))
        click.secho(
            f"  SKIPPED {skipped} {noun}: {reasons} (all listed in {result.pack}/skipped.jsonl)", fg="yellow", err=False
        )
        for example in result.skip_examples[:10]:
            click.echo(f"    {_shown(example['key'])}: {example['reason']}: {_shown(example['detail'])}")


@main.command()
@click.argument("pack", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
@click.option("--storage-options", help="For a PACK URL: fsspec options as JSON, e.g. '{\"anon\": true}'.")
@_friendly
def info(pack: str, as_json: bool, storage_options: str | None) -> None:
    """Show what PACK holds: format, samples, classes, fields, shards, bytes, version.

    \b
    Examples:
      packdata info train.lmdb
      packdata info train.lmdb --json | jq .classes
      packdata info s3://bucket/train.lmdb
    """
    from packdata.formats.verify import pack_info

    facts = pack_info(pack, storage_options=json.loads(storage_options) if storage_options else None)
    if as_json:
        click.echo(json.dumps(facts, indent=1, ensure_ascii=False))
        return
    classes = facts["classes"]
    shown = ", ".join(classes[:8]) + (", ..." if len(classes) > 8 else "")
    click.echo(f"pack:     {facts['path']}")
    click.echo(f"format:   {facts['format']} ({facts['kind']}), written by packdata {facts['packdata_version']}")
    click.echo(f"samples:  {facts['num_samples']}")
    click.echo(f"classes:  {len(classes)}" + (f" ({shown})" if classes else ""))
    click.echo(f"shards:   {len(facts['shards'])}, {_mb(facts['total_bytes'])}")
    if facts.get("codecs"):
        click.echo("fields:   " + ", ".join(f"{name} ({codec})" for name, codec in facts["codecs"].items()))
    skipped = facts.get("skipped") or {}
    if skipped.get("count"):
        reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.get("by_reason", {}).items()))
        click.echo(f"skipped:  {skipped['count']} at conversion ({reasons}; listed in {skipped.get('report')})")
    reencode = facts.get("reencode")
    if reencode:
        click.echo(
            f"reencode: {reencode.get('count', 0)} images re-encoded as JPEG to at most {reencode.get('max_side')} px "
            f"(quality {reencode.get('quality')})"
        )


@main.command()
@click.argument("pack", type=click.Path(path_type=str))
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--storage-options", help="For a PACK URL: fsspec options as JSON, e.g. '{\"anon\": true}'.")
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    help="For a PACK URL: shards read at once (about 8 MiB of memory each).  [default: 8]",
)
@_friendly
def verify(pack: str, quiet: bool, as_json: bool, storage_options: str | None, workers: int | None) -> None:
    """Read every record of PACK and check checksums, keys and labels.

    Exits 1 naming the first bad shard or record.

    PACK may be a URL (s3://...), verified in place without staging: every
    shard is read once and its size and SHA-256 checked against the manifest,
    along with the counts, skip report and labels. A TFRecord pack's records
    are checked as for a local pack (framing, CRCs, index, keys, labels,
    fields) while its shards stream. An LMDB pack's records are read through
    LMDB, which needs a local file, so at a URL only its checksums (and the
    binding of each records.i64 table to its shard) are checked, and the
    output says so: stage it and verify the staged copy to check its records.

    \b
    Examples:
      packdata verify train.lmdb
      packdata verify /mnt/packdata/train.lmdb -q --json
      packdata verify s3://bucket/train --workers 16
    """
    from packdata.formats.verify import verify_pack

    options = json.loads(storage_options) if storage_options else None
    result = verify_pack(pack, progress=not quiet, storage_options=options, workers=workers)
    if as_json:
        click.echo(json.dumps(result.to_dict()))
        return
    shards = f"{result.shards} shard{'s' * (result.shards != 1)}"
    if result.checks == "checksums":
        click.echo(
            f"ok: {shards}, {_mb(result.bytes)}: sizes and SHA-256 match the manifest. Records NOT checked: "
            f"an LMDB pack's records are checked in local files (packdata stage {result.path} --to DIR, "
            "then packdata verify the staged copy)"
        )
        return
    click.echo(f"ok: {result.records} records, {_mb(result.bytes)} in {shards} verified")


@main.command()
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

    result = merge_packs(packs, out, on_duplicate=on_duplicate, overwrite=overwrite)
    click.echo(
        f"merged {len(packs)} packs into {result.pack}: {result.samples} samples in {result.shards} shards "
        f"({result.linked} linked, {result.copied} copied, {result.rewritten} rewritten"
        + (f"; {result.renamed_keys} keys renamed" if result.renamed_keys else "")
        + ")"
    )


@main.command(name="ls")
@click.argument("pack", type=click.Path(path_type=str))
@click.option("--limit", type=click.IntRange(min=0), default=20, show_default=True, help="Samples to list (0: all).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--storage-options", help="For a PACK URL: fsspec options as JSON, e.g. '{\"anon\": true}'.")
@_friendly
def ls(pack: str, limit: int, as_json: bool, storage_options: str | None) -> None:
    """List the samples of PACK: index, key, label/class, fields with sizes, shard (from the index only).

    PACK may be a URL (s3://...): only its manifest and sample index are
    downloaded (cached in the temporary folder while the manifest is the same).

    \b
    Examples:
      packdata ls train.lmdb --limit 5
      packdata ls train.lmdb --limit 0 --json > samples.jsonl
      packdata ls s3://bucket/train.lmdb
    """
    from packdata.formats.contents import list_samples
    from packdata.units import format_size

    options = json.loads(storage_options) if storage_options else None
    for row in list_samples(pack, limit=limit or None, storage_options=options):
        if as_json:
            click.echo(json.dumps(row, ensure_ascii=False))
            continue
        label = f"{row['label']}" + (f" ({_shown(row['class'])})" if row["class"] is not None else "")
        fields = " ".join(f"{name}:{format_size(size)}" for name, size in row["fields"].items())
        click.echo(f"#{row['index']}\t{_shown(row['key'])}\t{label}\t{fields}\t{row['shard']}")


@main.command(name="cat")
@click.argument("pack", type=click.Path(path_type=str))
@click.argument("sample")
@click.option("--field", "field_name", help="The field to print (needed when the sample has several).")
@click.option("--storage-options", help="For a PACK URL: fsspec options as JSON, e.g. '{\"anon\": true}'.")
@_friendly
def cat(pack: str, sample: str, field_name: str | None, storage_options: str | None) -> None:
    """Write the stored bytes of one field of SAMPLE (a key, or #N for index N) to stdout.

    PACK may be a URL (s3://...): the record is read with one ranged request,
    through the offsets index of a TFRecord pack or the records.i64 table of
    an LMDB shard (an LMDB shard without one: stage the pack first).

    \b
    Examples:
      packdata cat train.lmdb n01440764/0001.JPEG > x.jpg
      packdata cat caps.lmdb '#0' --field txt
      packdata cat s3://bucket/train '#0' > x.jpg
    """
    from packdata.formats.contents import read_field

    options = json.loads(storage_options) if storage_options else None
    sys.stdout.buffer.write(read_field(pack, sample, field_name, storage_options=options))
    sys.stdout.buffer.flush()


@main.command()
@click.argument("pack", type=click.Path(path_type=str))
@click.argument("dst", type=click.Path(path_type=str))
@click.option(
    "--layout",
    type=click.Choice(["imagefolder", "grouped"]),
    help="imagefolder: one file per sample at its key; grouped: KEY.FIELD files. Default: by the pack's kind.",
)
@_friendly
def export(pack: str, dst: str, layout: str | None) -> None:
    """Write PACK back into files under DST (a new or empty folder).

    Keys that are not plain paths inside DST are refused and listed, never followed.

    \b
    Examples:
      packdata export train.lmdb ./train-files && diff -r ./train ./train-files
    """
    from packdata.formats.contents import export_pack

    result = export_pack(pack, dst, layout=layout)
    click.echo(f"exported {result.samples} samples as {result.files} files into {result.path}")
    if result.refused:
        click.secho(f"  REFUSED {len(result.refused)} samples:", fg="yellow")
        for item in result.refused[:10]:
            click.echo(f"    {_shown(item['key'])}: {_shown(item['reason'])}")
        sys.exit(1)


def _progress_line(line: str) -> None:
    click.echo(line, err=True)


def _int_list(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        values = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"should be comma-separated integers, but got {value!r}") from None
    if not values or min(values) < 0:
        raise click.BadParameter(f"should be comma-separated integers >= 0, but got {value!r}")
    return values


@main.command()
@click.argument("sources", nargs=-1, required=True, type=click.Path(path_type=str))
@click.option(
    "--workers",
    callback=_int_list,
    default="0,2",
    show_default=True,
    help="num_workers values to sweep, comma-separated.",
)
@click.option(
    "--batch-size", callback=_int_list, default="64", show_default=True, help="Batch sizes to sweep, comma-separated."
)
@click.option(
    "--pin-memory/--no-pin-memory",
    default=False,
    show_default=True,
    help="Pin host memory (only with CUDA; measured off without it).",
)
@click.option(
    "--prefetch-factor",
    callback=_int_list,
    default="2",
    show_default=True,
    help="prefetch_factor values to sweep, comma-separated.",
)
@click.option("--persistent-workers", is_flag=True, help="Keep workers between epochs.")
@click.option(
    "--decode",
    type=click.Choice(["bytes", "pil", "reduced", "crop"]),
    default="pil",
    show_default=True,
    help="bytes: no decoding; pil: full decode; reduced: JPEG DCT-scaled decode to --size; crop: DecodeCrop, "
    "decoding only what the random crop needs: its rows and columns with TurboJPEG 3 (pip install "
    "'packdata[turbo]'), else PIL's DCT scaling (the ceiling is then PIL's full decode + crop).",
)
@click.option("--no-transform", is_flag=True, help="Skip the standard transform (crop to --size, flip, uint8).")
@click.option(
    "--size", type=click.IntRange(min=1), default=224, show_default=True, help="Output side of the transform."
)
@click.option(
    "--seconds",
    type=click.FloatRange(min=0, min_open=True),
    help="Time each setting this long. Default: no time limit (--batches decides).",
)
@click.option("--batches", type=click.IntRange(min=1), help="Time this many batches per setting (default 50).")
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True, help="Untimed batches first.")
@click.option(
    "--step-ms",
    type=click.FloatRange(min=0),
    default=0,
    show_default=True,
    help="Simulated training step per batch; reports the share of time waiting for data.",
)
@click.option(
    "--cold",
    is_flag=True,
    help="Drop the page cache before each source: the WHOLE machine's cache (echo 3 > drop_caches), so it needs "
    "root and slows everything else running here for a while.",
)
@click.option(
    "--repeat",
    "repeats",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Run every setting this many times, interleaved; the table shows medians and their spread.",
)
@click.option("--wide", is_flag=True, help="All columns (MB/s, CPU time, latency percentiles, every memory figure).")
@click.option(
    "--json",
    "json_file",
    type=click.Path(dir_okay=False, path_type=str),
    help="Write the full result as JSON to this file ('-': stdout).",
)
@click.option(
    "--plot",
    "plot_file",
    type=click.Path(dir_okay=False, path_type=str),
    help="Plot throughput and memory against num_workers to this PNG (needs matplotlib).",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress lines (the setting being measured) on stderr.")
@_friendly
def bench(
    sources: tuple[str, ...],
    workers: tuple[int, ...],
    batch_size: tuple[int, ...],
    pin_memory: bool,
    prefetch_factor: tuple[int, ...],
    no_transform: bool,
    json_file: str | None,
    plot_file: str | None,
    wide: bool,
    quiet: bool,
    **options: Any,
) -> None:
    """Measure DataLoader throughput and memory for each SOURCE (pack or folder).

    The in-memory decode ceiling is measured next to them (same decode,
    transform and settings on bytes already in memory), so every figure is
    also a ratio to it.

    \b
    Examples:
      packdata bench train.lmdb ./images --workers 0,2,4 --batch-size 64,128
      packdata bench train.lmdb --step-ms 50 --seconds 10
      packdata bench train.lmdb --decode reduced --json bench.json --plot bench.png
      packdata bench train.lmdb --decode crop     # DecodeCrop against PIL's full decode + crop
    """
    from packdata.measure.bench import run_bench
    from packdata.measure.plot import plot_bench

    if 0 in batch_size or 0 in prefetch_factor:
        raise click.BadParameter("batch sizes and prefetch factors should be at least 1")
    missing = [s for s in sources if not os.path.exists(s)]
    if missing:
        raise click.ClickException(f"{missing[0]}: no such pack or folder (nothing was measured)")
    result = run_bench(
        list(sources),
        workers=workers,
        batch_sizes=batch_size,
        pin_memory=(pin_memory,),
        prefetch_factor=prefetch_factor,
        transform=None if no_transform else "standard",
        progress=None if quiet else _progress_line,
        **options,
    )
    if json_file == "-":
        click.echo(result.to_json())
    else:
        click.echo(result.table(wide=wide))
        if json_file:
            result.to_json(json_file)
    for warning in result.warnings:
        click.secho(f"warning: {warning}", fg="yellow", err=True)
    if plot_file:
        click.echo(f"plot: {plot_bench(result, plot_file)}", err=True)
    failed = [s for s in result.sources if s.get("error") and s["name"] != "ceiling"]
    if failed:
        raise click.ClickException(f"could not measure {failed[0]['name']}: {failed[0]['error']}")


@main.command()
@click.argument("source", type=click.Path(path_type=str))
@click.option(
    "--memory-budget",
    callback=_size,
    help="Memory the loader may use, e.g. 8GB. Default: half of MemAvailable (or of the cgroup's headroom).",
)
@click.option(
    "--device",
    default=None,
    help="Where batches go, e.g. cuda (turns on the pin_memory search). Default: cpu (pin_memory off).",
)
@click.option(
    "--batch-size",
    "batch_sizes",
    callback=_int_list,
    default="64",
    show_default=True,
    help="Your training batch size (kept); several values, comma-separated, are searched (e.g. 32,64,128).",
)
@click.option("--max-workers", type=click.IntRange(min=0), help="Most workers to try. Default: the logical CPUs.")
@click.option("--decode", type=click.Choice(["bytes", "pil", "reduced", "crop"]), default="pil", show_default=True)
@click.option(
    "--seconds",
    type=click.FloatRange(min=0, min_open=True),
    help="Time each trial this long. Default: no time limit (--batches decides).",
)
@click.option("--batches", type=click.IntRange(min=1), help="Time this many batches per trial (default 50).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines (the trial being measured) on stderr.")
@_friendly
def tune(source: str, batch_sizes: tuple[int, ...], as_json: bool, quiet: bool, **options: Any) -> None:
    """Search DataLoader settings for SOURCE and print the best as Python.

    One variable at a time from the rule of thumb (num_workers, batch_size,
    prefetch_factor, pin_memory), rejecting any setting whose projected memory
    exceeds the budget.

    \b
    Examples:
      packdata tune train.lmdb
      packdata tune train.lmdb --batch-size 64,128 --memory-budget 8G --json
    """
    from packdata.measure.tune import run_tune

    if 0 in batch_sizes:
        raise click.BadParameter("batch sizes should be at least 1", param_hint="--batch-size")
    result = run_tune(source, batch_sizes=batch_sizes, progress=None if quiet else _progress_line, **options)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=1))
        return
    for warning in result.warnings:
        click.secho(f"warning: {warning}", fg="yellow", err=True)

    def describe(label: str, trial: Any) -> None:
        click.echo(
            f"# {label}: {trial.samples_per_s:.0f} samples/s; peak private memory in this short run "
            f"{(trial.memory_peak_bytes or 0) / 2**20:.0f} MiB, projected for training "
            f"{trial.projected_bytes / 2**20:.0f} MiB (budget {result.memory_budget / 2**20:.0f} MiB, "
            f"{result.budget_source})"
        )

    describe("recommended", result.recommended)
    click.echo(result.python(result.recommended))
    if result.runner_up is not None:
        describe("runner-up", result.runner_up)
        click.echo(result.python(result.runner_up))
        best, second = result.recommended.samples_per_s or 0.0, result.runner_up.samples_per_s or 0.0
        if best and abs(best - second) / best < result.min_gain:
            click.echo(
                f"# the two are within noise ({100 * abs(best - second) / best:.0f}% apart, under the "
                f"{100 * result.min_gain:.0f}% a step must gain): prefer the one with fewer workers, smaller "
                "batches and less memory"
            )
    click.echo(
        "# projected = workers x per-worker private memory (the largest measured) + batches in flight "
        "(workers x prefetch_factor) x batch bytes (+ the same again when pinned); a short run peaks lower"
    )
    rejected = sum(1 for t in result.trials if t.rejected)
    click.echo(f"# {len(result.trials)} settings tried, {rejected} rejected over the memory budget or failing")


def _warn(warnings: Any) -> None:
    for w in warnings:
        click.secho(f"warning [{w.code}]: {w.message}", fg="yellow", err=True)


def _rate(bytes_per_second: float) -> str:
    from packdata.units import format_rate

    return format_rate(bytes_per_second)


def _mb(n: int) -> str:
    from packdata.units import format_size

    return format_size(n)


@main.command()
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
@click.option("--workers", type=click.IntRange(min=1), help="Parallel copy threads. Default: up to 4.")
@click.option("--force", is_flag=True, help="Go ahead even when the memory checks refuse the tmpfs size.")
@click.option(
    "--reserve",
    callback=_size,
    help="Memory to keep free for training in the tmpfs checks, e.g. 8G (0B: none). Default: 10% of RAM, "
    "at least 4 GiB, at most half.",
)
@click.option("--status", is_flag=True, help="List staged packs, sizes, free space and memory (in PACK as an area).")
@click.option(
    "--cache-limit",
    callback=_size,
    help="For a PACK URL: most bytes the --to folder's staged copies may hold; the least recently used copies "
    "of remote packs that no reader has open are evicted first. Default: no limit.",
)
@click.option(
    "--storage-options",
    help='For a PACK URL: fsspec options as JSON, e.g. \'{"anon": true}\' or \'{"endpoint_url": "http://..."}\'.',
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@_friendly
def stage(pack: str | None, shards: str | None, status: bool, as_json: bool, quiet: bool, **options: Any) -> None:
    """Copy PACK's shards to fast storage (NVMe or a sized tmpfs) and verify them.

    The staged pack, AREA/NAME, has its own manifest: staged shards point at
    the copies, shards left behind (over --budget) at the originals, so
    LMDBDataset(staged) and TFRecordDataset(staged) read the mix. A second
    run copies only what is missing or changed.

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
    from packdata.staging.stage import stage_status
    from packdata.staging.tmpfs import prepare_tmpfs

    if status:
        if any(v not in (None, False) for v in options.values()) or shards:
            raise click.UsageError("--status takes only an optional area (PACK) and --json")
        report = stage_status(pack)
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
                click.echo(
                    f"  {p.path.name}: {p.shards_staged} shards staged ({_mb(p.bytes_staged)}), "
                    f"{p.shards_left} left ({_mb(p.bytes_left)}) from {p.origin}{state}"
                )
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
    chosen = [s.strip() for s in shards.split(",") if s.strip()] if shards else None
    raw_options = options.pop("storage_options", None)
    storage = json.loads(raw_options) if raw_options else None
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
        click.echo(f"  why: {result.advice}")
    _warn(result.warnings)
    if not result.copied and not result.reused and result.left:
        raise click.ClickException(f"nothing was staged: {result.advice}")


@main.command()
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
    from packdata.staging.stage import unstage as run_unstage

    result = run_unstage(path, unmount=unmount, force=force)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=1))
        return
    for removed in result.removed:
        click.echo(f"removed {removed}")
    click.echo(f"freed {_mb(result.bytes_freed)}" + (f", unmounted {result.unmounted}" if result.unmounted else ""))


@main.command()
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


@main.command(name="monitor")
@click.argument("pid", required=False, type=int)
@click.option("--name", help="Watch the oldest process whose command line contains this (e.g. train.py).")
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True, help="Seconds per sample.")
@click.option("--count", type=click.IntRange(min=1), help="Stop after this many samples. Default: until the job ends.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per sample.")
@_friendly
def monitor_command(pid: int | None, name: str | None, interval: float, count: int | None, as_json: bool) -> None:
    """Watch a training job's data loading from a second terminal.

    The training process and its DataLoader workers (each one's private and
    file-backed memory), available memory against swap with the OOM warning,
    CPU and iowait. Redrawn in place on a terminal; one line per sample when piped.
    In the training script itself, packdata.monitor(loader) adds the step's
    waiting time and names the bottleneck.

    \b
    Examples:
      packdata monitor --name train.py
      packdata monitor 12345 --interval 5 --json >> loader.jsonl
    """
    from packdata.watch.screen import find_process, watch_process

    if (pid is None) == (name is None):
        raise click.UsageError("give the training process's PID or --name, one of them")
    watch_process(pid if pid is not None else find_process(name or ""), interval=interval, count=count, as_json=as_json)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
