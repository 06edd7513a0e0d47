"""Look inside a pack without torch: list samples, read one field's stored bytes, export back to files.

``export`` writes each sample where its key says, inside the destination only:
a key that is absolute, holds ``..`` or empty parts, or would land outside the
destination is refused and reported, never followed. ``convert`` then
``export`` then ``diff -r`` shows no difference for a pack converted without
re-encoding (the round trip a user runs before trusting a format).
"""

from __future__ import annotations

import bisect
import contextlib
import os
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packdata.errors import ConfigError, PackdataError, PackFormatError, raise_at_url
from packdata.formats import get_format
from packdata.formats.remote_pack import fetch_pack_skeleton, forget_skeleton
from packdata.host.disks import FULL_DISK_ERRNOS, no_space_error, write_error
from packdata.pack.fields import LABEL_FIELD, FieldError, decode_block, dotted_key_problem
from packdata.pack.files import check_visible, fsync_dir, is_inside
from packdata.pack.index import SampleIndex, check_index_digests
from packdata.pack.manifest import Manifest, read_manifest, resolve_in_pack
from packdata.pack.records import Sample
from packdata.pack.urls import display_url, is_url

__all__ = ["ExportResult", "export_pack", "list_samples", "read_field", "resolve_sample"]


def _index(pack: Path, manifest: Manifest, where: str | Path | None = None) -> SampleIndex:
    """The pack's sample index; ``where``: the pack as errors name it (a URL for a cached copy), default ``pack``."""
    directory = pack / manifest.index_dir
    try:
        fields = manifest.fields if manifest.kind == "fields" else None
        return SampleIndex(directory, manifest.num_samples, fields, manifest.index_sha256)
    except (OSError, ValueError) as exc:
        problem = (
            f"{os.path.basename(exc.filename)}: {exc.strerror}" if isinstance(exc, OSError) and exc.filename else exc
        )
        raise PackFormatError(
            f"sample index is missing or damaged: {problem}",
            path=f"{where}/{manifest.index_dir}" if where else directory,
            hint="Convert the pack again",
        ) from exc


def list_samples(
    pack: str | os.PathLike, *, limit: int | None = None, storage_options: dict[str, Any] | None = None
) -> Iterator[dict[str, Any]]:
    """One dict per sample, from the index only: index, key, label, class, shard, and each field's size.

    ``pack`` may be a URL (``s3://bucket/train.lmdb``, with ``storage_options``
    for fsspec): only its manifest and sample index are downloaded (and cached
    while the manifest is the same, see :func:`~packdata.formats.remote_pack.fetch_pack_skeleton`).

    Raises:
        PackFormatError: the sample index is missing, or differs from the manifest's digests.
    """
    url = is_url(pack)
    shown = display_url(os.fspath(pack)) if url else None
    pack = Path(_checked_skeleton(os.fspath(pack), storage_options)[0] if url else pack)
    manifest = read_manifest(pack)
    index = _index(pack, manifest, shown)
    if not url:  # a cached copy's index was checked as it was fetched
        check_index_digests(pack / manifest.index_dir, manifest.index_sha256)  # a flipped bit would list another label
    shard, shards = 0, manifest.shards
    for i in range(manifest.num_samples if limit is None else min(limit, manifest.num_samples)):
        while i >= shards[shard].first_index + shards[shard].num_samples:
            shard += 1
        label = int(index.labels[i])
        fields = index.sample_fields(i) or {manifest.kind: int(index.sizes[i])}
        yield {
            "index": i,
            "key": index.keys[i],
            "label": label,
            "class": manifest.classes[label] if 0 <= label < len(manifest.classes) else None,
            "fields": fields,
            "shard": shards[shard].file,
        }


def resolve_sample(pack: str | os.PathLike, which: str) -> int:
    """The index of the sample named by ``which``: a key, or ``#N`` for index N.

    Raises:
        ConfigError: no sample has that key, or the index is out of range.
    """
    pack = Path(pack)
    return _resolve(pack, read_manifest(pack), which, pack)


