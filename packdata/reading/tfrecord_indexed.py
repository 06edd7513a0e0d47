"""Map-style access to a TFRecord pack: :class:`TFRecordIndexedDataset`, one positioned read per sample."""

from __future__ import annotations

import bisect
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch.utils.data import Dataset

from packdata.errors import ConfigError
from packdata.formats.tfrecord import NAME as TFRECORD
from packdata.formats.tfrecord_reader import TFRecordShardReader
from packdata.formats.tfrecord_tables import RecordTable, has_record_table, parse_records, shard_records
from packdata.pack.urls import display_url, is_url
from packdata.reading.decode import DecodeFn
from packdata.reading.shard_readers import ShardReaders
from packdata.reading.tfrecord_view import _TFRecordView

__all__ = ["TFRecordIndexedDataset"]


class _IndexedShard(TFRecordShardReader):
    """A shard's reader holding this process's record table: ``parsed`` (given), else mapped and checked now."""

    def __init__(
        self,
        path: str,
        *,
        check_crc: bool,
        payloads: bool,
        expected_bytes: int,
        count: int,
        sha256: str,
        parsed: RecordTable | None,
    ) -> None:
        super().__init__(path, check_crc=check_crc, expected_bytes=expected_bytes)
        self.records = (
            parsed if parsed is not None else shard_records(path, count, expected_bytes, sha256, payloads=payloads)
        )


class TFRecordIndexedDataset(_TFRecordView, Dataset):
    """Map-style access to a TFRecord pack: ``ds[i] -> (sample, label)`` through each shard's record table.

    Each access is one positioned read (``os.pread``) of one record, its
    framing and (by default) CRCs checked, so any sampler works:
    ``DistributedSampler``, class-balanced samplers, or
    :class:`~packdata.reading.samplers.BlockShuffleSampler` for reads in long runs.
    ``classes``, ``class_to_idx``, ``targets`` and ``keys`` come from the
    manifest and sample index without reading a record.

    Workers: the dataset pickles only paths, options and per-shard facts.
    Each process opens a shard on its first read of it (keyed by
    ``os.getpid()``): the file descriptor, and the shard's ``.tfpayload``
    record table (offsets and payload spans), memory-mapped and checked whole
    in numpy. Every worker shares the page cache's copy of the tables, so
    memory does not grow with samples x workers; nothing opened is used
    across a fork, and ``ds[0]`` in the parent before workers start is fine.
    Shards without a valid record table (written by another tool or an older
    packdata) have their ``.tfindex`` parsed in ``__init__`` into int64
    arrays (16-32 bytes per sample, pickled to ``spawn``-ed workers): convert
    such a pack again to share its tables.

    Args:
        path: the pack (directory with ``manifest.json``).
        transform: applied to the decoded sample.
        target_transform: applied to the label.
        decode: ``"auto"`` (by the manifest's kind), ``"pil"``, ``"bytes"``,
            ``"text"``, or a callable on the bytes; a multi-field pack also takes
            a mapping field -> decoder (see :class:`~packdata.LMDBDataset`).
        check_crc: check both CRC32Cs of every record (framing is always checked).
        fields, transforms, missing: a multi-field pack's fields to return,
            per-field transforms and values for fields a sample lacks, as for :class:`~packdata.LMDBDataset`.
    """

    pack_format = TFRECORD

    def __init__(
        self,
        path: str | os.PathLike,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        decode: str | DecodeFn | Mapping[str, str | DecodeFn] = "auto",
        *,
        check_crc: bool = True,
        fields: Sequence[str] | None = None,
        transforms: Mapping[str, Callable[[Any], Any]] | None = None,
        missing: Mapping[str, Any] | None = None,
    ) -> None:
        if is_url(path):
            raise ConfigError(
                f"{display_url(os.fspath(path))}: random access reads local shards",
                hint="Stream it with TFRecordDataset(url), or stage it first: packdata.stage(url, to=DIR)",
            )
        _TFRecordView.__init__(
            self, path, transform, target_transform, decode, check_crc, fields, transforms, missing=missing
        )
        # with CRCs off, records are parsed instead: the parse checks their structure and label
        payloads = self.field_spec is None and check_crc
        kwargs = []
        for shard, path_ in enumerate(self._shard_paths):
            facts = (int(self._counts[shard]), self._bytes[shard], self._sha256[shard])
            # a shard without a valid record table (an older pack) is parsed once, here
            parsed = None if has_record_table(path_, *facts) else parse_records(path_, *facts, payloads=payloads)
            kwargs.append({"count": facts[0], "expected_bytes": facts[1], "sha256": facts[2], "parsed": parsed})
        self._first_list: list[int] = self._first.tolist()
        self._readers = ShardReaders(
            self._shard_paths,
            functools.partial(_IndexedShard, check_crc=check_crc, payloads=payloads),
            kwargs,
            self.pack.check_unchanged,
        )

    def __len__(self) -> int:
        return self.pack.manifest.num_samples

    def raw(self, index: int) -> tuple[bytes, int]:
        """The stored bytes and label of sample ``index``, undecoded."""
        return self._raw_at(self._sample_index(index))

    def _raw_at(self, index: int) -> tuple[bytes, int]:
        """:meth:`raw` of a position already checked (``0 <= index < len(self)``)."""
        shard = bisect.bisect_right(self._first_list, index) - 1  # a Python list: numpy's scalar calls cost more
        reader: _IndexedShard = self._readers[shard]
        offset, length, span = reader.records.record(index - self._first_list[shard])
        if span is not None:  # written by packdata: the payload sliced out, the label from the index (as streams do)
            return reader.read_payload(offset, length, span), self.pack.index.labels.item(index)
        data = reader.read(offset, length)
        view, label = self._parse(data, self._shard_paths[shard], offset, index)
        return bytes(view), label

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        position = self._sample_index(index)
        if self._returned_as_stored:
            return self._raw_at(position)
        return self._finish(*self._raw_at(position), index=position)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """A whole batch in one call: records read in file order, returned in the order asked."""
        positions = [self._sample_index(i) for i in indices]
        out: list[Any] = [None] * len(positions)
        for k in sorted(range(len(positions)), key=positions.__getitem__):
            out[k] = self._finish(*self._raw_at(positions[k]), index=positions[k])
        return out

    def __del__(self) -> None:
        if hasattr(self, "_readers"):
            self._readers.close()

    def __repr__(self) -> str:
        return f"TFRecordIndexedDataset({os.fspath(self.path)!r}, samples={len(self)}, classes={len(self.classes)})"
