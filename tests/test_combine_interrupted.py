"""Killed or interrupted appends and merges: a rerun or resume finishes, refuses what changed, loses nothing."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import KILLED_AT_SECOND_CHECKPOINT, assert_index_digests, image_bytes, tree_digest
from conftest import classes_folder as _folder
from conftest import pack_samples as _samples
from conftest import pack_tree as _tree
from faults.hostile import rewrite_manifest

import packdata
from packdata.cli import main as cli
from packdata.formats.lmdb_env import DATA_FILE
from packdata.pack.manifest import read_manifest

_KILL_DRIVER = r"""
import importlib, os, signal, sys
import packdata
for name in ("conversion.convert", "formats.lmdb", "formats.tfrecord"):  # imported once, before any fork
    importlib.import_module("packdata." + name)
WRITES = {"os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.link", "os.truncate", "shutil.rmtree"}
run = {"kill_at": 0, "calls": 0, "armed": False, "dst": "", "extra": ""}

def ours(path):
    return path == run["extra"] or path.startswith((run["extra"] + os.sep, run["dst"] + os.sep))

def hook(event, args):  # in a run: SIGKILL right before its kill_at-th change to the file system
    if not run["kill_at"] or not (event in WRITES or (event == "open" and args[2] & (os.O_WRONLY | os.O_CREAT))):
        return
    # armed from the conversion's rename into the hidden sibling pack on; then every change counts
    run["armed"] = run["armed"] or any(ours(os.fspath(a)) for a in args if isinstance(a, (str, os.PathLike)))
    if run["armed"]:
        run["calls"] += 1
        if run["calls"] == run["kill_at"]:
            os.kill(os.getpid(), signal.SIGKILL)

