"""The part both TFRecord datasets share: a pack's shard layout, its shards' readers, and record parsing.

:class:`_TFRecordView` is the base of :class:`~packdata.reading.streaming.TFRecordDataset`
and :class:`~packdata.reading.tfrecord_indexed.TFRecordIndexedDataset`: it holds
per-shard facts from the manifest (paths, counts, first indices, sizes,
checksums), opens a shard's reader (the local file, or ranged requests to a pack
at a URL), loads a shard's record table, and parses and checks a record against
the sample index.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from packdata.errors import PackdataError, PackFormatError, raise_at_url
from packdata.formats.remote_pack import forget_skeleton
from packdata.formats.tfrecord import NAME as TFRECORD
from packdata.formats.tfrecord_parse import ParsedExample, example_fields, parse_example
from packdata.formats.tfrecord_reader import TFRecordShardReader
from packdata.formats.tfrecord_remote import RemoteShardReader, fetch_skeleton
from packdata.formats.tfrecord_tables import RecordTable, payload_path, shard_records
from packdata.pack.records import RecordError
from packdata.pack.urls import display_url, is_url, open_url
from packdata.reading.datasets import PackView
from packdata.reading.decode import DecodeFn

__all__: list[str] = []

_T = TypeVar("_T")


class _TFRecordView(PackView):
    """Shared by both TFRecord datasets: the shard layout and CRC option."""

    def __init__(
        self,
        path: str | os.PathLike,
        transform: Callable[[Any], Any] | None,
        target_transform: Callable[[int], Any] | None,
        decode: str | DecodeFn | Mapping[str, str | DecodeFn],
        check_crc: bool,
        fields: Sequence[str] | None = None,
        transforms: Mapping[str, Callable[[Any], Any]] | None = None,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | os.PathLike | None = None,
        missing: Mapping[str, Any] | None = None,
    ) -> None:
        self._url: str | None = None
        self._storage_options = storage_options
        if is_url(path):  # shards stream from object storage; the manifest and index come from a local copy
            self._url = os.fspath(path).rstrip("/")
        where = display_url(self._url) if self._url else None
        for may_retry in (True, False):
            local = fetch_skeleton(self._url, storage_options, cache_dir) if self._url else path
            try:
                super().__init__(
                    local, TFRECORD, transform, target_transform, decode, fields, transforms, missing, where
                )
                self.pack.index.keys.check()  # every record read is matched to its key: hashed here, not per worker
                break
            except PackFormatError as exc:  # a cached copy's index damaged since it was downloaded: once more
                if not (self._url and may_retry and exc.path and Path(exc.path).is_relative_to(local)):
                    raise_at_url(exc, local, where)
                forget_skeleton(Path(local))
            except PackdataError as exc:
                raise_at_url(exc, local, where)
        self.check_crc = check_crc
        shards = self.pack.manifest.shards
        self._shard_paths = [os.fspath(s.path(self.path)) for s in shards]
        self._counts = np.array([s.num_samples for s in shards], dtype=np.int64)
        self._first = np.array([s.first_index for s in shards], dtype=np.int64)
        self._sha256 = [s.sha256 for s in shards]
        self._bytes = [s.bytes for s in shards]

    def _named(self, items: Iterator[_T]) -> Iterator[_T]:
        """``items``; an error they raise that names a file of a pack's cached copy names it by its URL instead.

        A record found damaged in a pack at a URL may be a damaged side table
        of the cached copy (one its stamps cannot tell: changed within the
        timestamp tick, or by a failing disk): the copy is marked not to be
        reused, so the dataset made again reads a fresh one.
        """
        try:
            yield from items
        except PackdataError as exc:
            if self._url and isinstance(exc, PackFormatError):
                forget_skeleton(Path(self.path))
            raise_at_url(exc, self.path, display_url(self._url) if self._url else None)

    def _load_records(self, shard: int, payloads: bool) -> RecordTable:
        """Shard ``shard``'s records: its record table mapped where valid, else its ``.tfindex`` parsed."""
        path, count = self._shard_paths[shard], int(self._counts[shard])
        return shard_records(path, count, self._bytes[shard], self._sha256[shard], payloads=payloads)

    def _shard_reader(self, shard: int) -> TFRecordShardReader:
        """The reader of one shard: the local file, or ranged requests to the remote one."""
        if self._url is None:
            return TFRecordShardReader(
                self._shard_paths[shard], check_crc=self.check_crc, expected_bytes=self._bytes[shard]
            )
        fs, root = open_url(self._url, self._storage_options)
        name = self.pack.manifest.shards[shard].file
        shown = f"{display_url(self._url)}/{name}"
        remote = f"{root.rstrip('/')}/{name}"
        return RemoteShardReader(
            fs,
            remote,
            shown,
            self._bytes[shard],
            check_crc=self.check_crc,
            opened=self.pack.manifest,
            table=payload_path(self._shard_paths[shard]),  # in the cached copy
        )

    def _parse(self, data: memoryview | bytes, path: str, offset: int, index: int) -> tuple[memoryview, int]:
        """Payload and label of sample ``index``'s record (a multi-field pack: the whole Example); labels must agree."""
        try:
            if self.field_spec is not None:
                _, label, key = example_fields(data)
                if key != self.keys[index]:
                    raise RecordError(f"it holds key {key!r}, the sample index says {self.keys[index]!r}")
                parsed = ParsedExample(memoryview(data), label, b"", "fields")
            else:
                parsed = parse_example(data)
                if parsed.key != self.pack.index.keys.encoded(index):  # as multi-field and LMDB reads check
                    held = parsed.key.decode("utf-8", "backslashreplace")
                    raise RecordError(f"it holds key {held!r}, the sample index says {self.keys[index]!r}")
        except RecordError as exc:
            raise PackFormatError(
                f"record {index} at byte offset {offset} is damaged: {exc}",
                path=path,
                hint="Run `packdata verify` on the pack, then convert or stage it again",
            ) from exc
        expected = self.pack.index.labels.item(index)
        if parsed.label != expected:
            raise PackFormatError(
                f"record {index} at byte offset {offset} has label {parsed.label}, the sample index says {expected}",
                path=path,
                hint="The pack is damaged or changed since the dataset was opened: run `packdata verify`, "
                "and recreate the dataset after converting a pack again",
            )
        return parsed.data, parsed.label

    def _finish(self, data: bytes, label: int, index: int | None = None) -> Any:
        if self.field_spec is None:
            return super()._finish(data, label, index)
        fields, label, key = example_fields(data)
        stored = {name: value for name, value in fields.items() if self.field_spec.wants(name)}
        sample = self.field_spec.build(stored, key, label, index)
        return self.transform(sample) if self.transform is not None else sample
