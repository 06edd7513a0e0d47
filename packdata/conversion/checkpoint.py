"""The local engine's checkpoint, ``progress.json`` in the partial pack: what it records, and its one loader.

A resume truncates, appends to and renames files by what the checkpoint says,
so :meth:`_Checkpoint.load` checks every value (types, ranges, how they add up,
shard names, the skip report's length) before any is used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import reprlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from packdata.conversion.probes import Lookup, check_probes, is_probe, stat_probe
from packdata.conversion.publish import (
    MAX_SKIP_EXAMPLES,
    SKIP_REPORT,
    classes_changed_error,
    is_count,
    is_skip_counts,
    is_skip_lines,
    other_options_error,
    source_changed_error,
)
from packdata.conversion.sources import RemoteFile
from packdata.errors import ConfigError, PackFormatError
from packdata.pack.files import atomic_write, read_regular
from packdata.pack.index import ALL_FILES, FIELD_SIZES_FILE, field_file_problem
from packdata.pack.manifest import ShardInfo, is_sha256
from packdata.pack.manifest.schema import MAX_MANIFEST_BYTES

__all__ = ["MAX_PROBES", "MAX_WATCHED_BYTES", "closed_shard_names"]

_COUNTS = ("files_done", "samples_done", "skip_report_bytes", "bytes_in", "reencoded", "shard_first", "shard_bytes")
_WALK = "walk_labels_sha256"  # of walk_record(entry) over the walk (earlier: "walk_sha256", of keys only)
_VERSION = 1
"""progress.json's ``version``: a checkpoint that has it holds every field :meth:`_Checkpoint.state` writes."""
_REQUIRED = (
    "options", "classes", _WALK, "skipped", "skip_examples", "shards", "finishing", "field_names", "index_files",
    *_COUNTS,
)  # fmt: skip
"""What every checkpoint holds, an earlier packdata's too (one without walk_labels_sha256 is refused first)."""
_ADDED = ("source", "probes", "copied_journal", "copied_journal_sha256")
"""Fields added since walk_labels_sha256, in that order: a checkpoint without ``version`` (an earlier packdata's)
holds the first few, each up to the last it holds."""
_SHARD_KEYS = {f.name for f in dataclasses.fields(ShardInfo)}
MAX_PROBES = 256
"""Packed files whose size and modification time a checkpoint keeps, spread over the walk, for a resume to stat."""

MAX_WATCHED_BYTES = 4 * MAX_MANIFEST_BYTES
"""The most bytes :func:`closed_shard_names` reads of a running conversion's ``progress.json``: a checkpoint holds
what its manifest will (classes, fields, shards: at most ``MAX_MANIFEST_BYTES``) and a bounded rest."""

# The most bytes JSON writes of what a checkpoint holds (every byte of a string at most 6: "\u001f"):
_PATH_JSON = 6 * 4096 + 2  # a path (PATH_MAX bytes), a URL or a version, quoted
_NAME_JSON = 6 * 255 + 2  # a file's name (NAME_MAX bytes) or a field's, quoted
_PROBE_JSON = 2 * _PATH_JSON + 32  # [path or URL, size, mtime_ns or version]
_SKIP_EXAMPLE_JSON = 4 * _PATH_JSON  # a skip's key, reason and detail: an error's message naming a path or two
_ENTRY_JSON = 2 * (_NAME_JSON + 160)  # a shard's listing, or an index file's [size, SHA-256], by name


