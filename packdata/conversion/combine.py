"""Combine packs: ``merge`` several packs into one (``append``, in :mod:`packdata.conversion.append`, grows one).

Both take shards whole (hard links where the packs share a filesystem, copies
otherwise; moved, for an append) and write a new sample index and manifest:

- classes are united by name: the first pack's keep their numbers, names new
  to the result get the next ones, and every label is renumbered through that map;
- fields are united by name (a name must mean the same codec in every pack);
- images re-encoded at conversion (``reencode``) stay recorded: with the
  packs' settings where all agree, else with the count alone;
- keys stay unique: a key met twice fails (``on_duplicate="error"``) or, with
  ``"rename"``, the later sample becomes ``KEY~N`` (N: its pack's position),
  which rewrites that pack's shards (records carry their keys).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from packdata.conversion.destination import (
    MAKING_PARTIAL,
    _check_destination_writable,
    _check_existing,
    check_inputs_apart,
    partial_path,
    spill_folder,
)
from packdata.conversion.publish import SKIP_REPORT, _publish, recover_replaced
from packdata.errors import CapacityError, ConfigError, PackFormatError
from packdata.formats import get_format, shard_writer
from packdata.formats.verify import check_shard_file, check_shard_records, open_index
from packdata.host.disks import FULL_DISK_ERRNOS, filesystem_named, write_error
from packdata.pack.fields import codec_of
from packdata.pack.files import (
    atomic_write,
    discard_partial,
    file_kind,
    fsync_dir,
    holds_conversion,
    is_inside,
    open_pack_file,
)
from packdata.pack.index import INDEX_DIR, SampleIndex, index_digests
from packdata.pack.index_writer import SampleIndexWriter
from packdata.pack.keyset import KeySet
from packdata.pack.lock import convert_lock_path, hold_lock
from packdata.pack.manifest import (
    FIELDS_VERSION,
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    read_manifest,
    resolve_in_pack,
    write_manifest,
)
from packdata.pack.records import MAX_KEY_BYTES, Sample

__all__ = ["MergeResult", "merge_packs"]

_CHUNK = 1 << 16  # index rows copied per step: memory stays flat on huge packs
_FULL_HINT = "Free space on its disk (shards are copied there from another disk), then merge again"


@dataclass
class MergeResult:
    """A merge or append: the pack written, its sample and shard counts, and how shards got there."""

    pack: Path
    samples: int
    shards: int
    linked: int = 0
    copied: int = 0
    rewritten: int = 0
    renamed_keys: int = 0
    appended: Manifest | None = None  # an append: the manifest of the pack it added
    missing_fields: dict[str, int] = field(default_factory=dict)  # field -> the pack's samples lacking it


@dataclass
class _Input:
    path: Path
    manifest: Manifest
    index: SampleIndex
    label_map: np.ndarray  # old label + 1 -> new label (position 0 maps -1 to -1)
    field_map: np.ndarray  # old field number -> new field number
    renames: dict[int, str]  # sample position -> new key


def _open(path: Path) -> tuple[Manifest, SampleIndex]:
    manifest = read_manifest(path)
    if manifest.staged_from is not None:
        raise ConfigError("is a staged pack; merge or append its origin", path=path)
    # a damaged index, or labels outside the classes, is never rewritten as sound (nor renumbered through a wrap)
    return manifest, open_index(manifest, path, path)


def _plan(
    paths: Sequence[Path], on_duplicate: str, spill: Path | None = None
) -> tuple[list[_Input], list[str], list[str], dict[str, str]]:
    """Open every pack, unite classes and fields by name, and find duplicate keys (``spill``: see KeySet)."""
    if on_duplicate not in ("error", "rename", "append"):
        raise ConfigError(f"on_duplicate should be 'error' or 'rename', but got on_duplicate={on_duplicate!r}")
    classes: dict[str, int] = {}  # name -> number in the result, in order (a dict: no search per name)
    fields: dict[str, int] = {}
    codecs: dict[str, str] = {}
    inputs = []
    first: Manifest | None = None
    with KeySet(spill=spill) as seen:  # key -> the number of the pack that holds it first
        for number, path in enumerate(paths):
            manifest, index = _open(path)
            first = first or manifest
            if manifest.format != first.format:
                raise ConfigError(
                    f"is a {manifest.format} pack, but the first pack ({paths[0]}) is {first.format}",
                    path=path,
                    hint=f"Merge packs of one format: convert this one's source again with format='{first.format}' "
                    f"(`packdata convert SRC DST --format {first.format}`)",
                )
            if manifest.kind != first.kind:
                said = {"fields": "multi-field"}
                raise ConfigError(
                    f"holds {said.get(manifest.kind, manifest.kind)} samples, but the first pack ({paths[0]}) "
                    f"holds {said.get(first.kind, first.kind)} samples",
                    path=path,
                    hint="Merge packs of one kind: images with images, texts with texts, "
                    "multi-field samples (a grouped convert's) with multi-field samples",
                )
            for name in manifest.classes:
                classes.setdefault(name, len(classes))
            for name in manifest.fields if manifest.kind == "fields" else ():
                codec = manifest.codecs.get(name, codec_of(name))
                if codecs.setdefault(name, codec) != codec:
                    raise ConfigError(f"field {name!r} is {codec} here, {codecs[name]} in an earlier pack", path=path)
                fields.setdefault(name, len(fields))
            label_map = np.array([-1] + [classes[c] for c in manifest.classes], dtype=np.int32)
            field_map = np.array([fields[n] for n in manifest.fields] if manifest.kind == "fields" else [], np.int64)
            renames = {}
            for i, key in enumerate(index.keys):
                holder = seen.add(key, number)
                if holder is not None:
                    if on_duplicate == "append":
                        raise ConfigError(
                            f"the new samples repeat key {key!r}, already in the pack",
                            path=paths[0],
                            hint="Keys are unique in a pack: rename the source's files, or convert them into a pack "
                            "of their own and merge the two with on_duplicate='rename' "
                            "(`packdata merge --on-duplicate rename`)",
                        )
                    if on_duplicate == "error":
                        raise ConfigError(
                            f"key {key!r} (sample {i}) is already in an earlier pack ({paths[holder]})",
                            path=path,
                            hint="Pass on_duplicate='rename' to keep both as KEY~N",
                        )
                    new, n = f"{key}~{number}", number
                    while new in seen:
                        n += 1
                        new = f"{key}~{n}"
                    size = len(new.encode("utf-8", "surrogateescape"))
                    if size > MAX_KEY_BYTES:  # no record, sample index or reader takes a longer key
                        raise ConfigError(
                            f"key {key[:100]!r} (sample {i}) is already in an earlier pack, and renamed "
                            f"'KEY~{n}' it would be {size} bytes in UTF-8, more than the {MAX_KEY_BYTES} "
                            "a key may hold",
                            path=path,
                            hint="Shorten the key where the pack was made, or merge without that pack",
                        )
                    renames[i] = new
                    seen.add(new, number)
            inputs.append(_Input(path, manifest, index, label_map, field_map, renames))
    return inputs, list(classes), list(fields), codecs


def _link_or_copy(src: Path, dst: Path) -> bool:
    """Hard-link ``src`` at ``dst``; copy it where a link cannot be made. Returns whether it linked."""
    try:
        os.link(src, dst)
        return True
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
    shutil.copy2(src, dst)
    return False


def _place_shard(fmt: str, pack: Path, source: str, out: Path, target: str) -> bool:
    """Link or copy shard ``source`` of ``pack`` (its data and side files) as ``target`` in ``out``; whether it linked.

    Raises:
        PackFormatError: the shard's data file is missing.
    """
    pairs = _shard_pairs(fmt, pack, source, target)
    if get_format(fmt).shard_layout(target).folder:
        (out / target).mkdir()
    linked = True
    for a, b in pairs:
        linked = _link_or_copy(pack / a, out / b) and linked
    return linked


def _needs_rewrite(item: _Input, shard: ShardInfo) -> bool:
    """Whether a shard's records must be written anew: a key renamed, or a label renumbered (records carry both)."""
    stop = shard.first_index + shard.num_samples
    if any(shard.first_index <= k < stop for k in item.renames):
        return True
    labels = np.asarray(item.index.labels[shard.first_index : stop])
    return bool((item.label_map[labels + 1] != labels).any())


