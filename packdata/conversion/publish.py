"""Where a pack goes and how it gets there.

Destination checks, what may be replaced, the manifest, the atomic rename, and the result.
"""

from __future__ import annotations

import json
import os
import reprlib
import shutil
import stat
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from packdata.conversion.layouts import AnySource, ListSource
from packdata.conversion.load import _Options
from packdata.conversion.sources import Skip
from packdata.conversion.tars import TarSource
from packdata.errors import (
    CapacityError,
    ConfigError,
    PackFormatError,
    SourceError,
)
from packdata.formats import get_format
from packdata.pack.fields import codec_of
from packdata.pack.files import (
    aside_path,
    discard_stale,
    file_kind,
    fsync_dir,
    holds_conversion,
    is_inside,
    stale_siblings,
)
from packdata.pack.index import ALL_FILES, INDEX_DIR, LABELS_FILE, SampleIndex, index_digests, index_files
from packdata.pack.lock import convert_lock_path
from packdata.pack.manifest import FIELDS_VERSION, MANIFEST_NAME, SKIP_REPORT, Manifest, ShardInfo, read_manifest
from packdata.pack.urls import is_url

__all__ = [
    "MAX_SKIP_EXAMPLES",
    "SKIP_REPORT",
    "ConvertResult",
    "bad_file_error",
    "check_inputs_apart",
    "check_real_destination",
    "check_resumable",
    "classes_changed_error",
    "extend_classes",
    "interrupted_error",
    "is_count",
    "is_skip_counts",
    "is_skip_lines",
    "make_result",
    "other_options_error",
    "partial_path",
    "record_skip",
    "recover_replaced",
    "skip_line",
    "source_changed_error",
    "source_identity",
]


MAX_SKIP_EXAMPLES = 20
"""Read errors kept as examples in the result (all of them are in the skip report)."""


@dataclass
class ConvertResult:
    """What a conversion did: counts, bytes and time, and every skip by reason."""

    pack: Path | str  # a URL for a pack converted into object storage
    format: str
    kind: str
    found: int
    packed: int
    skipped: dict[str, int]
    bytes_in: int
    bytes_out: int
    seconds: float
    shards: int
    resumed: bool = False
    reencoded: int = 0
    skip_examples: list[dict[str, str]] = field(default_factory=list)
    packed_before: int = 0  # of packed: samples an interrupted run had packed, which this resumed run kept
    missing_fields: dict[str, int] = field(default_factory=dict)  # field -> the pack's samples lacking it

    @property
    def rate(self) -> float:
        """Samples this run packed per second: those packed before a resume are not its work."""
        return (self.packed - self.packed_before) / max(self.seconds, 1e-9)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        out = asdict(self)
        out["pack"] = str(self.pack)
        return out


def partial_path(dst: str | os.PathLike) -> Path:
    """The hidden sibling a conversion into ``dst`` writes before renaming."""
    dst = Path(dst)
    return dst.parent / f".{dst.name}.partial"


def check_inputs_apart(inputs: Sequence[Path], dst: Path) -> None:
    """Refuse an input that is, holds or lies inside ``dst``, its partial folder or its lock file.

    A run into ``dst`` deletes or replaces those before it has read its inputs: such an input would be lost.

    Raises:
        ConfigError: naming the input and what it overlaps.
    """
    targets = {dst: "the destination", partial_path(dst): "its work folder", convert_lock_path(dst): "its lock file"}
    for source in inputs:
        for target, what in targets.items():
            if os.path.realpath(source) == os.path.realpath(target):
                relation = "is"
            elif is_inside(source, target):
                relation = "lies inside"
            elif is_inside(target, source):
                relation = "holds"
            else:
                continue
            raise ConfigError(
                f"the input {source} {relation} {what} {target}, which this run deletes or replaces",
                path=dst,
                hint="Choose a destination apart from the inputs",
            )