class _Checkpoint:
    """The resumable state of a conversion, saved in ``progress.json``."""

    def __init__(
        self, path: Path, options: dict[str, Any], classes: Sequence[str] = (), source: Sequence[str] = ()
    ) -> None:
        self.path = path
        self.options = options
        self.source = list(source)  # where the source is (source_identity): a resume must read the same
        self.saved_source: list[str] | None = None  # the interrupted run's (None: an earlier packdata kept none)
        self.classes = list(classes)  # the source's, as scanned: its labels number them
        self.saved_classes: list[str] | None = None  # the interrupted run's (None until loaded)
        self.files_done = 0
        self.samples_done = 0
        self.walk = hashlib.sha256()
        self.skip_report_bytes = 0
        self.skipped: Counter[str] = Counter()
        self.skip_examples: list[dict[str, str]] = []
        self.bytes_in = 0
        self.reencoded = 0
        self.shards: list[ShardInfo] = []
        self.shard_first = 0
        self.shard_bytes = 0
        self.walk_expected = ""
        self.field_names: list[str] = []  # a fields pack's field numbers, in order of first appearance
        self.finishing = False  # every shard is closed and listed: only naming, manifest and publish remain
        self.index_files: dict[str, list[object]] | None = None  # the sample index's sizes and SHA-256s
        self.probes: list[list[Any]] = []  # [path, size, mtime_ns] of packed files (see probe)
        self._probe_every = 1  # one commit in so many keeps its probe: doubled each time the list is thinned
        self._commits = 0
        self._tail = False  # the last probe is only the latest commit's: the next one replaces it
        self.copied_journal: int | None = None  # a copy of a URL's folder: its download journal's bytes before packing
        self.copied_journal_sha256: str | None = None  # ... and their SHA-256 (None from an earlier packdata)

    def state(self) -> dict[str, Any]:
        """What :meth:`save` writes, as of now."""
        return {
            "version": _VERSION,
            "options": self.options,
            "classes": self.classes,
            "source": self.source,
            "files_done": self.files_done,
            "samples_done": self.samples_done,
            _WALK: self.walk.hexdigest(),
            "skip_report_bytes": self.skip_report_bytes,
            "skipped": dict(self.skipped),
            "skip_examples": list(self.skip_examples),  # a copy: a snapshot is saved later (_settle)
            "bytes_in": self.bytes_in,
            "reencoded": self.reencoded,
            "shards": [asdict(s) for s in self.shards],
            "shard_first": self.shard_first,
            "shard_bytes": self.shard_bytes,
            "finishing": self.finishing,
            "field_names": list(self.field_names),
            "index_files": self.index_files,
            "probes": list(self.probes),
            "copied_journal": self.copied_journal,
            "copied_journal_sha256": self.copied_journal_sha256,
        }

    def save(self, state: dict[str, Any] | None = None) -> None:
        """Write the state (by default, as of now) to ``progress.json``, atomically."""
        atomic_write(self.path, json.dumps(self.state() if state is None else state).encode("utf-8"))

    def load(self, shard_name: Callable[[int], str]) -> None:
        """Take the saved state, every value checked first (``shard_name``: the format's name of shard ``i``).

        Raises:
            ConfigError: the interrupted conversion used other options, or an earlier or newer packdata made it.
            PackFormatError: ``progress.json`` is not a checkpoint packdata wrote (naming the first bad field).
        """
        state = _checked_state(self.path, self.options, shard_name, self._most_bytes())
        for name in _COUNTS:
            setattr(self, name, state[name])
        self.skipped = Counter(state["skipped"])
        self.skip_examples = state["skip_examples"]
        self.shards = [ShardInfo(**s) for s in state["shards"]]
        self.walk_expected = state[_WALK]
        self.finishing = state["finishing"]
        self.field_names = state["field_names"]
        self.index_files = state["index_files"]  # None: no index file kept yet
        self.saved_classes = state["classes"]
        self.saved_source = state.get("source")
        self.probes = state.get("probes", [])  # none from an earlier packdata
        self.copied_journal = state.get("copied_journal")  # None from an earlier packdata, or not a copy
        self.copied_journal_sha256 = state.get("copied_journal_sha256")

    def _most_bytes(self) -> int:
        """The most bytes a ``progress.json`` of this conversion can hold (more is not its checkpoint).

        Its options, source and classes are this run's (twice their size: an
        interrupted run's other classes are refused as such, not as too many
        bytes); at most :data:`MAX_PROBES` probes and ``MAX_SKIP_EXAMPLES``
        skip examples; a listing per file or folder the partial pack holds (a
        shard, an index file); a name per field its field sizes can number (a
        pair of int64s each, at least).
        """
        entries = fields = 0
        for root, folders, files in os.walk(self.path.parent):
            entries += len(folders) + len(files)
            if FIELD_SIZES_FILE in files:
                with contextlib.suppress(OSError):  # gone since the walk: no field of it
                    fields += os.lstat(os.path.join(root, FIELD_SIZES_FILE)).st_size // 16
        fixed = 2 * len(json.dumps(self.state())) + MAX_PROBES * _PROBE_JSON + MAX_SKIP_EXAMPLES * _SKIP_EXAMPLE_JSON
        return fixed + entries * _ENTRY_JSON + fields * _NAME_JSON

    def probe(self, path: str | RemoteFile) -> None:
        """Record the size and modification time of ``path``, the last file packed before this commit.

        At most :data:`MAX_PROBES` are kept, spread over the walk (every other
        one dropped when full, and probes kept half as often), and always the
        latest commit's, the file likeliest to be rewritten still (by a producer
        writing the source as it is packed): a stat a commit (thousands of
        samples) while converting, as many at a resume. A probe equal to the
        last one (the same tar, read on) is not kept twice: it would take the
        place of the files probed before it when the list is thinned.
        """
        self._commits += 1
        probe = stat_probe(path)
        if probe is None:
            return
        kept = self._commits % self._probe_every == 0
        if self.probes and self.probes[-1] == probe:  # the last one's file as it was (a tar read on): one probe
            self._tail = self._tail and not kept
            return
        if self._tail:
            self.probes.pop()
        self._tail = not kept
        self.probes.append(probe)
        if len(self.probes) > MAX_PROBES:
            self.probes = self.probes[::2]  # the first and the latest kept
            self._probe_every *= 2

    def check_probes(
        self, walked: set[str], what: str = "a file packed", lookup: Lookup | None = None, *, walked_only: bool = False
    ) -> None:
        """Refuse a resume where a packed file probed changed since (its size or modification time).

        A sample: a source rewritten as a whole (images resized again, captions
        regenerated) is found, a single file edited in place most often not.
        ``walked``: the probes' places that the resume's walk of the packed part
        gave again; a probe naming any other is refused before anything is
        looked at (``progress.json`` edited: a file outside the source, a link, a
        FIFO), or passed over with ``walked_only`` (the walk differs: files gone
        are the source's change, which the caller names). ``what`` the files are,
        for the message (``"a tar read"``: tar shards); ``lookup`` asks the store
        for a list's objects (:func:`~packdata.conversion.probes.remote_lookup`).

        Raises:
            PackFormatError: a probe names a file the walk did not give (naming ``progress.json``).
            SourceError: naming the first file that changed (resumable: the partial is kept).
        """
        unknown = next((probe[0] for probe in self.probes if probe[0] not in walked), None)
        if unknown is not None and not walked_only:
            raise _damaged(
                self.path,
                f"probes names {unknown!r}, which is not a file the interrupted conversion packed "
                "(a resume looks only at those)",
            )
        check_probes([probe for probe in self.probes if probe[0] in walked], what, lookup)

    def check_source(self) -> None:
        """Refuse a resume that reads another source than the interrupted run read.

        Raises:
            ConfigError: naming both (:func:`source_changed_error`).
        """
        error = source_changed_error(self.saved_source, self.source, self.path.parent)
        if error is not None:
            raise error

    def check_classes(self, source: Path | str) -> None:
        """Refuse a resume whose source numbers its classes otherwise than the interrupted run's did.

        Raises:
            SourceError: naming the source and the first class that differs (:func:`classes_changed_error`).
        """
        error = classes_changed_error(self.saved_classes, self.classes, source)
        if error is not None:
            raise error

    def check_shard_bytes(self, sizes: Path) -> None:
        """Refuse a ``shard_bytes`` other than the sizes the kept sample index gives the open shard's samples (those
        from ``shard_first`` to ``samples_done``): it decides where a ``shard_size`` limit closes the shard.

        Call once the kept index files matched the SHA-256s the checkpoint records (``sizes``: its ``sizes.i64``).

        Raises:
            PackFormatError: naming ``progress.json``'s ``shard_bytes``.
        """
        if self.finishing:  # every shard is closed: none is open
            return
        count, total = self.samples_done - self.shard_first, 0
        with open(sizes, "rb") as f:
            f.seek(8 * self.shard_first)
            for start in range(0, count, 1 << 20):  # flat memory, whatever the count
                total += int(np.fromfile(f, dtype="<i8", count=min(1 << 20, count - start)).sum())
        if total != self.shard_bytes:
            should = f"the {total} bytes the kept sample index gives the open shard's {count} samples"
            raise _bad(self.path, "shard_bytes", should, self.shard_bytes)

    def check_field_names(self, field_sizes: Path) -> None:
        """Refuse ``field_names`` that do not name every field number of the field sizes a resume kept.

        Call once the kept index files matched the SHA-256s the checkpoint records.

        Raises:
            PackFormatError: naming ``progress.json``'s ``field_names``.
        """
        problem = field_file_problem(field_sizes, len(self.field_names))
        if problem is not None:
            should = f"a name for each field number of the kept sample index ({problem})"
            raise _bad(self.path, "field_names", should, self.field_names)


