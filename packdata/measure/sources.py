"""The datasets bench reads besides the packs: the raw folder and the in-memory ceiling, and :func:`open_source`."""

from __future__ import annotations

import os
import stat
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from packdata.conversion.sources import SourceFile, scan_source
from packdata.errors import ConfigError, DecodeError, ImageFormatError, SourceError
from packdata.pack.files import file_kind, source_mode
from packdata.pack.manifest import MANIFEST_NAME, read_manifest
from packdata.reading.crop import DecodeCrop
from packdata.reading.decode import DecodeFn, DecodeJPEG, resolve_decoder
from packdata.reading.open import open_dataset

__all__ = ["DECODE_CHOICES", "FolderDataset", "InMemoryDataset", "check_source", "open_source"]


class _Blob:
    """Many byte strings in one numpy buffer plus offsets (no per-item Python objects)."""

    def __init__(self, items: Iterable[bytes]) -> None:
        chunks = list(items)
        self.offsets = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum([len(c) for c in chunks], out=self.offsets[1:])
        self.data = np.frombuffer(b"".join(chunks), dtype=np.uint8)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> bytes:
        return self.data[self.offsets[i] : self.offsets[i + 1]].tobytes()


class FolderDataset(Dataset):
    """The raw folder as ``torchvision.datasets.ImageFolder`` reads it: one file per sample.

    Files and labels come from :func:`packdata.conversion.sources.scan_source` (the same
    rules and order as ``convert``); the list is kept as one byte buffer and
    numpy arrays, so forked workers do not copy it on access. Files the walk
    skips (hidden, other kinds) are counted in ``skipped``.

    Workers: nothing is held open; each ``__getitem__`` opens, reads and closes its file.

    Args:
        root: the folder.
        transform: applied to the decoded sample.
        decode: ``"pil"``, ``"bytes"``, ``"text"`` or a callable on the bytes.
        kind: ``"image"``, ``"text"`` or ``"auto"``.

    Raises:
        SourceError: the folder is missing or holds no usable file.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        transform: Callable[[Any], Any] | None = None,
        decode: str | DecodeFn = "pil",
        *,
        kind: str = "auto",
    ) -> None:
        source = scan_source(root, kind)
        self.root = source.root
        self.kind = source.kind
        self.classes = source.classes
        self.transform = transform
        self.decode = resolve_decoder(decode)
        paths: list[bytes] = []
        labels: list[int] = []
        total = 0
        self.skipped: Counter[str] = Counter()
        for entry in source.walk():
            if isinstance(entry, SourceFile):
                paths.append(os.fsencode(entry.path))
                labels.append(entry.label)
                try:
                    total += os.stat(entry.path).st_size
                except OSError:
                    self.skipped["unreadable"] += 1
            else:
                self.skipped[entry.reason] += 1
        if not paths:
            raise SourceError(f"no {self.kind} files found", path=self.root, hint="Check the folder and kind=KIND")
        self._paths = _Blob(paths)
        self.targets = np.asarray(labels, dtype=np.int32)
        self.mean_bytes = total / len(paths)

    def __len__(self) -> int:
        return len(self.targets)

    def raw(self, index: int) -> tuple[bytes, int]:
        """The file's bytes and label."""
        with open(os.fsdecode(self._paths[index]), "rb") as f:
            return f.read(), int(self.targets[index])

    def __getitem__(self, index: int) -> tuple[Any, int]:
        data, label = self.raw(index)
        try:
            sample = self.decode(data)
        except (ImageFormatError, DecodeError) as exc:  # name the file: the folder may hold thousands
            path = os.fsdecode(self._paths[index])
            if isinstance(exc, ImageFormatError):  # its detected format kept, as sample_error keeps it
                raise ImageFormatError(exc.message, path=path, hint=exc.hint, detected=exc.detected) from exc
            raise DecodeError(exc.message, path=path, hint=exc.hint) from exc
        if self.transform is not None:
            sample = self.transform(sample)
        return sample, label


class InMemoryDataset(Dataset):
    """Samples whose encoded bytes are already in memory: decode and transform only.

    The decode ceiling: what a loader reaches when reading costs nothing. The
    bytes sit in one numpy buffer, shared by forked workers.

    Args:
        samples: ``(bytes, label)`` pairs.
        transform: applied to the decoded sample.
        decode: ``"pil"``, ``"bytes"``, ``"text"`` or a callable on the bytes.
        length: the dataset's length when larger than the samples held: index
            ``i`` is held sample ``i % held``. An epoch of the ceiling then has
            as many batches as the source's it stands beside, so a loader's
            workers start as often in both (1,024 samples held, no more, made
            the ceiling's epoch 16 batches: with workers that are not
            persistent, it measured their start-up more than the decode).
    """

    def __init__(
        self,
        samples: Iterable[tuple[bytes, int]],
        transform: Callable[[Any], Any] | None = None,
        decode: str | DecodeFn = "pil",
        length: int | None = None,
    ) -> None:
        pairs = list(samples)
        self._data = _Blob(data for data, _ in pairs)
        self.targets = np.asarray([label for _, label in pairs], dtype=np.int32)
        self.held = len(pairs)
        self._length = max(self.held, length or 0) if self.held else 0
        self.transform = transform
        self.decode = resolve_decoder(decode)
        self.mean_bytes = float(self._data.offsets[-1]) / max(len(pairs), 1)

    @classmethod
    def from_dataset(
        cls,
        dataset: Any,
        *,
        max_samples: int = 1024,
        max_bytes: int = 256 << 20,
        transform: Callable[[Any], Any] | None = None,
        decode: str | DecodeFn = "pil",
    ) -> InMemoryDataset:
        """Copy the raw bytes of up to ``max_samples`` samples, spread over ``dataset``, as long as ``dataset``.

        ``dataset`` needs a ``raw(index) -> (bytes, label)`` method (the pack and
        folder datasets have one).
        """
        n = len(dataset)
        picks: Any = np.unique(np.linspace(0, n - 1, num=min(n, max_samples)).astype(np.int64)) if n else []
        pairs: list[tuple[bytes, int]] = []
        size = 0
        for index in picks:
            data, label = dataset.raw(int(index))
            pairs.append((data, label))
            size += len(data)
            if size >= max_bytes:
                break
        return cls(pairs, transform, decode, length=n)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> tuple[Any, int]:
        if not -self._length <= index < self._length:
            raise IndexError(f"index {index} is out of range for {self._length} samples")
        index = index % self._length % self.held
        sample = self.decode(self._data[index])
        if self.transform is not None:
            sample = self.transform(sample)
        return sample, int(self.targets[index])


