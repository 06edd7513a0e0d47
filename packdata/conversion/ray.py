"""Distributed conversion on Ray: one task per shard, gathered by the driver.

One Ray task per shard reads its files with the local engine's reader and writes
its shard, index fragment and skip list into ``.NAME.partial``; the driver gathers
them in plan order, writes the manifest and renames the pack into place, as the
local engine does. Into a URL, each task writes in a worker-local folder and
uploads its own shard (:mod:`packdata.conversion.ray_remote`). How it plans,
scales, fails and resumes: ``docs/architecture.md``.
"""

# Over ~500 lines: planner, task and gather of one engine, read together.

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from packdata.conversion.layouts import AnySource
from packdata.conversion.load import _Options, _pipeline, _source_bytes, number_fields
from packdata.conversion.publish import (
    MAX_SKIP_EXAMPLES,
    PROGRESS_FILE,
    SKIP_REPORT,
    ConvertResult,
    _make_manifest,
    _no_samples_error,
    _publish,
    bad_file_error,
    check_resumable,
    extend_classes,
    make_result,
    partial_path,
    record_skip,
    skip_line,
)
from packdata.conversion.ray_remote import (
    RemoteTarget,
    check_object_name,
    objects_complete,
    place_shards,
    task_folder,
    upload_task_files,
)
from packdata.conversion.remote_folder import RemoteSourceFile
from packdata.conversion.sources import Skip, SourceFile, SourceGroup
from packdata.conversion.upload import upload_pack
from packdata.errors import ConfigError, EngineError
from packdata.formats import get_format, shard_writer
from packdata.pack.files import atomic_write, discard_partial, file_sha256, fsync_dir
from packdata.pack.index import (
    FIELD_OFFSETS_FILE,
    FIELD_SIZES_FILE,
    INDEX_DIR,
    KEY_OFFSETS_FILE,
    KEYS_FILE,
    LABELS_FILE,
    SIZES_FILE,
    SampleIndexWriter,
    index_files,
)
from packdata.pack.manifest import ShardInfo, write_manifest
from packdata.pack.records import Sample
from packdata.progress import progress as show_progress

__all__ = [
    "DEFAULT_TASK_SAMPLES",
    "DEFAULT_TASK_THREADS",
    "MAX_RETRIES",
    "ShardTask",
    "convert_on_ray",
    "plan_tasks",
    "require_ray",
]

DEFAULT_TASK_SAMPLES = 10_000
DEFAULT_TASK_THREADS = 4
MAX_RETRIES = 3
TASKS_DIR = "tasks"
_PLAN = "ray-plan.json"
_RESULT = "result.json"
_BATCH_BYTES = 32 << 20
_BATCH_SAMPLES = 4096
_CHUNK = 1 << 20  # index entries per copy when gathering fragments
_INSTALL_HINT = "Install it with: pip install 'packdata[ray]'"


def require_ray() -> Any:
    """Import Ray, or fail in one line saying how to install it.

    Raises:
        EngineError: Ray is not installed.
    """
    try:
        import ray
    except ImportError as exc:
        raise EngineError("engine 'ray' needs Ray, which is not installed", hint=_INSTALL_HINT) from exc
    return ray


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