def _resolve(pack: Path, manifest: Manifest, which: str, where: str | Path) -> int:
    digits = which[1:]
    if which.startswith("#") and digits.isascii() and digits.isdigit():  # ASCII: isdigit alone takes '²'
        if len(digits) > 18 or int(digits) >= manifest.num_samples:  # int() refuses over 4,300 digits
            shown = digits if len(digits) <= 18 else f"{digits[:18]}..."
            n = manifest.num_samples
            hint = f"Pick #0 to #{n - 1}, or a key ({_ls(where)} lists them)" if n else "The pack is empty"
            raise ConfigError(f"index {shown} is out of range for {n} samples", path=where, hint=hint)
        return int(digits)
    keys = _index(pack, manifest, where).keys
    for i in range(len(keys)):
        if keys[i] == which:
            return i
    raise ConfigError(
        f"no sample has the key {which!r}",
        path=where,
        hint=f"List keys with {_ls(where)}; #N picks by index (#0 to #{len(keys) - 1})",
    )


def _ls(where: str | Path) -> str:
    """The command that lists a pack's keys, quoted to paste."""
    return f"`packdata ls {shlex.quote(str(where))}`"


def _record(pack: Path, manifest: Manifest, i: int) -> Sample:
    """Sample ``i`` as stored (its shard read in order up to it, CRCs checked), matched to the sample index."""
    for shard in manifest.shards:
        if shard.first_index <= i < shard.first_index + shard.num_samples:
            path = resolve_in_pack(pack, shard.file, field="shard", manifest=pack / "manifest.json")
            for j, sample in get_format(manifest.format).iter_samples(path, shard.first_index):
                if j == i:
                    _match_index(_index(pack, manifest), i, sample.key, sample.label, len(sample.data), path)
                    return sample
    raise PackFormatError(f"record {i} is missing", path=pack, hint="Run `packdata verify`")


def _match_index(index: SampleIndex, i: int, key: str | None, label: int | None, size: int, where: str | Path) -> None:
    """Raise unless record ``i`` (its key and label where read: None when not) is what the sample index says.

    Datasets take keys and labels from the index and refuse a record that
    differs: ``cat`` and ``export`` then give what a dataset would, or nothing.
    """
    if (key is not None and key != index.keys[i]) or (label is not None and label != int(index.labels[i])):
        raise PackFormatError(f"record {i} (key {key!r}) does not match the sample index", path=where, hint=_VERIFY)
    if size != int(index.sizes[i]):
        raise PackFormatError(
            f"record {i} holds {size} bytes, the sample index says {int(index.sizes[i])}", path=where, hint=_VERIFY
        )


def _checked_skeleton(url: str, storage_options: dict[str, Any] | None) -> tuple[Path, Manifest, Any, str]:
    """:func:`fetch_pack_skeleton` (default cache), its sample index matching the manifest's digests.

    A cached copy whose index was damaged since its download is downloaded
    again once; what is still damaged then is the remote pack's, named by URL.
    """
    shown = display_url(url)
    for may_retry in (True, False):
        local, manifest, fs, root = fetch_pack_skeleton(url, storage_options, None)
        try:
            check_index_digests(
                local / manifest.index_dir, manifest.index_sha256, shown=f"{shown}/{manifest.index_dir}"
            )
            break
        except PackFormatError:
            if not may_retry:
                raise
            forget_skeleton(local)
    return local, manifest, fs, root


def _remote_record(url: str, which: str, storage_options: dict[str, Any] | None) -> tuple[Sample, Manifest, str]:
    """The sample ``which`` names in the pack at ``url``, read with ranged requests; its manifest; the URL shown."""
    shown = display_url(url)
    local, manifest, fs, root = _checked_skeleton(url, storage_options)
    i = _resolve(local, manifest, which, shown)
    shard = next((s for s in manifest.shards if s.first_index <= i < s.first_index + s.num_samples), None)
    if shard is None:
        raise PackFormatError(f"no shard holds record {i}", path=shown, hint=_VERIFY)
    fmt = get_format(manifest.format)
    rel = fmt.data_name(shard.file)
    j = i - shard.first_index
    index = _index(local, manifest, shown)
    try:
        data, key, label = fmt.read_remote_payload(
            fs, root, shown, rel, local / shard.file, shard, j, opened=manifest, key=index.keys[i]
        )
        _match_index(index, i, key, label, len(data), f"{shown}/{rel}")
    except PackdataError as exc:  # maybe a side table of the cached copy damaged unseen: named by its URL
        if isinstance(exc, PackFormatError):  # and not reused: the next reader downloads a fresh copy
            forget_skeleton(local)
        raise_at_url(exc, local, shown)
    return Sample(index.keys[i], int(index.labels[i]), data, manifest.kind), manifest, shown


_VERIFY = "Run `packdata verify` on the pack"
_EXPORT_AGAIN = "Free space, then export again"


