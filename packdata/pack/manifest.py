"""Read, write and validate a pack's manifest, the single source of truth.

``manifest.json`` sits at the top of every pack. It is small, human-readable
JSON: format version, packdata version, format, kind, classes, sample count, the
sample index folder and each index file's SHA-256, and per shard its file, sample
count, first global index, byte size and SHA-256. A pack without it is incomplete
by definition: convert writes it last and renames the pack into place only after.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packdata.errors import PackFormatError
from packdata.pack.fields import CODECS
from packdata.pack.files import atomic_write, file_kind, file_sha256, not_a_file, open_regular
from packdata.pack.index import index_files

__all__ = [
    "CHECKSUM_KEY",
    "FIELDS_VERSION",
    "FORMAT_VERSION",
    "SINGLE_FIELD_VERSION",
    "MANIFEST_NAME",
    "SKIP_REPORT",
    "Manifest",
    "ShardInfo",
    "check_field_counts",
    "classes_problem",
    "file_sha256",
    "first_repeated",
    "is_sha256",
    "manifest_checksum",
    "plain_name_problem",
    "read_manifest",
    "resolve_in_pack",
    "unique_keys",
    "validate_manifest",
    "write_manifest",
]

FORMAT_VERSION = 2
"""The newest pack format this packdata reads (1: image or text samples; 2: adds multi-field samples)."""
SINGLE_FIELD_VERSION = 1
"""Packs of image or text samples keep version 1, so older packdata reads them."""
FIELDS_VERSION = 2
"""Packs of multi-field samples (kind ``"fields"``, with ``codecs``)."""
MANIFEST_NAME = "manifest.json"
SKIP_REPORT = "skipped.jsonl"
"""The skip report a conversion writes (``skipped.report`` names it)."""
CHECKSUM_KEY = "checksum"
"""The manifest's own SHA-256 (:func:`manifest_checksum`); manifests of packdata before 0.2 have none."""


@dataclass
class ShardInfo:
    """One shard: ``file`` is a plain name in the pack (in a staged pack, maybe the path of an origin shard)."""

    file: str
    num_samples: int
    first_index: int
    bytes: int
    sha256: str

    def path(self, pack: str | os.PathLike) -> Path:
        """The shard's location, resolving a relative ``file`` against ``pack``."""
        return Path(pack) / self.file


@dataclass
class Manifest:
    """Everything a reader or ``stage`` needs to know about a pack."""

    format: str
    kind: str
    classes: list[str]
    num_samples: int
    shards: list[ShardInfo]
    index: dict[str, Any] = field(default_factory=dict)  # dir, previous (an append's), sha256 (file -> digest)
    fields: list[str] = field(default_factory=list)
    codecs: dict[str, str] = field(default_factory=dict)  # kind "fields": each field's codec
    field_counts: dict[str, int] = field(default_factory=dict)  # kind "fields": samples holding each field
    reencode: dict[str, Any] | None = None
    skipped: dict[str, Any] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)
    format_version: int = SINGLE_FIELD_VERSION
    packdata_version: str = ""
    staged_from: str | None = None  # set in a staged pack: the pack it was staged from

    @property
    def index_dir(self) -> str:
        """The sample index folder's name inside the pack."""
        return self.index.get("dir", "index")

    @property
    def index_sha256(self) -> dict[str, str]:
        """Index file name -> its SHA-256 (empty for a pack written before packdata recorded them)."""
        return dict(self.index.get("sha256", {}))

    def shards_digest(self) -> str:
        """16 hex digits of SHA-256 over the shards' checksums: a staged copy's are the same, a new pack's not."""
        return hashlib.sha256("".join(s.sha256 for s in self.shards).encode()).hexdigest()[:16]

    def missing_fields(self) -> dict[str, int]:
        """Field name -> how many samples lack it, for the fields some samples lack (by ``field_counts``)."""
        return {name: self.num_samples - n for name, n in self.field_counts.items() if n < self.num_samples}

    @property
    def total_bytes(self) -> int:
        """Sum of the shards' byte sizes."""
        return sum(s.bytes for s in self.shards)

    def to_dict(self) -> dict[str, Any]:
        """The manifest as plain JSON-ready data (``staged_from`` only in a staged pack)."""
        data = dataclasses.asdict(self)
        if data["staged_from"] is None:
            del data["staged_from"]
        for key in ("codecs", "field_counts"):
            if not data[key]:
                del data[key]  # version-1 manifests (and those of packdata before field counts) stay as they were
        return data


