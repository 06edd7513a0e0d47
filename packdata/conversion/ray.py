"""Distributed conversion on Ray: one task per shard, gathered by the driver.

One Ray task per shard reads its files with the local engine's reader and writes
its shard, index fragment and skip list into ``.NAME.partial``; the driver gathers
them in plan order, writes the manifest and renames the pack into place, as the
local engine does. Into a URL, each task writes in a worker-local folder and
uploads its own shard (:mod:`packdata.conversion.ray_remote`). This module is
the driver; the plan and the task are in :mod:`packdata.conversion.ray_tasks`,
the partial folder's resume checks and the gather in
:mod:`packdata.conversion.ray_gather`. How it plans, scales, fails and resumes:
``docs/architecture.md``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections import Counter, deque
from dataclasses import replace
from pathlib import Path
from typing import Any

from packdata.conversion.destination import partial_path, spill_folder
from packdata.conversion.layouts import AnySource
from packdata.conversion.load import _Options
from packdata.conversion.probes import check_probes
from packdata.conversion.publish import (
    ConvertResult,
    _make_manifest,
    _no_samples_error,
    _publish,
    bad_file_error,
    extend_classes,
    make_result,
    source_identity,
)
from packdata.conversion.ray_gather import (
    _drop_strays,
    _finishing_state,
    _Gatherer,
    _keep_fragment,
    _mark_finishing,
    _prepare_partial,
    _saved_result,
)
from packdata.conversion.ray_remote import (
    RemoteTarget,
    place_shards,
)
from packdata.conversion.ray_tasks import plan_tasks, run_shard_task
from packdata.conversion.upload import upload_pack
from packdata.conversion.upload_journal import journal_task_objects
from packdata.errors import CapacityError, EngineError, PackdataError, PackFormatError
from packdata.formats import get_format, shard_writer
from packdata.host.disks import FULL_DISK_ERRNOS, RERUN_HINT, no_space_error, raise_if_full
from packdata.pack.files import RAY_PLAN_FILE, fsync_dir
from packdata.pack.manifest import Manifest, write_manifest
from packdata.progress import count_done_before
from packdata.progress import progress as show_progress

__all__ = [
    "DEFAULT_TASK_SAMPLES",
    "DEFAULT_TASK_THREADS",
    "DRAIN_SECONDS",
    "MAX_RETRIES",
    "convert_on_ray",
    "require_ray",
]

DEFAULT_TASK_SAMPLES = 10_000
DEFAULT_TASK_THREADS = 4
MAX_RETRIES = 3
DRAIN_SECONDS = 60.0
"""How long the tasks in flight may go on once one failed for good: those that end keep their shards for a resume."""
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
            hint=f"Check address={address!r} (start a cluster with `ray start --head`), or leave it out"
            if address
            else "Check that Ray starts on this machine, or pass the address=ADDRESS of a running cluster",
        ) from exc
    return True


_FULL_HINT = "Free space on that disk, then run again with resume=True: finished shards are kept"


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
        resume: rerun only the tasks an interrupted Ray conversion did not finish (one killed
            after its manifest was written only finishes: no task runs, Ray is not started).
        progress: show a progress bar on stderr.
        address: the Ray cluster to join; None starts a local Ray instance.
        started: ``time.perf_counter()`` when the conversion began.
        target: the URL the pack goes to; ``dst`` is then the driver's local
            work folder, and no storage is shared with the workers.

    Raises:
        EngineError: Ray is missing or unreachable, or a task failed for good.
        SourceError: no usable files, or (``on_error="fail"``) a bad file.
        CapacityError: a full disk under the partial pack (named; resume once freed).
        PackFormatError: what an interrupted run left (resumed) is damaged.
    """
    ray = require_ray()
    if opts.shard_samples is None and opts.shard_size is None:
        opts = replace(opts, shard_samples=DEFAULT_TASK_SAMPLES)
    partial = partial_path(dst)
    resumed, plan = _prepare_partial(
        partial,
        dst,
        opts,
        overwrite=overwrite,
        resume=resume,
        classes=list(source.classes),
        source=source.root,
        places=source_identity(source),
    )
    writer_cls = shard_writer(opts.format)
    finishing = _finishing_state(partial, plan, writer_cls.shard_name) if resumed else None
    if finishing is None:
        gatherer = _gather(ray, source, partial, opts, workers, resumed, progress, address, target)
        manifest, record = _commit(source, partial, opts, gatherer, target, plan)
        packed_before = gatherer.samples_before
    else:  # killed while finishing: every task was gathered, the manifest written
        manifest, record = finishing
        packed_before = manifest.num_samples
    _finish(partial, writer_cls, manifest, record["written"], local=target is None)
    if target is None:
        _publish(partial, dst, overwrite=overwrite)
    else:  # index and skip report, then the manifest; the plan (never uploaded) stays until then, for a resume
        upload_pack(  # acts on what the driver's check found, as the local engine does: the manifest is not read again
            partial,
            target.url,
            storage_options=target.storage_options,
            workers=workers,
            progress=progress,
            found=target.found,
        )
        shutil.rmtree(partial)
    return make_result(
        dst,
        opts,
        source,
        manifest,
        found=record["found"],
        skipped=Counter(record["skipped"]),
        skip_examples=record["skip_examples"],
        bytes_in=record["bytes_in"],
        reencoded=record["reencoded"],
        resumed=resumed,
        started=started,
        packed_before=packed_before,
    )


