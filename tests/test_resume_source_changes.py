"""A resume over a source that changed since the interruption is refused, naming what changed, on every source kind.

Each conversion here is SIGKILLed in a subprocess as it writes a checkpoint
(:data:`conftest.KILLED_AT_SECOND_CHECKPOINT`), then resumed in this process.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
from conftest import KILLED_AT_SECOND_CHECKPOINT, moto_s3

import packdata
from packdata.errors import SourceError


def _tar(path: Path, texts: list[str]) -> None:
    """A tar of ``0.txt``, ``1.txt``, ... holding ``texts`` (members of a fixed time: the bytes are the texts')."""
    with tarfile.open(path, "w") as tar:
        for i, text in enumerate(texts):
            data = text.encode("utf-8")
            member = tarfile.TarInfo(f"{path.stem}-{i}.txt")
            member.size, member.mtime = len(data), 1_700_000_000
            tar.addfile(member, io.BytesIO(data))


def _killed(src: str, dst: Path) -> Path:
    """The partial folder of a conversion of ``src`` into ``dst`` SIGKILLed at its second checkpoint."""
    killed = subprocess.run([sys.executable, "-c", KILLED_AT_SECOND_CHECKPOINT, src, str(dst)], check=False)
    partial = dst.parent / f".{dst.name}.partial"
    assert killed.returncode == -signal.SIGKILL and (partial / "progress.json").is_file() and not dst.exists()
    return partial


def _texts(pack: Path) -> list[str]:
    return [s["txt"] if isinstance(s, dict) else s[0] for s in packdata.LMDBDataset(pack)]


@pytest.mark.parametrize("edit", ["rewritten", "touched"])
def test_a_resume_names_a_tar_rewritten_in_place_and_resumes_over_one_only_touched(tmp_path: Path, edit: str) -> None:
    """A tar whose packed members were rewritten in place (same size, other bytes) was refused as 'SRC: the source
    folder changed since the interrupted conversion', naming the tars' folder: the walk's check sees the members'
    bytes, but not which tar differs. The checkpoint now probes the tar of the last sample packed, and the refusal
    names it. A tar only touched (its time changed, its bytes not) is not a change: the resume publishes."""
    (tmp_path / "src").mkdir()
    for n in range(3):
        _tar(tmp_path / "src" / f"d-{n}.tar", [f"a{n}{i}" for i in range(3)])
    src, dst = str(tmp_path / "src" / "d-{0..2}.tar"), tmp_path / "out.lmdb"
    partial = _killed(src, dst)
    first = tmp_path / "src" / "d-0.tar"
    if edit == "rewritten":
        _tar(first, ["b00", "b01", "b02"])
        with pytest.raises(SourceError) as raised:
            packdata.convert(src, dst, shard_samples=1, workers=1, progress=False, resume=True)
        assert str(raised.value) == (
            f"{first}: a tar read before the interruption changed since (10240 bytes then, 10240 bytes now; or its "
            "modification time differs). Restore it as it was and resume, or start again with overwrite=True"
        )
        assert (partial / "progress.json").is_file() and not dst.exists()
        return
    os.utime(first, ns=(1, 1))
    packdata.convert(src, dst, shard_samples=1, workers=1, progress=False, resume=True)
    assert _texts(dst) == [f"a{n}{i}" for n in range(3) for i in range(3)]


_KILLED_AT_CHECKPOINT = r"""
import json, os, signal, sys
import packdata
from packdata.conversion import checkpoint, local

local._COMMIT_SAMPLES = 1  # a checkpoint a sample
kwargs = json.loads(sys.argv[4])
checkpoint.MAX_PROBES = kwargs.pop("max_probes")  # the list thinned within a few files
saved = []

def hook(event, args):  # SIGKILL as checkpoint N is written: the one before it is on disk
    if event in ("os.rename", "os.replace") and os.fspath(args[1]).endswith("progress.json"):
        saved.append(args[1])
        if len(saved) == int(sys.argv[3]):
            os.kill(os.getpid(), signal.SIGKILL)

sys.addaudithook(hook)
packdata.convert(sys.argv[1], sys.argv[2], workers=1, progress=False, **kwargs)
"""
"""``python -c`` it with SRC DST N KWARGS: a conversion SIGKILLed at checkpoint N, keeping at most
``KWARGS["max_probes"]`` probes (KWARGS: JSON, the rest of them convert's)."""


def test_a_resume_refuses_the_last_file_packed_rewritten_once_the_probes_were_thinned(tmp_path: Path) -> None:
    """Thinning the full list of probes kept every other one from the second, so the latest commit's file (the
    likeliest to be rewritten still, by a producer writing the source as it is packed) was dropped, and, probes
    then kept one commit in two, the next ones too: a rewrite of the last files packed was resumed over. The
    latest commit's file is now always probed."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        (src / f"{i:02d}.txt").write_text(f"t{i}", encoding="utf-8")
    dst = tmp_path / "out.lmdb"
    args = [sys.executable, "-c", _KILLED_AT_CHECKPOINT, str(src), str(dst), "10", '{"max_probes": 4}']
    assert subprocess.run(args, check=False).returncode == -signal.SIGKILL
    progress = json.loads((tmp_path / ".out.lmdb.partial" / "progress.json").read_text(encoding="utf-8"))
    last = src / f"{progress['samples_done'] - 1:02d}.txt"
    last.write_text("rewritten", encoding="utf-8")
    with pytest.raises(SourceError) as raised:
        packdata.convert(src, dst, workers=1, progress=False, resume=True)
    assert str(raised.value) == (
        f"{last}: a file packed before the interruption changed since (2 bytes then, 9 bytes now; or its "
        "modification time differs). Restore it as it was and resume, or start again with overwrite=True"
    )
    assert len(progress["probes"]) <= 4


def test_a_tar_read_over_several_commits_is_probed_once_and_a_resume_names_it_rewritten(tmp_path: Path) -> None:
    """A tar packed over several commits was probed once a commit, the same probe each time: the list (here at
    most 3) filled with copies of the first tar's, and thinning it dropped the second tar's, the latest commit's,
    so a resume over that tar rewritten since was refused only as 'the source folder changed', naming no tar. A
    probe equal to the last one is now kept once: the checkpoint probes each tar read, and the refusal names
    the second."""
    (tmp_path / "src").mkdir()
    for n in range(3):
        _tar(tmp_path / "src" / f"d-{n}.tar", [f"a{n}{i}" for i in range(3)])
    src, dst = str(tmp_path / "src" / "d-{0..2}.tar"), tmp_path / "out.lmdb"
    args = [sys.executable, "-c", _KILLED_AT_CHECKPOINT, src, str(dst), "5", '{"max_probes": 3}']
    assert subprocess.run(args, check=False).returncode == -signal.SIGKILL
    progress = json.loads((tmp_path / ".out.lmdb.partial" / "progress.json").read_text(encoding="utf-8"))
    tars = [str(tmp_path / "src" / f"d-{n}.tar") for n in range(2)]
    assert progress["samples_done"] == 4 and [p[0] for p in progress["probes"]] == tars  # 3 of d-0, 1 of d-1
    _tar(Path(tars[1]), ["b10", "b11", "b12"])
    os.utime(tars[1], ns=(1, 1))  # a time it surely did not have (a coarse clock could repeat one)
    with pytest.raises(SourceError) as raised:
        packdata.convert(src, dst, workers=1, progress=False, resume=True)
    assert str(raised.value) == (
        f"{tars[1]}: a tar read before the interruption changed since (10240 bytes then, 10240 bytes now; or its "
        "modification time differs). Restore it as it was and resume, or start again with overwrite=True"
    )


def _refused_naming(src: str, dst: Path, options: dict, url: str, size: int = 2) -> None:
    """Assert a resume of ``src`` into ``dst`` is refused naming the object at ``url``, ``size`` bytes when packed."""
    with pytest.raises(SourceError) as raised:
        packdata.convert(src, dst, storage_options=options, workers=1, progress=False, resume=True)
    message = str(raised.value)
    rewritten = "an object packed before the interruption was rewritten at the URL since"
    assert message.startswith(f"{url}: {rewritten} ({size} ")
    assert message.endswith(". Restore it as it was and resume, or start again with overwrite=True")
    assert (dst.parent / f".{dst.name}.partial" / "progress.json").is_file() and not dst.exists()


def _killed_copy(fs: Any, options: dict, texts: list[str], work: Path, dst: Path) -> dict:
    """The checkpoint of a conversion of s3://packs/src (``texts`` as 00.txt, 01.txt, ..., copied into its work
    folder under ``work``) into ``dst``, SIGKILLed at its fifth checkpoint: 4 samples packed, 00.txt and 03.txt
    the probes."""
    for i, text in enumerate(texts):
        fs.pipe_file(f"packs/src/{i:02d}.txt", text.encode())
    kwargs = json.dumps({"max_probes": 2, "storage_options": options})
    args = [sys.executable, "-c", _KILLED_AT_CHECKPOINT, "s3://packs/src", str(dst), "5", kwargs]
    assert (
        subprocess.run(args, check=False, env={**os.environ, "PACKDATA_TMP": str(work)}).returncode == -signal.SIGKILL
    )
    progress = json.loads((dst.parent / f".{dst.name}.partial" / "progress.json").read_text(encoding="utf-8"))
    assert progress["samples_done"] == 4 and [Path(p[0]).name for p in progress["probes"]] == ["00.txt", "03.txt"]
    return progress


def test_a_resume_of_a_copied_url_folder_refuses_an_object_rewritten_at_the_url_since(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A source folder at a URL is copied into a work folder, then converted. An object packed before the
    interruption and rewritten at the URL since was downloaded again by the resume, and was refused only if its
    local copy was among the probes (naming the work folder's file, not the object), else resumed over: the pack
    held the old bytes. The checkpoint now records how much of the download journal came before the packing, and
    a resume refuses any packed file the journal shows copied again at another size or version, naming its URL,
    again at every later resume (the journal keeps the new copy's line after the recorded point)."""
    work = tmp_path / "work"
    monkeypatch.setenv("PACKDATA_TMP", str(work))
    with moto_s3({"key": "testing-key-id", "secret": "testing-secret"}) as (options, fs):
        dst = tmp_path / "out.lmdb"
        _killed_copy(fs, options, [f"t{i}" for i in range(8)], work, dst)  # 01.txt is not among the probes
        fs.pipe_file("packs/src/01.txt", b"rewritten")
        for _ in range(2):
            _refused_naming("s3://packs/src", dst, options, "s3://packs/src/01.txt")
        packdata.convert("s3://packs/src", dst, storage_options=options, progress=False, overwrite=True)
    assert _texts(dst) == ["t0", "rewritten", *(f"t{i}" for i in range(2, 8))]


