"""A conversion into a URL or from one: packed in a local work folder, then uploaded; or copied down, then packed.

Into a URL, the local engine packs into a work folder (:func:`~packdata.conversion.upload.work_folder`),
uploading shards as they close and the rest after them, the manifest last; on the
Ray engine each task uploads its own shard (:mod:`packdata.conversion.ray_remote`).
A source folder at a URL is first copied into a local work folder
(:func:`~packdata.conversion.download.download_source`), then converted.
:func:`packdata.conversion.convert.convert` sends both here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from packdata.conversion.destination import partial_path
from packdata.conversion.download import COPIED_FROM, download_source
from packdata.conversion.publish import ConvertResult
from packdata.conversion.scan import REFUSED_OBJECTS
from packdata.conversion.upload import (
    ShardUploader,
    check_remote_destination,
    check_writable,
    clean_work_folder,
    end_remote_pack,
    upload_pack,
    work_folder,
)
from packdata.conversion.upload_journal import check_job, record_job
from packdata.errors import CapacityError, ConfigError
from packdata.formats import FORMATS, format_from_path
from packdata.host.disks import filesystem_named
from packdata.pack.lock import hold_lock
from packdata.pack.urls import display_url

__all__ = ["UPLOAD_TO", "convert_from_url", "convert_to_url"]


def convert_to_url(src: str | os.PathLike, url: str, options: dict[str, Any]) -> ConvertResult:
    """Convert into a local work folder, uploading shards as they close, then the rest (manifest last).

    On the Ray engine the work folder holds only the driver's pieces: each
    task uploads its own shard (:mod:`packdata.conversion.ray_remote`).
    """
    if options["append"]:
        raise ConfigError("a URL destination takes a new pack", hint="Append locally, then upload")
    if options["engine"] == "ray":
        return _convert_to_url_on_ray(src, url, options)
    storage, local, kwargs = _into_url(url, options)
    with _hold_work_folder(local, url):
        return _pack_and_upload(src, url, options, storage, local, kwargs)


def _hold_work_folder(local: Path, url: str) -> contextlib.AbstractContextManager[Path]:
    """The lock of a conversion into ``url`` on this machine: held from the first check to the manifest's upload."""
    return hold_lock(local.parent / ".upload.lock", what="packdata convert into a URL", target=display_url(url))


def _pack_and_upload(
    src: str | os.PathLike,
    url: str,
    options: dict[str, Any],
    storage: dict[str, Any] | None,
    local: Path,
    kwargs: dict[str, Any],
) -> ConvertResult:
    """The local engine's conversion into ``url``, its work folder ``local`` held (see :func:`convert_to_url`)."""
    from packdata.conversion.convert import _result_of, convert  # the entry, which imports this module

    resume_of = local if options["resume"] else None  # a pack this work folder published: its resume finishes it
    # again, held: another may have published
    found = check_remote_destination(url, storage, overwrite=options["overwrite"], resume_of=resume_of)
    if local.exists() and not options["resume"]:
        shutil.rmtree(local)  # packed by an earlier run that was not resumed: pack again
    end_remote_pack(url, storage, work=local, found=found)  # the old pack ends before its files are replaced
    early: dict[str, int] = {}
    if local.exists():  # packed before an interruption, from this source with these options: upload it
        check_job(local, src, kwargs, url)
        result = _result_of(local, float(options["started"]))
    else:  # pack (resuming a partial conversion), shards going up as they close
        record_job(local, src, kwargs)
        try:
            with ShardUploader(partial_path(local), url, storage, exclusive=not found.overwrite) as uploader:
                result = convert(src, local, **kwargs)
        except CapacityError as exc:  # the work folder's disk, which the user never named
            raise CapacityError(
                f"no space left on {filesystem_named(local.parent)} while packing for {display_url(url)} "
                "in this work folder",
                path=local,
                hint="Free space there and run again with resume=True, "
                "or set PACKDATA_TMP to a disk with room and run again",
            ) from exc
        early = uploader.uploaded
    upload_pack(  # acts on what the check found: the manifest is not read again
        local,
        url,
        storage_options=storage,
        workers=options["workers"],
        progress=options["progress"],
        early=early,
        found=found,
    )
    clean_work_folder(local)
    result.pack = display_url(url)
    return result


def _into_url(url: str, options: dict[str, Any]) -> tuple[dict[str, Any] | None, Path, dict[str, Any]]:
    """Check that ``url`` may take the pack; its storage options, local work folder and convert options."""
    from packdata.conversion.convert import _CONVERT_OPTIONS  # the entry, which imports this module

    storage = options["storage_options"]
    # a resume's destination is checked once its work folder is held: the pack there may be the one it publishes
    check_remote_destination(url, storage, overwrite=options["overwrite"] or options["resume"])
    check_writable(url, storage)  # a missing bucket is named now, not after the packing
    local = work_folder(url)
    local.parent.mkdir(parents=True, exist_ok=True)
    kwargs = {k: v for k, v in options.items() if k in _CONVERT_OPTIONS}
    # overwrite (the URL's pack) also starts over an interrupted conversion in the work folder, unless resumed
    kwargs["overwrite"] = options["overwrite"] and not options["resume"]
    kwargs["format"] = options["format"] or format_from_path(url) or FORMATS[0]
    return storage, local, kwargs


def _convert_to_url_on_ray(src: str | os.PathLike, url: str, options: dict[str, Any]) -> ConvertResult:
    """Convert on Ray into ``url``: tasks upload their shards, the driver the index, skip report and manifest."""
    from packdata.conversion.convert import convert  # the entry, which imports this module
    from packdata.conversion.ray_remote import RemoteTarget

    storage, local, kwargs = _into_url(url, options)
    with _hold_work_folder(local, url):
        resume_of = partial_path(local) if options["resume"] else None  # the plan's pack, which it may have published
        found = check_remote_destination(url, storage, overwrite=options["overwrite"], resume_of=resume_of)  # held
        end_remote_pack(url, storage, work=local, found=found)  # the old pack ends before its files go
        token = UPLOAD_TO.set((local, RemoteTarget(url, storage, found)))  # the upload acts on what was found
        try:
            result = convert(src, local, **kwargs)
        finally:
            UPLOAD_TO.reset(token)
        clean_work_folder(local)
    result.pack = display_url(url)
    return result


UPLOAD_TO: ContextVar[tuple[Path, Any]] = ContextVar("packdata_ray_upload_to", default=(Path(), None))
"""The work folder of a Ray conversion into a URL, and its ``RemoteTarget``.

Set by :func:`_convert_to_url_on_ray` around the conversion into that folder,
so the Ray engine converting into it uploads to the URL instead of publishing.
"""


def convert_from_url(url: str, dst: str | os.PathLike, options: dict[str, Any]) -> ConvertResult:
    """Copy a source folder from object storage into a local work folder, then convert that."""
    from packdata.conversion.convert import _CONVERT_OPTIONS, convert  # the entry, which imports this module

    if options["engine"] != "local":
        raise ConfigError("a source folder at a URL is converted by the local engine", hint="Pass engine='local'")
    local, refused = download_source(
        url, options["storage_options"], workers=options["workers"], progress=options["progress"]
    )
    kwargs = {k: v for k, v in options.items() if k in _CONVERT_OPTIONS}
    token = REFUSED_OBJECTS.set((local, tuple(refused)))
    copied = COPIED_FROM.set((local, display_url(url).rstrip("/")))
    try:
        result = convert(local, dst, **kwargs)
    finally:
        COPIED_FROM.reset(copied)
        REFUSED_OBJECTS.reset(token)
    clean_work_folder(local)
    return result
