"""The Ray driver's side of the partial folder: resume checks, saved task results and the gather.

:func:`_prepare_partial` readies or resumes ``.NAME.partial``; :func:`_saved_result`
tells which tasks an interrupted run finished; :class:`_Gatherer` appends the
task results in plan order into the pack's index, skip report and shard list;
:func:`_drop_strays` removes what is no shard of the plan.
"""

from __future__ import annotations

import json
import os
import re
import reprlib
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from packdata.conversion.destination import check_resumable, interrupted_error
from packdata.conversion.load import _Options
from packdata.conversion.probes import is_probe, probe_path, probe_place
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
from packdata.conversion.ray_remote import (
    RemoteTarget,
    check_object_name,
    objects_complete,
)
from packdata.conversion.ray_tasks import (
    _RESULT,
    TASKS_DIR,
    ShardTask,
    _task_dir,
    load_result,
    result_most,
    save_result,
)
from packdata.errors import ConfigError, PackFormatError
from packdata.pack.files import (
    PROGRESS_FILE,
    RAY_PLAN_FILE,
    atomic_write,
    discard_partial,
    file_sha256,
    fsync_named,
    read_regular,
)
from packdata.pack.index import (
    FIELD_OFFSETS_FILE,
    FIELD_SIZES_FILE,
    INDEX_DIR,
    KEY_OFFSETS_FILE,
    KEYS_FILE,
    LABELS_FILE,
    SIZES_FILE,
    field_pairs_problem,
    index_files,
)
from packdata.pack.manifest import MANIFEST_NAME, Manifest, ShardInfo, read_manifest
from packdata.pack.manifest.schema import MAX_MANIFEST_BYTES

__all__: list[str] = []

_CHUNK = 1 << 20  # index entries per copy when gathering fragments
_FINISHING = "finishing"  # the plan's key for what finishing needs once every task is gathered (_mark_finishing)
_FINISHING_KEYS = ("written", "found", "bytes_in", "reencoded", "skipped", "skip_examples")


