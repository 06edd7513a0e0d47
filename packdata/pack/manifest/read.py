"""Read a pack's manifest: validated, with every path it names resolved inside the pack."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from packdata.errors import PackFormatError
from packdata.pack.files import file_kind, not_a_file
from packdata.pack.manifest.model import (
    CHECKSUM_KEY,
    FORMAT_VERSION,
    MANIFEST_NAME,
    SINGLE_FIELD_VERSION,
    STAGED_FILE,
    Manifest,
    ShardInfo,
    evicted_mark,
    manifest_checksum,
)
from packdata.pack.manifest.schema import (
    MANIFEST_HINT,
    field_error,
    parse_manifest,
    plain_name_problem,
    validate_manifest,
)

__all__ = ["read_manifest", "resolve_in_pack"]


def _escapes(root_real: str, path: str) -> bool:
    real = os.path.realpath(path)
    return real != root_real and not real.startswith(root_real.rstrip(os.sep) + os.sep)


def resolve_in_pack(root: str | os.PathLike, name: str, *, field: str, manifest: str | os.PathLike) -> Path:
    """The path of ``name`` inside the pack ``root``, proven not to leave it.

    ``name`` must be a plain name (no separator, no ``..``, no NUL byte). When
    the entry exists it must not resolve outside ``root`` through a symlink, and
    when it is a folder (an LMDB shard) neither may any entry directly in it.

    Args:
        root: the pack folder.
        name: the file or folder name a manifest gives.
        field: the manifest field it came from, for the message.
        manifest: the manifest file, for the message.

    Raises:
        PackFormatError: naming the manifest, the field and the value.
    """
    problem = plain_name_problem(name)
    if problem is not None:
        raise field_error(manifest, field, f"{problem} inside the pack", name)
    path = Path(root) / name
    root_real = os.path.realpath(root)
    if os.path.lexists(path):
        if _escapes(root_real, os.fspath(path)):
            raise field_error(manifest, field, "should stay inside the pack, but it is a symlink leading out", name)
        if path.is_dir():
            try:
                entries = list(os.scandir(path))
            except OSError as exc:
                raise PackFormatError(f"cannot list {field}: {exc.strerror}", path=path) from exc
            for entry in entries:
                if entry.is_symlink() and _escapes(root_real, entry.path):
                    raise PackFormatError(
                        f"{entry.name} in {field} is a symlink leading out of the pack",
                        path=entry.path,
                        hint="Remove it: packdata never follows a pack's files outside the pack",
                    )
    return path


def _check_origin(manifest_path: Path, number: int, shard: ShardInfo, seen: dict[str, Manifest]) -> None:
    """A staged pack's shard left at its origin: a shard of a real pack, with the same checksum."""
    field = f"shards[{number}].file"
    origin = os.path.dirname(shard.file)
    if origin not in seen:
        try:
            seen[origin] = _read(Path(origin), external=False)
        except PackFormatError as exc:  # one hint: the origin's own ("convert ... first") would not apply here
            found = exc.message if exc.path == origin else f"{exc.path}: {exc.message}"
            hint = exc.hint or "Stage the pack again"
            if not os.path.lexists(os.path.join(origin, MANIFEST_NAME)):
                hint = "Its origin was moved or removed: stage the pack again from where it is now, "
                hint += f"or move it back to {origin}"
            raise PackFormatError(
                f"manifest field {field!r} names a shard of {origin}, which is not a readable pack: {found}",
                path=manifest_path,
                hint=hint,
            ) from exc
    name = os.path.basename(shard.file)
    match = next((s for s in seen[origin].shards if s.file == name), None)
    if match is None or (match.sha256, match.bytes) != (shard.sha256, shard.bytes):
        problem = "no longer lists it" if match is None else "now lists it with another checksum or size"
        raise PackFormatError(  # a staged copy's origin converted again: its staged shards are of the old pack
            f"manifest field {field!r} names shard {name} of {origin}, which {problem}: "
            "the pack was converted again since it was staged",
            path=manifest_path,
            hint=f"Stage it again (packdata stage {origin} ...); its staged shards are of the pack as it was",
        )
    resolve_in_pack(origin, name, field=field, manifest=manifest_path)


def _exists(path: Path) -> bool:
    """Whether ``path`` exists; False also where it cannot be told (a name too long to be one)."""
    try:
        return path.exists()
    except OSError:
        return False


def _pack_around(path: Path) -> Path | None:
    """The pack that ``path`` (a shard, a file of one) lies inside, if one of its nearest folders is a pack."""
    for parent in list(path.parents)[:3]:  # a shard file, or a file in a shard's folder (LMDB's data.mdb)
        if not_a_file(parent / MANIFEST_NAME) is None:
            return parent
    return None