def interrupted_error(dst: str | os.PathLike, partial: Path) -> ConfigError:
    """The refusal to start over an interrupted run into ``dst`` (in ``partial``) unasked.

    A conversion's checkpoint (or Ray plan) names it one; other work is left by a killed
    merge (or a conversion before its first checkpoint), which nothing can continue.
    """
    if holds_conversion(partial):
        return ConfigError(
            f"an interrupted conversion into {dst} is in {partial}",
            path=dst,
            hint="Pass --resume to continue it, or --overwrite to start again",
        )
    return ConfigError(
        f"an interrupted merge or conversion into {dst} left {partial}, with no checkpoint to continue from",
        path=dst,
        hint="Pass --overwrite to start again",
    )


def check_resumable(partial: Path) -> None:
    """Refuse to resume into anything but a folder of folders and regular files, as packdata writes them.

    A resume truncates and appends to the files it finds: a symlink, FIFO or
    device planted in the partial pack would send those writes elsewhere.

    Raises:
        ConfigError: ``partial``, or something inside it, is of another type (named).
    """
    hint = "Move it away, or start again with --overwrite"
    mode = os.lstat(partial).st_mode
    if not stat.S_ISDIR(mode):
        raise ConfigError(f"{partial} is {file_kind(mode)}, not an interrupted conversion", path=partial, hint=hint)
    for root, folders, files in os.walk(partial):
        for name in (*folders, *files):
            mode = os.lstat(os.path.join(root, name)).st_mode
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                where = os.path.join(root, name)
                raise ConfigError(
                    f"the interrupted conversion holds {where}, {file_kind(mode)}: packdata never writes one",
                    path=partial,
                    hint=hint,
                )


def _check_paths(src: Path, dst: Path, overwrite: bool) -> None:
    real_src, real_dst = os.path.realpath(src), os.path.realpath(dst)
    if real_dst == real_src or real_dst.startswith(real_src.rstrip(os.sep) + os.sep):
        raise ConfigError(
            "destination is inside the source folder", path=dst, hint="Write the pack outside the folder being packed"
        )
    if real_src.startswith(real_dst.rstrip(os.sep) + os.sep):
        raise ConfigError(
            "the source folder is inside the destination",
            path=dst,
            hint="Choose a destination that does not contain the source",
        )
    check_inputs_apart([src], dst)
    _check_existing(dst, overwrite)


def _check_existing(dst: Path, overwrite: bool) -> None:
    """Refuse an existing ``dst`` unless ``overwrite`` (and then only a complete packdata pack)."""
    if dst.exists() or dst.is_symlink():
        if not overwrite:
            raise ConfigError(
                "destination already exists", path=dst, hint="Pass --overwrite to replace it, or choose another path"
            )
        _check_replaceable(dst)


def _foreign_entry(manifest: Manifest, dst: Path) -> str | None:
    """The first entry of ``dst`` that is not one of the pack's own files, or of the wrong type; None if none.

    A pack holds its manifest, the skip report, the sample index folder (its
    files only), and each shard's files as its format lays them out (a folder
    with its files, or a file with side files beside it). No symlink anywhere.
    """
    layout_of = get_format(manifest.format).shard_layout
    files = {MANIFEST_NAME, f".{MANIFEST_NAME}.tmp", SKIP_REPORT}
    folders: dict[str, set[str]] = {manifest.index_dir: set(ALL_FILES)}
    if manifest.index.get("previous"):  # the index an append replaced, kept for readers opened before it
        folders[manifest.index["previous"]] = set(ALL_FILES)
    for shard in manifest.shards:
        layout = layout_of(shard.file)
        if layout.folder:
            folders[shard.file] = {layout.data, *layout.side, *layout.scratch}
        else:
            files.update((layout.data, *layout.side))
    for entry in sorted(os.scandir(dst), key=lambda e: e.name):
        if entry.name in files and entry.is_file(follow_symlinks=False):
            continue
        if entry.name not in folders or not entry.is_dir(follow_symlinks=False):
            return entry.name
        for inner in sorted(os.scandir(entry.path), key=lambda e: e.name):
            if inner.name not in folders[entry.name] or not inner.is_file(follow_symlinks=False):
                return f"{entry.name}/{inner.name}"
    return None