def test_a_resume_of_a_list_at_a_url_refuses_an_object_it_names_rewritten_since(tmp_path: Path) -> None:
    """A list at a URL names objects beside it, read in place. An object packed before the interruption and
    rewritten since (same size: only its ETag tells) was not looked at: probes were of local files only, and the
    walk holds names, so the resume packed the new objects after the old one. A checkpoint now probes the last
    object packed at each commit by its size and version, and a resume asks the store for them: one that differs
    is refused, naming its URL."""
    with moto_s3({"key": "testing-key-id", "secret": "testing-secret"}) as (options, fs):
        for i in range(6):
            fs.pipe_file(f"packs/l/{i}.txt", f"t{i}".encode())
        fs.pipe_file("packs/l/list.csv", b"path\n" + b"".join(b"%d.txt\n" % i for i in range(6)))
        dst = tmp_path / "out.lmdb"
        kwargs = json.dumps({"max_probes": 256, "storage_options": options})
        args = [sys.executable, "-c", _KILLED_AT_CHECKPOINT, "s3://packs/l/list.csv", str(dst), "4", kwargs]
        assert subprocess.run(args, check=False).returncode == -signal.SIGKILL
        progress = json.loads((tmp_path / ".out.lmdb.partial" / "progress.json").read_text(encoding="utf-8"))
        assert progress["samples_done"] == 3
        fs.pipe_file("packs/l/0.txt", b"T0")  # same size, other bytes
        _refused_naming("s3://packs/l/list.csv", dst, options, "s3://packs/l/0.txt")
        packdata.convert("s3://packs/l/list.csv", dst, storage_options=options, progress=False, overwrite=True)
    assert _texts(dst) == ["T0", *(f"t{i}" for i in range(1, 6))]


