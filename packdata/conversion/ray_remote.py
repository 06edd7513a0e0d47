"""Ray conversion into object storage: each task uploads its own shard, the driver the manifest, last.

No storage is shared between the driver and the Ray workers. A task writes its
shard in a worker-local temporary folder, uploads the shard's files to the
destination URL under the names it wrote them (``shard-00003.lmdb/data.mdb``,
``part-00003.tfrecord``), and returns its index fragment and skip lines with
each uploaded object's size, MD5 and the version (ETag) the store reported
after the upload. The driver keeps those small pieces in a local work folder
(for ``resume``: a task whose objects the store still reports with their
recorded size and version is not run again), builds the index and manifest
there, moves renamed shards (TFRecord ``-of-N`` names) on the store, checks the
size of every object, then uploads the index, the skip report and the manifest
last: the pack exists once its manifest does.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from packdata.conversion.upload_journal import file_md5, object_matches
from packdata.conversion.url_destination import Destination
from packdata.errors import EngineError, PackdataError, PackFormatError
from packdata.pack.lock import hold_lock
from packdata.pack.manifest import ShardInfo
from packdata.pack.urls import display_url, object_version, open_url, remote_error, retry_transient

__all__ = [
    "RemoteTarget",
    "check_object_name",
    "objects_complete",
    "place_shards",
    "task_folder",
    "upload_task_files",
]

_TASK_PREFIX = "packdata-task-"
_TASK_LOCK = ".task.lock"
_TASK_GRACE_S = 60.0  # a lock file this old and not held: its task died (a new one is held within microseconds)


@contextlib.contextmanager
def task_folder() -> Iterator[Path]:
    """A worker-local temporary folder for one task (in ``$PACKDATA_TMP`` or the system's), removed after.

    The task holds an ``flock`` on a lock file inside it while it runs. A
    killed worker never runs its clean-up, so each new task first removes
    sibling folders whose lock nobody holds and that are older than a minute:
    their task is dead (the kernel drops a dead process's locks), and a shard
    left there would fill the worker's disk over many retries.
    """
    base = Path(os.environ.get("PACKDATA_TMP") or tempfile.gettempdir())
    _sweep_dead_tasks(base)
    folder = Path(tempfile.mkdtemp(prefix=_TASK_PREFIX, dir=base))
    try:
        with hold_lock(folder / _TASK_LOCK, what="packdata convert (Ray task)", target=folder):
            yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _sweep_dead_tasks(base: Path) -> None:
    """Remove the task folders in ``base`` left by dead tasks (ours, real folders, unlocked, old)."""
    try:
        candidates = [p for p in base.iterdir() if p.name.startswith(_TASK_PREFIX)]
    except OSError:
        return
    for folder in candidates:
        try:
            st = os.lstat(folder)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue  # a symlink or someone else's: never followed, never removed
            fd = os.open(folder / _TASK_LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue  # no lock file: not a task folder we can judge
        try:
            if time.time() - os.fstat(fd).st_mtime < _TASK_GRACE_S:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(folder, ignore_errors=True)  # still holding the lock: no other sweeper races us
        except OSError:
            continue  # BlockingIOError: its task is alive
        finally:
            os.close(fd)


@dataclass(frozen=True)
class RemoteTarget:
    """Where the tasks of a Ray conversion upload: the pack's URL and its fsspec options (never shown).

    ``found``: what the driver's :func:`~packdata.conversion.url_destination.check_remote_destination` found
    there, which its :func:`~packdata.conversion.upload.upload_pack` acts on (the manifest is not read again).
    """

    url: str
    storage_options: dict[str, Any] | None = field(default=None, repr=False)
    found: Destination | None = None

    @property
    def shown(self) -> str:
        """The URL without credentials, for messages."""
        return display_url(self.url)

    def open(self) -> tuple[Any, str]:
        """The filesystem and the pack's root on it (no trailing slash), with no cached listing."""
        fs, root = open_url(self.url, self.storage_options)
        fs.invalidate_cache()  # objects come and go from other processes (the tasks)
        return fs, root.rstrip("/")


def check_object_name(rel: str, where: str) -> str:
    """``rel`` if it is a relative object name with no ``..``, ``.`` or empty parts.

    Raises:
        EngineError: it is not (a damaged or foreign task result).
    """
    if not isinstance(rel, str) or any(part in ("", ".", "..") for part in rel.split("/")) or "\\" in rel:
        raise EngineError(f"a task result names the object {rel!r}, which is not a name inside the pack", path=where)
    return rel


def upload_task_files(pack: Path, leave: str, target: RemoteTarget) -> dict[str, list[Any]]:
    """Upload every file under ``pack`` but the ``leave`` folder to ``target``; ``{name: [size, md5, version]}``.

    ``version`` is what the store reports for the object right after the upload
    (its ETag): a resume trusts the object only while the store still says so.
    A transient failure (a dropped connection, a timeout, a 5xx reply) is tried
    again with backoff (:func:`~packdata.pack.urls.retry_transient`).

    Raises:
        SourceError: an upload failed (the message shows the URL and the error's type only).
    """
    fs, root = target.open()
    objects: dict[str, list[Any]] = {}
    for path in sorted(p for p in pack.rglob("*") if p.is_file() and p.relative_to(pack).parts[0] != leave):
        rel = path.relative_to(pack).as_posix()
        try:
            version = retry_transient(partial(_put, fs, path, f"{root}/{rel}"))
        except Exception as exc:
            raise remote_error(target.shown, f"uploading {rel} failed", exc, resumable=True) from exc
        objects[rel] = [path.stat().st_size, file_md5(path), version]
    return objects


def _put(fs: Any, path: Path, target: str) -> str:
    """Upload ``path`` to ``target``; the version the store reports for it now."""
    fs.put_file(os.fspath(path), target)
    fs.invalidate_cache(target)
    return object_version(fs.info(target))


def objects_complete(target: RemoteTarget, objects: dict[str, list[Any]]) -> bool:
    """Whether the store still reports every object a task recorded with its size and version (see object_matches).

    Raises:
        SourceError: a request failed (the message shows the URL and the error's type only).
    """
    fs, root = target.open()
    try:
        return bool(objects) and all(
            retry_transient(
                partial(
                    object_matches,
                    fs,
                    f"{root}/{check_object_name(rel, target.shown)}",
                    int(size),
                    str(version),
                    str(md5),
                )
            )
            for rel, (size, md5, version) in objects.items()
        )
    except (AttributeError, TypeError, ValueError):
        return False  # a damaged record (not a name -> [size, md5, version] table): run the task again
    except PackdataError:
        raise
    except Exception as exc:
        raise remote_error(target.shown, "cannot look up the shards uploaded before", exc, resumable=True) from exc


def place_shards(
    target: RemoteTarget, written: list[ShardInfo], final: list[ShardInfo], objects: list[dict[str, list[Any]]]
) -> None:
    """Move each shard's objects from their written names to their final ones, then check every object's size.

    A shard's companions share its stem (``part-00003.tfindex``), so they move
    with it. Repeatable: an object already under its final name is left there.

    Raises:
        PackFormatError: an object is missing or has another size than its task wrote (rerun with resume).
        SourceError: a request failed.
    """
    fs, root = target.open()
    for old, new, files in zip(written, final, objects, strict=True):
        old_stem, new_stem = Path(old.file).stem, Path(new.file).stem
        for rel, (size, *_) in sorted(files.items()):
            head, dot, rest = check_object_name(rel, target.shown).partition(".")
            name = f"{new_stem}{dot}{rest}" if head == old_stem else rel
            try:
                found = retry_transient(partial(_place, fs, f"{root}/{rel}", f"{root}/{name}"))
            except Exception as exc:
                raise remote_error(target.shown, f"cannot move or look up {name}", exc, resumable=True) from exc
            if found != int(size):
                state = "is missing" if found < 0 else f"holds {found} bytes"
                raise PackFormatError(
                    f"{target.shown}: {name} {state}; its task uploaded {size} bytes",
                    hint="Run again with resume=True: that task runs again",
                )


def _place(fs: Any, old: str, new: str) -> int:
    """Move ``old`` to ``new`` unless it is gone (moved before); the size the store reports for ``new``, -1 if none."""
    try:
        if new != old and fs.exists(old):
            fs.mv(old, new)
        return int(fs.info(new).get("size", -1))
    except FileNotFoundError:
        return -1
