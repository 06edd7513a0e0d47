"""Append a pack's samples to another: its shards move in whole, a new sample index and manifest are written.

Classes, fields and keys are united as :mod:`packdata.conversion.combine`
merges them. An append never touches the existing shards. Its keys, past
:class:`~packdata.pack.keyset.KeySet`'s budget, spill into ``.append-aN.partial``
in the pack (N: the append's generation), removed once they are checked. It
prepares the new index and skip report in that folder, then
writes its plan, ``.append-aN.json`` (the manifest to publish, the files to move,
the index folder to delete). It then moves the index and the new shards' files
in, replaces the manifest atomically (the append takes effect), cleans up, and
deletes the plan last (the plan file: :mod:`packdata.conversion.append_plan`).
The index folder the old manifest named is kept (one generation), so a reader
opened before the append keeps reading the pack it opened.

A run killed at any instant leaves the pack as it was (the manifest names none
of the new files) or grown. The next append finishes one that took effect; with
``resume=True`` it carries out a written plan from where it stopped, each step
done once (a file to move is found at its source or its target, never lost);
otherwise it deletes what the interrupted one made and starts over.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from dataclasses import replace
from pathlib import Path

from packdata.conversion.append_plan import (
    STAGING,
    AppendPlan,
    generation_of,
    plan_fits,
    plan_path,
    plans_in,
    read_plan,
)
from packdata.conversion.combine import (
    MergeResult,
    _manifest,
    _needs_rewrite,
    _plan,
    _report_lines,
    _rewrite_shard,
    _shard_pairs,
    _write_index,
)
from packdata.conversion.destination import spill_folder
from packdata.conversion.publish import SKIP_REPORT
from packdata.errors import CapacityError, ConfigError, PackFormatError
from packdata.formats import get_format, shard_writer
from packdata.host.disks import raise_if_full
from packdata.pack.files import atomic_write, fsync_dir
from packdata.pack.index import ALL_FILES, INDEX_DIR
from packdata.pack.manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    read_manifest,
    resolve_in_pack,
    write_manifest,
)

__all__ = ["append_pack", "interrupted_append", "next_generation"]


def append_pack(dst: str | os.PathLike, new: str | os.PathLike, *, resume: bool = False) -> MergeResult:
    """Move the samples of pack ``new`` into pack ``dst`` as new shards (see the module docstring).

    ``new`` is consumed: its shards are moved, then it is deleted. Keys of
    ``new`` already in ``dst`` fail. Call under ``dst``'s conversion lock.

    Args:
        dst: the pack to grow.
        new: the pack whose samples are appended.
        resume: finish the append of ``new`` that an interruption stopped after
            its plan was written (see :func:`interrupted_append`); without one,
            append ``new`` as usual. Without ``resume``, what an interrupted
            append left is removed first (or finished, where it had taken effect).

    Raises:
        ConfigError: the packs differ in format or kind, or a key repeats.
        PackFormatError: a shard of ``new`` is missing, ``new`` is a link or a file, or
            ``index.previous`` of ``dst`` (the folder this append deletes) holds more than a sample index.
    """
    dst, new = Path(dst), Path(new)
    if new.is_symlink() or (os.path.lexists(new) and not new.is_dir()):  # its shards would move out of elsewhere
        raise PackFormatError(
            "the pack to append is a link or a file, not the folder packdata converted: nothing is moved out of it",
            path=new,
            hint="Remove it (a link: only the link itself), then append again without resume",
        )
    done = _recover(dst, new, resume=resume)
    if done is not None:
        return done
    generation = next_generation(dst, read_manifest(dst))
    staging = _staging_path(dst, generation)  # none yet: _recover removed what an interrupted append left
    try:  # the keys spill into the append's own folder, removed once planned, refused or failed
        inputs, classes, fields, codecs = _plan([dst, new], "append", spill_folder(staging))
    except ConfigError:
        shutil.rmtree(new)
        raise
    except CapacityError as exc:  # the keys spilled onto a full disk: the pack is as it was, new is kept
        raise exc.with_hint(_FULL_HINT) from exc
    finally:
        if os.path.lexists(staging):  # only once the keys spilled
            shutil.rmtree(staging)
    old, extra = inputs
    fmt = old.manifest.format
    index_dir = f"{INDEX_DIR}-a{generation}"
    drop = old.manifest.index.get("previous")
    if drop in (index_dir, old.manifest.index_dir):
        drop = None
    if drop is not None:
        _check_index_folder(dst, drop)  # before anything moves: what it holds is deleted once the append took effect
    count = len(extra.manifest.shards)
    shards = list(old.manifest.shards)
    base = old.manifest.num_samples
    moves: list[tuple[str, str]] = []
    for k, shard in enumerate(extra.manifest.shards):
        name = f"shard-a{generation}-{k:05d}-of-{count:05d}{Path(shard.file).suffix}"
        info = ShardInfo(name, shard.num_samples, base + shard.first_index, shard.bytes, shard.sha256)
        source = shard.file
        pairs = _shard_pairs(fmt, new, source, name)  # raises unless its data file is there
        if _needs_rewrite(extra, shard):  # labels renumbered into the pack's classes: written anew
            source = f".{name}"
            _remove_shard(fmt, new / source)  # what a run interrupted while rewriting it left
            nbytes, digest = _rewrite_shard(extra, fmt, new / shard.file, new / source, shard)
            info = replace(info, bytes=nbytes, sha256=digest)
            pairs = _shard_pairs(fmt, new, source, name)
        moves.extend(pairs)
        shards.append(info)
    staging.mkdir()
    _write_index(staging, inputs, fields=old.manifest.kind == "fields")
    atomic_write(staging / SKIP_REPORT, b"".join(line for item in inputs for line in _report_lines(item)))
    manifest = _manifest(inputs, staging, shards, classes, fields, codecs)  # the new index hashed where it is staged
    manifest.index.update(dir=index_dir, previous=old.manifest.index_dir)
    plan = {
        "manifest": manifest.to_dict(),
        "appended": extra.manifest.to_dict(),
        "moves": [list(pair) for pair in moves],
        "drop": drop,
    }
    journal = plan_path(dst, generation)
    atomic_write(staging / journal.name, json.dumps(plan, indent=1, ensure_ascii=False).encode("utf-8"))
    os.rename(staging / journal.name, journal)  # the plan is written: from here on it is carried out, as read back
    fsync_dir(dst)
    return _roll_forward(dst, new, read_plan(dst, journal))


_MAX_GENERATION = 10**12
"""More appends than any pack sees; the names of the next one's files stay far below a file system's 255 bytes."""


def next_generation(dst: str | os.PathLike, manifest: Manifest) -> int:
    """N of the next append into the pack ``dst`` (its names: ``shard-aN-...``, ``index-aN``), from its ``manifest``.

    Raises:
        PackFormatError: the pack's names give a generation too large to name the next one's files.
    """
    generation = 1 + max((generation_of(s.file) for s in manifest.shards), default=0)
    generation = max(generation, 1 + generation_of(manifest.index_dir))
    if generation > _MAX_GENERATION:
        raise PackFormatError(
            f"the pack's names (index.dir or a shard's file) count {generation - 1} appends, "
            "more than the next one could name its files after",
            path=Path(dst) / MANIFEST_NAME,
            hint="The manifest is damaged or was not written by packdata: convert the pack again",
        )
    return generation


_FULL_HINT = "The pack is as it was: free space on that disk, then append again with resume=True"
_RESTART = "Append again without resume: the pack holds nothing of that append yet"


def _staging_of(dst: Path, generation: int) -> Path:
    """:func:`_staging_path`, refused when a link or a file stands there: nothing is read or moved through it.

    Raises:
        PackFormatError: naming it.
    """
    staging = _staging_path(dst, generation)
    if staging.is_symlink() or (os.path.lexists(staging) and not staging.is_dir()):
        raise PackFormatError(
            "the interrupted append's folder is a link or a file, not the folder packdata made: nothing is read or "
            "moved through it",
            path=staging,
            hint="Remove it from the pack (a link: only the link itself), then run the append again",
        )
    return staging


def _staging_path(dst: Path, generation: int) -> Path:
    return dst / f"{STAGING}{generation}.partial"


def _interrupted(dst: Path, manifest: Manifest, *, resume: bool) -> tuple[AppendPlan, bool] | None:
    """The plan of an interrupted append in ``dst``, and whether that append took effect.

    One that took effect (the manifest names its index) comes first; else,
    with ``resume``, the newest plan that fits the pack.
    """
    journals = plans_in(dst)
    for path in journals:
        if path == plan_path(dst, generation_of(manifest.index_dir)):
            return read_plan(dst, path), True
    if resume:
        for path in journals:
            journal = read_plan(dst, path)
            if plan_fits(journal, manifest):
                return journal, False
    return None


def interrupted_append(dst: str | os.PathLike) -> Manifest | None:
    """The manifest of the pack that an interrupted append into ``dst`` adds, when ``resume=True`` finishes it.

    That is an append stopped after its plan was written: :func:`append_pack`
    with ``resume=True`` finishes it without its source. None when there is
    none (an append stopped before starts again). Call under ``dst``'s lock.

    Raises:
        PackFormatError: ``dst`` or the plan is damaged.
    """
    dst = Path(dst)
    found = _interrupted(dst, read_manifest(dst), resume=True)
    return found[0].appended if found else None


def _recover(dst: Path, new: Path, *, resume: bool) -> MergeResult | None:
    """Deal with what an interrupted append left in ``dst``; the result when ``resume`` finished it.

    One that took effect is finished (its skip report and cleanup); one whose
    plan fits the pack is carried out with ``resume``; anything else an append
    made that the manifest does not name is deleted (the pack is as before it).
    """
    found = _interrupted(dst, read_manifest(dst), resume=resume)
    result = None
    if found is not None:
        journal, took_effect = found
        if took_effect:
            _finish(dst, journal, new if resume else None)
            result = _merge_result(dst, journal) if resume else None
        else:  # with resume: a plan that fits the pack
            result = _roll_forward(dst, new, journal)
    _remove_leftovers(dst)
    return result


def _roll_forward(dst: Path, new: Path, journal: AppendPlan) -> MergeResult:
    """Carry out an append's plan from wherever it stopped: every step is done once, whatever ran before."""
    index = _staging_of(dst, journal.generation) / INDEX_DIR
    target = dst / journal.manifest.index_dir
    if index.is_dir():
        os.rename(index, target)
    elif not target.is_dir():
        raise PackFormatError("the sample index of an interrupted append is missing", path=index, hint=_RESTART)
    folders = set()
    for source, placed in journal.moves:
        src, to = new / source, dst / placed
        if to.parent != dst and to.parent not in folders:
            if to.parent.is_symlink() or (os.path.lexists(to.parent) and not to.parent.is_dir()):
                raise PackFormatError(  # a link planted there would take the shard's files out of the pack
                    "the interrupted append's shard folder is not a folder (a link or a file)",
                    path=to.parent,
                    hint=_RESTART,
                )
            to.parent.mkdir(exist_ok=True)
            folders.add(to.parent)
        if os.path.lexists(src):
            os.replace(src, to)
        elif not os.path.lexists(to):
            raise PackFormatError(
                "shard file is missing: the interrupted append moved neither it nor its copy into the pack",
                path=src,
                hint=_RESTART,
            )
    for folder in sorted(folders):
        fsync_dir(folder)
    fsync_dir(dst)
    try:
        write_manifest(dst, journal.manifest)  # the append takes effect here, atomically
    except OSError as exc:  # nothing published (atomic_write removed its temporary): the plan resumes it
        raise_if_full(exc, dst, of="of the pack", hint=_FULL_HINT)
        raise
    _finish(dst, journal, new)
    return _merge_result(dst, journal)


