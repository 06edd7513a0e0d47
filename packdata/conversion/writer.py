"""Write a pack from Python: ``PackWriter`` (one sample at a time) and ``write_pack`` (any iterable).

Samples are dicts in WebDataset's convention: ``"__key__"`` (a unique
string), ``"cls"`` (an optional integer label) and one entry per field, its
name telling the encoding (:mod:`packdata.pack.fields`). The pack is the same
as ``convert`` writes (shards, sample index, manifest, skip report) and
appears at its destination only when :meth:`PackWriter.close` publishes it;
an exception inside ``with PackWriter(...)`` leaves no pack behind.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import reprlib
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from packdata.conversion.checkpoint import _Checkpoint
from packdata.conversion.destination import (
    MAKING_PARTIAL,
    _check_destination_writable,
    _check_existing,
    partial_path,
    spill_folder,
)
from packdata.conversion.load import _Options, shard_limits
from packdata.conversion.local import _Packer
from packdata.conversion.pool_map import ordered_map
from packdata.conversion.publish import ConvertResult, _publish, make_result, recover_replaced
from packdata.conversion.sources import FREE_CLASSES
from packdata.errors import CapacityError, ConfigError
from packdata.formats import FORMATS, format_from_path, get_format
from packdata.host.cores import usable_cpus
from packdata.host.disks import write_error
from packdata.pack.fields import (
    KEY_FIELD,
    LABEL_FIELD,
    FieldError,
    check_field_name,
    dotted_key_problem,
    encode_block,
    encode_value,
)
from packdata.pack.files import PROGRESS_FILE, discard_partial
from packdata.pack.keyset import KeySet
from packdata.pack.lock import convert_lock_path, hold_lock
from packdata.pack.manifest import classes_problem
from packdata.pack.records import MAX_KEY_BYTES, MAX_SAMPLE_BYTES, Sample
from packdata.progress import progress as show_progress
from packdata.units import parse_size

__all__ = ["PackWriter", "write_pack"]

_FULL_HINT = "Free space on that disk, then write the pack again: a PackWriter publishes nothing it did not finish"


@dataclass
class _WriterSource:
    """What the shared packer and manifest need to know of a Python source."""

    root: Path
    classes: list[str]
    kind: str = "fields"
    codecs: dict[str, str] = field(default_factory=dict)


class PackWriter:
    """Write multi-field samples into a new pack, published atomically on :meth:`close`.

    Example::

        with packdata.PackWriter("out.lmdb", shard_size="1GB") as w:
            w.write({"__key__": "a/0001", "jpg": jpeg_bytes, "json": {"boxes": []}, "cls": 3})

    Args:
        dst: the pack to create (``out.lmdb``; a folder for TFRecord).
        format: a name from :data:`packdata.formats.FORMATS`; by default from ``dst``'s suffix, else LMDB.
        shard_size: start a new shard before one would exceed this size (bytes, or text like ``"1GB"``).
        shard_samples: at most this many samples per shard.
        classes: class names (distinct strings), label ``i`` naming ``classes[i]``;
            by default the labels' own numbers (``"0"``, ``"1"``, ...).
        overwrite: replace an existing pack at ``dst``.

    Raises:
        ConfigError: ``dst`` exists (without ``overwrite``), or a bad option (``classes`` included).
        LockedError: another process is writing ``dst``.
    """

    def __init__(
        self,
        dst: str | os.PathLike,
        *,
        format: str | None = None,
        shard_size: int | str | None = None,
        shard_samples: int | None = None,
        classes: list[str] | None = None,
        overwrite: bool = False,
    ) -> None:
        self.dst = Path(dst).absolute()  # the caller may change the working folder between writes
        problem = None if classes is None else classes_problem(list(classes) if isinstance(classes, tuple) else classes)
        if problem is not None:
            raise ConfigError(f"classes {problem}, but got {reprlib.repr(classes)}", path=self.dst)
        fmt = format or format_from_path(os.fspath(self.dst)) or FORMATS[0]
        pack_format = get_format(fmt)
        if isinstance(shard_size, str):
            shard_size = parse_size(shard_size)
        shard_size, shard_samples = shard_limits(shard_size, shard_samples, pack_format.default_shard_bytes)
        _check_destination_writable(self.dst)
        _check_existing(self.dst, overwrite)
        self._overwrite = overwrite
        self._classes = list(classes) if classes is not None else None
        self._top_label = -1
        self._started = time.perf_counter()
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(hold_lock(convert_lock_path(self.dst), what="packdata PackWriter", target=self.dst))
        recover_replaced(self.dst)
        self._partial = partial_path(self.dst)
        try:
            discard_partial(self._partial)  # a writer's partial is never resumable
            self._partial.mkdir(parents=True)
        except OSError as exc:
            # named before the lock file gives its room back
            error = write_error(exc, self._partial, folder=self.dst.parent, of=MAKING_PARTIAL, hint=_FULL_HINT)
            self._stack.close()
            raise error from exc
        self._keys = KeySet(spill=spill_folder(self._partial))  # the partial is new: nothing spilled there yet
        self._opts = _Options(fmt, "fields", "fail", False, None, 90, shard_size, shard_samples)
        self._source = _WriterSource(self.dst, [])
        self._checkpoint = _Checkpoint(self._partial / PROGRESS_FILE, asdict(self._opts))
        self._packer = _Packer(self._source, self._partial, self._opts, self._checkpoint, False)  # type: ignore[arg-type]
        self.result: ConvertResult | None = None
        self._aborted = False

    @property
    def count(self) -> int:
        """Samples written so far."""
        return self._checkpoint.samples_done

    def write(self, sample: Mapping[str, Any]) -> None:
        """Add one sample (see the class docstring); its values are encoded by their field names.

        Raises:
            ConfigError: not a dict, no ``__key__``, a key with a dot in its last part (its files
                ``KEY.FIELD`` would read back as another key), a repeated key, a bad label, or a value
                its field name cannot encode (nothing is written then).
        """
        self._append(self._encode(sample))

    def _encode(self, sample: Mapping[str, Any]) -> Sample:
        """Check and encode one sample into a fields record's payload (no writer state: any thread may call it)."""
        if not isinstance(sample, Mapping):
            raise ConfigError(
                f"a sample should be a dict such as {{'__key__': 'a/0001', 'jpg': b'...', 'cls': 3}}, but got a "
                f"{type(sample).__name__}",
                path=self.dst,
                hint="Map each (image, label) pair of a dataset to such a dict first",
            )
        key = sample.get(KEY_FIELD)
        if not isinstance(key, str) or not key:
            raise ConfigError(f"a sample needs a non-empty string {KEY_FIELD!r}, but got {key!r}", path=self.dst)
        try:
            size = len(key.encode("utf-8"))
        except UnicodeEncodeError as exc:  # a lone surrogate: what os.listdir makes of a name not in UTF-8
            raise ConfigError(f"key {key!r} is not valid UTF-8 ({exc.reason})", path=self.dst) from exc
        if size > MAX_KEY_BYTES:
            raise ConfigError(f"key {key[:100]!r}... is longer than {MAX_KEY_BYTES} bytes in UTF-8", path=self.dst)
        dotted = dotted_key_problem(key)
        if dotted is not None:
            raise ConfigError(
                f"sample {key!r}: {dotted}",
                path=self.dst,
                hint="A grouped folder, a tar and WebDataset take a sample's key as its files' name up to the first "
                "dot: keep dots out of the key's last part (a folder's, as in 'v1.2/a', is fine)",
            )
        given = sample.get(LABEL_FIELD, -1)
        label = int(given) if isinstance(given, numbers.Integral) and not isinstance(given, bool) else -2  # NumPy's too
        if not -1 <= label < 2**31:
            raise ConfigError(f"sample {key!r}: cls should be an integer >= 0, but got {given!r}", path=self.dst)
        if self._classes is None and label >= FREE_CLASSES:  # the manifest would name classes 0..label
            raise ConfigError(
                f"sample {key!r}: cls {label} would name {label + 1} classes; without classes= a label is below "
                f"{FREE_CLASSES}",
                path=self.dst,
                hint="Pass classes=[...] naming every class, or number the labels from 0",
            )
        fields: dict[str, bytes] = {}
        try:
            for name, value in sample.items():
                if name in (KEY_FIELD, LABEL_FIELD) or (isinstance(name, str) and name[:2] == name[-2:] == "__"):
                    continue  # WebDataset metadata such as __url__ is not stored
                name = check_field_name(name)  # before encode_value, which reads the name's extension
                fields[name] = encode_value(name, value)
            block = encode_block(fields)
        except FieldError as exc:
            raise ConfigError(f"sample {key!r}: {exc}", path=self.dst) from exc
        if len(block) > MAX_SAMPLE_BYTES:
            raise ConfigError(
                f"sample {key!r} is {len(block)} bytes; a sample holds at most {MAX_SAMPLE_BYTES}", path=self.dst
            )
        sizes = tuple(sorted((name, len(data)) for name, data in fields.items()))
        return Sample(key, label, block, "fields", sizes)

    def _append(self, sample: Sample) -> None:
        """Write an encoded sample (in the writer's thread)."""
        if self.result is not None or self._packer.report.closed:
            raise ConfigError("this PackWriter is closed", path=self.dst)
        try:
            first = self._keys.add(sample.key, self.count)
        except CapacityError as exc:  # its keys spilled past the memory budget onto a full disk
            raise exc.with_hint(_FULL_HINT) from exc
        if first is not None:
            raise ConfigError(f"key {sample.key!r} was written before (sample {first}): keys are unique", path=self.dst)
        self._top_label = max(self._top_label, sample.label)
        self._packer._make_room(len(sample.data))
        self._packer._add(sample)
        self._checkpoint.files_done += 1

    def close(self) -> ConvertResult:
        """Write the last shard, the index and the manifest, and publish the pack at ``dst``.

        Raises:
            ConfigError: nothing was written, or labels exceed the given classes.
        """
        if self.result is not None:
            return self.result
        if self._aborted:
            raise ConfigError("this PackWriter was aborted: it published nothing", path=self.dst)
        try:
            if self.count == 0:
                raise ConfigError("no sample was written: a pack needs at least one", path=self.dst)
            if self._classes is not None and self._top_label >= len(self._classes):
                raise ConfigError(f"label {self._top_label} has no class: {len(self._classes)} given", path=self.dst)
            self._source.classes = list(self._classes or [])  # labels past them get their numbers as names
            self._packer._commit()
            self._packer.close_files()
            manifest = self._packer.finish()
            self._keys.close()
            _publish(self._partial, self.dst, overwrite=self._overwrite)
        except BaseException:
            self.abort()
            raise
        self._stack.close()
        cp = self._checkpoint
        self.result = make_result(
            self.dst,
            self._opts,
            self._source,  # type: ignore[arg-type]
            manifest,
            found=cp.files_done,
            skipped=cp.skipped,
            skip_examples=cp.skip_examples,
            bytes_in=cp.bytes_in,
            reencoded=0,
            resumed=False,
            started=self._started,
        )
        return self.result

    def abort(self) -> None:
        """Drop everything written: no pack appears at ``dst`` (nothing is done once closed or aborted)."""
        if self.result is not None or self._aborted:
            return  # the lock is released: the partial pack there now is another writer's
        self._aborted = True
        self._keys.close()
        writer = self._packer.writer
        self._packer.close_files(failed=True)
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.close()
        shutil.rmtree(self._partial, ignore_errors=True)
        self._stack.close()

    def __enter__(self) -> PackWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_pack(
    samples: Iterable[Mapping[str, Any]],
    dst: str | os.PathLike,
    *,
    workers: int | None = None,
    progress: bool = True,
    **options: Any,
) -> ConvertResult:
    """Write every sample of ``samples`` (an iterable of dicts, or a map-style dataset of them) into a new pack.

    The samples of a list, or of a map-style dataset (``dataset[i]``, called
    from several threads at once), are fetched and encoded (images, arrays,
    JSON, checksums) in ``workers`` threads; those of any other iterable are
    encoded as they come, in the calling thread, since a generator may refill
    the arrays or buffers it yielded. Samples are written in their order, so
    the pack is the same whatever ``workers`` is. Threads pay
    where the work releases the GIL: file and network reads in ``__getitem__``,
    CRC-32s, NumPy saves. PIL's JPEG encoder mostly holds it (2 threads encode
    about 1.15x faster than 1 here): for many PIL images, encode them to bytes
    in processes (a ``DataLoader`` with workers over your dataset) and pass
    the bytes.

    Args:
        samples: dicts as :meth:`PackWriter.write` takes them; a map-style
            dataset (``__len__`` and ``__getitem__``) is read in index order.
        dst: the pack to create.
        workers: fetching and encoding threads for a list or map-style dataset
            (default: the CPUs this process may use, at most 8; 0 does everything in the calling thread).
        progress: show a progress bar on stderr.
        **options: :class:`PackWriter`'s options.

    Returns:
        A :class:`~packdata.conversion.publish.ConvertResult`.
    """
    if workers is None:
        workers = min(8, usable_cpus())  # the CPUs this process may use, not the host's
    if workers < 0:
        raise ConfigError(f"workers should be 0 or more, but got workers={workers}")
    total = len(samples) if hasattr(samples, "__len__") else None  # type: ignore[arg-type]
    items: Iterator[Any] = iter(samples)
    fetch: Callable[[Any], Mapping[str, Any]] = _same
    if total is None or not hasattr(samples, "__getitem__"):
        workers = 0  # a generator may refill what it yielded once asked for more: encode each sample before that
    elif not isinstance(samples, list | tuple):
        items, fetch = iter(range(total)), samples.__getitem__  # type: ignore[attr-defined]
    with (
        PackWriter(dst, **options) as writer,
        show_progress(total=total, desc="writing", unit=" samples", disable=not progress) as bar,
        ThreadPoolExecutor(max(1, workers), thread_name_prefix="packdata-encode") as pool,
    ):

        def encode(item: Any) -> Sample:
            return writer._encode(fetch(item))

        if workers == 0:
            encoded: Iterator[Sample] = map(encode, items)
        else:
            encoded = (sample for _, sample in ordered_map(encode, items, pool, depth=4 * workers, chunk=8))
        try:
            for sample in encoded:
                writer._append(sample)
                bar.update()
        except BaseException:
            pool.shutdown(cancel_futures=True)  # samples queued behind the failure are not encoded
            raise
    assert writer.result is not None
    return writer.result


def _same(sample: Mapping[str, Any]) -> Mapping[str, Any]:
    return sample
