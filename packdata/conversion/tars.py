"""WebDataset tar shards as a source: ``shards/data-{000000..000099}.tar`` (also ``.tar.gz``, globs).

Each tar is read as a stream, in the order the pattern lists them (brace
ranges in order, glob matches sorted), and grouped by WebDataset's rule:
consecutive members whose names share the part before the first dot of the
basename form one sample (``a/0001.jpg`` + ``a/0001.json`` -> key ``a/0001``,
fields ``jpg`` and ``json``, field names lower-cased); a sample never spans two
tars: the first tar's sample of a key is the sample (packed, or skipped with its
reason), a later tar's a ``"duplicate key"`` skip naming both tars. A sample
with two members of one field (``a.jpg``, ``a.JPG``) is skipped whole. A key's
members apart in a tar (an unsorted ``tar -c``: ``a.jpg``, ``b.jpg``, ``a.json``)
are read as WebDataset reads them, the first run as the sample (packed whole or
skipped whole, with its reason), and each later run is a ``"duplicate key"``
skip that says what was done with the sample: never packed in part, nor as a
second sample of one key. A member's name is its path as tar extracts it (``./a.jpg``, ``/a.jpg``
and ``b/../a.jpg`` are ``a.jpg``: keys are relative POSIX paths); one whose
``..`` leads out of the tar's top is a ``"bad key"`` skip. Member names are
read as UTF-8 on every machine, never in the locale's encoding; a member
named in bytes not UTF-8 past its key (``c.cls\\xe9``)
skips its sample whole. A ``cls`` member is the label. A hard link to an earlier member of an
uncompressed tar (``tar`` and ``tarfile.add`` write the second name of a file
so) is read from that member. Other links, devices, sparse members (whose
size is only claimed: tarfile reads their holes as zeros) and other non-file
members are skipped and reported, with their sample (never packed without
that field); the tars are only read, never extracted to
disk. A sample whose members together pass the sample limit is skipped whole
before the member that passes it is read. A header claiming more than 16 MiB of
pax records, long name or sparse map (a key holds 64 KiB) ends its tar as
damaged, unread (:mod:`packdata.conversion.tar_headers`); so does a folder,
link, device or FIFO whose header claims data (tarfile reads those bytes as
members, ``tar -t`` may skip them: the samples would depend on the reader).

Shards at a URL (``s3://bucket/shards/data-{000000..000009}.tar``; brace
ranges expanded here, globs by the URL's fsspec filesystem, sorted) are
streamed the same way through fsspec, in reads of 8 MiB: never copied whole
to local disk. A request that still fails after the filesystem's own retries
stops the conversion with a resumable :class:`~packdata.errors.SourceError`
(``resume=True`` continues; the tars are streamed again up to where it
stopped), rather than skip a shard on a transient failure; a tar whose bytes
are not a tar is skipped and reported as locally. A hard link's ranged read
answered with more bytes than asked (a store that ignores Range) stops it with
the store named (:mod:`packdata.pack.ranges`), never blaming the tar.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import posixpath
import re
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, cast

from packdata.conversion.sources import RemoteFile, Skip, SourceGroup, _is_utf8, _printable, too_large
from packdata.conversion.tar_headers import CheckedTarInfo, check_end, check_tarfile, data_problem
from packdata.conversion.tar_patterns import expand_shards, is_tar_pattern
from packdata.errors import SourceError
from packdata.pack.fields import FieldError, check_field_name
from packdata.pack.files import open_regular
from packdata.pack.keyset import KeySet
from packdata.pack.ranges import range_ignored
from packdata.pack.records import MAX_KEY_BYTES, MAX_SAMPLE_BYTES
from packdata.pack.urls import display_url, is_url, object_version, open_url, read_at_version, remote_error

__all__ = ["TarSource", "expand_shards", "is_tar_pattern", "scan_tars"]  # expand_shards, is_tar_pattern: tar_patterns

_BLOCK = 8 << 20  # bytes per read of a tar at a URL
_TAR_KEYS_BUDGET = 32 << 20  # bytes of memory for one tar's sample keys (more spill to disk)
_OUTSIDE = "its '..' leads out of the tar's top folder: a key is a relative path inside it (tar refuses it too)"


@dataclass
class TarSource:
    """WebDataset tar shards (see the module docstring)."""

    root: Path | str  # a URL (without credentials) for shards at a URL
    shards: list[str]
    classes: list[str] = field(default_factory=list)
    kind: str = "fields"
    codecs: dict[str, str] = field(default_factory=dict)
    fs: Any = None  # the fsspec filesystem of shards at a URL (their paths are on it)
    scheme: str = ""  # the URL's scheme, for messages
    base: str = ""  # the path on fs of the folder at ``root`` (shards at a URL): a resume asks the store there

    walk_covers_content: bool = True
    """The walk's records hold the members' bytes: a resume's check of the walk sees any edit of what was packed."""

    cheap_to_count: bool = False
    """A second walk to count samples for the progress bar would read (and decompress) every tar again:
    it made a conversion about 1.6x slower, so the bar shows counts and rates without a total."""

    def walk(self, spill: Path | None = None) -> Iterator[SourceGroup | Skip]:
        """Yield one group per sample, tar by tar, and skips for members that are not samples.

        ``spill``: a folder where the keys seen spill past a memory budget (:class:`~packdata.pack.keyset.KeySet`).

        Raises:
            SourceError: this Python's tarfile would bypass the header bounds (a Ray worker's Python too).
        """
        check_tarfile(os.fspath(self.root))
        with KeySet(spill=spill) as seen:  # key -> the shard that gave it first
            for number, shard in enumerate(self.shards):
                with KeySet(spill=spill, budget=_TAR_KEYS_BUDGET) as ended:
                    yield from self._read(shard, _Keys(self.shards, number, seen, ended))

    def _origin(self, shard: str) -> str | RemoteFile:
        """What a resume probes of ``shard``: a local tar's path, or the object of a tar in the folder at ``root``.

        A tar at a URL outside that folder (a brace pattern over folders) is not
        probed: a resume's check of the walk still sees its members' bytes.
        """
        if self.fs is None:
            return os.path.abspath(shard)
        if not self.base or not shard.startswith(f"{self.base}/"):
            return ""
        return RemoteFile(self.fs, shard, f"{self.root}/{shard[len(self.base) + 1 :]}")

    def _open(self, shard: str) -> BinaryIO:
        if self.fs is None:  # a FIFO a glob matched is refused (EINVAL, named), never waited on
            return os.fdopen(open_regular(shard), "rb")
        return self.fs.open(shard, "rb", block_size=_BLOCK, cache_type="readahead")

    def _read(self, shard: str, keys: _Keys) -> Iterator[SourceGroup | Skip]:
        name = os.path.basename(shard)
        origin = self._origin(shard)
        key: str | None = None
        fields: dict[str, bytes] | None = {}  # None: the sample is skipped whole (a member too large)
        total = 0  # the sample's member sizes so far: all of them together must fit a sample
        corrupt: tuple[type[BaseException], ...] = (tarfile.TarError, EOFError, gzip.BadGzipFile, lzma.LZMAError)
        corrupt += (zlib.error,)
        if self.fs is None:
            corrupt += (OSError,)  # a local file that cannot be read is skipped as before
        try:
            with self._open(shard) as stream, _decompressed(stream) as plain:
                end = _plain_size(stream, plain)  # where the tar ends: no member header may point past it
            with (
                self._open(shard) as stream,
                _decompressed(stream) as plain,
                tarfile.open(fileobj=plain, mode="r|", tarinfo=CheckedTarInfo, encoding="utf-8") as tar,
            ):
                offsets: dict[str, tuple[int, int]] | None = {} if plain is stream else None  # name -> data's span
                for member in tar:
                    problem = data_problem(member)
                    if problem is None and end is not None and tar.offset > end:  # tarfile would read on, forever
                        problem = f"member {member.name!r} claims {member.size} bytes, past the tar's end (byte {end})"
                    if problem is not None:
                        base, _ = _split(_relative(member.name) or "")
                        if base != key and key is not None:  # the sample before is whole: this member is not its
                            if fields is not None:
                                yield keys.ended_sample(key, fields, origin)
                            else:
                                keys.end(key, packed=False)
                            key, fields = base or member.name, {}
                        elif key is None and base is not None:  # the first member: its header read names a key
                            key = base  # skipped, and remembered: a later tar's sample of it is never packed instead
                        raise tarfile.ReadError(problem)
                    where = f"{name}:{member.name}"
                    if member.isdir():
                        continue
                    relative = _relative(member.name)
                    if relative is None:
                        yield Skip(where, "bad key", _OUTSIDE)
                        continue
                    base, ext = _split(relative)
                    named = _is_utf8(member.name)
                    if not named and (base is None or not _is_utf8(base)):  # no sample of a key in UTF-8 lacks it
                        yield Skip(f"{name}:{_printable(member.name)}", "name not UTF-8", problem=False)
                        continue
                    linked = offsets.get(member.linkname) if member.islnk() and offsets is not None else None
                    unread = _unread(member) if linked is None else None  # why a member's bytes are not read
                    if not named:  # c.cls\xe9: sample c would lack its field
                        unread = "named in bytes not UTF-8"
                    if unread is not None and base is None:
                        yield Skip(where, "not a regular file", unread)
                        continue
                    if offsets is not None and unread is None and linked is None:  # a later hard link reads it here
                        offsets[member.name] = (member.offset_data, member.size)
                    if base is None:
                        yield Skip(where, "no field", "a tar member is named KEY.FIELD", problem=False)
                        continue
                    if base != key:
                        if key is not None:
                            if fields is not None:
                                yield keys.ended_sample(key, fields, origin)
                            else:
                                keys.end(key, packed=False)
                        key, fields, total = base, {}, 0
                        apart = keys.apart(base, member.name)
                        if apart is not None:  # WebDataset reads a second sample of one key: never packed, nor added
                            yield Skip(f"{name}:{base}", "duplicate key", apart)
                            fields = None
                        elif (earlier := keys.earlier(base)) is not None:  # an earlier tar's, packed or skipped
                            yield Skip(base, "duplicate key", earlier)
                            fields = None
                    if fields is None:
                        continue
                    if unread is not None:  # the sample lacks that field: never packed without it
                        shown = repr(member.name) if named else f"'{_printable(member.name)}'"
                        detail = f"member {shown} is {unread}: the sample is skipped whole"
                        yield Skip(f"{name}:{base}", "not a regular file" if named else "name not UTF-8", detail)
                        fields = None
                        continue
                    if ext in fields:  # a.jpg then a.JPG: neither is the sample's one jpg, so it is skipped whole
                        detail = f"two members give field {ext!r}, the second {member.name!r}"
                        yield Skip(f"{name}:{base}", "duplicate field", detail)
                        fields = None
                        continue
                    total += member.size if linked is None else linked[1]
                    if total > MAX_SAMPLE_BYTES:  # never read into memory; nor is the sample packed in part
                        reason, detail = too_large(total)
                        yield Skip(f"{name}:{base}", reason, f"field {ext!r}: {detail}")
                        fields = None
                        continue
                    if linked is not None:
                        fields[ext] = self._read_span(shard, stream, *linked)
                        continue
                    extracted = tar.extractfile(member)
                    fields[ext] = extracted.read() if extracted is not None else b""
                check_end(tar)
        except corrupt as exc:
            # The sample being read may lack members or hold a cut one: it is dropped, never packed partly.
            if key is not None and key not in keys.ended:  # a later tar's sample of it is never packed instead
                keys.end(key, packed=False)
            if key is None:
                yield Skip(name, "corrupt tar", f"{exc}; no sample of this tar is packed")
            else:
                yield Skip(f"{name}:{key}", "corrupt tar", f"{exc}; the samples before this one in the tar are kept")
            return
        except Exception as exc:  # a request that failed: stop, resumable, rather than skip on a transient failure
            if range_ignored(exc):  # the store answered other bytes than the range: no rerun helps
                raise
            if self.fs is None:  # a local file (a path, not a URL): no endpoint or credentials to check
                raise _local_error(shard, exc) from exc
            shown = display_url(f"{self.scheme}://{shard}")
            raise remote_error(shown, "cannot read the tar; rerun with resume", exc, resumable=True) from exc
        if key is not None and fields is not None:
            yield keys.ended_sample(key, fields, origin)
        elif key is not None:
            keys.end(key, packed=False)

    def _read_span(self, shard: str, stream: BinaryIO, offset: int, size: int) -> bytes:
        """``size`` bytes of an uncompressed tar from ``offset`` (a hard link's target), the stream left where it is.

        At a URL, read at the version ``stream`` was opened at (s3fs's ETag: ``If-Match``), so a tar replaced
        since fails the read (HTTP 412) rather than give the new object's bytes; the reply's range is checked.
        """
        if self.fs is not None:
            where = display_url(f"{self.scheme}://{shard}")
            version = object_version(getattr(stream, "details", None) or {})
            data = read_at_version(self.fs, shard, version, offset, offset + size, where=where)
        else:
            data = os.pread(stream.fileno(), size, offset)
        if len(data) != size:
            raise tarfile.ReadError(f"a hard link's member holds {len(data)} of its {size} bytes")
        return data