def _check_replaceable(dst: Path) -> None:
    """``dst`` is provably a complete packdata pack that ``overwrite`` may replace, and nothing else.

    Its manifest must pass :func:`~packdata.pack.manifest.read_manifest` (schema,
    version, paths inside the pack), it must not be a staged pack, every shard
    and the sample index must be there, and it may hold nothing but the pack's
    own files: anything else (a web app's folder with a ``manifest.json``) is
    refused, never deleted.

    Raises:
        ConfigError: naming what makes ``dst`` not a pack packdata may replace.
    """
    hint = "Remove it yourself or choose another path"
    if dst.is_symlink() or not dst.is_dir():
        raise ConfigError(
            "destination exists and is not a packdata pack (not a folder); refusing to replace it", path=dst, hint=hint
        )
    if os.path.ismount(dst):  # replacing renames the old pack aside: a mount point cannot be renamed
        raise ConfigError(
            "destination is a mount point; a pack there cannot be replaced",
            path=dst,
            hint="Write the new pack to a folder inside the mount (a pack is published by renaming it into place)",
        )
    try:
        manifest = read_manifest(dst)
    except PackFormatError as exc:
        reason = str(exc)[: -len(exc.hint) - 2] if exc.hint else str(exc)
        raise ConfigError(
            f"destination exists and is not a packdata pack; refusing to replace it ({reason})", hint=hint
        ) from exc
    if manifest.staged_from is not None:
        raise ConfigError(
            "destination is a staged pack; refusing to replace it", path=dst, hint=f"Run `packdata unstage {dst}` first"
        )
    needed = [(dst / s.file, f"shard {s.file}") for s in manifest.shards]
    needed += [(dst / manifest.index_dir / name, f"sample index file {name}") for name in index_files(manifest.kind)]
    for path, what in needed:
        if not os.path.lexists(path):
            raise ConfigError(
                f"destination is not a complete packdata pack ({what} is missing); refusing to replace it",
                path=dst,
                hint=hint,
            )
    foreign = _foreign_entry(manifest, dst)
    if foreign is not None and foreign.startswith(".append-a"):  # conversion.append's plan or staging folder
        raise ConfigError(
            f"destination holds {foreign!r}: an append into it was interrupted; refusing to replace it",
            path=dst,
            hint="Finish the append first (append=True with resume=True), then overwrite",
        )
    if foreign is not None:
        raise ConfigError(
            f"destination holds {foreign!r}, which is not part of a packdata pack; refusing to replace it",
            path=dst,
            hint=hint,
        )


_MIN_FREE_BYTES = 1 << 20


_NAME_ROOM = 40
"""Bytes packdata adds to a destination's name (``.NAME.append.partial``, ``STEM-000000-of-000000.tfpayload``)."""


def check_real_destination(dst: Path) -> None:
    """Refuse a destination that is a symbolic link or ends in ``..``: its lock (``.NAME.lock``) and partial pack
    are made beside the last name given, so a pack written through such a path and through its real path at once
    would hold two locks.

    Raises:
        ConfigError: naming ``dst`` and what it is.
    """
    if dst.name == "..":
        raise ConfigError(
            "destination ends in '..'; packdata writes a pack only at a path that names it",
            path=dst,
            hint=f"Pass {os.path.normpath(dst)} itself",
        )
    if dst.is_symlink():
        raise ConfigError(
            f"destination is a symbolic link (to {os.readlink(dst)!r}); packdata writes a pack only at a real path",
            path=dst,
            hint="Pass the path the link points to, or another path",
        )


