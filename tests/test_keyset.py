"""KeySet: the keys a conversion has seen, in about 40 bytes a key, answering exactly as a dict would."""

from __future__ import annotations

import hashlib
import io
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import tracemalloc
from pathlib import Path
from typing import Any

import fsspec
import pytest
from click.testing import CliRunner
from conftest import KILLED_AT_SECOND_CHECKPOINT, killed_at_files_done, tree_digest

import packdata
from packdata.cli import main as cli
from packdata.conversion import combine, lists
from packdata.conversion.destination import SPILL_DIR, partial_path
from packdata.conversion.lists import scan_list
from packdata.conversion.local import _count_walk
from packdata.errors import ConfigError, PackFormatError
from packdata.pack import keyset
from packdata.pack.keyset import KeySet
from packdata.progress import progress


def _keys(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    pool = [f"train/c{rng.randrange(50)}/img_{rng.randrange(3000):05d}" for _ in range(count)]
    return [*pool, "a", "ä/ö", "name\udcff", "x" * 4000]  # non-ASCII, a name os.listdir gave from bytes, a long one


def _check_against_dict(keys: KeySet, added: list[str], absent: list[str]) -> None:
    truth: dict[str, int] = {}
    for value, key in enumerate(added):
        assert keys.add(key, value) == truth.get(key), key
        truth.setdefault(key, value)
        assert len(keys) == len(truth)
    assert all(key in keys for key in truth)
    assert not any(key in keys for key in absent if key not in truth)
    assert all(keys.add(key, -1) == value for key, value in truth.items())  # the first value stays


@pytest.mark.parametrize("min_recent", [1, 3, 1 << 16])
def test_a_key_set_answers_as_a_dict_across_merges(min_recent: int) -> None:
    """add returns None for a new key, the first value for a repeat, in the recent dict and the merged arrays."""
    keys = _keys(5000, seed=min_recent)
    _check_against_dict(KeySet(min_recent), keys, _keys(2000, seed=99))


def test_keys_whose_digests_share_their_first_eight_bytes_are_told_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """The arrays are sorted on 8 bytes: rows sharing them are each compared on the other 8, never taken as one."""

    def weak(key: str) -> bytes:  # 16 possible first halves: most keys share one with many others
        full = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        return bytes(7) + full[:1] + full[8:]

    monkeypatch.setattr(keyset, "_digest", weak)
    _check_against_dict(KeySet(4), _keys(3000, seed=7), _keys(1000, seed=8))


def test_a_list_walk_holds_well_under_a_hundred_bytes_a_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A list's walk remembers every key to refuse repeats: a dict of keys and paths held about 250 bytes a row,
    25 GB for 100 M rows. It now holds a KeySet: the walk's peak, all rows walked, stays under 100 bytes a row
    (its recent-keys dict made as small, against the rows, as it is for a list of millions)."""
    monkeypatch.setattr(keyset, "_MIN_RECENT", 1024)
    rows = 60_000
    listing = tmp_path / "l.csv"
    listing.write_text("path\n" + "".join(f"train/c{i % 10}/img_{i:08d}.jpg\n" for i in range(rows)), encoding="utf-8")
    source = scan_list(listing)
    tracemalloc.start()
    try:
        walked = sum(1 for _ in source.walk())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert walked == rows
    assert peak < 100 * rows, f"{peak / rows:.0f} bytes a row"


def test_a_packwriter_names_the_sample_that_first_gave_a_repeated_key(tmp_path: Path) -> None:
    with packdata.PackWriter(tmp_path / "w.lmdb") as writer:
        for n in range(3):
            writer.write({"__key__": f"k{n}", "txt": "x"})
        with pytest.raises(ConfigError, match=r"key 'k1' was written before \(sample 1\)"):
            writer.write({"__key__": "k1", "txt": "y"})
        writer.write({"__key__": "k3", "txt": "z"})
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "w.lmdb")] == ["k0", "k1", "k2", "k3"]


def test_a_tar_key_repeated_in_a_later_shard_names_the_shard_that_gave_it_first(tmp_path: Path) -> None:
    for shard, keys in (("a-0.tar", ["k0", "k1"]), ("a-1.tar", ["k2", "k0"])):
        with tarfile.open(tmp_path / shard, "w") as tar:
            for key in keys:
                info = tarfile.TarInfo(f"{key}.txt")
                info.size = len(key)
                tar.addfile(info, io.BytesIO(key.encode()))
    result = packdata.convert(f"{tmp_path}/a-{{0..1}}.tar", tmp_path / "out.lmdb", progress=False)
    assert result.packed == 3 and result.skipped == {"duplicate key": 1}
    detail = result.skip_examples[0]["detail"]
    assert detail == f"an earlier sample in {tmp_path}/a-0.tar has this key ({tmp_path}/a-1.tar)"


def test_the_progress_bars_count_of_a_list_reads_rows_and_remembers_no_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bar's total came from a second walk in a thread, which built a second KeySet as large as the walk's
    (and parsed every label and path again). It now counts rows: as many as the walk's entries, skips included."""
    made: list[int] = []

    class CountedKeySet(KeySet):
        def __init__(self, **options: Any) -> None:
            made.append(1)
            super().__init__(**options)

    monkeypatch.setattr(lists, "KeySet", CountedKeySet)
    listing = tmp_path / "l.csv"
    rows = ["a.txt,cat", "b.txt,dog", "a.txt,dog", ",cat", "c.txt,", 'd.txt,"x,y"', "e.txt,cat"]
    listing.write_text("path,label\n" + "\n".join(rows) + "\n", encoding="utf-8")
    source = scan_list(listing, label_column="label")
    bar = progress(desc="packing", unit=" files", disable=True)
    _count_walk(source, bar, threading.Event())
    assert made == []
    assert bar.total == len(list(source.walk())) == len(rows)
    assert made == [1]
    fsspec.filesystem("memory").pipe("/keyset-lists/l.csv", listing.read_bytes())
    assert source.cheap_to_count and not scan_list("memory://keyset-lists/l.csv").cheap_to_count  # downloaded once


_SPILL_EVERY = 50
"""Keys the arrays hold before they spill, under the tiny budget the spill tests set."""


def _tiny_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keyset, "_BUDGET", _SPILL_EVERY * 24 * 4)  # a quarter of it holds _SPILL_EVERY keys
    monkeypatch.setattr(keyset, "_MIN_RECENT", 8)