def _gather(
    ray: Any,
    source: AnySource,
    partial: Path,
    opts: _Options,
    workers: int | None,
    resumed: bool,
    progress: bool,
    address: str | None,
    target: RemoteTarget | None,
) -> _Gatherer:
    """Run the tasks a resume does not keep and gather every task's result, in plan order; the closed gatherer."""
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
        except BaseException:
            with contextlib.suppress(OSError, PackdataError):  # never in place of the error that stopped the run
                gatherer.close()
            raise
        gatherer.close()
    except OSError as exc:  # the driver's own writes: the gathered index, a remote task's fragment
        raise_if_full(exc, partial, of="of the partial pack", hint=RERUN_HINT)
        raise
    finally:
        if started_ray:
            ray.shutdown()
    if gatherer.samples == 0:
        shutil.rmtree(partial)
        raise _no_samples_error(source, gatherer.skipped)
    return gatherer


def _commit(
    source: AnySource,
    partial: Path,
    opts: _Options,
    gatherer: _Gatherer,
    target: RemoteTarget | None,
    plan: dict[str, Any],
) -> tuple[Manifest, dict[str, Any]]:
    """Record what finishing needs in the plan (``plan``: as :func:`_prepare_partial` wrote or checked it), then
    write the manifest: from then on, a resume only finishes.

    Nothing is removed or renamed before: a run stopped here (a full disk) resumes from its tasks' results.
    """
    writer_cls = shard_writer(opts.format)
    shards = writer_cls.final_shards(partial, gatherer.shards)  # the names finalize gives; no file touched
    if target is not None:  # the shards' objects get those names at the URL: repeatable, as the plan stays
        place_shards(target, gatherer.shards, shards, gatherer.objects)
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
    record = {
        "written": [shard.file for shard in gatherer.shards],
        "found": gatherer.files_found,
        "bytes_in": gatherer.bytes_in,
        "reencoded": gatherer.reencoded,
        "skipped": dict(gatherer.skipped),
        "skip_examples": gatherer.skip_examples,
    }
    try:
        _mark_finishing(partial, plan, record)
        write_manifest(partial, manifest)
    except OSError as exc:  # nothing published (atomic_write removed its temporary); every task's result is kept
        raise_if_full(exc, partial, of="of the partial pack", hint=_FULL_HINT)
        raise
    return manifest, record


