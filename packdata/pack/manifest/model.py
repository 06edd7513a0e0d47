"""The manifest's model: :class:`Manifest` and :class:`ShardInfo`, its constants, checksum and writer."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packdata.pack.files import atomic_write

__all__ = [
    "CHECKSUM_KEY",
    "FIELDS_VERSION",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "SINGLE_FIELD_VERSION",
    "SKIP_REPORT",
    "STAGED_FILE",
    "Manifest",
    "ShardInfo",
    "evicted_mark",
    "manifest_checksum",
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
STAGED_FILE = "staged.json"
"""The marker ``packdata stage`` writes in a staged copy (written and read by :mod:`packdata.staging.marker`)."""


def evicted_mark(copy: str | os.PathLike) -> Path:
    """``.NAME.evicted`` beside the staged copy ``copy`` of a URL: an empty file a cache limit's eviction of the
    copy leaves (:func:`packdata.staging.cache.evict_for`), removed when a stage puts a copy there again, so that
    opening the copy names its eviction, not a missing pack."""
    copy = Path(copy)
    return copy.parent / f".{copy.name}.evicted"


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