def _runs(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("run-*")) if folder.exists() else []


@pytest.mark.parametrize("weak", [False, True])
def test_a_spilling_key_set_answers_as_a_dict_across_runs_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, weak: bool
) -> None:
    """Past its budget the arrays go to sorted runs in the folder: a repeat of a key in any run is found, with
    the first value; a new key is not taken for one (also where digests share their first 8 bytes across runs).
    close() deletes the runs."""
    if weak:
        monkeypatch.setattr(keyset, "_digest", lambda key: bytes(7) + hashlib.blake2b(key.encode()).digest()[:9])
    keys = KeySet(4, spill=tmp_path / "spill", budget=_SPILL_EVERY * 24 * 4)
    _check_against_dict(keys, _keys(3000, seed=3)[:-2], _keys(1000, seed=4)[:-2])
    assert keys.runs >= 10 and len(_runs(tmp_path / "spill")) == keys.runs
    keys.close()
    assert list((tmp_path / "spill").iterdir()) == []


def _list_with_repeats(tmp_path: Path, rows: int) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    lines = []
    for i in range(rows):
        (src / f"{i:05d}.txt").write_text(f"t{i}")
        lines.append(f"{i:05d}.txt,c{i % 3}")
    lines += ["00002.txt,c0", f"{rows - 1:05d}.txt,c1", "./00007.txt,c2"]  # repeats of keys long spilled
    listing = src / "l.csv"
    listing.write_text("path,label\n" + "\n".join(lines) + "\n", encoding="utf-8")
    return listing