def _damaged(path: Path, what: str) -> PackFormatError:
    return PackFormatError(
        f"the interrupted conversion's checkpoint is damaged: {what}",
        path=path,
        hint="Start the conversion again with overwrite=True",
    )


def _bad(path: Path, field: str, should: str, value: object) -> PackFormatError:
    return _damaged(path, f"{field} should be {should}, but got {field}={reprlib.repr(value)}")


def _read(path: Path, most: int, damaged: Callable[[Path, str], PackFormatError] = _damaged) -> bytes:
    """The bytes of ``progress.json``: a regular file, never through a link, of at most ``most`` bytes (a longer one
    is refused by its size, unread; one that grows past it is read no further).

    Raises:
        PackFormatError: ``damaged(path, what)``: it is a link, FIFO, device or folder, or longer.
    """
    over = damaged(path, f"it holds more than the {most} bytes a checkpoint of this conversion can hold")
    try:  # a FIFO in its place would block the read for ever, a link to /dev/zero never end it
        return read_regular(path, most, follow_symlinks=False, too_long=over)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise damaged(path, "it is a symlink, not the file packdata wrote") from exc
        if exc.errno == errno.EINVAL:  # "not a regular file: a FIFO"
            raise damaged(path, f"it is {exc.strerror}") from exc
        raise