def manifest_checksum(data: dict[str, Any]) -> str:
    """SHA-256 of a manifest's fields (all but ``checksum``) as canonical JSON: sorted keys, no spaces."""
    fields = {k: v for k, v in data.items() if k != CHECKSUM_KEY}
    canonical = json.dumps(fields, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def write_manifest(pack: str | os.PathLike, manifest: Manifest) -> Path:
    """Write ``manifest.json`` into ``pack`` atomically (temporary file, fsync, rename), with its checksum."""
    from packdata._version import __version__

    manifest.packdata_version = manifest.packdata_version or __version__
    path = Path(pack) / MANIFEST_NAME
    data = manifest.to_dict()
    data[CHECKSUM_KEY] = manifest_checksum(data)
    atomic_write(path, (json.dumps(data, indent=1, ensure_ascii=False) + "\n").encode("utf-8"))
    return path


# --------------------------------------------------------------------------- paths


def plain_name_problem(name: object) -> str | None:
    """Why ``name`` is not a plain file name inside one folder, or None when it is."""
    if not isinstance(name, str):
        return "should be a string"
    if not name or name in (".", ".."):
        return "should be a plain file name"
    if "\x00" in name:
        return "should not hold a NUL byte"
    if "/" in name or "\\" in name:
        return "should be a plain file name, without a path separator"
    if len(name.encode("utf-8", "surrogateescape")) > 255:
        return "should be a file name of at most 255 bytes"
    return None


def _escapes(root_real: str, path: str) -> bool:
    real = os.path.realpath(path)
    return real != root_real and not real.startswith(root_real.rstrip(os.sep) + os.sep)


def resolve_in_pack(root: str | os.PathLike, name: str, *, field: str, manifest: str | os.PathLike) -> Path:
    """The path of ``name`` inside the pack ``root``, proven not to leave it.

    ``name`` must be a plain name (no separator, no ``..``, no NUL byte). When
    the entry exists it must not resolve outside ``root`` through a symlink, and
    when it is a folder (an LMDB shard) neither may any entry directly in it.

    Args:
        root: the pack folder.
        name: the file or folder name a manifest gives.
        field: the manifest field it came from, for the message.
        manifest: the manifest file, for the message.

    Raises:
        PackFormatError: naming the manifest, the field and the value.
    """
    problem = plain_name_problem(name)
    if problem is not None:
        raise _field_error(manifest, field, f"{problem} inside the pack", name)
    path = Path(root) / name
    root_real = os.path.realpath(root)
    if os.path.lexists(path):
        if _escapes(root_real, os.fspath(path)):
            raise _field_error(manifest, field, "should stay inside the pack, but it is a symlink leading out", name)
        if path.is_dir():
            try:
                entries = list(os.scandir(path))
            except OSError as exc:
                raise PackFormatError(f"cannot list {field}: {exc.strerror}", path=path) from exc
            for entry in entries:
                if entry.is_symlink() and _escapes(root_real, entry.path):
                    raise PackFormatError(
                        f"{entry.name} in {field} is a symlink leading out of the pack",
                        path=entry.path,
                        hint="Remove it: packdata never follows a pack's files outside the pack",
                    )
    return path


# --------------------------------------------------------------------------- validation

_MAX_MANIFEST_BYTES = 256 << 20
_MAX_INT = (1 << 63) - 1
_MANIFEST_KEYS = {f.name for f in dataclasses.fields(Manifest)}
_SHARD_KEYS = {f.name for f in dataclasses.fields(ShardInfo)}
_REQUIRED = ("format", "kind", "classes", "num_samples", "shards")
_HINT = "The manifest is damaged or was not written by packdata: convert the pack again"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _field_error(manifest: str | os.PathLike, field: str, problem: str, value: object) -> PackFormatError:
    return PackFormatError(f"manifest field {field!r} {problem}, but got {_short(value)}", path=manifest, hint=_HINT)


def first_repeated(names: Iterable[str]) -> str | None:
    """The first name that ``names`` holds twice, or None."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    return None


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refused (ValueError) when it names a key twice (``json.loads`` kept the last one alone).

    Pass it as ``object_pairs_hook``: a file other tools read too must mean one thing to all of them.
    """
    twice = first_repeated(key for key, _ in pairs)
    if twice is not None:
        raise ValueError(f"key {twice!r} twice in one object")
    return dict(pairs)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid number here")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


def _count(where: Path, field: str, value: object, *, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= _MAX_INT:
        raise _field_error(where, field, f"should be an integer from {minimum} to 2**63-1", value)
    return value


def _strings(where: Path, field: str, value: object) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _field_error(where, field, "should be a list of strings", value)
    return list(value)


def classes_problem(classes: object) -> str | None:
    """What keeps ``classes`` from naming a pack's classes (a list of distinct UTF-8 strings), or None."""
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        return "should be a list of strings"
    twice = first_repeated(classes)  # class_to_idx would give one of two labels for a name: samples mislabelled
    if twice is not None:
        return f"should name each class once ({twice!r} is there twice)"
    try:
        "".join(classes).encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate: no manifest (UTF-8) holds it
        return f"should be a list of UTF-8 strings ({exc.reason})"
    return None


def _parse(path: Path) -> dict[str, Any]:
    try:  # a FIFO is refused, never waited on; only what the file holds is allocated
        with os.fdopen(open_regular(path), "rb") as f:
            raw = f.read(min(os.fstat(f.fileno()).st_size, _MAX_MANIFEST_BYTES) + 1)
    except OSError as exc:
        raise PackFormatError(f"manifest is unreadable: {exc.strerror}", path=path) from exc
    if len(raw) > _MAX_MANIFEST_BYTES:
        raise PackFormatError(f"manifest is larger than {_MAX_MANIFEST_BYTES >> 20} MiB", path=path, hint=_HINT)
    try:
        data = json.loads(
            raw.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite_float, object_pairs_hook=unique_keys
        )
    except RecursionError as exc:
        raise PackFormatError("manifest is nested too deeply to be a manifest", path=path, hint=_HINT) from exc
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, NaN, Infinity, 1e999
        raise PackFormatError(f"manifest is not valid JSON: {exc}", path=path, hint=_HINT) from exc
    if not isinstance(data, dict):
        raise PackFormatError(
            f"manifest should be a JSON object, but got a {type(data).__name__}", path=path, hint=_HINT
        )
    return data


def _shards(path: Path, value: object, staged: bool) -> list[ShardInfo]:
    if not isinstance(value, list) or not value:
        raise _field_error(path, "shards", "should be a non-empty list of shard objects", value)
    shards: list[ShardInfo] = []
    names: set[str] = set()
    first = 0
    for i, item in enumerate(value):
        where = f"shards[{i}]"
        if not isinstance(item, dict):
            raise _field_error(path, where, "should be an object", item)
        unknown = sorted(set(item) - _SHARD_KEYS)
        missing = sorted(_SHARD_KEYS - set(item))
        if unknown or missing:
            what = f"has an unknown key {unknown[0]!r}" if unknown else f"lacks the key {missing[0]!r}"
            raise _field_error(path, where, f"{what} (keys are {', '.join(sorted(_SHARD_KEYS))})", sorted(item))
        file = item["file"]
        if staged and isinstance(file, str) and os.path.isabs(file):
            if os.path.normpath(file) != file or "\x00" in file:
                raise _field_error(path, f"{where}.file", "should be a normalized absolute path", file)
            name = os.path.basename(file)
        else:
            name = file
        problem = plain_name_problem(name)
        if problem is not None:
            problem = f"{problem} inside the pack" + ("" if staged else " (only a staged pack names shards elsewhere)")
            raise _field_error(path, f"{where}.file", problem, file)
        if name in names:
            raise _field_error(path, f"{where}.file", "should name each shard once", file)
        names.add(name)
        count = _count(path, f"{where}.num_samples", item["num_samples"])
        start = _count(path, f"{where}.first_index", item["first_index"])
        if start != first:
            raise _field_error(
                path, f"{where}.first_index", f"should be {first} (the samples of the shards before)", start
            )
        first += count
        size = _count(path, f"{where}.bytes", item["bytes"])
        sha = item["sha256"]
        if not is_sha256(sha):
            raise _field_error(path, f"{where}.sha256", "should be 64 lowercase hex digits", sha)
        shards.append(ShardInfo(file, count, start, size, sha))
    return shards


def _check_index_names(path: Path, index: dict[str, str], shards: list[ShardInfo], report: object) -> None:
    """The index folders (``dir``, and ``previous``, which an append deletes) name no shard or other pack file."""
    taken = {s.file: "a shard" for s in shards if not os.path.isabs(s.file)}
    taken.update({MANIFEST_NAME: "the manifest", f".{MANIFEST_NAME}.tmp": "the manifest's temporary file"})
    for name in (SKIP_REPORT, report):
        if isinstance(name, str):
            taken[name] = "the skip report"
    current = index.get("dir", "index")
    if current in taken:
        raise _field_error(path, "index.dir", f"should name the sample index folder, not {taken[current]}", current)
    previous = index.get("previous")
    if previous is not None and (previous == current or previous in taken):
        what = "the current index folder (index.dir)" if previous == current else taken[previous]
        raise _field_error(
            path, "index.previous", f"should name the index folder an append replaced, not {what}", previous
        )


def _field_counts(where: Path, counts: object, kind: object, fields: list[str], num_samples: int) -> dict[str, int]:
    """``field_counts``: each field of a multi-field pack -> how many of its samples hold it (0 to ``num_samples``)."""
    if not isinstance(counts, dict):
        raise _field_error(where, "field_counts", "should be an object of field name -> sample count", counts)
    if counts and kind != "fields":
        raise _field_error(where, "field_counts", "is for a pack of multi-field samples only", counts)
    names = ", ".join(fields)
    unknown = [name for name in counts if name not in fields]
    if unknown:
        raise _field_error(where, "field_counts", f"should count only the manifest's fields ({names})", unknown[0])
    if counts and len(counts) != len(fields):
        raise _field_error(where, "field_counts", f"should count each of the manifest's fields ({names})", list(counts))
    for name, n in counts.items():
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= num_samples:
            problem = f"should be an integer from 0 to num_samples ({num_samples})"
            raise _field_error(where, f"field_counts.{name}", problem, n)
    return dict(counts)


def check_field_counts(manifest: Manifest, counted: dict[str, int], path: str | os.PathLike) -> None:
    """Raise unless the manifest's ``field_counts`` (when it has them) are ``counted``, the sample index's.

    Raises:
        PackFormatError: naming the manifest ``path`` and the first field whose count differs.
    """
    for name, n in manifest.field_counts.items():
        if counted.get(name, 0) != n:
            raise PackFormatError(
                f"manifest field 'field_counts' says {n} samples hold field {name!r}, "
                f"but the sample index lists it for {counted.get(name, 0)}",
                path=path,
                hint=_HINT,
            )


def _check_index_sha256(where: Path, digests: object, kind: object) -> None:
    """``index.sha256``: each index file of a pack of ``kind`` -> 64 lowercase hex digits."""
    names = index_files(kind) if isinstance(kind, str) else ()
    if not isinstance(digests, dict) or set(digests) != set(names):
        problem = f"should be an object naming each index file once ({', '.join(names)})"
        raise _field_error(where, "index.sha256", problem, digests)
    for name, digest in digests.items():
        if not is_sha256(digest):
            raise _field_error(where, f"index.sha256.{name}", "should be 64 lowercase hex digits", digest)


def is_sha256(value: object) -> bool:
    """Whether ``value`` is a SHA-256 as packdata writes one: 64 lowercase hex digits."""
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _optional_dict(path: Path, data: dict[str, Any], key: str, *, nullable: bool = False) -> None:
    if key in data and not (isinstance(data[key], dict) or (nullable and data[key] is None)):
        raise _field_error(path, key, "should be an object" + (" or null" if nullable else ""), data[key])


def _check_skipped(where: Path, skipped: dict[str, Any]) -> None:
    """The ``skipped`` object: a count, counts by reason, and the skip report's plain name (each optional)."""
    if "count" in skipped:
        _count(where, "skipped.count", skipped["count"])
    by_reason = skipped.get("by_reason", {})
    problem = "should be an object of reason -> count (an integer from 0 to 2**63-1)"
    if not isinstance(by_reason, dict):
        raise _field_error(where, "skipped.by_reason", problem, by_reason)
    for reason, n in by_reason.items():
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= _MAX_INT:
            raise _field_error(where, "skipped.by_reason", problem, {reason: n})
    if "count" in skipped and "by_reason" in skipped and sum(by_reason.values()) != skipped["count"]:
        # a merge or an append adds up the reasons: a lie here would become a miscount there
        problem = f"should add up to skipped.count ({skipped['count']})"
        raise _field_error(where, "skipped.by_reason", problem, by_reason)
    report = skipped.get("report")
    if report is not None and plain_name_problem(report) is not None:
        raise _field_error(where, "skipped.report", f"{plain_name_problem(report)} inside the pack", report)


def validate_manifest(data: object, path: str | os.PathLike) -> Manifest:
    """Check a parsed manifest's whole schema and build the :class:`Manifest`.

    Types, ranges and consistency: known keys only, counts that are integers
    in range and add up, shard ``first_index`` values that follow each other,
    unique shard names, plain names for every file the pack holds (absolute
    paths only for the shards a staged pack left at its origin).

    Args:
        data: the parsed JSON.
        path: the manifest file, named in errors.

    Raises:
        PackFormatError: naming the manifest and the first bad field.
    """
    where = Path(path)
    if not isinstance(data, dict):
        raise PackFormatError(f"manifest should be a JSON object, but got a {type(data).__name__}", path=where)
    unknown = sorted(k for k in data if k not in _MANIFEST_KEYS)
    if unknown:
        raise _field_error(
            where, unknown[0], "is not a manifest field (a newer packdata may know it)", data[unknown[0]]
        )
    for key in _REQUIRED:
        if key not in data:
            raise PackFormatError(f"manifest lacks the field {key!r}", path=where, hint=_HINT)
    version = data.get("format_version", SINGLE_FIELD_VERSION)
    _count(where, "format_version", version, minimum=1)
    for key in ("format", "kind", "packdata_version"):
        if key in data and not isinstance(data[key], str):
            raise _field_error(where, key, "should be a string", data[key])
    staged_from = data.get("staged_from")
    if staged_from is not None and (
        not isinstance(staged_from, str) or not os.path.isabs(staged_from) or "\x00" in staged_from
    ):
        raise _field_error(where, "staged_from", "should be an absolute path or null", staged_from)
    problem = classes_problem(data["classes"])
    if problem is not None:
        raise _field_error(where, "classes", problem, data["classes"])
    classes = list(data["classes"])
    fields = _strings(where, "fields", data.get("fields", []))
    codecs = data.get("codecs", {})
    if not isinstance(codecs, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v in CODECS for k, v in codecs.items()
    ):
        raise _field_error(where, "codecs", f"should map field names to one of {', '.join(CODECS)}", codecs)
    if data["kind"] == "fields" and (set(codecs) != set(fields) or len(set(fields)) != len(fields)):
        raise _field_error(where, "codecs", "should name each of the manifest's fields once", codecs)
    num_samples = _count(where, "num_samples", data["num_samples"])
    field_counts = _field_counts(where, data.get("field_counts", {}), data["kind"], fields, num_samples)
    index = data.get("index", {})
    if not isinstance(index, dict) or not all(isinstance(v, str) for k, v in index.items() if k != "sha256"):
        raise _field_error(where, "index", "should be an object of folder names (and sha256, of digests)", index)
    if "sha256" in index:
        _check_index_sha256(where, index["sha256"], data["kind"])
    for key in ("dir", "previous"):
        if key in index and plain_name_problem(index[key]) is not None:
            raise _field_error(where, f"index.{key}", f"{plain_name_problem(index[key])} inside the pack", index[key])
    _optional_dict(where, data, "reencode", nullable=True)
    for key, minimum in (("count", 0), ("max_side", 1), ("quality", 1)):  # info prints them as numbers
        if isinstance(data.get("reencode"), dict) and key in data["reencode"]:
            _count(where, f"reencode.{key}", data["reencode"][key], minimum=minimum)
    _optional_dict(where, data, "skipped")
    _optional_dict(where, data, "source")
    _check_skipped(where, data.get("skipped", {}))
    shards = _shards(where, data["shards"], staged_from is not None)
    _check_index_names(where, index, shards, data.get("skipped", {}).get("report"))
    counted = sum(s.num_samples for s in shards)
    if counted != num_samples:
        raise PackFormatError(
            f"manifest is inconsistent: shards hold {counted} samples, but num_samples={num_samples}",
            path=where,
            hint=_HINT,
        )
    return Manifest(
        format=data["format"],
        kind=data["kind"],
        classes=classes,
        num_samples=num_samples,
        shards=shards,
        index=dict(index),
        fields=fields,
        codecs=dict(codecs),
        field_counts=field_counts,
        reencode=data.get("reencode"),
        skipped=dict(data.get("skipped", {})),
        source=dict(data.get("source", {})),
        format_version=version,
        packdata_version=data.get("packdata_version", ""),
        staged_from=staged_from,
    )


# --------------------------------------------------------------------------- reading


def _check_origin(manifest_path: Path, number: int, shard: ShardInfo, seen: dict[str, Manifest]) -> None:
    """A staged pack's shard left at its origin: a shard of a real pack, with the same checksum."""
    field = f"shards[{number}].file"
    origin = os.path.dirname(shard.file)
    if origin not in seen:
        try:
            seen[origin] = _read(Path(origin), external=False)
        except PackFormatError as exc:  # one hint: the origin's own ("convert ... first") would not apply here
            found = exc.message if exc.path == origin else f"{exc.path}: {exc.message}"
            hint = exc.hint or "Stage the pack again"
            if not os.path.lexists(os.path.join(origin, MANIFEST_NAME)):
                hint = "Its origin was moved or removed: stage the pack again from where it is now, "
                hint += f"or move it back to {origin}"
            raise PackFormatError(
                f"manifest field {field!r} names a shard of {origin}, which is not a readable pack: {found}",
                path=manifest_path,
                hint=hint,
            ) from exc
    name = os.path.basename(shard.file)
    match = next((s for s in seen[origin].shards if s.file == name), None)
    if match is None or (match.sha256, match.bytes) != (shard.sha256, shard.bytes):
        problem = "lists no such shard" if match is None else "lists it with another checksum or size"
        raise _field_error(
            manifest_path, field, f"should name a shard of its origin pack, but that pack {problem}", shard.file
        )
    resolve_in_pack(origin, name, field=field, manifest=manifest_path)


def _exists(path: Path) -> bool:
    """Whether ``path`` exists; False also where it cannot be told (a name too long to be one)."""
    try:
        return path.exists()
    except OSError:
        return False


def _read(pack: Path, *, external: bool, staged: bool = True) -> Manifest:
    path = pack / MANIFEST_NAME
    try:
        mode: int | None = os.stat(pack).st_mode
    except (FileNotFoundError, NotADirectoryError):
        mode = None
    except OSError as exc:  # a name too long, a folder it may not search: one line, not a traceback
        raise PackFormatError(
            f"cannot be read ({exc.strerror})", path=pack, hint="Name a pack's folder that this process may read"
        ) from exc
    if mode is not None and not stat.S_ISDIR(mode):  # a file given for the pack: not a damaged manifest inside it
        hint = "Pass the pack's folder"
        if pack.name == MANIFEST_NAME:
            hint = f"Pass the folder that holds it: {pack.parent}"
        raise PackFormatError(
            f"is {file_kind(mode)}, not a packdata pack (a folder holding {MANIFEST_NAME})", path=pack, hint=hint
        )
    problem = not_a_file(path)
    if problem and problem != "is missing":  # something else stands in its place
        raise PackFormatError(f"{MANIFEST_NAME} {problem}", path=path, hint=_HINT)
    if problem:
        hint = "Convert a folder with `packdata convert SRC DST` first"
        if _exists(pack.parent / f".{pack.name}.partial"):
            hint = (
                "A conversion into it was interrupted: finish it with resume (`packdata convert SRC DST --resume`);"
                " a PackWriter's cannot be resumed: write it again"
            )
        problem = f"not a packdata pack (no {MANIFEST_NAME})" if mode is not None else "no such pack"
        raise PackFormatError(problem, path=pack, hint=hint)
    data = _parse(path)
    version = data.get("format_version", SINGLE_FIELD_VERSION)
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        raise PackFormatError(
            f"pack format version {version} is newer than this packdata reads ({FORMAT_VERSION})",
            path=pack,
            hint="Upgrade packdata: pip install -U packdata",
        )
    checksum = data.pop(CHECKSUM_KEY, None)
    manifest = validate_manifest(data, path)
    if checksum is not None and checksum != manifest_checksum(data):
        raise PackFormatError(
            "manifest checksum does not match its content (a damaged or hand-edited manifest)",
            path=path,
            hint=_HINT,
        )
    if not staged and manifest.staged_from is not None:  # before any path it names is looked at
        raise PackFormatError("is a staged pack's manifest", path=path, hint="Point at the original pack")
    if not external and any(os.path.isabs(s.file) for s in manifest.shards):
        raise PackFormatError(
            "is a staged pack whose shards are partly elsewhere; it cannot be the origin of another",
            path=pack,
            hint="Stage from the original pack",
        )
    seen: dict[str, Manifest] = {}
    for number, shard in enumerate(manifest.shards):
        if os.path.isabs(shard.file):
            _check_origin(path, number, shard, seen)
        else:
            resolve_in_pack(pack, shard.file, field=f"shards[{number}].file", manifest=path)
    resolve_in_pack(pack, manifest.index_dir, field="index.dir", manifest=path)
    return manifest


def read_manifest(pack: str | os.PathLike, *, staged: bool = True) -> Manifest:
    """Read a pack's manifest and validate all of it.

    The schema is checked strictly (:func:`validate_manifest`) and every path
    it names is resolved inside the pack (:func:`resolve_in_pack`); the shards a
    staged pack left at its origin must be shards of that pack, with the same
    checksum. ``staged=False`` refuses a staged pack before any path its
    manifest names is looked at (a manifest from a URL names no local file).

    Raises:
        PackFormatError: the path is missing, is not a pack, is damaged, names a
            path outside the pack, or was written by a newer packdata.
    """
    return _read(Path(pack), external=True, staged=staged)
