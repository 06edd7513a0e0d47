"""Where a pack may go: destination checks, what may be replaced, and the partial pack beside it."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

from packdata.errors import CapacityError, ConfigError, PackFormatError
from packdata.formats import get_format
from packdata.host.disks import filesystem_named
from packdata.pack.files import check_visible, discard_partial, file_kind, holds_conversion, is_inside
from packdata.pack.index import ALL_FILES, index_files
from packdata.pack.lock import convert_lock_path
from packdata.pack.manifest import MANIFEST_NAME, SKIP_REPORT, Manifest, read_manifest
from packdata.units import format_size

__all__ = [
    "MAKING_PARTIAL",
    "SPILL_DIR",
    "check_inputs_apart",
    "check_real_destination",
    "check_resumable",
    "interrupted_error",
    "partial_path",
    "spill_folder",
]

SPILL_DIR = "keys.spill"
"""The folder of a partial pack where a walk's :class:`~packdata.pack.keyset.KeySet` spills sorted runs of
keys (its memory stays bounded): emptied as a conversion starts or resumes, removed before it is published."""

MAKING_PARTIAL = "(making its partial pack's folder)"
"""What a full disk names a write as when the partial pack's folder cannot be made (``of=`` of
:func:`packdata.host.disks.write_error`)."""


def partial_path(dst: str | os.PathLike) -> Path:
    """The hidden sibling a conversion into ``dst`` writes before renaming."""
    dst = Path(dst)
    return dst.parent / f".{dst.name}.partial"


def spill_folder(partial: Path, *, empty: bool = False) -> Path:
    """Where the key sets of a conversion into ``partial`` spill; ``empty``: what was spilled there is removed."""
    folder = partial / SPILL_DIR
    if empty:  # a file or link found there goes itself (never what it leads to): packdata makes only a folder
        discard_partial(folder)
    return folder


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
            hint="Pass resume=True to continue it, or overwrite=True to start again",
        )
    return ConfigError(
        f"an interrupted merge or conversion into {dst} left {partial}, with no checkpoint to continue from",
        path=dst,
        hint="Pass overwrite=True to start again",
    )


def check_resumable(partial: Path) -> None:
    """Refuse to resume into anything but a folder of folders and regular files, as packdata writes them.

    A resume truncates and appends to the files it finds: a symlink, FIFO or
    device planted in the partial pack would send those writes elsewhere, and
    a folder of another user's (a shared scratch area) lets that user plant one
    while the resume writes there.

    Raises:
        ConfigError: ``partial``, or something inside it, is of another type or
            a folder of another user's (named).
    """
    hint = "Move it away, or start again with overwrite=True"
    info = os.lstat(partial)
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(
            f"{partial} is {file_kind(info.st_mode)}, not an interrupted conversion", path=partial, hint=hint
        )
    _check_own_folder(partial, info, partial, hint)
    for root, folders, files in os.walk(partial):
        for name in (*folders, *files):
            info = os.lstat(os.path.join(root, name))
            mode = info.st_mode
            if stat.S_ISDIR(mode):
                _check_own_folder(Path(root, name), info, partial, hint)
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                where = os.path.join(root, name)
                raise ConfigError(
                    f"the interrupted conversion holds {where}, {file_kind(mode)}: packdata never writes one",
                    path=partial,
                    hint=hint,
                )


def _check_own_folder(folder: Path, info: os.stat_result, partial: Path, hint: str) -> None:
    """Refuse a folder of ``partial`` that another user owns: that user may swap its files for links meanwhile."""
    if info.st_uid != os.geteuid():
        raise ConfigError(
            f"the interrupted conversion's folder {folder} belongs to another user (uid {info.st_uid}), "
            "who could swap its files for links while packdata writes there",
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
                "destination already exists", path=dst, hint="Pass overwrite=True to replace it, or choose another path"
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
        ConfigError: naming ``dst`` and what it is, or that it cannot be looked at.
    """
    check_visible(dst, what="the destination", hint="Choose a destination whose folders this user may search and write")
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
            f"no space left on {filesystem_named(parent)} to start a pack there "
            f"({format_size(_MIN_FREE_BYTES)} needed)",
            path=parent,
            hint="Free space or choose another destination",
        )