@dataclass
class _Keys:
    """The sample keys a walk has met: in every tar so far, and in the tar being read."""

    shards: list[str]
    number: int  # the tar being read
    seen: KeySet  # key -> 2 * the tar that gave it first, + 1 if that tar's sample was packed (0: skipped)
    ended: KeySet  # key -> 1 if this tar's sample of that key was packed, 0 if it was skipped

    def ended_sample(self, key: str, fields: dict[str, bytes], origin: str | RemoteFile) -> SourceGroup | Skip:
        """The sample of ``key`` whose members were all read: a group, or why it is skipped; noted as either."""
        entry = _group(key, fields, origin)
        self.end(key, packed=isinstance(entry, SourceGroup))
        return entry

    def end(self, key: str, *, packed: bool) -> None:
        """Note this tar's sample of ``key`` as ended, packed or skipped (the first of a key: later ones are not)."""
        self.ended.add(key, int(packed))
        self.seen.add(key, 2 * self.number + int(packed))

    def earlier(self, key: str) -> str | None:
        """Why this tar's sample ``key`` is skipped if an earlier tar gave it (packed or skipped there); else None."""
        if key not in self.seen:
            return None
        first, packed = divmod(cast(int, self.seen.add(key)), 2)  # the first value is kept
        detail = f"an earlier sample in {self.shards[first]} has this key ({self.shards[self.number]})"
        return detail if packed else f"{detail}; that one was skipped (reported): this one is never packed in its place"

    def apart(self, key: str, member: str) -> str | None:
        """Why ``member`` is skipped if this tar's sample ``key`` ended before it (after other samples' members)."""
        if key not in self.ended:
            return None
        done = "packed as the sample" if self.ended.add(key) else "skipped as the sample (reported)"
        return (
            f"the tar's members of sample {key!r} are not next to each other: {member!r} comes after other "
            f"samples' members, and the members before them were {done}; these later members are skipped, "
            "never added to it (sort the tar: tar --sort=name)"
        )


