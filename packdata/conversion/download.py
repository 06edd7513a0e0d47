"""Convert from object storage: a source folder at a URL copied into a local work folder, then converted.

:func:`download_source` copies it in parallel and resumably; an object whose name
would leave the work folder (``..``, ``.`` or empty parts) is never written, and
appears in the pack's skip report.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from functools import partial
from pathlib import Path
from typing import Any

from packdata.conversion.remote_folder import _ListedObject, list_folder
from packdata.conversion.replace import OVERSIZED_WORK_FILE_HINT, WORK_FILE_HINT, files_under, journal_most
from packdata.conversion.sources import Skip
from packdata.conversion.upload import work_folder
from packdata.conversion.upload_journal import _read_journal
from packdata.errors import CapacityError, SourceError
from packdata.host.disks import filesystem_named
from packdata.host.facts import disk_free
from packdata.pack.own_files import append_own_file, read_own_bytes
from packdata.pack.urls import display_url, object_version, remote_error, retry_transient
from packdata.progress import progress as show_progress
from packdata.units import format_size

__all__ = ["COPIED_FROM", "copied_again", "download_source", "journal_mark"]


_WORK_FOLDER_HINT = "Set PACKDATA_TMP to a folder on a disk with room (the work folder lives there), or free space"


def _check_room(folder: Path, needed: int, what: str) -> None:
    """Refuse to start writing ``needed`` bytes into ``folder`` when its disk has less free.

    Raises:
        CapacityError: naming the disk (its mount, size and room), what is needed and how to move the work folder.
    """
    if needed > disk_free(folder):
        raise CapacityError(
            f"no space left on {filesystem_named(folder)} for {what} ({format_size(needed)} needed in the work folder)",
            path=folder,
            hint=_WORK_FOLDER_HINT,
        )


def download_source(
    url: str, storage_options: dict[str, Any] | None, *, workers: int | None, progress: bool
) -> tuple[Path, list[Skip]]:
    """Copy the source folder at ``url`` into a local work folder (resumable); return it and the objects refused.

    A file an earlier run downloaded is kept only when the journal beside the
    folder says it was downloaded from the object as it is now (same size and
    version, see :func:`~packdata.conversion.remote_folder.list_folder`); any
    other file in the folder (an object since removed or rewritten, a partial
    download) is removed or downloaded again, so the folder holds exactly the
    listing. Downloads go to a folder of their own and are renamed into place.
    An object whose name has ``..``, ``.`` or empty parts (``a/../b``, ``a//b``,
    a leading ``/``) is not downloaded: it could land outside the folder or on
    another object's file. It is returned as a :class:`Skip` (sorted by name)
    for the conversion's skip report, never dropped silently, as is an object
    rewritten or removed since the listing (see :func:`_download`).

    Raises:
        SourceError: the URL cannot be listed or holds no file, or a download failed for good.
    """
    fs, _, objects, refused = list_folder(url, storage_options)
    shown = display_url(url)
    local = work_folder(url, kind="source")
    local.mkdir(parents=True, exist_ok=True)
    journal = local.parent / _DOWNLOADED
    incoming = local.parent / ".incoming"
    shutil.rmtree(incoming, ignore_errors=True)
    incoming.mkdir()
    done = _read_journal(journal, ("size", "version"), journal_most(len(objects) + len(refused)))
    _remove_unlisted(local, {rel for _, rel, _, _ in objects})
    todo = []
    for path, rel, size, version in objects:
        target = local.joinpath(*rel.split("/"))
        kept = version and done.get(rel) == [size, version] and target.is_file() and target.stat().st_size == size
        if not kept:
            target.unlink(missing_ok=True)
            todo.append((path, rel, target, size, version))
    _check_room(local, sum(item[3] for item in todo), "the source's files")
    lock = threading.Lock()

    def get(item: tuple[str, str, Path, int, str]) -> Skip | None:
        path, rel, target, size, version = item
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=incoming)
        os.close(fd)
        skip = _download(fs, path, shown, rel, Path(tmp), size, version)
        if skip is not None:
            os.unlink(tmp)
            return skip
        os.replace(tmp, target)
        with lock:
            line = json.dumps({"name": rel, "size": size, "version": version}) + "\n"
            append_own_file(journal, line, hint=WORK_FILE_HINT)
        return None

    with (
        show_progress(desc="download source", unit="B", total=sum(i[3] for i in todo), disable=not progress) as bar,
        ThreadPoolExecutor(max_workers=workers or 16, thread_name_prefix="packdata-source") as pool,
    ):
        for item, skip in zip(todo, pool.map(get, todo), strict=True):
            bar.update(item[3])
            if skip is not None:
                refused.append(skip)
    shutil.rmtree(incoming, ignore_errors=True)
    return local, refused


_READ_WHOLE = 16 << 20
"""Source objects up to this size are read in one request that only the listed version answers (S3's If-Match)."""


def _download(fs: Any, path: str, shown: str, rel: str, file: Path, size: int, version: str) -> Skip | None:
    """Download the object ``path`` into ``file`` as listed (``size`` bytes at ``version``), or why ``rel`` is skipped.

    An object up to :data:`_READ_WHOLE` bytes is read as the Ray engine reads it
    (``_ListedObject``: on S3 only from the listed version); a larger one is
    streamed into ``file``, then its size and the version the store reports now
    are compared with the listing's. One rewritten since the listing is a skip
    (``changed``), one removed since too (``vanished``).

    Raises:
        SourceError: a request failed for good (the message shows the URL and the error's type only).
    """
    if size <= _READ_WHOLE:
        data = _ListedObject(fs, path, f"{shown}/{rel}", size, version).read(rel)
        if isinstance(data, Skip):
            return data
        file.write_bytes(data)
        return None
    try:
        retry_transient(partial(fs.get_file, path, os.fspath(file)))
        fs.invalidate_cache(path)
        now = object_version(retry_transient(partial(fs.info, path)))
    except FileNotFoundError:
        return Skip(rel, "vanished", "no such object: removed since the listing")
    except Exception as exc:
        raise remote_error(shown, f"cannot read {rel}; rerun to resume", exc) from exc
    if file.stat().st_size != size or (version and now != version):
        return Skip(rel, "changed", "its size or version is not the one listed: rewritten since the listing")
    return None


_DOWNLOADED = "downloaded.jsonl"
"""Beside a source's work folder: one line per object downloaded (name, size, version), appended once in place."""


def _remove_unlisted(local: Path, names: set[str]) -> None:
    """Remove from the work folder every file, link or empty folder that is not one of the listed ``names``."""
    for folder, dirs, files in os.walk(local, topdown=False):
        here = Path(folder)
        for name in files + [d for d in dirs if (here / d).is_symlink()]:
            if (here / name).relative_to(local).as_posix() not in names or (here / name).is_symlink():
                (here / name).unlink()
        if here != local and not any(here.iterdir()):
            here.rmdir()


COPIED_FROM: ContextVar[tuple[Path, str] | None] = ContextVar("packdata_copied_from", default=None)
"""The work folder a conversion reads and the URL of the source folder it was copied from (None: not a copy).

Set by :func:`~packdata.conversion.remote_convert.convert_from_url` around the
conversion of the work folder: its checkpoint records how much of the
download journal came before it packed (:func:`journal_mark`), and a resume
refuses a packed file copied again since at another size or version
(:func:`copied_again`).
"""


def journal_mark(folder: Path) -> tuple[int, str]:
    """The size and SHA-256 of the download journal beside the work folder ``folder`` (an empty one's if none)."""
    data = _read_downloaded(folder) or b""
    return len(data), hashlib.sha256(data).hexdigest()


def _read_downloaded(folder: Path) -> bytes | None:
    """The download journal beside the work folder ``folder`` (None: there is none), of at most a line per file
    there at its longest (see :func:`~packdata.conversion.replace.journal_most`).

    Raises:
        ConfigError: it is a link, FIFO, folder or another user's file, or longer (never read through or whole).
    """
    most = journal_most(files_under(folder))
    return read_own_bytes(
        folder.parent / _DOWNLOADED, hint=WORK_FILE_HINT, most=most, over_hint=OVERSIZED_WORK_FILE_HINT
    )


def copied_again(folder: Path, before: int, sha256: str | None) -> dict[str, str]:
    """The files of ``folder`` downloaded again since the journal held ``before`` bytes (of SHA-256 ``sha256``:
    None from an earlier packdata), as another object.

    Another object: one listed at another size or version than its last
    download before then (or not downloaded before then at all: the work
    folder was emptied, its journal with it). Name -> what differs, in words.
    An object downloaded again as it was (its copy removed, or a store that
    gives no version) is not among them.

    Raises:
        ConfigError: the journal is a link, a FIFO, a folder or another user's file, or longer than packdata writes
            it (never read through it, or whole).
        SourceError: the journal's first ``before`` bytes are not those measured (resumable: the partial is kept).
    """
    journal = folder.parent / _DOWNLOADED
    data = _read_downloaded(folder)
    if data is None:
        return {}
    if sha256 is not None and (before > len(data) or hashlib.sha256(data[:before]).hexdigest() != sha256):
        raise _another_journal(journal, len(data), before)
    if before > len(data):  # another journal (an earlier packdata's checkpoint has no SHA-256): none of it came before
        before = 0
    since = _journal_entries(data[before:], None)
    earlier = _journal_entries(data[:before], set(since))
    again = {}
    for name, (size, version) in since.items():
        then = earlier.get(name)
        if then is None:
            again[name] = "copied again, and no earlier copy is listed in the download journal"
        elif then[0] != size or then[1] != version:
            again[name] = f"{then[0]} bytes at version {then[1]!r} when packed, {size} bytes at {version!r} now"
    return again


def _another_journal(journal: Path, size: int, before: int) -> SourceError:
    """The refusal of a resume whose download journal is not the one measured before packing (``before`` bytes)."""
    held = f"fewer than the {before} it held" if before > size else f"its first {before} bytes not those"
    error = SourceError(
        f"is not the download journal the interrupted conversion packed from ({size} bytes, {held} then): "
        "which packed files were downloaded again since, as other objects, cannot be told",
        path=journal,
        hint="It was cut, edited or removed with its work folder since: start again with overwrite=True",
    )
    error.resumable = True  # the partial is kept
    return error


def _journal_entries(data: bytes, names: set[str] | None) -> dict[str, tuple[int, str]]:
    """The last (size, version) a journal's ``data`` lists of each name (of ``names`` only, unless None)."""
    entries: dict[str, tuple[int, str]] = {}
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            entry = json.loads(line)
            name = str(entry["name"])
            if names is None or name in names:
                entries[name] = (entry["size"], entry["version"])
        except (ValueError, KeyError, TypeError):  # a torn or odd line counts for nothing
            continue
    return entries