def _keep_fragment(partial: Path, result: dict[str, Any]) -> dict[str, Any]:
    """Write the fragment files a remote task returned into ``tasks/NNNNN`` and save its result there, last."""
    work = _task_dir(partial, int(result["number"]))
    if work.exists():
        shutil.rmtree(work)
    for rel, data in result.pop("fragment").items():
        path = work.joinpath(*check_object_name(rel, os.fspath(work)).split("/"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    save_result(work, result)
    return result


def _saved_result(
    partial: Path, task: ShardTask, kind: str, name: str, data: str, target: RemoteTarget | None
) -> dict[str, Any] | None:
    """The result an interrupted run saved for ``task``, if it is complete, its own and for the same files.

    Its own: it names this task's number and, if any, the shard ``name`` this
    task writes (never a file elsewhere, or another task's fragment).
    Complete: its shard's records file (``data``, inside the partial folder)
    has the size and SHA-256 the result recorded or, with a ``target`` URL, the
    store still reports every object the task uploaded with its recorded size
    and version; and its fragment files (of a pack of ``kind``) still have the
    sizes and SHA-256 it recorded.
    """
    saved = load_result(_task_dir(partial, task.number) / _RESULT, most=result_most(task))
    if saved is None or saved.get("fingerprint") != task.fingerprint or saved.get("number") != task.number:
        return None
    shard = saved.get("shard")
    if shard is not None and (not isinstance(shard, dict) or shard.get("file") != name):
        return None
    if (
        shard is not None
        and target is None
        and not _file_matches(partial / data, shard.get("bytes"), shard.get("sha256"))
    ):
        return None
    if shard is not None and target is not None and not objects_complete(target, saved.get("objects") or {}):
        return None
    if not _adds_up(partial, task, saved):
        return None
    return saved if _fragment_mismatch(_task_dir(partial, task.number), saved, kind) is None else None


def _adds_up(partial: Path, task: ShardTask, saved: dict[str, Any]) -> bool:
    """Whether a saved result holds what :class:`_Gatherer` adds, of the right types and agreeing with its task.

    Agreeing: each entry a sample or a skip, the shard holding the samples, the index fragment one label a sample,
    the probes of the task's own files (a resume stats or looks up no other: ``result.json`` may be edited).
    """
    names, probes = saved.get("field_names"), saved.get("probes", [])  # no probes from an earlier packdata
    if not (
        isinstance(probes, list)
        and len(probes) <= 2
        and all(is_probe(p) for p in probes)
        and {p[0] for p in probes} <= {probe_place(path) for e in task.entries if (path := probe_path(e)) is not None}
        and all(is_count(saved.get(key)) for key in ("samples", "bytes_in", "reencoded"))
        and is_skip_counts(saved.get("skipped"))
        and is_skip_lines(saved.get("skip_examples"))
        and isinstance(names, list)
        and all(isinstance(n, str) for n in names)
        and len(set(names)) == len(names)
    ):
        return False
    samples, shard = saved["samples"], saved.get("shard")
    if saved.get("entries") != len(task.entries) or samples + sum(saved["skipped"].values()) != len(task.entries):
        return False
    if (shard is None) != (samples == 0) or (shard is not None and shard.get("num_samples") != samples):
        return False
    labels = _task_dir(partial, task.number) / INDEX_DIR / LABELS_FILE
    return labels.is_file() and labels.stat().st_size == 4 * samples


def _file_matches(path: Path, size: object, sha256: object) -> bool:
    """Whether ``path`` has the ``size`` and SHA-256 a task's result recorded (hashed only when the size matches)."""
    try:
        return path.stat().st_size == size and file_sha256(path) == sha256
    except OSError:
        return False  # missing, or not a regular file: the task runs again


def _fragment_mismatch(work: Path, result: dict[str, Any], kind: str) -> str | None:
    """The first fragment file the gather appends (index files of ``kind``, then the skip list) that differs from
    the size and SHA-256 its task recorded in ``result`` (or is missing, or unrecorded), relative to ``work``; None
    when each matches."""
    recorded = result.get("fragment_files")
    for rel in (*(f"{INDEX_DIR}/{name}" for name in index_files(kind)), SKIP_REPORT):
        entry = recorded.get(rel) if isinstance(recorded, dict) else None
        if not (isinstance(entry, list) and len(entry) == 2 and _file_matches(work / rel, *entry)):
            return rel
    return None


class _Gatherer:
    """Appends task results, in plan order, to the pack's index, skip report and shard list.

    A fields pack numbers its fields in order of first appearance over the
    whole walk (as the local engine does): each task's own numbers are mapped
    to the pack's as its fragment is appended.
    """

    def __init__(self, partial: Path, kind: str) -> None:
        self.partial = partial
        self.kind = kind
        directory = partial / INDEX_DIR
        directory.mkdir(exist_ok=True)
        # open for the whole gather, closed in close()
        self.files = {name: open(directory / name, "wb") for name in index_files(kind)}  # noqa: SIM115
        for name in (KEY_OFFSETS_FILE, FIELD_OFFSETS_FILE):
            if name in self.files:
                self.files[name].write(np.int64(0).tobytes())
        self.field_names: list[str] = []
        self.field_numbers: dict[str, int] = {}
        self.field_end = 0
        self.report = open(partial / SKIP_REPORT, "wb")  # noqa: SIM115
        self.shards: list[ShardInfo] = []
        self.objects: list[dict[str, list[Any]]] = []  # per shard, the objects its task uploaded (into a URL)
        self.samples = self.files_found = self.bytes_in = self.reencoded = self.key_end = 0
        self.samples_before = 0  # of samples: those of tasks an interrupted run finished (kept on resume)
        self.skipped: Counter[str] = Counter()
        self.skip_examples: list[dict[str, str]] = []

    def add(self, result: dict[str, Any]) -> None:
        """Append one task's result, its fragment files checked first against the sizes and SHA-256 it recorded.

        Raises:
            PackFormatError: a fragment file differs from its record, or holds a field number out of range.
        """
        fragment = _task_dir(self.partial, result["number"])
        damaged = _fragment_mismatch(fragment, result, self.kind)
        if damaged is not None:
            raise PackFormatError(
                "this task's fragment file is missing or differs from the size and SHA-256 its task recorded",
                path=fragment / damaged,
                hint="Run again with resume=True (the task runs again) or overwrite=True",
            )
        source = fragment / INDEX_DIR
        for name in (LABELS_FILE, SIZES_FILE, KEYS_FILE):
            with open(source / name, "rb") as f:
                shutil.copyfileobj(f, self.files[name], 8 << 20)
        self.key_end += self._append_offsets(source / KEY_OFFSETS_FILE, self.key_end)
        if FIELD_SIZES_FILE in self.files:
            self._append_fields(source, result.get("field_names", []))
        with open(fragment / SKIP_REPORT, "rb") as f:
            shutil.copyfileobj(f, self.report, 8 << 20)
        shard = result["shard"]
        if shard is not None:
            self.shards.append(
                ShardInfo(shard["file"], shard["num_samples"], self.samples, shard["bytes"], shard["sha256"])
            )
            self.objects.append(result.get("objects") or {})
        self.samples += result["samples"]
        self.files_found += result["entries"]
        self.bytes_in += result["bytes_in"]
        self.reencoded += result["reencoded"]
        self.skipped.update(result["skipped"])
        room = MAX_SKIP_EXAMPLES - len(self.skip_examples)
        self.skip_examples.extend(result["skip_examples"][:room])

    def _append_offsets(self, fragment: Path, base: int) -> int:
        """Append a fragment's offsets (after its leading 0) moved up by ``base``; its last offset."""
        last = 0
        with open(fragment, "rb") as f:
            f.seek(8)  # every fragment starts with offset 0
            while len(chunk := np.fromfile(f, dtype="<i8", count=_CHUNK)):
                self.files[fragment.name].write((chunk + base).astype("<i8").tobytes())
                last = int(chunk[-1])
        return last

    def _append_fields(self, fragment: Path, names: list[str]) -> None:
        """Append a fragment's field sizes with the task's field numbers mapped to the pack's.

        Raises:
            PackFormatError: a field number is not one of the task's ``names``, or a field size is negative.
        """
        for name in names:
            if name not in self.field_numbers:
                self.field_numbers[name] = len(self.field_names)
                self.field_names.append(name)
        pack_number = np.array([self.field_numbers[name] for name in names], dtype="<i8")
        with open(fragment / FIELD_SIZES_FILE, "rb") as f:
            if (size := os.fstat(f.fileno()).st_size) % 16:
                raise PackFormatError(
                    f"{size} bytes: not a whole number of (field number, size) pairs of 16 bytes",
                    path=fragment / FIELD_SIZES_FILE,
                    hint="Start the conversion again with overwrite=True",
                )
            while len(pairs := np.fromfile(f, dtype="<i8", count=2 * _CHUNK)):
                pairs = pairs.reshape(-1, 2)
                problem = field_pairs_problem(pairs, len(names))
                if problem is not None:
                    raise PackFormatError(
                        problem,
                        path=fragment / FIELD_SIZES_FILE,
                        hint="Start the conversion again with overwrite=True",
                    )
                pairs[:, 0] = pack_number[pairs[:, 0]]
                self.files[FIELD_SIZES_FILE].write(pairs.astype("<i8").tobytes())
        self.field_end += self._append_offsets(fragment / FIELD_OFFSETS_FILE, self.field_end)

    def close(self) -> None:
        for f in (*self.files.values(), self.report):
            if not f.closed:
                f.flush()
                fsync_named(f.fileno(), f.name)
                f.close()


def _prepare_partial(
    partial: Path,
    dst: Path,
    opts: _Options,
    *,
    overwrite: bool,
    resume: bool,
    classes: list[str] | None = None,
    source: Path | str = "",
    places: list[str] | None = None,
) -> tuple[bool, dict[str, Any]]:
    """Make the partial folder ready; whether an interrupted Ray run into it is resumed, and the plan (as written
    now, or as read back and checked: :func:`_mark_finishing` and :func:`_finishing_state` take it, never reading
    the file again).

    ``classes``: the source's, as scanned (recorded in the plan; a resume whose
    source, at ``source``, numbers them otherwise is refused). ``places``: where the
    source is (:func:`~packdata.conversion.publish.source_identity`; a resume reading another is refused).
    """
    state = {"engine": "ray", "options": asdict(opts)}
    recorded = {
        **state,
        **({} if classes is None else {"classes": classes}),
        **({} if places is None else {"source": places}),
    }
    plan = partial / RAY_PLAN_FILE
    if resume and os.path.lexists(partial):
        check_resumable(partial)
    if os.path.lexists(partial):
        if resume and plan.is_file():
            # this run's plan twice (the options and source recorded), the classes an earlier run recorded and the
            # finishing record (a name per shard, counts, MAX_SKIP_EXAMPLES skip lines): each less than a manifest
            most = 2 * len(json.dumps(recorded)) + 2 * MAX_MANIFEST_BYTES
            too_long = PackFormatError(
                f"the interrupted conversion's plan is damaged: it holds more than the {most} bytes packdata "
                "writes there",
                path=plan,
                hint="Start the conversion again with overwrite=True",
            )
            data = read_regular(plan, most, follow_symlinks=False, too_long=too_long)
            try:
                saved = json.loads(data)
            except (ValueError, RecursionError) as exc:
                raise PackFormatError(
                    f"the interrupted conversion's plan is damaged: not JSON ({exc})",
                    path=plan,
                    hint="Start the conversion again with overwrite=True",
                ) from exc
            plan_read = dict(saved) if isinstance(saved, dict) else {}  # all of it, for the finishing steps
            saved_classes = saved.pop("classes", None) if isinstance(saved, dict) else None
            saved_places = saved.pop("source", None) if isinstance(saved, dict) else None
            if isinstance(saved, dict):
                saved.pop(_FINISHING, None)  # what finishing needs: read by _finishing_state
                extra = next((key for key in saved if key not in state), None)
                if extra is not None:  # never taken for other options: no option of this run differs
                    raise PackFormatError(
                        f"the interrupted conversion's plan is damaged: it holds {reprlib.repr(extra)}, which this "
                        "packdata never writes there (a newer packdata's plan, or an edited one)",
                        path=plan,
                        hint="Resume with the packdata that wrote it, or start the conversion again with "
                        "overwrite=True",
                    )
                lost = next((key for key in state if key not in saved), None)  # every plan written holds both
                wrong = None if lost is not None or saved["engine"] == "ray" else saved["engine"]
                if lost is not None or wrong is not None:  # never taken for other options: none may differ
                    what = f"it lacks {lost!r}" if lost is not None else f"its engine is {reprlib.repr(wrong)}"
                    raise PackFormatError(
                        f"the interrupted conversion's plan is damaged: {what}, but every plan packdata writes "
                        "there holds 'engine': 'ray' and the options",
                        path=plan,
                        hint="Start the conversion again with overwrite=True",
                    )
            if saved != state:
                options = saved.get("options") if isinstance(saved, dict) else saved
                raise other_options_error(options, asdict(opts), partial)
            if saved_classes is not None and not (
                isinstance(saved_classes, list) and all(isinstance(c, str) for c in saved_classes)
            ):
                raise PackFormatError(
                    "the interrupted conversion's plan is damaged: classes should be a list of strings",
                    path=plan,
                    hint="Start the conversion again with overwrite=True",
                )
            moved = None if places is None else source_changed_error(saved_places, places, partial)
            if moved is not None:
                raise moved
            changed = None if classes is None else classes_changed_error(saved_classes, classes, source)
            if changed is not None:
                raise changed
            (partial / TASKS_DIR).mkdir(exist_ok=True)
            return True, plan_read
        if resume and (partial / PROGRESS_FILE).is_file():
            raise ConfigError(
                "the interrupted conversion into it ran on the local engine",
                path=dst,
                hint="Resume it with engine='local', or start again with overwrite=True",
            )
        if not overwrite and not resume:
            raise interrupted_error(dst, partial)
        discard_partial(partial)
    (partial / TASKS_DIR).mkdir(parents=True)
    plan.write_text(json.dumps(recorded), encoding="utf-8")
    return False, recorded


def _drop_strays(partial: Path, shards: list[ShardInfo]) -> None:
    """Remove what is no file of the finished pack, but its plan: the tasks' folder, and what an interrupted run
    left (no shard of this plan, as the source may have shrunk; a killed write's temporary file)."""
    stems = tuple(Path(s.file).stem + "." for s in shards)  # a shard and its companions (a .tfindex)
    for path in partial.iterdir():
        if path.name in (INDEX_DIR, SKIP_REPORT, MANIFEST_NAME, RAY_PLAN_FILE) or path.name.startswith(stems):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _mark_finishing(partial: Path, plan: dict[str, Any], record: dict[str, Any]) -> None:
    """Add ``record`` to the plan, atomically: what the finishing steps need (the shards' names as written, the
    result's counts), kept until the plan goes; written before the manifest, whose presence says it is complete.
    ``plan``: this run's own, as :func:`_prepare_partial` wrote or checked it."""
    atomic_write(partial / RAY_PLAN_FILE, json.dumps({**plan, _FINISHING: record}).encode("utf-8"))


def _finishing_state(
    partial: Path, saved: dict[str, Any], shard_name: Callable[[int], str]
) -> tuple[Manifest, dict[str, Any]] | None:
    """The manifest and finishing record of a resumed run killed while finishing (every task gathered, the manifest
    written, the plan not yet removed), or None when the tasks are to be gathered (again). ``saved``: the plan as
    :func:`_prepare_partial` read and checked it; ``shard_name``: the format's name of a shard as a task writes it.

    Raises:
        PackFormatError: the manifest or the plan's finishing record is damaged.
    """
    plan = partial / RAY_PLAN_FILE
    if not (partial / MANIFEST_NAME).is_file() or _FINISHING not in saved:
        return None  # killed before the manifest: the tasks' results are all there
    manifest = read_manifest(partial)
    record = saved[_FINISHING]
    problem = _finishing_problem(record, manifest, shard_name)
    if problem is not None:
        raise PackFormatError(
            f"the interrupted conversion's plan is damaged: its finishing record {problem}",
            path=plan,
            hint="Start the conversion again with overwrite=True",
        )
    return manifest, record


def _finishing_problem(record: object, manifest: Manifest, shard_name: Callable[[int], str]) -> str | None:
    """What is wrong with a finishing record read from the plan, for ``manifest``; None when nothing is."""
    if not isinstance(record, dict) or set(record) != set(_FINISHING_KEYS):
        return "should be an object of the result's counts and the shards' names"
    written = record["written"]
    if not isinstance(written, list) or len(written) != len(manifest.shards):
        return f"should name the manifest's {len(manifest.shards)} shards"
    if not all(isinstance(name, str) and name == shard_name(_number(name)) for name in written):
        return "should name each shard as a task writes it"
    if len(set(written)) != len(written):
        return "should name each shard once"
    counts = all(is_count(record[key]) for key in ("found", "bytes_in", "reencoded"))
    if not (counts and is_skip_counts(record["skipped"]) and is_skip_lines(record["skip_examples"])):
        return "should hold counts, skip counts and skip examples"
    return None


def _number(name: str) -> int:
    """The first number in ``name`` (a shard's as written), or -1."""
    found = re.search(r"[0-9]+", name)
    return int(found.group()) if found else -1