def read_field(
    pack: str | os.PathLike,
    which: str,
    field_name: str | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
) -> bytes:
    """The stored bytes of one sample's field (a single-field pack: its payload; ``cls``: the label as text).

    ``pack`` may be a URL (with ``storage_options`` for fsspec): the sample
    index is downloaded (cached) and the one record read with a ranged request:
    for TFRecord through the offsets index (framing and CRCs checked), for
    LMDB through the shard's ``records.i64`` table (payload CRC32C checked);
    an LMDB shard without a fitting table is refused (stage the pack first).

    Raises:
        ConfigError: no such sample, the sample has no such field, or the
            record cannot be read in place.
    """
    if is_url(pack):
        sample, manifest, where = _remote_record(os.fspath(pack), which, storage_options)
        return _field_of(sample, manifest, field_name, where)
    pack = Path(pack)
    manifest = read_manifest(pack)
    return _field_of(_record(pack, manifest, resolve_sample(pack, which)), manifest, field_name, pack)


def _field_of(sample: Sample, manifest: Manifest, field_name: str | None, pack: str | Path) -> bytes:
    """One field's bytes of a sample as stored (see :func:`read_field`)."""
    if field_name == LABEL_FIELD:
        return str(sample.label).encode("ascii")
    if manifest.kind != "fields":
        if field_name not in (None, manifest.kind):
            raise ConfigError(
                f"this pack holds one {manifest.kind} per sample, not field {field_name!r}",
                path=pack,
                hint=f"Leave the field out, or pass field={manifest.kind}",
            )
        return sample.data
    fields = _fields(sample, pack)
    named = f"Pass field=NAME (such as field={min(fields)})" if fields else None
    if field_name is None:
        if len(fields) != 1:
            raise ConfigError(
                f"sample {sample.key!r} has fields {', '.join(sorted(fields))}: name one", path=pack, hint=named
            )
        field_name = next(iter(fields))
    if field_name not in fields:
        raise ConfigError(
            f"sample {sample.key!r} has no field {field_name!r} ({', '.join(sorted(fields))})", path=pack, hint=named
        )
    return fields[field_name]


def _fields(sample: Sample, pack: str | Path) -> dict[str, bytes]:
    try:
        return decode_block(sample.data)
    except FieldError as exc:
        raise PackFormatError(f"sample {sample.key!r} is damaged: {exc}", path=pack) from exc


@dataclass
class ExportResult:
    """An export: samples and files written, and keys refused (with why)."""

    path: Path
    samples: int = 0
    files: int = 0
    refused: list[dict[str, str]] = field(default_factory=list)


def _inside(root: Path, key: str) -> Path | None:
    """``root/key`` when ``key`` is a plain relative path that stays inside ``root``, else None."""
    parts = key.split("/")
    if key.startswith("/") or any(p in ("", ".", "..") or "\x00" in p for p in parts):
        return None
    target = root.joinpath(*parts)
    real_root = os.path.realpath(root)
    real = os.path.realpath(target.parent)
    if real != real_root and not real.startswith(real_root.rstrip(os.sep) + os.sep):
        return None
    return target


