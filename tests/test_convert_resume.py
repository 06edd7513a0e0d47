"""convert's resume: an interrupted conversion continued, refused when anything it kept or read changed since."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import IMAGE_EXTS, expected_samples, image_bytes, killed_at_files_done, tree_digest
from conftest import interrupted_convert as _interrupted_convert
from conftest import pack_contents as _pack_contents

from packdata import (
    ConfigError,
    LMDBDataset,
    PackFormatError,
    SourceError,
    TFRecordIndexedDataset,
    convert,
    verify_pack,
)
from packdata.cli import main
from packdata.conversion.destination import partial_path


def test_interrupted_partial_needs_resume_or_overwrite(image_folder: Path, tmp_path: Path) -> None:
    partial_path(tmp_path / "out.lmdb").mkdir()  # no checkpoint in it: nothing to continue
    with pytest.raises(ConfigError, match=r"no checkpoint to continue from\. Pass overwrite=True to start again"):
        convert(image_folder, tmp_path / "out.lmdb", progress=False)


def test_a_resume_with_other_options_names_each_that_differs_as_a_flag(
    image_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It printed the saved options as a Python dict ({'format': 'lmdb', ..., 'shard_samples': 200}), eight of them."""
    dst = tmp_path / "out.lmdb"
    _interrupted_convert(image_folder, dst, monkeypatch, shard_samples=4)
    args = ["convert", str(image_folder), str(dst), "--resume", "--shard-samples", "6", "--on-error", "fail", "-q"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    assert result.output == (
        f"Error: {partial_path(dst)}: the interrupted conversion used other options: "
        "--on-error skip (this run: 'fail'), --shard-samples 4 (this run: 6). "
        "Resume with the same options, or start again with --overwrite\n"
    )


@pytest.mark.parametrize("planted", ["skipped.jsonl", "index/labels.i32", "shard-00000.lmdb/data.mdb"])
def test_resume_refuses_a_symlink_planted_in_the_partial_pack(
    image_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planted: str
) -> None:
    """A resume truncates and appends to the partial's files: a link there would send that elsewhere."""
    dst = tmp_path / "out.lmdb"
    _interrupted_convert(image_folder, dst, monkeypatch)
    victim = tmp_path / "precious.bin"
    victim.write_bytes(b"user data " * 500)
    (partial_path(dst) / planted).unlink()
    (partial_path(dst) / planted).symlink_to(victim)
    with pytest.raises(ConfigError, match=f"holds .*{planted}, a symlink: packdata never writes one"):
        convert(image_folder, dst, progress=False, resume=True)
    assert victim.read_bytes() == b"user data " * 500
    assert not dst.exists()
    convert(image_folder, dst, progress=False, overwrite=True)  # --overwrite starts again
    assert victim.read_bytes() == b"user data " * 500
    assert _pack_contents(dst) == expected_samples(image_folder, IMAGE_EXTS)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
@pytest.mark.parametrize("folder", ["", "index"])
def test_resume_refuses_a_partial_pack_whose_folder_another_user_owns(
    image_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, folder: str
) -> None:
    """A partial pack left in a shared area by another user (or one of its folders theirs) was resumed into: its
    owner could swap a file for a link between the resume's checks and its writes. Refused now, naming it."""
    dst = tmp_path / "out.lmdb"
    _interrupted_convert(image_folder, dst, monkeypatch)
    theirs = partial_path(dst) / folder if folder else partial_path(dst)
    os.chown(theirs, 65534, 65534)
    before = tree_digest(partial_path(dst))
    message = f"the interrupted conversion's folder {theirs} belongs to another user (uid 65534), who could swap"
    with pytest.raises(ConfigError, match=re.escape(message) + ".*Move it away, or start again with overwrite=True"):
        convert(image_folder, dst, progress=False, resume=True)
    assert tree_digest(partial_path(dst)) == before and not dst.exists()
    convert(image_folder, dst, progress=False, overwrite=True)  # --overwrite starts again
    assert _pack_contents(dst) == expected_samples(image_folder, IMAGE_EXTS)


def test_resume_names_a_partial_shard_cut_short_instead_of_dying_in_lmdb(
    image_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LMDB maps as many pages as the meta page says: on a cut file its truncation walk was a SIGBUS."""
    dst = tmp_path / "out.lmdb"
    _interrupted_convert(image_folder, dst, monkeypatch)
    data = partial_path(dst) / "shard-00000.lmdb" / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    resume = subprocess.run(
        [sys.executable, "-m", "packdata.cli", "convert", str(image_folder), str(dst), "--resume", "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert resume.returncode == 1, resume.stderr
    last = resume.stderr.strip().splitlines()[-1]
    assert f"{data}: the interrupted conversion's shard is damaged: is truncated" in last
    assert last.endswith("Convert again with --overwrite")
    assert partial_path(dst).is_dir() and not dst.exists()
    convert(image_folder, dst, progress=False, overwrite=True)
    assert _pack_contents(dst) == expected_samples(image_folder, IMAGE_EXTS)


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_resume_refuses_a_kept_record_damaged_since_it_was_written(
    image_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """A resume keeps the shard's records as found: one damaged on disk must not be vouched for by the new pack."""
    dst = tmp_path / f"out.{fmt}"
    _interrupted_convert(image_folder, dst, monkeypatch, format=fmt)
    data = partial_path(dst) / ("shard-00000.lmdb/data.mdb" if fmt == "lmdb" else "part-00000.tfrecord")
    first = (image_folder / "cat" / "a.jpg").read_bytes()
    blob = bytearray(data.read_bytes())
    at = blob.find(first)
    assert at > 0
    while at > 0:  # every copy: LMDB's freed pages keep older ones
        blob[at + len(first) // 2] ^= 0x55
        at = blob.find(first, at + 1)
    data.write_bytes(bytes(blob))
    found = "record 0 is damaged: payload CRC-32" if fmt == "lmdb" else "shard is damaged: .* CRC32C of the data"
    with pytest.raises(PackFormatError, match=found):
        convert(image_folder, dst, progress=False, resume=True, format=fmt)
    assert not dst.exists()


@pytest.mark.parametrize("name", ["labels.i32", "keys.utf8", "key_offsets.i64"])
def test_resume_refuses_a_sample_index_changed_since_its_checkpoint(
    image_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """The kept part of the index is the pack's keys and labels: a flipped byte would change them silently."""
    dst = tmp_path / "out.lmdb"
    _interrupted_convert(image_folder, dst, monkeypatch)
    path = partial_path(dst) / "index" / name
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2 if name == "keys.utf8" else 8] ^= 0x01  # a label, a key's byte, the second key's offset
    path.write_bytes(bytes(blob))
    with pytest.raises(PackFormatError, match=f"{name}: the interrupted conversion's sample index is damaged"):
        convert(image_folder, dst, progress=False, resume=True)
    assert not dst.exists()
    convert(image_folder, dst, progress=False, overwrite=True)
    assert _pack_contents(dst) == expected_samples(image_folder, IMAGE_EXTS)


@pytest.mark.parametrize(
    ("fmt", "gone"),
    [
        ("lmdb", "index/sizes.i64"),
        ("lmdb", "shard-00000.lmdb/data.mdb"),
        ("tfrecord", "part-00000.tfindex"),
        ("tfrecord", "part-00000.tfrecord"),
    ],
)
def test_resume_names_a_partial_file_that_is_gone(
    image_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, gone: str
) -> None:
    """A file the checkpoint keeps part of, deleted since: one line, not a raw FileNotFoundError or a late failure."""
    dst = tmp_path / f"out.{fmt}"
    _interrupted_convert(image_folder, dst, monkeypatch, format=fmt)
    (partial_path(dst) / gone).unlink()
    with pytest.raises(PackFormatError, match=r"interrupted conversion's .*(missing|gone).*overwrite=True"):
        convert(image_folder, dst, progress=False, resume=True, format=fmt)
    assert not dst.exists()


def test_a_tfrecord_resume_checks_the_record_table_rows_it_keeps(
    image_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The .tfpayload rows say where each payload lies: a kept row shifted since was published, then met by readers."""
    import numpy as np

    dst = tmp_path / "out.tfrecord"
    _interrupted_convert(image_folder, dst, monkeypatch, format="tfrecord")
    table = partial_path(dst) / "part-00000.tfpayload"
    rows = np.frombuffer(table.read_bytes(), dtype="<i8").copy()
    rows[7] += 6  # the first record's payload offset (two header rows of three, then offset, payload start)
    table.write_bytes(rows.tobytes())
    with pytest.raises(
        PackFormatError,
        match=r"part-00000\.tfpayload: the interrupted conversion's payload table is damaged: the payload table does "
        r"not point at the payload of the record at byte offset \d+ of part-00000\.tfrecord, and the record is sound",
    ):
        convert(image_folder, dst, progress=False, resume=True, format="tfrecord")
    assert not dst.exists()


@pytest.mark.parametrize("earlier", [False, True])
def test_a_resumed_pack_equals_an_uninterrupted_one_index_included(
    image_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, earlier: bool
) -> None:
    """Resume hashes the kept index and goes on hashing what it appends (``earlier``: a checkpoint without digests,
    null; one without the field at all is damaged)."""
    _interrupted_convert(image_folder, tmp_path / "resumed.lmdb", monkeypatch)
    if earlier:
        progress = partial_path(tmp_path / "resumed.lmdb") / "progress.json"
        state = json.loads(progress.read_text())
        state["index_files"] = None  # as an earlier packdata's (no version) could hold
        del state["version"]
        progress.write_text(json.dumps(state))
    convert(image_folder, tmp_path / "resumed.lmdb", progress=False, resume=True)
    convert(image_folder, tmp_path / "whole.lmdb", progress=False)
    for name in ("labels.i32", "sizes.i64", "keys.utf8", "key_offsets.i64"):
        resumed, whole = (tmp_path / p / "index" / name for p in ("resumed.lmdb", "whole.lmdb"))
        assert resumed.read_bytes() == whole.read_bytes(), name
    assert verify_pack(tmp_path / "resumed.lmdb", progress=False).records == 19  # raises on a digest that differs


def test_a_resumed_conversion_rates_only_its_own_samples(
    image_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The summary's files/s divided every sample of the pack, the interrupted run's too, by the resumed run's time."""
    from packdata.conversion import load

    dst = tmp_path / "out.lmdb"
    _interrupted_convert(image_folder, dst, monkeypatch, after=15)
    before = json.loads((partial_path(dst) / "progress.json").read_text())["samples_done"]
    assert 0 < before < 19
    real_load = load._load

    def slow_load(entry, opts):  # each file this run reads takes 0.1 s: it packs at most 10 files/s
        time.sleep(0.1)
        return real_load(entry, opts)

    with monkeypatch.context() as m:
        m.setattr(load, "_load", slow_load)
        out = CliRunner().invoke(main, ["convert", str(image_folder), str(dst), "--resume", "--workers", "1", "-q"])
    assert out.exit_code == 0, out.output
    rate = float(re.search(r"out [^,]+, ([\d,.]+) files/s", out.output).group(1).replace(",", ""))
    assert rate <= 10, out.output
    shutil.rmtree(dst)
    _interrupted_convert(image_folder, dst, monkeypatch, after=15)
    result = convert(image_folder, dst, progress=False, resume=True, workers=1)
    assert (result.packed, result.packed_before) == (19, before)
    assert result.rate == pytest.approx((19 - before) / result.seconds)
    assert result.to_dict()["packed_before"] == before


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_resume_names_a_closed_shard_gone_or_cut_since_the_interruption(
    image_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, damage: str
) -> None:
    """A shard closed before the interruption is listed from the checkpoint: it must still be the file closed."""
    dst = tmp_path / f"out.{fmt}"
    _interrupted_convert(image_folder, dst, monkeypatch, after=7, format=fmt, shard_samples=2)
    data = partial_path(dst) / ("shard-00000.lmdb/data.mdb" if fmt == "lmdb" else "part-00000.tfrecord")
    if damage == "deleted":
        data.unlink()
    else:
        os.truncate(data, data.stat().st_size - 1)
    with pytest.raises(PackFormatError, match="a shard of the interrupted conversion is"):
        convert(image_folder, dst, progress=False, resume=True, format=fmt, shard_samples=2)
    assert not dst.exists()


@pytest.mark.parametrize("line", [b"0 x", b"0", b"5 1000", b"-16 16", b"0 99999999999999999999999"])
def test_resume_names_a_damaged_tfrecord_offsets_index(
    image_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, line: bytes
) -> None:
    """The partial's offsets index says where the kept records end: a damaged line is named, never followed."""
    dst = tmp_path / "out.tfrecord"
    _interrupted_convert(image_folder, dst, monkeypatch, format="tfrecord")
    index = partial_path(dst) / "part-00000.tfindex"
    lines = index.read_bytes().split(b"\n")
    index.write_bytes(b"\n".join([line, *lines[1:]]))
    with pytest.raises(PackFormatError, match="offsets index is damaged"):
        convert(image_folder, dst, progress=False, resume=True, format="tfrecord")
    assert not dst.exists()


def _set(**values: object) -> Callable[[dict], object]:
    def edit(state: dict) -> object:
        state.update(values)
        return state

    return edit


def _shard0(**values: object) -> Callable[[dict], object]:
    def edit(state: dict) -> object:
        state["shards"][0].update(values)
        return state

    return edit


_DAMAGED_CHECKPOINTS = {  # how progress.json is damaged -> the field the error names
    "not JSON": (lambda state: "{", "not JSON"),
    "nested deeply": (lambda state: "[" * 100_000, "not JSON .maximum recursion depth"),
    "a list": (lambda state: [state], "a JSON list, not an object"),
    "a key missing": (lambda state: {k: v for k, v in state.items() if k != "samples_done"}, "it lacks samples_done"),
    "a string count": (_set(files_done="5"), "files_done should be an integer >= 0, but got files_done='5'"),
    "a float count": (_set(samples_done=4.0), "samples_done should be an integer >= 0"),
    "null": (_set(bytes_in=None), "bytes_in should be an integer >= 0, but got bytes_in=None"),
    "a boolean count": (_set(shard_bytes=True), "shard_bytes should be an integer >= 0"),
    "a negative report length": (_set(skip_report_bytes=-1), "skip_report_bytes should be an integer >= 0"),
    "a report length past the report": (_set(skip_report_bytes=10**6), "skip_report_bytes should be at most the 0"),
    "files walked again": (_set(files_done=0), r"files_done should be samples_done plus the files skipped \(4\)"),
    "skips as a list": (_set(skipped=["corrupt image"]), "skipped should be an object of reason -> count"),
    "a skip count as text": (_set(skipped={"empty": "1"}), "skipped should be an object of reason -> count"),
    "a bad skip example": (_set(skip_examples=[1]), "skip_examples should be a list of at most 20 skip lines"),
    "fields as text": (_set(field_names="jpg"), "field_names should be a list of distinct strings"),
    "a field number": (_set(field_names=[1]), "field_names should be a list of distinct strings"),
    "finishing as text": (_set(finishing="false"), "finishing should be true or false, but got finishing='false'"),
    "finishing with a shard open": (_set(finishing=True), r"shards should be every shard, 4 samples in all"),
    "classes as text": (_set(classes="cat,dog"), "classes should be a list of strings, but got classes='cat,dog'"),
    "index files as a list": (_set(index_files=[1]), "index_files should be an object of file name -> .size, SHA-256."),
    "a journal digest alone": (
        _set(copied_journal_sha256="0" * 64),
        r"copied_journal_sha256 should be a SHA-256 \(with copied_journal\) or null, but got copied_journal_sha256='0",
    ),
    "shard_first moved": (_set(shard_first=1), "shard_first should be the 2 samples of the shards listed"),
    "shards as an object": (_set(shards={}), "shards should be a list"),
    "a shard as a number": (_set(shards=[1]), r"shards\[0\] should be an object of bytes, file, first_index"),
    "a shard count as text": (_shard0(num_samples="2"), r"shards\[0\].num_samples should be an integer >= 0"),
    "a shard moved": (_shard0(first_index=1), r"shards\[0\].first_index should be 0"),
    "a shard without checksum": (_shard0(sha256=""), r"shards\[0\].sha256 should be 64 lowercase hex digits"),
}


@pytest.mark.parametrize("damage", list(_DAMAGED_CHECKPOINTS))
def test_resume_names_a_damaged_checkpoint_field_and_changes_nothing(
    image_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """Every value in progress.json is checked before a resume truncates, appends or renames by it."""
    dst = tmp_path / "out.lmdb"
    _interrupted_convert(image_folder, dst, monkeypatch, shard_samples=2)
    progress = partial_path(dst) / "progress.json"
    state = json.loads(progress.read_text())
    assert state["samples_done"] == 4 and len(state["shards"]) == 1 and state["skip_report_bytes"] == 0
    edit, named = _DAMAGED_CHECKPOINTS[damage]
    damaged = edit(state)
    progress.write_text(damaged if isinstance(damaged, str) else json.dumps(damaged))
    before = tree_digest(partial_path(dst))
    with pytest.raises(
        PackFormatError, match=f"progress.json: the interrupted conversion's checkpoint is damaged: {named}"
    ):
        convert(image_folder, dst, progress=False, resume=True, shard_samples=2)
    assert tree_digest(partial_path(dst)) == before and not dst.exists()
    result = CliRunner().invoke(main, ["convert", str(image_folder), str(dst), "--resume", "--shard-samples", "2"])
    assert result.exit_code == 1 and result.output.count("\n") == 1, result.output  # one line, no traceback
    assert result.output.rstrip().endswith("Start the conversion again with --overwrite")
    convert(image_folder, dst, progress=False, overwrite=True, shard_samples=2)
    assert verify_pack(dst, progress=False).records == 19


@pytest.mark.parametrize("layout", ["list", "grouped"])
def test_a_resume_refuses_a_source_whose_classes_changed_since(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """A list's new label, or a new class folder, renumbered the classes; the samples packed before kept old numbers.

    (The walk of the part already packed is the same: no key changed.) The resume
    gave cat's samples the label of the new class 'ant'; it is refused now, the partial kept.
    """
    src = tmp_path / "src"
    rows = ["path,label"]
    for i in range(8):
        cls = "cat" if i < 4 else "dog"
        (src / cls).mkdir(parents=True, exist_ok=True)
        (src / cls / f"{i}.txt").write_text(f"t{i}", encoding="utf-8")
        (src / cls / f"{i}.json").write_text(f"[{i}]", encoding="utf-8")
        rows.append(f"{cls}/{i}.txt,{cls}")
    (src / "l.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    source, options = (src / "l.csv", {"label_column": "label"}) if layout == "list" else (src, {"layout": "grouped"})
    dst = tmp_path / "out.lmdb"
    _interrupted_convert(source, dst, monkeypatch, after=3, **options)
    if layout == "list":  # a row added at the end, of a class sorted first
        (src / "ant.txt").write_text("new", encoding="utf-8")
        (src / "l.csv").write_text("\n".join([*rows, "ant.txt,ant"]) + "\n", encoding="utf-8")
    else:  # a class folder made, not filled yet
        (src / "ant").mkdir()
    before = tree_digest(partial_path(dst))
    message = "the source's classes changed since the interrupted conversion (class 0 was 'cat', is now 'ant')"
    with pytest.raises(SourceError, match=re.escape(message)):
        convert(source, dst, progress=False, resume=True, **options)
    assert tree_digest(partial_path(dst)) == before and not dst.exists()


@pytest.mark.parametrize("layout", ["folder", "list"])
def test_a_resume_from_another_source_with_the_same_names_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """The checkpoint did not record which source it read: a conversion of v1 (images_256/, say) resumed from v2
    (images_512/: the same names and classes, other bytes) gave a pack of v1's first samples and v2's last ones,
    which neither gives. It is refused now, naming both sources, the partial kept for v1."""
    for version in ("v1", "v2"):
        rows = ["path,label"]
        for i in range(8):
            cls = "cat" if i < 4 else "dog"
            (tmp_path / version / cls).mkdir(parents=True, exist_ok=True)
            (tmp_path / version / cls / f"{i}.txt").write_text(f"{version} {i}", encoding="utf-8")
            rows.append(f"{cls}/{i}.txt,{cls}")
        (tmp_path / f"{version}.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
        shutil.move(tmp_path / f"{version}.csv", tmp_path / version / "list.csv")
    options = {"list": {"label_column": "label"}}.get(layout, {})
    source = {"folder": "{v}", "list": "{v}/list.csv"}[layout]
    v1, v2 = (tmp_path / source.format(v=v) for v in ("v1", "v2"))
    dst = tmp_path / "out.lmdb"
    _interrupted_convert(v1, dst, monkeypatch, after=3, **options)
    before = tree_digest(partial_path(dst))
    message = f"the interrupted conversion read another source ({v1.resolve()}; this run reads {v2.resolve()})"
    with pytest.raises(ConfigError, match=re.escape(message)):
        convert(v2, dst, progress=False, resume=True, **options)
    assert tree_digest(partial_path(dst)) == before and not dst.exists()
    assert convert(v1, dst, progress=False, resume=True, **options).resumed
    convert(v1, tmp_path / "whole.lmdb", progress=False, **options)
    assert tree_digest(dst) == tree_digest(tmp_path / "whole.lmdb")


def test_a_resume_over_a_changed_source_keeps_the_interrupted_conversion(
    image_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusal deleted the partial pack: a file moved for a while (a mount not up yet) cost the whole run so far."""
    dst = tmp_path / "out.lmdb"
    _interrupted_convert(image_folder, dst, monkeypatch)
    checkpoint = (partial_path(dst) / "progress.json").read_bytes()
    (image_folder / "cat" / "a.jpg").rename(tmp_path / "a.jpg")
    message = "the source folder changed since the interrupted conversion. Restore it as it was and resume"
    with pytest.raises(SourceError, match=re.escape(message)) as refused:  # kept, as a caller logging it would
        convert(image_folder, dst, progress=False, resume=True)
    assert (partial_path(dst) / "progress.json").read_bytes() == checkpoint and not dst.exists()
    (tmp_path / "a.jpg").rename(image_folder / "cat" / "a.jpg")
    # the failed run's open shard went with it, not with the traceback: 'already open in this process' once
    assert convert(image_folder, dst, progress=False, resume=True).resumed and refused.value.resumable
    convert(image_folder, tmp_path / "whole.lmdb", progress=False)
    for name in ("keys.utf8", "labels.i32", "sizes.i64"):
        assert (dst / "index" / name).read_bytes() == (tmp_path / "whole.lmdb" / "index" / name).read_bytes()
    assert verify_pack(dst, progress=False).records == 19


def test_a_resume_refuses_other_required_fields(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """require was no option a checkpoint kept: a resume without it packed what the interrupted run had skipped.

    (6 samples and 2 'missing field' skips: a pack neither run alone gives, 4 or 8 samples.)
    """
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"{i}.txt").write_text(f"t{i}", encoding="utf-8")
        if i % 2:
            (src / f"{i}.json").write_text(f"[{i}]", encoding="utf-8")
    dst = tmp_path / "out.lmdb"
    _interrupted_convert(src, dst, monkeypatch, after=2, layout="grouped", require=["json"])
    before = tree_digest(partial_path(dst))
    result = CliRunner().invoke(main, ["convert", str(src), str(dst), "--layout", "grouped", "--resume", "-q"])
    assert result.exit_code == 1
    assert result.output == (
        f"Error: {partial_path(dst)}: the interrupted conversion used other options: --require json (this run: ''). "
        "Resume with the same options, or start again with --overwrite\n"
    )
    assert tree_digest(partial_path(dst)) == before and not dst.exists()
    resumed = convert(src, dst, layout="grouped", require=["json"], resume=True, progress=False)
    assert (resumed.packed, resumed.skipped) == (4, {"missing field": 4})


@pytest.mark.parametrize(("kept", "named"), [(["json"], "1 field"), ([], "0 fields")])
def test_resume_refuses_field_names_that_miss_a_kept_field_number(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kept: list[str], named: str
) -> None:
    """progress.json's field_names number the kept index's fields: cut short, a resume numbered md anew, and the
    published index gave the kept samples' txt (or json) sizes to md."""
    src = tmp_path / "grouped"
    src.mkdir()
    for i in range(10):  # json and txt, then md and txt: md is new after the checkpoint at 4 samples
        (src / f"s{i:02d}.txt").write_text(f"t{i}", encoding="utf-8")
        (src / (f"s{i:02d}.json" if i < 4 else f"s{i:02d}.md")).write_text(json.dumps({"n": i}), encoding="utf-8")
    dst = tmp_path / "out.lmdb"
    _interrupted_convert(src, dst, monkeypatch, after=5)
    progress = partial_path(dst) / "progress.json"
    state = json.loads(progress.read_text())
    assert state["samples_done"] == 4 and state["field_names"] == ["json", "txt"]
    progress.write_text(json.dumps({**state, "field_names": kept}))
    with pytest.raises(
        PackFormatError,
        match=r"progress.json: the interrupted conversion's checkpoint is damaged: field_names should be a name for "
        rf"each field number of the kept sample index \(field number 1 is out of range for {named}\), but got",
    ):
        convert(src, dst, progress=False, resume=True)
    assert not dst.exists()
    result = CliRunner().invoke(main, ["convert", str(src), str(dst), "--resume"])
    assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
    assert result.output.rstrip().endswith("Start the conversion again with --overwrite")
    convert(src, dst, progress=False, overwrite=True)
    assert LMDBDataset(dst).pack.index.field_names == ["json", "txt", "md"]


@pytest.mark.parametrize("name", ["../victim.tfrecord", "absolute", "skipped.jsonl", "part-00001.tfrecord"])
def test_resume_renames_no_file_a_checkpoint_names_outside_its_shards(
    image_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """A TFRecord pack's last step renames the listed shards: only the partial pack's own shard files may be named."""
    dst = tmp_path / "out"
    _interrupted_convert(image_folder, dst, monkeypatch, format="tfrecord", shard_samples=2, after=7)
    victims = {tmp_path / "victim.tfrecord": b"precious records", tmp_path / "victim.tfindex": b"0 16\n"}
    for path, data in victims.items():
        path.write_bytes(data)
    progress = partial_path(dst) / "progress.json"
    state = json.loads(progress.read_text())
    assert [s["file"] for s in state["shards"]] == ["part-00000.tfrecord", "part-00001.tfrecord"]
    state["shards"][0]["file"] = os.fspath(tmp_path / "victim.tfrecord") if name == "absolute" else name
    progress.write_text(json.dumps(state))
    before = tree_digest(partial_path(dst))
    with pytest.raises(PackFormatError, match=r"shards\[0\].file should be 'part-00000.tfrecord', but got"):
        convert(image_folder, dst, progress=False, resume=True, format="tfrecord", shard_samples=2)
    assert {path: path.read_bytes() for path in victims} == victims
    assert tree_digest(partial_path(dst)) == before and not dst.exists()


@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_a_partial_pack_that_is_not_a_folder_is_named_and_overwrite_replaces_only_it(
    image_folder: Path, tmp_path: Path, kind: str
) -> None:
    dst = tmp_path / "out.lmdb"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("x")
    if kind == "symlink":
        partial_path(dst).symlink_to(elsewhere)
    else:
        partial_path(dst).write_text("x")
    with pytest.raises(
        ConfigError, match=f"is a {'symlink' if kind == 'symlink' else 'regular file'}, not an interrupted"
    ):
        convert(image_folder, dst, progress=False, resume=True)
    with pytest.raises(ConfigError, match="Pass overwrite=True to start again"):
        convert(image_folder, dst, progress=False)
    convert(image_folder, dst, progress=False, overwrite=True)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["keep"]
    assert _pack_contents(dst) == expected_samples(image_folder, IMAGE_EXTS)


_SLOW_CONVERT = """
import importlib, sys, time
c = importlib.import_module("packdata.conversion.convert")
local = importlib.import_module("packdata.conversion.local")
ld = importlib.import_module("packdata.conversion.load")
local._COMMIT_SAMPLES = 5
load = ld._load
def slow_load(entry, opts):
    time.sleep(0.01)
    return load(entry, opts)
ld._load = slow_load
c.convert(sys.argv[1], sys.argv[2], workers=2, progress=False, resume=len(sys.argv) > 3)
"""


@pytest.mark.slow
def test_kill_9_then_resume_equals_a_clean_run(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for c in range(3):
        (src / f"c{c}").mkdir(parents=True)
        for i in range(60):
            (src / f"c{c}/{i:03d}.jpg").write_bytes(image_bytes(100 * c + i))
    dst = tmp_path / "out.lmdb"
    progress = partial_path(dst) / "progress.json"
    killed_at_files_done(_SLOW_CONVERT, [str(src), str(dst)], 40)
    assert not dst.exists()  # nothing looks complete
    done = json.loads(progress.read_text())["files_done"]
    assert 40 <= done < 180  # killed right after the first checkpoint counting 40 files
    subprocess.run([sys.executable, "-c", _SLOW_CONVERT, str(src), str(dst), "resume"], check=True)
    convert(src, tmp_path / "clean.lmdb", progress=False)
    assert _pack_contents(dst) == _pack_contents(tmp_path / "clean.lmdb")
    verify_pack(dst, progress=False)


_SLOW_CLOSE = """
import os, signal, sys, time
from packdata import convert
from packdata.formats.lmdb_writer import LMDBShardWriter
close = LMDBShardWriter.close
def slow_close(self):
    time.sleep(0.5)  # the next shard fills meanwhile
    if self.path.name == "shard-00001.lmdb":  # SIGKILL while shard 1 closes: its close never ends, whatever the load
        os.kill(os.getpid(), signal.SIGKILL)
    return close(self)
LMDBShardWriter.close = slow_close
convert(sys.argv[1], sys.argv[2], shard_samples=20, workers=2, progress=False)
"""


def test_a_kill_while_a_shard_closes_then_resume_gives_the_same_bytes(tmp_path: Path) -> None:
    """A shard closes in a thread while the next fills; no checkpoint lists it before it is closed."""
    src = tmp_path / "src"
    for c in range(2):
        (src / f"c{c}").mkdir(parents=True)
        for i in range(40):
            (src / f"c{c}/{i:03d}.txt").write_text(f"sample {c} {i} " * (i + 1))
    dst = tmp_path / "out.lmdb"
    killed = subprocess.run([sys.executable, "-c", _SLOW_CLOSE, str(src), str(dst)], capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-4000:]  # shard 1 closing, shard 2 open
    listed = json.loads((partial_path(dst) / "progress.json").read_text())["shards"]
    assert [s["file"] for s in listed] == ["shard-00000.lmdb"] and listed[0]["sha256"]
    convert(src, dst, progress=False, resume=True, shard_samples=20)
    convert(src, tmp_path / "clean.lmdb", progress=False, shard_samples=20)
    resumed, clean = tree_digest(dst), tree_digest(tmp_path / "clean.lmdb")
    assert resumed.pop("manifest.json") and clean.pop("manifest.json")  # it holds times
    assert resumed == clean  # every shard and index file, byte for byte
    shards = [json.loads((p / "manifest.json").read_text())["shards"] for p in (dst, tmp_path / "clean.lmdb")]
    assert shards[0] == shards[1] and len(shards[0]) == 4
    verify_pack(dst, progress=False)


def test_a_resume_refuses_a_list_whose_labels_changed_with_the_same_classes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The walk's check covered keys only: a list edited after the interruption (two rows' labels swapped, the
    same classes) resumed into a pack whose first samples kept the old labels and the rest took the new ones,
    a pack neither list gives. It is refused now, the partial kept; --overwrite packs the list as it is."""
    src = tmp_path / "src"
    src.mkdir()
    labels = ["cat"] * 4 + ["dog"] * 4
    for i in range(8):
        (src / f"{i}.txt").write_text(f"t{i}", encoding="utf-8")

    def write_list() -> None:
        rows = [f"{i}.txt,{label}" for i, label in enumerate(labels)]
        (src / "l.csv").write_text("\n".join(["path,label", *rows]) + "\n", encoding="utf-8")

    write_list()
    dst = tmp_path / "out.lmdb"
    _interrupted_convert(src / "l.csv", dst, monkeypatch, after=3, label_column="label")
    checkpoint = (partial_path(dst) / "progress.json").read_bytes()
    labels[0], labels[4] = "dog", "cat"  # packed before the interruption, and not yet
    write_list()
    with pytest.raises(SourceError, match="the source folder changed since the interrupted conversion"):
        convert(src / "l.csv", dst, progress=False, resume=True, label_column="label")
    assert (partial_path(dst) / "progress.json").read_bytes() == checkpoint and not dst.exists()
    state = json.loads(checkpoint)  # as an earlier packdata wrote it: its walk's digest covered keys only
    state["walk_sha256"] = state.pop("walk_labels_sha256")
    (partial_path(dst) / "progress.json").write_text(json.dumps(state), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"made by an earlier packdata.*Start again with overwrite=True"):
        convert(src / "l.csv", dst, progress=False, resume=True, label_column="label")
    convert(src / "l.csv", dst, progress=False, overwrite=True, label_column="label")
    ds = LMDBDataset(dst, decode="bytes")
    assert [ds.classes[ds.targets[i]] for i in range(8)] == labels


@pytest.mark.parametrize("edit", ["caption", "field file"])
def test_a_resume_refuses_a_group_whose_fields_changed_in_the_packed_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edit: str
) -> None:
    """A list's caption edited, or a field file added to a sample packed before the interruption: same keys, so
    the resume kept the old sample beside new ones (a pack neither source gives)."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"{i}.txt").write_text(f"t{i}", encoding="utf-8")
    rows = ["path,caption", *(f"{i}.txt,caption {i}" for i in range(8))]
    (src / "l.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    source, options = (src / "l.csv", {}) if edit == "caption" else (src, {"layout": "grouped"})
    dst = tmp_path / "out.lmdb"
    _interrupted_convert(source, dst, monkeypatch, after=3, **options)
    checkpoint = (partial_path(dst) / "progress.json").read_bytes()
    if edit == "caption":
        rows[1] = "0.txt,another caption"
        (src / "l.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    else:
        (src / "0.json").write_text("[0]", encoding="utf-8")
    with pytest.raises(SourceError, match="the source folder changed since the interrupted conversion"):
        convert(source, dst, progress=False, resume=True, **options)
    assert (partial_path(dst) / "progress.json").read_bytes() == checkpoint and not dst.exists()


@pytest.mark.parametrize("source", ["folder", "list"])
def test_a_resume_refuses_a_source_rewritten_since_the_interruption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    """Files packed before the interruption and rewritten before the resume (same names: resized again,
    regenerated) were not looked at: the pack held old samples then new ones. A checkpoint now keeps the size
    and modification time of a packed file per commit (at most 256), and a resume stats them: one that differs
    is refused, naming it, the partial kept; --overwrite packs the source as it is."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"{i}.txt").write_text(f"t{i}", encoding="utf-8")
    (tmp_path / "l.csv").write_text("path\n" + "".join(f"src/{i}.txt\n" for i in range(8)), encoding="utf-8")
    given = src if source == "folder" else tmp_path / "l.csv"
    dst = tmp_path / "out.lmdb"
    _interrupted_convert(given, dst, monkeypatch, after=5)
    checkpoint = (partial_path(dst) / "progress.json").read_bytes()
    assert [p[0] for p in json.loads(checkpoint)["probes"]] == [str(src / "1.txt"), str(src / "3.txt")]
    for i in range(8):  # the whole source written again, one byte longer
        (src / f"{i}.txt").write_text(f"new{i}", encoding="utf-8")
    with pytest.raises(SourceError) as raised:
        convert(given, dst, progress=False, resume=True)
    assert str(raised.value) == (
        f"{src / '1.txt'}: a file packed before the interruption changed since (2 bytes then, 4 bytes now; or its "
        "modification time differs). Restore it as it was and resume, or start again with overwrite=True"
    )
    assert (partial_path(dst) / "progress.json").read_bytes() == checkpoint and not dst.exists()
    convert(given, dst, progress=False, overwrite=True)
    texts = [s["txt"] if isinstance(s, dict) else s[0] for s in LMDBDataset(dst)]
    assert texts == [f"new{i}" for i in range(8)]


_CLOSING_SHARDS = """
import importlib, sys
c = importlib.import_module("packdata.conversion.convert")
importlib.import_module("packdata.conversion.local")._COMMIT_SAMPLES = 2
c.convert(sys.argv[1], sys.argv[2], format=sys.argv[3], shard_samples=4, workers=2, progress=False, resume=True)
"""


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_a_resume_refuses_a_closed_shard_whose_bytes_are_not_the_ones_its_checkpoint_lists(
    tmp_path: Path, fmt: str
) -> None:
    """A closed shard was checked at resume by its size and record count only: one byte flipped in it (same size)
    was carried into the manifest with the SHA-256 the checkpoint listed, a pack verify refuses. A resume hashes
    the closed shards now: a shard whose bytes differ is named, nothing published; an untouched resume still
    gives the uninterrupted run's pack."""
    src = tmp_path / "src"
    samples = []  # what every pack of it holds: (key, bytes, label)
    for c in range(2):
        (src / f"c{c}").mkdir(parents=True)
        for i in range(12):
            samples.append((f"c{c}/{i:03d}.txt", f"sample {c} {i} ".encode() * (i + 1), c))
            (src / samples[-1][0]).write_bytes(samples[-1][1])
    runs = {name: tmp_path / name / f"out.{fmt}" for name in ("damaged", "intact", "clean")}
    for name in ("damaged", "intact"):
        runs[name].parent.mkdir()
        killed_at_files_done(_CLOSING_SHARDS, [str(src), str(runs[name]), fmt], 13)
    state = json.loads((partial_path(runs["damaged"]) / "progress.json").read_text())
    assert len(state["shards"]) >= 2 and not state["finishing"]  # killed with shards closed, one open
    listed = state["shards"][1]
    data = partial_path(runs["damaged"]) / (f"{listed['file']}/data.mdb" if fmt == "lmdb" else listed["file"])
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0x55  # same size, other bytes
    data.write_bytes(bytes(blob))
    with pytest.raises(PackFormatError) as raised:
        convert(src, runs["damaged"], format=fmt, shard_samples=4, progress=False, resume=True)
    assert str(raised.value) == (
        f"{data}: a shard of the interrupted conversion holds other bytes than progress.json lists (SHA-256 "
        f"{hashlib.sha256(blob).hexdigest()}, listed as {listed['sha256']}). A resume cannot continue past a "
        "damaged shard: start the conversion again with overwrite=True"
    )
    assert not runs["damaged"].exists() and data.read_bytes() == blob  # nothing published, nothing rewritten
    convert(src, runs["intact"], format=fmt, shard_samples=4, progress=False, resume=True)
    runs["clean"].parent.mkdir()
    convert(src, runs["clean"], format=fmt, shard_samples=4, progress=False)
    verify_pack(runs["intact"], progress=False)
    packs = [runs["intact"], runs["clean"]]
    shards = [
        [(s["file"], s["num_samples"], s["first_index"]) for s in json.loads(p.read_text())["shards"]]
        for p in (pack / "manifest.json" for pack in packs)
    ]
    assert shards[0] == shards[1] and len(shards[0]) == 6
    datasets = [(LMDBDataset if fmt == "lmdb" else TFRecordIndexedDataset)(pack, decode="bytes") for pack in packs]
    assert [[(ds.keys[i], *ds[i]) for i in range(len(ds))] for ds in datasets] == [samples, samples]
    assert tree_digest(runs["intact"] / "index") == tree_digest(runs["clean"] / "index")


_KILLED_FINISHING = """
import os, signal, sys
from packdata import convert
from packdata.conversion import checkpoint
save, replace, finishing = checkpoint._Checkpoint.save, os.replace, []
def save_then_kill(self, state=None):  # LMDB: SIGKILL right after the checkpoint listing every shard (finishing)
    save(self, state)
    finishing.append((self.state() if state is None else state)["finishing"])
    if finishing[-1] and sys.argv[3] == "lmdb":
        os.kill(os.getpid(), signal.SIGKILL)
def replace_then_kill(a, b, *args, **kwargs):  # TFRecord: SIGKILL once finishing renamed shard 0's records file
    replace(a, b, *args, **kwargs)
    if finishing[-1:] == [True] and os.fspath(b).endswith(".tfrecord"):
        os.kill(os.getpid(), signal.SIGKILL)
checkpoint._Checkpoint.save, os.replace = save_then_kill, replace_then_kill
convert(sys.argv[1], sys.argv[2], format=sys.argv[3], shard_samples=4, workers=2, progress=False)
"""


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_a_resume_of_a_finishing_conversion_refuses_a_shard_whose_bytes_are_not_the_ones_listed(
    tmp_path: Path, fmt: str
) -> None:
    """Killed once every shard was closed and listed (finishing: a TFRecord shard may be renamed already), a
    resume checked each shard's size only: a byte flipped in one was published under the listed SHA-256."""
    src = tmp_path / "src"
    for i in range(10):
        (src / "c0").mkdir(parents=True, exist_ok=True)
        (src / f"c0/{i:03d}.txt").write_text(f"sample {i} " * (i + 1))
    dst = tmp_path / f"out.{fmt}"
    killed = subprocess.run([sys.executable, "-c", _KILLED_FINISHING, str(src), str(dst), fmt], capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-4000:]
    state = json.loads((partial_path(dst) / "progress.json").read_text())
    assert state["finishing"] and len(state["shards"]) == 3
    name = "shard-00000.lmdb/data.mdb" if fmt == "lmdb" else "out-00000-of-00003.tfrecord"  # renamed already
    data = partial_path(dst) / name
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0x55
    data.write_bytes(bytes(blob))
    with pytest.raises(PackFormatError) as raised:
        convert(src, dst, format=fmt, shard_samples=4, progress=False, resume=True)
    assert str(raised.value) == (
        f"{data}: a shard of the interrupted conversion holds other bytes than progress.json lists (SHA-256 "
        f"{hashlib.sha256(blob).hexdigest()}, listed as {state['shards'][0]['sha256']}). A resume cannot continue "
        "past a damaged shard: start the conversion again with overwrite=True"
    )
    assert not dst.exists() and data.read_bytes() == blob
