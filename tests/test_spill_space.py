"""A disk that fills while keys spill past the memory budget (or a shard starts): every writer names the disk,
as a stage does.

Each test mounts a real small tmpfs (as root; skipped otherwise), fills it with
a real file, and lets the writer's key set spill onto it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import tree_digest

import packdata
from packdata.cli import main as cli
from packdata.conversion import destination
from packdata.conversion.destination import SPILL_DIR, partial_path
from packdata.pack import keyset

_SPILL_EVERY = 8
"""Keys the arrays hold before they spill: each run is one page of the tmpfs."""

_RUN = r"keys\.spill/keys-[^/]+/run-\d{5}"
_RERUN_HINT = "Free space on that disk, then run again (a conversion: --resume continues it)"


_START_ROOM = 32 << 10
"""Free bytes a conversion or merge needs to start, in these tests (1 MiB else: 250 runs of a page to fill it)."""


def _tiny_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keyset, "_BUDGET", _SPILL_EVERY * 24 * 4)  # a quarter of it holds _SPILL_EVERY keys
    monkeypatch.setattr(keyset, "_MIN_RECENT", _SPILL_EVERY)
    monkeypatch.setattr(destination, "_MIN_FREE_BYTES", _START_ROOM)


def _fill(disk: Path, leave: int = 0) -> Path:
    """Fill ``disk`` with a file until ``leave`` bytes are free (0: until the disk refuses a write)."""
    filler = disk / "filler"
    with open(filler, "wb") as f:
        if leave:
            st = os.statvfs(disk)
            f.write(bytes(st.f_bavail * st.f_frsize - leave))
        else:
            with pytest.raises(OSError, match="No space left on device"):
                while True:
                    f.write(bytes(1 << 16))
                    f.flush()
    return filler


def _folder(root: Path, names: range, cls: str = "c") -> Path:
    (root / cls).mkdir(parents=True)
    for n in names:
        (root / cls / f"{n:05d}.txt").write_text(f"t{n}")
    return root


def _refused(args: list[str], pattern: str) -> None:
    """The command ``args`` exits 1 with the one line ``pattern`` matches."""
    failed = CliRunner().invoke(cli, args)
    assert failed.exit_code == 1 and re.fullmatch(pattern, failed.output), failed.output


def _samples(pack: Path) -> list[object]:
    """Every sample of ``pack`` in pack order: its fields, or (key, stored bytes, label)."""
    ds = packdata.LMDBDataset(pack, decode="bytes")
    return [sorted(s.items()) if isinstance(s, dict) else (ds.keys[i], *s) for i, s in enumerate(ds)]


def test_a_pack_writer_whose_keys_spill_onto_a_full_disk_names_the_disk(
    tmp_path: Path, tmpfs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PackWriter's keys spilled onto a full disk as a bare OSError (ENOSPC). It is now the CapacityError a full
    stage gives: the run's file, the mount, its type, size and free space, and that a writer must start again;
    the writer's partial pack is removed, and once space is freed the pack is written whole."""
    _tiny_budget(monkeypatch)
    disk = tmpfs("8m")
    dst = disk / "w.lmdb"
    samples = [{"__key__": f"k{n:04d}", "txt": f"t{n}"} for n in range(200)]
    with pytest.raises(packdata.CapacityError) as caught, packdata.PackWriter(dst) as writer:
        for sample in samples[:4]:  # under the budget: nothing spilled yet
            writer.write(sample)
        filler = _fill(disk)
        for sample in samples[4:]:
            writer.write(sample)
    pattern = (
        rf"{re.escape(str(partial_path(dst)))}/{_RUN}: no space left on {re.escape(str(disk))} "
        rf"\(tmpfs of 8\.0 MiB, [0-9.]+ [KM]?i?B free\) while writing {_RUN} \(keys spilled past the memory "
        r"budget\)\. Free space on that disk, then write the pack again: a PackWriter publishes nothing it did not "
        r"finish"
    )
    assert re.fullmatch(pattern, str(caught.value)), str(caught.value)
    assert sorted(os.listdir(disk)) == ["filler"]
    filler.unlink()
    packdata.write_pack(samples, dst, progress=False)
    assert [(s["__key__"], s["txt"]) for s in packdata.LMDBDataset(dst)] == [(s["__key__"], s["txt"]) for s in samples]