def test_a_list_whose_keys_spill_names_each_repeats_first_row_and_publishes_no_spill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The list walk's keys spill into the partial pack; repeats of keys in spilled runs are skipped naming the
    row that gave them first; the spilled runs are not in the published pack."""
    _tiny_budget(monkeypatch)
    listing = _list_with_repeats(tmp_path, 600)
    walk = scan_list(listing, label_column="label").walk(spill=tmp_path / "s")
    for _ in range(400):
        next(walk)
    assert len(_runs(tmp_path / "s")) >= 5  # spilled while walking
    assert sum(1 for _ in walk) == 203
    assert _runs(tmp_path / "s") == []  # the walk's end deletes its runs
    dst = tmp_path / "out.lmdb"
    result = packdata.convert(listing, dst, label_column="label", progress=False)
    assert result.packed == 600 and result.skipped == {"duplicate key": 3}
    details = [e["detail"] for e in result.skip_examples]
    assert details == [
        "row 602 (00002.txt) has the key of row 4: " + lists._KEY_RULE,
        "row 603 (00599.txt) has the key of row 601: " + lists._KEY_RULE,
        "row 604 (./00007.txt) has the key of row 9: " + lists._KEY_RULE,
    ]
    assert not (dst / SPILL_DIR).exists() and not partial_path(dst).exists()
    assert sorted(s["__key__"] for s in packdata.LMDBDataset(dst)) == [f"{i:05d}" for i in range(600)]


def test_a_packwriter_whose_keys_spill_names_the_first_sample_and_leaves_no_spill_closed_or_aborted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _tiny_budget(monkeypatch)
    for end in ("abort", "close"):
        dst = tmp_path / f"{end}.lmdb"
        writer = packdata.PackWriter(dst)
        for n in range(300):
            writer.write({"__key__": f"k{n}", "txt": "x"})
        assert len(_runs(partial_path(dst) / SPILL_DIR)) >= 4
        with pytest.raises(ConfigError, match=r"key 'k3' was written before \(sample 3\)"):
            writer.write({"__key__": "k3", "txt": "y"})
        getattr(writer, end)()
        assert not partial_path(dst).exists()
    assert not os.path.lexists(tmp_path / "abort.lmdb")
    assert not (tmp_path / "close.lmdb" / SPILL_DIR).exists()
    assert len(packdata.LMDBDataset(tmp_path / "close.lmdb")) == 300


def test_a_merge_whose_keys_spill_finds_repeats_in_spilled_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _tiny_budget(monkeypatch)
    for name, keys in (("a", range(300)), ("b", [*range(300, 400), 5, 250])):
        with packdata.PackWriter(tmp_path / f"{name}.lmdb") as writer:
            for n in keys:
                writer.write({"__key__": f"k{n:03d}", "txt": name})
    packs = [tmp_path / "a.lmdb", tmp_path / "b.lmdb"]
    with pytest.raises(ConfigError, match=rf"key 'k005' \(sample 100\) is already in an earlier pack \({packs[0]}\)"):
        packdata.merge_packs(packs, tmp_path / "m.lmdb")
    assert not partial_path(tmp_path / "m.lmdb").exists()
    result = packdata.merge_packs(packs, tmp_path / "m.lmdb", on_duplicate="rename")
    assert result.renamed_keys == 2 and not (tmp_path / "m.lmdb" / SPILL_DIR).exists()
    keys = sorted(s["__key__"] for s in packdata.LMDBDataset(tmp_path / "m.lmdb"))
    assert keys == sorted([f"k{n:03d}" for n in range(400)] + ["k005~1", "k250~1"])


_SLOW_LIST = """
import sys, time
import packdata
from packdata.conversion import load, local
from packdata.pack import keyset
keyset._BUDGET, keyset._MIN_RECENT, local._COMMIT_SAMPLES = 50 * 24 * 4, 8, 5
load._load = lambda entry, opts, _load=load._load: (time.sleep(0.005), _load(entry, opts))[1]
packdata.convert(sys.argv[1], sys.argv[2], label_column="label", workers=2, progress=False, resume=len(sys.argv) > 3)
"""


@pytest.mark.slow
def test_a_list_conversion_killed_with_keys_spilled_resumes_to_the_clean_runs_pack(tmp_path: Path) -> None:
    """Killed with runs spilled, a resume walks again with a fresh key set (the killed run's runs removed), finds
    the same repeats, and publishes what an uninterrupted run does, without the spill folder."""
    listing = _list_with_repeats(tmp_path, 600)
    dst = tmp_path / "out.lmdb"
    killed_at_files_done(_SLOW_LIST, [str(listing), str(dst)], 300)
    assert not dst.exists() and _runs(partial_path(dst) / SPILL_DIR)  # killed with runs on disk
    subprocess.run([sys.executable, "-c", _SLOW_LIST, str(listing), str(dst), "resume"], check=True)
    assert not (dst / SPILL_DIR).exists() and not partial_path(dst).exists()
    clean = packdata.convert(listing, tmp_path / "clean.lmdb", label_column="label", progress=False)
    assert clean.skipped == {"duplicate key": 3}
    assert (dst / "skipped.jsonl").read_bytes() == (tmp_path / "clean.lmdb" / "skipped.jsonl").read_bytes()
    ours = [(s["__key__"], s["txt"], s["cls"]) for s in packdata.LMDBDataset(dst)]
    assert ours == [(s["__key__"], s["txt"], s["cls"]) for s in packdata.LMDBDataset(tmp_path / "clean.lmdb")]


def _listing(folder: Path, names: list[str]) -> Path:
    """A list source in ``folder`` of a text file per name (its key), each of class c0 or c1."""
    folder.mkdir(parents=True)
    for name in names:
        (folder / f"{name}.txt").write_text(name)
    listing = folder / "l.csv"
    listing.write_text("path,label\n" + "".join(f"{n}.txt,c{i % 2}\n" for i, n in enumerate(names)), "utf-8")
    return listing


def _pack_and_new(tmp_path: Path, repeat: str | None = None) -> tuple[Path, Path]:
    """A pack of 300 keys and a list of 100 new ones (``repeat`` last, a key of the pack, if given)."""
    pack = tmp_path / "p.lmdb"
    listing = _listing(tmp_path / "a", [f"k{n:03d}" for n in range(300)])
    packdata.convert(listing, pack, label_column="label", progress=False)
    names = [f"k{n:03d}" for n in range(300, 400)] + ([repeat] if repeat else [])
    return pack, _listing(tmp_path / "b", names)


def test_an_append_whose_keys_spill_names_a_repeat_and_leaves_no_spill_done_refused_or_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An append's key set held every key of the pack and the new samples in memory (about 40 B a key); it now
    spills into the append's own folder in the pack (.append-aN.partial), removed once planned, refused or failed."""
    spilled: list[tuple[Path | None, int]] = []

    class SeenKeySet(KeySet):
        def close(self) -> None:
            spilled.append((self._spill, self.runs))
            super().close()

    _tiny_budget(monkeypatch)
    monkeypatch.setattr(combine, "KeySet", SeenKeySet)
    pack, new = _pack_and_new(tmp_path / "refused", repeat="k002")
    before = tree_digest(pack)
    refusal = f"{pack}: the new samples repeat key 'k002', already in the pack. Keys are unique in a pack"
    with pytest.raises(ConfigError, match=f"^{re.escape(refusal)}"):
        packdata.convert(new, pack, label_column="label", append=True, progress=False)
    assert spilled == [(pack / ".append-a1.partial" / SPILL_DIR, spilled[0][1])] and spilled[0][1] >= 5
    assert tree_digest(pack) == before and sorted(os.listdir(pack.parent)) == ["a", "b", "p.lmdb"]

    spilled.clear()
    pack, new = _pack_and_new(tmp_path / "done")
    result = packdata.convert(new, pack, label_column="label", append=True, progress=False)
    assert result.packed == 100 and spilled[0][0] == pack / ".append-a1.partial" / SPILL_DIR and spilled[0][1] >= 6
    assert sorted(s["__key__"] for s in packdata.LMDBDataset(pack)) == [f"k{n:03d}" for n in range(400)]
    assert not any(name.startswith(".") for name in os.listdir(pack))
    assert sorted(os.listdir(pack.parent)) == ["a", "b", "p.lmdb"]
    (pack / "index" / "notes.txt").write_text("mine")  # the next append deletes index/: it fails after planning
    other = _listing(tmp_path / "done" / "c", ["x1"])
    with pytest.raises(PackFormatError, match=re.escape(f"{pack / 'index'}: the index folder an append replaced")):
        packdata.convert(other, pack, label_column="label", append=True, progress=False)
    assert spilled[-1][0] == pack / ".append-a2.partial" / SPILL_DIR and spilled[-1][1] >= 6
    assert not any(name.startswith(".append") for name in os.listdir(pack))


_KILLED_APPEND = """
import os, signal, sys
import packdata
from packdata.pack import keyset
keyset._BUDGET, keyset._MIN_RECENT = 50 * 24 * 4, 8
spill = os.path.join(sys.argv[2], ".append-a1.partial")
def run(self, path, *args, _run=keyset._Run.__init__):
    _run(self, path, *args)
    if str(path).startswith(spill) and path.name == "run-00003":  # the append's key set has spilled 4 runs
        os.kill(os.getpid(), signal.SIGKILL)
keyset._Run.__init__ = run
packdata.convert(sys.argv[1], sys.argv[2], label_column="label", append=True, progress=False)
"""


@pytest.mark.parametrize("resume", [False, True], ids=["again", "resume"])
def test_an_append_killed_with_its_keys_spilled_then_rerun_gives_the_pack_of_an_uninterrupted_one(
    tmp_path: Path, resume: bool
) -> None:
    """Killed while its keys spill into the pack, the pack reads as before; appended again (or resumed), the
    spill is removed and made anew, and the pack equals one appended uninterrupted, with no spill left."""
    pack, new = _pack_and_new(tmp_path)
    clean = tmp_path / "clean.lmdb"
    shutil.copytree(pack, clean)
    packdata.convert(new, clean, label_column="label", append=True, progress=False)
    killed = subprocess.run([sys.executable, "-c", _KILLED_APPEND, str(new), str(pack)], check=False)
    assert killed.returncode == -signal.SIGKILL
    assert len(_runs(pack / ".append-a1.partial" / SPILL_DIR)) == 4  # killed with its runs on disk
    assert sorted(s["__key__"] for s in packdata.LMDBDataset(pack)) == [f"k{n:03d}" for n in range(300)]
    args = ["--resume"] if resume else []
    done = CliRunner().invoke(cli, ["convert", str(new), str(pack), "--append", "--label-column", "label", "-q", *args])
    assert done.exit_code == 0, done.output
    assert not any(name.startswith(".") for name in os.listdir(pack))
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "clean.lmdb", "p.lmdb"]
    ours = [(s["__key__"], s["txt"], s["cls"]) for s in packdata.LMDBDataset(pack)]
    assert ours == [(s["__key__"], s["txt"], s["cls"]) for s in packdata.LMDBDataset(clean)]