DECODE_CHOICES = ("bytes", "pil", "reduced", "crop")
"""What ``decode`` may name in bench and tune (or pass a callable): stored bytes, full PIL decode, reduced
decode, :class:`DecodeCrop` (the decoder is the random resized crop)."""


def check_decode(decode: str | DecodeFn) -> None:
    """Raise :class:`ConfigError` unless ``decode`` is a callable or one of :data:`DECODE_CHOICES`."""
    if not callable(decode) and decode not in DECODE_CHOICES:
        raise ConfigError(
            f"decode should be {', '.join(map(repr, DECODE_CHOICES))} or a callable, but got decode={decode!r}",
            hint="Pass decode='bytes' to skip decoding",
        )


def _decoder(decode: str | DecodeFn, kind: str, size: int) -> DecodeFn | str:
    check_decode(decode)
    if kind == "text":
        return "bytes" if decode == "bytes" else "text"
    if callable(decode):
        return decode
    if decode == "reduced":
        return DecodeJPEG(size)
    return DecodeCrop(size, output="tensor") if decode == "crop" else decode


def check_source(path: str | os.PathLike) -> None:
    """Refuse, before measuring, a source that is missing, not a folder, or behind a folder this user may not search.

    Raises:
        SourceError: naming the path, what it is, and what to pass.
    """
    hint = "Pass a pack made by `packdata convert` or a folder"
    mode = source_mode(path)
    if mode is None:
        raise SourceError("no such pack or folder", path=path, hint=hint)
    if not stat.S_ISDIR(mode):
        raise SourceError(f"is {file_kind(mode)}, not a pack or a folder", path=path, hint=hint)


def open_source(
    path: str | os.PathLike,
    *,
    decode: str | DecodeFn = "pil",
    transform: Callable[[Any], Any] | None = None,
    size: int = 224,
) -> tuple[Dataset, dict[str, Any]]:
    """Open a pack (LMDB or TFRecord) or a raw folder as the dataset users train with.

    Args:
        path: a pack directory (with ``manifest.json``) or a source folder.
        decode: ``"bytes"`` (no decoding), ``"pil"``, ``"reduced"`` (:class:`DecodeJPEG`
            to ``size``), ``"crop"`` (:class:`DecodeCrop` to ``size``), or a callable.
            Text sources always decode to text (or bytes with ``"bytes"``).
        transform: applied to decoded images (ignored for text and ``"bytes"``).
        size: the output size for ``"reduced"`` and ``"crop"``.

    Returns:
        ``(dataset, facts)``, facts being the source's ``kind``, ``format``,
        ``samples``, ``mean_bytes`` and ``skipped`` counts.

    Raises:
        PackdataError: the path is neither a readable pack nor a usable folder,
            or the pack's reader is not available.
    """
    check_source(path)
    path = Path(path)
    if (path / MANIFEST_NAME).is_file():
        manifest = read_manifest(path)
        decoder = _decoder(decode, manifest.kind, size)
        tf = transform if manifest.kind == "image" and decode != "bytes" else None
        dataset = open_dataset(path, streaming=True, transform=tf, decode=decoder)  # what users train with
        sizes = getattr(getattr(dataset, "pack", None), "index", None)
        mean = (
            float(np.mean(sizes.sizes))
            if sizes is not None and len(sizes.sizes)
            else manifest.total_bytes / max(manifest.num_samples, 1)
        )
        facts = {
            "kind": manifest.kind,
            "format": manifest.format,
            "samples": manifest.num_samples,
            "mean_bytes": mean,
            "skipped": dict(manifest.skipped.get("by_reason", {}) or {}),
        }
        return dataset, facts
    kind = scan_source(path).kind
    decoder = _decoder(decode, kind, size)
    folder = FolderDataset(path, transform if kind == "image" and decode != "bytes" else None, decoder, kind=kind)
    facts = {
        "kind": kind,
        "format": "folder",
        "samples": len(folder),
        "mean_bytes": folder.mean_bytes,
        "skipped": dict(folder.skipped),
    }
    return folder, facts


def _raw_view(name: str, dataset: Any, facts: dict[str, Any]) -> Any:
    """Something with ``raw(index)`` over the source (the map-style reader of a pack streamed for training)."""
    if hasattr(dataset, "raw"):
        return dataset
    if facts.get("format") != "folder":
        return open_dataset(name, decode="bytes")
    return None
