"""Convert into and from object storage: pack locally, then upload, the manifest last.

A source folder at a URL is first copied into a local work folder
(:func:`download_source`, parallel and resumable), then converted like a local
one; an object whose name would leave the work folder (``..``, ``.`` or empty
parts) is never written, and appears in the pack's skip report.


``convert(src, "s3://bucket/train.lmdb")`` converts into a local work folder
(``$PACKDATA_TMP`` or the system's temporary folder, one per destination URL,
so ``resume=True`` continues an interrupted conversion there), then uploads
every file of the pack in parallel and ``manifest.json`` last: a pack in object
storage exists when its manifest does, so a reader never opens a half upload.
An upload resumed after an interruption skips objects already there with the
local file's size and, where the store reports an MD5 (single-part uploads),
the same MD5. With ``overwrite`` the old manifest is deleted first (the old
pack ceases to exist before any of its files is replaced).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from packdata.conversion.sources import Skip
from packdata.errors import ConfigError, PackFormatError, SourceError
from packdata.pack.manifest import MANIFEST_NAME
from packdata.pack.urls import display_url, open_url, remote_error
from packdata.progress import progress as show_progress

__all__ = ["download_source", "upload_pack", "work_folder"]


def work_folder(url: str) -> Path:
    """The local folder a conversion into ``url`` packs into (stable per URL, so a resume finds it)."""
    base = Path(os.environ.get("PACKDATA_TMP") or tempfile.gettempdir()) / "packdata-upload"
    shown = display_url(url)
    tag = hashlib.sha256(shown.encode("utf-8")).hexdigest()[:16]
    return base / tag / (shown.rstrip("/").rsplit("/", 1)[-1] or "pack")


def check_remote_destination(url: str, storage_options: dict[str, Any] | None, *, overwrite: bool) -> None:
    """Refuse a URL that already holds a pack, unless ``overwrite``.

    Raises:
        ConfigError: a manifest is there and ``overwrite`` is off.
    """
    fs, root = open_url(url, storage_options)
    try:
        exists = fs.exists(f"{root.rstrip('/')}/{MANIFEST_NAME}")
    except Exception as exc:
        raise remote_error(display_url(url), "cannot reach the destination", exc) from exc
    if exists and not overwrite:
        raise ConfigError(
            f"{display_url(url)}: a pack already exists there",
            hint="Pass --overwrite to replace it, or choose another URL",
        )


def upload_pack(
    local: Path,
    url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    workers: int | None = None,
    progress: bool = True,
) -> int:
    """Upload the pack at ``local`` to ``url``, the manifest last; returns the bytes uploaded.

    Raises:
        PackFormatError: an upload failed (rerun with resume to continue).
    """
    fs, root = open_url(url, storage_options)
    root = root.rstrip("/")
    shown = display_url(url)
    manifest = f"{root}/{MANIFEST_NAME}"
    if fs.exists(manifest):
        fs.rm_file(manifest)  # the old pack ends here, before any of its files is replaced
    files = sorted(p for p in local.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    todo = [p for p in files if not _already_there(fs, f"{root}/{p.relative_to(local).as_posix()}", p)]
    total = sum(p.stat().st_size for p in todo)

    def put(path: Path) -> int:
        target = f"{root}/{path.relative_to(local).as_posix()}"
        try:
            fs.put_file(os.fspath(path), target)
        except Exception as exc:
            raise PackFormatError(
                f"{shown}: uploading {path.relative_to(local)} failed ({type(exc).__name__})",
                hint="Rerun with --resume: uploaded files are kept",
            ) from exc
        return path.stat().st_size

    with (
        show_progress(desc="upload", unit="B", total=total, disable=not progress) as bar,
        ThreadPoolExecutor(max_workers=workers or 16, thread_name_prefix="packdata-upload") as pool,
    ):
        for done in pool.map(put, todo):
            bar.update(done)
    fs.put_file(os.fspath(local / MANIFEST_NAME), manifest)  # the pack exists from here
    return total


def _already_there(fs: Any, target: str, path: Path) -> bool:
    """An object uploaded by an interrupted run: the same size and, when the store gives one, the same MD5."""
    try:
        info = fs.info(target)
    except FileNotFoundError:
        return False
    if int(info.get("size", -1)) != path.stat().st_size:
        return False
    etag = str(info.get("ETag", info.get("etag", ""))).strip('"')
    if len(etag) == 32 and all(c in "0123456789abcdef" for c in etag):
        digest = hashlib.md5(usedforsecurity=False)
        with open(path, "rb") as f:
            while block := f.read(8 << 20):
                digest.update(block)
        return digest.hexdigest() == etag
    return True


def clean_work_folder(local: Path) -> None:
    """Remove a work folder after a finished upload."""
    shutil.rmtree(local.parent, ignore_errors=True)


def download_source(
    url: str, storage_options: dict[str, Any] | None, *, workers: int | None, progress: bool
) -> tuple[Path, list[Skip]]:
    """Copy the source folder at ``url`` into a local work folder (resumable); return it and the objects refused.

    Files already there with the remote size are kept (a rerun continues). An
    object whose name has ``..``, ``.`` or empty parts (``a/../b``, ``a//b``,
    a leading ``/``) is not downloaded: it could land outside the folder or on
    another object's file. It is returned as a :class:`Skip` (sorted by name)
    for the conversion's skip report, never dropped silently.

    Raises:
        SourceError: the URL cannot be listed or holds no file.
    """
    fs, root = open_url(url, storage_options)
    root = root.rstrip("/")
    shown = display_url(url)
    try:
        listing = fs.find(root, detail=True)
    except Exception as exc:
        raise remote_error(shown, "cannot list the source", exc) from exc
    local = work_folder(f"source:{shown}")
    local.mkdir(parents=True, exist_ok=True)
    todo = []
    refused: list[Skip] = []
    for path, info in sorted(listing.items()):
        if info.get("type") == "directory" or path.rstrip("/") == root:
            continue
        rel = path[len(root) + 1 :] if path.startswith(f"{root}/") else path
        parts = rel.split("/")
        if any(p in ("", ".", "..") for p in parts):
            refused.append(Skip(rel, "unsafe name", "'..', '.' or empty parts would leave the work folder: not copied"))
            continue
        target = local.joinpath(*parts)
        size = int(info.get("size") or 0)
        if not (target.is_file() and target.stat().st_size == size):
            todo.append((path, target, size))
    if not listing:
        raise SourceError(f"{shown}: no files there", hint="Check the URL")

    def get(item: tuple[str, Path, int]) -> int:
        path, target, size = item
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.part")
        try:
            fs.get_file(path, os.fspath(tmp))
        except Exception as exc:
            raise remote_error(shown, f"cannot read {path[len(root) :].lstrip('/')}; rerun to resume", exc) from exc
        os.replace(tmp, target)
        return size

    with (
        show_progress(desc="download source", unit="B", total=sum(s for _, _, s in todo), disable=not progress) as bar,
        ThreadPoolExecutor(max_workers=workers or 16, thread_name_prefix="packdata-source") as pool,
    ):
        for done in pool.map(get, todo):
            bar.update(done)
    return local, refused
