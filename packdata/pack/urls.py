"""Packs in object storage: URLs through fsspec (``s3://``, ``gs://``, ``az://``, any fsspec protocol).

Credentials come the standard way (environment, profile files, or
``storage_options`` passed through to fsspec) and never appear in an error or a
log line: :func:`display_url` is what packdata prints of a URL.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from packdata.errors import ConfigError, PackFormatError, SourceError
from packdata.pack.manifest import MANIFEST_NAME, Manifest, read_manifest
from packdata.pack.manifest import schema as manifest_schema
from packdata.pack.ranges import check_range_length, check_range_reply
from packdata.pack.s3_models import share_models

__all__ = [
    "EXTRAS",
    "conditional_reads",
    "display_url",
    "is_transient",
    "is_url",
    "local_name",
    "manifest_kept",
    "object_version",
    "open_at_version",
    "open_url",
    "precondition_failed",
    "put_new",
    "range_not_satisfiable",
    "read_at_version",
    "read_url_manifest",
    "remote_error",
    "remote_object",
    "remote_size",
    "remove_at_version",
    "retry_transient",
    "store_digest",
    "url_place",
    "version_now",
]

EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}
"""URL scheme -> the packdata extra that installs its fsspec filesystem."""
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: object) -> bool:
    """Whether ``path`` is a URL of a remote filesystem (``file://`` and plain paths are local)."""
    return isinstance(path, str) and bool(_SCHEME.match(path)) and not path.lower().startswith("file://")


_CONTAINER_SCHEMES = frozenset({"abfs", "abfss", "az"})  # Azure's CONTAINER@account: a name, never a credential


def display_url(url: str) -> str:
    """``url`` without credentials or query (``s3://key:secret@bucket/x?token=...`` -> ``s3://bucket/x``).

    A user part is dropped (it may be a credential, a token alone included),
    but Azure's container (``abfs://CONTAINER@account/x``, no password) is kept:
    it names the pack there.
    """
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host += f":{parts.port}"
    if parts.scheme.lower() in _CONTAINER_SCHEMES and parts.username and parts.password is None:
        host = f"{parts.username}@{host}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def url_place(url: str) -> str:
    """What tells ``url``'s place apart: :func:`display_url` with the user part it drops (a user part may name
    another bucket or home: fsspec reads ``memory://alice@x/p`` at ``/alice@x/p``); hash it before writing it."""
    user = urlsplit(url).username
    shown = display_url(url)
    return f"{user}@{shown}" if user else shown


def user_digest(url: str) -> str:
    """A hash of ``url``'s user name, ``""`` without one: it tells apart URLs that :func:`display_url` shows alike.

    ``abfs://CONTAINER@account/x`` names the pack's container there, yet a user
    part may be a credential: only its hash is ever written (markers), never it.
    """
    user = urlsplit(url).username
    return hashlib.sha256(user.encode("utf-8")).hexdigest()[:16] if user else ""


# storage options that say who asks, never where: a rotated token must not make a staged copy another store's
_CREDENTIAL_OPTIONS = frozenset(
    {"key", "secret", "token", "password", "session_token", "sas_token", "account_key", "client_secret"}
    | {"aws_access_key_id", "aws_secret_access_key", "aws_session_token"}
)
# the environment that picks an S3 endpoint (botocore) when the storage options name none
_ENDPOINT_ENVIRONMENT = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_DEFAULT_PROFILE")


def store_digest(storage_options: dict[str, Any] | None) -> str:
    """A hash of where ``storage_options`` (and the environment) send a URL's requests: its endpoint, profile, ...

    Two stages whose digests differ may reach two stores holding the same path (two
    S3 endpoints), so one never looks up the other's origin. Credentials are left out
    (the same store with other keys holds the same objects); an option that is no
    JSON value counts by its ``repr``. Only the hash is written (markers), never an option.
    """

    def plain(options: dict[str, Any]) -> dict[str, Any]:
        return {
            str(k): plain(v) if isinstance(v, dict) else v for k, v in options.items() if k not in _CREDENTIAL_OPTIONS
        }

    where = {"options": plain(storage_options or {}), "env": {k: os.environ.get(k) for k in _ENDPOINT_ENVIRONMENT}}
    text = json.dumps(where, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def local_name(url: str) -> str:
    """The last part of ``url``'s path as one local folder name: ``"pack"`` when it has none (``""``, ``.``, ``..``).

    An object store keeps ``.`` and ``..`` as plain names, so ``s3://bucket/x/..`` is a
    pack of its own; a local folder so named would be the folder above.
    """
    name = url.rstrip("/").rsplit("/", 1)[-1]
    return name if name not in ("", ".", "..") else "pack"


def object_version(info: dict[str, Any]) -> str:
    """What a store says changes whenever an object is written: its ETag, else its modification time, else ``""``.

    A store that gives neither may give the object's creation time (fsspec's
    memory store, where every write makes a new object): that is taken last.
    """
    return str(
        info.get("ETag")
        or info.get("etag")
        or info.get("mtime")
        or info.get("LastModified")
        or info.get("created")
        or ""
    )


def remote_size(fs: Any, path: str, where: str) -> int | None:
    """The byte size of ``path`` on ``fs``, or None when there is no such object.

    Raises:
        PackFormatError: ``path`` is a folder (a prefix of other objects) or anything but a file.
        SourceError: the request failed.
    """
    found = remote_object(fs, path, where)
    return None if found is None else found[0]


def remote_object(fs: Any, path: str, where: str) -> tuple[int, str] | None:
    """``(byte size, version)`` of ``path`` on ``fs`` (the version: :func:`~packdata.pack.urls.object_version`,
    ``""`` where the store gives none), or None when there is no such object; raises as :func:`remote_size`."""
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return None
    except Exception as exc:
        raise remote_error(where, "cannot look the object up", exc) from exc
    kind = info.get("type", "file")
    if kind != "file":
        shown = "a folder (a prefix of other objects)" if kind == "directory" else f"of type {kind!r}"
        raise PackFormatError(f"is {shown}, not a file", path=where, hint="Upload or convert the pack again")
    return int(info["size"]), object_version(info)


def version_now(fs: Any, path: str, where: str | None = None) -> str:
    """The version (:func:`~packdata.pack.urls.object_version`) of ``path`` asked of the store now, not of a
    listing cached earlier (``""``: no such object, or the store gives none); ``where`` names it in errors."""
    fs.invalidate_cache(path)
    found = remote_object(fs, path, where or display_url(path))
    return "" if found is None else found[1]


def conditional_reads(fs: Any) -> bool:
    """Whether ``fs`` reads only from a given version (S3's ``If-Match``): s3fs."""
    protocol = getattr(fs, "protocol", ())
    return "s3" in ((protocol,) if isinstance(protocol, str) else protocol) and hasattr(fs, "_call_s3")


def read_at_version(
    fs: Any, path: str, version: str, start: int = 0, end: int | None = None, *, where: str | None = None
) -> bytes:
    """Bytes ``[start, end)`` of ``path`` (to its end when ``end`` is None); on S3, only from ``version`` (an ETag).

    On S3 with a ``version``, the request carries ``If-Match``: an object
    replaced since answers HTTP 412 (see :func:`precondition_failed`), at no
    extra request. Elsewhere, or without a version, the bytes are read as they are now.
    A ranged read's reply is checked (:mod:`packdata.pack.ranges`): on S3 its
    status and ``Content-Range``, elsewhere that it is no longer than asked for (which
    does not catch every reply that ignores ``Range``: see
    :func:`~packdata.pack.ranges.check_range_length`);
    ``where`` names the object in that error (default: its URL as ``fs`` names it).

    Raises:
        SourceError: the store answered other bytes than the range asked for
            (:func:`~packdata.pack.ranges.range_ignored` holds for it).
    """
    ranged = bool(start) or end is not None
    where = where or display_url(fs.unstrip_protocol(path))
    if not conditional_reads(fs) or not (version or ranged):
        data = bytes(fs.cat_file(path, start=start or None, end=end))
        if ranged:
            check_range_length(len(data), where, start, end)
        return data
    from fsspec.asyn import sync

    bucket, key, _ = fs.split_path(path)
    return bytes(sync(fs.loop, _s3_get, fs, bucket, key, version, where, start, end))


@contextlib.contextmanager
def open_at_version(fs: Any, path: str, looked: tuple[int, str] | None) -> Iterator[Any]:
    """``path`` open for ``read(n)``; with ``looked`` (its size and S3 ETag), read only at that version.

    Each read is a ranged request at that ETag (:func:`read_at_version`,
    retried while it fails transiently): an object rewritten since answers HTTP 412
    (:func:`precondition_failed`). Without ``looked``, the file as fsspec opens it.
    """
    if looked is None:
        with fs.open(path, "rb") as remote:
            yield remote
    else:
        yield _ReaderAt(fs, path, *looked)


class _ReaderAt:
    """``read(n)`` of an S3 object at one ETag, in ranged requests."""

    def __init__(self, fs: Any, path: str, size: int, version: str) -> None:
        self.fs, self.path, self.size, self.version, self.pos = fs, path, size, version, 0

    def read(self, n: int) -> bytes:
        end = min(self.pos + max(n, 0), self.size)
        if end <= self.pos:
            return b""
        data = retry_transient(partial(read_at_version, self.fs, self.path, self.version, self.pos, end))
        if len(data) != end - self.pos:
            raise EOFError(f"{len(data)} bytes read of {end - self.pos}")  # named as a failed read
        self.pos = end
        return data


async def _s3_get(fs: Any, bucket: str, key: str, etag: str, where: str, start: int, end: int | None) -> bytes:
    """One GET through s3fs (its credentials, endpoint and request options), with ``If-Match: etag`` when given;
    a ranged one's reply checked before its body is read (:func:`~packdata.pack.ranges.check_range_reply`)."""
    ranged = bool(start) or end is not None
    byte_range = {"Range": f"bytes={start}-{'' if end is None else end - 1}"} if ranged else {}
    condition = {"IfMatch": etag} if etag else {}
    response = await fs._call_s3("get_object", Bucket=bucket, Key=key, **condition, **byte_range)
    try:
        if ranged:
            check_range_reply(response, where, start, end)
        return await response["Body"].read()
    finally:
        response["Body"].close()


def remove_at_version(fs: Any, path: str, version: str) -> bool:
    """Remove ``path``, on S3 only while it is at ``version`` (an ETag the caller found); whether it was removed.

    On S3 the DELETE carries ``If-Match``: an object rewritten since the
    caller's look-up answers HTTP 412 and is kept (False), as is one gone
    (404). A store that refuses the header (HTTP 501 ``NotImplemented``, or 400
    ``InvalidArgument``/``InvalidRequest``) and any other store get a plain
    delete: there, an object written between the caller's look-up and the delete is removed.
    """
    if version and conditional_reads(fs):
        from fsspec.asyn import sync

        bucket, key, _ = fs.split_path(path)
        try:
            sync(fs.loop, fs._call_s3, "delete_object", Bucket=bucket, Key=key, IfMatch=version)
        except FileNotFoundError:
            return False
        except Exception as exc:
            if precondition_failed(exc) or _failed_with(exc, 404, "NoSuchKey"):
                return False
            if not _header_refused(exc):
                raise
        else:
            fs.invalidate_cache(path)
            return True
    fs.rm_file(path)
    return True


def put_new(fs: Any, lpath: str, path: str) -> bool:
    """Upload the local file ``lpath`` to ``path`` only where no object is there; whether it was put (False: one is).

    On S3 (s3fs) the write itself carries ``If-None-Match: *`` (s3fs's ``mode="create"``: on the PUT, or on the
    completion of a multi-part upload): an object written there at any moment before, however near, answers
    HTTP 412 and is kept as it was (False). A store that refuses the header (HTTP 501 ``NotImplemented``, or 400
    ``InvalidArgument``/``InvalidRequest``), an s3fs too old to send it, and any other store are asked first
    (a HEAD) and written plainly: there, an object written between the two is overwritten.
    """
    if conditional_reads(fs) and "mode" in inspect.signature(fs._put_file).parameters:
        try:
            fs.put_file(lpath, path, mode="create")
        except Exception as exc:
            if precondition_failed(exc):
                fs.invalidate_cache(path)
                return False
            if not _header_refused(exc):
                raise
        else:
            return True
    fs.invalidate_cache(path)
    if fs.exists(path):
        return False
    fs.put_file(lpath, path)
    return True


def _header_refused(exc: BaseException) -> bool:
    """Whether a store refused a request for a header it does not implement (conditional deletes, say)."""
    return any(
        _failed_with(exc, status, code)
        for status, code in ((501, "NotImplemented"), (400, "InvalidArgument"), (400, "InvalidRequest"))
    )


def precondition_failed(exc: BaseException) -> bool:
    """Whether a request failed with HTTP 412 (its ``If-Match`` no longer holds: the object was replaced)."""
    return _failed_with(exc, 412, "PreconditionFailed")


def range_not_satisfiable(exc: BaseException) -> bool:
    """Whether a request failed with HTTP 416: its range starts past the object's end (S3's answer to that)."""
    return _failed_with(exc, 416, "InvalidRange")


def _failed_with(exc: BaseException, status: int, code: str) -> bool:
    for error in (exc, exc.__cause__):  # s3fs raises an OSError caused by botocore's ClientError
        response = getattr(error, "response", None)
        if isinstance(response, dict) and (
            response.get("ResponseMetadata", {}).get("HTTPStatusCode") == status
            or response.get("Error", {}).get("Code") == code
        ):
            return True
    return False


def open_url(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path inside it.

    Raises:
        ConfigError: fsspec, or the filesystem's package, is not installed (the
            message names the extra to install), or the URL cannot be opened.
    """
    scheme = url.split("://", 1)[0].lower()
    extra = EXTRAS.get(scheme, "remote")
    try:
        import fsspec
    except ImportError as exc:
        raise ConfigError(
            f"{display_url(url)}: reading URLs needs fsspec", hint=f"pip install 'packdata[{extra}]'"
        ) from exc
    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as exc:
        raise ConfigError(
            f"{display_url(url)}: the {scheme}:// filesystem is not installed", hint=f"pip install 'packdata[{extra}]'"
        ) from exc
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{display_url(url)}: cannot open the URL ({type(exc).__name__})") from exc
    share_models(fs)  # S3: a forked worker's client reuses the models this process decoded
    return fs, path


def read_url_manifest(fs: Any, root: str, shown: str) -> tuple[Manifest, bytes]:
    """The manifest of the pack at ``root`` on ``fs``, validated like a local one, and its bytes.

    Raises:
        PackFormatError: no manifest (not a pack, or not finished: a pack exists
            when its manifest.json does), unreadable, invalid, or a staged pack.
    """
    try:
        # one byte past the largest manifest read_manifest takes: a larger object is refused, never downloaded whole
        raw = fs.cat_file(f"{root.rstrip('/')}/{MANIFEST_NAME}", start=0, end=manifest_schema.MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError as exc:
        raise PackFormatError(
            f"{shown}: no {MANIFEST_NAME} there: not a pack, or not finished (a pack exists when its "
            f"{MANIFEST_NAME} does)",
            hint="Check the URL",
        ) from exc
    except Exception as exc:
        raise remote_error(shown, f"cannot read {MANIFEST_NAME}", exc) from exc
    with tempfile.TemporaryDirectory(prefix="packdata-manifest-") as probe:
        Path(probe, MANIFEST_NAME).write_bytes(raw)
        try:
            manifest = read_manifest(probe, staged=False)  # a staged pack's shards would be paths on this machine
        except PackFormatError as exc:  # named by its URL: the probe folder is gone once this returns
            raise PackFormatError(exc.message, path=f"{shown}/{MANIFEST_NAME}", hint=exc.hint) from exc
    return manifest, raw


def manifest_kept(fs: Any, root: str, raw: bytes, shown: str) -> bool:
    """Whether ``root``'s manifest still has the bytes ``raw``, read before the pack's files were looked up.

    A pack uploaded again in between (its manifest removed first and put last)
    had the look-ups find its files: its manifest is gone or another's now.

    Raises:
        SourceError: the request failed.
    """
    try:
        again = fs.cat_file(f"{root.rstrip('/')}/{MANIFEST_NAME}", start=0, end=len(raw) + 1)
    except FileNotFoundError:
        return False
    except Exception as exc:
        raise remote_error(shown, f"cannot read {MANIFEST_NAME}", exc) from exc
    return bytes(again) == raw


def remote_error(shown: str, what: str, exc: BaseException, *, resumable: bool = False) -> SourceError:
    """One line for a failed request: the URL (no credentials), what failed, and the error's type only.

    The type names the cause (``EndpointConnectionError``, ``ClientError``,
    ``TimeoutError``); the message is left out because some backends echo
    request details into it. ``resumable``: a conversion it stops is kept, and
    the hint says to rerun with ``resume``.
    """
    error = SourceError(
        f"{shown}: {what} ({type(exc).__name__})",
        hint="Check the URL, the endpoint and the credentials (environment, profile or storage_options), then rerun"
        + (" with resume=True" if resumable else ""),
    )
    error.resumable = resumable
    return error


_T = TypeVar("_T")
RETRY_DELAYS = (1.0, 2.0, 4.0)
"""Seconds waited before each new try of a request that failed transiently (after the filesystem's own retries)."""

_TRANSIENT_TYPES = frozenset(
    {
        "ConnectionError",  # builtin and botocore's (EndpointConnectionError, ConnectTimeoutError)
        "HTTPClientError",  # botocore: ConnectionClosedError, ReadTimeoutError
        "ClientConnectionError",  # aiohttp: ServerDisconnectedError, ClientOSError
        "ClientPayloadError",  # aiohttp: a body cut short
        "IncompleteRead",
        "SSLEOFError",  # a TLS connection dropped mid-reply (not a certificate refused: SSLCertVerificationError)
        "SSLZeroReturnError",  # a TLS connection closed before the reply
    }
)
_TRANSIENT_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "ServiceUnavailable"})


def is_transient(exc: BaseException) -> bool:
    """Whether a failed request may pass when tried again: a dropped or refused connection, a timeout, a 5xx or 429.

    Looks along the exception's causes: s3fs raises an ``OSError`` caused by
    botocore's ``ClientError``, whose reply holds the HTTP status. A missing
    bucket or object, denied access and any other 4xx reply are not transient.
    """
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, TimeoutError) or _TRANSIENT_TYPES & {t.__name__ for t in type(error).__mro__}:
            return True
        response = getattr(error, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if response.get("Error", {}).get("Code") in _TRANSIENT_CODES or _transient_status(status):
                return True
        if _transient_status(getattr(error, "status", None)) or _transient_status(getattr(error, "code", None)):
            return True  # aiohttp's ClientResponseError.status, gcsfs's HttpError.code
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return False


def _transient_status(status: object) -> bool:
    return isinstance(status, int) and not isinstance(status, bool) and (status == 429 or 500 <= status < 600)


def retry_transient(call: Callable[[], _T], delays: tuple[float, ...] = RETRY_DELAYS) -> _T:
    """``call()``, tried again after each of ``delays`` while it fails transiently (see :func:`is_transient`).

    Any other failure, and a transient one after the last delay, is raised as it came.
    """
    for delay in delays:
        try:
            return call()
        except Exception as exc:
            if not is_transient(exc):
                raise
        time.sleep(delay)
    return call()