def _read(pack: Path, *, external: bool, staged: bool = True) -> Manifest:
    path = pack / MANIFEST_NAME
    try:
        mode: int | None = os.stat(pack).st_mode
    except (FileNotFoundError, NotADirectoryError):
        mode = None
    except OSError as exc:  # a name too long, a folder it may not search: one line, not a traceback
        raise PackFormatError(
            f"cannot be read ({exc.strerror})", path=pack, hint="Name a pack's folder that this process may read"
        ) from exc
    if mode is not None and not stat.S_ISDIR(mode):  # a file given for the pack: not a damaged manifest inside it
        hint = "Pass the pack's folder"
        if pack.name == MANIFEST_NAME:
            hint = f"Pass the folder that holds it: {pack.parent}"
        elif around := _pack_around(pack):
            hint = f"It lies inside the pack {around}: pass that folder"
        raise PackFormatError(
            f"is {file_kind(mode)}, not a packdata pack (a folder holding {MANIFEST_NAME})", path=pack, hint=hint
        )
    problem = not_a_file(path)
    if problem and problem != "is missing":  # something else stands in its place
        raise PackFormatError(f"{MANIFEST_NAME} {problem}", path=path, hint=MANIFEST_HINT)
    if problem:
        hint = "Convert a folder with `packdata convert SRC DST` first"
        if _exists(pack.parent / f".{pack.name}.partial"):
            hint = (
                "A conversion into it was interrupted: finish it with resume (`packdata convert SRC DST --resume`);"
                " a PackWriter's cannot be resumed: write it again"
            )
        elif _exists(pack / STAGED_FILE):  # a stage's marker, written before its first manifest
            hint = "A stage into it was interrupted before its manifest was written: stage the pack again"
        elif mode is not None and (around := _pack_around(pack)):  # a shard's folder given for its pack
            hint = f"It lies inside the pack {around}: pass that folder"
        problem = f"not a packdata pack (no {MANIFEST_NAME})" if mode is not None else "no such pack"
        if mode is None and not_a_file(evicted_mark(pack)) is None:  # the cache's record of evicting it
            problem = (
                "no such pack: the staged copy was evicted from its cache (a stage with a cache limit needed the room)"
            )
            hint = "Open the pack's URL again, or stage it again, to fetch a new copy"
        raise PackFormatError(problem, path=pack, hint=hint)
    data = parse_manifest(path)
    version = data.get("format_version", SINGLE_FIELD_VERSION)
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        raise PackFormatError(
            f"pack format version {version} is newer than this packdata reads ({FORMAT_VERSION})",
            path=pack,
            hint="Upgrade packdata: pip install -U packdata",
        )
    checksum = data.pop(CHECKSUM_KEY, None)
    manifest = validate_manifest(data, path)
    if checksum is not None and checksum != manifest_checksum(data):
        raise PackFormatError(
            "manifest checksum does not match its content (a damaged or hand-edited manifest)",
            path=path,
            hint=MANIFEST_HINT,
        )
    if not staged and manifest.staged_from is not None:  # before any path it names is looked at
        raise PackFormatError("is a staged pack's manifest", path=path, hint="Point at the original pack")
    if not external and any(os.path.isabs(s.file) for s in manifest.shards):
        raise PackFormatError(
            "is a staged pack whose shards are partly elsewhere; it cannot be the origin of another",
            path=pack,
            hint="Stage from the original pack",
        )
    seen: dict[str, Manifest] = {}
    for number, shard in enumerate(manifest.shards):
        if os.path.isabs(shard.file):
            _check_origin(path, number, shard, seen)
        else:
            resolve_in_pack(pack, shard.file, field=f"shards[{number}].file", manifest=path)
    resolve_in_pack(pack, manifest.index_dir, field="index.dir", manifest=path)
    return manifest


def read_manifest(pack: str | os.PathLike, *, staged: bool = True) -> Manifest:
    """Read a pack's manifest and validate all of it.

    The schema is checked strictly (:func:`validate_manifest`) and every path
    it names is resolved inside the pack (:func:`resolve_in_pack`); the shards a
    staged pack left at its origin must be shards of that pack, with the same
    checksum. ``staged=False`` refuses a staged pack before any path its
    manifest names is looked at (a manifest from a URL names no local file).

    Raises:
        PackFormatError: the path is missing, is not a pack, is damaged, names a
            path outside the pack, or was written by a newer packdata.
    """
    return _read(Path(pack), external=True, staged=staged)