def closed_shard_names(path: Path) -> list[str]:
    """The shard files listed by ``path``, the checkpoint of a conversion running now, for a watcher in another thread
    (:class:`~packdata.conversion.upload.ShardUploader`); none while it is not written yet or not a checkpoint.

    Read as a resume reads it, to at most :data:`MAX_WATCHED_BYTES`: a FIFO in its place never blocks the watcher
    (which the conversion waits for at its end), a link to ``/dev/zero`` or a huge file never fills memory.

    Raises:
        PackFormatError: it is a link, FIFO, device or folder, or longer (naming it).
    """
    try:
        state = json.loads(_read(path, MAX_WATCHED_BYTES, _replaced))
        return [shard["file"] for shard in state["shards"]]
    except (OSError, ValueError, RecursionError, KeyError, TypeError):
        return []  # not written yet, or not a checkpoint: the next look sees the next one


def _replaced(path: Path, what: str) -> PackFormatError:
    return PackFormatError(
        f"the running conversion's checkpoint was replaced by a file packdata never writes: {what}",
        path=path,
        hint="Nothing was read from it, and nothing published: the pack waits in the work folder. "
        "Check what else writes there, then run again with resume=True",
    )


def _checked_state(path: Path, options: dict[str, Any], shard_name: Callable[[int], str], most: int) -> dict[str, Any]:
    """``progress.json`` (of at most ``most`` bytes) parsed, with each value of the right type and range and all of
    them agreeing.

    Agreeing: each file walked gave a sample or a skip; the shards are named
    ``shard_name(0)``, ``shard_name(1)``, ... and their samples follow one
    another up to ``shard_first`` (up to ``samples_done`` once ``finishing``);
    the skip report holds at least the bytes the checkpoint kept of it.
    """
    try:
        state = json.loads(_read(path, most))
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, nested past Python's stack
        raise _damaged(path, f"not JSON ({exc})") from exc
    if not isinstance(state, dict):
        raise _damaged(path, f"a JSON {type(state).__name__}, not an object")
    if "walk_sha256" in state and _WALK not in state:  # its walk's digest covered keys only
        raise ConfigError(
            "the interrupted conversion was made by an earlier packdata, whose checkpoint cannot tell whether "
            "a list's labels changed since",
            path=path.parent,
            hint="Start again with overwrite=True",
        )
    fields = _required(path, state)
    for name in fields:
        if name not in state:
            raise _damaged(path, f"it lacks {name}")
    extra = next((name for name in state if name not in fields), None)
    if extra is not None:  # a newer or tampered writer's: never read as this version with it dropped
        raise _damaged(path, f"it holds {reprlib.repr(extra)}, which no checkpoint of its version holds")
    if state["options"] != options:
        raise other_options_error(state["options"], options, path.parent)
    for name in _COUNTS:
        if not is_count(state[name]):
            raise _bad(path, name, "an integer >= 0", state[name])
    if not is_sha256(state[_WALK]):
        raise _bad(path, _WALK, "64 lowercase hex digits", state[_WALK])
    skipped = state["skipped"]
    if not is_skip_counts(skipped):
        raise _bad(path, "skipped", "an object of reason -> count", skipped)
    walked = state["samples_done"] + sum(skipped.values())
    if state["files_done"] != walked:
        raise _bad(path, "files_done", f"samples_done plus the files skipped ({walked})", state["files_done"])
    if not is_skip_lines(state["skip_examples"]):
        raise _bad(path, "skip_examples", f"a list of at most {MAX_SKIP_EXAMPLES} skip lines", state["skip_examples"])
    finishing = state["finishing"]
    if not isinstance(finishing, bool):
        raise _bad(path, "finishing", "true or false", finishing)
    _check_shards(path, state, shard_name)
    names = state["field_names"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise _bad(path, "field_names", "a list of distinct strings", names)
    source = state.get("source", [])  # absent from an earlier packdata's
    if not isinstance(source, list) or not all(isinstance(s, str) for s in source):
        raise _bad(path, "source", "a list of strings", source)
    classes = state["classes"]
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise _bad(path, "classes", "a list of strings", classes)
    kept = state["index_files"]
    if kept is not None and not (
        isinstance(kept, dict)
        and all(name in ALL_FILES for name in kept)
        and all(isinstance(v, list) and len(v) == 2 and is_count(v[0]) and is_sha256(v[1]) for v in kept.values())
    ):
        raise _bad(path, "index_files", "an object of file name -> [size, SHA-256]", kept)
    if kept is None and "version" in state and (state["shards"] or state["samples_done"]):  # this packdata's: kept
        raise _damaged(path, "index_files is null, but this packdata records the kept sample index's SHA-256s")
    probes = state.get("probes", [])  # absent from an earlier packdata's
    if not isinstance(probes, list) or len(probes) > MAX_PROBES or not all(is_probe(p) for p in probes):
        should = f"a list of at most {MAX_PROBES} [path, size, mtime_ns] or [URL, size, version]"
        raise _bad(path, "probes", should, probes)
    copied = state.get("copied_journal")
    if copied is not None and not is_count(copied):
        raise _bad(path, "copied_journal", "an integer >= 0 or null", copied)
    copied_sha256 = state.get("copied_journal_sha256")
    if copied_sha256 is not None and not (copied is not None and is_sha256(copied_sha256)):
        raise _bad(path, "copied_journal_sha256", "a SHA-256 (with copied_journal) or null", copied_sha256)
    report = path.parent / SKIP_REPORT
    size = report.stat().st_size if report.is_file() else 0
    if state["skip_report_bytes"] > size:
        raise _bad(path, "skip_report_bytes", f"at most the {size} bytes of {SKIP_REPORT}", state["skip_report_bytes"])
    return state


def _required(path: Path, state: dict[str, Any]) -> tuple[str, ...]:
    """The fields ``state`` holds, no more, no fewer: all with ``version``; without it (an earlier packdata's), those
    it held then.

    An earlier packdata's holds the fields of :data:`_ADDED` up to the last
    one it holds, so one that lacks a field it held (a damaged file) is named.

    Raises:
        ConfigError: its ``version`` is a newer packdata's (naming the file and the version).
        PackFormatError: its ``version`` is no packdata's (not an integer, or below this one's).
    """
    if "version" in state:
        version = state["version"]
        if is_count(version) and version > _VERSION:
            raise ConfigError(
                f"the interrupted conversion's checkpoint is of version {version}, written by a newer packdata: "
                f"this one reads version {_VERSION} and earlier",
                path=path,
                hint="Resume with the packdata that wrote it, or start the conversion again with overwrite=True",
            )
        if version != _VERSION or not is_count(version):
            raise _bad(path, "version", str(_VERSION), version)
        return ("version", *_REQUIRED, *_ADDED)
    held = max((i + 1 for i, name in enumerate(_ADDED) if name in state), default=0)
    return (*_REQUIRED, *_ADDED[:held])


def _check_shards(path: Path, state: dict[str, Any], shard_name: Callable[[int], str]) -> None:
    """The closed shards: named as the format numbers them (never a path), their samples following one another."""
    shards = state["shards"]
    if not isinstance(shards, list):
        raise _bad(path, "shards", "a list", shards)
    first = 0
    for i, shard in enumerate(shards):
        where = f"shards[{i}]"
        if not isinstance(shard, dict) or set(shard) != _SHARD_KEYS:
            raise _bad(path, where, f"an object of {', '.join(sorted(_SHARD_KEYS))}", shard)
        if shard["file"] != shard_name(i):
            raise _bad(path, f"{where}.file", repr(shard_name(i)), shard["file"])
        for key in ("num_samples", "bytes"):
            if not is_count(shard[key]):
                raise _bad(path, f"{where}.{key}", "an integer >= 0", shard[key])
        if shard["first_index"] != first:
            raise _bad(
                path, f"{where}.first_index", f"{first} (the samples of the shards before)", shard["first_index"]
            )
        if not is_sha256(shard["sha256"]):
            raise _bad(path, f"{where}.sha256", "64 lowercase hex digits", shard["sha256"])
        first += shard["num_samples"]
    if state.get("finishing") is True:  # the last shard is closed and listed too
        if not shards or first != state["samples_done"] or shards[-1]["first_index"] != state["shard_first"]:
            raise _bad(path, "shards", f"every shard, {state['samples_done']} samples in all (finishing)", shards)
    elif state["shard_first"] != first or first > state["samples_done"]:
        raise _bad(path, "shard_first", f"the {first} samples of the shards listed", state["shard_first"])