def _finish(dst: Path, journal: AppendPlan, new: Path | None) -> None:
    """What follows an append taking effect: its skip report, the index two appends old, ``new``, the plan last."""
    staging = _staging_of(dst, journal.generation)
    report = staging / SKIP_REPORT
    if report.is_file() and not report.is_symlink():  # a link's file outside never becomes the pack's report
        os.replace(report, dst / SKIP_REPORT)
    if journal.drop is not None:
        _drop_index(dst, journal.drop)
    if new is not None and new.exists():
        shutil.rmtree(new)
    if staging.exists():
        shutil.rmtree(staging)
    journal.path.unlink()  # the append is over
    fsync_dir(dst)


def _merge_result(dst: Path, journal: AppendPlan) -> MergeResult:
    manifest = journal.manifest
    return MergeResult(
        dst,
        manifest.num_samples,
        len(manifest.shards),
        appended=journal.appended,
        missing_fields=manifest.missing_fields(),
    )


def _remove_shard(fmt: str, shard: Path) -> None:
    """Delete the shard at ``shard`` (a folder, or a file and its side files), if it is there."""
    layout = get_format(fmt).shard_layout(shard.name)
    if layout.folder:
        shutil.rmtree(shard, ignore_errors=True)
    else:
        for path in (shard, *layout.side_paths(shard)):
            path.unlink(missing_ok=True)


