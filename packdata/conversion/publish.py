"""How a pack gets to its destination: the manifest, the atomic rename, the skip log, and the result.

Where it may go (the destination checks) is :mod:`packdata.conversion.destination`.
"""

from __future__ import annotations

import json
import os
import reprlib
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from packdata.conversion.destination import _check_replaceable, spill_folder
from packdata.conversion.layouts import AnySource
from packdata.conversion.lists import ListSource
from packdata.conversion.load import _Options
from packdata.conversion.sources import Skip
from packdata.conversion.tars import TarSource
from packdata.errors import ConfigError, SourceError
from packdata.pack.fields import codec_of
from packdata.pack.files import aside_path, discard_stale, fsync_dir, stale_siblings
from packdata.pack.index import INDEX_DIR, LABELS_FILE, SampleIndex, index_digests
from packdata.pack.manifest import FIELDS_VERSION, SKIP_REPORT, Manifest, ShardInfo
from packdata.pack.urls import is_url

__all__ = [
    "MAX_SKIP_EXAMPLES",
    "SKIP_REPORT",
    "ConvertResult",
    "bad_file_error",
    "classes_changed_error",
    "extend_classes",
    "is_count",
    "is_skip_counts",
    "is_skip_lines",
    "make_result",
    "other_options_error",
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
        hint="Resume with the same options, or start again with overwrite=True",
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
        hint="Restore the source as it was, or start again with overwrite=True",
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
        hint="Resume with the source it read, or start again with overwrite=True",
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
        where, hint = source.root, "Check the folder and kind=KIND"
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
    spill_folder(partial, empty=True)  # the walk's key set's scratch, never published
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
