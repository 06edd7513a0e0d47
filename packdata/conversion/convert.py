"""Source folder -> parallel reads -> one writer per shard -> manifest, atomically.

The pack is written into a hidden sibling, ``.NAME.partial``, and renamed into
place only once its manifest is written, so a reader never sees a half pack.
Every commit is followed by a checkpoint (``progress.json``) that records how far
the sorted walk got; ``resume=True`` cuts the shard and index back to the last
checkpoint and carries on, giving the same content as an uninterrupted run.
A checkpoint counts a source file only together with its sample (or its skip
line), so a kill at any instant loses nothing. One process at a time converts
into a destination: it holds ``.NAME.lock`` beside it (:mod:`packdata.pack.lock`)
from before the partial folder is touched until after the publish rename."""

from __future__ import annotations

import inspect
import os
import shutil
import time
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from packdata.conversion.append import append_pack, interrupted_append, next_generation
from packdata.conversion.destination import (
    _check_destination_writable,
    _check_existing,
    _check_paths,
    check_inputs_apart,
    check_real_destination,
    partial_path,
)
from packdata.conversion.load import _Options, shard_limits
from packdata.conversion.local import _convert_local
from packdata.conversion.publish import ConvertResult, recover_replaced
from packdata.conversion.remote_convert import UPLOAD_TO, convert_from_url, convert_to_url
from packdata.conversion.remote_folder import RemoteFolder
from packdata.conversion.scan import is_pack, scan_any, streams_in_place, with_refused
from packdata.conversion.tars import TarSource
from packdata.errors import ConfigError, PackdataError, PackFormatError
from packdata.formats import FORMATS, format_from_path, get_format
from packdata.pack.files import atomic_write, discard_partial, read_regular, source_mode
from packdata.pack.lock import convert_lock_path, hold_lock
from packdata.pack.manifest import MANIFEST_NAME, Manifest, read_manifest
from packdata.pack.urls import display_url, is_url

