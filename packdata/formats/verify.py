"""``packdata info`` and ``packdata verify``: what a pack holds, and whether it is intact."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packdata.errors import PackFormatError
from packdata.formats import get_format
from packdata.pack.fields import FieldError, decode_block
from packdata.pack.files import file_sha256
from packdata.pack.index import SampleIndex
from packdata.pack.manifest import MANIFEST_NAME, Manifest, read_manifest
from packdata.pack.urls import display_url, is_url, open_url, read_url_manifest
from packdata.progress import progress as show_progress

__all__ = ["VerifyResult", "pack_info", "verify_pack"]


def pack_info(path: str | os.PathLike, *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest facts of a pack (a local path, or a URL such as ``s3://bucket/train.lmdb``), as JSON-ready data."""
    if is_url(path):
        fs, root = open_url(os.fspath(path), storage_options)
        manifest, _ = read_url_manifest(fs, root, display_url(os.fspath(path)))
        info = manifest.to_dict()
        info["path"] = display_url(os.fspath(path))
        info["total_bytes"] = manifest.total_bytes
        return info
    manifest = read_manifest(path)
    info = manifest.to_dict()
    info["path"] = os.fspath(path)
    info["total_bytes"] = manifest.total_bytes
    return info


@dataclass
class VerifyResult:
    """A verified pack: how many records and bytes were checked."""

    path: Path
    records: int
    bytes: int
    shards: int


def _check_counts(manifest: Manifest, pack: Path) -> None:
    """Every source file counted is a sample or a skip, and every skip is in the skip report."""
    found = manifest.source.get("files_found")
    skipped = manifest.skipped.get("count")
    if not isinstance(found, int) or not isinstance(skipped, int):
        return  # a manifest without the counts (hand-made): nothing to compare
    if found != manifest.num_samples + skipped:
        raise PackFormatError(
            f"the conversion counted {found} source files, but the pack holds {manifest.num_samples} samples "
            f"and {skipped} skips ({found - manifest.num_samples - skipped} unaccounted for)",
            path=pack / MANIFEST_NAME,
            hint="Samples were lost: convert the folder again with overwrite=True",
        )
    report = manifest.skipped.get("report")
    if not skipped or not isinstance(report, str):
        return
    report_path = pack / report
    if "/" in report or report.startswith(".") or not report_path.is_file():
        raise PackFormatError(
            f"the manifest counts {skipped} skipped files, but the skip report {report!r} is missing",
            path=pack,
            hint="Convert or stage the pack again",
        )
    with open(report_path, "rb") as f:
        lines = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    if lines != skipped:
        raise PackFormatError(
            f"skip report lists {lines} files, the manifest counts {skipped}",
            path=report_path,
            hint="Convert the pack again",
        )


def verify_pack(path: str | os.PathLike, *, progress: bool = True) -> VerifyResult:
    """Read every record of a pack and check it against the manifest and index.

    Checks that every source file the manifest counts is packed or skipped
    (and each skip listed in the skip report), each shard's byte size and
    SHA-256, each record's CRC, that indices run without gaps, that every
    record's key and label equal the index, that every label lies in
    ``[-1, len(classes))``, and every side table (``records.i64``,
    ``.tfindex``, ``.tfpayload``) row by row.

    Raises:
        PackFormatError: naming the first bad shard or record.
    """
    pack = Path(path)
    manifest = read_manifest(pack)
    _check_counts(manifest, pack)
    index_dir = pack / manifest.index.get("dir", "index")
    try:
        index = SampleIndex(index_dir, manifest.num_samples, manifest.fields if manifest.kind == "fields" else None)
    except (OSError, ValueError) as exc:
        raise PackFormatError(
            f"sample index is missing or damaged: {exc}", path=index_dir, hint="Convert the pack again"
        ) from exc
    labels = index.labels
    bad = [int(i) for i in ((labels < -1) | (labels >= len(manifest.classes))).nonzero()[0][:1]]
    if bad:
        raise PackFormatError(
            f"sample {bad[0]} has label {int(labels[bad[0]])}, outside [-1, {len(manifest.classes)})",
            path=index_dir / "labels.i32",
            hint="Convert the pack again",
        )
    fmt = get_format(manifest.format)
    checked = nbytes = 0
    with show_progress(total=manifest.num_samples, desc="verifying", unit=" records", disable=not progress) as bar:
        for shard in manifest.shards:
            shard_path = shard.path(pack)
            data_file = fmt.shard_layout(os.path.basename(shard.file)).data_path(shard_path)
            if not data_file.is_file():
                raise PackFormatError("shard file is missing", path=data_file, hint="Convert or stage the pack again")
            size = data_file.stat().st_size
            if size != shard.bytes:
                raise PackFormatError(
                    f"shard is {size} bytes, the manifest says {shard.bytes}",
                    path=data_file,
                    hint="The shard is truncated or was replaced: convert or stage again",
                )
            if file_sha256(data_file) != shard.sha256:
                raise PackFormatError(
                    "shard checksum does not match the manifest",
                    path=data_file,
                    hint="The shard is damaged: convert or stage again",
                )
            expected = shard.first_index
            for i, sample in fmt.iter_samples(shard_path, shard.first_index):
                if i != expected:
                    raise PackFormatError(f"record {expected} is missing (found {i} next)", path=data_file)
                if (
                    sample.key != index.keys[i]
                    or sample.label != int(index.labels[i])
                    or len(sample.data) != int(index.sizes[i])
                ):
                    raise PackFormatError(
                        f"record {i} (key {sample.key!r}) does not match the sample index",
                        path=data_file,
                        hint="Convert the pack again",
                    )
                if manifest.kind == "fields":
                    _check_fields(sample.data, index.sample_fields(i), i, data_file)
                expected += 1
                nbytes += len(sample.data)
                bar.update()
            if expected != shard.first_index + shard.num_samples:
                raise PackFormatError(
                    f"shard holds {expected - shard.first_index} records, the manifest says {shard.num_samples}",
                    path=data_file,
                )
            checked += expected - shard.first_index
            fmt.check_side_tables(shard_path, shard)
    return VerifyResult(pack, checked, nbytes, len(manifest.shards))


def _check_fields(block: bytes, sizes: dict[str, int], i: int, data_file: Path) -> None:
    """A fields record's block parses, every field's CRC matches, and its fields and sizes are the index's."""
    try:
        found = {name: len(data) for name, data in decode_block(block).items()}
    except FieldError as exc:
        raise PackFormatError(f"record {i} is damaged: {exc}", path=data_file, hint="Convert the pack again") from exc
    if found != sizes:
        raise PackFormatError(
            f"record {i} holds fields {found}, the sample index says {sizes}",
            path=data_file,
            hint="Convert the pack again",
        )
