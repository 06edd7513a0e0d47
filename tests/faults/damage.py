"""Damage a built pack in a named way: the faults readers and ``verify`` must name, never read as data.

Each function takes a finished pack (LMDB or TFRecord) and damages shard 0 or
its side tables, returning the file it damaged, so a test can match that path
in the error. :data:`DAMAGES` maps a name to each.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
from conftest import flip_label

__all__ = ["DAMAGES", "shard_files"]


def _manifest(pack: Path) -> dict:
    return json.loads((pack / "manifest.json").read_text())


def shard_files(pack: Path, number: int = 0) -> dict[str, Path]:
    """The data file and side tables of shard ``number``: keys ``data``, ``table``, and ``index`` (TFRecord)."""
    manifest = _manifest(pack)
    shard = pack / manifest["shards"][number]["file"]
    if manifest["format"] == "lmdb":
        return {"data": shard / "data.mdb", "table": shard / "records.i64"}
    stem = shard.name[: -len(".tfrecord")]
    return {"data": shard, "table": shard.with_name(stem + ".tfpayload"), "index": shard.with_name(stem + ".tfindex")}


def truncate_shard(pack: Path, fraction: float = 0.5) -> Path:
    """Cut shard 0's data file to ``fraction`` of its size."""
    data = shard_files(pack)["data"]
    with open(data, "r+b") as f:
        f.truncate(int(data.stat().st_size * fraction))
    return data


def flip_payload_byte(pack: Path) -> Path:
    """Flip one bit in the middle of the payload of shard 0's last record (found from the real file)."""
    data = shard_files(pack)["data"]
    blob = bytearray(data.read_bytes())
    if _manifest(pack)["format"] == "lmdb":
        table = np.fromfile(shard_files(pack)["table"], dtype="<i8").reshape(-1, 3)
        offset, length = int(table[-1, 0]), int(table[-1, 1])
    else:
        offset, length = (int(v) for v in shard_files(pack)["index"].read_text().split()[-2:])
        offset, length = offset + 12, length - 16
    blob[offset + length // 2] ^= 0x04
    data.write_bytes(bytes(blob))
    return data


def sibling_table(pack: Path) -> Path:
    """Copy shard 1's side table (and offsets index) over shard 0's."""
    mine, sibling = shard_files(pack, 0), shard_files(pack, 1)
    for name in ("table", "index"):
        if name in mine:
            shutil.copyfile(sibling[name], mine[name])
    return mine["table"]


def _rewrite_table_rows(pack: Path, change: Callable[[np.ndarray], None]) -> Path:
    """Apply ``change`` to the per-record rows of shard 0's side table, header left valid.

    Both formats' tables are int64 triples after two header rows; column 0 is
    where the record (LMDB: its payload) lies in the data file.
    """
    table = shard_files(pack)["table"]
    raw = np.fromfile(table, dtype="<i8").reshape(-1, 3)
    change(raw[2:])
    raw.tofile(table)
    return table


def table_offset_past_end(pack: Path) -> Path:
    """Point record 1's row of shard 0's side table past the end of its file/record."""
    return _rewrite_table_rows(pack, lambda rows: rows.__setitem__((1, 0), 1 << 40))


def table_offset_negative(pack: Path) -> Path:
    """A negative offset in record 1's row of shard 0's side table."""
    return _rewrite_table_rows(pack, lambda rows: rows.__setitem__((1, 0), -64))


def table_offset_shifted(pack: Path) -> Path:
    """Shift record 1's row by 3 bytes: still in bounds, pointing at other bytes (a flipped bit)."""
    return _rewrite_table_rows(pack, lambda rows: rows.__setitem__((1, 0), rows[1, 0] + 3))


def index_offset_past_end(pack: Path) -> Path:
    """TFRecord: point record 1 of the offsets index past the end; LMDB: same as the side table."""
    files = shard_files(pack)
    if "index" not in files:
        return table_offset_past_end(pack)
    lines = files["index"].read_text().splitlines()
    lines[1] = f"{1 << 40} {lines[1].split()[1]}"
    files["index"].write_text("\n".join(lines) + "\n")
    return files["index"]


def swap_foreign_shard(pack: Path, foreign: Path) -> Path:
    """Replace shard 0's files with shard 0 of another pack ``foreign`` (same format)."""
    mine, theirs = shard_files(pack), shard_files(foreign)
    for name, path in mine.items():
        shutil.copyfile(theirs[name], path)
    return mine["data"]


def labels_out_of_range(pack: Path) -> Path:
    """Set sample 2's label in the index to one past the last class."""
    labels = pack / "index" / "labels.i32"
    raw = np.fromfile(labels, dtype="<i4")
    raw[2] = len(_manifest(pack)["classes"])
    raw.tofile(labels)
    return labels


DAMAGES: dict[str, Callable[[Path], Path]] = {
    "label_flipped": flip_label,  # still in range: only the index digest tells
    "truncate": truncate_shard,
    "flip_payload": flip_payload_byte,
    "sibling_table": sibling_table,
    "table_past_end": table_offset_past_end,
    "table_negative": table_offset_negative,
    "table_shifted": table_offset_shifted,
    "index_past_end": index_offset_past_end,
    "labels_out_of_range": labels_out_of_range,
}