def _index_folder_problem(path: Path) -> str | None:
    """Why the folder ``path`` is not a sample index and nothing else; None when it is one (or is not there)."""
    if not os.path.lexists(path):
        return None
    if path.is_symlink() or not path.is_dir():
        return "is not a folder"
    for entry in os.scandir(path):
        if entry.name not in ALL_FILES or not entry.is_file(follow_symlinks=False):
            return f"holds {entry.name!r}, which is not a sample index file"
    return None


def _check_index_folder(dst: Path, name: str) -> None:
    """Raise unless ``index.previous`` of ``dst`` names a sample index folder and nothing else (or nothing).

    Raises:
        PackFormatError: naming the folder and what else it holds.
    """
    path = resolve_in_pack(dst, name, field="index.previous", manifest=dst / MANIFEST_NAME)
    problem = _index_folder_problem(path)
    if problem is not None:
        raise PackFormatError(
            f"the index folder an append replaced (index.previous in {MANIFEST_NAME}) {problem}; "
            "the next append deletes that folder",
            path=path,
            hint="Move what is not a sample index file out of the pack, then append again",
        )


def _drop_index(dst: Path, name: str) -> None:
    """Delete the index folder ``name`` of ``dst``: its sample index files, then the folder, never anything else."""
    _check_index_folder(dst, name)
    path = dst / name
    if not os.path.lexists(path):
        return
    for entry in os.scandir(path):
        if entry.name in ALL_FILES:
            os.unlink(entry.path)
    os.rmdir(path)  # fails rather than delete what is not an index file


