"""A resume's check that the shards its checkpoint lists are on disk as the interrupted run closed them."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from packdata.errors import PackFormatError
from packdata.formats import get_format
from packdata.pack.files import file_kind, file_sha256
from packdata.pack.manifest import ShardInfo

__all__ = ["check_shard_files"]


def check_shard_files(
    partial: Path,
    fmt: str,
    shards: list[ShardInfo],
    final: list[ShardInfo],
    *,
    records: bool = False,
    digests: bool = False,
) -> None:
    """Each shard's data file is a regular file of the size closing it recorded (a resume trusts no earlier run's),
    with ``records`` holds the records it lists, and with ``digests`` has the SHA-256 it lists.

    A resume checks the shards its checkpoint lists so (the manifest lists that SHA-256: a shard damaged since, same
    size and other bytes, is never published), at the cost of reading them once, as a verify does, before packing.
    A shard is under its name while written or, once a killed run renamed it, its ``final`` name.

    Raises:
        PackFormatError: a shard file is missing, not a regular file, or of another size, record count or SHA-256.
    """
    data_name = get_format(fmt).data_name
    for shard, named in zip(shards, final, strict=True):
        path = partial / data_name(shard.file)
        if not os.path.lexists(path):
            path = partial / data_name(named.file)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise _shard_changed(partial / data_name(shard.file), "is missing") from None
        if not stat.S_ISREG(st.st_mode) or st.st_size != shard.bytes:
            raise _shard_changed(path, f"is {file_kind(st.st_mode)} of {st.st_size} bytes, closed at {shard.bytes}")
        if records and (held := get_format(fmt).closed_records(path)) != shard.num_samples:
            raise _shard_changed(path, f"holds {held} records, but progress.json lists it with {shard.num_samples}")
        if digests and (digest := file_sha256(path)) != shard.sha256:
            raise _shard_changed(
                path,
                f"holds other bytes than progress.json lists (SHA-256 {digest}, listed as {shard.sha256})",
                hint="A resume cannot continue past a damaged shard: start the conversion again with overwrite=True",
            )


def _shard_changed(
    path: Path, what: str, hint: str = "Start the conversion again with overwrite=True"
) -> PackFormatError:
    return PackFormatError(f"a shard of the interrupted conversion {what}", path=path, hint=hint)
