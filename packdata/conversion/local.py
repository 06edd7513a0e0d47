"""The local engine: reader threads, one writer that rolls shards, checkpoints after every commit, resume."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from packdata.conversion.checkpoint import _Checkpoint
from packdata.conversion.destination import (
    MAKING_PARTIAL,
    check_resumable,
    interrupted_error,
    partial_path,
    spill_folder,
)
from packdata.conversion.download import COPIED_FROM, copied_again, journal_mark
from packdata.conversion.layouts import AnySource
from packdata.conversion.load import Entry, _Options, _pipeline, _source_bytes, number_fields
from packdata.conversion.probes import probe_path, probe_place, refuse_copied_again, remote_lookup
from packdata.conversion.publish import (
    SKIP_REPORT,
    ConvertResult,
    _make_manifest,
    _no_samples_error,
    _publish,
    bad_file_error,
    extend_classes,
    make_result,
    record_skip,
    skip_line,
    source_identity,
)
from packdata.conversion.resume_shards import check_shard_files
from packdata.conversion.sources import RemoteFile, Skip, walk_record
from packdata.errors import (
    PackdataError,
    PackFormatError,
    SourceError,
)
from packdata.formats import ShardWriter, shard_writer
from packdata.host.cores import usable_cpus
from packdata.host.disks import raise_if_full, write_error
from packdata.pack.files import PROGRESS_FILE, discard_partial, fsync_dir, fsync_named
from packdata.pack.index import FIELD_SIZES_FILE, SIZES_FILE
from packdata.pack.index_writer import SampleIndexWriter
from packdata.pack.manifest import Manifest, ShardInfo, write_manifest
from packdata.pack.records import Sample
from packdata.progress import progress as show_progress
from packdata.units import format_rate

__all__ = []


_FULL_HINT = "Free space on that disk, then convert again with resume=True"

_COMMIT_BYTES = 128 << 20


_COMMIT_SAMPLES = 20_000

_WRITE_BYTES = 4 << 20
"""Samples are handed to the shard's writer every this many bytes, between commits: a commit's 128 MiB held
as samples, then copied whole into records, cost as much again in fresh memory (page faults) and stayed in the
cache of no CPU. Written early, they are not yet durable: a resume cuts the shard back to the last checkpoint."""


def _convert_local(
    source: AnySource,
    dst: Path,
    opts: _Options,
    *,
    workers: int | None,
    overwrite: bool,
    resume: bool,
    progress: bool,
    started: float,
) -> ConvertResult:
    """The local engine: threads read, this process writes; run under the destination's lock."""
    partial = partial_path(dst)
    checkpoint = _Checkpoint(partial / PROGRESS_FILE, asdict(opts), source.classes, source_identity(source))
    if resume and os.path.lexists(partial):
        check_resumable(partial)
    resumed = resume and checkpoint.path.is_file()
    if resumed:
        checkpoint.load(shard_writer(opts.format).shard_name)
        checkpoint.check_source()
        checkpoint.check_classes(source.root)
    elif os.path.lexists(partial):
        if not overwrite and not resume:
            raise interrupted_error(dst, partial)
        discard_partial(partial)
    packed_before = checkpoint.samples_done  # what the interrupted run packed: not this run's work
    try:
        partial.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise write_error(exc, partial, folder=dst.parent, of=MAKING_PARTIAL, hint=_FULL_HINT) from exc
    workers = workers or min(32, 4 * usable_cpus())  # the CPUs this process may use, not the host's

    packer = _Packer(source, partial, opts, checkpoint, resumed)
    try:
        if not checkpoint.finishing:  # else every shard was closed before the interruption
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="packdata-read") as pool:
                try:
                    packer.run(pool, depth=2 * workers, progress=progress)
                except BaseException:
                    pool.shutdown(wait=True, cancel_futures=True)
                    raise
    except SourceError as exc:
        packer.close_files(failed=True)
        if not exc.resumable:
            shutil.rmtree(partial)  # a deliberate stop: nothing to resume
        raise
    except OSError as exc:
        packer.close_files(failed=True)
        _raise_if_full(exc, partial)
        raise
    except BaseException:
        packer.close_files(failed=True)
        raise
    packer.close_files()
    if checkpoint.samples_done == 0:
        shutil.rmtree(partial)
        raise _no_samples_error(source, checkpoint.skipped)
    try:
        manifest = packer.finish()
    except OSError as exc:  # its checkpoint or manifest on a full disk: the partial is kept, resumable
        _raise_if_full(exc, partial)
        raise
    _publish(partial, dst, overwrite=overwrite)
    return make_result(
        dst,
        opts,
        source,
        manifest,
        found=checkpoint.files_done,
        skipped=checkpoint.skipped,
        skip_examples=checkpoint.skip_examples,
        bytes_in=checkpoint.bytes_in,
        reencoded=checkpoint.reencoded,
        resumed=resumed,
        started=started,
        packed_before=packed_before,
    )


