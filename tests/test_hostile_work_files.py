"""Work files a stranger can edit (a resume's progress.json, an overwrite's replaced.jsonl): nothing outside the
source is looked at, nothing outside the pack's prefix is deleted."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import interrupted_convert, moto_s3

from packdata import ConfigError, LMDBDataset, LockedError, PackFormatError, convert
from packdata.conversion import checkpoint
from packdata.conversion.destination import partial_path
from packdata.conversion.download import copied_again, journal_mark
from packdata.conversion.replace import remove_replaced
from packdata.conversion.upload import ShardUploader, work_folder
from packdata.conversion.upload_journal import UploadJournal, check_job
from packdata.formats import get_format
from packdata.pack.urls import object_version


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on loopback; yields (storage_options, filesystem)."""
    with moto_s3({"key": "testing-key-id", "secret": "testing-secret"}) as server:
        yield server


@pytest.mark.parametrize(
    "name", ["../train2/{}", "/../train2/{}", "x/../../train2/{}", "//train2/{}", "a//../train2/{}"]
)
def test_an_edited_replaced_record_never_deletes_a_neighbouring_packs_objects(
    s3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """replaced.jsonl (beside an overwrite's work folder) names the old pack's objects to remove once the new pack
    is up. Edited to name a neighbouring pack's objects, through ``..``, ``//`` or ``x/../..``, with their true
    size and version: only the pack's own recorded object goes (the store is asked to remove nothing else), the
    neighbour's stay."""
    _, fs = s3
    for pack in ("train", "train2"):
        for obj in ("shard-00000.bin", "sub/part.bin"):
            fs.pipe_file(f"packs/{pack}/{obj}", f"{pack} {obj}".encode())
    fs.invalidate_cache()
    found = {p: (int(i["size"]), object_version(i)) for p, i in fs.find("packs", detail=True).items()}
    lines = []
    for obj in ("shard-00000.bin", "sub/part.bin"):
        size, version = found[f"packs/train2/{obj}"]
        lines.append({"name": name.format(obj), "size": size, "version": version})
    size, version = found["packs/train/shard-00000.bin"]
    lines.append({"name": "shard-00000.bin", "size": size, "version": version})  # the pack's own: removed
    work = tmp_path / "work" / "train"
    work.parent.mkdir()
    (work.parent / "replaced.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    real_call, asked = fs._call_s3, []

    async def recording_call(method, *args, **kwargs):  # S3 keys are literal: asked for, ../ would name another object
        if method == "delete_object":  # plain and conditional deletes alike
            asked.append(f"{kwargs['Bucket']}/{kwargs['Key']}")
        return await real_call(method, *args, **kwargs)

    monkeypatch.setattr(fs, "_call_s3", recording_call)
    removed = remove_replaced(fs, "packs/train", "s3://packs/train", work, keep=set())
    fs.invalidate_cache()
    assert sorted(fs.find("packs")) == [
        "packs/train/sub/part.bin",
        "packs/train2/shard-00000.bin",
        "packs/train2/sub/part.bin",
    ]
    assert (removed, asked) == (1, ["packs/train/shard-00000.bin"])
    monkeypatch.undo()
    for obj in ("shard-00000.bin", "sub/part.bin"):
        fs.rm_file(f"packs/train2/{obj}")
    fs.rm_file("packs/train/sub/part.bin")
    assert not (work.parent / "replaced.jsonl").exists()


@pytest.mark.parametrize("probe", ["outside", "dotdot", "link", "fifo", "unpacked"])
def test_a_resume_stats_only_files_the_interrupted_conversion_packed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, probe: str
) -> None:
    """progress.json's probes (files a resume stats to find a source rewritten since) edited to name a file outside
    the source (an absolute path, or one through ``..``), a link in the source to a file outside, a FIFO, or a
    source file not packed yet: the resume stat'ed any of them (a FIFO's open would hang; the message told the size
    of a file outside). It now refuses the checkpoint as damaged, naming it and the probe, before any stat: the
    partial is kept, nothing is published, and --overwrite packs the source."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"{i}.txt").write_text(f"t{i}", encoding="utf-8")
    secret = tmp_path / "secret.txt"
    secret.write_text("not the source's", encoding="utf-8")
    dst = tmp_path / "out.lmdb"
    interrupted_convert(src, dst, monkeypatch, after=5)
    progress = partial_path(dst) / "progress.json"
    state = json.loads(progress.read_bytes())
    if probe == "outside":
        named = str(secret)
    elif probe == "dotdot":
        named = f"{src}/../secret.txt"
    elif probe == "link":
        named = str(src / "9.txt")  # walked after the packed part
        os.symlink(secret, named)
    elif probe == "fifo":
        named = str(tmp_path / "fifo")
        os.mkfifo(named)
    else:
        named = str(src / "7.txt")
    state["probes"].append([named, 1, 0])
    progress.write_text(json.dumps(state), encoding="utf-8")
    checkpoint = progress.read_bytes()
    message = (
        f"{progress}: the interrupted conversion's checkpoint is damaged: probes names {named!r}, which is not a file "
        "the interrupted conversion packed (a resume looks only at those). Start the conversion again with "
        "overwrite=True"
    )
    with pytest.raises(PackFormatError) as raised:
        convert(src, dst, progress=False, resume=True)
    assert str(raised.value) == message
    assert progress.read_bytes() == checkpoint and not dst.exists()
    assert secret.read_text(encoding="utf-8") == "not the source's"
    convert(src, dst, progress=False, overwrite=True)
    assert len(LMDBDataset(dst)) == (9 if probe == "link" else 8)


def test_a_lock_file_of_deeply_nested_json_is_in_the_way_never_a_crash(tmp_path: Path) -> None:
    """A ``.NAME.lock`` beside the destination holding ``[[[[...`` (4,000 deep, within the 4,096 bytes a lock record
    may have) stopped convert with a bare RecursionError (and its descriptor left open): it is now a file in the
    way of the lock file, named, as any other content that is not a lock record."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "0.txt").write_text("t0", encoding="utf-8")
    lock = tmp_path / ".out.lmdb.lock"
    lock.write_text("[" * 4000, encoding="utf-8")
    with pytest.raises(ConfigError) as raised:
        convert(src, tmp_path / "out.lmdb", progress=False)
    assert str(raised.value) == (
        f"{lock}: a file is in the way of the lock file: its content is not a packdata lock record. "
        "Move it away if it is not packdata's, or choose another destination"
    )
    assert not (tmp_path / "out.lmdb").exists()


@pytest.mark.parametrize("record", ["nested", "since_out_of_range"])
def test_a_held_lock_whose_record_is_hostile_names_another_process(tmp_path: Path, record: str) -> None:
    """A lock held by another process whose record is deeply nested JSON, or gives a start time no clock can show
    (1e300 seconds), stopped convert with a bare RecursionError or OverflowError: the holder is now 'another
    process', as for a record not written yet."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "0.txt").write_text("t0", encoding="utf-8")
    lock, dst = tmp_path / ".out.lmdb.lock", tmp_path / "out.lmdb"
    text = (
        "[" * 4000
        if record == "nested"
        else json.dumps({"pid": 1, "host": "h", "command": "packdata convert", "since": 1e300})
    )
    lock.write_text(text, encoding="utf-8")
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(lock)], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(LockedError) as raised:
            convert(src, dst, progress=False)
    finally:
        holder.kill()
        holder.wait()
    assert str(raised.value) == (
        f"{dst}: another process (it has not written its name yet) is writing it (lock file {lock}). Wait for it to "
        "finish, or stop that process; a lock left by a dead process is taken over"
    )


_HOLD_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


_NESTED = "[" * 12_000  # past the C recursion limit of json.loads, within a journal line at its longest


def test_a_work_folders_journal_line_of_deeply_nested_json_counts_for_nothing(
    s3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line of ``[[[[...`` (12,000 deep) in a URL source's download journal (downloaded.jsonl, the work folder's),
    or in an overwrite's replaced.jsonl, stopped the conversion with a bare RecursionError: like a torn line, it
    now counts for nothing (the files are downloaded again; nothing is removed for it). A job.json (the record of a
    pack waiting in the work folder for its upload) nested so is an unknown conversion's, as one not JSON."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    for i in range(3):
        fs.pipe_file(f"packs/nested-src/{i}.txt", f"t{i}".encode())
    fs.invalidate_cache()
    journal = work_folder("source:s3://packs/nested-src").parent / "downloaded.jsonl"
    journal.parent.mkdir(parents=True)
    journal.write_text(_NESTED + "\n", encoding="utf-8")
    dst = tmp_path / "out.lmdb"
    convert("s3://packs/nested-src", dst, storage_options=options, progress=False)
    assert [s[0] for s in LMDBDataset(dst)] == ["t0", "t1", "t2"]
    fs.pipe_file("packs/nested-pack/shard-00000.bin", b"old")
    work = tmp_path / "replacing" / "nested-pack"
    work.parent.mkdir()
    (work.parent / "replaced.jsonl").write_text(_NESTED + "\n", encoding="utf-8")
    assert remove_replaced(fs, "packs/nested-pack", "s3://packs/nested-pack", work, keep=set()) == 0
    assert fs.cat_file("packs/nested-pack/shard-00000.bin") == b"old"
    (work.parent / "job.json").write_text(_NESTED, encoding="utf-8")  # the record of the pack waiting for upload
    with pytest.raises(ConfigError, match=r"^s3://packs/nested-pack: the pack waiting .* by an unknown conversion"):
        check_job(work, "src", {}, "s3://packs/nested-pack")


@pytest.mark.parametrize("planted", ["symlink", "FIFO", "folder"])
def test_a_download_journal_that_is_no_regular_file_is_refused_by_a_resumes_check(tmp_path: Path, planted: str) -> None:
    """copied_again (a resume's check of the files of a URL's folder downloaded again since they were packed) read
    downloaded.jsonl with Path.read_bytes: through a link planted at its name (the planter's lines read as the
    journal), a FIFO (the read waited for a writer forever), a folder (a bare IsADirectoryError). It is read as
    the work folder's other journals are: refused, named, never read through."""
    folder = tmp_path / "work" / "src"
    folder.mkdir(parents=True)
    journal = folder.parent / "downloaded.jsonl"
    theirs = tmp_path / "theirs.jsonl"
    theirs.write_text(json.dumps({"name": "a.txt", "size": 2, "version": "v2"}) + "\n", encoding="utf-8")
    if planted == "symlink":
        journal.symlink_to(theirs)
    elif planted == "FIFO":
        os.mkfifo(journal)
    else:
        journal.mkdir()
    kind = {"symlink": "a symlink", "FIFO": "a FIFO", "folder": "a folder"}[planted]
    expected = (
        f"{journal}: is {kind}, not a regular file: packdata never reads or writes its own files through it "
        "(another user may have put it there). Remove it if it is not yours (nothing was written through it), or "
        "set PACKDATA_TMP to your own folder"
    )
    with pytest.raises(ConfigError, match=f"^{re.escape(expected)}$"):
        copied_again(folder, 0, None)


def _plant(path: Path, planted: str, size: int = 0) -> None:
    """Put ``planted`` at ``path``: a FIFO, a symlink to /dev/zero, or a sparse file of ``size`` zero bytes."""
    path.unlink(missing_ok=True)
    if planted == "fifo":
        os.mkfifo(path)
    elif planted == "devzero":
        path.symlink_to("/dev/zero")
    else:
        with open(path, "wb") as f:
            f.truncate(size)


@pytest.mark.parametrize("planted", ["fifo", "devzero", "oversized"])
def test_a_checkpoint_replaced_by_a_fifo_dev_zero_or_a_huge_file_is_named_never_read_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planted: str
) -> None:
    """progress.json, replaced by a FIFO or a link to /dev/zero, is refused by the resume's look at the partial
    pack; replaced by a file of 64 MiB (more than a checkpoint of this conversion can hold: its probes, skip
    examples and a listing per shard, at their longest) it was read whole, as a 10 GB one would have been, and
    refused only as 'not JSON'. It is now refused by its size, read no further, naming it: the partial is kept,
    the source untouched, nothing published, and overwrite=True packs the source."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"{i}.txt").write_text(f"t{i}", encoding="utf-8")
    dst = tmp_path / "out.lmdb"
    interrupted_convert(src, dst, monkeypatch, after=5)
    partial = partial_path(dst)
    progress = partial / "progress.json"
    _plant(progress, planted, 64 << 20)
    if planted == "oversized":
        with pytest.raises(PackFormatError) as raised:
            convert(src, dst, progress=False, resume=True)
        message = str(raised.value)
        assert re.fullmatch(
            rf"{re.escape(str(progress))}: the interrupted conversion's checkpoint is damaged: it holds more than the "
            r"[0-9]+ bytes a checkpoint of this conversion can hold\. Start the conversion again with overwrite=True",
            message,
        ), message
        assert int(message.split("more than the ")[1].split(" ")[0]) < 64 << 20
    else:
        kind = "a FIFO" if planted == "fifo" else "a symlink"
        with pytest.raises(ConfigError) as raised:
            convert(src, dst, progress=False, resume=True)
        assert str(raised.value) == (
            f"{partial}: the interrupted conversion holds {progress}, {kind}: packdata never writes one. "
            "Move it away, or start again with overwrite=True"
        )
    assert os.path.lexists(progress) and not dst.exists()
    assert sorted(p.read_text(encoding="utf-8") for p in src.iterdir()) == [f"t{i}" for i in range(8)]
    convert(src, dst, progress=False, overwrite=True)
    assert len(LMDBDataset(dst)) == 8


@pytest.mark.parametrize("planted", ["fifo", "devzero", "oversized"])
def test_a_checkpoint_replaced_while_a_conversion_into_a_url_runs_ends_it_named_never_hangs(
    s3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planted: str
) -> None:
    """The early uploader's watcher reads the running conversion's progress.json to upload the shards it lists.
    Replaced by a FIFO once the first checkpoint exists, its plain read blocked the watcher for ever, and the
    conversion, which waits for the watcher at its end, hung; a link to /dev/zero or a huge file was read whole.
    It is now read as a resume reads it: the refusal ends the conversion with a line naming the file (nothing
    uploaded), and a run with resume=True uploads the pack packed in the work folder."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    monkeypatch.setattr(ShardUploader, "PERIOD", 0.005)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"{i}.txt").write_text(f"t{i}", encoding="utf-8")
    url = f"s3://packs/watched-{planted}"
    progress = partial_path(work_folder(url)) / "progress.json"
    most = getattr(checkpoint, "MAX_WATCHED_BYTES", 0)  # none before: read whatever its size
    planted_now, looked = threading.Event(), threading.Event()
    real_save, real_look = checkpoint._Checkpoint.save, ShardUploader._closed_shard_files

    def save(self: checkpoint._Checkpoint, state: dict | None = None) -> None:
        real_save(self, state)
        if not planted_now.is_set():  # the first checkpoint: replaced, then looked at by the watcher
            _plant(progress, planted, most + 1)
            planted_now.set()
            if not looked.wait(60):  # the watcher is blocked in its look (the FIFO's open): a writer's open ends it
                with contextlib.suppress(OSError):
                    os.close(os.open(progress, os.O_WRONLY | os.O_NONBLOCK))
                pytest.fail(f"the watcher's look at {progress} never ended")

    def look(self: ShardUploader) -> list[Path]:
        after = planted_now.is_set()
        try:
            return real_look(self)
        except PackFormatError:  # the refusal ends the watching: also a look begun just before the planting
            looked.set()
            raise
        finally:
            if after:
                looked.set()

    monkeypatch.setattr(checkpoint._Checkpoint, "save", save)
    monkeypatch.setattr(ShardUploader, "_closed_shard_files", look)
    with pytest.raises(PackFormatError) as raised:
        convert(src, url, storage_options=options, shard_samples=2, progress=False)
    what = {
        "fifo": "it is not a regular file: a FIFO",
        "devzero": "it is a symlink, not the file packdata wrote",
        "oversized": f"it holds more than the {most} bytes a checkpoint of this conversion can hold",
    }[planted]
    assert str(raised.value) == (
        f"{progress}: the running conversion's checkpoint was replaced by a file packdata never writes: {what}. "
        "Nothing was read from it, and nothing published: the pack waits in the work folder. Check what else writes "
        "there, then run again with resume=True"
    )
    fs.invalidate_cache()
    assert not fs.exists(f"packs/watched-{planted}/manifest.json")
    monkeypatch.undo()
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    convert(src, url, storage_options=options, shard_samples=2, progress=False, resume=True)
    fs.invalidate_cache()
    assert fs.exists(f"packs/watched-{planted}/manifest.json")
    fs.rm(f"packs/watched-{planted}", recursive=True)


_OVERSIZED = (
    ": holds more than the {} bytes packdata writes there at most: it is not packdata's file. A resume cannot go on "
    "from it: remove it with the work folder beside it (nothing was read from it), then run again"
)


@pytest.mark.parametrize("planted", ["fifo", "devzero", "oversized"])
@pytest.mark.parametrize("journal", ["downloaded.jsonl", "uploaded.jsonl", "replaced.jsonl"])
def test_a_work_folder_journal_replaced_by_a_fifo_dev_zero_or_a_huge_file_is_named_never_read_whole(
    s3, tmp_path: Path, planted: str, journal: str
) -> None:
    """The work folder's journals (a URL source's downloaded.jsonl, a conversion into a URL's uploaded.jsonl, an
    overwrite's replaced.jsonl) replaced by a FIFO or a link to /dev/zero are refused, never read through; one
    longer than a line per object at its longest was read whole (a 10 GB file too) and its lines
    taken. It is now refused by its size, naming it, and read no further; the store's objects are untouched."""
    _, fs = s3
    folder = tmp_path / "work" / "pack"
    folder.mkdir(parents=True)
    for name in ("a.txt", "b.txt"):
        (folder / name).write_text(name, encoding="utf-8")
    path = folder.parent / journal
    objects = 3 if journal == "uploaded.jsonl" else 2  # uploaded: every file beside it (itself too) counts
    most = (objects + 1) * (2 * (6 * 1024 + 2) + 256)  # a line each, and one more, at the longest
    _plant(path, planted, most + 1)
    root = f"packs/hostile-{journal}"
    fs.pipe_file(f"{root}/a.txt", b"old a")
    fs.pipe_file(f"{root}/b.txt", b"old b")
    fs.invalidate_cache()

    def read() -> object:
        if journal == "downloaded.jsonl":
            return copied_again(folder, 0, None)
        if journal == "uploaded.jsonl":
            return UploadJournal(folder.parent)
        return remove_replaced(fs, root, f"s3://{root}", folder, keep=set())

    if planted == "oversized":
        expected = f"{path}{_OVERSIZED.format(most)}"
    else:
        kind = "a FIFO" if planted == "fifo" else "a symlink"
        expected = (
            f"{path}: is {kind}, not a regular file: packdata never reads or writes its own files through it (another "
            "user may have put it there). Remove it if it is not yours (nothing was written through it), or set "
            "PACKDATA_TMP to your own folder"
        )
    with pytest.raises(ConfigError) as raised:
        read()
    assert str(raised.value) == expected
    if journal == "downloaded.jsonl":
        with pytest.raises(ConfigError) as raised:
            journal_mark(folder)
        assert str(raised.value) == expected
    assert os.path.lexists(path)
    fs.invalidate_cache()
    assert sorted(fs.find(root)) == [f"{root}/a.txt", f"{root}/b.txt"]
    fs.rm(root, recursive=True)


def test_a_job_record_longer_than_packdata_writes_is_an_unknown_conversions_never_read_whole(tmp_path: Path) -> None:
    """job.json (the record of a pack waiting in the work folder for its upload) longer than the record of this
    conversion, as packdata writes it, is another conversion's: refused as one, never read whole."""
    work = tmp_path / "work" / "pack"
    work.mkdir(parents=True)
    _plant(work.parent / "job.json", "oversized", 1 << 20)
    with pytest.raises(ConfigError, match=r"^s3://packs/pack: the pack waiting .* by an unknown conversion"):
        check_job(work, "src", {}, "s3://packs/pack")


_ADDED = ["source", "probes", "copied_journal", "copied_journal_sha256"]  # in the order packdata added them


def _interrupted_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, Path, dict]:
    """A source of 8 texts, its conversion interrupted after 5: (src, dst, progress.json, its state)."""
    src = tmp_path / "src"
    src.mkdir(parents=True)
    for i in range(8):
        (src / f"{i}.txt").write_text(f"t{i}", encoding="utf-8")
    dst = tmp_path / "out.lmdb"
    interrupted_convert(src, dst, monkeypatch, after=5)
    progress = partial_path(dst) / "progress.json"
    return src, dst, progress, json.loads(progress.read_bytes())


def _refused_resume(src: Path, dst: Path, progress: Path, error: type[Exception]) -> str:
    """The message of the ``error`` a resume raises, progress.json unchanged and nothing published."""
    checkpoint = progress.read_bytes()
    with pytest.raises(error) as raised:
        convert(src, dst, progress=False, resume=True)
    assert progress.read_bytes() == checkpoint and not dst.exists()
    return str(raised.value)


@pytest.mark.parametrize(
    "dropped", ["copied_journal_sha256", "copied_journal", "probes", "source", "finishing", "index_files", "classes"]
)
def test_a_checkpoint_that_lost_a_field_this_packdata_writes_is_named_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dropped: str
) -> None:
    """progress.json without copied_journal_sha256 (or another field the current packdata writes: the journal's
    length, the probes, the source, finishing, the index files' digests, the classes) was read as an earlier
    packdata's checkpoint, the missing value taken as 'none kept': a damaged or edited file passed as old. A
    checkpoint now says its version, and one of this version lacking a field is refused, naming the file and the
    field; the partial is kept, nothing published."""
    src, dst, progress, state = _interrupted_checkpoint(tmp_path, monkeypatch)
    del state[dropped]
    progress.write_text(json.dumps(state), encoding="utf-8")
    assert _refused_resume(src, dst, progress, PackFormatError) == (
        f"{progress}: the interrupted conversion's checkpoint is damaged: it lacks {dropped}. "
        "Start the conversion again with overwrite=True"
    )


@pytest.mark.parametrize("held", [4, 3, 2, 1, 0])
def test_an_earlier_packdatas_checkpoint_resumes_and_one_with_a_gap_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held: int
) -> None:
    """A checkpoint without a version, as an earlier packdata wrote it (the fields added since walk_labels_sha256
    up to some point: source, probes, copied_journal, copied_journal_sha256), still resumes into the whole pack;
    one without a version that lacks a field before the last one it holds is damaged, named."""
    src, dst, progress, state = _interrupted_checkpoint(tmp_path, monkeypatch)
    del state["version"]
    for name in _ADDED[held:]:
        del state[name]
    progress.write_text(json.dumps(state), encoding="utf-8")
    convert(src, dst, progress=False, resume=True)
    assert sorted(s[0] for s in LMDBDataset(dst)) == [f"t{i}" for i in range(8)]
    if held < 2:
        return
    src, dst, progress, state = _interrupted_checkpoint(tmp_path / "gap", monkeypatch)
    del state["version"], state[_ADDED[held - 2]]
    for name in _ADDED[held:]:
        del state[name]
    progress.write_text(json.dumps(state), encoding="utf-8")
    with pytest.raises(PackFormatError) as raised:
        convert(src, dst, progress=False, resume=True)
    assert str(raised.value) == (
        f"{progress}: the interrupted conversion's checkpoint is damaged: it lacks {_ADDED[held - 2]}. "
        "Start the conversion again with overwrite=True"
    )


def test_a_checkpoint_of_a_newer_version_is_refused_naming_the_file_and_the_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """progress.json of version 2 (a newer packdata's, with a field this one does not know) was refused as damaged
    ('version should be 1'), as if no packdata wrote it. It is now a newer packdata's, named with its version and
    what to do; the partial is kept, nothing published."""
    src, dst, progress, state = _interrupted_checkpoint(tmp_path, monkeypatch)
    state["version"] = 2
    state["shard_offsets"] = [0, 4096]  # what a newer packdata might add
    progress.write_text(json.dumps(state), encoding="utf-8")
    assert _refused_resume(src, dst, progress, ConfigError) == (
        f"{progress}: the interrupted conversion's checkpoint is of version 2, written by a newer packdata: this one "
        "reads version 1 and earlier. Resume with the packdata that wrote it, or start the conversion again with "
        "overwrite=True"
    )


_EXTRA_FIELDS = {  # a field added to progress.json by a newer or tampered writer -> what the error names
    "a field beside version 1": (lambda state: {**state, "shard_offsets": [0]}, "it holds 'shard_offsets'"),
    "a field in an earlier packdata's": (
        lambda state: {k: v for k, v in state.items() if k != "version"} | {"shard_offsets": [0]},
        "it holds 'shard_offsets'",
    ),
    "an index file no pack holds": (
        lambda state: {**state, "index_files": {**state["index_files"], "../../x": [0, "0" * 64]}},
        "index_files should be an object of file name -> .size, SHA-256.",
    ),
}


@pytest.mark.parametrize("extra", list(_EXTRA_FIELDS))
def test_a_checkpoint_holding_a_field_its_version_never_holds_is_named_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: str
) -> None:
    """A field no checkpoint of its version holds (added by a newer packdata that kept the version, or by hand) was
    dropped, the rest read as that version: a resume went on without what the field said. It is now damaged, named
    (an index file's name too: only the pack's index files are checkpointed); the partial is kept."""
    src, dst, progress, state = _interrupted_checkpoint(tmp_path, monkeypatch)
    assert state["index_files"]
    edit, named = _EXTRA_FIELDS[extra]
    progress.write_text(json.dumps(edit(state)), encoding="utf-8")
    message = _refused_resume(src, dst, progress, PackFormatError)
    assert re.fullmatch(
        f"{re.escape(str(progress))}: the interrupted conversion's checkpoint is damaged: {named}.*"
        r"\. Start the conversion again with overwrite=True",
        message,
    ), message
    convert(src, dst, progress=False, overwrite=True)
    assert sorted(s[0] for s in LMDBDataset(dst)) == [f"t{i}" for i in range(8)]