def export_pack(pack: str | os.PathLike, dst: str | os.PathLike, *, layout: str | None = None) -> ExportResult:
    """Write every sample of ``pack`` back as files under ``dst`` (a new or empty folder).

    Args:
        pack: the pack.
        dst: the folder to write into; created if missing, must be empty.
        layout: ``"imagefolder"`` (one file per sample at its key: single-field
            packs) or ``"grouped"`` (``KEY.FIELD`` files that a grouped convert
            reads back as the same samples: class folders made first, a ``KEY.cls``
            file for a label at the top; a single-field pack's key names its file,
            ``cats/1.jpg``). Default: by the pack's kind.

    Returns:
        What was written, and the samples refused with their reasons: a key that
        is not a plain path inside ``dst``, that clashes with another key's
        files, that the file system rejects (a name too long), or, in grouped
        files, whose files a grouped convert would read back as another sample
        (see :func:`_reread_problem`). A refused sample leaves no file behind; the export goes on.

    Raises:
        ConfigError: ``dst`` is not empty, is inside the pack or cannot be made, or the layout does not fit the pack.
        CapacityError: the disk filled up (the samples before stay written).
        PackFormatError: the sample index is missing or damaged, or a record differs from it
            (its key, label or size): the samples before stay written.
    """
    pack, dst = Path(pack), Path(dst)
    manifest = read_manifest(pack)
    layout = layout or ("grouped" if manifest.kind == "fields" else "imagefolder")
    if layout not in ("imagefolder", "grouped"):
        raise ConfigError(f"layout should be 'imagefolder' or 'grouped', but got layout={layout!r}")
    if layout == "imagefolder" and manifest.kind == "fields":
        raise ConfigError("a multi-field pack exports as grouped files", path=pack, hint="Pass layout='grouped'")
    index = _index(pack, manifest)  # read as a dataset reads the pack: keys and labels from the index
    check_index_digests(pack / manifest.index_dir, manifest.index_sha256)  # a damaged index: before dst is made
    check_visible(dst, what="the export destination", hint="Choose a folder this user may search and write")
    if is_inside(dst, pack):  # its files would become part of the pack's folder
        raise ConfigError(
            "export destination is inside the pack being exported", path=dst, hint="Choose a folder outside it"
        )
    if dst.is_symlink() or (dst.exists() and not dst.is_dir()):
        what = "a symbolic link" if dst.is_symlink() else "a file"
        raise ConfigError(f"export destination is {what}, not a folder", path=dst, hint="Choose a new folder")
    if dst.exists() and any(dst.iterdir()):
        raise ConfigError("export destination is not an empty folder", path=dst, hint="Choose a new folder")
    try:
        dst.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a full disk, read-only, a file on the way, no permission
        raise write_error(exc, dst, folder=dst.parent, of="(the export's folder)", hint=_EXPORT_AGAIN) from exc
    result = ExportResult(dst)
    folders = _class_folders(dst, manifest, index) if layout == "grouped" else None
    for shard in manifest.shards:
        path = resolve_in_pack(pack, shard.file, field="shard", manifest=pack / "manifest.json")
        for i, sample in get_format(manifest.format).iter_samples(path, shard.first_index):
            _match_index(index, i, sample.key, sample.label, len(sample.data), path)  # as a dataset reads it
            files = _files_of(sample, manifest, layout, pack, folders)
            targets = [(_inside(dst, name), data) for name, data in files]
            if any(target is None for target, _ in targets):
                result.refused.append({"key": sample.key, "reason": "key is not a plain path inside the folder"})
                continue
            reread = _reread_problem(sample.key, sample.label, manifest.kind, folders) if layout == "grouped" else None
            if reread is not None:  # its files would read back as another sample
                result.refused.append({"key": sample.key, "reason": reread})
                continue
            written: list[Path] = []
            try:
                for target, data in targets:
                    assert target is not None
                    _make_folders(dst, target.parent)
                    with open(target, "xb") as f:  # never over another sample's file
                        written.append(target)
                        f.write(data)
            except (FileExistsError, NotADirectoryError, IsADirectoryError) as exc:
                _undo(dst, written, targets, folders or [])  # no half sample is left behind
                result.refused.append({"key": sample.key, "reason": f"clashes with another key's files ({exc})"})
                continue
            except OSError as exc:
                _undo(dst, written, targets, folders or [])
                if exc.errno in FULL_DISK_ERRNOS:
                    of = f"of the export, after {result.samples} samples were exported"
                    hint = "Free space, delete the partial export and run it again"
                    where = exc.filename or (written[-1] if written else dst)  # a write's error names no file
                    raise no_space_error(exc, where, folder=dst, of=of, hint=hint) from exc
                reason = exc.strerror or str(exc)  # a name too long, a character the file system rejects
                result.refused.append({"key": sample.key, "reason": f"the file system refuses its files ({reason})"})
                continue
            result.files += len(written)
            result.samples += 1
    fsync_dir(dst)
    return result


def _make_folders(dst: Path, folder: Path) -> None:
    """Make ``folder`` and the missing folders between it and ``dst``, outermost first, in a loop.

    ``Path.mkdir(parents=True)`` recurses once per missing folder: a key of
    1,500 parts (3,000 bytes, a path the file system takes) overflowed Python's stack.
    """
    missing: list[Path] = []
    while folder != dst and not folder.is_dir():
        missing.append(folder)
        folder = folder.parent
    for path in reversed(missing):
        path.mkdir(exist_ok=True)  # a file in the way: FileExistsError, a clash