def _rewrite_shard(item: _Input, fmt: str, src: Path, dst: Path, shard: ShardInfo) -> tuple[int, str]:
    """Write shard ``src``'s records into a new shard at ``dst`` with keys renamed and labels renumbered.

    The new shard gets a checksum of its own, so the old one must be the
    shard its manifest names (size and SHA-256) and every record the sample
    index's, as ``verify`` checks them, or damage would pass into the result unseen.

    Raises:
        PackFormatError: naming the shard's data file, and the record.
    """
    data_file = check_shard_file(fmt, src, shard)
    writer = shard_writer(fmt)(dst)
    batch: list[tuple[int, Sample]] = []

    def written() -> Iterator[tuple[int, Sample]]:
        nonlocal batch
        for i, sample in get_format(fmt).iter_samples(src, shard.first_index):
            expected = int(item.index.labels[i])  # checked to lie in range; the record's label was not
            if sample.label != expected:
                raise PackFormatError(
                    f"record {i} holds label {sample.label}, the sample index says {expected}",
                    path=src,
                    hint="Run `packdata verify` on the pack, then convert it again",
                )
            yield i, sample  # written once check_shard_records asks for the next: it passed its checks
            key = item.renames.get(i, sample.key)
            batch.append((i - shard.first_index, replace(sample, key=key, label=int(item.label_map[sample.label + 1]))))
            if len(batch) >= 1024:
                writer.write(batch)
                batch = []

    check_shard_records(written(), shard, item.manifest, item.index, data_file)
    if batch:
        writer.write(batch)
    return writer.close()