__all__ = ["convert"]


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    format: str | None = None,
    kind: str = "auto",
    workers: int | None = None,
    on_error: str = "skip",
    verify_images: bool = False,
    max_side: int | None = None,
    quality: int = 90,
    shard_size: int | None = None,
    shard_samples: int | None = None,
    overwrite: bool = False,
    resume: bool = False,
    progress: bool = True,
    engine: str = "local",
    address: str | None = None,
    layout: str = "auto",
    require: tuple[str, ...] | list[str] = (),
    path_column: str = "path",
    label_column: str | None = None,
    append: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> ConvertResult:
    """Pack the files of ``src`` into a pack at ``dst``.

    Args:
        src: the source: a folder (ImageFolder class subfolders give labels; or
            grouped files, see ``layout``), a list file (``.csv``, ``.tsv``,
            ``.jsonl``), or WebDataset tar shards (``data-{000..099}.tar``,
            globs, ``.tar.gz``). Never modified. A URL (``s3://...``, with
            ``storage_options``): tar shards and list files are read in place
            through fsspec (no local copy; a list's relative paths name objects
            beside it); a folder is first copied into a local work folder
            (:func:`~packdata.conversion.download.download_source`), except on
            Ray, whose tasks read class folders in place
            (:mod:`packdata.conversion.remote_folder`).
        dst: the pack to create (``out.lmdb``; a folder for TFRecord), or a URL
            (``s3://bucket/out.lmdb``): packed locally, then uploaded, the
            manifest last (:mod:`packdata.conversion.upload`); on Ray each
            task uploads its own shard (:mod:`packdata.conversion.ray_remote`).
        format: a name from :data:`packdata.formats.FORMATS`; by default from ``dst``'s suffix, else the first.
        kind: ``"image"``, ``"text"`` or ``"auto"``.
        workers: parallel reader threads (default: 4 per CPU this process may use, at most 32).
        on_error: ``"skip"`` corrupt, empty or unreadable files (listed in the
            summary and in ``skipped.jsonl``), or ``"fail"`` at the first.
        verify_images: fully decode every image (catches truncated files).
        max_side: re-encode images whose longer side is larger to this size, as JPEG
            (one of more than 8 bits a channel or of several frames is kept as it is, with a warning).
        quality: JPEG quality of re-encoded images.
        shard_size: start a new shard before one would exceed this many bytes.
        shard_samples: at most this many samples per shard.
        overwrite: replace an existing pack at ``dst``.
        resume: continue an interrupted conversion into ``dst``.
        progress: show a progress bar on stderr.
        engine: ``"local"`` (threads in this process) or ``"ray"`` (one Ray task
            per shard, see :mod:`packdata.conversion.ray`; needs ``packdata[ray]``).
        address: with ``engine="ray"``, the Ray cluster to connect to (``"auto"``,
            ``"ray://host:10001"``, ...); by default a local Ray instance starts.
        layout: for a folder: ``"classes"`` (one file per sample), ``"grouped"``
            (files sharing a stem form one multi-field sample: ``0001.jpg`` +
            ``0001.json``), or ``"auto"`` (grouped when some stem has several files).
        require: with grouped files or a list, field names every sample must
            have; a group lacking one is skipped and reported.
        path_column: a list file's column of file paths (relative to the list's folder, or absolute).
        label_column: a list file's column of labels (class names, or integers), if any.
        storage_options: for a URL source or destination: passed to fsspec (credentials, endpoint).
        append: add the samples as new shards of the existing pack at ``dst``
            (same format and kind): existing shards untouched, classes united
            by name, the manifest replaced atomically last
            (:mod:`packdata.conversion.combine`); keys already in the pack fail.

    Returns:
        A :class:`ConvertResult`.

    Raises:
        SourceError: ``src`` is missing, has no usable files, or (with
            ``on_error="fail"``) holds a bad file.
        ConfigError: ``dst`` exists, is inside ``src``, is a link, is not a
            folder, its parent is missing or not writable, or options contradict.
        CapacityError: the destination disk is full (at the start, or later:
            then free space and resume).
        LockedError: another process is converting into ``dst`` (it is named).
    """
    started = time.perf_counter()
    if is_url(src) and is_url(dst) and not streams_in_place(os.fspath(src)):
        _check_urls_apart(os.fspath(src), os.fspath(dst))
    # tar shards or a list at a URL, or on Ray a folder at a URL: read in place
    streamed = is_url(src) and (streams_in_place(os.fspath(src)) or engine == "ray")
    if is_url(src) and not streamed:
        return convert_from_url(os.fspath(src), dst, locals())
    if is_url(dst):
        return convert_to_url(src, os.fspath(dst), locals())
    src = os.fspath(src) if streamed else Path(src)
    dst = Path(dst)
    if isinstance(src, Path):
        source_mode(src)  # one line for a source behind a folder this user may not search; missing: the scan says
    if engine == "ray":  # its tasks run in another working directory, maybe on another machine
        src, dst = src if streamed else Path(src).absolute(), dst.absolute()
    if append:
        return _append(src, dst, locals())
    if engine == "ray":
        from packdata.conversion.ray import require_ray

        require_ray()
    elif engine != "local":
        raise ConfigError(f"engine should be 'local' or 'ray', but got engine={engine!r}")
    elif address is not None:
        raise ConfigError("address is only used by engine='ray'", hint="Pass engine='ray' or drop address")
    fmt = format or format_from_path(os.fspath(dst)) or FORMATS[0]
    pack_format = get_format(fmt)
    if on_error not in ("skip", "fail"):
        raise ConfigError(f"on_error should be 'skip' or 'fail', but got on_error={on_error!r}")
    if max_side is not None and max_side < 1:
        raise ConfigError(f"max_side should be a positive number of pixels, but got max_side={max_side}")
    shard_size, shard_samples = shard_limits(shard_size, shard_samples, pack_format.default_shard_bytes)
    source = with_refused(scan_any(src, kind, layout, tuple(require), path_column, label_column, storage_options), src)
    into, into_kind = _APPEND_INTO.get()
    if into_kind is not None and source.kind != into_kind:  # before any file is read, not after all were packed
        raise _kind_mismatch(source.kind, into_kind, into)
    if engine == "ray" and (isinstance(source, TarSource) or (streamed and not isinstance(source, RemoteFolder))):
        raise ConfigError(
            "the Ray engine packs local folders and list files, and class folders at a URL (tar shards are "
            "read as one stream; a list at a URL is read by the local engine)",
            hint="Pass engine='local'",
        )
    if source.kind == "fields" and max_side is not None:
        raise ConfigError(
            "max_side re-encodes single-image samples only (a multi-field sample may hold masks)",
            hint="Drop max_side, or resize the images before converting",
        )
    _check_destination_writable(dst)
    if resume and not overwrite and (dst / MANIFEST_NAME).is_file() and not partial_path(dst).exists():
        raise ConfigError(
            "is already complete: there is no interrupted conversion to resume",
            path=dst,
            hint="Use the pack as it is, or pass overwrite=True to convert it again",
        )
    _check_source_and_destination(src, dst, overwrite)
    opts = _Options(
        fmt, source.kind, on_error, verify_images, max_side, quality, shard_size, shard_samples, ",".join(require)
    )
    dst.parent.mkdir(parents=True, exist_ok=True)
    with hold_lock(convert_lock_path(dst), what=f"packdata convert, {engine} engine", target=dst):
        recover_replaced(dst)  # a pack a killed overwrite=True moved aside goes back (or its leftover goes)
        _check_source_and_destination(src, dst, overwrite)  # again, under the lock: another may have published
        if engine == "ray":
            from packdata.conversion.ray import convert_on_ray

            upload_to, target = UPLOAD_TO.get()
            return convert_on_ray(
                source,
                dst,
                opts,
                workers=workers,
                overwrite=overwrite,
                resume=resume,
                progress=progress,
                address=address,
                started=started,
                target=target if upload_to == dst else None,
            )
        return _convert_local(
            source, dst, opts, workers=workers, overwrite=overwrite, resume=resume, progress=progress, started=started
        )


