"""An append's plan file, ``.append-aN.json`` in the pack: its name, reading it back (every name checked), finding
the plans in a pack and whether one fits it, and the generation N of the names an append gives.

:mod:`packdata.conversion.append` writes the plan once its files are prepared and carries it out; what is read
back here is trusted only once checked: a plan longer than packdata writes is refused unread, a link or a FIFO in
its place never followed or opened for reading.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from packdata.errors import PackFormatError
from packdata.pack.files import open_regular
from packdata.pack.index import INDEX_DIR
from packdata.pack.manifest import Manifest, plain_name_problem, validate_manifest
from packdata.pack.manifest.schema import MAX_MANIFEST_BYTES

__all__ = ["STAGING", "AppendPlan", "generation_of", "plan_fits", "plan_path", "plans_in", "read_plan"]

STAGING = ".append-a"
"""An append's files are prepared in ``.append-aN.partial`` in the pack (N: the append's generation)."""


def plan_path(dst: Path, generation: int) -> Path:
    """Where an append writes its plan, once complete: ``.append-aN.json`` in the pack, deleted last."""
    return dst / f"{STAGING}{generation}.json"


@dataclass
class AppendPlan:
    """An append's plan, read back from its file (every name checked)."""

    path: Path
    manifest: Manifest  # the pack's manifest once the append took effect
    appended: Manifest  # the appended pack's manifest (what the append adds)
    moves: list[tuple[str, str]]  # (path in the appended pack, path in the pack) of every file it moves
    drop: str | None  # the index folder two appends old, deleted once this one took effect

    @property
    def generation(self) -> int:
        return generation_of(self.manifest.index_dir)


def read_plan(dst: Path, path: Path) -> AppendPlan:
    """The plan of an append into ``dst``, from the file ``path``.

    Raises:
        PackFormatError: the plan is damaged.
    """
    hint = f"Remove {path.name} from the pack, then append again without resume"
    try:  # a FIFO in its place would block the read for ever, a link lead out of the pack
        with os.fdopen(open_regular(path, follow_symlinks=False), "rb") as file:
            if (size := os.fstat(file.fileno()).st_size) > _PLAN_MOST:  # a stranger's file: never read
                raise PackFormatError(
                    f"the plan of an interrupted append is {size} bytes, {_OVER}", path=path, hint=hint
                )
            data = json.loads(file.read(_PLAN_MOST + 1))
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nested past Python's stack
        raise PackFormatError(f"the plan of an interrupted append is unreadable ({exc})", path=path, hint=hint) from exc
    if not isinstance(data, dict) or set(data) != {"manifest", "appended", "moves", "drop"}:
        raise PackFormatError("the plan of an interrupted append is not one packdata wrote", path=path, hint=hint)
    manifest = validate_manifest(data["manifest"], path)
    appended = validate_manifest(data["appended"], path)
    moves, drop = data["moves"], data["drop"]
    generation = generation_of(manifest.index_dir)
    if not (
        isinstance(moves, list)
        and all(isinstance(m, list) and len(m) == 2 and all(map(_relative_in_pack, m)) for m in moves)
        and all(m[1].startswith(f"shard-a{generation}-") for m in moves)  # the new shards' files only
        and (drop is None or plain_name_problem(drop) is None)
        and generation > 0
        and path == plan_path(dst, generation)
    ):
        raise PackFormatError("the plan of an interrupted append is not one packdata wrote", path=path, hint=hint)
    return AppendPlan(path, manifest, appended, [(a, b) for a, b in moves], drop)


# An append's plan at its longest: two manifests, and its moves (a pair of names per file of the appended pack's
# shards: less than twice what its manifest, at its longest, says of them)
_PLAN_MOST = 4 * MAX_MANIFEST_BYTES
_OVER = f"more than the {_PLAN_MOST} packdata writes at most"


def _relative_in_pack(path: object) -> bool:
    """Whether ``path`` is a file name in a pack, or a name in a shard folder there (``NAME/FILE``)."""
    if not isinstance(path, str):
        return False
    parts = path.split("/")
    return len(parts) <= 2 and all(plain_name_problem(part) is None for part in parts)


def plan_fits(journal: AppendPlan, manifest: Manifest) -> bool:
    """Whether an append's plan grows the pack as it is now (its shards kept, its index the one replaced)."""
    kept = journal.manifest.shards[: len(manifest.shards)]
    return (
        kept == manifest.shards
        and journal.manifest.index.get("previous") == manifest.index_dir
        and journal.generation > generation_of(manifest.index_dir)
        and (journal.manifest.format, journal.manifest.kind) == (manifest.format, manifest.kind)
    )


def plans_in(dst: Path) -> list[Path]:
    """The plans of appends in ``dst`` (``.append-aN.json``), newest first."""
    found = []
    for entry in os.scandir(dst):
        digits = entry.name[len(STAGING) : -len(".json")]
        if entry.name.startswith(STAGING) and entry.name.endswith(".json") and digits.isdigit():
            found.append((int(digits), Path(entry.path)))
    return [path for _, path in sorted(found, reverse=True)]


def generation_of(name: str) -> int:
    """N of a name an append gave (``shard-aN-...``, ``index-aN``), else 0."""
    for prefix in ("shard-a", f"{INDEX_DIR}-a"):
        if name.startswith(prefix):
            digits = name[len(prefix) :].split("-", 1)[0]
            if digits.isdigit():
                return int(digits)
    return 0