def _remove_leftovers(dst: Path) -> None:
    """Delete what an interrupted append left in ``dst``: the names it writes, exactly, that the manifest does not list.

    Call only once an append that took effect is finished, and one to resume carried out (:func:`_recover`):
    the plans left (``.append-aN.json``) are of appends that did not take effect.
    """
    manifest = read_manifest(dst)
    for journal in plans_in(dst):  # first: an append not taken effect cannot be resumed once this starts
        journal.unlink()
    known = {s.file for s in manifest.shards} | {manifest.index_dir, manifest.index.get("previous", "")}
    layout_of = get_format(manifest.format).shard_layout
    for shard in manifest.shards:
        layout = layout_of(shard.file)
        if not layout.folder:
            known.update(layout.side)
    generation = next_generation(dst, manifest)
    for entry in os.scandir(dst):
        if entry.name in known or _append_made(entry.name, manifest.format) < generation:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)


_MADE = re.compile(rf"{re.escape(INDEX_DIR)}-a([0-9]+)|\.(?:append|{re.escape(INDEX_DIR)})-a([0-9]+)\.partial")
_MADE_SHARD = re.compile(r"shard-a([0-9]+)-[0-9]{5,}-of-[0-9]{5,}")


def _append_made(name: str, fmt: str) -> int:
    """N when ``name`` is exactly one an append of generation N writes into a pack (a shard's file or side
    table, ``index-aN``, its ``.append-aN.partial`` or, before the plans, ``.index-aN.partial``), else 0."""
    made = _MADE.fullmatch(name)
    if made is not None:
        return int(made[1] or made[2])
    shard = _MADE_SHARD.match(name)
    if shard is None:
        return 0
    data = shard[0] + Path(shard_writer(fmt).shard_name(0)).suffix
    layout = get_format(fmt).shard_layout(data)
    return int(shard[1]) if name in (data, *(() if layout.folder else layout.side)) else 0
