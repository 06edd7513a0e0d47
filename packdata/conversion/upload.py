"""Convert into object storage: pack locally, shards uploaded as they close, the manifest last.

A source folder at a URL is first copied into a local work folder
(:mod:`packdata.conversion.download`).

``convert(src, "s3://bucket/train.lmdb")`` converts into a local work folder
(``$PACKDATA_TMP`` or the system's temporary folder, one per destination URL,
so ``resume=True`` continues an interrupted conversion there). While it packs,
a :class:`ShardUploader` uploads each shard the conversion's checkpoint lists as
closed (under the name it has in the work folder; a TFRecord shard's final
``-of-N`` name is known only at the end, so it is moved on the store then).
When the pack is complete, :func:`upload_pack` uploads what is not there yet,
in parallel, and ``manifest.json`` last: a pack in object storage exists when
its manifest does, so a reader never opens a half upload.
A journal beside the work folder (``uploaded.jsonl``) records each object
this conversion uploaded: its size, SHA-256, MD5 and the version (ETag) the
store reported after the upload. A resumed upload skips an object only when
the journal has it for the local file's bytes and the store still reports
that size and version; anything else (an older pack's object of the same
size, say) is uploaded again. With ``overwrite`` the old manifest is deleted
first (the old pack ceases to exist before any of its files is replaced).
Objects the journal holds that the finished pack does not have (an earlier,
unfinished run's) are removed before the manifest goes up, each only while the
store still reports it as the journal recorded it.
A resume uploads a pack finished in the work folder only for the source and
options it was packed with (``job.json`` beside the work folder). Both records are
kept by :mod:`packdata.conversion.upload_journal`.
The destination is checked once (:mod:`packdata.conversion.url_destination`): the
old pack is ended and the new manifest put on what that check found, so a manifest a
stranger put there since is refused, never removed or overwritten: on S3 exactly (the
manifest's PUT carries ``If-None-Match: *``), elsewhere up to the moment between a
last look and the PUT. Without ``overwrite``, every file goes up the same way unless the
journal holds the object there (:meth:`UploadJournal.put`): a stranger's pack uploading at
the URL meanwhile keeps its objects, and the conversion is refused. Written plainly still:
with ``overwrite``, objects under the new pack's names; a TFRecord shard's early upload
moved to its ``-of-N`` name (a copy on the store); a Ray task's shard uploads.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from packdata.conversion.checkpoint import closed_shard_names
from packdata.conversion.replace import remove_replaced
from packdata.conversion.upload_journal import UploadJournal, object_matches
from packdata.conversion.url_destination import (
    Destination,
    changed_since,
    check_remote_destination,
    check_writable,
    end_remote_pack,
    manifest_version,
    published_from,
)
from packdata.errors import ConfigError, PackdataError, PackFormatError
from packdata.formats import shard_writer
from packdata.formats.remote_pack import pack_objects
from packdata.pack.files import (
    PROGRESS_FILE,
    RAY_PLAN_FILE,
    private_folder,
    private_temp_folder,
)
from packdata.pack.manifest import MANIFEST_NAME, plain_name_problem, read_manifest
from packdata.pack.urls import (
    display_url,
    local_name,
    manifest_kept,
    open_url,
    put_new,
    remote_error,
    remove_at_version,
    retry_transient,
    url_place,
)
from packdata.progress import progress as show_progress

__all__ = [
    "Destination",
    "ShardUploader",
    "check_remote_destination",
    "check_writable",
    "clean_work_folder",
    "end_remote_pack",
    "upload_pack",
    "work_folder",
]


_PRIVATE_HINT = "Remove it if it is not yours, or set PACKDATA_TMP to a folder of your own"


def work_folder(url: str, *, kind: str = "") -> Path:
    """The local folder a conversion into ``url`` packs into (stable per URL, so a resume finds it).

    One per place (:func:`~packdata.pack.urls.url_place`: URLs that differ in their user part only have
    a folder each, its name a hash); ``kind`` (``"source"``: a source folder's copy) keeps apart other uses.
    """
    chosen = os.environ.get("PACKDATA_TMP")
    base = (
        private_folder(Path(chosen) / "packdata-upload", hint=_PRIVATE_HINT)
        if chosen
        else private_temp_folder("packdata-upload", hint=_PRIVATE_HINT)
    )
    place = f"{kind}:{url_place(url)}" if kind else url_place(url)
    tag = hashlib.sha256(place.encode("utf-8")).hexdigest()[:16]
    return base / tag / local_name(display_url(url))  # never the tag folder or above it


class ShardUploader:
    """Uploads, in the background, the shards a conversion into ``partial`` has closed.

    A thread reads the conversion's checkpoint (``progress.json``) every
    :attr:`PERIOD` seconds and uploads the files of every shard listed there as
    closed, under their names in the work folder, ``workers`` at a time (a
    shard named by a path out of the work pack is ignored). It is only a head
    start: a failed or interrupted upload is left for
    :func:`upload_pack`, which checks every object before the manifest goes
    up. An object counts as uploaded when the journal says this conversion
    uploaded it (see :class:`UploadJournal`). A checkpoint replaced by a link,
    FIFO, device or huge file stops the watching, and is raised when the
    conversion ends (it cannot stop the conversion's thread).
    """

    PERIOD = 1.0
    """Seconds between two looks at the checkpoint."""

    def __init__(
        self,
        partial: Path,
        url: str,
        storage_options: dict[str, Any] | None,
        *,
        workers: int = 4,
        exclusive: bool = False,
    ) -> None:
        self.partial = partial
        self.exclusive = exclusive  # an object there that this conversion did not upload is kept (UploadJournal.put)
        self.fs, root = open_url(url, storage_options)
        self.root = root.rstrip("/")
        self.uploaded: dict[str, int] = {}  # path relative to the pack -> bytes, uploaded or found there
        self.journal = UploadJournal(partial.parent)
        self._seen: set[str] = set()
        self.refused: PackFormatError | None = None  # the watcher's refusal of the checkpoint, raised at the end
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="packdata-upload-early")
        self._thread = threading.Thread(target=self._watch, name="packdata-upload-watch", daemon=True)

    def __enter__(self) -> ShardUploader:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        """Stop watching, wait for the uploads under way; raise the watcher's refusal if the conversion ended well.

        Raises:
            PackFormatError: the checkpoint was replaced by a link, FIFO, device or huge file while the
                conversion ran (see :func:`~packdata.conversion.checkpoint.closed_shard_names`).
        """
        self._stop.set()
        self._thread.join()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self.refused is not None and kind is None:
            raise self.refused

    def _watch(self) -> None:
        while not self._stop.wait(self.PERIOD):
            try:
                new = self._closed_shard_files()
            except PackFormatError as exc:  # the conversion goes on; its end raises this
                self.refused = exc
                return
            for path in new:
                self._pool.submit(self._put, path)

    def _closed_shard_files(self) -> list[Path]:
        new = []
        for name in closed_shard_names(self.partial / PROGRESS_FILE):
            if plain_name_problem(name) is not None or name in self._seen:
                continue  # a shard is a plain name in the work pack: never a path out of it
            self._seen.add(name)
            top = self.partial / name
            try:
                new.extend(sorted(p for p in top.rglob("*") if p.is_file()) if top.is_dir() else [top])
                new.extend(p for p in sorted(self.partial.glob(f"{Path(name).stem}.*")) if p != top and p.is_file())
            except OSError:  # the folder moved on (renamed at the end, or removed): upload_pack sends it
                continue
        return new

    def _put(self, path: Path) -> None:
        rel = path.relative_to(self.partial).as_posix()
        target = f"{self.root}/{rel}"
        try:
            size = path.stat().st_size
            if self.journal.holds(self.fs, target, rel, path) or self.journal.put(
                self.fs, path, target, rel, exclusive=self.exclusive
            ):
                self.uploaded[rel] = size  # else another's object is there: upload_pack refuses it
        except Exception:  # a head start only: upload_pack uploads, and reports, what failed here
            return


def upload_pack(
    local: Path,
    url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    workers: int | None = None,
    progress: bool = True,
    early: dict[str, int] | None = None,
    found: Destination | None = None,
) -> int:
    """Upload the pack at ``local`` to ``url``, the manifest last; returns the bytes uploaded.

    ``early``: files a :class:`ShardUploader` uploaded while the pack was written
    (path in the work folder -> size); one whose name changed when the pack was
    finished (a TFRecord shard's ``-of-N`` name) is moved on the store, and
    objects under names the pack no longer has are removed. Any other file is
    skipped only when the journal beside ``local`` holds it (see
    :class:`UploadJournal`).

    ``found``: what :func:`check_remote_destination` found, once :func:`end_remote_pack` acted on it: the
    manifest is not read again; a pack published from ``local`` is kept only while its manifest is the one
    found. The new manifest goes up only where none is there: exactly on S3 (a PUT with ``If-None-Match: *``),
    elsewhere looked up just before the PUT (see :func:`_put_manifest`).

    Raises:
        PackFormatError: an upload failed (rerun with resume to continue).
        ConfigError: the manifest at ``url`` is not the one found, or one is there when this one goes up
            (another conversion published).
    """
    fs, root = open_url(url, storage_options)
    root = root.rstrip("/")
    shown = display_url(url)
    manifest = f"{root}/{MANIFEST_NAME}"
    if found is not None and found.ours and _still(fs, manifest, shown, found.version):
        _remove_replaced(fs, root, shown, local)  # published before a later step failed: only the removal is left
        return 0
    if found is None and published_from(fs, root, shown, local):
        _remove_replaced(fs, root, shown, local)
        return 0
    if found is None:
        end_remote_pack(url, storage_options, work=local)
    unsent = (local / MANIFEST_NAME, local / RAY_PLAN_FILE)  # the manifest goes last; a Ray plan, never
    files = sorted(p for p in local.rglob("*") if p.is_file() and p not in unsent and p.name != MANIFEST_NAME)
    early = dict(early or {})
    journal = UploadJournal(local.parent)
    _move_renamed(fs, root, local, files, early, journal)
    try:
        todo = [
            p
            for p in files
            if early.get(rel := p.relative_to(local).as_posix()) != p.stat().st_size
            and not retry_transient(partial(journal.holds, fs, f"{root}/{rel}", rel, p))
        ]
    except Exception as exc:
        raise remote_error(shown, "cannot look up the files uploaded before", exc, resumable=True) from exc
    total = sum(p.stat().st_size for p in todo)

    exclusive = found is not None and not found.overwrite  # nothing there that this conversion did not put

    def put(path: Path) -> int:
        rel = path.relative_to(local).as_posix()
        try:
            there = retry_transient(partial(journal.put, fs, path, f"{root}/{rel}", rel, exclusive=exclusive))
        except Exception as exc:
            raise _upload_error(shown, rel, exc) from exc
        if not there:
            raise ConfigError(
                f"{shown}: {rel} is there, and this conversion did not upload it (another conversion uploading "
                "there now?): it was not overwritten",
                hint="Choose another URL, or pass overwrite=True to replace what is there (with resume=True, "
                "nothing packed is lost)",
            )
        return path.stat().st_size

    with (
        show_progress(desc="upload", unit="B", total=total, disable=not progress) as bar,
        ThreadPoolExecutor(max_workers=workers or 16, thread_name_prefix="packdata-upload") as pool,
    ):
        for done in pool.map(put, todo):
            bar.update(done)
    _remove_strays(fs, root, shown, local, files, journal)
    _put_manifest(fs, root, shown, local)  # the pack exists from here
    _remove_replaced(fs, root, shown, local)
    return total


def _still(fs: Any, manifest: str, shown: str, version: str | None) -> bool:
    """True if ``manifest`` is at ``version`` (None: missing) now, asked of the store.

    Raises:
        ConfigError: it is not (see :func:`~packdata.conversion.url_destination.changed_since`).
    """
    try:
        now = manifest_version(fs, manifest)
    except Exception as exc:
        raise remote_error(shown, f"cannot look up {MANIFEST_NAME}", exc, resumable=True) from exc
    if now != version:
        raise changed_since(shown)
    return True


def _put_manifest(fs: Any, root: str, shown: str, local: Path) -> None:
    """Put ``local``'s manifest at ``root`` only where none is there (the old one ended by :func:`end_remote_pack`).

    On S3 the PUT carries ``If-None-Match: *``: a manifest a stranger put there at any moment before is kept,
    exactly; elsewhere it is looked up first, and one put between that look and the PUT is overwritten
    (:func:`~packdata.pack.urls.put_new`). A manifest found there with this one's bytes is this PUT's, its reply
    lost and the PUT tried again.

    Raises:
        ConfigError: another manifest is there (:func:`~packdata.conversion.url_destination.changed_since`).
        PackFormatError: the upload failed.
    """
    path = local / MANIFEST_NAME
    try:
        put = retry_transient(partial(put_new, fs, os.fspath(path), f"{root}/{MANIFEST_NAME}"))
        if not put and not manifest_kept(fs, root, path.read_bytes(), shown):
            raise changed_since(shown)
    except PackdataError:
        raise
    except Exception as exc:
        raise _upload_error(shown, MANIFEST_NAME, exc) from exc


def _remove_replaced(fs: Any, root: str, shown: str, local: Path) -> None:
    """Remove the objects of the pack that the one published from ``local`` replaced, but the new pack's own (its
    files and its manifest's objects: a Ray task's shards too); see :mod:`packdata.conversion.replace`."""
    keep = {p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()}
    remove_replaced(fs, root, shown, local, keep | set(pack_objects(read_manifest(local))) | {MANIFEST_NAME})


def _upload_error(shown: str, rel: str, exc: BaseException) -> PackFormatError:
    """One line for a failed upload of ``rel``: the URL (no credentials) and the error's type only."""
    return PackFormatError(
        f"{shown}: uploading {rel} failed ({type(exc).__name__})",
        hint="Run again with resume=True: uploaded files are kept",
    )


def _move_renamed(
    fs: Any, root: str, local: Path, files: list[Path], early: dict[str, int], journal: UploadJournal
) -> None:
    """Move early uploads of files renamed when the pack was finished to their final names.

    The shard numbered ``i`` was written as ``shard_name(i)`` and is now the
    manifest's ``shards[i].file``; its companions share its stem. An early
    object whose final file has the bytes the journal recorded for it is moved
    (a copy on the store) and journaled under its final name; one that matches
    no final file is removed. ``early`` is updated to the final names.
    """
    manifest = read_manifest(local)
    renamed = {
        Path(shard_writer(manifest.format).shard_name(i)).stem: Path(shard.file).stem
        for i, shard in enumerate(manifest.shards)
    }
    present = {p.relative_to(local).as_posix() for p in files}
    for rel, size in sorted(early.items()):
        if rel in present:
            continue
        stem, dot, rest = rel.partition(".")
        final = f"{renamed[stem]}{dot}{rest}" if stem in renamed else None
        try:
            if final in present and final not in early and journal.same_bytes(rel, local / final):
                retry_transient(partial(fs.mv, f"{root}/{rel}", f"{root}/{final}"))
                journal.record(fs, f"{root}/{final}", final, journal.entries[rel][:3])
                early[final] = size
            else:
                retry_transient(partial(fs.rm_file, f"{root}/{rel}"))
        except Exception as exc:
            raise remote_error(display_url(f"{root}"), f"cannot move or remove {rel}", exc) from exc
        del early[rel]


def _remove_strays(fs: Any, root: str, shown: str, local: Path, files: list[Path], journal: UploadJournal) -> None:
    """Remove the objects an earlier, unfinished run of this conversion uploaded that the pack no longer has.

    Only what the journal holds is looked at (objects this work folder's
    conversions uploaded), and an object is removed only while the store still
    reports the size and version the journal recorded after its upload: an
    object anyone wrote since, or that the journal does not name, is never
    touched. Names of the pack's files and shards (a shard's objects and
    companions, which a Ray task may have uploaded) are kept.

    Raises:
        SourceError: a request failed (rerun with resume).
    """
    shards = read_manifest(local).shards
    keep = {p.relative_to(local).as_posix() for p in files} | {MANIFEST_NAME}
    for rel, (size, _, md5, version) in sorted(journal.entries.items()):
        top = rel.split("/", 1)[0]
        if rel in keep or any(part in ("", ".", "..") for part in rel.split("/")):
            continue
        if any(top == shard.file or top.startswith(f"{Path(shard.file).stem}.") for shard in shards):
            continue
        try:
            fs.invalidate_cache(f"{root}/{rel}")
            if retry_transient(partial(object_matches, fs, f"{root}/{rel}", size, version, md5)):
                retry_transient(partial(remove_at_version, fs, f"{root}/{rel}", version))  # S3: If-Match
        except Exception as exc:
            raise remote_error(
                display_url(root), f"cannot remove {rel}, left by an earlier run", exc, resumable=True
            ) from exc


def clean_work_folder(local: Path) -> None:
    """Remove a work folder after a finished upload."""
    shutil.rmtree(local.parent, ignore_errors=True)