def _finish(partial: Path, writer_cls: Any, manifest: Manifest, written: list[str], *, local: bool) -> None:
    """Give the shards their final names, remove the tasks' folder and strays, then the plan, last.

    Each step is repeatable, so a run killed at any of them resumes here (:func:`_finishing_state`). Into a URL
    (not ``local``) the plan stays until the upload ends: a failed upload resumes by uploading, no task runs.

    Raises:
        PackFormatError: a shard the manifest lists is under neither its written nor its final name.
    """
    if local:
        as_written = [replace(shard, file=name) for shard, name in zip(manifest.shards, written, strict=True)]
        with contextlib.suppress(FileNotFoundError):  # one neither written nor renamed: named below
            writer_cls.finalize(partial, as_written)
        for shard in manifest.shards:
            if not os.path.lexists(partial / shard.file):
                raise PackFormatError(
                    "the interrupted conversion's shard is missing",
                    path=partial / shard.file,
                    hint="Start the conversion again with overwrite=True",
                )
    _drop_strays(partial, manifest.shards)
    if local:
        (partial / RAY_PLAN_FILE).unlink()
    fsync_dir(partial)


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
                    _drain(ray, in_flight)
                    cause = getattr(exc, "cause", None)
                    if isinstance(cause, OSError) and cause.errno in FULL_DISK_ERRNOS and target is None:
                        where = cause.filename or partial  # a task's write into the partial pack: its disk is named
                        raise no_space_error(
                            cause, where, folder=partial, of="of the partial pack", hint=_FULL_HINT
                        ) from exc
                    if isinstance(cause, CapacityError) and target is None:  # the task named the full disk
                        raise cause.with_hint(_FULL_HINT) from exc
                    raise EngineError(
                        f"{description} failed for good (Ray retries a task up to {MAX_RETRIES} times): "
                        f"{_failure(exc)}",
                        path=partial,
                        hint="Fix the cause and run again with resume=True: finished shards are kept",
                    ) from exc
                if "fragment" in result:
                    result = _keep_fragment(partial, result)
                    journal_task_objects(partial.parent, result.get("objects") or {})  # a later run may remove them
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
            spill = spill_folder(partial, empty=True)
            for task in plan_tasks(source, shard_samples=opts.shard_samples, shard_size=opts.shard_size, spill=spill):
                queue.append(task.number)  # the entries travel with the task, not kept here
                saved = None
                if resumed:
                    saved = _saved_result(
                        partial, task, opts.kind, name(task.number), data_name(name(task.number)), target
                    )
                if saved is not None:
                    check_probes(saved.get("probes", []))  # a finished task's file rewritten: refused
                    results[task.number] = saved
                    gatherer.samples_before += saved["samples"]
                    count_done_before(bar, len(task.entries))
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


def _drain(ray: Any, in_flight: dict[Any, Any]) -> None:
    """Let the tasks in flight end, for up to :data:`DRAIN_SECONDS`, then stop only those still running.

    A task writes its own shard and result, so each one that ends is kept for a
    resume; one cancelled would be packed again, however far it had got. A task
    that ended is never cancelled: Ray's core worker dies on cancelling a finished
    task it is completing (a fatal check, 'Tried to complete task that was not pending').
    """
    if in_flight:
        ready, _ = ray.wait(list(in_flight), num_returns=len(in_flight), timeout=DRAIN_SECONDS)
        for ref in ready:
            del in_flight[ref]
    _abort(ray, in_flight)


def _abort(ray: Any, in_flight: dict[Any, Any]) -> None:
    """Stop every task still running, so none writes into a folder being removed."""
    for ref in in_flight:
        ray.cancel(ref, force=True)
    for ref in list(in_flight):
        with contextlib.suppress(Exception):  # a cancelled task raises; we only wait for it to end
            ray.get(ref, timeout=30)
    in_flight.clear()