def _damage_message(run: Path, problem: str) -> str:
    return re.escape(f"{run}: a run of keys spilled to disk {problem}. It is scratch this run wrote, damaged since")


@pytest.mark.parametrize("damage", ["cut", "zeroed"])
def test_a_spilled_run_damaged_on_disk_is_named_never_read_as_other_keys(tmp_path: Path, damage: str) -> None:
    """A run file cut short raised a bare OSError where a lookup read past its end (and answered where it did
    not); one whose keys were overwritten answered lookups from other bytes. Both are a PackFormatError naming it."""
    keys = KeySet(4, spill=tmp_path / "spill", budget=_SPILL_EVERY * 24 * 4)
    for n in range(300):
        keys.add(f"k{n}", n)
    run = next((tmp_path / "spill").rglob("run-00000"))
    if damage == "cut":
        os.truncate(run, run.stat().st_size - 13)
        problem = f"is {run.stat().st_size} bytes, {run.stat().st_size + 13} were written"
    else:
        with open(run, "r+b") as f:
            f.write(bytes(16))  # the first two digests' high halves: the page's first no longer the one held
        problem = "holds other bytes than were written (its keys are out of order)"
    with pytest.raises(PackFormatError, match=_damage_message(run, problem)):
        keys.add("k3", 9)  # in the first run
    keys.close()


