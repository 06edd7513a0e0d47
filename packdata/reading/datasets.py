"""Torch datasets over a pack: drop-ins for ``torchvision.datasets.ImageFolder``.

Datasets here know torch and the manifest, never the source folder. They hold
only paths, options and small plain data; every file handle, LMDB environment
and memory map opens lazily in the process that reads, so a dataset pickles
cheaply to ``spawn``-ed workers and a forked worker never uses its parent's
handles.
"""

from __future__ import annotations

import bisect
import functools
import operator
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, overload

import numpy as np
from torch.utils.data import Dataset
from zlib_ng.zlib_ng import crc32

from packdata.errors import ConfigError, DecodeError, ImageFormatError, PackFormatError, sample_error
from packdata.formats.lmdb import NAME as LMDB
from packdata.formats.lmdb_reader import LMDBShardReader
from packdata.pack.fields import FieldError, decode_block, read_directory
from packdata.pack.images import IMAGE_EXTENSIONS, decoding_sample
from packdata.pack.index import KeyList, LabelList
from packdata.pack.records import RecordError, decode_record
from packdata.pack.urls import display_url, is_url
from packdata.reading.decode import DecodeFn, resolve_decoder
from packdata.reading.fields import FieldSpec
from packdata.reading.pack_info import PackInfo
from packdata.reading.shard_readers import ShardReaders

__all__ = ["LMDBDataset", "PackView", "SampleList"]

_BYTES = resolve_decoder("bytes")


