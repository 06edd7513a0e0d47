"""Read, write and validate a pack's manifest, the single source of truth.

``manifest.json`` sits at the top of every pack. It is small, human-readable
JSON: format version, packdata version, format, kind, classes, sample count, the
sample index files, and per shard its file, sample count, first global index,
byte size and SHA-256. A pack without it is incomplete by definition: convert
writes it last and renames the pack into place only after.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packdata.errors import PackFormatError

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "Manifest",
    "ShardInfo",
    "file_sha256",
    "read_manifest",
    "write_manifest",
]

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"


@dataclass
class ShardInfo:
    """One shard: ``file`` is relative to the pack, or absolute once staged."""

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
    index: dict[str, str] = field(default_factory=dict)
    fields: list[str] = field(default_factory=list)
    reencode: dict[str, Any] | None = None
    skipped: dict[str, Any] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    packdata_version: str = ""

    @property
    def total_bytes(self) -> int:
        """Sum of the shards' byte sizes."""
        return sum(s.bytes for s in self.shards)

    def to_dict(self) -> dict[str, Any]:
        """The manifest as plain JSON-ready data."""
        return dataclasses.asdict(self)


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 hex digest of a file, read in large blocks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(pack: str | os.PathLike, manifest: Manifest) -> Path:
    """Write ``manifest.json`` into ``pack`` atomically (temporary file, fsync, rename)."""
    from packdata import __version__

    manifest.packdata_version = manifest.packdata_version or __version__
    path = Path(pack) / MANIFEST_NAME
    tmp = path.with_name(f".{MANIFEST_NAME}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest.to_dict(), f, indent=1, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_manifest(pack: str | os.PathLike) -> Manifest:
    """Read and validate a pack's manifest.

    Raises:
        PackFormatError: the path is missing, is not a pack, is damaged, or was
            written by a newer packdata.
    """
    pack = Path(pack)
    path = pack / MANIFEST_NAME
    if not path.is_file():
        hint = "Convert a folder with `packdata convert SRC DST` first"
        if (pack.parent / f".{pack.name}.partial").exists():
            hint = "A conversion into it was interrupted: rerun it with --resume"
        problem = f"not a packdata pack (no {MANIFEST_NAME})" if pack.exists() else "no such pack"
        raise PackFormatError(problem, path=pack, hint=hint)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        version = int(data.get("format_version", 0))
    except (OSError, ValueError, AttributeError) as exc:
        raise PackFormatError(f"manifest is unreadable: {exc}", path=path) from exc
    if version > FORMAT_VERSION:
        raise PackFormatError(
            f"pack format version {version} is newer than this packdata reads ({FORMAT_VERSION})",
            path=pack,
            hint="Upgrade packdata: pip install -U packdata",
        )
    try:
        data["shards"] = [ShardInfo(**s) for s in data["shards"]]
        manifest = Manifest(**data)
    except (KeyError, TypeError) as exc:
        raise PackFormatError(f"manifest is malformed: {exc}", path=path) from exc
    counted = sum(s.num_samples for s in manifest.shards)
    if counted != manifest.num_samples:
        raise PackFormatError(
            f"manifest is inconsistent: shards hold {counted} samples, but num_samples={manifest.num_samples}",
            path=path,
        )
    return manifest