def _count_walk(source: AnySource, bar: Any, stop: threading.Event) -> None:
    """Count the source's entries in a second walk and give the bar its total (runs in a thread)."""
    count = 0
    try:
        for _ in getattr(source, "count_walk", source.walk)():
            count += 1
            if stop.is_set():
                return
    except Exception:
        return
    bar.total = count
    bar.refresh()


def _raise_if_full(exc: OSError, partial: Path) -> None:
    """Raise the named full disk for ``exc`` (met writing into ``partial``) if it is one; else return."""
    raise_if_full(exc, partial, of="of the partial pack", hint=_FULL_HINT)


class _Packer:
    """The single writer: consumes read results in walk order, rolls shards, checkpoints."""

    def __init__(self, source: AnySource, partial: Path, opts: _Options, cp: _Checkpoint, resumed: bool) -> None:
        self.source, self.partial, self.opts, self.cp = source, partial, opts, cp
        self.writer_cls = shard_writer(opts.format)
        self.index = SampleIndexWriter(
            partial,
            resume_at=cp.samples_done if resumed else None,
            fields=source.kind == "fields",
            kept=cp.index_files if resumed else None,
        )
        if resumed:
            try:
                cp.check_shard_bytes(self.index.dir / SIZES_FILE)
                final = self.writer_cls.final_shards(partial, list(cp.shards))
                # finishing, a TFRecord shard may be half renamed (apart from its index): its records are not counted
                check_shard_files(partial, opts.format, cp.shards, final, records=not cp.finishing, digests=True)
                if source.kind == "fields":
                    cp.check_field_names(self.index.dir / FIELD_SIZES_FILE)
            except PackFormatError:
                self.index.close()
                raise
        self.field_numbers = {name: i for i, name in enumerate(cp.field_names)}
        report = partial / SKIP_REPORT
        report.touch()
        if resumed:
            os.truncate(report, cp.skip_report_bytes)
        self.report = open(report, "ab")  # noqa: SIM115 (closed in close_files())
        self.writer: ShardWriter | None = None  # None once finishing: every shard is closed
        if not cp.finishing:
            self.writer = self._open_shard(cp.samples_done - cp.shard_first if resumed else None)
        self.batch: list[tuple[int, Sample]] = []
        self.batch_bytes = 0
        self.batch_samples = 0
        self.unwritten_bytes = 0
        self.packed_file: str | RemoteFile | None = None  # the last file (or listed object) packed: to probe
        self.shard_samples = cp.samples_done - cp.shard_first
        # a full shard closing in a thread, and the checkpoint to save once it is closed
        self._closing: tuple[Future[tuple[int, str]], dict[str, Any]] | None = None

    def _open_shard(self, resume_at: int | None = None) -> ShardWriter:
        path = self.partial / self.writer_cls.shard_name(len(self.cp.shards))
        return self.writer_cls(path, resume_at=resume_at)

    def run(self, pool: ThreadPoolExecutor, depth: int, progress: bool) -> None:
        entries = self._entries()
        bar = show_progress(desc="packing", unit=" files", disable=not progress, initial=self.cp.files_done)
        counted = threading.Event()
        if progress and getattr(self.source, "cheap_to_count", True):
            threading.Thread(target=_count_walk, args=(self.source, bar, counted), daemon=True).start()
        last_bytes, last_time = self.cp.bytes_in, time.perf_counter()
        try:
            with bar:
                for entry, result, reencoded in _pipeline(entries, pool, self.opts, depth):
                    if isinstance(result, Sample):
                        # A full shard is closed and checkpointed *before* this file is counted:
                        # a checkpoint never counts a file whose sample is not written with it.
                        self._make_room(len(result.data))
                    self.cp.walk.update(walk_record(entry))
                    self.cp.files_done += 1
                    if isinstance(result, Skip):
                        self._skip(result, is_read_error=result.problem)
                    else:
                        self.packed_file = probe_path(entry)
                        self._add(result, _source_bytes(entry, result, reencoded))
                        self.cp.reencoded += reencoded
                    bar.update()
                    now = time.perf_counter()
                    if now - last_time > 1.0:
                        bar.set_postfix_str(format_rate((self.cp.bytes_in - last_bytes) / (now - last_time)))
                        last_bytes, last_time = self.cp.bytes_in, now
                self._commit()
        finally:
            counted.set()  # stops the counting walk if it is still going

    def _entries(self) -> Iterator[Entry]:
        """The walk, with the part an interrupted run already packed verified and dropped."""
        walk = self.source.walk(spill_folder(self.partial, empty=True))
        copy = COPIED_FROM.get()  # the work folder and URL of a source folder copied from a URL
        if copy is not None and Path(os.fspath(self.source.root)) != copy[0]:
            copy = None
        if self.cp.files_done:
            check = hashlib.sha256()
            again = {}  # files of the copy downloaded again as other objects since the interrupted run packed
            if copy is not None and self.cp.copied_journal is not None:
                again = copied_again(copy[0], self.cp.copied_journal, self.cp.copied_journal_sha256)
            probed, walked = {probe[0] for probe in self.cp.probes}, set()
            for _, entry in zip(range(self.cp.files_done), walk, strict=False):
                check.update(walk_record(entry))
                packed = probe_path(entry)
                if packed is not None and (place := probe_place(packed)) in probed:
                    walked.add(place)
                if again:
                    refuse_copied_again(entry, again, *copy)  # type: ignore[misc]
            covered = getattr(self.source, "walk_covers_content", False)  # tars: the members' bytes are walked
            what = "a tar read" if covered else "a file packed"
            if check.hexdigest() != self.cp.walk_expected:
                self.cp.check_probes(walked, what, remote_lookup(self.source), walked_only=True)  # named first
                error = SourceError(
                    "the source folder changed since the interrupted conversion",
                    path=self.source.root,
                    hint="Restore it as it was and resume, or start again with overwrite=True",
                )
                error.resumable = True  # the partial is kept: a file moved for a while, a mount not up yet
                raise error
            self.cp.walk = check
            if not covered:  # else what was packed is as it was read, whatever its file's time says
                self.cp.check_probes(walked, what, remote_lookup(self.source))
        if copy is not None:  # every file this run packs was downloaded before this point of the journal
            self.cp.copied_journal, self.cp.copied_journal_sha256 = journal_mark(copy[0])
        return walk

    def _skip(self, skip: Skip, is_read_error: bool) -> None:
        """Record a skip; a problem (not a skip by rule) is an example, and stops the run with on_error="fail"."""
        line = skip_line(skip)
        if is_read_error and self.opts.on_error == "fail":
            raise bad_file_error(self.source.root, line)
        record_skip(self.report, self.cp.skipped, self.cp.skip_examples, line, read_error=is_read_error)

    def _make_room(self, size: int) -> None:
        """Close the current shard when a sample of ``size`` bytes would overfill it."""
        limit_bytes, limit_samples = self.opts.shard_size, self.opts.shard_samples
        if self.shard_samples and (
            (limit_samples and self.shard_samples >= limit_samples)
            or (limit_bytes and self.cp.shard_bytes + size > limit_bytes)
        ):
            self._roll_shard()

    def _add(self, sample: Sample, source_bytes: int | None = None) -> None:
        """Append a sample, counted with its file (call :meth:`_make_room` first).

        ``source_bytes``: its size in the source, when not the data's (a re-encoded image).
        """
        size = len(sample.data)
        self.batch.append((self.shard_samples, sample))
        fields = number_fields(sample, self.field_numbers, self.cp.field_names)
        self.index.append(sample.key, sample.label, size, fields)
        self.cp.samples_done += 1
        self.cp.bytes_in += size if source_bytes is None else source_bytes
        self.shard_samples += 1
        self.cp.shard_bytes += size
        self.batch_bytes += size
        self.batch_samples += 1
        self.unwritten_bytes += size
        if self.batch_bytes >= _COMMIT_BYTES or self.batch_samples >= _COMMIT_SAMPLES:
            self._commit()
        elif self.unwritten_bytes >= _WRITE_BYTES:  # handed on early, made durable by the commit
            assert self.writer is not None  # internal invariant: only called while packing
            self.writer.write(self.batch)
            self.batch, self.unwritten_bytes = [], 0

    def _write_batch(self) -> None:
        """Hand the batch to the shard, and the index and skip report to the disk (a checkpoint comes after)."""
        assert self.writer is not None  # internal invariant: only called while packing
        if self.batch:
            self.writer.write(self.batch)
        self.batch, self.batch_bytes, self.batch_samples, self.unwritten_bytes = [], 0, 0, 0
        self.index.flush()
        self.cp.index_files = self.index.checkpoint()
        self.report.flush()
        fsync_named(self.report.fileno(), self.report.name)
        self.cp.skip_report_bytes = self.report.tell()

    def _commit(self) -> None:
        """Write the batch, make everything durable, then record the checkpoint."""
        self._settle()
        self._write_batch()
        assert self.writer is not None
        self.writer.sync()
        self._probe()
        self.cp.save()

    def _probe(self) -> None:
        """Let the checkpoint about to be recorded probe the last file packed (see :meth:`_Checkpoint.probe`)."""
        if self.packed_file is not None:
            self.cp.probe(self.packed_file)
            self.packed_file = None

    def _roll_shard(self) -> None:
        """Write the full shard's last batch, hand the shard to a thread that closes it, and open the next.

        Closing (sync, checksum, side tables) runs while the next shard fills
        (sealing, its part that needs the GIL, runs here first);
        the checkpoint that lists the closed shard is saved when it is done
        (:meth:`_settle`, before any later checkpoint). Killed before that, a
        resume starts again from the previous checkpoint and writes the shard
        again: closing is repeatable.
        """
        self._settle()
        self._write_batch()
        assert self.writer is not None
        self.writer.seal()  # its Python work here: in the thread, it would hold the GIL against this one
        name = self.writer_cls.shard_name(len(self.cp.shards))
        self.cp.shards.append(ShardInfo(name, self.shard_samples, self.cp.shard_first, 0, ""))  # sized when closed
        self.cp.shard_first = self.cp.samples_done
        self.shard_samples = self.cp.shard_bytes = 0
        self._probe()
        closer = ThreadPoolExecutor(1, thread_name_prefix="packdata-shard-close")
        self._closing = (closer.submit(self.writer.close), self.cp.state())
        closer.shutdown(wait=False)  # its thread ends with the close
        self.writer = self._open_shard()

    def _settle(self) -> None:
        """Wait for the shard closing in its thread, list its size and checksum, and save its checkpoint.

        Raises:
            whatever closing it raised (a full disk: ``OSError``, ``CapacityError``).
        """
        if self._closing is None:
            return
        closing, state = self._closing
        self._closing = None
        nbytes, digest = closing.result()
        number = len(state["shards"]) - 1
        self.cp.shards[number] = dataclasses.replace(self.cp.shards[number], bytes=nbytes, sha256=digest)
        state["shards"][number] = asdict(self.cp.shards[number])
        self.cp.save(state)

    def close_files(self, failed: bool = False) -> None:
        """Close the skip report and the index files (safe to call twice).

        After a failure, errors closing them (a full disk) are ignored: the last
        checkpoint, not these buffers, is what a resume continues from.
        """
        if self._closing is not None and failed:
            with contextlib.suppress(BaseException):  # the failure being raised is the one to report
                self._closing[0].result()  # no thread writes into the partial pack once this returns
            self._closing = None
        if failed:  # the open shard goes with its writer, not with the traceback, which a caller may keep
            self.writer = None
        if self.report.closed:
            return
        try:
            self.report.close()
            self.index.close()
        except (OSError, PackdataError):  # PackdataError: a refused fsync, named (pack.files.fsync_named)
            if not failed:
                raise

    def finish(self) -> Manifest:
        """Close the last shard, give shards their final names, write the manifest.

        The closed shard list is checkpointed (``finishing``) before any shard is
        renamed, and the checkpoint is removed only after the manifest is
        written, so a run killed in between resumes by redoing these steps
        (:meth:`finalize` is repeatable).
        """
        if not self.cp.finishing:
            self._settle()
            assert self.writer is not None
            nbytes, digest = self.writer.close()
            name = self.writer_cls.shard_name(len(self.cp.shards))
            self.cp.shards.append(ShardInfo(name, self.shard_samples, self.cp.shard_first, nbytes, digest))
            self.cp.finishing = True
            self.cp.save()
        extend_classes(self.source, self.partial)
        final = self.writer_cls.final_shards(self.partial, list(self.cp.shards))
        check_shard_files(self.partial, self.opts.format, self.cp.shards, final)
        shards = self.writer_cls.finalize(self.partial, list(self.cp.shards))
        manifest = _make_manifest(
            self.source,
            self.opts,
            self.partial,
            shards,
            samples=self.cp.samples_done,
            files_found=self.cp.files_done,
            bytes_in=self.cp.bytes_in,
            reencoded=self.cp.reencoded,
            skipped=self.cp.skipped,
            field_names=self.cp.field_names,
        )
        write_manifest(self.partial, manifest)
        (self.partial / PROGRESS_FILE).unlink()
        fsync_dir(self.partial)
        return manifest
