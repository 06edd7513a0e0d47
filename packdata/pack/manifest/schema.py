"""Validate a manifest's JSON strictly: every field's type, range and name, before anything uses it."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from packdata.errors import PackFormatError
from packdata.pack.fields import CODECS
from packdata.pack.files import open_regular
from packdata.pack.index import index_files
from packdata.pack.manifest.model import MANIFEST_NAME, SINGLE_FIELD_VERSION, SKIP_REPORT, Manifest, ShardInfo

__all__ = [
    "MANIFEST_HINT",
    "MAX_MANIFEST_BYTES",
    "check_field_counts",
    "classes_problem",
    "field_error",
    "first_repeated",
    "is_sha256",
    "parse_manifest",
    "plain_name_problem",
    "unique_keys",
    "validate_manifest",
]

MAX_MANIFEST_BYTES = 256 << 20
"""The largest manifest read (a local file, or an object at a URL): a larger one is refused, never read whole."""
_MAX_INT = (1 << 63) - 1
_MANIFEST_KEYS = {f.name for f in dataclasses.fields(Manifest)}
_SHARD_KEYS = {f.name for f in dataclasses.fields(ShardInfo)}
_REQUIRED = ("format", "kind", "classes", "num_samples", "shards")
MANIFEST_HINT = "The manifest is damaged or was not written by packdata: convert the pack again"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def field_error(manifest: str | os.PathLike, field: str, problem: str, value: object) -> PackFormatError:
    """A manifest field's error: "manifest field F PROBLEM, but got VALUE", naming the manifest file."""
    problem = f"manifest field {field!r} {problem}, but got {_short(value)}"
    return PackFormatError(problem, path=manifest, hint=MANIFEST_HINT)


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
        raise field_error(where, field, f"should be an integer from {minimum} to 2**63-1", value)
    return value


def _strings(where: Path, field: str, value: object) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise field_error(where, field, "should be a list of strings", value)
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


def parse_manifest(path: Path) -> dict[str, Any]:
    """The JSON object in the manifest file ``path``: at most :data:`MAX_MANIFEST_BYTES`, no key twice, no NaN."""
    try:  # a FIFO is refused, never waited on; only what the file holds is allocated
        with os.fdopen(open_regular(path), "rb") as f:
            raw = f.read(min(os.fstat(f.fileno()).st_size, MAX_MANIFEST_BYTES) + 1)
    except OSError as exc:
        raise PackFormatError(f"manifest is unreadable: {exc.strerror}", path=path) from exc
    if len(raw) > MAX_MANIFEST_BYTES:
        raise PackFormatError(f"manifest is larger than {MAX_MANIFEST_BYTES >> 20} MiB", path=path, hint=MANIFEST_HINT)
    try:
        data = json.loads(
            raw.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite_float, object_pairs_hook=unique_keys
        )
    except RecursionError as exc:
        raise PackFormatError("manifest is nested too deeply to be a manifest", path=path, hint=MANIFEST_HINT) from exc
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, NaN, Infinity, 1e999
        raise PackFormatError(f"manifest is not valid JSON: {exc}", path=path, hint=MANIFEST_HINT) from exc
    if not isinstance(data, dict):
        raise PackFormatError(
            f"manifest should be a JSON object, but got a {type(data).__name__}", path=path, hint=MANIFEST_HINT
        )
    return data


def _shards(path: Path, value: object, staged: bool) -> list[ShardInfo]:
    if not isinstance(value, list) or not value:
        raise field_error(path, "shards", "should be a non-empty list of shard objects", value)
    shards: list[ShardInfo] = []
    names: set[str] = set()
    first = 0
    for i, item in enumerate(value):
        where = f"shards[{i}]"
        if not isinstance(item, dict):
            raise field_error(path, where, "should be an object", item)
        unknown = sorted(set(item) - _SHARD_KEYS)
        missing = sorted(_SHARD_KEYS - set(item))
        if unknown or missing:
            what = f"has an unknown key {unknown[0]!r}" if unknown else f"lacks the key {missing[0]!r}"
            raise field_error(path, where, f"{what} (keys are {', '.join(sorted(_SHARD_KEYS))})", sorted(item))
        file = item["file"]
        if staged and isinstance(file, str) and os.path.isabs(file):
            if os.path.normpath(file) != file or "\x00" in file:
                raise field_error(path, f"{where}.file", "should be a normalized absolute path", file)
            name = os.path.basename(file)
        else:
            name = file
        problem = plain_name_problem(name)
        if problem is not None:
            problem = f"{problem} inside the pack" + ("" if staged else " (only a staged pack names shards elsewhere)")
            raise field_error(path, f"{where}.file", problem, file)
        if name in names:
            raise field_error(path, f"{where}.file", "should name each shard once", file)
        names.add(name)
        count = _count(path, f"{where}.num_samples", item["num_samples"])
        start = _count(path, f"{where}.first_index", item["first_index"])
        if start != first:
            raise field_error(
                path, f"{where}.first_index", f"should be {first} (the samples of the shards before)", start
            )
        first += count
        size = _count(path, f"{where}.bytes", item["bytes"])
        sha = item["sha256"]
        if not is_sha256(sha):
            raise field_error(path, f"{where}.sha256", "should be 64 lowercase hex digits", sha)
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
        raise field_error(path, "index.dir", f"should name the sample index folder, not {taken[current]}", current)
    previous = index.get("previous")
    if previous is not None and (previous == current or previous in taken):
        what = "the current index folder (index.dir)" if previous == current else taken[previous]
        raise field_error(
            path, "index.previous", f"should name the index folder an append replaced, not {what}", previous
        )


