"""The destination of a conversion into a URL: checked once, and the steps after act on what the check found.

:func:`check_remote_destination` looks at the URL's manifest (read only for a
resume, to tell a pack its work folder published) and returns a
:class:`Destination`; :func:`end_remote_pack` and
:func:`~packdata.conversion.upload.upload_pack` act on that answer instead of
reading the manifest again, so a manifest replaced by a stranger between the
check and the publish is refused, never removed or overwritten.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from packdata.conversion.replace import record_replaced
from packdata.errors import ConfigError, PackdataError, SourceError
from packdata.pack.files import read_regular
from packdata.pack.manifest import MANIFEST_NAME
from packdata.pack.manifest.schema import MAX_MANIFEST_BYTES
from packdata.pack.urls import (
    display_url,
    manifest_kept,
    object_version,
    open_url,
    remote_error,
    remove_at_version,
    retry_transient,
)

__all__ = [
    "Destination",
    "changed_since",
    "check_remote_destination",
    "check_writable",
    "end_remote_pack",
    "manifest_version",
    "published_from",
]


@dataclass(frozen=True)
class Destination:
    """What :func:`check_remote_destination` found at a URL: the decision the later steps act on, never read again.

    ``version``: the manifest's (its ETag, or what the store gives), None when none was there;
    ``ours``: it is the one the work folder a resume finishes published;
    ``overwrite``: the conversion was asked to replace what is there (objects of the pack's names included).
    """

    version: str | None
    ours: bool = False
    overwrite: bool = False


def check_remote_destination(
    url: str, storage_options: dict[str, Any] | None, *, overwrite: bool, resume_of: Path | None = None
) -> Destination:
    """Refuse a URL that already holds a pack, unless ``overwrite``, or ``resume_of`` (the work pack a resume
    finishes) published it: a publish that failed after the manifest went up (see :func:`published_from`).

    Returns what was found, for :func:`end_remote_pack` and :func:`upload_pack` to act on (the manifest is
    read once, and only for a resume).

    Raises:
        ConfigError: a manifest is there and ``overwrite`` is off, or the
            URL's path has ``.`` or ``..`` parts (object stores keep them as
            names, so the pack would not be where the URL seems to say).
    """
    fs, root = open_url(url, storage_options)
    if any(part in (".", "..") for part in root.split("/")):
        raise ConfigError(
            f"{display_url(url)}: a destination URL's path cannot have '.' or '..' parts",
            hint="Name the pack's folder plainly, e.g. s3://bucket/packs/train",
        )
    try:
        version = manifest_version(fs, f"{root.rstrip('/')}/{MANIFEST_NAME}")
    except Exception as exc:
        raise remote_error(display_url(url), "cannot reach the destination", exc) from exc
    ours = version is not None and published_from(fs, root, display_url(url), resume_of)
    if version is not None and not overwrite and not ours:
        raise ConfigError(
            f"{display_url(url)}: a pack already exists there",
            hint="Pass overwrite=True to replace it, or choose another URL",
        )
    return Destination(version, ours, overwrite)


def check_writable(url: str, storage_options: dict[str, Any] | None) -> None:
    """Write one empty object into ``url`` and remove it, so a destination that takes no pack is named before any work.

    The object's name is this run's own (``.packdata-write-check-<random>``): no pack or stranger has it.

    Raises:
        SourceError: the write failed (no such bucket, access denied, an unreachable endpoint), or the removal did.
    """
    fs, root = open_url(url, storage_options)
    shown = display_url(url)
    probe = f"{root.rstrip('/')}/{_WRITE_CHECK}{uuid.uuid4().hex}"
    try:
        fs.pipe_file(probe, b"")
    except FileNotFoundError as exc:
        raise SourceError(
            f"{shown}: cannot write there: its bucket does not exist ({type(exc).__name__})",
            hint="Create the bucket, or check the URL and the endpoint",
        ) from exc
    except Exception as exc:
        raise remote_error(shown, "cannot write there, so nothing was converted", exc) from exc
    try:
        fs.rm_file(probe)
    except Exception as exc:
        raise remote_error(shown, f"cannot remove {probe.rsplit('/', 1)[-1]}, written to check access", exc) from exc


_WRITE_CHECK = ".packdata-write-check-"


def end_remote_pack(
    url: str,
    storage_options: dict[str, Any] | None,
    work: Path | None = None,
    *,
    resume_of: Path | None = None,
    found: Destination | None = None,
) -> None:
    """Delete the manifest at ``url``: the pack there ends, before any of its files is replaced.

    With ``work`` (the conversion's work folder), its objects are recorded
    first, beside it, for :func:`upload_pack` to remove those the new pack
    does not have (:mod:`packdata.conversion.replace`). A pack that ``resume_of``
    (the work pack a resume finishes) published is kept (see :func:`published_from`).
    With ``found`` (:func:`check_remote_destination`'s answer), that decision is acted on instead: a pack
    published from the work folder is kept unread, and a manifest other than the one found is never removed.

    Raises:
        ConfigError: with ``found``, the manifest there is not the one found (another conversion published since).
    """
    fs, root = open_url(url, storage_options)
    root = root.rstrip("/")
    manifest = f"{root}/{MANIFEST_NAME}"
    try:
        if found is not None:
            if not found.ours:
                _end_found(fs, root, display_url(url), work, found)
        elif _manifest_there(fs, manifest) and not published_from(fs, root, display_url(url), resume_of):
            if work is not None:
                record_replaced(fs, root, display_url(url), work)
            retry_transient(partial(fs.rm_file, manifest))
    except PackdataError:
        raise
    except Exception as exc:
        raise remote_error(display_url(url), "cannot remove the old manifest", exc) from exc


def _end_found(fs: Any, root: str, shown: str, work: Path | None, found: Destination) -> None:
    """Remove the manifest :func:`check_remote_destination` found (its pack's objects recorded beside ``work``),
    only while it is that one (S3: ``If-Match``); where none was found, none may be there now."""
    manifest = f"{root}/{MANIFEST_NAME}"
    if found.version is None:
        if manifest_version(fs, manifest) is not None:
            raise changed_since(shown)
        return
    if work is not None:
        record_replaced(fs, root, shown, work)
    if not retry_transient(partial(remove_at_version, fs, manifest, found.version)):
        raise changed_since(shown)


def changed_since(shown: str) -> ConfigError:
    """The refusal of a destination whose manifest is no longer the one its check found."""
    return ConfigError(
        f"{shown}: the manifest there changed since this conversion checked the destination "
        "(another conversion published there?): it was not overwritten",
        hint="Run again to check it anew (with resume=True, nothing packed is lost); pass overwrite=True to replace it",
    )


def manifest_version(fs: Any, manifest: str) -> str | None:
    """The version of ``manifest`` asked of the store now (see :func:`_manifest_there`), None when it is missing."""
    fs.invalidate_cache(manifest)
    try:
        return object_version(retry_transient(partial(fs.info, manifest)))
    except FileNotFoundError:
        return None


def published_from(fs: Any, root: str, shown: str, local: Path | None) -> bool:
    """Whether the pack at ``root`` is the one in the work folder ``local``: its manifest has the bytes of ``local``'s.

    A publish that failed once that manifest was up (an object of the pack it replaced could not be removed) left
    it published: its resume keeps it, uploads nothing and removes the rest (:func:`upload_pack`). False when
    ``local`` is None or holds no manifest (not packed yet).

    Raises:
        SourceError: the manifest at ``root`` could not be read.
    """
    if local is None:
        return False
    try:
        raw = read_regular(local / MANIFEST_NAME, MAX_MANIFEST_BYTES, follow_symlinks=False)
    except OSError:  # missing, a link, not a regular file: no pack of this work folder's
        return False
    return len(raw) <= MAX_MANIFEST_BYTES and manifest_kept(fs, root.rstrip("/"), raw, shown)


def _manifest_there(fs: Any, manifest: str) -> bool:
    """Whether ``manifest`` exists now: asked of the store, not of a listing this process cached earlier.

    fsspec keeps one filesystem per URL and options, with its listings, for the
    whole process: one made before another process uploaded a pack there would
    say no pack is there, and the old pack would not end before its files are replaced.
    """
    fs.invalidate_cache(manifest)
    return bool(retry_transient(partial(fs.exists, manifest)))