def _unread(member: tarfile.TarInfo) -> str | None:
    """Why a member's bytes are not read (a link, device or sparse member), in words; None for a regular file."""
    if not member.isfile():
        return "a link or device in the tar"
    if member.issparse():  # its size is a claim: tarfile reads the holes as zeros, all in memory
        stored = sum(size for _, size in cast("list[tuple[int, int]]", member.sparse or []))
        return f"a sparse member ({member.size} bytes, {stored} stored)"
    return None


def _local_error(shard: str, exc: Exception) -> SourceError:
    """The error of a local tar that failed other than as a damaged tar (memory ran out): resumable, as a request's."""
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    hint = "Check the file, then rerun with resume=True"
    if isinstance(exc, MemoryError):
        hint = "Free memory (or convert on a machine with more), then rerun with resume=True"
    error = SourceError(f"cannot read the tar ({detail})", path=shard, hint=hint)
    error.resumable = True  # the conversion so far is kept
    return error


def _plain_size(stream: BinaryIO, plain: BinaryIO) -> int | None:
    """The tar's own bytes: a compressed one read through (its checksum is at its end), else its file's size.

    None where the size is not known (an object whose store says none).
    """
    if plain is not stream:
        total = 0
        while chunk := plain.read(_BLOCK):
            total += len(chunk)
        return total
    try:
        return os.fstat(stream.fileno()).st_size
    except (OSError, AttributeError, io.UnsupportedOperation):  # an fsspec file: no descriptor
        size = getattr(stream, "size", None)
        return size if isinstance(size, int) else None