def _undo(dst: Path, written: list[Path], targets: list[tuple[Path | None, bytes]], kept: list[str]) -> None:
    """Remove one sample's files ``written`` and the folders made for it that are left empty (not ``kept``:
    the first-level folders made before any sample)."""
    for path in written:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    for target, _ in targets:
        folder = target.parent if target is not None else dst
        while folder != dst and dst in folder.parents and not (folder.parent == dst and folder.name in kept):
            try:
                folder.rmdir()
            except OSError:  # not empty (another sample's files), or never made
                break
            folder = folder.parent


def _class_folders(dst: Path, manifest: Manifest, index: SampleIndex) -> list[str] | None:
    """The class folders a grouped export makes in ``dst`` before any file, in name order, or None: no key lies in
    a folder named after a class of the pack (a tar's, a ``PackWriter``'s keys: folders are paths, labels in
    ``KEY.cls``, as WebDataset reads them).

    A grouped folder convert reads every first-level folder as a class, numbered
    in name order, empty ones included: made up front (every key's first folder
    and every class a folder can be named after), each sample's label read back
    is known before it is written (:func:`_reread_problem`), whatever samples are refused.
    """
    keys = index.keys
    tops = {keys[i].split("/", 1)[0] for i in range(len(keys)) if "/" in keys[i]}
    tops = {top for top in tops if _folder_name(top)}
    classes = {name for name in manifest.classes if _folder_name(name)}
    if not tops & classes:
        return None
    names = sorted(tops | classes)
    made = []
    for name in names:
        try:
            (dst / name).mkdir()
        except OSError as exc:
            if exc.errno in FULL_DISK_ERRNOS:
                raise no_space_error(exc, dst / name, folder=dst, of="(a class folder)", hint=_EXPORT_AGAIN) from exc
            continue  # a name too long: no folder, and the samples in it refused
        made.append(name)
    return made


def _folder_name(name: str) -> bool:
    """Whether ``name`` can name a first-level folder a grouped convert reads as a class."""
    if not name or "/" in name or "\x00" in name or name.startswith("."):
        return False
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _reread_problem(key: str, label: int, kind: str, folders: list[str] | None) -> str | None:
    """Why the grouped files of sample ``key`` would not read back as it (its key and label), or None.

    A grouped convert takes a file's key up to the first dot of its name and
    skips hidden files; a single-field pack's key names its field (``cats/1.jpg``
    is key ``cats/1``, field ``jpg``); a key in a folder takes the class of its
    first folder, numbered in name order among ``folders`` (:func:`_class_folders`; None: not checked).
    """
    folder, _, name = key.rpartition("/")
    if kind == "fields":
        dotted = dotted_key_problem(key)
        if dotted is not None:
            return dotted
    elif "." not in name:
        return f"its key's last part names no field: a grouped convert reads files named KEY.FIELD ({key}.jpg)"
    if folders is None:  # folders are paths: WebDataset (a tar of the files) reads the key and KEY.cls back
        return None
    if any(part.startswith(".") for part in key.split("/")):
        return "a part of its key starts with a dot: a grouped convert skips its files as hidden"
    if not folder:
        return None
    top = key.split("/", 1)[0]
    at = bisect.bisect_left(folders, top)
    back = at if at < len(folders) and folders[at] == top else None
    if back == label:
        return None
    got = f"label {back}" if back is not None else "a class of its own"
    has = f"label {label}" if label >= 0 else "no label"
    return (
        f"a grouped convert reads its first folder {top!r} as its class ({got}: first-level folders are classes, "
        f"numbered in name order), but it has {has}"
    )


def _files_of(
    sample: Sample, manifest: Manifest, layout: str, pack: Path, folders: list[str] | None
) -> list[tuple[str, bytes]]:
    """The ``(relative path, bytes)`` files one sample exports to (grouped: checked by :func:`_reread_problem`)."""
    if layout == "imagefolder":
        return [(sample.key, sample.data)]
    if manifest.kind == "fields":
        files = [(f"{sample.key}.{name}", data) for name, data in sorted(_fields(sample, pack).items())]
        stem = sample.key
    else:  # the key names its file and field already: cats/1.JPG is key cats/1, field jpg, to a grouped convert
        folder, slash, name = sample.key.rpartition("/")
        stem = folder + slash + name.partition(".")[0]
        files = [(f"{stem}.{name.partition('.')[2].lower()}", sample.data)]  # as a grouped convert names the field
    if sample.label >= 0 and ("/" not in sample.key or folders is None):  # else labelled by its class folder
        files.append((f"{stem}.{LABEL_FIELD}", str(sample.label).encode("ascii")))
    return files
