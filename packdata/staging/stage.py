"""``packdata stage``: copy a pack's shards to fast storage, verify them, and point a manifest at them.

A staging *area* is a directory on fast storage: a local NVMe path given with
``to=``, or a tmpfs that packdata mounts (``tmpfs=SIZE``, at
:data:`DEFAULT_AREA` unless ``mount=`` says otherwise). A pack staged from
``/nfs/train.lmdb`` lands in ``AREA/train.lmdb``: a pack of its own whose
manifest points each shard at its staged copy (a relative name) or, for a
shard left behind because the budget did not hold it, at the original (an
absolute path). The sample index is copied too, so ``LMDBDataset(staged)`` and
``TFRecordDataset(staged)`` read the mix without knowing.

How a run goes:

1. Existing copies are checked: a staged shard counts only if every file has
   the source's size and its SHA-256 equals the manifest's (side files, such as
   ``records.i64`` or ``.tfindex``, must equal the source's). Anything else is
   deleted and copied again, so a second run copies nothing and a corrupt or
   outdated copy is replaced (the choice documented for checksum mismatches);
   shards ``staged.json`` names that the source no longer has are removed.
2. Shards are chosen in priority order (the pack's order, or ``shards=``) while
   their bytes fit the budget; a shard too big for what is left is skipped and
   smaller later ones still get their chance. The default budget is what fits
   the destination's free space.
3. Free space (and, on tmpfs, memory: :func:`packdata.host.memory.memory_warnings`)
   is checked before a byte is copied. An unsafe tmpfs is refused unless ``force``.
4. An interim manifest is written first (valid copies relative, all else at
   the originals), so the staged pack reads correctly at every moment.
5. Shards copy in parallel threads to hidden ``.NAME.partial`` names, hashed as
   they are written; a copy whose SHA-256 differs from the manifest is an
   error (the source is damaged, or was converted again since the stage read
   its manifest: said so), never staged. Only a verified copy is renamed
   to its real name, then the final manifest and ``staged.json`` are written.

A Ctrl-C or a kill therefore leaves at most ``.partial`` leftovers that no
reader opens and the next run deletes; a run that stops on an error or Ctrl-C
points the manifest at the shards it copied and verified before it stopped. A destination that fills up raises one
:class:`~packdata.errors.CapacityError`, after removing the partial shard; the
source is only ever read.

tmpfs contents live in RAM and vanish at reboot or unmount: the originals stay
the source of truth, and ``staged.json`` records where they are.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from packdata.errors import (
    CapacityError,
    ConfigError,
    LockedError,
    PackdataError,
    PackFormatError,
)
from packdata.host.facts import gather_facts, read_mounts
from packdata.host.memory import SafetyWarning, memory_warnings
from packdata.pack.files import discard_partial
from packdata.pack.lock import create_readers_lock, exclude_readers
from packdata.pack.manifest import MANIFEST_NAME, Manifest, read_manifest, write_manifest
from packdata.pack.urls import is_url
from packdata.staging.cache import discard_stale_copies
from packdata.staging.copy import ShardFiles, copy_all, is_staged, shard_files
from packdata.staging.folder import (
    copy_index,
    dir_bytes,
    index_folder,
    locked,
    missing_folders,
    old_shards,
    remove_leftovers,
    resolve_order,
    same_tree,
    staged_manifest,
)
from packdata.staging.marker import STAGED_FILE, check_destination, check_name, read_marker, write_marker
from packdata.staging.remote import RemoteStageResult, stage_remote
from packdata.staging.result import StageResult
from packdata.staging.space import FULL_DISK_ERRNOS, area_error, no_space_error
from packdata.staging.tmpfs import (
    DEFAULT_AREA,
    TmpfsArea,
    mount_of,
    prepare_tmpfs,
    tmpfs_mount_at,
)
from packdata.units import format_size

__all__ = [
    "StageResult",
    "stage",
]

_HEADROOM = 64 << 10  # left free on the destination beyond the staged files (directory blocks, staged.json)


# --------------------------------------------------------------------------- shard units


def _free_bytes(area: Path) -> int:
    """Bytes free at the destination (what an unprivileged writer may use)."""
    return shutil.disk_usage(area).free


# --------------------------------------------------------------------------- stage


def stage(
    pack: str | os.PathLike,
    *,
    to: str | os.PathLike | None = None,
    tmpfs: int | None = None,
    mount: str | os.PathLike | None = None,
    resize: bool = False,
    budget: int | None = None,
    shards: Sequence[int | str] | None = None,
    name: str | None = None,
    workers: int | None = None,
    force: bool = False,
    reserve: int | None = None,
    progress: bool = True,
    storage_options: dict[str, Any] | None = None,
    cache_limit: int | None = None,
    wait_seconds: float = 6 * 3600,
) -> StageResult | RemoteStageResult:
    """Copy ``pack``'s shards to fast storage and write a staged pack that reads from them.

    ``pack`` may be a URL (``s3://bucket/train.lmdb``, any fsspec URL): the pack is
    then downloaded whole into ``to`` once per cache folder, every rank of a job
    calling this (:func:`packdata.staging.remote.stage_remote`).

    Exactly one destination: ``to`` (a directory on local disk), ``tmpfs`` (a
    size: mount or reuse a tmpfs at ``mount``, default :data:`DEFAULT_AREA`), or
    neither (the default area, which must already be mounted, e.g. by
    ``prepare_tmpfs``). The staged pack is ``AREA/NAME`` (``name`` defaults to
    the pack's folder name). See the module docstring for the steps.

    Args:
        pack: the pack to stage.
        to: a staging area on local disk.
        tmpfs: mount a tmpfs of this many bytes (reuse the one there).
        mount: the tmpfs mount point, or the default area to use.
        resize: remount an existing tmpfs with the ``tmpfs`` size.
        budget: most bytes of this pack's shards to hold at the destination
            (default: what fits its free space).
        shards: shard numbers or names in priority order; only these are staged.
        name: the staged pack's folder name inside the area (one plain name: no '/', '.' or '..').
        workers: parallel copy threads (default: up to 4).
        force: stage even when the memory checks refuse.
        reserve: memory kept for training in the tmpfs checks.
        progress: show a tqdm bar (bytes, MB/s) on stderr.
        storage_options: for a URL: passed to fsspec (credentials, endpoint, ``anon``).
        cache_limit: for a URL: most bytes the cache's staged copies may hold (LRU
            eviction of verified copies of remote packs not in use).
        wait_seconds: how long to wait for another process staging into the same
            ``AREA/NAME`` (the other ranks of a job on this node), then use what it staged.

    Returns:
        A :class:`StageResult` naming copied, reused and left shards (a
        :class:`~packdata.staging.remote.RemoteStageResult` for a URL).

    Raises:
        CapacityError: the chosen shards do not fit, the tmpfs is unsafe, or
            the destination filled up while copying (the partial shard is removed).
        PackFormatError: the source is not a pack, a shard fails its checksum, or the source changed
            (converted again) while it was staged.
        ConfigError: contradictory options, a ``name`` that is not a plain folder name,
            not root for a mount, or a destination packdata did not stage.
        LockedError: another ``packdata stage`` or ``unstage`` held the destination for longer than
            ``wait_seconds`` (it is named), or
            a dataset reads the staged pack and this run would change it (other shards, a changed source).
    """
    if is_url(pack):
        if tmpfs is not None or budget is not None or shards is not None:
            raise ConfigError(
                "a pack in object storage is staged whole into to=DIR (LMDB reads local files only)",
                hint="Mount the tmpfs first (prepare_tmpfs, or `packdata stage --tmpfs SIZE`), "
                "then stage the URL with to=MOUNT",
            )
        area = to if to is not None else mount
        return stage_remote(
            os.fspath(pack),
            to=area,
            name=name,
            storage_options=storage_options,
            workers=workers,
            reserve=reserve,
            force=force,
            progress=progress,
            cache_limit=cache_limit,
            wait_seconds=wait_seconds,
        )
    if cache_limit is not None:
        raise ConfigError(
            "cache_limit=SIZE applies to packs staged from a URL", hint="Use budget=SIZE for a local pack"
        )
    start = time.monotonic()
    if to is not None and (tmpfs is not None or mount is not None):
        raise ConfigError("give either to= (a directory) or tmpfs=/mount= (a tmpfs area), not both")
    if workers is not None and workers < 1:
        raise ConfigError(f"workers should be at least 1, but got workers={workers}")
    if budget is not None and budget < 0:
        raise ConfigError(f"budget should be at least 0, but got budget={budget}")
    source = Path(pack)
    manifest = read_manifest(source)
    source = source.resolve()
    order = resolve_order(manifest, shards)
    name = source.name if name is None else name
    planned = Path(to if to is not None else mount or DEFAULT_AREA).absolute()
    check_name(name, area=planned)
    check_destination(source, planned / name)  # before the area is made or mounted: never inside the source

    area_info: TmpfsArea | None = None
    made: list[Path] = []  # the folders of the area this run makes
    smallest = min(manifest.shards[n].bytes for n in order)
    if tmpfs is not None and tmpfs < smallest + _HEADROOM:  # before mounting: a typo (1K for 1G) mounted 4 KiB
        raise CapacityError(
            f"a tmpfs of {format_size(tmpfs)} holds no shard of the pack (the smallest to stage is "
            f"{format_size(smallest)})",
            path=planned,
            hint="Ask for a tmpfs=SIZE that holds the shards, e.g. the pack's size",
        )
    if tmpfs is not None:
        area_info = prepare_tmpfs(tmpfs, mount=mount or DEFAULT_AREA, resize=resize, force=force, reserve=reserve)
        area = area_info.path
    elif to is not None:
        area = Path(to).absolute()
        made = missing_folders(area)
        try:
            area.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a full disk, read-only, a file on the way, no permission
            raise area_error(exc, area) from exc
    else:
        area = Path(mount or DEFAULT_AREA).absolute()
        if not area.is_dir() or (mount is None and tmpfs_mount_at(area) is None):
            raise ConfigError(
                "no staging area here",
                path=area,
                hint="Prepare one with tmpfs=SIZE (as root), or give to=DIR",
            )
    dest = area / name
    check_destination(source, dest)

    with (
        locked(dest, made=made, wait_seconds=wait_seconds),
        _full_disk_named(dest),
        contextlib.ExitStack() as held,
    ):  # makes dest
        check_destination(source, dest)  # again, under the lock: another stage may have claimed it meanwhile
        discard_stale_copies(dest)  # a copy an unstage killed mid-delete left aside (it holds .NAME.lock too)
        remove_leftovers(dest)
        units = shard_files(manifest, source, dest)
        previous = read_marker(dest)  # the shards of the pack as it was staged last
        gone = [] if previous is None else old_shards(dest, previous, units, manifest)
        gone_bytes = sum(dir_bytes(p) for p in gone if not p.is_symlink())  # the room they leave (a link: none)
        index_dir = index_folder(source, manifest)
        sizes = {u.number: u.size for u in units}
        claimed = not (dest / STAGED_FILE).is_file()
        if claimed:  # claim the folder first, so a failed run can be retried
            _mark(dest, source, manifest, units, set(), sizes, complete=False)
        try:  # the checks before a byte is copied: a refused first run leaves no folder claimed
            valid = {u.number for u in units if is_staged(u)}
            existing = sum(u.dest_bytes() for u in units) + gone_bytes
            fresh_index = not same_tree(index_dir, dest / index_dir.name, manifest.index_sha256)
            index_bytes = dir_bytes(index_dir) if fresh_index else 0
            free = _free_bytes(area)
            capacity = max(free + existing - index_bytes - _HEADROOM, 0)
            limit = capacity if budget is None else budget
            chosen: set[int] = set()
            total = 0
            for number in order:
                if total + sizes[number] <= limit:
                    chosen.add(number)
                    total += sizes[number]
            to_copy = [units[n] for n in order if n in chosen and n not in valid]  # hottest first
            new_bytes = sum(sizes[u.number] for u in to_copy)
            dead = [u for u in units if u.number not in chosen or u.number not in valid]
            room = free + sum(u.dest_bytes() for u in dead) + gone_bytes - _HEADROOM
            if new_bytes + index_bytes > room:
                raise CapacityError(
                    f"the {len(to_copy)} shards to stage need {format_size(new_bytes + index_bytes)}, "
                    f"but only {format_size(max(room, 0))} is free",
                    path=area,
                    hint="Lower budget=SIZE, choose fewer shards=LIST, or free space",
                )
            warnings: list[SafetyWarning] = []
            mount_info = mount_of(area, read_mounts())
            in_tmpfs = mount_info is not None and mount_info.fstype == "tmpfs"
            if in_tmpfs:
                if area_info is not None and area_info.action != "reused":
                    warnings = list(area_info.warnings)  # the new size was checked as it was mounted
                else:  # the bytes about to land in RAM
                    facts = gather_facts(include_gpus=False)
                    warnings = memory_warnings(facts, tmpfs_size=new_bytes, reserve=reserve, adding=True)
                    refused = [w for w in warnings if w.severity == "refuse"]
                    if refused and not force:
                        raise CapacityError(
                            refused[0].message,
                            path=area,
                            hint="Stage fewer shards with budget=SIZE, or pass force=True",
                        )
        except CapacityError:
            if claimed:
                (dest / STAGED_FILE).unlink(missing_ok=True)  # then locked() removes the folders it made
            raise

        if _changed(dest, staged_manifest(manifest, source, units, chosen)) and not held.enter_context(
            exclude_readers(dest)  # held while the copy changes: a dataset opening it waits for the new one
        ):
            raise LockedError(
                "is still read (a dataset holds it), and staging it again would change its shards under its readers",
                path=dest,
                hint="Stage again once its readers are done, or stage under another name=NAME",
            )
        with _changed_source_named(source, manifest):
            copy_index(source, dest, manifest)
            keep = valid & chosen
            write_manifest(dest, staged_manifest(manifest, source, units, keep))
            _mark(dest, source, manifest, units, keep, sizes, complete=False)
            for unit in dead:
                unit.remove()
            for path in gone:
                with contextlib.suppress(OSError):  # one that cannot be removed costs disk, never the stage
                    discard_partial(path)

            try:
                copy_all(to_copy, new_bytes, workers, progress)
            except BaseException:  # a full disk, a damaged shard, Ctrl-C: the copies verified so far are read
                done = keep | {u.number for u in to_copy if os.path.lexists(u.dest_root)}  # renamed once verified
                with contextlib.suppress(OSError, PackdataError):  # never hides why the copy stopped
                    write_manifest(dest, staged_manifest(manifest, source, units, done))
                    _mark(dest, source, manifest, units, done, sizes, complete=False)
                raise

        staged = chosen
        write_manifest(dest, staged_manifest(manifest, source, units, staged))
        _mark(dest, source, manifest, units, staged, sizes, complete=True)
        create_readers_lock(dest)  # its datasets hold it: unstage then keeps the copy while they live

    names = {u.number: u.name for u in units}
    return StageResult(
        source=source,
        staged=dest,
        area=area,
        copied=[names[u.number] for u in to_copy],
        reused=[names[n] for n in order if n in keep],
        left=[names[u.number] for u in units if u.number not in staged],
        bytes_copied=new_bytes,
        bytes_staged=sum(sizes[n] for n in staged),
        bytes_left=sum(sizes[u.number] for u in units if u.number not in staged),
        budget=limit,
        seconds=time.monotonic() - start,
        free_after=shutil.disk_usage(area).free,
        smallest_left=min((sizes[n] for n in order if n not in staged), default=0),
        bound="budget" if budget is not None else "tmpfs" if to is None and in_tmpfs else "folder",  # to=DIR: no resize
        tmpfs=area_info,
        warnings=warnings,
    )


def _changed(dest: Path, final: Manifest) -> bool:
    """Whether the staged pack at ``dest`` has a readable manifest other than ``final``: its readers would fail."""
    if not (dest / MANIFEST_NAME).is_file():
        return False
    try:
        return read_manifest(dest) != final
    except PackdataError:  # damaged, or its origin changed: its readers fail already
        return False


@contextlib.contextmanager
def _full_disk_named(dest: Path) -> Iterator[None]:
    """A full disk (no block or inode left) while ``dest`` is written: one CapacityError naming the file and its disk.

    The same words as a shard's copy that fills the disk (:func:`~packdata.staging.space.no_space_error`).
    Any other refusal of a file in ``dest`` (a rename across an overlay's layers, an fsync the file system
    refuses) is one ConfigError naming it; the staged pack is left as the interim manifest says.
    """
    try:
        yield
    except OSError as exc:
        if exc.errno in FULL_DISK_ERRNOS:
            raise no_space_error(exc, exc.filename or dest, staged=dest) from exc
        if exc.filename is None or not Path(os.fsdecode(exc.filename)).is_relative_to(dest):
            raise  # the source's, or no file's: not the destination's to name
        raise ConfigError(
            f"cannot write the staged pack: {exc.strerror or exc}"
            + (f" (renaming it to {os.fsdecode(exc.filename2)})" if exc.filename2 else ""),
            path=os.fsdecode(exc.filename),
            hint="Its file system refuses what a stage does (create, rename, fsync; an overlay whose lower layer "
            "holds the copy refuses to rename its folders): unstage it and stage again, or stage into another "
            "to=DIR on a local file system",
        ) from exc


@contextlib.contextmanager
def _changed_source_named(source: Path, manifest: Manifest) -> Iterator[None]:
    """A copy that fails its checksum because ``source`` was converted again meanwhile: say so, not 'damaged'."""
    try:
        yield
    except PackFormatError as exc:
        try:
            changed = read_manifest(source) != manifest
        except PackdataError:  # no pack there now (a conversion is replacing it), or a damaged one
            changed = False
        if not changed:
            raise
        raise PackFormatError(
            f"changed while it was staged: its manifest is no longer the one this stage began with "
            f"({exc.path}: {exc.message})",
            path=source,
            hint="It was converted again meanwhile: stage it again once that conversion is done",
        ) from exc


def _mark(
    dest: Path,
    source: Path,
    manifest: Manifest,
    units: list[ShardFiles],
    staged: set[int],
    sizes: dict[int, int],
    *,
    complete: bool,
) -> None:
    write_marker(
        dest,
        origin=source,
        format=manifest.format,
        staged=[u.name for u in units if u.number in staged],
        left=[u.name for u in units if u.number not in staged],
        bytes_staged=sum(sizes[n] for n in staged),
        bytes_left=sum(sizes[u.number] for u in units if u.number not in staged),
        complete=complete,
    )
