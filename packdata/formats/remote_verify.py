"""``packdata verify URL``: a pack in object storage checked in place, without staging it.

The manifest, sample index, side tables and skip report are downloaded into a
temporary folder (:func:`~packdata.formats.remote_pack.download_skeleton`) and
checked as for a local pack (counts, skip report, labels). Then every shard
is read once, front to back, in ranged requests (bounded memory), several
shards at a time (a bounded thread pool), and for each:

- its size and SHA-256 are compared with the manifest;
- where the format can check records in a stream (TFRecord), every record's
  framing and both CRCs, its place in the offsets index, its key, label, size
  and fields against the sample index, and every payload table row, exactly
  as a local verify does;
- where it cannot (LMDB: records are read through LMDB, which needs a local
  file), size, SHA-256, and the side table: its binding to the shard, and
  every row against the record it places, read as the shard's bytes pass
  (as a local verify checks it). The result then says ``checks="rows"``,
  counts the records so checked and names the shards without a table
  (``unchecked_shards``: size and SHA-256 only), or ``checks="checksums"``
  where no shard had one; the CLI says which. Stage the pack and verify the
  staged copy for LMDB's own pages and every record.
"""

from __future__ import annotations

import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from packdata.errors import PackdataError, PackFormatError, raise_at_url
from packdata.formats import PackFormat, get_format
from packdata.formats.remote_pack import download_skeleton
from packdata.formats.remote_reads import RemoteStream
from packdata.formats.verify import VerifyResult, _check_counts, check_shard_records, open_index
from packdata.pack.index import SampleIndex
from packdata.pack.manifest import Manifest, ShardInfo
from packdata.pack.urls import display_url, open_url, read_url_manifest, remote_size
from packdata.progress import progress as show_progress

__all__ = ["verify_remote_pack"]

_WORKERS = 8


def verify_remote_pack(
    url: str, *, storage_options: dict[str, Any] | None = None, progress: bool = True, workers: int | None = None
) -> VerifyResult:
    """Verify the pack at ``url`` in place (see the module docstring).

    Args:
        url: the pack (``s3://bucket/train``).
        storage_options: passed to fsspec (credentials, endpoint).
        progress: show a progress bar (bytes read) on stderr.
        workers: shards read at once (default 8); memory is about 8 MiB per worker.

    Raises:
        PackFormatError: naming the first bad shard (by manifest order) or record, by URL.
        SourceError: a request failed.
    """
    fs, root = open_url(url, storage_options)
    root = root.rstrip("/")
    shown = display_url(url)
    manifest, raw = read_url_manifest(fs, root, shown)
    fmt = get_format(manifest.format)
    with tempfile.TemporaryDirectory(prefix="packdata-verify-") as tmp:
        local = download_skeleton(fs, root, manifest, raw, shown, Path(tmp) / "pack")
        try:  # a file of the temporary copy is named by its URL
            index = open_index(manifest, local, shown)
            _check_counts(manifest, local, shown)
            lock = threading.Lock()
            with (
                show_progress(total=manifest.total_bytes, desc="verifying", unit="B", disable=not progress) as bar,
                ThreadPoolExecutor(max_workers=workers or _WORKERS, thread_name_prefix="packdata-verify") as pool,
            ):

                def advance(n: int) -> None:
                    with lock:
                        bar.update(n)

                futures = [
                    pool.submit(_verify_shard, fs, root, shown, local, fmt, manifest, index, shard, advance)
                    for shard in manifest.shards
                ]
                try:
                    results = [future.result() for future in futures]  # the first bad shard in manifest order
                except BaseException:
                    pool.shutdown(wait=True, cancel_futures=True)
                    raise
        except PackdataError as exc:
            raise_at_url(exc, local, shown, cached=False)
    records = sum(r for r, _, _ in results)
    if all(how == "records" for _, _, how in results):
        return VerifyResult(shown, records, sum(b for _, b, _ in results), len(results))
    unchecked = [shard.file for shard, (_, _, how) in zip(manifest.shards, results, strict=True) if how == "checksums"]
    checks = "checksums" if len(unchecked) == len(results) else "rows"
    return VerifyResult(shown, records, manifest.total_bytes, len(results), checks=checks, unchecked_shards=unchecked)


def _verify_shard(
    fs: Any,
    root: str,
    shown: str,
    local: Path,
    fmt: PackFormat,
    manifest: Manifest,
    index: SampleIndex,
    shard: ShardInfo,
    advance: Any,
) -> tuple[int, int, str]:
    """One shard read once: ``(records checked, payload bytes, how)``.

    ``how`` is ``"records"`` (each record read from the stream), ``"rows"``
    (each record checked through its side table's row) or ``"checksums"`` (size and SHA-256 only).
    """
    rel = fmt.data_name(shard.file)
    where = f"{shown}/{rel}"
    size = remote_size(fs, f"{root}/{rel}", where)
    if size is None:
        raise PackFormatError("shard file is missing", path=where, hint="Upload or convert the pack again")
    if size != shard.bytes:
        raise PackFormatError(
            f"shard is {size} bytes, the manifest says {shard.bytes}",
            path=where,
            hint="The shard is truncated or was replaced: convert or upload again",
        )
    stream = RemoteStream(fs, f"{root}/{rel}", where, size, on_bytes=advance)
    shard_copy = local / shard.file
    samples = fmt.iter_stream_samples(stream, shard_copy, shard, where)
    records = nbytes = 0
    how = "records"
    table_error: PackFormatError | None = None
    if samples is not None:
        records, nbytes = check_shard_records(samples, shard, manifest, index, where)
    else:
        try:
            rows = fmt.check_remote_side_tables(stream, shard_copy, shard, index, where)
        except PackFormatError as exc:  # raised after the checksum: a damaged shard is named, not its table
            table_error = exc
        else:
            records, how = (0, "checksums") if rows is None else (rows, "rows")
    if stream.hexdigest() != shard.sha256:
        raise PackFormatError(
            "shard checksum does not match the manifest",
            path=where,
            hint="The shard is damaged: convert or upload again",
        )
    if table_error is not None:
        raise table_error
    return records, nbytes, how
