"""Storage formats: the registry, and per format one module the registry loads plus its `NAME_*` siblings.

A caller asks the registry (:func:`get_format`) for what it needs of a format:
its shard writer, the files a shard consists of, how to walk and check a shard.
Nothing outside this package names a format; a new format is a new module here
and one :data:`REGISTRY` entry. Formats know bytes on disk and nothing of torch.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from packdata.errors import ConfigError, PackFormatError
from packdata.pack.manifest import MANIFEST_NAME

if TYPE_CHECKING:
    import numpy as np

    from packdata.pack.index import SampleIndex
    from packdata.pack.manifest import Manifest, ShardInfo
    from packdata.pack.records import Sample

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "ByteStream",
    "FORMATS",
    "REGISTRY",
    "PackFormat",
    "ShardLayout",
    "ShardWriter",
    "format_from_path",
    "get_format",
    "shard_writer",
]


class ByteStream(Protocol):
    """Anything read front to back like a binary file: ``read(n)`` gives up to ``n`` bytes (fewer only at the end)."""

    def read(self, n: int, /) -> bytes: ...


class ShardWriter(Protocol):
    """What convert needs of a format's shard writer.

    A writer is constructed as ``cls(path, resume_at=None)``, takes batches of
    ``(index within the shard, Sample)`` in :meth:`write` (``resume_at`` is the
    index within the shard of the first record to drop), makes them durable in
    :meth:`sync` and returns ``(bytes, sha256)`` from :meth:`close`, which
    may run in another thread once :meth:`seal` (the end of the writes, and
    the part of closing that needs the GIL) has run in the writing one. Its static
    ``shard_name(number)`` names shard files and ``finalize(pack, shards)``
    gives them their final names once the shard count is known
    (``final_shards`` says which, without touching a file).
    """

    def __init__(self, path: str | os.PathLike, *, resume_at: int | None = None) -> None: ...
    def write(self, items: list[tuple[int, Sample]]) -> None: ...
    def sync(self) -> None: ...
    def seal(self) -> None: ...
    def close(self) -> tuple[int, str]: ...
    @staticmethod
    def shard_name(number: int) -> str: ...
    @staticmethod
    def finalize(pack: Path, shards: list[ShardInfo]) -> list[ShardInfo]: ...
    @staticmethod
    def final_shards(pack: Path, shards: list[ShardInfo]) -> list[ShardInfo]: ...


@dataclass(frozen=True)
class ShardLayout:
    """The files one shard consists of, by name.

    ``folder``: the shard is a folder (``data`` and ``side`` are names inside it)
    or a file (``data`` is the shard's own name, ``side`` are files beside it).
    ``side``: accelerator tables (optional; copied when present), except those
    also in ``needed``, which readers cannot do without (TFRecord's offsets
    index): a copy of the shard without them is refused. ``scratch``:
    files a writer or reader may leave in the shard folder that are not pack data.
    """

    folder: bool
    data: str
    side: tuple[str, ...] = ()
    scratch: tuple[str, ...] = ()
    needed: tuple[str, ...] = ()

    def data_path(self, shard: Path) -> Path:
        """The file holding the shard's records, for a shard at ``shard``."""
        return shard / self.data if self.folder else shard

    def side_paths(self, shard: Path) -> list[Path]:
        """The shard's side tables, whether present or not."""
        base = shard if self.folder else shard.parent
        return [base / name for name in self.side]


@dataclass(frozen=True)
class PackFormat:
    """One storage format: its name, destination suffixes, defaults and implementation module.

    The module provides ``SHARD_WRITER``, ``shard_layout(name)``,
    ``iter_samples(shard, first_index)``, ``closed_records(data)`` and ``check_side_tables(shard, info)``.
    """

    name: str
    suffixes: tuple[str, ...]
    module: str
    default_shard_bytes: int | None
    streams_by_shard: bool  # its streaming reader splits work by whole shards (so shard count matters)

    def _impl(self):
        return importlib.import_module(self.module)

    def shard_writer(self) -> type[ShardWriter]:
        """The shard writer class."""
        return self._impl().SHARD_WRITER

    def shard_layout(self, name: str) -> ShardLayout:
        """The files of the shard called ``name`` (a plain name)."""
        return self._impl().shard_layout(name)

    def check_names(self, manifest: Manifest, path: str | os.PathLike) -> None:
        """Refuse a manifest that gives two of the pack's files one name.

        The shards' files (a shard's side tables too), the sample index folder,
        the skip report and the manifest itself must each have a name of their
        own, or copying the pack would write two files to one place.

        Raises:
            PackFormatError: naming the manifest at ``path`` and both uses of the name.
        """
        owners = {MANIFEST_NAME: "the manifest"}
        names = []
        for number, shard in enumerate(manifest.shards):
            layout = self.shard_layout(os.path.basename(shard.file))
            names.append((os.path.basename(shard.file), f"shard {number}"))
            if not layout.folder:
                names += [(side, f"a side table of shard {number}") for side in layout.side]
        names.append((manifest.index_dir, "the sample index folder"))
        report = manifest.skipped.get("report")
        if isinstance(report, str) and report:
            names.append((report, "the skip report"))
        for name, what in names:
            if name in owners:
                raise PackFormatError(
                    f"manifest names {name!r} as {owners[name]} and as {what}",
                    path=path,
                    hint="Not a pack packdata wrote: convert it again",
                )
            owners[name] = what

    def iter_samples(self, shard: Path, first_index: int) -> Iterator[tuple[int, Sample]]:
        """``(global index, Sample)`` of every record in file order, every check made (for verify)."""
        return self._impl().iter_samples(shard, first_index)

    def closed_records(self, data: Path) -> int:
        """The records a closed shard holds, read from its data file ``data`` (or the index beside it), not its
        records: what a resume checks a checkpoint's shard counts against."""
        return self._impl().closed_records(data)

    def check_side_tables(self, shard: Path, info: ShardInfo) -> None:
        """Check the shard's side tables row by row against the shard (for verify)."""
        self._impl().check_side_tables(shard, info)

    def iter_stream_samples(
        self, stream: ByteStream, shard: Path, info: ShardInfo, where: str
    ) -> Iterator[tuple[int, Sample]] | None:
        """Every record of a shard read as a sequential stream, checked as by :meth:`iter_samples`.

        ``shard`` holds local copies of the shard's side tables; ``where`` names
        the shard in messages. None when the format checks records in local files only.
        """
        walk = getattr(self._impl(), "iter_stream_samples", None)
        return None if walk is None else walk(stream, shard, info, where)

    def check_remote_side_tables(
        self, stream: ByteStream, shard: Path, info: ShardInfo, index: SampleIndex, where: str
    ) -> int | None:
        """Check local copies of a shard's side tables against its bytes as ``stream`` passes them (remote verify).

        For a format whose records are not checked in a stream (:meth:`iter_stream_samples` is None).
        Returns the records the tables let it check, or None where none was (no table: size and SHA-256 only).
        """
        check = getattr(self._impl(), "check_remote_side_tables", None)
        return None if check is None else check(stream, shard, info, index, where)

    def read_remote_payload(
        self,
        fs: Any,
        root: str,
        shown: str,
        rel: str,
        shard: Path,
        info: ShardInfo,
        j: int,
        *,
        opened: Manifest,
        key: str,
    ) -> tuple[bytes, str, int]:
        """Record ``j`` of a shard in object storage in ranged reads: its payload, and the key and label it holds.

        ``shard`` holds local copies of the shard's side tables, downloaded with
        ``opened``, the pack's manifest: the bytes come only from the shard
        object's version pinned for it (see :func:`~packdata.formats.remote_reads.fetch_range`).
        ``key`` is the sample's key by the sample index (a format may find the record's start by its length).

        Raises:
            ConfigError: the format cannot read one record of this shard in place (stage it).
            PackFormatError: the pack was replaced since ``opened`` was read, or the record is damaged.
        """
        return self._impl().read_remote_payload(fs, root, shown, rel, shard, info, j, opened=opened, key=key)

    def record_spans(self, shard: Path, size: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Byte offsets and lengths of every record in the shard's data file of ``size`` bytes, for read-ahead hints.

        From the shard's side table, memory-mapped where the table allows; None
        without a usable one. Only lightly checked: hints never decide what is
        read (a reader checks every record it returns).
        """
        spans = getattr(self._impl(), "record_spans", None)
        return None if spans is None else spans(shard, size)

    def data_name(self, file: str) -> str:
        """The path, inside the pack, of the file holding the records of the shard called ``file``."""
        layout = self.shard_layout(os.path.basename(file))
        return f"{file}/{layout.data}" if layout.folder else file


DEFAULT_SHARD_BYTES = 256 * 10**6
"""Every format's default shard size: the unit ``stage`` copies and Ray converts in parallel.

A pack of at least twice this size stages in part into any area holding one
shard, and a terabyte is about 4,000 shards, so a DataLoader worker's open
files and memory maps per pack stay in the thousands (per-process limits:
``ulimit -n``, ``vm.max_map_count``). MosaicML Streaming and LitData default
to 64 MB chunks, WebDataset users to a few hundred MB.
"""

REGISTRY: dict[str, PackFormat] = {
    f.name: f
    for f in (
        PackFormat("lmdb", (".lmdb",), "packdata.formats.lmdb", DEFAULT_SHARD_BYTES, streams_by_shard=False),
        PackFormat(
            "tfrecord",
            (".tfrecord", ".tfrecords"),
            "packdata.formats.tfrecord",
            DEFAULT_SHARD_BYTES,
            streams_by_shard=True,
        ),
    )
}
FORMATS = tuple(REGISTRY)
"""Format names, the default first."""


def get_format(name: str) -> PackFormat:
    """The registered format called ``name``.

    Raises:
        ConfigError: no such format.
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise ConfigError(f"format should be one of {', '.join(FORMATS)}, but got format={name!r}") from None


def format_from_path(path: str) -> str | None:
    """The format a destination's suffix names (``out.lmdb`` -> ``"lmdb"``), or None."""
    lowered = path.rstrip("/").lower()
    return next((f.name for f in REGISTRY.values() if lowered.endswith(f.suffixes)), None)


def shard_writer(fmt: str) -> type[ShardWriter]:
    """The shard writer class of format ``fmt`` (see :class:`ShardWriter`)."""
    return get_format(fmt).shard_writer()
