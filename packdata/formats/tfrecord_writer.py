"""The TFRecord shard writer: framed Examples appended to a shard, its ``.tfindex`` and its ``.tfpayload``.

The on-disk layout is described in :mod:`packdata.formats.tfrecord` (framing,
Example features, offsets index) and :mod:`packdata.formats.tfrecord_tables`
(the record table, whose header stays unset until the shard is complete).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import numpy as np

from packdata.errors import PackFormatError, unwritable_error
from packdata.formats.tfrecord_example import encode_with_span
from packdata.formats.tfrecord_framing import frame_record
from packdata.formats.tfrecord_reader import _CHUNK, TFRecordShardReader
from packdata.formats.tfrecord_tables import (
    _HEAD,
    _ROW,
    _TABLE_MAGIC,
    _TABLE_VERSION,
    SHARD_SUFFIX,
    index_path,
    payload_path,
    record_table_header,
)
from packdata.host.disks import FULL_DISK_ERRNOS, RERUN_HINT, no_space_error
from packdata.pack.files import atomic_write, fsync_named
from packdata.pack.manifest import ShardInfo
from packdata.pack.records import Sample

__all__ = ["TFRecordShardWriter"]


_OVERWRITE = "Start the conversion again with overwrite=True"
_UNFINISHED = _ROW.pack(_TABLE_MAGIC, _TABLE_VERSION, 0) + _ROW.pack(0, 0, 0)  # a record table being written


class TFRecordShardWriter:
    """Appends framed Examples to one shard, its offsets index and its record table.

    The file bytes are exactly what is written, so the shard's SHA-256 is
    computed as it is written. :meth:`sync` makes data and index durable (call
    it before recording a checkpoint); ``resume_at=k`` cuts both back to their
    first ``k`` records.
    """

    def __init__(self, path: str | os.PathLike, *, resume_at: int | None = None) -> None:
        self.path = Path(path)
        self.index_path = index_path(self.path)
        self.payload_path = payload_path(self.path)
        self._sha = hashlib.sha256()
        self.count = 0
        self.bytes = 0
        self._with_table = True  # False when resuming a shard whose record table is missing
        self._spans = True  # every row holds its payload's span (False once a multi-field record is written)
        if resume_at is not None:
            self._truncate(resume_at)
        else:
            try:
                self.path.write_bytes(b"")
                self.index_path.write_bytes(b"")
                self.payload_path.write_bytes(_UNFINISHED)  # header completed by close()
            except OSError as exc:
                where = exc.filename or self.path  # the file that failed: the shard, its index or record table
                if exc.errno in FULL_DISK_ERRNOS:  # named as any full disk a pack is written to
                    of = "(a new TFRecord shard, its index or record table)"
                    raise no_space_error(exc, where, folder=self.path.parent, of=of, hint=RERUN_HINT) from exc
                raise unwritable_error(exc, where) from exc
        self._file = open(self.path, "ab", buffering=1 << 20)  # noqa: SIM115 (closed in close())
        self._index = open(self.index_path, "ab")  # noqa: SIM115
        self._table = open(self.payload_path, "ab") if self._with_table else None  # noqa: SIM115

    @staticmethod
    def shard_name(number: int) -> str:
        """Temporary file name of shard ``number``; :meth:`finalize` gives the TF-style name."""
        return f"part-{number:05d}{SHARD_SUFFIX}"

    @staticmethod
    def finalize(pack: Path, shards: list[ShardInfo]) -> list[ShardInfo]:
        """Rename shards (and indexes) to ``NAME-00003-of-00016.tfrecord``.

        ``NAME`` is the pack's name without its suffix (``out.tfrecord`` and
        ``out`` give ``out``), or ``data``; ``pack`` may be the hidden
        ``.NAME.partial`` folder convert writes into. Repeatable: a file already
        under its final name (a run killed while renaming) is left there.
        """
        out = TFRecordShardWriter.final_shards(pack, shards)
        for shard, final in zip(shards, out, strict=True):
            old, new = Path(pack) / shard.file, Path(pack) / final.file
            for source, target, required in (
                (index_path(old), index_path(new), True),
                (payload_path(old), payload_path(new), False),
                (old, new, True),
            ):
                if source.exists() or (required and not target.exists()):
                    os.replace(source, target)
        return out

    @staticmethod
    def final_shards(pack: Path, shards: list[ShardInfo]) -> list[ShardInfo]:
        """``shards`` under the names :meth:`finalize` gives them; no file is touched."""
        name = Path(pack).name
        if name.startswith(".") and name.endswith(".partial"):
            name = name[1 : -len(".partial")]
        name = (name[: -len(Path(name).suffix)] if Path(name).suffix else name) or "data"
        count = len(shards)
        return [
            dataclasses.replace(shard, file=f"{name}-{number:05d}-of-{count:05d}{SHARD_SUFFIX}")
            for number, shard in enumerate(shards)
        ]

    def _truncate(self, keep: int) -> None:
        """Cut the shard, its offsets index and its record table back to their first ``keep`` records.

        The kept records are the pack's: every one is checked first (framing,
        CRC32C, its table row), and only then is anything cut; the index and
        table are replaced atomically, so a resume killed here can resume again.
        """
        try:
            lines = self.index_path.read_bytes().split(b"\n")
            size = self.path.stat().st_size
        except FileNotFoundError as exc:
            missing = os.path.basename(exc.filename)
            raise PackFormatError(
                f"the interrupted conversion's {missing} is missing", path=self.path, hint=_OVERWRITE
            ) from exc
        if len(lines) - 1 < keep:  # the last element follows the last newline
            raise PackFormatError(
                f"offsets index holds {len(lines) - 1} complete records, cannot resume at {keep}",
                path=self.index_path,
                hint=_OVERWRITE,
            )
        kept = b"".join(line + b"\n" for line in lines[:keep])
        try:
            listed = np.array([[int(v) for v in line.split()] for line in lines[:keep]], dtype=np.int64)
            offsets, lengths = listed.reshape(keep, 2).T
        except (ValueError, OverflowError) as exc:
            raise PackFormatError(
                "offsets index is damaged: a line is not two integers", path=self.index_path, hint=_OVERWRITE
            ) from exc
        if keep and (offsets[0] != 0 or (lengths < 16).any() or (offsets[1:] != offsets[:-1] + lengths[:-1]).any()):
            raise PackFormatError(
                "offsets index is damaged: its records do not follow one another", path=self.index_path, hint=_OVERWRITE
            )
        end = int(offsets[-1] + lengths[-1]) if keep else 0
        if size < end:
            raise PackFormatError(
                f"shard is shorter than its checkpoint ({end} bytes)", path=self.path, hint=_OVERWRITE
            )
        table = self.payload_path.read_bytes() if self.payload_path.is_file() else b""
        end_row = _HEAD + _ROW.size * keep
        rows = None  # written without a table (or by an older packdata, or it was lost): the shard is read by parsing
        if len(table) >= end_row and table[:16] == _UNFINISHED[:16]:  # this version's table: header unset until close()
            rows = np.frombuffer(table[_HEAD:end_row], dtype="<i8").reshape(-1, 3)
            multi = rows[:, 1] < 0  # a multi-field record's row: (offset, -1, -1)
            if (rows[:, 0] != offsets).any() or (rows[multi, 1:] != -1).any():
                raise PackFormatError(
                    "record table is damaged: a row does not start where its record does",
                    path=self.payload_path,
                    hint=_OVERWRITE,
                )
            self._spans = not multi.any()
        self._check_kept(offsets, lengths, keep, rows[:, 1:] if rows is not None and self._spans else None)
        os.truncate(self.path, end)
        atomic_write(self.index_path, kept)
        if rows is not None:
            atomic_write(self.payload_path, _UNFINISHED + table[_HEAD:end_row])
        else:
            self.payload_path.unlink(missing_ok=True)
            self._with_table = False
        with open(self.path, "rb") as f:
            while block := f.read(_CHUNK):
                self._sha.update(block)
        self.count, self.bytes = keep, end

    def _check_kept(self, offsets: np.ndarray, lengths: np.ndarray, keep: int, spans: np.ndarray | None) -> None:
        """Stream the kept records through the reader's checks (and, with ``spans``, each table row's payload span)."""
        reader = TFRecordShardReader(self.path)
        try:
            for _ in reader.stream(offsets, lengths, 0, keep, spans):
                pass
        except PackFormatError as exc:
            what = "payload table" if exc.path == reader.table else "shard"
            raise PackFormatError(
                f"the interrupted conversion's {what} is damaged: {exc.message}", path=exc.path, hint=_OVERWRITE
            ) from exc
        finally:
            reader.close()

    def write(self, items: list[tuple[int, Sample]]) -> None:
        """Append ``(index in shard, sample)`` pairs; indices must continue the shard."""
        lines = []
        rows = []
        for index, sample in items:
            if index != self.count:
                raise PackFormatError(f"record {index} is out of order (expected {self.count})", path=self.path)
            example, span = encode_with_span(sample)
            if span is None:  # a multi-field sample, no one payload: readers parse the Example
                self._spans = False
                rows.append(_ROW.pack(self.bytes, -1, -1))
            else:
                rows.append(_ROW.pack(self.bytes, *span))
            record = frame_record(example)
            self._file.write(record)
            self._sha.update(record)
            lines.append(f"{self.bytes} {len(record)}\n")
            self.bytes += len(record)
            self.count += 1
        self._index.write("".join(lines).encode("ascii"))
        if self._table is not None:
            self._table.write(b"".join(rows))

    def sync(self) -> None:
        """Make every record written so far durable, data before index."""
        for f in (self._file, self._index, self._table):
            if f is not None:
                f.flush()
                fsync_named(f.fileno(), f.name)

    def seal(self) -> None:
        """Nothing to do: the checksum and record tables grow with each write."""

    def close(self) -> tuple[int, str]:
        """Sync and close; the shard is complete. Returns its byte size and SHA-256."""
        self.sync()
        self._file.close()
        self._index.close()
        digest = self._sha.hexdigest()
        if self._table is not None:
            self._table.close()
            self._table = None
            with open(self.payload_path, "r+b") as f:  # the header makes the table valid
                f.write(record_table_header(self.count, self.bytes, digest, self._spans))
                f.flush()
                fsync_named(f.fileno(), f.name)
        return self.bytes, digest