def _write_index(out: Path, inputs: list[_Input], *, fields: bool) -> None:
    """The united sample index: labels renumbered, field numbers remapped, keys renamed, chunk by chunk."""
    writer = SampleIndexWriter(out, fields=fields)
    for item in inputs:
        index = item.index
        numbers = {name: int(item.field_map[k]) for k, name in enumerate(item.manifest.fields)} if fields else {}
        for start in range(0, item.manifest.num_samples, _CHUNK):
            stop = min(start + _CHUNK, item.manifest.num_samples)
            labels = item.label_map[np.asarray(index.labels[start:stop]) + 1]
            for i in range(start, stop):
                pairs = None
                if fields:
                    sizes = index.sample_fields(i)
                    pairs = [(numbers[n], s) for n, s in sizes.items()]
                key = item.renames.get(i, index.keys[i])
                writer.append(key, int(labels[i - start]), int(index.sizes[i]), pairs)
            writer.flush()
    writer.close()


def _manifest(
    inputs: list[_Input],
    out: Path,
    shards: list[ShardInfo],
    classes: list[str],
    fields: list[str],
    codecs: dict[str, str],
) -> Manifest:
    """The manifest of the united pack whose finished index :func:`_write_index` wrote into ``out``."""
    first = inputs[0].manifest
    found = [item.manifest.source.get("files_found") for item in inputs]
    num_samples = sum(item.manifest.num_samples for item in inputs)
    return Manifest(
        format=first.format,
        kind=first.kind,
        classes=classes,
        num_samples=num_samples,
        shards=shards,
        index={"dir": INDEX_DIR, "sha256": index_digests(out / INDEX_DIR, first.kind)},
        fields=fields if first.kind == "fields" else list(first.fields),
        codecs=codecs if first.kind == "fields" else {},
        field_counts=SampleIndex(out / INDEX_DIR, num_samples, fields).field_counts() if first.kind == "fields" else {},
        skipped=_skipped([item.manifest.skipped for item in inputs]),
        reencode=_reencode([item.manifest.reencode for item in inputs]),
        source={"files_found": sum(found), "merged_from": len(inputs)}
        if all(isinstance(n, int) for n in found)
        else {"merged_from": len(inputs)},
        format_version=FIELDS_VERSION if first.kind == "fields" else first.format_version,
    )