def _check_destination_writable(dst: Path) -> None:
    """Refuse, with one line, a destination packdata cannot write a pack at.

    ``dst`` must not be a symbolic link (to a folder or to nothing) nor an
    existing non-folder (a file, a device); its nearest existing ancestor (the
    parent, or where missing parents will be created) must be a writable folder
    with at least 1 MiB free. Nothing is created here; what
    only an attempt reveals (``/proc``, races) is caught where the pack's
    folder and first shard are created.

    Raises:
        ConfigError: ``dst`` or its parent cannot be used.
        CapacityError: the parent's file system is full.
    """
    check_real_destination(dst)
    if dst.exists() and not dst.is_dir():
        raise ConfigError(
            "destination exists and is not a folder", path=dst, hint="Choose another path; packdata will not replace it"
        )
    parent = dst.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent  # missing parents are created with the pack
    if not parent.is_dir():
        raise ConfigError("the destination's parent is not a folder", path=parent, hint="Choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(
            "the destination's parent folder is not writable (read-only file system or permissions)",
            path=parent,
            hint="Choose a writable destination",
        )
    st = os.statvfs(parent)
    longest = st.f_namemax or 255
    if len(os.fsencode(dst.name)) + _NAME_ROOM > longest:
        raise ConfigError(
            f"the destination's name is {len(os.fsencode(dst.name))} bytes: the names packdata makes from it "
            f"(shards, the partial pack) need it at most {longest - _NAME_ROOM}",
            path=dst,
            hint="Choose a shorter name",
        )
    if st.f_blocks == 0:
        raise ConfigError(
            "the destination's parent folder is on a file system without storage (such as /proc or /sys)",
            path=parent,
            hint="Choose a destination on a disk or tmpfs",
        )
    free = st.f_bavail * st.f_frsize
    if free < _MIN_FREE_BYTES:
        raise CapacityError(
            f"the destination disk is full: {free} bytes free, at least {_MIN_FREE_BYTES} needed to start",
            path=parent,
            hint="Free space or choose another destination",
        )


def other_options_error(saved: Any, now: dict[str, Any], path: str | os.PathLike) -> ConfigError:
    """The refusal of a resume whose options are not the interrupted run's: each that differs, with both values."""
    if isinstance(saved, dict):
        keys = sorted(saved.keys() | now.keys())
        what = ", ".join(f"{k}={saved.get(k)!r} (this run: {now.get(k)!r})" for k in keys if saved.get(k) != now.get(k))
    else:
        what = reprlib.repr(saved)
    return ConfigError(
        f"the interrupted conversion used other options: {what}",
        path=path,
        hint="Resume with the same options, or start again with --overwrite",
    )


def classes_changed_error(saved: list[str] | None, now: list[str], source: Path | str) -> SourceError | None:
    """The refusal of a resume whose source numbers its classes otherwise than the interrupted run's (``saved``).

    The samples packed before the interruption carry the old numbers: a class
    added, removed or renamed since (a list's new label, a new folder) would
    give the rest of the pack other meanings for the same labels. None when
    they agree, or nothing was saved (an earlier packdata's run).
    """
    if saved is None or saved == now:
        return None
    change = next(
        (f"class {i} was {a!r}, is now {b!r}" for i, (a, b) in enumerate(zip(saved, now, strict=False)) if a != b),
        f"it had {len(saved)} classes, has {len(now)}",
    )
    return SourceError(
        f"the source's classes changed since the interrupted conversion ({change}): "
        "the samples packed before it carry the old class numbers",
        path=source,
        hint="Restore the source as it was, or start again with --overwrite",
    )


def source_identity(source: AnySource) -> list[str]:
    """What a checkpoint records of the source it reads: its real path (a list's file, each tar shard) or URL."""
    if isinstance(source, TarSource):
        places = [os.fspath(shard) for shard in source.shards]
    elif isinstance(source, ListSource):
        places = [os.fspath(source.list_file)]
    else:
        return [os.fspath(source.root) if is_url(os.fspath(source.root)) else os.path.realpath(source.root)]
    if getattr(source, "fs", None) is not None:  # paths on the store: shown under the source's URL
        return [f"{source.root}/{os.path.basename(place)}" for place in places]
    return [os.path.realpath(place) for place in places]


def source_changed_error(saved: object, now: list[str], partial: Path) -> ConfigError | None:
    """The refusal of a resume that reads another source than the interrupted run (``saved``: what it recorded).

    Samples of the same names and classes from another folder (a new version, another resolution) would
    follow the ones packed before. None when they agree, or nothing was saved (an earlier packdata's run).
    """
    if saved is None or saved == now:
        return None

    def shown(places: object) -> str:
        if not isinstance(places, list) or not places:
            return reprlib.repr(places)
        return str(places[0]) + (f" and {len(places) - 1} more" if len(places) > 1 else "")

    return ConfigError(
        f"the interrupted conversion read another source ({shown(saved)}; this run reads {shown(now)})",
        path=partial,
        hint="Resume with the source it read, or start again with --overwrite",
    )