def test_a_list_conversion_whose_spilled_run_is_cut_short_stops_naming_it_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cut short while the walk goes on, the run is named, the partial kept; a resume spills anew and publishes
    the pack an uninterrupted run makes."""
    _tiny_budget(monkeypatch)
    cut: list[tuple[Path, int]] = []

    class CutKeySet(KeySet):
        def _spill_run(self) -> None:
            super()._spill_run()
            if self.runs == 4 and not cut:  # once: the first run of the first walk, cut to 100 bytes
                run = next(Path(self._spill or "").rglob("run-00000"))
                cut.append((run, run.stat().st_size))
                os.truncate(run, 100)

    monkeypatch.setattr(lists, "KeySet", CutKeySet)
    listing = _list_with_repeats(tmp_path, 600)
    dst = tmp_path / "out.lmdb"
    with pytest.raises(PackFormatError) as caught:
        packdata.convert(listing, dst, label_column="label", progress=False)
    [(run, written)] = cut
    assert run.parent.parent == partial_path(dst) / SPILL_DIR and partial_path(dst).exists()
    assert str(caught.value) == (
        f"{run}: a run of keys spilled to disk is 100 bytes, {written} were written. It is scratch this run wrote, "
        "damaged since (check that disk): run again (a conversion: resume=True continues it); the keys spill anew"
    )
    result = packdata.convert(listing, dst, label_column="label", progress=False, resume=True)
    assert result.skipped == {"duplicate key": 3} and not partial_path(dst).exists()
    assert sorted(s["__key__"] for s in packdata.LMDBDataset(dst)) == [f"{i:05d}" for i in range(600)]


def test_a_resume_whose_partial_holds_a_file_named_keys_spill_removes_it_and_publishes(tmp_path: Path) -> None:
    """A plain file at the partial pack's keys.spill (a folder there is emptied as a resume starts) stopped the
    resume with a bare NotADirectoryError from rmtree. The file is removed now, and the pack is published."""
    src = tmp_path / "src"
    src.mkdir()
    for n in range(6):
        (src / f"{n}.txt").write_text("x" * (n + 1), encoding="utf-8")
    dst = tmp_path / "out.lmdb"
    killed = subprocess.run([sys.executable, "-c", KILLED_AT_SECOND_CHECKPOINT, str(src), str(dst)], check=False)
    assert killed.returncode == -9 and (partial_path(dst) / "progress.json").is_file()
    (partial_path(dst) / SPILL_DIR).write_text("not a folder", encoding="utf-8")
    result = packdata.convert(src, dst, shard_samples=1, workers=1, progress=False, resume=True)
    assert result.resumed and result.packed == 6
    assert not os.path.lexists(partial_path(dst)) and not os.path.lexists(dst / SPILL_DIR)
    assert sorted(packdata.LMDBDataset(dst).keys) == [f"{n}.txt" for n in range(6)]