def _check_urls_apart(src: str, dst: str) -> None:
    """Refuse a destination URL inside the source folder's URL, or around it: a later run would pack the pack.

    Raises:
        ConfigError: one is the other, or under it.
    """
    source, pack = display_url(src).rstrip("/"), display_url(dst).rstrip("/")
    if pack == source or pack.startswith(source + "/"):
        raise ConfigError(
            f"{pack}: destination is inside the source folder {source}",
            hint="Write the pack outside the folder being packed",
        )
    if source.startswith(pack + "/"):
        raise ConfigError(
            f"{pack}: the source folder {source} is inside the destination",
            hint="Choose a destination that does not contain the source",
        )


def _check_source_and_destination(src: Path | str, dst: Path, overwrite: bool) -> None:
    """Refuse a destination inside a local source (or around it) or inside a pack, or an existing pack unless
    ``overwrite``."""
    around = next((folder for folder in Path(os.path.abspath(dst)).parents if is_pack(folder)), None)
    if around is not None:  # its shards would sit in a pack's folder, which overwrite=True of that pack then refuses
        raise ConfigError(f"the pack would be inside the pack {around}", path=dst, hint="Choose an output outside it")
    if isinstance(src, str):  # a URL: nothing of it is on this disk
        _check_existing(dst, overwrite)
    else:
        _check_paths(src, dst, overwrite)


def _append(src: Path | str, dst: Path, options: dict[str, Any]) -> ConvertResult:
    """Convert ``src`` into a hidden sibling pack, then move its shards into ``dst`` (under ``dst``'s lock).

    With ``resume``, an append stopped after its plan was written is finished
    without converting again; one stopped before goes on from the sibling pack
    (converted, or resumed where its conversion stopped).
    """
    if options["overwrite"]:
        raise ConfigError("append adds to a pack, overwrite replaces it: pass one of them")
    check_real_destination(dst)  # its lock and its sibling pack would not lie beside the pack
    manifest = read_manifest(dst)
    if options["format"] not in (None, manifest.format):
        raise ConfigError(f"the pack is {manifest.format}; its appended shards must be too", path=dst)
    kwargs = {k: v for k, v in options.items() if k in _CONVERT_OPTIONS}
    kwargs.update(format=manifest.format, append=False)
    extra = dst.parent / f".{dst.name}.append"
    if os.stat(dst).st_dev != os.stat(extra.parent).st_dev:  # its shards could not be renamed in from extra
        raise ConfigError(
            "is a mount point: an append converts beside the pack and renames the new shards in",
            path=dst,
            hint="Convert the source into a pack of its own, then `packdata merge` the two",
        )
    next_generation(dst, manifest)  # before converting: the new files' names must fit
    if isinstance(src, Path):  # before extra and its partial folder are discarded, or dst grows
        check_inputs_apart([src], dst)
        check_inputs_apart([src], extra)
    resume, started = bool(options["resume"]), float(options["started"])
    with hold_lock(convert_lock_path(dst), what="packdata convert --append", target=dst):
        with hold_lock(convert_lock_path(extra), what="packdata convert --append", target=extra):
            pass  # the lock a conversion into extra killed before its end left: taken over and removed
        planned = interrupted_append(dst) if resume else None
        record, place = extra.with_name(f"{extra.name}.source"), _source_place(src)
        try:
            if planned is not None or (resume and extra.exists()):  # converted: src is not read again
                _check_append_source(record, place, dst)
            if planned is not None:  # its shards are moving into dst: finish that
                result = _summary(planned, extra, started)
            else:
                for leftover in () if resume else (extra, partial_path(extra)):
                    discard_partial(leftover)  # what a run killed before it moved shards converted: again
                if not resume:
                    atomic_write(record, place.encode("utf-8"))  # a resume once extra is converted checks it
                if resume and not extra.exists() and not partial_path(extra).exists():
                    raise ConfigError(
                        "there is no interrupted append to resume",
                        path=dst,
                        hint="The last append into it finished (or none began): append without resume",
                    )
                # Converted before an interruption: apply it now; else convert (resuming a partial one).
                token = _APPEND_INTO.set((dst, manifest.kind))
                try:
                    result = _result_of(extra, started) if extra.exists() else convert(src, extra, **kwargs)
                except PackdataError as exc:  # a resume refused: overwrite=True, its advice, is refused here
                    if resume and exc.hint and "overwrite=True" in exc.hint:
                        raise exc.with_hint(_APPEND_AGAIN) from exc
                    raise
                finally:
                    _APPEND_INTO.reset(token)
                if result.kind != manifest.kind:
                    shutil.rmtree(extra)
                    raise _kind_mismatch(result.kind, manifest.kind, dst)
            merged = append_pack(dst, extra, resume=resume)
        finally:
            if not _left_to_resume(dst, extra):  # finished, refused or undone: the record goes with it
                record.unlink(missing_ok=True)
    result.pack = dst
    result.shards = merged.shards
    result.missing_fields = merged.missing_fields  # of the whole pack: the new samples may lack an old field
    if merged.appended is not None:
        result.packed = merged.appended.num_samples
    return result


