"""The Ray engine's plan and its task: one :class:`ShardTask` per shard, planned on the driver and run in a Ray worker.

:func:`plan_tasks` cuts the sorted walk into shard tasks; :func:`run_shard_task`
reads one task's files with the local engine's reader and writes its shard,
index fragment, skip list and ``result.json`` into ``tasks/NNNNN`` (or, into a
URL, uploads its shard from a worker-local folder). The driver is
:mod:`packdata.conversion.ray`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packdata.conversion.layouts import AnySource
from packdata.conversion.load import _Options, _pipeline, _source_bytes, number_fields
from packdata.conversion.probes import probe_path, stat_probe
from packdata.conversion.publish import (
    SKIP_REPORT,
    record_skip,
    skip_line,
)
from packdata.conversion.ray_remote import (
    RemoteTarget,
    task_folder,
    upload_task_files,
)
from packdata.conversion.remote_folder import RemoteSourceFile
from packdata.conversion.sources import RemoteFile, Skip, SourceFile, SourceGroup, walk_record
from packdata.errors import ConfigError, EngineError
from packdata.formats import shard_writer
from packdata.pack.files import atomic_write, fsync_named, read_regular
from packdata.pack.index import INDEX_DIR
from packdata.pack.index_writer import SampleIndexWriter
from packdata.pack.records import Sample

__all__ = ["TASKS_DIR", "ShardTask", "load_result", "plan_tasks", "result_most", "run_shard_task", "save_result"]

TASKS_DIR = "tasks"
_RESULT = "result.json"
_BATCH_BYTES = 32 << 20
_BATCH_SAMPLES = 4096


@dataclass(frozen=True)
class ShardTask:
    """One planned shard: a contiguous run of the sorted walk (files or groups, and walk-time skips)."""

    number: int
    entries: tuple[SourceFile | SourceGroup | Skip, ...]
    files: int
    fingerprint: str

    def describe(self) -> str:
        """``shard task 3 (1000 files, cat/a.jpg .. dog/z.jpg)``, for messages."""
        return f"shard task {self.number} ({self.files} files, {self.entries[0].key} .. {self.entries[-1].key})"


def _file_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0  # the task reports it as unreadable


def _entry_size(entry: SourceFile | SourceGroup) -> int:
    """The source bytes of a file or a group (its files' sizes and its inline values)."""
    if isinstance(entry, RemoteSourceFile):
        return entry.size
    if isinstance(entry, SourceFile):
        return _file_size(entry.path)
    on_disk = sum(_file_size(path) for _, path in entry.files if isinstance(path, str))
    return on_disk + sum(len(value) for _, value in entry.values)


def plan_tasks(
    source: AnySource, *, shard_samples: int | None, shard_size: int | None, spill: Path | None = None
) -> Iterator[ShardTask]:
    """Cut the sorted walk of ``source`` into shard tasks, deterministically.

    The roll rule is the local engine's: a task takes files (or groups) until
    the next one would make it hold more than ``shard_samples`` of them or
    ``shard_size`` bytes (``os.stat`` sizes; one larger than the limit gets a
    task of its own). Walk-time skips (hidden files, other extensions) travel with the task
    they fall in, so the skip report keeps walk order.

    Args:
        source: the scanned source.
        shard_samples: at most this many files per task.
        shard_size: at most this many source bytes per task.
        spill: where the walk's key set spills (see :class:`~packdata.pack.keyset.KeySet`).

    Raises:
        ConfigError: neither limit is given.
    """
    if not shard_samples and not shard_size:
        raise ConfigError("a shard plan needs shard_samples or shard_size")
    entries: list[SourceFile | SourceGroup | Skip] = []
    files = nbytes = number = 0
    digest = hashlib.sha256()
    for entry in source.walk(spill):
        if not isinstance(entry, Skip):
            size = _entry_size(entry) if shard_size else 0
            if files and ((shard_samples and files >= shard_samples) or (shard_size and nbytes + size > shard_size)):
                yield ShardTask(number, tuple(entries), files, digest.hexdigest())
                entries, files, nbytes, number, digest = [], 0, 0, number + 1, hashlib.sha256()
            files += 1
            nbytes += size
        entries.append(entry)
        digest.update(walk_record(entry))
        if isinstance(entry, RemoteSourceFile):  # the object as listed: one rewritten since reruns its task
            version = getattr(entry.remote, "version", "")
            digest.update(b"%d:%s\n" % (entry.size, version.encode("utf-8", "surrogateescape")))
    if entries:
        yield ShardTask(number, tuple(entries), files, digest.hexdigest())


def _task_dir(partial: Path, number: int) -> Path:
    return partial / TASKS_DIR / f"{number:05d}"


def run_shard_task(
    task: ShardTask, partial: str, opts: _Options, threads: int, target: RemoteTarget | None = None
) -> dict[str, Any]:
    """Read the files of one task and write its shard, index fragment and skip list (runs in a Ray worker).

    Starts from scratch every attempt, so a retried task overwrites what a dead
    attempt left. Returns a small JSON-ready summary, also saved as
    ``tasks/NNNNN/result.json`` (written last) for ``resume``, with the size
    and SHA-256 of each fragment file as written (``"fragment_files"``); with
    ``on_error="fail"`` a bad file is returned as ``{"failed": ...}``.
    With a ``target`` URL, ``partial`` is not used: the task writes in a
    worker-local temporary folder, uploads its shard files to the URL and
    returns its fragment files in the summary (``"fragment"``: name -> bytes)
    with the uploaded objects' sizes, MD5s and versions (``"objects"``).
    """
    if target is None:
        if not (Path(partial) / TASKS_DIR).is_dir():
            raise EngineError("the conversion this task belongs to is gone", path=partial)
        return _write_shard(task, Path(partial), opts, threads)
    with task_folder() as folder:
        pack = folder / "pack"  # beside the task's lock file, which is not uploaded
        (pack / TASKS_DIR).mkdir(parents=True)
        summary = _write_shard(task, pack, opts, threads)
        if "failed" in summary:
            return summary
        summary["objects"] = upload_task_files(pack, TASKS_DIR, target) if summary["shard"] else {}
        work = _task_dir(pack, task.number)
        summary["fragment"] = {
            p.relative_to(work).as_posix(): p.read_bytes() for p in work.rglob("*") if p.is_file() and p.name != _RESULT
        }
        return summary


def _write_shard(task: ShardTask, pack: Path, opts: _Options, threads: int) -> dict[str, Any]:
    """Write one task's shard into ``pack``, its fragment and result into ``tasks/NNNNN``; the summary."""
    work = _task_dir(pack, task.number)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir()
    writer_cls = shard_writer(opts.format)
    name = writer_cls.shard_name(task.number)
    if (pack / name).is_dir():
        shutil.rmtree(pack / name)  # an LMDB environment from a dead attempt
    skipped: Counter[str] = Counter()
    examples: list[dict[str, str]] = []
    samples = bytes_in = reencoded = batch_bytes = 0
    batch: list[tuple[int, Sample]] = []
    writer = None
    index = SampleIndexWriter(work, fields=opts.kind == "fields")
    field_numbers: dict[str, int] = {}
    field_names: list[str] = []  # this task's field numbers; the driver renumbers them for the pack
    report_digest, report_bytes = hashlib.sha256(), 0  # of the skip list as written
    shard = None
    packed: list[str | RemoteFile] = []  # the first and the last file (or listed object) packed: probed
    try:
        with open(work / SKIP_REPORT, "wb") as report, ThreadPoolExecutor(threads) as pool:
            for entry, result, was_reencoded in _pipeline(iter(task.entries), pool, opts, max(32, 8 * threads)):
                if isinstance(result, Skip):
                    read_error = result.problem
                    line = skip_line(result)
                    if read_error and opts.on_error == "fail":
                        return {"number": task.number, "failed": line}
                    written = record_skip(report, skipped, examples, line, read_error=read_error)
                    report_digest.update(written)
                    report_bytes += len(written)
                    continue
                if writer is None:
                    writer = writer_cls(pack / name)
                if (path := probe_path(entry)) is not None:
                    packed[1 if packed else 0 :] = [path]
                size = len(result.data)
                batch.append((samples, result))
                index.append(result.key, result.label, size, number_fields(result, field_numbers, field_names))
                samples += 1
                bytes_in += _source_bytes(entry, result, was_reencoded)
                reencoded += was_reencoded
                batch_bytes += size
                if batch_bytes >= _BATCH_BYTES or len(batch) >= _BATCH_SAMPLES:
                    writer.write(batch)
                    batch, batch_bytes = [], 0
            if batch and writer is not None:
                writer.write(batch)
            report.flush()
            fsync_named(report.fileno(), report.name)
        if writer is not None:
            nbytes, digest = writer.close()
            writer = None
            shard = {"file": name, "num_samples": samples, "bytes": nbytes, "sha256": digest}
    finally:
        index.close()
        if writer is not None:  # this attempt failed; the next one starts afresh
            with contextlib.suppress(Exception):
                writer.close()
    summary = {
        "number": task.number,
        "fingerprint": task.fingerprint,
        "entries": len(task.entries),
        "samples": samples,
        "bytes_in": bytes_in,
        "reencoded": reencoded,
        "skipped": dict(skipped),
        "skip_examples": examples,
        "shard": shard,
        "field_names": field_names,
        "probes": [probe for path in packed if (probe := stat_probe(path)) is not None],
        # what the gather appends, as written: it checks each file against these first
        "fragment_files": {
            **{f"{INDEX_DIR}/{name}": entry for name, entry in index.checkpoint().items()},
            SKIP_REPORT: [report_bytes, report_digest.hexdigest()],
        },
    }
    save_result(work, summary)
    return summary


_RESULT_SHA256 = "result_sha256"


def save_result(work: Path, result: dict[str, Any]) -> None:
    """Write a task's ``result.json`` into ``work``, with the SHA-256 of its own content (see :func:`load_result`)."""
    body = {key: value for key, value in result.items() if key != _RESULT_SHA256}
    digest = hashlib.sha256(_canonical(body)).hexdigest()
    atomic_write(work / _RESULT, json.dumps({**body, _RESULT_SHA256: digest}, ensure_ascii=False).encode("utf-8"))


# A result at its longest but for its field names: counts, digests, its shard and the few objects uploaded of it,
# 2 probes and MAX_SKIP_EXAMPLES skip lines (each a path or URL, a version, a message: under 100 KiB JSON-escaped)
_RESULT_FIXED = 4 << 20


def result_most(task: ShardTask) -> int:
    """The most bytes ``result.json`` of ``task`` can hold: :data:`_RESULT_FIXED` and a name per field of its groups
    (JSON-escaped, up to 6 bytes a byte)."""
    names = (name for e in task.entries if isinstance(e, SourceGroup) for name, _ in (*e.files, *e.values))
    return _RESULT_FIXED + sum(6 * len(name.encode("utf-8")) + 4 for name in names)


def load_result(path: Path, *, most: int) -> dict[str, Any] | None:
    """A saved ``result.json`` whose content still has the SHA-256 it was saved with, else None.

    None also for one that cannot be read or parsed, one of an earlier packdata (no digest), or one longer than
    ``most`` bytes (:func:`result_most`: more than its task writes, read no further): its task runs again.
    """
    try:  # one longer than most raises OSError (EFBIG) too: not its task's, it runs again as a damaged one does
        data = read_regular(path, most, follow_symlinks=False)
    except OSError:
        return None
    try:
        saved = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    if not isinstance(saved, dict):
        return None
    digest = saved.pop(_RESULT_SHA256, None)
    return saved if digest == hashlib.sha256(_canonical(saved)).hexdigest() else None


def _canonical(body: dict[str, Any]) -> bytes:
    """One byte string for a JSON value, whatever order its keys were written in."""
    return json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