def test_a_resume_names_a_tar_at_a_url_rewritten_since(tmp_path: Path) -> None:
    """A tar at a URL whose packed members were rewritten (same size, other bytes) was refused as 's3://packs/t:
    the source folder changed since the interrupted conversion', naming the tars' folder: tars at a URL were not
    probed. The checkpoint now probes the tar of the last sample packed by its size and version, as a list's
    objects are, and the refusal names its URL."""
    with moto_s3({"key": "testing-key-id", "secret": "testing-secret"}) as (options, fs):
        for n in range(3):
            _tar(tmp_path / f"d-{n}.tar", [f"a{n}{i}" for i in range(3)])
            fs.put_file(str(tmp_path / f"d-{n}.tar"), f"packs/t/d-{n}.tar")
        src, dst = "s3://packs/t/d-{0..2}.tar", tmp_path / "out.lmdb"
        kwargs = json.dumps({"max_probes": 256, "storage_options": options})
        args = [sys.executable, "-c", _KILLED_AT_CHECKPOINT, src, str(dst), "4", kwargs]
        assert subprocess.run(args, check=False).returncode == -signal.SIGKILL
        progress = json.loads((tmp_path / ".out.lmdb.partial" / "progress.json").read_text(encoding="utf-8"))
        assert progress["samples_done"] == 3  # all of d-0.tar
        _tar(tmp_path / "d-0.tar", ["b00", "b01", "b02"])  # same size, other bytes
        fs.put_file(str(tmp_path / "d-0.tar"), "packs/t/d-0.tar")
        _refused_naming(src, dst, options, "s3://packs/t/d-0.tar", size=10240)
        packdata.convert(src, dst, storage_options=options, progress=False, overwrite=True)
    assert _texts(dst) == ["b00", "b01", "b02", *(f"a{n}{i}" for n in (1, 2) for i in range(3))]