_APPEND_AGAIN = "Append again without resume=True: the interrupted append starts over, the pack keeps its samples"


def _source_place(src: Path | str) -> str:
    """Where an append's source is: its real path, or its URL as messages show it."""
    return display_url(src) if isinstance(src, str) and is_url(src) else os.path.realpath(src)


def _left_to_resume(dst: Path, extra: Path) -> bool:
    """Whether an append into ``dst`` is left to resume: its source converted (or converting) beside it, or its plan."""
    if os.path.lexists(extra) or os.path.lexists(partial_path(extra)):
        return True
    try:
        return interrupted_append(dst) is not None
    except PackdataError:  # a damaged pack or plan: what resuming it says
        return True


def _check_append_source(record: Path, place: str, dst: Path) -> None:
    """Refuse to resume an append whose source was converted from another ``place`` (``record`` says which).

    Raises:
        ConfigError: naming both; nothing recorded (an earlier packdata's append) passes.
        PackFormatError: the record is not a small regular file.
    """
    try:
        saved = read_regular(record, 1 << 16, follow_symlinks=False).decode("utf-8", "replace")
    except FileNotFoundError:
        return
    except OSError as exc:
        raise PackFormatError(
            f"the record of the interrupted append's source is unreadable ({exc.strerror})",
            path=record,
            hint="Remove it, then resume",
        ) from exc
    if saved != place:
        raise ConfigError(
            f"the interrupted append read another source ({saved[:4096]}; this run reads {place})",
            path=dst,
            hint="Resume with the source it read, or append again without resume",
        )


_CONVERT_OPTIONS = tuple(inspect.signature(convert).parameters)[2:]

_APPEND_INTO: ContextVar[tuple[Path, str | None]] = ContextVar("packdata_append_into", default=(Path(), None))
"""The pack an append converts for, and its kind: set by :func:`_append` around its conversion,
so a source of another kind is refused once scanned, before any file is read."""


def _kind_mismatch(source_kind: str, pack_kind: str, pack: Path) -> ConfigError:
    return ConfigError(
        f"the source holds {source_kind} samples, the pack {pack_kind}",
        path=pack,
        hint="Append a source of the pack's kind, or convert this one into a pack of its own",
    )


def _result_of(pack: Path, started: float) -> ConvertResult:
    """What a finished conversion did, from its manifest (an append resumed after the conversion ended)."""
    return _summary(read_manifest(pack), pack, started)


def _summary(manifest: Manifest, pack: Path, started: float) -> ConvertResult:
    """What the conversion that wrote ``manifest`` (a pack at ``pack``) did."""
    return ConvertResult(
        pack=pack,
        format=manifest.format,
        kind=manifest.kind,
        found=int(manifest.source.get("files_found", manifest.num_samples)),
        packed=manifest.num_samples,
        skipped=dict(manifest.skipped.get("by_reason", {})),
        bytes_in=int(manifest.source.get("bytes", 0)),
        bytes_out=manifest.total_bytes,
        seconds=time.perf_counter() - started,
        shards=len(manifest.shards),
        resumed=True,
        packed_before=manifest.num_samples,  # all packed before the interruption
        missing_fields=manifest.missing_fields(),
    )
