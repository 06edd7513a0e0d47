"""An LMDB shard's environment: its data file's name, its keys, and the readers its lock file makes room for.

Only the writer (:mod:`packdata.formats.lmdb_writer`) opens LMDB; readers
locate and read records themselves (:mod:`packdata.formats.lmdb_reader`).
"""

from __future__ import annotations

import struct

__all__ = ["DATA_FILE", "MAX_READERS", "encode_key"]

DATA_FILE = "data.mdb"
MAX_READERS = 2048
_KEY = struct.Struct(">Q")


def encode_key(index: int) -> bytes:
    """The LMDB key of the record at ``index`` within its shard: 8 bytes, big-endian."""
    return _KEY.pack(index)
