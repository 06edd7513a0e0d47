"""Commands that read a pack: info, verify, ls, cat, export."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click

from packdata.cli.common import _count, _friendly, _json_object, _json_text, _mb, _said
from packdata.errors import PackdataError
from packdata.units import shown as _shown

__all__ = ["cat", "export", "info", "ls", "verify"]


@click.command()
@click.argument("pack", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
@click.option(
    "--storage-options", callback=_json_object, help="For a PACK URL: fsspec options as JSON, e.g. '{\"anon\": true}'."
)
@_friendly
def info(pack: str, as_json: bool, storage_options: dict[str, Any] | None) -> None:
    """Show what PACK holds: format, samples, classes, fields, shards, bytes, version.

    \b
    Examples:
      packdata info train.lmdb
      packdata info train.lmdb --json | jq .classes
      packdata info s3://bucket/train.lmdb
    """
    from packdata.formats.verify import pack_info

    facts = pack_info(pack, storage_options=storage_options)
    if as_json:
        click.echo(_json_text(facts, indent=1))
        return
    classes = facts["classes"]  # every string from the manifest is shown escaped: a stranger's pack may hold any
    shown = ", ".join(map(_shown, classes[:8])) + (", ..." if len(classes) > 8 else "")
    click.echo(f"pack:     {_shown(facts['path'])}")
    version = f"written by packdata {_shown(facts['packdata_version'])}"
    click.echo(f"format:   {_shown(facts['format'])} ({_shown(facts['kind'])}), {version}")
    click.echo(f"samples:  {facts['num_samples']:,}")
    click.echo(f"classes:  {len(classes)}" + (f" ({shown})" if classes else ""))
    click.echo(f"shards:   {len(facts['shards'])}, {_mb(facts['total_bytes'])}")
    if facts.get("codecs"):
        counts, total = facts.get("field_counts", {}), facts["num_samples"]
        held = {name: f", in {n:,} of {total:,} samples" for name, n in counts.items() if n < total}
        click.echo(
            "fields:   "
            + ", ".join(f"{_shown(name)} ({codec}{held.get(name, '')})" for name, codec in facts["codecs"].items())
        )
    skipped = facts.get("skipped") or {}
    if skipped.get("count"):
        reasons = ", ".join(f"{n} {_shown(reason)}" for reason, n in sorted(skipped.get("by_reason", {}).items()))
        reasons = reasons or "reasons not recorded"  # a manifest may hold the count alone (a merge of such a pack)
        report = _shown(str(skipped.get("report")))
        click.echo(f"skipped:  {skipped['count']} at conversion ({reasons}; listed in {report})")
    reencode = facts.get("reencode")
    if reencode:
        settings = (
            f"to at most {_shown(str(reencode.get('max_side')))} px (quality {_shown(str(reencode.get('quality')))})"
            if "max_side" in reencode
            else "(packs merged with different settings, or none: their own manifests say which)"
        )
        click.echo(f"reencode: {_count(reencode.get('count', 0), 'image')} re-encoded as JPEG {settings}")


@click.command()
@click.argument("pack", type=click.Path(path_type=str))
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='Print the result as JSON, {"ok": true, ...}; on failure {"ok": false, "error": ..., "path": ...} '
    "as well as the error line on stderr.",
)
@click.option(
    "--storage-options", callback=_json_object, help="For a PACK URL: fsspec options as JSON, e.g. '{\"anon\": true}'."
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    help="For a PACK URL: shards read at once (about 8 MiB of memory each).  [default: 8]",
)
@_friendly
def verify(pack: str, quiet: bool, as_json: bool, storage_options: dict[str, Any] | None, workers: int | None) -> None:
    """Read every record of PACK and check checksums, keys and labels.

    Exits 1 naming the first bad shard or record.

    PACK may be a URL (s3://...), verified in place without staging: the
    sample index's SHA-256, the counts, skip report and labels are checked, and
    every shard is read once and its size and SHA-256 checked against the
    manifest. A TFRecord pack's records are checked as for a local pack
    (framing, CRCs, index, keys, labels, fields) while its shards stream. An
    LMDB pack's records are read through LMDB, which needs a local file, so at
    a URL each row of a shard's records.i64 table is checked against the record
    it places as the shard streams (the record's header and CRC-32, its key,
    label and size against the sample index, the row's CRC32C; a shard without
    the table: its size and SHA-256 only), but neither LMDB's own pages nor the
    fields of a multi-field sample are, and the output says which records were
    checked: stage it and verify the staged copy for every check.

    \b
    Examples:
      packdata verify train.lmdb
      packdata verify /mnt/packdata/train.lmdb -q --json
      packdata verify s3://bucket/train --workers 16
    """
    from packdata.formats.verify import verify_pack
    from packdata.pack.urls import display_url, is_url

    try:
        result = verify_pack(pack, progress=not quiet, storage_options=storage_options, workers=workers)
    except PackdataError as exc:
        if as_json:  # a script reading stdout gets an object either way; the line goes to stderr as well
            shown = display_url(pack) if is_url(pack) else os.fspath(Path(pack))
            click.echo(_json_text({"ok": False, "error": _said(exc), "path": shown}))
        raise
    if as_json:
        click.echo(json.dumps({"ok": True, **result.to_dict()}))
        return
    shards = _count(result.shards, "shard")
    if result.checks == "records":
        click.echo(f"ok: {result.records:,} records, {_mb(result.bytes)} in {shards} verified")
        return
    click.echo(f"ok: {shards}, {_mb(result.bytes)}: sizes and SHA-256 match the manifest. {_checked_at_url(result)}")


def _checked_at_url(result: Any) -> str:
    """What a verify of an LMDB pack at a URL checked of its records, and how to check the rest."""
    stage = f"packdata stage {result.path} --to DIR, then packdata verify the staged copy"
    unchecked = result.unchecked_shards
    if result.checks == "checksums":
        return f"Records NOT checked: no shard has a records.i64 table to check them by at a URL ({stage})"
    said = (
        f"{result.records:,} records checked through their records.i64 rows "
        "(record header and CRC-32; key, label and size against the sample index; row CRC32C)"
    )
    if unchecked:
        names = ", ".join(_shown(name) for name in unchecked[:3]) + (
            f" and {len(unchecked) - 3:,} more" if len(unchecked) > 3 else ""
        )
        said += f". Records NOT checked in {_count(len(unchecked), 'shard')} without the table ({names})"
    return f"{said}. LMDB's own pages and a multi-field sample's fields are checked in local files ({stage})"


@click.command(name="ls")
@click.argument("pack", type=click.Path(path_type=str))
@click.option("--limit", type=click.IntRange(min=0), default=20, show_default=True, help="Samples to list (0: all).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option(
    "--storage-options", callback=_json_object, help="For a PACK URL: fsspec options as JSON, e.g. '{\"anon\": true}'."
)
@_friendly
def ls(pack: str, limit: int, as_json: bool, storage_options: dict[str, Any] | None) -> None:
    """List the samples of PACK: index, key, label/class, fields with sizes, shard (from the index only).

    Only the first --limit samples unless --limit 0; a note on stderr says when more follow.

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

    for row in list_samples(pack, limit=limit + 1 if limit else None, storage_options=storage_options):
        if limit and row["index"] == limit:  # one more than asked for: say the list is cut, off stdout
            first = "the first sample" if limit == 1 else f"the first {limit:,} samples"
            click.echo(f"({first}; more follow: --limit 0 lists all)", err=True)
            break
        if as_json:
            click.echo(_json_text(row))
            continue
        label = f"{row['label']}" + (f" ({_shown(row['class'])})" if row["class"] is not None else "")
        fields = " ".join(f"{_shown(name)}:{format_size(size)}" for name, size in row["fields"].items())
        click.echo(f"#{row['index']}\t{_shown(row['key'])}\t{label}\t{fields}\t{_shown(row['shard'])}")


@click.command(name="cat")
@click.argument("pack", type=click.Path(path_type=str))
@click.argument("sample")
@click.option("--field", "field_name", help="The field to print (needed when the sample has several).")
@click.option(
    "--storage-options", callback=_json_object, help="For a PACK URL: fsspec options as JSON, e.g. '{\"anon\": true}'."
)
@_friendly
def cat(pack: str, sample: str, field_name: str | None, storage_options: dict[str, Any] | None) -> None:
    """Write the stored bytes of one field of SAMPLE (a key, or #N for index N) to stdout.

    On a terminal only plain text is written: binary bytes (an image) or
    control characters are refused, so redirect them to a file.

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

    data = read_field(pack, sample, field_name, storage_options=storage_options)
    if sys.stdout.isatty() and not _plain_text(data):
        raise click.ClickException(
            f"{pack}: sample {_shown(sample)} holds {_mb(len(data))} of binary data or control characters, "
            "not written to the terminal. Redirect it to a file (> FILE) or a pipe"
        )
    rest = memoryview(data)
    while rest:  # a write the reader's exit cut short returns what it wrote: the next one raises BrokenPipeError
        rest = rest[sys.stdout.buffer.write(rest) :]
    sys.stdout.buffer.flush()


def _plain_text(data: bytes) -> bool:
    """UTF-8 with no control character but tab and newline: safe to write to a terminal."""
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return False
    return text.replace("\t", "").replace("\n", "").replace("\r", "").isprintable()


@click.command()
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
    click.echo(f"exported {_count(result.samples, 'sample')} as {_count(result.files, 'file')} into {result.path}")
    if result.refused:
        click.secho(f"  REFUSED {_count(len(result.refused), 'sample')}:", fg="yellow")
        for item in result.refused[:10]:
            click.echo(f"    {_shown(item['key'])}: {_shown(item['reason'])}")
        sys.exit(1)