@pytest.mark.parametrize("version", ["1", 1.5, True, 0, -1, None])
def test_a_checkpoint_whose_version_is_no_packdatas_is_named_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: object
) -> None:
    """A version no packdata writes (text, a fraction, a boolean, 0 or below, null) is damaged, not newer."""
    src, dst, progress, state = _interrupted_checkpoint(tmp_path, monkeypatch)
    progress.write_text(json.dumps({**state, "version": version}), encoding="utf-8")
    with pytest.raises(PackFormatError) as raised:
        convert(src, dst, progress=False, resume=True)
    assert str(raised.value) == (
        f"{progress}: the interrupted conversion's checkpoint is damaged: version should be 1, but got "
        f"version={version!r}. Start the conversion again with overwrite=True"
    )


@pytest.mark.parametrize("shard_bytes", [0, 10**15])
def test_a_checkpoint_whose_open_shard_bytes_differ_from_the_kept_index_is_named_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shard_bytes: int
) -> None:
    """shard_bytes (the bytes of the open shard's samples, which decide where a shard_size limit closes it) was
    taken as written: edited, the resume closed shards elsewhere than an uninterrupted conversion does (10**15: the
    open shard at once; 0: past the limit). It is now checked against the sizes the kept sample index gives those
    samples, and a count that differs is damaged, named; the partial is kept."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"{i}.txt").write_text(f"t{i}" * 10, encoding="utf-8")  # 20 bytes a sample
    dst = tmp_path / "out.lmdb"
    interrupted_convert(src, dst, monkeypatch, after=5, shard_size=70)
    progress = partial_path(dst) / "progress.json"
    state = json.loads(progress.read_bytes())
    assert state["shard_bytes"] == 20 * (state["samples_done"] - state["shard_first"]) > 0
    progress.write_text(json.dumps({**state, "shard_bytes": shard_bytes}), encoding="utf-8")
    checkpoint = progress.read_bytes()
    with pytest.raises(PackFormatError) as raised:
        convert(src, dst, progress=False, resume=True, shard_size=70)
    assert str(raised.value) == (
        f"{progress}: the interrupted conversion's checkpoint is damaged: shard_bytes should be the "
        f"{state['shard_bytes']} bytes the kept sample index gives the open shard's "
        f"{state['samples_done'] - state['shard_first']} samples, but got shard_bytes={shard_bytes}. Start the "
        "conversion again with overwrite=True"
    )
    assert progress.read_bytes() == checkpoint and not dst.exists()


def test_a_current_checkpoint_whose_index_digests_were_nulled_is_named_damaged_not_hashed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """progress.json of this packdata (it says its version) lists closed shards and the kept sample index's sizes and
    SHA-256s. Edited to null them (``"index_files": null``, as an earlier packdata's could hold), with a kept key
    changed in the index, it was read as an earlier packdata's: the kept index hashed again rather than compared,
    and the changed key went into the published pack. It is now damaged, named; the partial is kept, nothing
    published."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"{i}.txt").write_text(f"t{i}", encoding="utf-8")
    dst = tmp_path / "out.lmdb"
    interrupted_convert(src, dst, monkeypatch, after=5, shard_samples=2)
    progress = partial_path(dst) / "progress.json"
    state = json.loads(progress.read_bytes())
    assert state["version"] == 1 and state["shards"] and state["index_files"]
    state["index_files"] = None
    progress.write_text(json.dumps(state), encoding="utf-8")
    keys = partial_path(dst) / "index" / "keys.utf8"
    kept = keys.read_bytes()
    assert kept.startswith(b"0")
    keys.write_bytes(b"9" + kept[1:])  # the first sample's key, edited within the part kept
    checkpoint = progress.read_bytes()
    with pytest.raises(PackFormatError) as raised:
        convert(src, dst, progress=False, resume=True, shard_samples=2)
    assert str(raised.value) == (
        f"{progress}: the interrupted conversion's checkpoint is damaged: index_files is null, but this packdata "
        "records the kept sample index's SHA-256s. Start the conversion again with overwrite=True"
    )
    assert progress.read_bytes() == checkpoint and not dst.exists()


def test_a_resumed_append_s_source_record_longer_than_packdata_writes_is_refused_unread(
    image_folder: Path, tmp_path: Path
) -> None:
    """The record of an interrupted append's source (.NAME.append.source, the source's place) replaced by a file of
    1 GiB was read to 64 KiB + 1 and named as 'the interrupted append read another source (' followed by 4096 of
    its bytes; it is now refused by its size, unread, as a record packdata never writes, and nothing is appended."""
    dst = tmp_path / "p.lmdb"
    convert(image_folder, dst, progress=False)
    (tmp_path / ".p.lmdb.append").mkdir()  # the pack an interrupted append converted beside dst
    record = tmp_path / ".p.lmdb.append.source"
    with open(record, "wb") as f:
        f.truncate(1 << 30)  # sparse: no disk used
    with pytest.raises(PackFormatError) as refused:
        convert(image_folder, dst, append=True, resume=True, progress=False)
    assert str(refused.value) == (
        f"{record}: the record of the interrupted append's source is unreadable (it holds more than the 65536 "
        "bytes it may hold). Remove it, then resume"
    )
    assert len(LMDBDataset(dst)) == 19


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_a_checkpoint_whose_closed_shards_counts_differ_from_their_files_is_refused_not_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """progress.json's closed shards listed with 2 and 4 samples (their files hold 3 and 3, the total the same)
    resumed and published a pack whose manifest every reader refuses ('shard holds 3 records, the manifest says
    2'): a resume now counts the records of each closed shard, naming the shard; the partial is kept."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(10):
        (src / f"{i}.txt").write_text(f"t{i}", encoding="utf-8")
    dst = tmp_path / ("out.lmdb" if fmt == "lmdb" else "out")
    interrupted_convert(src, dst, monkeypatch, after=8, format=fmt, shard_samples=3)
    progress = partial_path(dst) / "progress.json"
    state = json.loads(progress.read_bytes())
    assert [(s["num_samples"], s["first_index"]) for s in state["shards"]] == [(3, 0), (3, 3)]
    state["shards"][0]["num_samples"], state["shards"][1]["num_samples"] = 2, 4
    state["shards"][1]["first_index"] = 2
    progress.write_text(json.dumps(state), encoding="utf-8")
    checkpoint = progress.read_bytes()
    with pytest.raises(PackFormatError) as raised:
        convert(src, dst, progress=False, resume=True, format=fmt, shard_samples=3)
    assert progress.read_bytes() == checkpoint and not dst.exists()
    data = get_format(fmt).data_name(state["shards"][0]["file"])
    assert str(raised.value) == (
        f"{partial_path(dst) / data}: a shard of the interrupted conversion holds 3 records, but progress.json "
        "lists it with 2. Start the conversion again with overwrite=True"
    )