sys.addaudithook(hook)
for line in sys.stdin:  # "SRC\tDST\tKILL_AT": one append, in a forked process
    src, dst, kill_at = line.rstrip("\n").split("\t")
    pid = os.fork()
    if pid == 0:
        dst = os.path.abspath(dst)
        extra = os.path.join(os.path.dirname(dst), "." + os.path.basename(dst) + ".append")
        run.update(kill_at=int(kill_at), dst=dst, extra=extra)
        packdata.convert(src, dst, append=True, shard_samples=2, progress=False)
        print("finished after", run["calls"], flush=True)
        os._exit(0)
    print("exit", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


def _grown_pack(tmp_path: Path, fmt: str) -> tuple[Path, Path, Path]:
    """A pack grown once (so a second append deletes the index two generations old), a source to append
    (two shards: one rewritten, ant 0 -> 2; one moved as it is, dog 1 -> 1), and that append done uninterrupted."""
    template = tmp_path / "template" / f"p.{fmt}"
    packdata.convert(_folder(tmp_path / "a", {"cat": ["1.jpg", "2.jpg"], "dog": ["3.jpg"]}), template, progress=False)
    packdata.convert(_folder(tmp_path / "b", {"cat": ["4.jpg"]}), template, append=True, progress=False)
    new = _folder(tmp_path / "c", {"ant": ["5.jpg"], "dog": ["6.jpg", "7.jpg", "8.jpg"]})
    reference = tmp_path / "reference" / f"p.{fmt}"
    shutil.copytree(template, reference)
    packdata.convert(new, reference, append=True, shard_samples=2, progress=False)
    index = read_manifest(reference).index
    assert (index["dir"], index["previous"]) == ("index-a2", "index-a1")
    assert_index_digests(reference)
    assert "index" not in os.listdir(reference)  # two generations old: deleted
    return template, new, reference


class _KilledAppends:
    """Appends run in processes forked by one driver (imported once), each SIGKILLed at a chosen change."""

    def __init__(self) -> None:
        self.driver = subprocess.Popen(
            [sys.executable, "-c", _KILL_DRIVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).parent.parent,
        )

    def run(self, src: Path, pack: Path, kill_at: int) -> bool:
        """Append ``src`` to ``pack``, killed right before its ``kill_at``-th change; False if it ended before."""
        stdin, stdout = self.driver.stdin, self.driver.stdout
        assert stdin is not None and stdout is not None
        stdin.write(f"{src}\t{pack}\t{kill_at}\n")
        stdin.flush()
        line = stdout.readline()
        if line.startswith("finished"):
            assert line.split() == ["finished", "after", str(kill_at - 1)]
            assert stdout.readline().split() == ["exit", "0"]
            return False
        assert line.split() == ["exit", str(-signal.SIGKILL)], (kill_at, line)
        return True

    def __enter__(self) -> _KilledAppends:
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.driver.stdin is not None
        self.driver.stdin.close()
        self.driver.wait(timeout=30)


@pytest.mark.parametrize("resume", [True, False], ids=["resume", "again"])
@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_append_killed_at_every_step_then_rerun_equals_an_uninterrupted_one(
    tmp_path: Path, fmt: str, resume: bool
) -> None:
    # Killed at each change the append makes to the file system in turn, then run again: resumed (finished
    # from where it stopped), or not (undone and done again, or, once it took effect, refused: keys repeat).
    template, new, reference = _grown_pack(tmp_path, fmt)
    before, tree_before = _samples(template), _tree(template)
    after, tree_after = _samples(reference), _tree(reference)
    runner = CliRunner()
    kill_at, states, refused = 0, set(), 0
    with _KilledAppends() as appends:
        while True:
            kill_at += 1
            pack = tmp_path / f"kill{kill_at}" / f"p.{fmt}"
            shutil.copytree(template, pack)
            if not appends.run(new, pack, kill_at):  # it ended before its kill_at-th change: every instant was tried
                assert _tree(pack) == tree_after
                break
            killed = _samples(pack)  # the pack is readable, as it was or grown
            assert killed in (before, after), kill_at
            states.add(len(killed))
            args = ["convert", str(new), str(pack), "--append", "--shard-samples", "2", "-q"]
            done = runner.invoke(cli, args + ["--resume"] * resume)
            if done.exit_code == 1:  # the append had taken effect
                refusal = "there is no interrupted append to resume" if resume else "repeat key 'ant/5.jpg'"
                assert refusal in done.output and killed == after, (kill_at, done.output)
                refused += 1
            else:
                assert done.exit_code == 0, (kill_at, done.output)
            assert _tree(pack) == tree_after, kill_at
            assert sorted(os.listdir(pack.parent)) == [pack.name], kill_at  # the sibling pack and the locks are gone
    assert kill_at > 30 and states == {4, 8}  # killed before and after the manifest changed
    # resumed, only a run killed at the removal of its source's record (.p.lmdb.append.source) or of its lock has
    # nothing left to do; run again, every one that took effect
    assert refused == 2 if resume else refused > 5
    assert tree_before != tree_after and packdata.verify_pack(pack, progress=False).records == 8


def _append_killed_with_a_shard_file_to_move(template: Path, new: Path, tmp_path: Path) -> Path:
    """A copy of ``template`` whose append of ``new`` was killed at the first instant with its plan written and a
    shard file (``shard-00001.lmdb``'s data.mdb) still to move into the pack."""
    with _KilledAppends() as appends:
        for kill_at in range(1, 100):
            pack = tmp_path / f"kill{kill_at}" / "p.lmdb"
            shutil.copytree(template, pack)
            assert appends.run(new, pack, kill_at)
            waiting = pack.parent / ".p.lmdb.append" / "shard-00001.lmdb" / DATA_FILE
            if (pack / ".append-a2.json").exists() and waiting.exists():
                return pack
    raise AssertionError("no instant of the append had its plan written and a shard file still to move")


def test_resumed_append_refuses_a_lost_shard_and_leaves_the_pack_as_it_was(tmp_path: Path) -> None:
    template, new, reference = _grown_pack(tmp_path, "lmdb")
    before, tree_before = _samples(template), _tree(template)
    pack = _append_killed_with_a_shard_file_to_move(template, new, tmp_path)
    lost = pack.parent / ".p.lmdb.append" / "shard-00001.lmdb" / DATA_FILE
    lost.unlink()
    runner = CliRunner()
    done = runner.invoke(cli, ["convert", str(new), str(pack), "--append", "--resume", "-q", "--shard-samples", "2"])
    assert done.exit_code == 1 and done.output.count("\n") == 1, done.output
    assert done.output.startswith(f"Error: {lost}: shard file is missing") and "without resume" in done.output
    assert _samples(pack) == before and packdata.verify_pack(pack, progress=False).records == 4
    done = runner.invoke(cli, ["convert", str(new), str(pack), "--append", "-q", "--shard-samples", "2"])
    assert done.exit_code == 0, done.output
    assert _tree(pack) == _tree(reference) != tree_before


def test_resumed_append_never_moves_a_shard_file_through_a_link_in_the_pack(tmp_path: Path) -> None:
    """A stranger's pack whose interrupted append's shard folder is a link out: resume moved data.mdb through it."""
    template, new, _ = _grown_pack(tmp_path, "lmdb")
    pack = _append_killed_with_a_shard_file_to_move(template, new, tmp_path)
    plan = json.loads((pack / ".append-a2.json").read_text())
    placed = next(to for source, to in plan["moves"] if source == f"shard-00001.lmdb/{DATA_FILE}")
    folder = pack / placed.split("/")[0]
    if folder.exists():
        shutil.rmtree(folder)
    outside = tmp_path / "outside"
    outside.mkdir()
    folder.symlink_to(outside, target_is_directory=True)
    args = ["convert", str(new), str(pack), "--append", "--resume", "-q", "--shard-samples", "2"]
    done = CliRunner().invoke(cli, args)
    assert done.exit_code == 1 and done.output.count("\n") == 1, done.output
    refusal = f"Error: {folder}: the interrupted append's shard folder is not a folder (a link or a file)"
    assert done.output.startswith(refusal), done.output
    assert os.listdir(outside) == [] and _samples(pack) == _samples(template)  # the pack as it was


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_append_deletes_as_index_previous_only_a_folder_of_index_files(tmp_path: Path, fmt: str) -> None:
    pack = tmp_path / f"p.{fmt}"
    packdata.convert(_folder(tmp_path / "a", {"cat": ["1.jpg"]}), pack, progress=False)
    new = _folder(tmp_path / "b", {"cat": ["2.jpg"]})
    runner = CliRunner()
    append = ["convert", str(new), str(pack), "--append", "-q"]
    shard = read_manifest(pack).shards[0].file
    rewrite_manifest(pack, lambda d: d["index"].__setitem__("previous", shard))  # what the next append deletes
    around = tree_digest(pack)
    for command in (["verify", "-q", str(pack)], append):
        done = runner.invoke(cli, command)
        assert done.exit_code == 1 and done.output.startswith(
            f"Error: {pack / 'manifest.json'}: manifest field 'index.previous' should name the index folder an "
            f"append replaced, not a shard, but got '{shard}'. The manifest is damaged"
        ), done.output
    assert tree_digest(pack) == around
    # names the manifest cannot tell from an index folder: one holding something else, a shard's side table
    shutil.copytree(pack / "index", pack / "index-old")
    (pack / "index-old" / "notes.txt").write_text("mine")
    victims = {"index-old": "holds 'notes.txt', which is not a sample index file"}
    if fmt == "tfrecord":
        victims[shard.replace(".tfrecord", ".tfindex")] = "is not a folder"
    for victim, problem in victims.items():
        rewrite_manifest(pack, lambda d, victim=victim: d["index"].__setitem__("previous", victim))
        around = tree_digest(pack)
        done = runner.invoke(cli, append)
        assert done.exit_code == 1 and done.output.count("\n") == 1, done.output
        assert done.output.startswith(f"Error: {pack / victim}: the index folder an append replaced") and (
            f"(index.previous in manifest.json) {problem}; the next append deletes that folder. Move" in done.output
        ), done.output
        assert tree_digest(pack) == around and packdata.verify_pack(pack, progress=False).records == 1
    (pack / "index-old" / "notes.txt").unlink()  # now a folder of index files: the append deletes it
    rewrite_manifest(pack, lambda d: d["index"].__setitem__("previous", "index-old"))
    done = runner.invoke(cli, append)
    assert done.exit_code == 0, done.output
    index = read_manifest(pack).index
    assert "index-old" not in os.listdir(pack) and (index["dir"], index["previous"]) == ("index-a1", "index")
    assert [key for key, _, _ in _samples(pack)] == ["cat/1.jpg", "cat/2.jpg"]


def test_an_interrupted_append_says_how_to_finish_it_and_that_advice_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C during convert --append: the message names --append --resume, not "nothing was published"; it works."""
    import packdata.conversion.convert as convert_module

    pack = tmp_path / "p.lmdb"
    packdata.convert(_folder(tmp_path / "a", {"cat": ["1.jpg"]}), pack, progress=False)
    new = _folder(tmp_path / "b", {"cat": ["2.jpg"]})
    real = convert_module.append_pack

    def interrupted(*args: object, **kwargs: object) -> object:
        monkeypatch.setattr(convert_module, "append_pack", real)
        raise KeyboardInterrupt  # Ctrl-C once the new samples are converted, before they move in

    monkeypatch.setattr(convert_module, "append_pack", interrupted)
    runner = CliRunner()
    done = runner.invoke(cli, ["convert", str(new), str(pack), "--append", "-q"])
    assert done.exit_code == 130 and "nothing was published" not in done.output, done.output
    assert f"Interrupted: the append into {pack} did not finish" in done.output
    assert "rerun with --append --resume to complete it" in done.output
    assert [key for key, _, _ in _samples(pack)] == ["cat/1.jpg"]  # the pack still reads as before
    done = runner.invoke(cli, ["convert", str(new), str(pack), "--append", "--resume", "-q"])
    assert done.exit_code == 0, done.output
    assert [key for key, _, _ in _samples(pack)] == ["cat/1.jpg", "cat/2.jpg"]


def test_overwrite_of_a_pack_with_an_interrupted_append_says_to_finish_it(tmp_path: Path) -> None:
    """Its plan left in the pack: overwrite names the interrupted append, and finishing it first lets overwrite run."""
    template, new, _ = _grown_pack(tmp_path, "lmdb")
    with _KilledAppends() as appends:
        for kill_at in range(1, 100):  # the first instant with the plan written
            pack = tmp_path / f"kill{kill_at}" / "p.lmdb"
            shutil.copytree(template, pack)
            assert appends.run(new, pack, kill_at)
            if (pack / ".append-a2.json").exists():
                break
    runner = CliRunner()
    around = tree_digest(pack)
    done = runner.invoke(cli, ["convert", str(new), str(pack), "--overwrite", "-q"])
    assert done.exit_code == 1 and done.output.count("\n") == 1, done.output
    assert done.output.startswith(f"Error: {pack}: destination holds '.append-a2.json': an append into it was "), (
        done.output
    )
    assert "Finish the append first (--append with --resume), then overwrite" in done.output
    assert tree_digest(pack) == around
    args = ["convert", str(new), str(pack), "--append", "--resume", "-q", "--shard-samples", "2"]
    assert runner.invoke(cli, args).exit_code == 0
    done = runner.invoke(cli, ["convert", str(new), str(pack), "--overwrite", "-q"])
    assert done.exit_code == 0, done.output
    sources = sorted(p.relative_to(new).as_posix() for p in new.rglob("*") if p.is_file())
    assert [key for key, _, _ in _samples(pack)] == sources and not any(p.name.startswith(".") for p in pack.iterdir())


_KILLED_BETWEEN_RENAMES = r"""
import os, signal, sys
import packdata

def hook(event, args):  # SIGKILL as the merged pack is renamed into place: the old one is already moved aside
    if event == "os.rename" and os.fspath(args[0]).endswith(".partial"):
        os.kill(os.getpid(), signal.SIGKILL)

sys.addaudithook(hook)
packdata.merge_packs(sys.argv[1:3], sys.argv[3], overwrite=True)
"""


def test_a_merge_without_overwrite_after_a_killed_overwrite_refuses_the_restored_pack(tmp_path: Path) -> None:
    """A merge --overwrite killed between its two renames leaves the old pack hidden beside DST. A merge without
    --overwrite then checked DST before restoring it, merged, and failed with 'destination appeared while
    converting. The new pack is left in .m.lmdb.partial', a folder it had deleted. Now DST is restored first and
    the merge refused at once, as a merge over an existing pack is."""
    for name, classes in (("a", {"cat": ["1.jpg"]}), ("b", {"dog": ["2.jpg"]}), ("c", {"ant": ["3.jpg"]})):
        packdata.convert(_folder(tmp_path / name, classes), tmp_path / f"{name}.lmdb", progress=False)
    out = tmp_path / "m.lmdb"
    shutil.copytree(tmp_path / "c.lmdb", out)
    old = _samples(out)
    packs = [str(tmp_path / "a.lmdb"), str(tmp_path / "b.lmdb")]
    killed = subprocess.run([sys.executable, "-c", _KILLED_BETWEEN_RENAMES, *packs, str(out)], check=False)
    assert killed.returncode == -signal.SIGKILL and not out.exists()
    result = CliRunner().invoke(cli, ["merge", *packs, "-o", str(out)])
    assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
    assert result.output.startswith(f"Error: {out}: destination already exists, and an interrupted merge"), (
        result.output
    )
    assert _samples(out) == old
    left = {".m.lmdb.partial", "a", "a.lmdb", "b", "b.lmdb", "c", "c.lmdb", "m.lmdb"}  # the killed run's partial
    assert set(os.listdir(tmp_path)) == left
    assert CliRunner().invoke(cli, ["merge", *packs, "-o", str(out), "--overwrite"]).exit_code == 0
    assert len(_samples(out)) == 2 and set(os.listdir(tmp_path)) == left - {".m.lmdb.partial"}


_KILLED_MERGING = r"""
import os, signal, sys
import packdata

def hook(event, args):  # SIGKILL as the first shard file lands in the partial pack, or as that pack is renamed in
    where = os.fspath(args[1] if event == "os.link" else args[0]) if event in ("os.link", "os.rename") else ""
    if (event == "os.link" and ".partial" in where) or (event == "os.rename" and where.endswith(".partial")):
        if sys.argv[4] in event:
            os.kill(os.getpid(), signal.SIGKILL)

sys.addaudithook(hook)
packdata.merge_packs(sys.argv[1:3], sys.argv[3], overwrite=True)
"""


@pytest.mark.parametrize("killed_at", ["link", "rename"])
def test_a_merge_after_a_killed_merge_overwrite_names_its_leftover_and_each_remedy_works(
    tmp_path: Path, killed_at: str
) -> None:
    """A merge --overwrite SIGKILLed mid-write (its first shard linked into .m.lmdb.partial) or between its renames
    leaves that folder; the next merge without --overwrite said only 'destination already exists. Pass --overwrite
    to replace it, or choose another path', never naming the folder left behind, which stayed whatever was chosen
    (no --resume continues a merge). It now names it, that --overwrite removes it, and that keeping the pack means
    deleting it; both remedies leave one pack and no leftover, its samples exactly those asked for."""
    for name, classes in (("a", {"cat": ["1.jpg"]}), ("b", {"dog": ["2.jpg"]}), ("c", {"ant": ["3.jpg"]})):
        packdata.convert(_folder(tmp_path / name, classes), tmp_path / f"{name}.lmdb", progress=False)
    out, partial = tmp_path / "m.lmdb", tmp_path / ".m.lmdb.partial"
    shutil.copytree(tmp_path / "c.lmdb", out)
    old = _samples(out)
    packs = [str(tmp_path / "a.lmdb"), str(tmp_path / "b.lmdb")]
    killed = subprocess.run([sys.executable, "-c", _KILLED_MERGING, *packs, str(out), killed_at], check=False)
    assert killed.returncode == -signal.SIGKILL and partial.is_dir()
    result = CliRunner().invoke(cli, ["merge", *packs, "-o", str(out)])
    assert result.exit_code == 1, result.output
    assert result.output == (
        f"Error: {out}: destination already exists, and an interrupted merge or conversion into it left {partial}, "
        "which was never published (merge cannot continue it: it has no resume). Pass --overwrite to replace "
        f"the pack, which removes .m.lmdb.partial too; or, to keep the pack, delete {partial} and merge into "
        "another path\n"
    )
    assert _samples(out) == old and partial.is_dir()  # refused: nothing changed
    if killed_at == "link":  # keep the pack: delete the leftover, merge elsewhere
        shutil.rmtree(partial)
        assert CliRunner().invoke(cli, ["merge", *packs, "-o", str(tmp_path / "n.lmdb")]).exit_code == 0
        assert _samples(out) == old and len(_samples(tmp_path / "n.lmdb")) == 2
    else:  # replace it
        assert CliRunner().invoke(cli, ["merge", *packs, "-o", str(out), "--overwrite"]).exit_code == 0
        assert sorted(_samples(out)) == sorted(_samples(tmp_path / "a.lmdb") + _samples(tmp_path / "b.lmdb"))
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".m.lmdb.") and p.name != ".m.lmdb.lock"]


def test_a_merge_never_deletes_an_interrupted_conversion_that_resume_would_finish(tmp_path: Path) -> None:
    """A conversion SIGKILLed after its checkpoint leaves .m.lmdb.partial, which `convert --resume` finishes (and
    convert without it refuses to touch); a merge into m.lmdb deleted it without a word and published its own pack.
    It is now refused, naming the conversion and the three ways on; the resume then finishes the pack."""
    for name, classes in (("a", {"cat": ["1.jpg"]}), ("b", {"dog": ["2.jpg"]})):
        packdata.convert(_folder(tmp_path / name, classes), tmp_path / f"{name}.lmdb", progress=False)
    source = _folder(tmp_path / "big", {"ant": [f"{i}.jpg" for i in range(6)], "bee": ["x.jpg", "y.jpg"]})
    out, partial = tmp_path / "m.lmdb", tmp_path / ".m.lmdb.partial"
    killed = subprocess.run([sys.executable, "-c", KILLED_AT_SECOND_CHECKPOINT, str(source), str(out)], check=False)
    assert killed.returncode == -signal.SIGKILL and (partial / "progress.json").is_file() and not out.exists()
    packs = [str(tmp_path / "a.lmdb"), str(tmp_path / "b.lmdb")]
    result = CliRunner().invoke(cli, ["merge", *packs, "-o", str(out)])
    assert result.exit_code == 1, result.output
    assert result.output == (
        f"Error: {out}: an interrupted conversion into {out} is in {partial}, and merging there would delete it. "
        f"Finish it with resume (`packdata convert SRC {out} --resume`), merge into another path, or pass "
        "--overwrite to merge over it (its work is lost)\n"
    )
    assert (partial / "progress.json").is_file() and not out.exists()
    packdata.convert(source, out, shard_samples=1, workers=1, progress=False, resume=True)
    packdata.convert(source, tmp_path / "clean.lmdb", shard_samples=1, workers=1, progress=False)
    assert _samples(out) == _samples(tmp_path / "clean.lmdb")


@pytest.mark.parametrize("planted", ["link", "file"])
def test_a_merge_beside_a_partial_that_is_a_link_or_a_file_removes_only_it_and_publishes(
    tmp_path: Path, planted: str
) -> None:
    """A .m.lmdb.partial that is a symlink to a folder outside (or a plain file), with no pack at m.lmdb, stopped
    every merge there with a bare FileExistsError (rmtree refused the link, mkdir found it). The link (or file)
    itself is removed now, what it leads to is untouched, and the merge publishes, with and without overwrite."""
    packs = []
    for name, classes in (("a", {"cat": ["1.jpg"]}), ("b", {"dog": ["2.jpg"]})):
        packdata.convert(_folder(tmp_path / name, classes), tmp_path / f"{name}.lmdb", progress=False)
        packs.append(tmp_path / f"{name}.lmdb")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine", encoding="utf-8")
    for overwrite in (False, True):
        out = tmp_path / f"m{overwrite}.lmdb"
        partial = tmp_path / f".{out.name}.partial"
        if planted == "link":
            partial.symlink_to(outside, target_is_directory=True)
        else:
            partial.write_text("a file", encoding="utf-8")
        result = packdata.merge_packs(packs, out, overwrite=overwrite)
        assert result.samples == 2 and not os.path.lexists(partial)
        assert sorted(s[0] for s in _samples(out)) == ["cat/1.jpg", "dog/2.jpg"]
    assert os.listdir(outside) == ["keep.txt"] and (outside / "keep.txt").read_text(encoding="utf-8") == "mine"


def test_a_resumed_append_from_another_source_with_the_same_names_is_refused(tmp_path: Path) -> None:
    """An append of v1 killed once v1 was converted beside the pack (or once its plan was written), resumed with
    v2 (the same names, other bytes): the resume appended v1's samples and said it had packed v2's. Refused now,
    naming both, until resumed with v1 (which then appends v1, as an uninterrupted append does)."""
    template = tmp_path / "template" / "p.lmdb"
    packdata.convert(_folder(tmp_path / "base", {"cat": ["1.jpg"]}), template, progress=False)
    v1 = _folder(tmp_path / "v1", {"ant": ["5.jpg"], "dog": ["6.jpg", "7.jpg"]})
    v2 = tmp_path / "v2"
    shutil.copytree(v1, v2)
    for i, path in enumerate(sorted(v2.rglob("*.jpg"))):
        path.write_bytes(image_bytes(500 + i))
    reference = tmp_path / "reference" / "p.lmdb"
    shutil.copytree(template, reference)
    packdata.convert(v1, reference, append=True, shard_samples=2, progress=False)
    runner, found = CliRunner(), set()
    with _KilledAppends() as appends:
        for kill_at in range(1, 200):
            pack = tmp_path / f"kill{kill_at}" / "p.lmdb"
            shutil.copytree(template, pack)
            if not appends.run(v1, pack, kill_at):
                break
            planned = (pack / ".append-a1.json").exists()
            if not planned and not (pack.parent / ".p.lmdb.append" / "manifest.json").exists():
                continue  # not converted yet (a resume converts v2: refused by its checkpoint), or appended
            found.add(planned)
            args = ["--append", "--resume", "--shard-samples", "2", "-q"]
            done = runner.invoke(cli, ["convert", str(v2), str(pack), *args])
            assert done.exit_code == 1 and done.output.count("\n") == 1, (kill_at, done.output)
            assert f"the interrupted append read another source ({v1}; this run reads {v2})" in done.output
            done = runner.invoke(cli, ["convert", str(v1), str(pack), *args])
            assert done.exit_code == 0, (kill_at, done.output)
            assert _samples(pack) == _samples(reference), kill_at
    assert found == {False, True}  # killed with v1 converted, and with the append's plan written


def test_a_refused_append_resume_advises_appending_again_not_overwrite(tmp_path: Path) -> None:
    """An append killed while its source's conversion beside the pack was unfinished, its checkpoint then
    damaged, resumed: the refusal said 'start the conversion again with --overwrite', which --append refuses.
    It now says to append again without --resume, and doing so appends as an uninterrupted append does."""
    pack = tmp_path / "p.lmdb"
    packdata.convert(_folder(tmp_path / "base", {"cat": ["1.jpg"]}), pack, progress=False)
    new = _folder(tmp_path / "new", {"ant": ["5.jpg"], "dog": ["6.jpg", "7.jpg"]})
    reference = tmp_path / "reference" / "p.lmdb"
    shutil.copytree(pack, reference)
    packdata.convert(new, reference, append=True, shard_samples=2, progress=False)
    with _KilledAppends() as appends:
        assert appends.run(new, pack, 1)  # killed before its conversion's partial pack was renamed
    partial = tmp_path / "..p.lmdb.append.partial"
    assert partial.is_dir()
    (partial / "progress.json").write_text("not json", encoding="utf-8")
    runner = CliRunner()
    done = runner.invoke(cli, ["convert", str(new), str(pack), "--append", "--resume", "--shard-samples", "2", "-q"])
    assert done.exit_code == 1 and done.output.count("\n") == 1, done.output
    assert "checkpoint is damaged" in done.output and "--overwrite" not in done.output, done.output
    assert done.output.rstrip().endswith(
        "Append again without --resume: the interrupted append starts over, the pack keeps its samples"
    )
    again = runner.invoke(cli, ["convert", str(new), str(pack), "--append", "--shard-samples", "2", "-q"])
    assert again.exit_code == 0, again.output
    assert _samples(pack) == _samples(reference)
