"""``packdata info`` and ``packdata verify``: what a pack holds, and whether it is intact."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packdata.errors import PackFormatError
from packdata.formats import get_format
from packdata.pack.fields import FieldError, decode_block
from packdata.pack.files import file_sha256, not_a_file, open_pack_file
from packdata.pack.index import SampleIndex, check_index_digests, labels_out_of_range
from packdata.pack.manifest import MANIFEST_NAME, Manifest, ShardInfo, check_field_counts, read_manifest
from packdata.pack.records import Sample
from packdata.pack.urls import display_url, is_url, open_url, read_url_manifest
from packdata.progress import progress as show_progress

__all__ = ["VerifyResult", "check_shard_file", "check_shard_records", "open_index", "pack_info", "verify_pack"]


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
    """A verified pack: how many records and bytes were checked, and how deeply.

    ``checks`` is ``"records"`` (every record read and checked); for an LMDB
    pack verified at a URL (its records are read through LMDB in local files)
    ``"rows"`` (each shard's size and SHA-256, and every record of a shard with
    a ``records.i64`` checked through its row; ``unchecked_shards`` names the
    shards without one) or ``"checksums"`` (no shard had one: sizes and SHA-256
    only). ``records`` counts the records checked, ``bytes`` their payload
    bytes, or for an LMDB pack at a URL the shards' bytes.
    """

    path: Path | str
    records: int
    bytes: int
    shards: int
    checks: str = "records"
    unchecked_shards: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data (``unchecked_shards`` only where records are not all checked)."""
        data = {**self.__dict__, "path": os.fspath(self.path)}
        if self.checks == "records":
            del data["unchecked_shards"]
        return data


def _check_counts(manifest: Manifest, pack: Path, where: str | Path | None = None) -> None:
    """Every source file counted is a sample or a skip, and every skip is in the skip report.

    ``where`` names the pack in messages (default ``pack``; a URL for a downloaded copy).
    """
    where = where or pack
    found = manifest.source.get("files_found")
    skipped = manifest.skipped.get("count")
    if not isinstance(found, int) or not isinstance(skipped, int):
        return  # a manifest without the counts (hand-made): nothing to compare
    if found != manifest.num_samples + skipped:
        raise PackFormatError(
            f"the conversion counted {found} source files, but the pack holds {manifest.num_samples} samples "
            f"and {skipped} skips ({found - manifest.num_samples - skipped} unaccounted for)",
            path=f"{where}/{MANIFEST_NAME}",
            hint="Samples were lost: convert the folder again with overwrite=True",
        )
    report = manifest.skipped.get("report")
    if not skipped or not isinstance(report, str):
        return
    missing = PackFormatError(
        f"the manifest counts {skipped} skipped files, but the skip report {report!r} is missing",
        path=where,
        hint="Convert or stage the pack again",
    )
    if "/" in report or report.startswith("."):
        raise missing
    try:
        fd = open_pack_file(pack / report, shown=f"{where}/{report}")
    except FileNotFoundError:
        raise missing from None
    with os.fdopen(fd, "rb") as f:
        lines = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    if lines != skipped:
        raise PackFormatError(
            f"skip report lists {lines} files, the manifest counts {skipped}",
            path=f"{where}/{report}",
            hint="Convert the pack again",
        )


def open_index(manifest: Manifest, pack: Path, where: str | Path) -> SampleIndex:
    """The pack's sample index: each file checked against its SHA-256 in the manifest, every label to lie in range.

    Labels must lie in ``[-1, len(classes))``; a pack written before the
    manifest recorded index digests is checked for range only. The
    manifest's ``field_counts``, when it has them, must be the index's.
    """
    index_dir = pack / manifest.index_dir
    shown_dir = f"{where}/{manifest.index_dir}"
    check_index_digests(index_dir, manifest.index_sha256, shown=shown_dir)
    try:
        index = SampleIndex(index_dir, manifest.num_samples, manifest.fields if manifest.kind == "fields" else None)
    except (OSError, ValueError) as exc:
        problem = str(exc).replace(os.fspath(pack), os.fspath(where))
        raise PackFormatError(
            f"sample index is missing or damaged: {problem}", path=shown_dir, hint="Convert the pack again"
        ) from exc
    labels = index.labels
    bad = labels_out_of_range(labels, len(manifest.classes))
    if bad is not None:
        raise PackFormatError(
            f"sample {bad[0]} has label {int(labels[bad[0]])}, outside [-1, {len(manifest.classes)})",
            path=f"{shown_dir}/labels.i32",
            hint="Convert the pack again",
        )
    check_field_counts(manifest, index.field_counts(), f"{where}/{MANIFEST_NAME}")
    return index