def _decompressed(stream: BinaryIO) -> BinaryIO:
    """``stream`` read through its compression, told by its first bytes (gzip, bzip2, xz), or as it is.

    Python's own readers check each format's checksums and end marker (tarfile's
    stream mode never reads gzip's CRC: a flipped byte was packed as data).
    """
    magic = stream.read(6)
    stream.seek(0)
    if magic[:2] == b"\x1f\x8b":
        return cast(BinaryIO, gzip.GzipFile(fileobj=stream, mode="rb"))
    if magic[:3] == b"BZh":
        return cast(BinaryIO, bz2.BZ2File(stream))
    if magic == b"\xfd7zXZ\x00":
        return cast(BinaryIO, lzma.LZMAFile(stream))
    return stream


def _relative(name: str) -> str | None:
    """A member name as a relative POSIX path, the key's source; None for one that leads out of the tar's top.

    ``./`` (as ``tar -C DIR .`` writes), ``.`` and empty parts, a ``..`` that
    stays inside, and leading slashes are dropped, as tar and Python's tarfile
    (``filter="data"``) extract them: ``/a/./b/../c.jpg`` is ``a/c.jpg``. A
    name whose ``..`` leads above the top (``../x.jpg``) has no such path:
    extracting it is refused there too.
    """
    if name.startswith(("/", ".")) or "/." in name or "//" in name:  # else it is plain already: no normpath
        name = posixpath.normpath(name.lstrip("/"))
        if name == ".." or name.startswith("../"):
            return None
    return name


