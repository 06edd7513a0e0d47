"""Read, write and validate a pack's manifest, the single source of truth.

``manifest.json`` sits at the top of every pack. It is small, human-readable
JSON: format version, packdata version, format, kind, classes, sample count, the
sample index folder and each index file's SHA-256, and per shard its file, sample
count, first global index, byte size and SHA-256. A pack without it is incomplete
by definition: convert writes it last and renames the pack into place only after.

``model`` holds :class:`Manifest` and its writer, ``schema`` the strict check of
its JSON, ``read`` the reader that also resolves every path it names.
"""

from __future__ import annotations

from packdata.pack.files import file_sha256
from packdata.pack.manifest.model import (
    CHECKSUM_KEY,
    FIELDS_VERSION,
    FORMAT_VERSION,
    MANIFEST_NAME,
    SINGLE_FIELD_VERSION,
    SKIP_REPORT,
    STAGED_FILE,
    Manifest,
    ShardInfo,
    evicted_mark,
    manifest_checksum,
    write_manifest,
)
from packdata.pack.manifest.read import read_manifest, resolve_in_pack
from packdata.pack.manifest.schema import (
    check_field_counts,
    classes_problem,
    first_repeated,
    is_sha256,
    plain_name_problem,
    unique_keys,
    validate_manifest,
)

__all__ = [
    "CHECKSUM_KEY",
    "FIELDS_VERSION",
    "FORMAT_VERSION",
    "SINGLE_FIELD_VERSION",
    "MANIFEST_NAME",
    "SKIP_REPORT",
    "STAGED_FILE",
    "Manifest",
    "ShardInfo",
    "check_field_counts",
    "classes_problem",
    "evicted_mark",
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
