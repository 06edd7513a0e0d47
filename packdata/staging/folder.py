"""The staged folder besides its shards' copies: its sample index copy, old shards and leftovers, its lock,
the folders a stage made, its JSON files and the staged manifest. Internal to :mod:`packdata.staging`."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from packdata.errors import ConfigError, PackdataError, PackFormatError, unwritable_error
from packdata.formats import get_format
from packdata.pack.files import (
    aside_path,
    atomic_write,
    discard_partial,
    discard_stale,
    file_kind,
)
from packdata.pack.index import ALL_FILES as INDEX_FILES
from packdata.pack.index import damaged_index_file, index_files
from packdata.pack.lock import convert_lock_path, wait_for_lock
from packdata.pack.manifest import MANIFEST_NAME, STAGED_FILE, Manifest
from packdata.staging.copy import (
    EXTRA_FILES,
    LOCK,
    PARTIAL,
    ShardFiles,
    copy_regular,
    is_regular,
    require_regular,
    sha256_of,
)
from packdata.staging.space import FULL_DISK_ERRNOS, no_space_error

__all__ = [
    "copy_index",
    "dir_bytes",
    "index_folder",
    "locked",
    "missing_folders",
    "old_shards",
    "remove_empty",
    "remove_leftovers",
    "removed_if_refused",
    "resolve_order",
    "same_tree",
    "staged_manifest",
    "write_json",
]


def dir_bytes(path: Path) -> int:
    if is_regular(path):
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if is_regular(p))


def same_tree(src: Path, dst: Path, digests: dict[str, str]) -> bool:
    """``dst`` holds the same sample index files as ``src``, each with its SHA-256 in ``digests`` where it has one.

    Only the index's own files count. ``digests`` is the manifest's
    ``index.sha256``: a copy of a damaged index is never kept as current.
    """
    if dst.is_symlink() or not dst.is_dir():
        return False
    for name in INDEX_FILES:
        mine, other = src / name, dst / name
        if not os.path.lexists(mine):
            continue
        if not is_regular(other) or other.lstat().st_size != mine.lstat().st_size:
            return False
        copied = sha256_of(other)
        if copied != sha256_of(mine) or copied != digests.get(name, copied):
            return False
    return True


def index_folder(source: Path, manifest: Manifest) -> Path:
    """The source pack's sample index folder, which stage copies: a folder of the pack's own, not a link.

    Each index file a pack of its kind holds must be there as a regular file.

    Raises:
        PackFormatError: it is missing, or is a symlink or not a folder; or one
            of its index files is missing or not a regular file (named).
    """
    folder = source / manifest.index_dir
    try:
        mode = folder.lstat().st_mode
    except FileNotFoundError:
        raise PackFormatError(
            "the sample index folder is missing", path=folder, hint="Convert the pack again"
        ) from None
    if not stat.S_ISDIR(mode):
        raise PackFormatError(
            f"the sample index folder is not a folder of the pack (it is {file_kind(mode)})",
            path=folder,
            hint="packdata copies only a pack's own regular files: replace it by the real folder or convert again",
        )
    for file in index_files(manifest.kind):
        require_regular(folder / file, f"sample index file {file}")
    return folder


def copy_index(source: Path, dest: Path, manifest: Manifest) -> None:
    """Copy the sample index (and small extras) unless the destination already holds the same files.

    Only the index's own files are copied, each as a regular file (see
    :func:`copy_regular`); anything else in the source's index folder is left.
    Each copy must match its SHA-256 in the manifest (``index.sha256``), which
    the staged manifest keeps: the staged index is the one the pack was written with.
    The old index is moved aside (:func:`~packdata.pack.files.aside_path`) and
    deleted; call it holding ``dest``'s lock.

    Raises:
        PackFormatError: an index file of the source is damaged (its copy does
            not match the manifest) or is not a regular file, or the index folder
            is not a folder of the pack (:func:`index_folder`).
    """
    name = manifest.index_dir
    src = index_folder(source, manifest)
    digests = manifest.index_sha256
    if not same_tree(src, dest / name, digests):
        temp = dest / f".{name}{PARTIAL}"
        shutil.rmtree(temp, ignore_errors=True)
        try:
            temp.mkdir()
            for file in INDEX_FILES:
                if file in digests or os.path.lexists(src / file):
                    _, digest = copy_regular(src / file, temp / file)
                    if digest != digests.get(file, digest):
                        hint = "The source pack is damaged: run `packdata verify` on it and convert it again"
                        raise damaged_index_file(src / file, hint=hint)
        except BaseException:  # a damaged file, a full disk: no partial index is left
            shutil.rmtree(temp, ignore_errors=True)
            raise
        discard_stale(dest / name, "old")  # what a run killed between the renames below left
        old = aside_path(dest / name)  # never onto a leftover that could not be removed
        try:
            if os.path.lexists(dest / name):
                os.rename(dest / name, old)
            os.rename(temp, dest / name)
        except OSError:  # a file system that refuses the rename: the old index stays, no copy is left over
            shutil.rmtree(temp, ignore_errors=True)
            raise
        with contextlib.suppress(OSError):  # one that cannot be removed costs disk; the next stage sweeps it
            discard_partial(old)
    for extra in EXTRA_FILES:
        if os.path.lexists(source / extra):
            tmp = dest / f".{extra}{PARTIAL}"
            tmp.unlink(missing_ok=True)
            copy_regular(source / extra, tmp)
            os.replace(tmp, dest / extra)


def old_shards(dest: Path, marker: dict[str, Any], units: list[ShardFiles], manifest: Manifest) -> list[Path]:
    """The files and folders in ``dest`` of shards its ``marker`` names (staged or left) that ``units`` no longer has.

    What a source converted again into other shards leaves of its old ones, each
    with its side tables: only plain names directly in ``dest`` (not hidden) that
    are no file of the pack being staged. Remove them with
    :func:`~packdata.pack.files.discard_partial` (a link itself, never followed),
    holding ``dest``'s lock.
    """
    try:
        layout_of = get_format(marker["format"]).shard_layout
    except PackdataError:  # a format this packdata does not know: nothing is taken for its shards
        return []
    current = {u.name for u in units} | {dst.name for u in units for _, dst, _, _ in u.files}
    current |= {MANIFEST_NAME, manifest.index_dir, *EXTRA_FILES, STAGED_FILE}
    found = []
    for name in [*marker["staged"], *marker["left"]]:
        plain = isinstance(name, str) and name[:1] not in ("", ".") and "/" not in name and "\0" not in name
        if not plain or name in current:
            continue
        layout = layout_of(name)
        paths = [dest / name] if layout.folder else [dest / name, *layout.side_paths(dest / name)]
        found += [p for p in paths if p.name not in current and os.path.lexists(p)]
    return found


def remove_leftovers(dest: Path) -> None:
    """Delete ``.partial`` files and folders an interrupted run left."""
    for entry in dest.iterdir():
        if entry.name.startswith(".") and entry.name.endswith(PARTIAL):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


@contextlib.contextmanager
def locked(
    dest: Path, what: str = "packdata stage", made: Sequence[Path] = (), wait_seconds: float = 0
) -> Iterator[None]:
    """Hold ``dest``'s locks (see :mod:`packdata.pack.lock`), making ``dest`` once the first is held.

    Another process holding one is waited for, at most ``wait_seconds`` for each (0: not at all).

    ``.NAME.lock`` beside ``dest`` is the one a stage from a URL into the same
    folder holds (it replaces the whole folder, so its lock lives outside it);
    ``.stage.lock`` inside is the one any other path to ``dest`` (a symlink) shares.
    A run refused by the first lock creates nothing; one refused by the second
    found ``dest`` already there. A block that raises removes ``dest`` if this
    made it and it is left empty, then the folders above it in ``made`` (those
    the caller made for it, deepest first) while each is empty: never a folder
    that was there before.

    Raises:
        LockedError: another process holds either lock, still after ``wait_seconds`` (it is named).
    """
    try:
        with wait_for_lock(convert_lock_path(dest), what=what, target=dest, timeout=wait_seconds):
            created = not os.path.lexists(dest)
            dest.mkdir(exist_ok=True)
            try:
                with wait_for_lock(dest / LOCK, what=what, target=dest, timeout=wait_seconds):
                    yield
            except BaseException:
                if created:
                    remove_empty([dest])
                raise
    except BaseException:
        if not os.path.lexists(dest):  # after .NAME.lock is gone from the folder above
            remove_empty(made)
        raise


def missing_folders(folder: Path) -> list[Path]:
    """``folder`` and the folders above it that do not exist yet, deepest first: what making ``folder`` creates."""
    return [p for p in (folder, *folder.parents) if not os.path.lexists(p)]


@contextlib.contextmanager
def removed_if_refused(made: Sequence[Path]) -> Iterator[None]:
    """If the block raises, remove the folders of ``made`` (deepest first) that it left empty; never another."""
    try:
        yield
    except BaseException:
        remove_empty(made)
        raise


def remove_empty(folders: Sequence[Path]) -> None:
    """Remove ``folders`` (deepest first) that are empty folders, stopping at the first that is not."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # not empty (something was written there), or gone: the ones above hold it
            return


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON atomically (a kill leaves a ``.partial`` temporary, which stage cleans up).

    Raises:
        CapacityError: the disk is full; ConfigError: it cannot be written otherwise (both name ``path``).
    """
    try:
        atomic_write(path, (json.dumps(data, indent=1, ensure_ascii=False) + "\n").encode("utf-8"), tmp_suffix=PARTIAL)
    except OSError as exc:
        if exc.errno in FULL_DISK_ERRNOS:
            raise no_space_error(exc, path, staged=path.parent) from exc
        raise unwritable_error(exc, path) from exc


def staged_manifest(manifest: Manifest, source: Path, units: list[ShardFiles], staged: set[int]) -> Manifest:
    """The staged pack's manifest: staged shards by name, the others at their origin (absolute paths).

    ``staged_from`` marks it as staged: only such a manifest may name shards
    outside its pack, and :func:`packdata.pack.manifest.read_manifest` checks each
    against its origin pack's manifest.
    """
    shards = [
        dataclasses.replace(u.info, file=u.name if u.number in staged else os.fspath(u.info.path(source)))
        for u in units
    ]
    return dataclasses.replace(manifest, shards=shards, staged_from=os.fspath(source))


def resolve_order(manifest: Manifest, shards: Sequence[int | str] | None) -> list[int]:
    n = len(manifest.shards)
    if shards is None:
        return list(range(n))
    names = {Path(s.file).name: i for i, s in enumerate(manifest.shards)}
    hint = f"The pack's shards are {', '.join(list(names)[:3])}{', ...' if n > 3 else ''}"
    if not shards:
        raise ConfigError("shards should name at least one shard, but got none", hint=hint)
    order: list[int] = []
    for item in shards:
        digits = isinstance(item, str) and item.strip().isascii() and item.strip().isdigit()  # not '²'
        if isinstance(item, int) or digits:
            number = int(item) if isinstance(item, int) or len(item.strip()) <= 18 else n  # 5,000 digits: out of range
            if not 0 <= number < n:
                raise ConfigError(
                    f"shards should be numbers from 0 to {n - 1} or shard names, but got {item!r}", hint=hint
                )
        elif item in names:
            number = names[item]
        else:
            raise ConfigError(f"shards should be numbers from 0 to {n - 1} or shard names, but got {item!r}", hint=hint)
        if number not in order:
            order.append(number)
    return order