@pytest.mark.parametrize("journal_now", ["shorter", "edited"])
def test_a_resume_of_a_copied_url_folder_refuses_a_download_journal_other_than_the_one_it_packed_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, journal_now: str
) -> None:
    """The checkpoint records how many bytes of the download journal came before the packing; a resume read the
    journal's lines past that point as the files downloaded again. A journal other than the one measured was
    misread: one shorter (its work folder removed, an unpacked object rewritten shorter, all downloaded again)
    had every packed object refused as 'rewritten at the URL since', unchanged ones too; one edited (a packed
    object's line gone, that object rewritten at the same size and downloaded again) grew back to the same size,
    and the resume packed the rest after the old bytes. The checkpoint now records the SHA-256 of those bytes
    too; a journal whose first bytes are not those is refused, named, the partial kept."""
    work = tmp_path / "work"
    monkeypatch.setenv("PACKDATA_TMP", str(work))
    with moto_s3({"key": "testing-key-id", "secret": "testing-secret"}) as (options, fs):
        dst = tmp_path / "out.lmdb"
        progress = _killed_copy(fs, options, [f"text-{i:05d}" for i in range(8)], work, dst)
        journal = next(work.rglob("downloaded.jsonl"))
        if journal_now == "shorter":  # 07.txt is not packed yet: 6 bytes now, 10 then (its line a byte shorter)
            shutil.rmtree(journal.parent)
            fs.pipe_file("packs/src/07.txt", b"text-7")
        else:  # 01.txt (packed, not probed) rewritten at the same size; its journal line removed
            lines = journal.read_text(encoding="utf-8").splitlines(keepends=True)
            journal.write_text("".join(line for line in lines if '"01.txt"' not in line), encoding="utf-8")
            fs.pipe_file("packs/src/01.txt", b"TEXT-00001")
        with pytest.raises(SourceError) as raised:
            packdata.convert("s3://packs/src", dst, storage_options=options, workers=1, progress=False, resume=True)
        size, before = journal.stat().st_size, progress["copied_journal"]
        held = f"fewer than the {before} it held" if journal_now == "shorter" else f"its first {before} bytes not those"
        assert (journal_now, size < before) in (("shorter", True), ("edited", False))
        assert str(raised.value) == (
            f"{journal}: is not the download journal the interrupted conversion packed from ({size} bytes, {held} "
            "then): which packed files were downloaded again since, as other objects, cannot be told. It was cut, "
            "edited or removed with its work folder since: start again with overwrite=True"
        )
        assert (tmp_path / ".out.lmdb.partial" / "progress.json").is_file() and not dst.exists()
        packdata.convert("s3://packs/src", dst, storage_options=options, progress=False, overwrite=True)
    assert _texts(dst)[:2] == ["text-00000", "TEXT-00001" if journal_now == "edited" else "text-00001"]