def plan_tasks(source: AnySource, *, shard_samples: int | None, shard_size: int | None) -> Iterator[ShardTask]:
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

    Raises:
        ConfigError: neither limit is given.
    """
    if not shard_samples and not shard_size:
        raise ConfigError("a shard plan needs shard_samples or shard_size")
    entries: list[SourceFile | SourceGroup | Skip] = []
    files = nbytes = number = 0
    digest = hashlib.sha256()
    for entry in source.walk():
        if not isinstance(entry, Skip):
            size = _entry_size(entry) if shard_size else 0
            if files and ((shard_samples and files >= shard_samples) or (shard_size and nbytes + size > shard_size)):
                yield ShardTask(number, tuple(entries), files, digest.hexdigest())
                entries, files, nbytes, number, digest = [], 0, 0, number + 1, hashlib.sha256()
            files += 1
            nbytes += size
        entries.append(entry)
        digest.update(entry.key.encode("utf-8", "surrogateescape") + b"\0")
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
    ``tasks/NNNNN/result.json`` (written last) for ``resume``; with
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
    shard = None
    try:
        with open(work / SKIP_REPORT, "wb") as report, ThreadPoolExecutor(threads) as pool:
            for entry, result, was_reencoded in _pipeline(iter(task.entries), pool, opts, max(32, 8 * threads)):
                if isinstance(result, Skip):
                    read_error = result.problem
                    line = skip_line(result)
                    if read_error and opts.on_error == "fail":
                        return {"number": task.number, "failed": line}
                    record_skip(report, skipped, examples, line, read_error=read_error)
                    continue
                if writer is None:
                    writer = writer_cls(pack / name)
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
            os.fsync(report.fileno())
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
    }
    atomic_write(work / _RESULT, json.dumps(summary, ensure_ascii=False).encode("utf-8"))
    return summary


def _keep_fragment(partial: Path, result: dict[str, Any]) -> dict[str, Any]:
    """Write the fragment files a remote task returned into ``tasks/NNNNN`` and save its result there, last."""
    work = _task_dir(partial, int(result["number"]))
    if work.exists():
        shutil.rmtree(work)
    for rel, data in result.pop("fragment").items():
        path = work.joinpath(*check_object_name(rel, os.fspath(work)).split("/"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    atomic_write(work / _RESULT, json.dumps(result, ensure_ascii=False).encode("utf-8"))
    return result


def _saved_result(
    partial: Path, task: ShardTask, name: str, data: str, target: RemoteTarget | None
) -> dict[str, Any] | None:
    """The result an interrupted run saved for ``task``, if it is complete, its own and for the same files.

    Its own: it names this task's number and, if any, the shard ``name`` this
    task writes (never a file elsewhere, or another task's fragment).
    Complete: its shard's records file (``data``, inside the partial folder)
    has the size and SHA-256 the result recorded or, with a ``target`` URL, the
    store still reports every object the task uploaded with its recorded size
    and version.
    """
    path = _task_dir(partial, task.number) / _RESULT
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if (
        not isinstance(saved, dict)
        or saved.get("fingerprint") != task.fingerprint
        or saved.get("number") != task.number
    ):
        return None
    shard = saved.get("shard")
    if shard is not None and (not isinstance(shard, dict) or shard.get("file") != name):
        return None
    if shard is not None and target is None and not _holds_shard(partial / data, shard):
        return None
    if shard is not None and target is not None and not objects_complete(target, saved.get("objects") or {}):
        return None
    return saved


def _holds_shard(data: Path, shard: dict[str, Any]) -> bool:
    """Whether the records file ``data`` has the size and SHA-256 its task's result recorded (hashed once)."""
    try:
        return data.stat().st_size == shard.get("bytes") and file_sha256(data) == shard.get("sha256")
    except OSError:
        return False  # missing, or not a regular file: the task runs again


class _Gatherer:
    """Appends task results, in plan order, to the pack's index, skip report and shard list.

    A fields pack numbers its fields in order of first appearance over the
    whole walk (as the local engine does): each task's own numbers are mapped
    to the pack's as its fragment is appended.
    """

    def __init__(self, partial: Path, kind: str) -> None:
        self.partial = partial
        directory = partial / INDEX_DIR
        directory.mkdir(exist_ok=True)
        # open for the whole gather, closed in close()
        self.files = {name: open(directory / name, "wb") for name in index_files(kind)}  # noqa: SIM115
        for name in (KEY_OFFSETS_FILE, FIELD_OFFSETS_FILE):
            if name in self.files:
                self.files[name].write(np.int64(0).tobytes())
        self.field_names: list[str] = []
        self.field_numbers: dict[str, int] = {}
        self.field_end = 0
        self.report = open(partial / SKIP_REPORT, "wb")  # noqa: SIM115
        self.shards: list[ShardInfo] = []
        self.objects: list[dict[str, list[Any]]] = []  # per shard, the objects its task uploaded (into a URL)
        self.samples = self.files_found = self.bytes_in = self.reencoded = self.key_end = 0
        self.skipped: Counter[str] = Counter()
        self.skip_examples: list[dict[str, str]] = []

    def add(self, result: dict[str, Any]) -> None:
        fragment = _task_dir(self.partial, result["number"])
        source = fragment / INDEX_DIR
        for name in (LABELS_FILE, SIZES_FILE, KEYS_FILE):
            with open(source / name, "rb") as f:
                shutil.copyfileobj(f, self.files[name], 8 << 20)
        self.key_end += self._append_offsets(source / KEY_OFFSETS_FILE, self.key_end)
        if FIELD_SIZES_FILE in self.files:
            self._append_fields(source, result.get("field_names", []))
        with open(fragment / SKIP_REPORT, "rb") as f:
            shutil.copyfileobj(f, self.report, 8 << 20)
        shard = result["shard"]
        if shard is not None:
            self.shards.append(
                ShardInfo(shard["file"], shard["num_samples"], self.samples, shard["bytes"], shard["sha256"])
            )
            self.objects.append(result.get("objects") or {})
        self.samples += result["samples"]
        self.files_found += result["entries"]
        self.bytes_in += result["bytes_in"]
        self.reencoded += result["reencoded"]
        self.skipped.update(result["skipped"])
        room = MAX_SKIP_EXAMPLES - len(self.skip_examples)
        self.skip_examples.extend(result["skip_examples"][:room])

    def _append_offsets(self, fragment: Path, base: int) -> int:
        """Append a fragment's offsets (after its leading 0) moved up by ``base``; its last offset."""
        last = 0
        with open(fragment, "rb") as f:
            f.seek(8)  # every fragment starts with offset 0
            while len(chunk := np.fromfile(f, dtype="<i8", count=_CHUNK)):
                self.files[fragment.name].write((chunk + base).astype("<i8").tobytes())
                last = int(chunk[-1])
        return last

    def _append_fields(self, fragment: Path, names: list[str]) -> None:
        """Append a fragment's field sizes with the task's field numbers mapped to the pack's."""
        for name in names:
            if name not in self.field_numbers:
                self.field_numbers[name] = len(self.field_names)
                self.field_names.append(name)
        pack_number = np.array([self.field_numbers[name] for name in names], dtype="<i8")
        with open(fragment / FIELD_SIZES_FILE, "rb") as f:
            while len(pairs := np.fromfile(f, dtype="<i8", count=2 * _CHUNK)):
                pairs = pairs.reshape(-1, 2)
                pairs[:, 0] = pack_number[pairs[:, 0]]
                self.files[FIELD_SIZES_FILE].write(pairs.astype("<i8").tobytes())
        self.field_end += self._append_offsets(fragment / FIELD_OFFSETS_FILE, self.field_end)

    def close(self) -> None:
        for f in (*self.files.values(), self.report):
            if not f.closed:
                f.flush()
                os.fsync(f.fileno())
                f.close()


def _prepare_partial(partial: Path, dst: Path, opts: _Options, *, overwrite: bool, resume: bool) -> bool:
    """Make the partial folder ready; True when an interrupted Ray run into it is resumed."""
    state = {"engine": "ray", "options": asdict(opts)}
    plan = partial / _PLAN
    if resume and os.path.lexists(partial):
        check_resumable(partial)
    if os.path.lexists(partial):
        if resume and plan.is_file():
            saved = json.loads(plan.read_text(encoding="utf-8"))
            if saved != state:
                raise ConfigError(
                    f"the interrupted conversion used other options ({saved.get('options')})",
                    path=partial,
                    hint="Resume with the same options, or start again with --overwrite",
                )
            (partial / TASKS_DIR).mkdir(exist_ok=True)
            return True
        if resume and (partial / PROGRESS_FILE).is_file():
            raise ConfigError(
                "the interrupted conversion into it ran on the local engine",
                path=dst,
                hint="Resume it with --engine local, or start again with --overwrite",
            )
        if not overwrite and not resume:
            raise ConfigError(
                f"an interrupted conversion into {dst} is in {partial}",
                path=dst,
                hint="Pass --resume to continue it, or --overwrite to start again",
            )
        discard_partial(partial)
    (partial / TASKS_DIR).mkdir(parents=True)
    plan.write_text(json.dumps(state), encoding="utf-8")
    return False


def _drop_strays(partial: Path, shards: list[ShardInfo]) -> None:
    """Remove what an interrupted run left that is no shard of this plan (the source may have shrunk)."""
    stems = tuple(Path(s.file).stem + "." for s in shards)  # a shard and its companions (a .tfindex)
    for path in partial.iterdir():
        if path.name in (INDEX_DIR, SKIP_REPORT) or path.name.startswith(stems):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _connect(ray: Any, address: str | None) -> bool:
    """Join the cluster at ``address``, or start a local Ray; True when this call started Ray."""
    if ray.is_initialized():
        return False
    try:
        if address:
            ray.init(address=address, logging_level=logging.WARNING)
        else:
            ray.init(include_dashboard=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = f"the Ray cluster at {address}" if address else "a local Ray instance"
        raise EngineError(
            f"cannot start or reach {where}: {exc}".splitlines()[0],
            hint="Check --address (start a cluster with `ray start --head`), or leave it out",
        ) from exc
    return True


def _failure(exc: BaseException) -> str:
    """The first line of a Ray task failure, unwrapped to the task's own exception."""
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}".rstrip(": ")


def convert_on_ray(
    source: AnySource,
    dst: Path,
    opts: _Options,
    *,
    workers: int | None,
    overwrite: bool,
    resume: bool,
    progress: bool,
    address: str | None,
    started: float,
    target: RemoteTarget | None = None,
) -> ConvertResult:
    """Run a checked conversion as Ray tasks; called by :func:`packdata.conversion.convert.convert`.

    Args:
        source: the scanned folder or list (its files on storage every Ray node sees).
        dst: the pack to create; its partial folder must be on shared storage.
        opts: the validated conversion options.
        workers: reader threads per task (default :data:`DEFAULT_TASK_THREADS`).
        overwrite: replace an existing pack or interrupted conversion.
        resume: rerun only the tasks an interrupted Ray conversion did not finish.
        progress: show a progress bar on stderr.
        address: the Ray cluster to join; None starts a local Ray instance.
        started: ``time.perf_counter()`` when the conversion began.
        target: the URL the pack goes to; ``dst`` is then the driver's local
            work folder, and no storage is shared with the workers.

    Raises:
        EngineError: Ray is missing or unreachable, or a task failed for good.
        SourceError: no usable files, or (``on_error="fail"``) a bad file.
    """
    ray = require_ray()
    if opts.shard_samples is None and opts.shard_size is None:
        opts = replace(opts, shard_samples=DEFAULT_TASK_SAMPLES)
    partial = partial_path(dst)
    resumed = _prepare_partial(partial, dst, opts, overwrite=overwrite, resume=resume)
    started_ray = _connect(ray, address)
    try:
        gatherer = _Gatherer(partial, opts.kind)
        try:
            _run_tasks(
                ray,
                source,
                partial,
                opts,
                gatherer,
                threads=workers or DEFAULT_TASK_THREADS,
                resumed=resumed,
                progress=progress,
                target=target,
            )
        finally:
            gatherer.close()
    finally:
        if started_ray:
            ray.shutdown()
    if gatherer.samples == 0:
        shutil.rmtree(partial)
        raise _no_samples_error(source, gatherer.skipped)
    writer_cls = shard_writer(opts.format)
    if target is not None:  # before the plan goes: a failure here is resumable
        shards = writer_cls.final_shards(partial, gatherer.shards)
        place_shards(target, gatherer.shards, shards, gatherer.objects)
    # The plan goes first: a run killed from here on starts afresh on --resume, never
    # resumes from task results whose index fragments are half deleted.
    (partial / _PLAN).unlink()
    fsync_dir(partial)
    shutil.rmtree(partial / TASKS_DIR)
    if resumed:
        _drop_strays(partial, gatherer.shards)
    if target is None:
        shards = writer_cls.finalize(partial, gatherer.shards)
    extend_classes(source, partial)
    manifest = _make_manifest(
        source,
        opts,
        partial,
        shards,
        samples=gatherer.samples,
        files_found=gatherer.files_found,
        bytes_in=gatherer.bytes_in,
        reencoded=gatherer.reencoded,
        skipped=gatherer.skipped,
        field_names=gatherer.field_names,
    )
    write_manifest(partial, manifest)
    if target is None:
        _publish(partial, dst, overwrite=overwrite)
    else:  # index and skip report, then the manifest
        upload_pack(partial, target.url, storage_options=target.storage_options, workers=workers, progress=progress)
        shutil.rmtree(partial)
    return make_result(
        dst,
        opts,
        source,
        manifest,
        found=gatherer.files_found,
        skipped=gatherer.skipped,
        skip_examples=gatherer.skip_examples,
        bytes_in=gatherer.bytes_in,
        reencoded=gatherer.reencoded,
        resumed=resumed,
        started=started,
    )


def _run_tasks(
    ray: Any,
    source: AnySource,
    partial: Path,
    opts: _Options,
    gatherer: _Gatherer,
    *,
    threads: int,
    resumed: bool,
    progress: bool,
    target: RemoteTarget | None,
) -> None:
    """Submit the plan with bounded tasks in flight and gather results in plan order."""
    remote = ray.remote(run_shard_task)
    name = shard_writer(opts.format).shard_name
    data_name = get_format(opts.format).data_name
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    limit = cpus + min(cpus, 64)  # every CPU busy, plus a bounded queue (task arguments live in the object store)
    in_flight: dict[Any, tuple[str, int]] = {}  # ref -> (description, walk entries)
    queue: deque[int] = deque()  # task numbers planned, not yet gathered, in plan order
    results: dict[int, dict[str, Any]] = {}
    bar = show_progress(desc="packing (ray)", unit=" files", disable=not progress)

    def settle(block: bool) -> None:
        if in_flight:
            ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=None if block else 0)
            for ref in ready:
                description, entries = in_flight.pop(ref)
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    _abort(ray, in_flight)
                    raise EngineError(
                        f"{description} failed for good (Ray retries a task up to {MAX_RETRIES} times): "
                        f"{_failure(exc)}",
                        path=partial,
                        hint="Fix the cause and rerun with --resume: finished shards are kept",
                    ) from exc
                if "fragment" in result:
                    result = _keep_fragment(partial, result)
                results[result["number"]] = result
                bar.update(entries)
        while queue and queue[0] in results:
            result = results.pop(queue.popleft())
            if "failed" in result:
                _abort(ray, in_flight)
                shutil.rmtree(partial, ignore_errors=True)  # a deliberate stop: nothing to resume
                raise bad_file_error(source.root, result["failed"])
            gatherer.add(result)

    try:
        with bar:
            for task in plan_tasks(source, shard_samples=opts.shard_samples, shard_size=opts.shard_size):
                queue.append(task.number)  # the entries travel with the task, not kept here
                saved = None
                if resumed:
                    saved = _saved_result(partial, task, name(task.number), data_name(name(task.number)), target)
                if saved is not None:
                    results[task.number] = saved
                    bar.update(len(task.entries))
                else:
                    ref = remote.options(
                        num_cpus=1,
                        max_retries=MAX_RETRIES,
                        retry_exceptions=[OSError],
                        name=f"packdata-shard-{task.number:05d}",
                    ).remote(task, os.fspath(partial), opts, threads, target)
                    in_flight[ref] = (task.describe(), len(task.entries))
                while len(in_flight) >= limit:
                    settle(block=True)
                settle(block=False)
            while in_flight or queue:
                settle(block=True)
    except BaseException:
        _abort(ray, in_flight)
        raise


def _abort(ray: Any, in_flight: dict[Any, Any]) -> None:
    """Stop every task still running, so none writes into a folder being removed."""
    for ref in in_flight:
        ray.cancel(ref, force=True)
    for ref in list(in_flight):
        with contextlib.suppress(Exception):  # a cancelled task raises; we only wait for it to end
            ray.get(ref, timeout=30)
    in_flight.clear()