def _split(name: str) -> tuple[str | None, str]:
    """WebDataset's key and field of a member name: up to the first dot of the basename, and the rest (lower-cased)."""
    match = re.match(r"^((?:.*/|)[^.]+)[.]([^/]*)$", name)
    if not match:
        return None, ""
    return match.group(1), match.group(2).lower()


def _group(key: str, fields: dict[str, bytes], origin: str | RemoteFile = "") -> SourceGroup | Skip:
    size = len(key.encode("utf-8"))
    if size > MAX_KEY_BYTES:  # a pax or GNU long name: any length
        return Skip(f"{key[:100]}...", "key too long", f"{size} bytes in UTF-8, at most {MAX_KEY_BYTES} fit")
    for name in fields:
        try:
            check_field_name(name)
        except FieldError as exc:
            return Skip(key, "bad field name", str(exc))
    return SourceGroup(key, -1, (), tuple(sorted(fields.items())), origin)


def scan_tars(pattern: str, storage_options: dict[str, Any] | None = None) -> TarSource:
    """A tar source over the shards ``pattern`` names (checked to exist); a URL pattern streams through fsspec.

    Raises:
        SourceError: a shard is missing, or this Python's tarfile would bypass the header bounds
            (:func:`~packdata.conversion.tar_headers.check_tarfile`).
    """
    check_tarfile(display_url(pattern) if is_url(pattern) else pattern)
    if is_url(pattern):
        scheme = pattern.split("://", 1)[0]
        fs, path = open_url(pattern, storage_options)
        shards = expand_shards(path, fs, scheme)
        base = shards[0].rsplit("/", 1)[0]
        return TarSource(root=display_url(f"{scheme}://{base}"), shards=shards, fs=fs, scheme=scheme, base=base)
    shards = expand_shards(pattern)
    return TarSource(root=Path(os.path.dirname(shards[0]) or "."), shards=shards)