class SampleList(Sequence[tuple[str, int]]):
    """``(key, label)`` pairs over the index, read on access (a pack of 100 M samples is not listed in memory)."""

    def __init__(self, keys: KeyList, labels: np.ndarray) -> None:
        self._keys, self._labels = keys, labels

    def __len__(self) -> int:
        return len(self._keys)

    @overload
    def __getitem__(self, i: int) -> tuple[str, int]: ...
    @overload
    def __getitem__(self, i: slice) -> list[tuple[str, int]]: ...
    def __getitem__(self, i: int | slice) -> tuple[str, int] | list[tuple[str, int]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        key = self._keys[i]
        return key, int(self._labels[i % len(self)])


class PackView:
    """What every pack dataset shares: the pack, its ImageFolder attributes, decode and transforms.

    A pack of one image or text per sample reads as ``(sample, label)``; a
    multi-field pack reads as a dict (or a tuple, with ``fields``) built by
    its :class:`~packdata.reading.fields.FieldSpec`.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        expected_format: str,
        transform: Callable[[Any], Any] | None,
        target_transform: Callable[[int], Any] | None,
        decode: str | DecodeFn | Mapping[str, str | DecodeFn],
        fields: Sequence[str] | None = None,
        transforms: Mapping[str, Callable[[Any], Any]] | None = None,
        missing: Mapping[str, Any] | None = None,
        where: str | None = None,
    ) -> None:
        """``where``: the pack as errors name it (a URL whose manifest and index are cached at ``path``)."""
        self.pack = PackInfo(path, expected_format)
        self.pack.check_labels()
        self.path = self.pack.path
        self.where = where or os.fspath(self.path)  # the pack as errors name it: its URL for a cached copy
        self.transform = transform
        self.target_transform = target_transform
        manifest = self.pack.manifest
        self.field_spec: FieldSpec | None = None
        if manifest.kind == "fields":
            self.field_spec = FieldSpec(manifest, fields, decode, transforms, path=self.where, missing=missing)
            self.pack.index.keys.check()  # every sample carries its key: hashed here once, forked workers inherit it
            self.field_spec.check_present(self.pack)
            self.decode: DecodeFn = resolve_decoder("bytes")
        else:
            if fields is not None or transforms or missing is not None or isinstance(decode, Mapping):
                raise ConfigError(
                    f"fields, transforms, missing and per-field decode are for multi-field packs; this pack holds one "
                    f"{manifest.kind} per sample",
                    path=self.where,
                    hint="Use decode= and transform=",
                )
            if decode == "auto":  # the manifest says what the samples are
                decode = "text" if manifest.kind == "text" else "pil"
            self.decode = resolve_decoder(decode)  # type: ignore[arg-type]
        # a decode of an image names its sample in PIL's bomb warning (bytes returned as stored decode nothing)
        self._images = manifest.kind == "image" and self.decode is not _BYTES

    @property
    def _returned_as_stored(self) -> bool:
        """Samples are ``(payload bytes, label)`` as stored: no decode or transform layers to run.

        Read on every call: torchvision's habit of setting ``ds.transform`` after construction must hold.
        """
        return (
            self.field_spec is None
            and self.decode is _BYTES
            and self.transform is None
            and self.target_transform is None
        )

    @property
    def classes(self) -> list[str]:
        return self.pack.classes

    @property
    def class_to_idx(self) -> dict[str, int]:
        return self.pack.class_to_idx

    @property
    def targets(self) -> LabelList:
        """Every sample's label, like ImageFolder's ``list[int]`` (over the memory-mapped index: no record read)."""
        return LabelList(self.pack.index.labels)

    @property
    def keys(self) -> KeyList:
        """Every sample's key: its path relative to the source folder."""
        return self.pack.index.keys

    @property
    def samples(self) -> SampleList:
        """``(key, label)`` of every sample, like ImageFolder's ``samples`` (keys, not absolute file paths)."""
        return SampleList(self.pack.index.keys, self.pack.index.labels)

    @property
    def imgs(self) -> SampleList:
        """ImageFolder's other name for :attr:`samples`."""
        return self.samples

    @property
    def root(self) -> str:
        """The pack's path (ImageFolder's ``root`` is the image folder)."""
        return os.fspath(self.path)

    @property
    def loader(self) -> DecodeFn:
        """The decoder (ImageFolder's ``loader`` takes a file path; this takes the stored bytes)."""
        return self.decode

    @property
    def extensions(self) -> tuple[str, ...] | None:
        """The file extensions packed as images, for an image pack (else None)."""
        return tuple(sorted(IMAGE_EXTENSIONS)) if self.pack.manifest.kind == "image" else None

    def _which(self, index: int | None) -> str:
        """Sample ``index`` as messages name it (its key is read only then)."""
        return f"sample {self.keys[index]!r} (index {index})" if index is not None else "a sample"

    def _sample_index(self, index: int) -> int:
        """``index`` as a position in the pack (negative counts from the end), or IndexError (TypeError: not an int)."""
        n = self.pack.manifest.num_samples
        index = operator.index(index)  # 1.5 is no position (a float read as its int was another sample)
        if not -n <= index < n:
            raise IndexError(f"index {index} is out of range for a pack of {n} samples")
        return index % n

    def _finish(self, data: bytes, label: int, index: int | None = None) -> tuple[Any, Any]:
        """Decode and transform one sample (``index``: its position, to name it in errors and image warnings)."""
        token = decoding_sample.set(lambda: f"{self.where}: {self._which(index)}") if self._images else None
        try:
            sample = self.decode(data)
        except (ImageFormatError, DecodeError) as exc:
            raise sample_error(exc, self._which(index), self.where) from exc
        finally:
            if token is not None:
                decoding_sample.reset(token)
        if self.transform is not None:
            sample = self.transform(sample)
        target: Any = label
        if self.target_transform is not None:
            target = self.target_transform(label)
        return sample, target


def _rows_from_headers(pack: PackInfo, first: Sequence[int], shard: int, reader: LMDBShardReader) -> None:
    """A shard without a valid location table: let its reader take payload rows from its records' headers.

    It does once every record's key and label are the sample index's, so
    reads take the table's path, not a whole record each, checked one by one.
    """
    if reader.unbound:
        reader.rows_from_headers(functools.partial(_index_records, pack, first[shard]))


def _index_records(pack: PackInfo, first: int, a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Labels, key bytes and key lengths of samples ``first + a`` to ``first + b`` in the sample index."""
    keys = pack.index.keys.encoded_range(first + a, first + b)
    return None if keys is None else (np.asarray(pack.index.labels[first + a : first + b]), *keys)


class LMDBDataset(PackView, Dataset):
    """Map-style dataset over an LMDB pack: ``ds[i] -> (sample, label)``, or a dict for a multi-field pack.

    A drop-in for ``torchvision.datasets.ImageFolder``: ``classes``,
    ``class_to_idx``, ``targets`` and ``keys`` (paths relative to the source)
    come from the manifest and index without reading a record.

    Workers: nothing is opened in ``__init__`` but the manifest. Each process
    opens its own read-only LMDB handle (``lock=False``) on first access and
    reopens after a fork, so it works with ``num_workers > 0`` under ``fork``
    and ``spawn``, with ``persistent_workers=True``, after ``ds[0]`` in the
    parent, and next to a second dataset over the same pack in one process
    (they share one environment per shard). Decoding runs in the worker.

    Args:
        path: the pack (directory with ``manifest.json``).
        transform: applied to the decoded sample.
        target_transform: applied to the label.
        decode: ``"auto"`` (what the manifest says the samples are: RGB PIL
            image or str), ``"pil"``, ``"bytes"``, ``"text"``, or a callable on
            the bytes; for a multi-field pack also a mapping field -> decoder.
        fields: a multi-field pack: the field names to return, as a tuple in
            this order (``"__key__"``, ``"cls"`` included); default: a dict of
            the fields each sample holds. A field some samples lack is refused
            here (ConfigError naming it and how many lack it) unless ``missing`` gives it a value.
        transforms: a multi-field pack: field name -> transform after decoding.
        missing: a multi-field pack: field name -> the value a sample without
            that field reads in its place (as given: not decoded or transformed),
            e.g. ``{"txt": ""}``; with ``fields=None`` it is added to the dict.
        readahead: no effect, kept so older code runs: records are read with
            ``pread`` (or slices of a resident file), never through page faults.
        check_crc: check each payload's checksum as it is read (on by default, as
            for TFRecord; about 2 us per 40 KB, under 1% of a JPEG decode).
            Whatever it is set to, a read returns the complete payload of the
            record the index points at, or raises.
        verify: the older name of ``check_crc=True``.
    """

    pack_format = LMDB

    def __init__(
        self,
        path: str | os.PathLike,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        decode: str | DecodeFn | Mapping[str, str | DecodeFn] = "auto",
        *,
        fields: Sequence[str] | None = None,
        transforms: Mapping[str, Callable[[Any], Any]] | None = None,
        missing: Mapping[str, Any] | None = None,
        readahead: bool = False,
        check_crc: bool = True,
        verify: bool = False,
    ) -> None:
        if is_url(path):  # as a local path, "s3://b/x" would be the folder s3:/b/x
            raise ConfigError(
                f"{display_url(os.fspath(path))}: an LMDB pack is read through local files",
                hint="Stage it first: packdata.stage(url, to=DIR), then open the staged copy",
            )
        super().__init__(path, LMDB, transform, target_transform, decode, fields, transforms, missing)
        self.readahead = readahead
        self.check_crc = check_crc or verify
        shards = self.pack.manifest.shards
        self._first = [s.first_index for s in shards]
        self._first_array = np.asarray(self._first, dtype=np.int64)
        self._shard_paths = [os.fspath(s.path(self.path)) for s in shards]
        self._readers = ShardReaders(
            self._shard_paths,
            functools.partial(LMDBShardReader, check_crc=self.check_crc),
            [
                {"expected_bytes": s.bytes, "expected_sha256": s.sha256, "expected_records": s.num_samples}
                for s in shards
            ],
            self.pack.check_unchanged,
            functools.partial(_rows_from_headers, self.pack, tuple(self._first)),
        )

    def __len__(self) -> int:
        return self.pack.manifest.num_samples

    def raw(self, index: int) -> tuple[bytes, int]:
        """The stored bytes and label of sample ``index``, undecoded."""
        return self._raw_at(self._sample_index(index))

    def _raw_at(self, index: int) -> tuple[bytes, int]:
        """:meth:`raw` of a position already checked (``0 <= index < len(self)``)."""
        shard = bisect.bisect_right(self._first, index) - 1
        reader: LMDBShardReader = self._readers[shard]
        local = index - self._first[shard]
        payload = reader.payload(local)  # through the shard's own table: length and CRC32C checked
        if payload is not None:
            return payload, self.pack.index.labels.item(index)
        try:
            sample = decode_record(reader.get(local), check_crc=self.check_crc)
        except RecordError as exc:
            raise PackFormatError(
                f"record {index} is damaged: {exc}",
                path=self._shard_paths[shard],
                hint="Run `packdata verify` on the pack",
            ) from exc
        key, label = self.pack.index.keys[index], self.pack.index.labels.item(index)
        if sample.key != key or sample.label != label:
            raise PackFormatError(
                f"record {index} holds {sample.key!r} (label {sample.label}), the sample index says {key!r} "
                f"(label {label})",
                path=self._shard_paths[shard],
                hint="The pack is damaged or changed since the dataset was opened: run `packdata verify`, "
                "and recreate the dataset after converting a pack again",
            )
        return sample.data, label

    def raw_fields(self, index: int, names: Sequence[str] | None = None) -> dict[str, bytes]:
        """The stored bytes of fields ``names`` (default: all) of sample ``index`` of a multi-field pack.

        Only the fields asked for are read: through the shard's location table,
        the block's directory and then each field in its own ``pread``, each
        checked against its CRC-32 (unless ``check_crc=False``).

        Raises:
            PackFormatError: the record is damaged.
        """
        index = self._sample_index(index)
        shard = bisect.bisect_right(self._first, index) - 1
        reader: LMDBShardReader = self._readers[shard]
        local = index - self._first[shard]
        try:
            found = self._fields_by_span(reader, local, names, index)
            if found is None:
                block: bytes | memoryview | None = reader.payload(local)  # one pread, CRC32C-checked
                if block is None:
                    block, _ = self.raw(index)  # the whole record: its key, label and CRC checked
                found = decode_block(block, names, check_crc=self.check_crc)
        except (FieldError, RecordError) as exc:
            raise PackFormatError(
                f"record {index} is damaged: {exc}", path=self._shard_paths[shard], hint="Run `packdata verify`"
            ) from exc
        return found

    def _fields_by_span(
        self, reader: LMDBShardReader, local: int, names: Sequence[str] | None, index: int
    ) -> dict | None:
        """Some fields of sample ``index`` read span by span through the table, or None (read the whole block then).

        None too when the directory lacks a field asked for and its names and
        sizes are not the ones the sample index lists: the directory is not covered by the
        fields' CRC-32s, so a damaged name would read as a field the sample does
        not have; the whole block's CRC32C tells.
        """
        total = reader.payload_length(local)
        if names is None or total is None:
            return None
        head = reader.payload_span(local, 0, min(total, 512))
        entries = None if head is None else read_directory(head, total)
        if entries is None:
            return None
        held = {entry.name: entry.length for entry in entries}
        if not set(names) <= held.keys() and held != self.pack.index.sample_fields(index):
            return None  # a name missing may be a damaged directory, which no CRC covers: the whole block's tells
        out = {}
        for entry in entries:
            if entry.name in names:
                data = reader.payload_span(local, entry.start, entry.length)
                if data is None:
                    return None
                if self.check_crc and crc32(data) != entry.crc:
                    raise FieldError(f"field {entry.name!r}: CRC-32 does not match")
                out[entry.name] = data
        return out

    def __getitem__(self, index: int) -> Any:
        if self.field_spec is not None:
            return self._sample(index)
        position = self._sample_index(index)
        if self._returned_as_stored:
            return self._raw_at(position)
        return self._finish(*self._raw_at(position), index=position)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """A whole batch in one call (``DataLoader`` uses it): records read in pack order, labels looked up once.

        Returns the same samples, in the order asked, as ``[ds[i] for i in indices]``.
        """
        if self.field_spec is not None:
            return [self._sample(i) for i in indices]
        n = len(self)
        if not len(indices):
            return []
        if min(indices) < -n or max(indices) >= n:
            bad = next(i for i in indices if not -n <= i < n)
            raise IndexError(f"index {bad} is out of range for a pack of {n} samples")
        positions = np.asarray(indices)
        if positions.dtype.kind not in "iu":  # as ds[i] says it: not an int (numpy would cut 1.5 to 1)
            positions = np.asarray([self._sample_index(i) for i in indices], dtype=np.int64)
        positions = positions.astype(np.int64) % n
        labels = self.pack.index.labels[positions].tolist()
        payloads = self._batch_payloads(positions)
        plain = self._returned_as_stored
        if plain and None not in payloads:
            return list(zip(payloads, labels, strict=True))
        out: list[Any] = []
        for k, position in enumerate(positions.tolist()):
            payload = payloads[k]
            if payload is None:  # no valid location table: the whole record, with its own checks
                payload, _ = self.raw(position)
            out.append((payload, labels[k]) if plain else self._finish(payload, labels[k], index=position))
        return out

    def _batch_payloads(self, positions: np.ndarray) -> list[bytes | None]:
        """The payloads at ``positions`` (in range), None where a shard has no valid location table."""
        if len(self._first) == 1:
            return self._readers[0].payloads(positions)  # a warm map is read in any order alike
        order = positions.argsort(kind="stable")  # forward through the shards
        ordered = positions[order]
        shards = np.searchsorted(self._first_array, ordered, side="right") - 1
        local = ordered - self._first_array[shards]
        cuts = (np.flatnonzero(shards[1:] != shards[:-1]) + 1).tolist()
        flat: list[bytes | None]
        if 16 * (len(cuts) + 1) > len(positions):  # runs of a few records (a pack of many shards):
            readers = self._readers  # a call per run (~5 us) would cost more than the run
            flat = [readers[s].payload(i) for s, i in zip(shards.tolist(), local.tolist(), strict=True)]
        else:
            starts, ends = [0, *cuts], [*cuts, len(ordered)]
            flat = []
            for shard, a, b in zip(shards[starts].tolist(), starts, ends, strict=True):  # one call per shard's run
                flat += self._readers[shard].payloads(local[a:b])
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        return [flat[k] for k in inverse.tolist()]

    def _sample(self, index: int) -> Any:
        """A multi-field sample, decoded and transformed."""
        spec = self.field_spec
        assert spec is not None
        position = self._sample_index(index)
        stored = self.raw_fields(position, spec.stored)
        sample = spec.build(stored, self.keys[position], self.pack.index.labels.item(position), position)
        return self.transform(sample) if self.transform is not None else sample

    def __repr__(self) -> str:
        return f"LMDBDataset({os.fspath(self.path)!r}, samples={len(self)}, classes={len(self.classes)})"