def _no_samples_error(source: AnySource, skipped: Counter[str]) -> SourceError:
    """The error of a conversion that packed nothing."""
    reasons = ", ".join(f"{n} {r}" for r, n in skipped.items()) or "none"
    if isinstance(source, ListSource):
        where, hint = source.list_file, "Check the paths and labels the list gives"
    elif isinstance(source, TarSource):
        where = (
            source.shards[0] if len(source.shards) == 1 else f"{source.shards[0]} (and {len(source.shards) - 1} more)"
        )
        hint = "Check the tar shards: each sample is files sharing a key, as WebDataset writes them"
    else:
        where, hint = source.root, "Check the folder and --kind"
    if "missing field" in skipped:
        hint = "Check require=FIELDS: it names the fields every sample must have"
    what = f"{source.kind} files" if source.kind in ("image", "text") else "samples"
    return SourceError(f"no usable {what} (skipped: {reasons})", path=where, hint=hint)


def extend_classes(source: AnySource, partial: Path) -> None:
    """Name the classes a fields pack's labels reach past the class folders (``cls`` files, list labels, a writer)."""
    if source.kind != "fields":
        return
    labels = np.fromfile(partial / INDEX_DIR / LABELS_FILE, dtype="<i4")
    top = int(labels.max()) if len(labels) else -1
    known = list(source.classes)
    source.classes = known + [str(i) for i in range(len(known), top + 1)]


def _make_manifest(
    source: AnySource,
    opts: _Options,
    partial: Path,
    shards: list[ShardInfo],
    *,
    samples: int,
    files_found: int,
    bytes_in: int,
    reencoded: int,
    skipped: Counter[str],
    field_names: list[str] | None = None,
) -> Manifest:
    """The manifest of the finished pack ``partial`` (shards finalized, index closed); every engine writes this one."""
    index = {"dir": INDEX_DIR, "sha256": index_digests(partial / INDEX_DIR, source.kind)}
    if source.kind == "fields":
        names = list(field_names or [])
        return Manifest(
            format=opts.format,
            kind="fields",
            classes=source.classes,
            num_samples=samples,
            shards=shards,
            index=index,
            fields=names,
            codecs={name: source.codecs.get(name) or codec_of(name) for name in names},
            field_counts=SampleIndex(partial / INDEX_DIR, samples, names).field_counts(),
            skipped={"count": sum(skipped.values()), "by_reason": dict(skipped), "report": SKIP_REPORT},
            source={"files_found": files_found, "bytes": bytes_in},
            format_version=FIELDS_VERSION,
        )
    return Manifest(
        format=opts.format,
        kind=source.kind,
        classes=source.classes,
        num_samples=samples,
        shards=shards,
        index=index,
        fields=[opts.kind, "label", "key"],
        reencode={"max_side": opts.max_side, "quality": opts.quality, "count": reencoded} if opts.max_side else None,
        skipped={"count": sum(skipped.values()), "by_reason": dict(skipped), "report": SKIP_REPORT},
        source={"files_found": files_found, "bytes": bytes_in},
    )


def recover_replaced(dst: Path) -> None:
    """Undo or finish a replacement of ``dst`` that a killed run left; call it holding ``dst``'s lock.

    :func:`_publish` moves the old pack aside as ``.NAME.old-PID`` and deletes
    it once the new pack has the name. Killed between the two renames, ``dst``
    is gone and the old pack hidden: it is moved back when it is a complete
    pack (never a link). Any other such sibling is what a killed deletion left:
    removed (:func:`~packdata.pack.files.discard_stale`).
    """
    for old in [] if os.path.lexists(dst) else stale_siblings(dst, "old"):
        try:
            _check_replaceable(old)  # complete: every shard and index file, nothing else; a folder, not a link
        except ConfigError:
            continue
        os.rename(old, dst)
        fsync_dir(dst.parent)
        break
    discard_stale(dst, "old")