def test_a_list_conversion_whose_keys_spill_onto_a_full_disk_names_it_and_resumes_to_the_clean_pack(
    tmp_path: Path, tmpfs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A list's walk spilling keys onto a full disk said 'PARTIAL: the destination disk is full', naming neither
    the disk nor the file. It now names both as a stage does; freed, --resume publishes the uninterrupted pack."""
    _tiny_budget(monkeypatch)
    src = _folder(tmp_path / "src", range(1200))
    listing = src / "l.csv"
    listing.write_text("path,label\n" + "".join(f"c/{n:05d}.txt,c{n % 3}\n" for n in range(1200)), "utf-8")
    disk = tmpfs("4m")
    filler = _fill(disk, leave=_START_ROOM + (256 << 10))  # room for the shard to start, not for 150 runs of a page
    dst = disk / "out.lmdb"
    args = ["convert", str(listing), str(dst), "--label-column", "label", "-q"]
    pattern = (
        rf"Error: {re.escape(str(partial_path(dst)))}/{_RUN}: no space left on {re.escape(str(disk))} "
        rf"\(tmpfs of 4\.0 MiB, [0-9.]+ [KM]?i?B free\) while writing {_RUN} \(keys spilled past the memory "
        rf"budget\)\. {re.escape(_RERUN_HINT)}\n"
    )
    _refused(args, pattern)
    assert not dst.exists() and partial_path(dst).is_dir()
    filler.unlink()
    resumed = CliRunner().invoke(cli, [*args, "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert not (dst / SPILL_DIR).exists() and not partial_path(dst).exists()
    clean = tmp_path / "clean.lmdb"
    packdata.convert(listing, clean, label_column="label", progress=False)
    assert _samples(dst) == _samples(clean) and len(_samples(dst)) == 1200


def test_an_append_whose_keys_spill_onto_a_full_disk_names_it_and_resumes_to_the_clean_append(
    tmp_path: Path, tmpfs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An append's keys (the pack's and the new samples') spilled onto a full disk as a bare OSError. It now
    names the disk, the pack is as it was, and once space is freed --append --resume gives the append a run
    with room gives."""
    _tiny_budget(monkeypatch)
    disk = tmpfs("8m")
    pack = disk / "p.lmdb"
    packdata.convert(_folder(tmp_path / "a", range(600)), pack, progress=False)
    clean = tmp_path / "clean.lmdb"
    shutil.copytree(pack, clean)
    new = _folder(tmp_path / "b", range(600, 700), cls="d")
    before = tree_digest(pack)
    filler = _fill(disk, leave=_START_ROOM + (160 << 10))  # room to convert the new samples, not for 87 runs
    args = ["convert", str(new), str(pack), "--append", "-q"]
    staging = re.escape(str(pack / ".append-a1.partial"))
    pattern = (
        rf"Error: {staging}/{_RUN}: no space left on {re.escape(str(disk))} \(tmpfs of 8\.0 MiB, [0-9.]+ [KM]?i?B "
        rf"free\) while writing {_RUN} \(keys spilled past the memory budget\)\. The pack is as it was: free space on "
        r"that disk, then append again with --resume\n"
    )
    _refused(args, pattern)
    assert tree_digest(pack) == before
    filler.unlink()
    resumed = CliRunner().invoke(cli, [*args, "--resume"])
    assert resumed.exit_code == 0, resumed.output
    packdata.convert(new, clean, append=True, progress=False)
    assert _samples(pack) == _samples(clean) and len(_samples(pack)) == 700
    assert sorted(os.listdir(disk)) == ["p.lmdb"]


def test_a_merge_whose_keys_spill_onto_a_full_disk_names_it_and_leaves_nothing(
    tmp_path: Path, tmpfs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A merge whose keys spilled onto a full disk said 'the destination disk filled while merging', naming
    neither the disk nor its size. It now names the mount, its type, size and free space."""
    _tiny_budget(monkeypatch)
    a = tmp_path / "a.lmdb"
    b = tmp_path / "b.lmdb"
    packdata.convert(_folder(tmp_path / "a", range(400)), a, progress=False)
    packdata.convert(_folder(tmp_path / "b", range(400, 600), cls="d"), b, progress=False)
    disk = tmpfs("4m")
    _fill(disk, leave=_START_ROOM + (64 << 10))
    out = disk / "m.lmdb"
    pattern = (
        rf"Error: {re.escape(str(out))}: no space left on {re.escape(str(disk))} \(tmpfs of 4\.0 MiB, [0-9.]+ "
        r"[KM]?i?B free\) while merging: nothing was published\. Free space on its disk \(shards are copied there "
        r"from another disk\), then merge again\n"
    )
    _refused(["merge", str(a), str(b), "-o", str(out)], pattern)
    assert sorted(os.listdir(disk)) == ["filler"]


def test_a_conversion_without_room_for_a_shards_lock_file_names_the_disk_and_resumes(
    tmp_path: Path, tmpfs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An LMDB shard's lock file, allocated before LMDB maps it, said 'LOCK: the destination disk is full (No
    space left on device). Free space and rerun' on a full disk, naming neither the disk nor its size. It is now
    named as a full stage is; once space is freed, --resume publishes what an uninterrupted run does."""
    monkeypatch.setattr(destination, "_MIN_FREE_BYTES", _START_ROOM)
    src = _folder(tmp_path / "src", range(20))
    disk = tmpfs("4m")
    filler = _fill(disk, leave=_START_ROOM + (64 << 10))  # room to start, not for a lock file of 135 KB
    dst = disk / "out.lmdb"
    args = ["convert", str(src), str(dst), "-q"]
    lock = "shard-00000.lmdb/lock.mdb"
    pattern = (
        rf"Error: {re.escape(str(partial_path(dst) / lock))}: no space left on {re.escape(str(disk))} \(tmpfs of "
        rf"4\.0 MiB, [0-9.]+ [KM]?i?B free\) while writing {re.escape(lock)} \(an LMDB shard's lock file, allocated "
        rf"before LMDB maps it\)\. {re.escape(_RERUN_HINT)}\n"
    )
    _refused(args, pattern)
    filler.unlink()
    resumed = CliRunner().invoke(cli, [*args, "--resume"])
    assert resumed.exit_code == 0, resumed.output
    packdata.convert(src, tmp_path / "clean.lmdb", progress=False)
    assert _samples(dst) == _samples(tmp_path / "clean.lmdb") and len(_samples(dst)) == 20


def test_a_tfrecord_shard_begun_on_a_full_disk_names_the_disk(tmp_path: Path, tmpfs) -> None:
    """A TFRecord shard begun on a full disk said 'SHARD: the destination disk is full (No space left on device).
    Free space and rerun', naming neither the disk nor its size; a Ray task raising it then stopped the conversion
    with an EngineError instead of the named full disk. It is now named as a full LMDB shard's lock file is."""
    from packdata.formats.tfrecord_writer import TFRecordShardWriter

    disk = tmpfs("1m")
    _fill(disk)
    shard = disk / "part-00000.tfrecord"
    pattern = (
        rf"{re.escape(str(shard))}: no space left on {re.escape(str(disk))} \(tmpfs of 1\.0 MiB, 0 B free\) while "
        r"writing part-00000\.tfrecord \(a new TFRecord shard, its index or record table\)\. "
        rf"{re.escape(_RERUN_HINT.replace('--resume', 'resume=True'))}$"
    )
    with pytest.raises(packdata.CapacityError, match=pattern):
        TFRecordShardWriter(shard)


@pytest.mark.parametrize("which", ["index", "record table"])
def test_a_tfrecord_shard_whose_index_or_record_table_cannot_be_written_names_that_file(
    tmp_path: Path, which: str
) -> None:
    """A new TFRecord shard whose offsets index or record table could not be created (here a folder in its
    place, a real EISDIR) named the shard file, 'SHARD: cannot write the destination (Is a directory)', which was
    written; it now names the file that failed."""
    from packdata.formats.tfrecord_tables import index_path, payload_path
    from packdata.formats.tfrecord_writer import TFRecordShardWriter

    shard = tmp_path / "part-00000.tfrecord"
    failing = index_path(shard) if which == "index" else payload_path(shard)
    failing.mkdir()
    with pytest.raises(packdata.ConfigError) as caught:
        TFRecordShardWriter(shard)
    assert str(caught.value) == (
        f"{failing}: cannot write the destination (Is a directory). Choose a destination on a writable local or "
        "network file system"
    )


def _out_of_inodes(tmpfs) -> Path:
    """A real 4 MiB tmpfs with room for its root and one file (a conversion's lock file): bytes free, no inodes."""
    return tmpfs("4m", options="nr_inodes=2")


def _partial_refused(disk: Path, dst: Path, hint: str) -> str:
    """The one line a writer that cannot make the partial pack of ``dst`` on ``disk`` (out of inodes) gives."""
    return (
        rf"{re.escape(str(partial_path(dst)))}: no space left on {re.escape(str(disk))} \(tmpfs of 4\.0 MiB, "
        rf"[0-9.]+ [KM]?i?B free, no inodes free\) while writing {re.escape(dst.name)} \(making its partial pack's "
        rf"folder\){hint}"
    )


def test_a_conversion_that_cannot_make_its_partial_pack_names_the_full_disk(tmp_path: Path, tmpfs) -> None:
    """A conversion whose partial pack's folder a full disk refused said 'PARTIAL: the destination disk is full
    (No space left on device). Free space and rerun', naming neither the disk nor its size. It is now named as a
    full shard is, with the resume hint; once there is room, --resume publishes the pack."""
    src = _folder(tmp_path / "src", range(5))
    disk = _out_of_inodes(tmpfs)
    dst = disk / "out.lmdb"
    args = ["convert", str(src), str(dst), "-q"]
    hint = r"\. Free space on that disk, then convert again with --resume\n"
    _refused(args, f"Error: {_partial_refused(disk, dst, hint)}")
    assert not os.path.lexists(partial_path(dst)) and not dst.exists()


def test_a_pack_writer_that_cannot_make_its_partial_pack_names_the_full_disk(tmp_path: Path, tmpfs) -> None:
    """PackWriter's partial pack refused by a full disk said 'PARTIAL: the destination disk is full'; it now
    names the disk and that a PackWriter publishes nothing it did not finish."""
    disk = _out_of_inodes(tmpfs)
    dst = disk / "w.lmdb"
    hint = r"\. Free space on that disk, then write the pack again: a PackWriter publishes nothing it did not finish"
    with pytest.raises(packdata.CapacityError) as caught:
        packdata.PackWriter(dst)
    assert re.fullmatch(_partial_refused(disk, dst, hint), str(caught.value)), str(caught.value)


def test_a_merge_that_cannot_make_its_partial_pack_names_the_full_disk(tmp_path: Path, tmpfs) -> None:
    """A merge whose partial pack a full disk refused said 'PARTIAL: the destination disk is full'; it now names
    the disk and that nothing was published."""
    a, b = tmp_path / "a.lmdb", tmp_path / "b.lmdb"
    packdata.convert(_folder(tmp_path / "a", range(3)), a, progress=False)
    packdata.convert(_folder(tmp_path / "b", range(3, 6), cls="d"), b, progress=False)
    disk = _out_of_inodes(tmpfs)
    out = disk / "m.lmdb"
    hint = (
        r": nothing was published\. Free space on its disk \(shards are copied there from another disk\), then "
        r"merge again\n"
    )
    _refused(["merge", str(a), str(b), "-o", str(out)], f"Error: {_partial_refused(disk, out, hint)}")
    assert not out.exists()


def test_a_conversion_onto_a_full_disk_names_it_before_it_starts(tmp_path: Path, tmpfs) -> None:
    """A destination disk without the room to start said 'the destination disk is full: 0 bytes free, at least
    1048576 needed to start', naming no disk; it now names it as every full disk is."""
    src = _folder(tmp_path / "src", range(2))
    disk = tmpfs("1m")
    _fill(disk)
    dst = disk / "out.lmdb"
    pattern = (
        rf"Error: {re.escape(str(disk))}: no space left on {re.escape(str(disk))} \(tmpfs of 1\.0 MiB, 0 B free\) "
        r"to start a pack there \(1\.0 MiB needed\)\. Free space or choose another destination\n"
    )
    _refused(["convert", str(src), str(dst), "-q"], pattern)


def test_an_lmdb_shard_that_fills_the_disk_names_it(tmpfs) -> None:
    """LMDB reports the short write of a commit on a full disk as EIO (a write with no room at all as ENOSPC): the
    shard said 'SHARD: cannot write the shard (mdb_txn_commit: Input/output error); 0.0 MB free on its disk. Free
    space on the destination disk and rerun with --resume' (its own units, a CLI flag in the library). It is now
    named as a full lock file is."""
    from packdata.formats.lmdb_writer import LMDBShardWriter
    from packdata.pack.records import Sample

    disk = tmpfs("1m")
    _fill(disk, leave=300 << 10)  # the lock file (135 KB) and a record of 100 KB fit, not two records more
    shard = disk / "shard-00000.lmdb"
    writer = LMDBShardWriter(shard)
    pattern = (
        rf"{re.escape(str(shard / 'data.mdb'))}: no space left on {re.escape(str(disk))} \(tmpfs of 1\.0 MiB, "
        r"[0-9.]+ [KM]?i?B free\) while writing shard-00000\.lmdb/data\.mdb \(LMDB: mdb_txn_commit: "
        rf"(Input/output error|No space left on device)\)\. {re.escape(_RERUN_HINT.replace('--resume', 'resume=True'))}"
    )
    with pytest.raises(packdata.CapacityError) as caught:
        for i in range(3):
            writer.write([(i, Sample(key=f"k{i}", label=0, data=bytes(100_000)))])
    assert re.fullmatch(pattern, str(caught.value)), str(caught.value)


def test_a_conversion_whose_lock_file_a_full_disk_refuses_names_the_disk(tmp_path: Path, tmpfs) -> None:
    """The lock file beside the destination, refused by a full disk, said 'LOCK: cannot create the lock file: No
    space left on device. Choose a destination on a writable file system', as if it were read-only."""
    src = _folder(tmp_path / "src", range(2))
    disk = tmpfs("4m", options="nr_inodes=1")  # its root alone
    dst = disk / "out.lmdb"
    pattern = (
        rf"Error: {re.escape(str(disk / '.out.lmdb.lock'))}: no space left on {re.escape(str(disk))} \(tmpfs of "
        r"4\.0 MiB, 4\.0 MiB free, no inodes free\) while writing \.out\.lmdb\.lock \(the lock file of packdata "
        rf"convert, local engine\)\. {re.escape(_RERUN_HINT)}\n"
    )
    _refused(["convert", str(src), str(dst), "-q"], pattern)
    assert os.listdir(disk) == []


_KILLED_AT_THE_MANIFEST = """
import importlib, os, signal, sys
import packdata
local = importlib.import_module("packdata.conversion.local")
local.write_manifest = lambda *args: os.kill(os.getpid(), signal.SIGKILL)  # in this child only
packdata.convert(sys.argv[1], sys.argv[2], progress=False)
"""


def test_a_manifest_that_a_full_disk_refuses_names_the_disk_and_the_partial_resumes(tmp_path: Path, tmpfs) -> None:
    """A full disk met writing the manifest (or the last checkpoint) of a local conversion escaped as a bare
    OSError ('[Errno 28] No space left on device', no file): packer.finish ran past the handler that names a full
    disk, and atomic_write's write named no file. It is now the named full disk, nothing looks published, and a
    resume once there is room publishes the pack a first run gives.

    The resume's start check wants 1 MiB free, so the disk is full of files rather than bytes: a conversion is
    killed (in a child) as it is about to write the manifest, every shard renamed and the last checkpoint saved;
    the tmpfs's inodes are then used up, and the resume's first new file is the manifest's temporary."""
    src = _folder(tmp_path / "src", range(12))
    first = packdata.convert(src, tmp_path / "first.tfrecord", progress=False)
    disk = tmpfs("4m", options="nr_inodes=64")
    dst = disk / "out.tfrecord"
    killed = subprocess.run([sys.executable, "-c", _KILLED_AT_THE_MANIFEST, str(src), str(dst)], capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
    fillers = disk / "fillers"
    fillers.mkdir()
    with pytest.raises(OSError, match="No space left on device"):
        for n in range(64):
            (fillers / str(n)).touch()
    partial = partial_path(dst)
    with pytest.raises(packdata.CapacityError) as caught:
        packdata.convert(src, dst, resume=True, progress=False)
    pattern = (
        rf"{re.escape(str(partial / '.manifest.json.tmp'))}: no space left on {re.escape(str(disk))} \(tmpfs of "
        r"4\.0 MiB, [0-9.]+ [KM]?i?B free, no inodes free\) while writing manifest\.json of the partial pack\. Free "
        r"space on that disk, then convert again with resume=True"
    )
    assert re.fullmatch(pattern, str(caught.value)), str(caught.value)
    assert not dst.exists() and not (partial / "manifest.json").exists()  # nothing that looks whole
    assert (partial / "progress.json").is_file()
    shutil.rmtree(fillers)
    resumed = packdata.convert(src, dst, resume=True, progress=False)
    assert resumed.resumed and resumed.packed_before == 12 and not partial.exists()
    assert list(packdata.TFRecordDataset(dst)) == list(packdata.TFRecordDataset(first.pack))


def test_an_atomic_write_that_a_full_disk_refuses_names_its_file(tmpfs) -> None:
    """atomic_write (manifests, checkpoints) let a write's ENOSPC escape naming no file, so a caller that names a
    full disk by the file that met it named its folder instead; it now names the temporary file it was writing
    (shown as the file it becomes), and removes it."""
    from packdata.pack.files import atomic_write

    disk = tmpfs("1m")
    _fill(disk)
    with pytest.raises(OSError, match="No space left on device") as caught:
        atomic_write(disk / "manifest.json", bytes(10_000))
    assert caught.value.filename == str(disk / ".manifest.json.tmp")
    assert sorted(p.name for p in disk.iterdir()) == ["filler"]


_APPEND_KILLED_AT_THE_MANIFEST = """
import os, signal, sys
from packdata.conversion import append
append.write_manifest = lambda *args: os.kill(os.getpid(), signal.SIGKILL)  # in this child only
append.append_pack(sys.argv[1], sys.argv[2])
"""


def test_an_append_whose_manifest_a_full_disk_refuses_names_the_disk_and_resumes(tmp_path: Path, tmpfs) -> None:
    """An append whose new manifest (the step that makes it take effect) a full disk refused escaped as a bare
    OSError. It is now the named full disk, the pack reads as it was, and once there is room the plan resumes
    to the pack a clean append gives.

    The append is killed (in a child) as it is about to write the manifest, its plan written and every file
    moved; the tmpfs's inodes are then used up, so the resume's first new file is the manifest's temporary."""
    from packdata.conversion.append import append_pack

    disk = tmpfs("4m", options="nr_inodes=96")
    pack, new = disk / "p.lmdb", disk / "new.lmdb"
    packdata.convert(_folder(tmp_path / "a", range(20)), pack, progress=False)
    packdata.convert(_folder(tmp_path / "b", range(20, 30), cls="d"), new, progress=False)
    clean = tmp_path / "clean.lmdb"
    packdata.convert(tmp_path / "a", clean, progress=False)
    packdata.convert(tmp_path / "b", clean, append=True, progress=False)
    manifest = (pack / "manifest.json").read_bytes()
    killed = subprocess.run([sys.executable, "-c", _APPEND_KILLED_AT_THE_MANIFEST, str(pack), str(new)])
    assert killed.returncode == -signal.SIGKILL
    fillers = disk / "fillers"
    fillers.mkdir()
    with pytest.raises(OSError, match="No space left on device"):
        for n in range(96):
            (fillers / str(n)).touch()
    with pytest.raises(packdata.CapacityError) as caught:
        append_pack(pack, new, resume=True)
    pattern = (
        rf"{re.escape(str(pack / '.manifest.json.tmp'))}: no space left on {re.escape(str(disk))} \(tmpfs of "
        r"4\.0 MiB, [0-9.]+ [KM]?i?B free, no inodes free\) while writing manifest\.json of the pack\. The pack is "
        r"as it was: free space on that disk, then append again with resume=True"
    )
    assert re.fullmatch(pattern, str(caught.value)), str(caught.value)
    assert (pack / "manifest.json").read_bytes() == manifest and not (pack / ".manifest.json.tmp").exists()
    assert len(_samples(pack)) == 20
    shutil.rmtree(fillers)
    append_pack(pack, new, resume=True)
    assert _samples(pack) == _samples(clean) and len(_samples(pack)) == 30
    assert not new.exists() and not [name for name in os.listdir(pack) if name.startswith(".append")]