def verify_pack(
    path: str | os.PathLike,
    *,
    progress: bool = True,
    storage_options: dict[str, Any] | None = None,
    workers: int | None = None,
) -> VerifyResult:
    """Read every record of a pack and check it against the manifest and index.

    Checks each sample index file against its SHA-256 in the manifest (first),
    that every source file the manifest counts is packed or skipped
    (and each skip listed in the skip report), each shard's byte size and
    SHA-256, each record's CRC, that indices run without gaps, that every
    record's key and label equal the index, that every label lies in
    ``[-1, len(classes))``, and every side table (``records.i64``,
    ``.tfindex``, ``.tfpayload``) row by row.

    A URL (``s3://bucket/train``) is verified in place (see
    :func:`packdata.formats.remote_verify.verify_remote_pack`): the same checks
    for a TFRecord pack, its shards streamed once each. For an LMDB pack
    (``checks="rows"``, or ``"checksums"`` where no shard has a ``records.i64``), the sample index, counts, skip
    report and labels, each shard's size and SHA-256, and every row of its
    ``records.i64`` (where it has one) against the record it places (header,
    CRC-32, key, label and size); not LMDB's own pages nor the fields of a
    ``kind="fields"`` record: its records are read through LMDB, which needs a
    local file, so stage it and verify the staged copy for every check.

    Args:
        path: the pack, or its URL.
        progress: show progress on stderr.
        storage_options: for a URL: passed to fsspec (credentials, endpoint).
        workers: for a URL: shards verified at once (default 8).

    Raises:
        PackFormatError: naming the first bad shard or record.
    """
    if is_url(path):
        from packdata.formats.remote_verify import verify_remote_pack

        return verify_remote_pack(os.fspath(path), storage_options=storage_options, progress=progress, workers=workers)
    pack = Path(path)
    manifest = read_manifest(pack)
    index = open_index(manifest, pack, pack)  # first: a damaged index file is named before anything else
    _check_counts(manifest, pack)
    fmt = get_format(manifest.format)
    checked = nbytes = 0
    with show_progress(total=manifest.num_samples, desc="verifying", unit=" records", disable=not progress) as bar:
        for shard in manifest.shards:
            shard_path = shard.path(pack)
            data_file = check_shard_file(manifest.format, shard_path, shard)
            records, shard_bytes = check_shard_records(
                fmt.iter_samples(shard_path, shard.first_index), shard, manifest, index, data_file, bar.update
            )
            checked += records
            nbytes += shard_bytes
            fmt.check_side_tables(shard_path, shard)
    return VerifyResult(pack, checked, nbytes, len(manifest.shards))


def check_shard_file(fmt: str, shard_path: Path, shard: ShardInfo, *, checksum: bool = True) -> Path:
    """The data file of the shard at ``shard_path``, checked to be a regular file of the manifest's size and SHA-256.

    Args:
        fmt: the pack's format.
        shard_path: where the shard is.
        shard: its manifest entry.
        checksum: check the SHA-256 too (reads the whole file), not only the size.

    Raises:
        PackFormatError: naming the data file.
    """
    data_file = get_format(fmt).shard_layout(os.path.basename(shard.file)).data_path(shard_path)
    problem = not_a_file(data_file)
    if problem:
        raise PackFormatError(f"shard file {problem}", path=data_file, hint="Convert or stage the pack again")
    size = data_file.stat().st_size
    if size != shard.bytes:
        raise PackFormatError(
            f"shard is {size} bytes, the manifest says {shard.bytes}",
            path=data_file,
            hint="The shard is truncated or was replaced: convert or stage again",
        )
    if checksum and file_sha256(data_file) != shard.sha256:
        raise PackFormatError(
            "shard checksum does not match the manifest",
            path=data_file,
            hint="The shard is damaged: convert or stage again",
        )
    return data_file


def check_shard_records(
    samples: Iterator[tuple[int, Sample]],
    shard: ShardInfo,
    manifest: Manifest,
    index: SampleIndex,
    where: str | Path,
    on_record: Callable[[], object] = lambda: None,
) -> tuple[int, int]:
    """Check a shard's records against the sample index: no gap, same key, label, size and fields, none missing.

    Returns:
        ``(records, payload bytes)`` checked.

    Raises:
        PackFormatError: naming ``where`` (the shard's data file or URL) and the record.
    """
    expected = shard.first_index
    nbytes = 0
    for i, sample in samples:
        if i != expected:
            raise PackFormatError(f"record {expected} is missing (found {i} next)", path=where)
        if (
            sample.key != index.keys[i]
            or sample.label != int(index.labels[i])
            or len(sample.data) != int(index.sizes[i])
        ):
            raise PackFormatError(
                f"record {i} (key {sample.key!r}) does not match the sample index",
                path=where,
                hint="Convert the pack again",
            )
        if manifest.kind == "fields":
            _check_fields(sample.data, index.sample_fields(i), i, where)
        expected += 1
        nbytes += len(sample.data)
        on_record()
    if expected != shard.first_index + shard.num_samples:
        raise PackFormatError(
            f"shard holds {expected - shard.first_index} records, the manifest says {shard.num_samples}",
            path=where,
        )
    return expected - shard.first_index, nbytes


def _check_fields(block: bytes, sizes: dict[str, int], i: int, data_file: str | Path) -> None:
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