def _field_counts(where: Path, counts: object, kind: object, fields: list[str], num_samples: int) -> dict[str, int]:
    """``field_counts``: each field of a multi-field pack -> how many of its samples hold it (0 to ``num_samples``)."""
    if not isinstance(counts, dict):
        raise field_error(where, "field_counts", "should be an object of field name -> sample count", counts)
    if counts and kind != "fields":
        raise field_error(where, "field_counts", "is for a pack of multi-field samples only", counts)
    names = ", ".join(fields)
    unknown = [name for name in counts if name not in fields]
    if unknown:
        raise field_error(where, "field_counts", f"should count only the manifest's fields ({names})", unknown[0])
    if counts and len(counts) != len(fields):
        raise field_error(where, "field_counts", f"should count each of the manifest's fields ({names})", list(counts))
    for name, n in counts.items():
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= num_samples:
            problem = f"should be an integer from 0 to num_samples ({num_samples})"
            raise field_error(where, f"field_counts.{name}", problem, n)
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
                hint=MANIFEST_HINT,
            )


def _check_index_sha256(where: Path, digests: object, kind: object) -> None:
    """``index.sha256``: each index file of a pack of ``kind`` -> 64 lowercase hex digits."""
    names = index_files(kind) if isinstance(kind, str) else ()
    if not isinstance(digests, dict) or set(digests) != set(names):
        problem = f"should be an object naming each index file once ({', '.join(names)})"
        raise field_error(where, "index.sha256", problem, digests)
    for name, digest in digests.items():
        if not is_sha256(digest):
            raise field_error(where, f"index.sha256.{name}", "should be 64 lowercase hex digits", digest)


def is_sha256(value: object) -> bool:
    """Whether ``value`` is a SHA-256 as packdata writes one: 64 lowercase hex digits."""
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _optional_dict(path: Path, data: dict[str, Any], key: str, *, nullable: bool = False) -> None:
    if key in data and not (isinstance(data[key], dict) or (nullable and data[key] is None)):
        raise field_error(path, key, "should be an object" + (" or null" if nullable else ""), data[key])


def _check_skipped(where: Path, skipped: dict[str, Any]) -> None:
    """The ``skipped`` object: a count, counts by reason, and the skip report's plain name (each optional)."""
    if "count" in skipped:
        _count(where, "skipped.count", skipped["count"])
    by_reason = skipped.get("by_reason", {})
    problem = "should be an object of reason -> count (an integer from 0 to 2**63-1)"
    if not isinstance(by_reason, dict):
        raise field_error(where, "skipped.by_reason", problem, by_reason)
    for reason, n in by_reason.items():
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= _MAX_INT:
            raise field_error(where, "skipped.by_reason", problem, {reason: n})
    if "count" in skipped and "by_reason" in skipped and sum(by_reason.values()) != skipped["count"]:
        # a merge or an append adds up the reasons: a lie here would become a miscount there
        problem = f"should add up to skipped.count ({skipped['count']})"
        raise field_error(where, "skipped.by_reason", problem, by_reason)
    report = skipped.get("report")
    if report is not None and plain_name_problem(report) is not None:
        raise field_error(where, "skipped.report", f"{plain_name_problem(report)} inside the pack", report)


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
        raise field_error(where, unknown[0], "is not a manifest field (a newer packdata may know it)", data[unknown[0]])
    for key in _REQUIRED:
        if key not in data:
            raise PackFormatError(f"manifest lacks the field {key!r}", path=where, hint=MANIFEST_HINT)
    version = data.get("format_version", SINGLE_FIELD_VERSION)
    _count(where, "format_version", version, minimum=1)
    for key in ("format", "kind", "packdata_version"):
        if key in data and not isinstance(data[key], str):
            raise field_error(where, key, "should be a string", data[key])
    staged_from = data.get("staged_from")
    if staged_from is not None and (
        not isinstance(staged_from, str) or not os.path.isabs(staged_from) or "\x00" in staged_from
    ):
        raise field_error(where, "staged_from", "should be an absolute path or null", staged_from)
    problem = classes_problem(data["classes"])
    if problem is not None:
        raise field_error(where, "classes", problem, data["classes"])
    classes = list(data["classes"])
    fields = _strings(where, "fields", data.get("fields", []))
    codecs = data.get("codecs", {})
    if not isinstance(codecs, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v in CODECS for k, v in codecs.items()
    ):
        raise field_error(where, "codecs", f"should map field names to one of {', '.join(CODECS)}", codecs)
    if data["kind"] == "fields" and (set(codecs) != set(fields) or len(set(fields)) != len(fields)):
        raise field_error(where, "codecs", "should name each of the manifest's fields once", codecs)
    num_samples = _count(where, "num_samples", data["num_samples"])
    field_counts = _field_counts(where, data.get("field_counts", {}), data["kind"], fields, num_samples)
    index = data.get("index", {})
    if not isinstance(index, dict) or not all(isinstance(v, str) for k, v in index.items() if k != "sha256"):
        raise field_error(where, "index", "should be an object of folder names (and sha256, of digests)", index)
    if "sha256" in index:
        _check_index_sha256(where, index["sha256"], data["kind"])
    for key in ("dir", "previous"):
        if key in index and plain_name_problem(index[key]) is not None:
            raise field_error(where, f"index.{key}", f"{plain_name_problem(index[key])} inside the pack", index[key])
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
            hint=MANIFEST_HINT,
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