def _skipped(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``skipped`` object of packs united: counts added up, as far as every pack recorded them.

    A pack's count is ``count``, else the sum of ``by_reason`` (the manifest reader takes either alone);
    without either in some pack there is no count; without ``by_reason`` in a pack with skips, no reasons.
    """
    counts = [part.get("count", sum(part["by_reason"].values()) if "by_reason" in part else None) for part in parts]
    united: dict[str, Any] = {}
    if all(n is not None for n in counts):
        united["count"] = sum(counts)
        if all("by_reason" in part for part, n in zip(parts, counts, strict=True) if n):
            by_reason: dict[str, int] = {}
            for part in parts:
                for reason, n in part.get("by_reason", {}).items():
                    by_reason[reason] = by_reason.get(reason, 0) + int(n)
            united["by_reason"] = by_reason
    return {**united, "report": SKIP_REPORT}


def _reencode(parts: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The ``reencode`` record of packs united: the packs' ``max_side`` and ``quality`` where all agree, counts added.

    Where they differ (other settings, or some packs kept their bytes) only the count is kept: each
    pack's own manifest holds its settings.
    """
    done = [part for part in parts if part]
    if not done:
        return None
    united: dict[str, Any] = {}
    if len({None if not part else (part.get("max_side"), part.get("quality")) for part in parts}) == 1:
        united.update(max_side=done[0].get("max_side"), quality=done[0].get("quality"))
    if all("count" in part for part in done):
        united["count"] = sum(int(part["count"]) for part in done)
    return united


def merge_packs(
    packs: Sequence[str | os.PathLike], out: str | os.PathLike, *, on_duplicate: str = "error", overwrite: bool = False
) -> MergeResult:
    """One pack at ``out`` from ``packs`` (same format and kind), published atomically.

    Raises:
        ConfigError: fewer than two packs, formats or kinds differ, a key is
            duplicated (with ``on_duplicate="error"``), ``out`` exists or lies inside one of ``packs``,
            or a pack is ``out``, lies inside it or is its partial folder or lock (see :func:`check_inputs_apart`).
    """
    paths = [Path(p) for p in packs]
    out = Path(out)
    if len(paths) < 2:
        raise ConfigError("merge needs at least two packs")
    inside = next((p for p in paths if is_inside(out, p)), None)
    if inside is not None:  # the merged pack would become part of that pack's folder
        raise ConfigError(
            f"the merged pack would be inside the pack {inside}", path=out, hint="Choose an output outside it"
        )
    check_inputs_apart(paths, out)
    _check_destination_writable(out)
    if overwrite or not os.path.lexists(partial_path(out)):  # one a killed run left is named under the lock
        _check_existing(out, overwrite)
    result = MergeResult(out, 0, 0)
    out.parent.mkdir(parents=True, exist_ok=True)  # missing parents are made, as convert makes them
    with hold_lock(convert_lock_path(out), what="packdata merge", target=out):
        recover_replaced(out)
        _check_left_behind(out, overwrite)
        _check_existing(out, overwrite)  # again: a pack a killed merge with overwrite hid is back at out
        partial = partial_path(out)
        try:  # a link or file planted there goes itself, never what a link leads to
            discard_partial(partial)
            partial.mkdir(parents=True)
        except OSError as exc:
            of = f"{MAKING_PARTIAL}: nothing was published"
            raise write_error(exc, partial, folder=out.parent, of=of, hint=_FULL_HINT) from exc
        try:
            # the keys spill into the partial (removed with it): planned under the lock, after it is made
            inputs, classes, fields, codecs = _plan(paths, on_duplicate, spill_folder(partial))
            fmt = inputs[0].manifest.format
            writer_cls = shard_writer(fmt)
            shards: list[ShardInfo] = []
            base = 0
            for item in inputs:
                for shard in item.manifest.shards:
                    src = resolve_in_pack(item.path, shard.file, field="shard", manifest=item.path / MANIFEST_NAME)
                    name = writer_cls.shard_name(len(shards))
                    info = ShardInfo(name, shard.num_samples, base + shard.first_index, shard.bytes, shard.sha256)
                    rewrite = _needs_rewrite(item, shard)
                    check_shard_file(fmt, src, shard, checksum=False)  # a rewrite checks the rest; a link keeps it
                    if rewrite:
                        nbytes, digest = _rewrite_shard(item, fmt, src, partial / name, shard)
                        info = replace(info, bytes=nbytes, sha256=digest)
                        result.rewritten += 1
                    elif _place_shard(fmt, item.path, src.name, partial, name):
                        result.linked += 1
                    else:
                        result.copied += 1
                    shards.append(info)
                base += item.manifest.num_samples
            shards = writer_cls.finalize(partial, shards)
            _write_index(partial, inputs, fields=inputs[0].manifest.kind == "fields")
            atomic_write(partial / SKIP_REPORT, b"".join(line for item in inputs for line in _report_lines(item)))
            manifest = _manifest(inputs, partial, shards, classes, fields, codecs)
            write_manifest(partial, manifest)
            fsync_dir(partial)
            _publish(partial, out, overwrite=overwrite)
        except BaseException as exc:
            # a copy's raw OSError; a rewritten shard's or a key spill's CapacityError (whose hints say to resume)
            full = isinstance(exc, CapacityError) or (isinstance(exc, OSError) and exc.errno in FULL_DISK_ERRNOS)
            disk = filesystem_named(partial) if full else ""  # before the partial's room is given back
            shutil.rmtree(partial, ignore_errors=True)
            if full:
                raise CapacityError(
                    f"no space left on {disk} while merging: nothing was published", path=out, hint=_FULL_HINT
                ) from exc
            if isinstance(exc, ConfigError) and exc.hint and os.fspath(partial) in exc.hint:  # it is gone, not left
                hint = "Nothing was published: move what is at the destination away and merge again"
                raise exc.with_hint(hint) from exc
            raise
    result.samples, result.shards = manifest.num_samples, len(shards)
    result.missing_fields = manifest.missing_fields()
    result.renamed_keys = sum(len(item.renames) for item in inputs)
    return result


def _check_left_behind(out: Path, overwrite: bool) -> None:
    """Refuse a merge into ``out`` beside a partial pack a killed run left: a conversion's that ``resume`` continues,
    or any beside an existing pack (a killed merge's into a new ``out`` is replaced without a word).

    Call it holding ``out``'s lock: no live run writes that folder then. ``overwrite`` removes it.
    """
    partial = partial_path(out)
    if overwrite or not os.path.lexists(partial):
        return
    if holds_conversion(partial):  # hours of a conversion's work, which its resume continues
        raise ConfigError(
            f"an interrupted conversion into {out} is in {partial}, and merging there would delete it",
            path=out,
            hint=f"Finish it with resume (`packdata convert SRC {out} --resume`), merge into another path, "
            "or pass overwrite=True to merge over it (its work is lost)",
        )
    if not (out.exists() or out.is_symlink()):  # a killed merge's: nothing can continue it, this merge replaces it
        return
    raise ConfigError(
        f"destination already exists, and an interrupted merge or conversion into it left {partial}, "
        "which was never published (merge cannot continue it: it has no resume)",
        path=out,
        hint=f"Pass overwrite=True to replace the pack, which removes {partial.name} too; or, to keep the pack, "
        f"delete {partial} and merge into another path",
    )


def _shard_pairs(fmt: str, pack: Path, source: str, target: str) -> list[tuple[str, str]]:
    """Each file of shard ``source`` in ``pack`` and its name in shard ``target``: data file first, side tables present.

    Raises:
        PackFormatError: the shard's data file or a needed side table is missing, or a file is not
            a regular file itself (a link is never followed: its target lies
            outside the pack, a device would be copied without end).
    """
    layout_of = get_format(fmt).shard_layout
    a, b = layout_of(source), layout_of(target)
    if a.folder:
        pairs = [(f"{source}/{x}", f"{target}/{y}") for x, y in zip((a.data, *a.side), (b.data, *b.side), strict=True)]
    else:
        pairs = [(source, target), *zip(a.side, b.side, strict=True)]
    present = [pairs[0]]
    present += [pair for pair in pairs[1:] if os.path.lexists(pack / pair[0]) or Path(pair[0]).name in a.needed]
    for name, _ in present:
        try:
            mode = os.lstat(pack / name).st_mode
        except FileNotFoundError:
            raise PackFormatError(
                "shard file is missing", path=pack / name, hint="The pack is damaged: convert it again"
            ) from None
        if not stat.S_ISREG(mode):
            raise PackFormatError(
                f"shard file is {file_kind(mode)}, not a regular file of the pack",
                path=pack / name,
                hint="The pack is damaged or was not written by packdata: convert it again",
            )
    return present


def _report_lines(item: _Input) -> Iterator[bytes]:
    name = item.manifest.skipped.get("report")
    if not name:
        return
    path = resolve_in_pack(item.path, name, field="skipped.report", manifest=item.path / MANIFEST_NAME)
    try:
        fd = open_pack_file(path)  # a link (leading out of the pack) or a FIFO is refused, never read
    except FileNotFoundError:
        return
    with os.fdopen(fd, "rb") as f:
        for line in f:
            yield line if line.endswith(b"\n") else line + b"\n"
