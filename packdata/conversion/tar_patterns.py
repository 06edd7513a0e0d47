"""The tar shards a pattern names: ``data-{000000..000099}.tar``, ``{a,b}`` choices and globs, on disk or at a URL.

Braces expand left to right (a range keeps its zero padding), then each name that is a glob
is matched (sorted); every other name must be a regular file. A pattern naming more than a
million shards is refused before it is expanded further.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterator
from typing import Any

from packdata.errors import SourceError
from packdata.pack.files import file_kind
from packdata.pack.urls import display_url, remote_error

__all__ = ["expand_shards", "is_tar_pattern"]

_TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_CHOICE = re.compile(r"\{([^{}]*,[^{}]*)\}")
_MAX_SHARDS = 1_000_000


def is_tar_pattern(src: str) -> bool:
    """Whether ``src`` names WebDataset tar shards (a ``.tar``/``.tar.gz`` path or pattern)."""
    return src.lower().endswith(_TAR_SUFFIXES)


def _braces(pattern: str) -> list[str]:
    """Expand ``{000..099}`` ranges (zero padding kept) and ``{a,b}`` choices, left to right.

    Raises:
        SourceError: the pattern names more than :data:`_MAX_SHARDS` shards (in one range, or all together:
            two ranges of a million were a trillion names, a MemoryError).
    """
    names: list[str] = []
    for name in _expand(pattern):
        if len(names) > _MAX_SHARDS:
            raise SourceError(f"the pattern names more than {_MAX_SHARDS} shards", path=pattern)
        names.append(name)
    return names


def _expand(pattern: str) -> Iterator[str]:
    """The names :func:`_braces` expands ``pattern`` to, one at a time."""
    match = _RANGE.search(pattern)
    choice = _CHOICE.search(pattern)
    if match and (not choice or match.start() < choice.start()):
        lo, hi = match.group(1), match.group(2)
        if int(hi) - int(lo) > _MAX_SHARDS:
            raise SourceError(f"the range {match.group(0)} names more than {_MAX_SHARDS} shards", path=pattern)
        width = len(lo) if lo.startswith("0") else 0
        head, tail = pattern[: match.start()], pattern[match.end() :]
        for n in range(int(lo), int(hi) + 1):
            yield from _expand(f"{head}{n:0{width}d}{tail}")
    elif choice:
        head, tail = pattern[: choice.start()], pattern[choice.end() :]
        for option in choice.group(1).split(","):
            yield from _expand(f"{head}{option}{tail}")
    else:
        yield pattern


def expand_shards(pattern: str, fs: Any = None, scheme: str = "") -> list[str]:
    """The tar files ``pattern`` names, in order; each must exist.

    With ``fs`` (an fsspec filesystem), ``pattern`` is a path on it (a URL's
    path, without its ``scheme``), and globs and existence are asked of ``fs``.

    Raises:
        SourceError: the pattern names no file, or a named shard is missing.
    """
    paths: list[str] = []
    for part in _braces(pattern):
        shown = display_url(f"{scheme}://{part}") if fs is not None else part
        if glob.has_magic(part):
            try:
                found = sorted(fs.glob(part)) if fs is not None else sorted(glob.glob(part))
            except Exception as exc:
                raise remote_error(shown, "cannot list the shards", exc) from exc
            if not found:
                raise SourceError("the pattern matches no file", path=shown, hint="Check the shard names")
            paths += found
        elif not _is_file(part, fs, shown):
            kind = _local_kind(part) if fs is None else None
            if kind is not None:  # a FIFO or folder named .tar was "no such tar shard. Check the pattern's range"
                raise SourceError(
                    f"not a tar file: {kind}",
                    path=shown,
                    hint="Name regular tar files (a FIFO or device is never opened)",
                )
            raise SourceError("no such tar shard", path=shown, hint="Check the pattern's range")
        else:
            paths.append(part)
    if not paths:
        raise SourceError("the pattern names no tar shard", path=pattern)
    return paths


def _local_kind(path: str) -> str | None:
    """What a local path that is no regular file is, in words (from ``stat``: never opened); None where nothing is."""
    try:
        return file_kind(os.stat(path).st_mode)
    except (OSError, ValueError):
        return None


def _is_file(path: str, fs: Any, shown: str) -> bool:
    if fs is None:
        return os.path.isfile(path)
    try:
        return bool(fs.isfile(path))
    except Exception as exc:
        raise remote_error(shown, "cannot look the shard up", exc) from exc