def _publish(partial: Path, dst: Path, *, overwrite: bool) -> None:
    """Rename the finished pack into place; with ``overwrite``, an old pack at ``dst`` is replaced.

    Something that appeared at ``dst`` while converting is refused without
    ``overwrite``. The old pack is checked again (:func:`_check_replaceable`: it
    may have changed while converting), moved aside to a hidden sibling, and deleted only
    once the new pack has its name; if the rename fails, it is moved back.
    """
    old = None
    if os.path.lexists(dst):
        if not overwrite:
            raise ConfigError(
                "destination appeared while converting",
                path=dst,
                hint=f"The new pack is left in {partial}: move what is at the destination away and convert again",
            )
        _check_replaceable(dst)
        old = aside_path(dst)
        os.rename(dst, old)
    try:
        os.rename(partial, dst)
    except BaseException:
        if old is not None and not os.path.lexists(dst):
            os.rename(old, dst)
        raise
    fsync_dir(dst.parent)
    if old is not None:
        shutil.rmtree(old)


def skip_line(skip: Skip) -> dict[str, str]:
    """A skip as one line of ``skipped.jsonl``."""
    return {"key": skip.key, "reason": skip.reason, "detail": skip.detail}


def record_skip(
    report: BinaryIO, counts: Counter[str], examples: list[dict[str, str]], line: dict[str, str], *, read_error: bool
) -> bytes:
    """Count a skip by reason, keep it as an example (the first few read errors), and append it to the report.

    Returns:
        The bytes appended to the report.
    """
    counts[line["reason"]] += 1
    if read_error and len(examples) < MAX_SKIP_EXAMPLES:
        examples.append(line)
    data = json.dumps(line, ensure_ascii=False).encode("utf-8") + b"\n"
    report.write(data)
    return data


def is_count(value: object) -> bool:
    """Whether ``value``, read from a file, is a count: an integer (never a boolean) >= 0."""
    return type(value) is int and value >= 0


def is_skip_counts(value: object) -> bool:
    """Whether ``value``, read from a file, is skip counts as :func:`record_skip` keeps them (reason -> count)."""
    return isinstance(value, dict) and all(is_count(n) for n in value.values())


def is_skip_lines(value: object) -> bool:
    """Whether ``value``, read from a file, is skip examples as :func:`record_skip` keeps them (:func:`skip_line`)."""
    return (
        isinstance(value, list)
        and len(value) <= MAX_SKIP_EXAMPLES
        and all(isinstance(e, dict) and set(e) == {"key", "reason", "detail"} for e in value)
        and all(isinstance(v, str) for e in value for v in e.values())
    )


def bad_file_error(root: Path | str, line: dict[str, str]) -> SourceError:
    """The error that stops a conversion at a bad file with ``on_error="fail"`` (``root``: a folder or a URL)."""
    detail = f": {line['detail']}" if line["detail"] else ""
    return SourceError(
        f"{line['reason']}{detail}",
        path=os.path.join(root, line["key"]),
        hint="Fix or remove the file, or pass on_error='skip'",
    )


def make_result(
    dst: Path,
    opts: _Options,
    source: AnySource,
    manifest: Manifest,
    *,
    found: int,
    skipped: Counter[str],
    skip_examples: list[dict[str, str]],
    bytes_in: int,
    reencoded: int,
    resumed: bool,
    started: float,
    packed_before: int = 0,
) -> ConvertResult:
    """What a published conversion did: the one :class:`ConvertResult` builder of both engines.

    ``packed_before``: the samples a resumed run found packed (kept, not its work); ``started``: when this run began.
    """
    return ConvertResult(
        pack=dst,
        format=opts.format,
        kind=source.kind,
        found=found,
        packed=manifest.num_samples,
        skipped=dict(skipped),
        bytes_in=bytes_in,
        bytes_out=manifest.total_bytes,
        seconds=time.perf_counter() - started,
        shards=len(manifest.shards),
        resumed=resumed,
        reencoded=reencoded,
        skip_examples=skip_examples,
        packed_before=packed_before,
        missing_fields=manifest.missing_fields(),
    )
