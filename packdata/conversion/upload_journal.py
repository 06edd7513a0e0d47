"""What a conversion into a URL records beside its work folder: the objects it uploaded, and the job it packs.

``uploaded.jsonl`` (:class:`UploadJournal`) holds one line per object this
conversion uploaded: its size, SHA-256, MD5 and the version (ETag) the store
reported after the upload; only an object it holds, that the store still
reports with that size and version, counts as uploaded
(:mod:`packdata.conversion.upload`). ``job.json`` (:func:`record_job`,
:func:`check_job`) holds the source and options the waiting pack is converted
from, so a resume uploads it only for those.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

from packdata.conversion.replace import OVERSIZED_WORK_FILE_HINT, WORK_FILE_HINT, files_under, journal_most
from packdata.errors import ConfigError
from packdata.pack.files import atomic_write, file_sha256
from packdata.pack.own_files import append_own_file, read_own_file
from packdata.pack.urls import display_url, is_url, object_version, put_new

__all__ = ["UploadJournal", "check_job", "file_md5", "journal_task_objects", "object_matches", "record_job"]


class UploadJournal:
    """The objects a conversion into a URL uploaded: ``uploaded.jsonl`` in its work folder's parent.

    One line per object, appended once the store reports it: name, size,
    SHA-256 and MD5 of the local file, and the version (ETag) the store gave
    after the upload. Only this journal makes an object count as uploaded: an
    object found at the URL with the right size may be an older pack's (a
    multi-part object's ETag is no MD5 of its bytes, so nothing else tells).
    """

    def __init__(self, folder: Path) -> None:
        self.path = folder / _UPLOADED
        most = journal_most(files_under(folder))  # a line per file of the pack uploaded
        self.entries = _read_journal(self.path, ("size", "sha256", "md5", "version"), most)
        self._lock = threading.Lock()

    def put(self, fs: Any, path: Path, target: str, rel: str, *, exclusive: bool = False) -> bool:
        """Upload ``path`` to ``target`` and journal it as ``rel``; whether it is there now.

        ``exclusive``: an object at ``target`` that the journal does not hold as the store reports it now (an
        earlier run's upload) is kept, never overwritten: on S3 exactly, the PUT carrying ``If-None-Match: *``
        (see :func:`~packdata.pack.urls.put_new`), and False is returned; unless it holds ``path``'s bytes (a
        single-part object whose ETag is their MD5: this conversion's PUT whose journal line was lost), which is
        journaled as uploaded.
        """
        size, md5 = path.stat().st_size, file_md5(path)
        digests = [size, file_sha256(path), md5]
        entry = self.entries.get(rel)
        if not exclusive or (entry is not None and object_matches(fs, target, entry[0], entry[3], entry[2])):
            fs.put_file(os.fspath(path), target)
        elif not put_new(fs, os.fspath(path), target) and not _holds_bytes(fs, target, size, md5):
            return False
        self.record(fs, target, rel, digests)
        return True

    def record(self, fs: Any, target: str, rel: str, digests: list[Any]) -> None:
        """Journal ``target`` as ``rel``: ``[size, sha256, md5]``, with the version the store reports now."""
        fs.invalidate_cache(target)
        entry = [*digests, object_version(fs.info(target))]
        with self._lock:
            append_own_file(self.path, _journal_line(rel, *entry), hint=WORK_FILE_HINT)
            self.entries[rel] = entry

    def same_bytes(self, rel: str, path: Path) -> bool:
        """Whether the journal holds ``rel`` with the size and SHA-256 of the local file ``path``."""
        entry = self.entries.get(rel)
        return entry is not None and entry[0] == path.stat().st_size and entry[1] == file_sha256(path)

    def holds(self, fs: Any, target: str, rel: str, path: Path) -> bool:
        """Whether ``target`` is what this conversion uploaded from ``path``'s bytes, unchanged since."""
        entry = self.entries.get(rel)
        if entry is None or entry[0] != path.stat().st_size:
            return False
        fs.invalidate_cache(target)
        return object_matches(fs, target, entry[0], entry[3], entry[2]) and self.same_bytes(rel, path)


_UPLOADED = "uploaded.jsonl"
"""Beside a destination's work folder: one line per object uploaded (name, size, sha256, md5, version)."""


def _journal_line(rel: str, size: int, sha256: str, md5: str, version: str) -> str:
    return json.dumps({"name": rel, "size": size, "sha256": sha256, "md5": md5, "version": version}) + "\n"


def journal_task_objects(folder: Path, objects: dict[str, list[Any]]) -> None:
    """Journal in ``folder`` the objects a Ray task uploaded (``{name: [size, md5, version]}``).

    With no SHA-256: never taken for an upload of a local file, only removed
    if the finished pack does not have them (see :func:`upload_pack`).
    """
    lines = [_journal_line(rel, int(size), "", str(md5), str(version)) for rel, (size, md5, version) in objects.items()]
    append_own_file(folder / _UPLOADED, "".join(lines), hint=WORK_FILE_HINT)


def object_matches(fs: Any, target: str, size: int, version: str, md5: str) -> bool:
    """Whether the store still reports ``target`` as the object uploaded: ``size`` bytes and version ``version``.

    ``version`` is what the store reported right after the upload (see
    :func:`~packdata.pack.urls.object_version`): it changes
    whenever the object is written, so an older object of the same size (a
    multi-part one, whose ETag is no MD5) never passes; an empty one never
    matches. Where the ETag is a single-part upload's MD5, it must be ``md5``.
    """
    try:
        info = fs.info(target)
    except FileNotFoundError:
        return False
    found = object_version(info)
    if int(info.get("size", -1)) != size or not version or found != version:
        return False
    etag = found.strip('"')
    return len(etag) != 32 or any(c not in "0123456789abcdef" for c in etag) or etag == md5


def _holds_bytes(fs: Any, target: str, size: int, md5: str) -> bool:
    """Whether ``target`` is a single-part object of ``size`` bytes whose ETag is ``md5``: bytes of that MD5."""
    fs.invalidate_cache(target)
    try:
        info = fs.info(target)
    except FileNotFoundError:
        return False
    return int(info.get("size", -1)) == size and object_version(info).strip('"') == md5


def file_md5(path: Path) -> str:
    """The MD5 of a local file, hex (what a store reports as a single-part object's ETag)."""
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


_JOB = "job.json"
"""Beside a destination's work folder: the source and options its pack is converted from (no storage options)."""

_JOB_OPTIONS = (
    "format", "kind", "layout", "require", "path_column", "label_column", "on_error", "verify_images", "max_side",
    "quality", "shard_size", "shard_samples",
)  # fmt: skip


def _job(src: str | os.PathLike, options: dict[str, Any]) -> dict[str, Any]:
    where = os.fspath(src) if is_url(src) else os.path.abspath(src)
    return json.loads(json.dumps({"src": where, "options": {k: options.get(k) for k in _JOB_OPTIONS}}))


def record_job(local: Path, src: str | os.PathLike, options: dict[str, Any]) -> None:
    """Record beside the work folder ``local`` that its pack is converted from ``src`` with ``options``."""
    atomic_write(local.parent / _JOB, json.dumps(_job(src, options)).encode("utf-8"))


def check_job(local: Path, src: str | os.PathLike, options: dict[str, Any], url: str) -> None:
    """Refuse to upload the finished pack in ``local`` for another source or other options than it was packed with.

    Raises:
        ConfigError: the pack there is another conversion's (or its record is missing or damaged).
    """
    try:
        most = len(json.dumps(_job(src, options)))  # as record_job writes it: a longer one is another's
        text = read_own_file(local.parent / _JOB, hint=WORK_FILE_HINT, most=most, over_hint=OVERSIZED_WORK_FILE_HINT)
        saved = json.loads(text or "null")
    except (OSError, ValueError, RecursionError):
        saved = None
    if saved != _job(src, options):
        was = saved.get("src") if isinstance(saved, dict) else None
        raise ConfigError(
            f"{display_url(url)}: the pack waiting in the work folder to be uploaded was converted "
            + (f"from {was!r}, or with other options" if isinstance(was, str) else "by an unknown conversion"),
            hint="Resume with the same source and options, or run again without resume=True to convert again",
        )


def _read_journal(journal: Path, fields: tuple[str, ...], most: int) -> dict[str, list[Any]]:
    """The objects a journal of at most ``most`` bytes lists: name -> its ``fields``' values; a torn or odd line
    counts for nothing.

    Raises:
        ConfigError: it is a link, FIFO, folder or another user's file, or longer (never read through or whole).
    """
    done: dict[str, list[Any]] = {}
    text = read_own_file(journal, hint=WORK_FILE_HINT, most=most, over_hint=OVERSIZED_WORK_FILE_HINT)
    for line in (text or "").splitlines():
        try:
            entry = json.loads(line)
            done[str(entry["name"])] = [entry[key] for key in fields]
        except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: nested past Python's stack
            continue
    return done
