"""A TFRecord shard's side tables: the ``.tfindex`` offsets index (the tfrecord package's
and DALI's) and packdata's ``.tfpayload`` payload table, each checked against its shard.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from packdata.errors import PackFormatError

__all__ = [
    "INDEX_SUFFIX",
    "PAYLOAD_SUFFIX",
    "SHARD_SUFFIX",
    "index_path",
    "payload_path",
    "read_index",
    "read_payload_table",
]


SHARD_SUFFIX = ".tfrecord"
INDEX_SUFFIX = ".tfindex"


PAYLOAD_SUFFIX = ".tfpayload"


_PAIR = struct.Struct("<qq")


def index_path(shard: str | os.PathLike) -> Path:
    """The offsets index beside a shard: ``x.tfrecord`` -> ``x.tfindex``."""
    shard = Path(shard)
    stem = shard.name[: -len(SHARD_SUFFIX)] if shard.name.endswith(SHARD_SUFFIX) else shard.name
    return shard.with_name(stem + INDEX_SUFFIX)


def payload_path(shard: str | os.PathLike) -> Path:
    """The payload table beside a shard: ``x.tfrecord`` -> ``x.tfpayload``."""
    shard = Path(shard)
    stem = shard.name[: -len(SHARD_SUFFIX)] if shard.name.endswith(SHARD_SUFFIX) else shard.name
    return shard.with_name(stem + PAYLOAD_SUFFIX)


def _sha_prefix(sha256_hex: str) -> int:
    return int.from_bytes(bytes.fromhex(sha256_hex[:16]), "little", signed=True)


def read_payload_table(
    shard: str | os.PathLike, count: int, sha256_hex: str, lengths: np.ndarray | None = None
) -> np.ndarray | None:
    """``(count, 2)`` int64 array of payload ``(offset in data, length)``, or None if absent or stale.

    Valid only when the header matches ``count`` and the shard's SHA-256 (from
    the manifest) and, given the records' framed ``lengths``, every span lies
    inside its record's data (checked once, here).
    """
    try:
        raw = payload_path(shard).read_bytes()
    except OSError:
        return None
    if len(raw) != _PAIR.size * (count + 1) or not sha256_hex or len(sha256_hex) < 16:
        return None
    try:
        if _PAIR.unpack_from(raw, 0) != (count, _sha_prefix(sha256_hex)):
            return None
    except ValueError:
        return None
    table = np.frombuffer(raw, dtype="<i8").reshape(-1, 2)[1:].astype(np.int64)
    if lengths is not None and count:
        at, m = table[:, 0], table[:, 1]
        if len(lengths) != count or at.min() < 0 or m.min() < 0 or ((at + m) > (lengths - 16)).any():
            return None
    return table


def read_index(shard: str | os.PathLike, *, size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets, lengths)`` of every record of a shard, from its ``.tfindex``, as int64 arrays.

    Given the shard's byte ``size``, the records must also tile the file exactly:
    the first at 0, each starting where the previous ends, each at least 16
    bytes, the last ending at ``size`` (checked once, in numpy).

    Raises:
        PackFormatError: the index is missing or malformed, or does not fit a shard of ``size`` bytes.
    """
    path = index_path(shard)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise PackFormatError(
            f"cannot read the shard's offsets index: {exc.strerror or exc}",
            path=path,
            hint="Convert or stage the pack again",
        ) from exc
    try:
        table = np.array(raw.split(), dtype=np.int64).reshape(-1, 2)
    except (ValueError, OverflowError) as exc:
        raise PackFormatError(f"offsets index is malformed: {exc}", path=path, hint="Convert the pack again") from exc
    offsets, lengths = np.ascontiguousarray(table[:, 0]), np.ascontiguousarray(table[:, 1])
    if size is not None:
        ends = np.cumsum(lengths)
        starts = ends - lengths
        bad = np.flatnonzero((lengths < 16) | (offsets != starts))
        if len(bad) or (ends[-1] if len(ends) else 0) != size:
            where = f"line {int(bad[0]) + 1} ({int(offsets[bad[0]])} {int(lengths[bad[0]])})" if len(bad) else "its end"
            raise PackFormatError(
                f"offsets index does not tile the {size}-byte shard: {where} is not where the records are",
                path=path,
                hint="The index is damaged or belongs to another shard: convert or stage the pack again",
            )
    return offsets, lengths
