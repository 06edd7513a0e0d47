"""Hostile packs against every command and reader: one ``Error:`` line, and nothing around the pack touched.

Each case copies a real small pack (with a ``victim/`` folder beside it) into
the test's own folder, makes it hostile (:mod:`faults.hostile`), runs one
command through the real CLI or opens one reader, and compares a snapshot of
the tree around the pack before and after.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from faults.hostile import (
    MALFORMED,
    PATH_CASES,
    PLANTED,
    build_pack,
    opens_of,
    rewrite_manifest,
    snapshot,
    symlink_out_of_shard,
    web_app_folder,
)
from packdata.cli import main as cli_main
from packdata.errors import ConfigError, PackdataError
from packdata.pack.manifest import read_manifest
from packdata.reading.datasets import LMDBDataset
from packdata.reading.streaming import TFRecordDataset
from packdata.reading.tfrecord_indexed import TFRecordIndexedDataset

FORMATS = ("lmdb", "tfrecord")
COMMANDS = ("info", "verify", "stage", "convert-overwrite", "readers")


@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One converted pack per format, copied by each test (converting per test would be slow)."""
    return {fmt: build_pack(tmp_path_factory.mktemp(f"template-{fmt}"), fmt).parent.parent for fmt in FORMATS}


def _pack(templates: dict[str, Path], tmp_path: Path, fmt: str) -> Path:
    for name in ("src", "packs"):
        shutil.copytree(templates[fmt] / name, tmp_path / name, symlinks=True)
    return tmp_path / "packs" / f"train.{fmt}"


def _cli(*args: str) -> Result:
    return CliRunner().invoke(cli_main, list(args))


def _one_error_line(result: Result, *expected: str) -> str:
    assert result.exit_code == 1, result.output
    assert not isinstance(result.exception, SystemExit) or result.exception.code == 1
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert "Traceback" not in result.output
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def _run(command: str, pack: Path, tmp_path: Path, fmt: str) -> Callable[[], None] | Result:
    if command == "info":
        return _cli("info", str(pack))
    if command == "verify":
        return _cli("verify", "-q", str(pack))
    if command == "stage":
        return _cli("stage", str(pack), "--to", str(tmp_path / "fast"), "-q")
    if command == "convert-overwrite":
        return _cli("convert", str(tmp_path / "src"), str(pack), "--overwrite", "-q", "--format", fmt)
    raise AssertionError(command)


def _readers(fmt: str) -> list[Callable[[Path], object]]:
    return [LMDBDataset] if fmt == "lmdb" else [TFRecordDataset, TFRecordIndexedDataset]


def _check_refused(command: str, pack: Path, tmp_path: Path, fmt: str, expected: str) -> None:
    around = snapshot(pack.parent)
    if command == "readers":
        for reader in _readers(fmt):
            with pytest.raises(PackdataError) as info:
                reader(pack)
            message = str(info.value)
            assert "\n" not in message and expected in message, message
    else:
        result = _run(command, pack, tmp_path, fmt)
        assert isinstance(result, Result)
        _one_error_line(result, expected)
    assert snapshot(pack.parent) == around
    assert not (tmp_path / "fast").exists() or not any((tmp_path / "fast").iterdir())


_PATH_EXPECTED = {
    "dotdot": "shards[0].file",
    "climb": "shards[0].file",
    "absolute": "shards[0].file",
    "nul": "shards[0].file",
    "separator": "shards[0].file",
    "dot": "shards[0].file",
    "staged-forgery": "shards[0].file",
    "index-dotdot": "index.dir",
    "report-dotdot": "skipped.report",
    "symlinked-shard": "symlink leading out",
    "symlinked-index": "symlink leading out",
    "previous-shard": "'index.previous' should name the index folder an append replaced, not a shard",
    "previous-index": "'index.previous' should name the index folder an append replaced, not the current index",
    "previous-manifest": "'index.previous' should name the index folder an append replaced, not the manifest",
    "index-shard": "'index.dir' should name the sample index folder, not a shard",
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", sorted(PATH_CASES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_hostile_path_is_refused_and_nothing_is_touched(
    templates: dict[str, Path], tmp_path: Path, fmt: str, case: str, command: str
) -> None:
    pack = _pack(templates, tmp_path, fmt)
    PATH_CASES[case](pack, fmt)
    _check_refused(command, pack, tmp_path, fmt, _PATH_EXPECTED[case])


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", sorted(MALFORMED))
@pytest.mark.parametrize("fmt", FORMATS)
def test_malformed_manifest_gives_one_line(
    templates: dict[str, Path], tmp_path: Path, fmt: str, case: str, command: str
) -> None:
    pack = _pack(templates, tmp_path, fmt)
    apply, expected = MALFORMED[case]
    apply(pack, fmt)
    _check_refused(command, pack, tmp_path, fmt, expected)


@pytest.mark.parametrize("command", COMMANDS)
def test_symlink_leading_out_of_an_lmdb_shard_is_refused(
    templates: dict[str, Path], tmp_path: Path, command: str
) -> None:
    pack = _pack(templates, tmp_path, "lmdb")
    symlink_out_of_shard(pack, "lmdb")
    _check_refused(command, pack, tmp_path, "lmdb", "planted")


def test_stage_refuses_a_symlinked_tfrecord_side_file(templates: dict[str, Path], tmp_path: Path) -> None:
    pack = _pack(templates, tmp_path, "tfrecord")
    link = symlink_out_of_shard(pack, "tfrecord")
    around = snapshot(pack.parent)
    result = _cli("stage", str(pack), "--to", str(tmp_path / "fast"), "-q")
    _one_error_line(result, link.name, "not a regular file")
    assert snapshot(pack.parent) == around


@pytest.mark.parametrize("side", [".tfindex", ".tfpayload"])
def test_readers_never_follow_a_tfrecord_side_file_out_of_the_pack(
    templates: dict[str, Path], tmp_path: Path, side: str
) -> None:
    """A shard's .tfindex or .tfpayload is a file beside it, outside what the manifest names: the readers and
    verify followed a symlink in its place out of the pack, and a .tfindex's target was quoted in the error
    ('invalid literal for int() with base 10: b'do'', the first word of the victim file). A .tfindex link is
    refused by name; a .tfpayload link is no table (the .tfindex is read instead), and verify names it."""
    pack = _pack(templates, tmp_path, "tfrecord")
    shard = pack / read_manifest(pack).shards[0].file
    clean = [TFRecordIndexedDataset(pack, decode="bytes")[i] for i in range(6)]
    link = shard.with_suffix(side)
    secret = pack.parent / "victim" / "secret.txt"
    if side == ".tfpayload":  # a table the shard's own would be, kept outside the pack
        secret.write_bytes(link.read_bytes())
    else:  # without its record table (a pack of another tool) the shard's records come from its .tfindex
        shard.with_suffix(".tfpayload").unlink()
    link.unlink()
    link.symlink_to(os.path.relpath(secret, pack))
    with opens_of(secret) as opens:
        if side == ".tfindex":
            for read in (
                lambda: TFRecordIndexedDataset(pack, decode="bytes"),
                lambda: list(TFRecordDataset(pack, decode="bytes")),
            ):
                with pytest.raises(PackdataError, match=re.escape(str(link)) + ".*is a symlink") as caught:
                    read()
                assert "do not touch" not in str(caught.value) and "b'do'" not in str(caught.value)
        else:
            assert [TFRecordIndexedDataset(pack, decode="bytes")[i] for i in range(6)] == clean
            assert sorted(TFRecordDataset(pack, decode="bytes", shuffle=False)) == sorted(clean)
        _one_error_line(_cli("verify", "-q", str(pack)), link.name)
        assert opens() == 0


# --------------------------------------------------------------------------- staging copies only the pack's files


def _own_files(pack: Path) -> set[str]:
    return {os.path.relpath(p, pack) for p in pack.rglob("*")}


@pytest.mark.parametrize("plant", sorted(PLANTED))
@pytest.mark.parametrize("fmt", FORMATS)
def test_stage_copies_only_the_packs_own_regular_files(
    templates: dict[str, Path], tmp_path: Path, fmt: str, plant: str
) -> None:
    pack = _pack(templates, tmp_path, fmt)
    clean = _own_files(pack)
    planted = PLANTED[plant](pack, fmt)
    os.chmod(pack / read_manifest(pack).shards[0].file if fmt == "tfrecord" else pack / "index" / "keys.utf8", 0o640)
    around = snapshot(pack.parent)
    result = _cli("stage", str(pack), "--to", str(tmp_path / "fast"), "-q")
    assert result.exit_code == 0, result.output
    staged = tmp_path / "fast" / pack.name
    copied = {
        p
        for p in _own_files(staged)
        if p not in ("staged.json", ".stage.lock", ".readers.lock") and not p.startswith(".manifest")
    }
    assert copied == clean, f"{planted.name} was copied" if copied > clean else copied ^ clean
    for rel in copied:
        st = (staged / rel).lstat()
        assert stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode), rel
        if stat.S_ISREG(st.st_mode) and rel != "manifest.json":
            assert stat.S_IMODE(st.st_mode) == stat.S_IMODE((pack / rel).stat().st_mode), rel
    assert snapshot(pack.parent) == around
    reader = LMDBDataset(staged) if fmt == "lmdb" else TFRecordIndexedDataset(staged)
    assert len(reader) == 6  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["fifo", "device", "symlink-out", "folder"])
def test_a_planted_readers_lock_is_never_followed_or_waited_on(
    templates: dict[str, Path], tmp_path: Path, fmt: str, kind: str
) -> None:
    """A stranger's pack with ``.readers.lock`` as a FIFO, a device node, a link to a file outside or a folder.

    A dataset reads it unlocked: it must not hang on the FIFO, open the FIFO or
    the device at all (opening a device can act on it), lock or create anything
    through the link, or fail on the folder. Eviction keeps such a copy, naming
    what the lock is, and opens nothing either.
    """
    import fcntl

    from packdata.pack.lock import exclude_readers

    if kind == "device" and os.geteuid() != 0:
        pytest.skip("making a device node needs root")
    pack = _pack(templates, tmp_path, fmt)
    outside = tmp_path / "victim.txt"
    outside.write_bytes(b"keep")
    lock = pack / ".readers.lock"
    if kind == "fifo":
        os.mkfifo(lock)
    elif kind == "device":
        os.mknod(lock, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers: harmless if opened
    elif kind == "symlink-out":
        lock.symlink_to(outside)
    else:
        lock.mkdir()
    around = snapshot(tmp_path)
    with opens_of(lock) as opens:
        reader = LMDBDataset(pack) if fmt == "lmdb" else TFRecordIndexedDataset(pack)
        labels = [reader[i][1] for i in range(len(reader))]  # type: ignore[arg-type]
        what = {"fifo": "a FIFO", "device": "a character device", "symlink-out": "a symlink", "folder": "a folder"}
        refused = f"is {what[kind]}, not the readers' lock a stage makes"
        with pytest.raises(ConfigError, match=refused), exclude_readers(pack):
            pass
        assert kind == "folder" or opens() == 0
    assert len(labels) == 6 and set(labels) <= {0, 1}
    with open(outside, "rb") as f:  # the dataset holds no lock on what the link points at
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert snapshot(tmp_path) == around and outside.read_bytes() == b"keep"


@pytest.mark.timeout(60)  # a FIFO opened for reading waits for a writer: a hang is the failure
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_tfrecord_shard_that_is_a_fifo_or_device_is_named_never_opened(
    templates: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    """cat and export walk a shard whole (not through the dataset's checks): a planted FIFO or device is refused."""
    if kind == "device" and os.geteuid() != 0:
        pytest.skip("making a device node needs root")
    pack = _pack(templates, tmp_path, "tfrecord")
    shard = pack / read_manifest(pack).shards[0].file
    shard.unlink()  # its .tfindex stays, so the walk gets as far as opening the shard
    if kind == "fifo":
        os.mkfifo(shard)
    else:
        os.mknod(shard, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers: harmless if opened
    what = {"fifo": "a FIFO", "device": "a character device"}[kind]
    with opens_of(shard) as opens:
        _one_error_line(_cli("cat", str(pack), "#0"), shard.name, f"is not a regular file: {what}")
        _one_error_line(_cli("export", str(pack), str(tmp_path / "out")), shard.name, what)
        assert opens() == 0


def test_a_lock_file_that_is_a_fifo_or_device_is_refused_never_opened(tmp_path: Path) -> None:
    from packdata.pack.lock import hold_lock

    planted = {"fifo": "a FIFO"}
    os.mkfifo(tmp_path / ".fifo.lock")
    if os.geteuid() == 0:
        os.mknod(tmp_path / ".device.lock", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        planted["device"] = "a character device"
    for name, what in planted.items():
        lock = tmp_path / f".{name}.lock"
        with opens_of(lock) as opens:
            refused = pytest.raises(ConfigError, match=f"cannot create the lock file: {what} is in its place")
            with refused, hold_lock(lock, what="packdata convert", target=tmp_path / name):
                pass
            assert opens() == 0


# --------------------------------------------------------------------------- staged manifests and unstage


def test_staged_pack_names_origin_shards_that_are_checked_and_never_deleted(
    templates: dict[str, Path], tmp_path: Path
) -> None:
    pack = _pack(templates, tmp_path, "tfrecord")
    manifest = read_manifest(pack)
    first = pack / manifest.shards[0].file  # the shard and its side tables
    budget = f"{sum(p.stat().st_size for p in pack.glob(first.stem + '.*')) + 10}B"
    around = snapshot(pack.parent)
    result = _cli("stage", str(pack), "--to", str(tmp_path / "fast"), "--budget", budget, "-q")
    assert result.exit_code == 0, result.output
    staged = tmp_path / "fast" / pack.name
    left = read_manifest(staged).shards[1]
    assert left.file == os.fspath((pack / manifest.shards[1].file).resolve())
    assert len(TFRecordIndexedDataset(staged)) == 6
    # a staged manifest whose origin shard has another checksum is refused
    rewrite_manifest(staged, lambda d: d["shards"][1].__setitem__("sha256", "0" * 64))
    _one_error_line(_cli("info", str(staged)), "shards[1].file", "another checksum")
    # unstaging (and restaging) never writes or deletes the originals
    assert _cli("unstage", str(staged)).exit_code == 0
    assert not staged.exists()
    assert snapshot(pack.parent) == around


def test_unstage_ignores_hostile_staged_manifest_and_touches_nothing_outside(
    templates: dict[str, Path], tmp_path: Path
) -> None:
    pack = _pack(templates, tmp_path, "lmdb")
    area = tmp_path / "fast"
    assert _cli("stage", str(pack), "--to", str(area), "-q").exit_code == 0
    staged = area / pack.name
    (area / "victim").mkdir()
    (area / "victim" / "data.mdb").write_text("precious")
    rewrite_manifest(staged, lambda d: d["shards"][0].__setitem__("file", "../victim"))
    packs, victim = snapshot(pack.parent), snapshot(area / "victim")
    result = _cli("unstage", str(staged))
    assert result.exit_code == 0, result.output
    assert not staged.exists()
    assert snapshot(pack.parent) == packs and snapshot(area / "victim") == victim


def test_unstage_refuses_a_symlink_to_a_staged_pack(templates: dict[str, Path], tmp_path: Path) -> None:
    pack = _pack(templates, tmp_path, "lmdb")
    area = tmp_path / "fast"
    assert _cli("stage", str(pack), "--to", str(area), "-q").exit_code == 0
    link = tmp_path / "link"
    link.symlink_to(area / pack.name)
    around = snapshot(tmp_path)
    _one_error_line(_cli("unstage", str(link)), "symlink")
    assert snapshot(tmp_path) == around


# --------------------------------------------------------------------------- convert --overwrite


def test_overwrite_refuses_a_web_app_with_a_manifest(templates: dict[str, Path], tmp_path: Path) -> None:
    _pack(templates, tmp_path, "lmdb")
    app = web_app_folder(tmp_path / "www")
    around = snapshot(tmp_path)
    result = _cli("convert", str(tmp_path / "src"), str(app), "--overwrite", "-q", "--format", "lmdb")
    _one_error_line(result, str(app), "not a packdata pack; refusing")
    assert snapshot(tmp_path) == around


@pytest.mark.parametrize(
    "damage", ["foreign-file", "file-in-shard", "missing-index", "missing-shard", "staged", "symlink"]
)
def test_overwrite_refuses_anything_not_provably_a_pack(
    templates: dict[str, Path], tmp_path: Path, damage: str
) -> None:
    pack = _pack(templates, tmp_path, "lmdb")
    target, expected = pack, "refusing"
    if damage == "foreign-file":
        (pack / "thesis.tex").write_text("years of work")
        expected = "'thesis.tex'"
    elif damage == "file-in-shard":
        shard = read_manifest(pack).shards[0].file
        (pack / shard / "notes.txt").write_text("mine")
        expected = f"'{shard}/notes.txt'"
    elif damage == "missing-index":
        (pack / "index" / "labels.i32").unlink()
        expected = "labels.i32"
    elif damage == "missing-shard":
        shutil.rmtree(pack / read_manifest(pack).shards[0].file)
        expected = read_manifest(pack).shards[0].file
    elif damage == "staged":
        target = tmp_path / "fast" / pack.name
        assert _cli("stage", str(pack), "--to", str(tmp_path / "fast"), "-q").exit_code == 0
        expected = "staged pack"
    else:
        target = tmp_path / "link.lmdb"
        target.symlink_to(pack)
        expected = "is a symbolic link"
    around = snapshot(tmp_path)
    result = _cli("convert", str(tmp_path / "src"), str(target), "--overwrite", "-q", "--format", "lmdb")
    _one_error_line(result, expected)
    assert snapshot(tmp_path) == around


@pytest.mark.parametrize("fmt", FORMATS)
def test_overwrite_replaces_a_real_pack_and_leaves_nothing_aside(
    templates: dict[str, Path], tmp_path: Path, fmt: str
) -> None:
    pack = _pack(templates, tmp_path, fmt)
    (pack / read_manifest(pack).skipped["report"]).write_text("")  # the report a pack may hold
    victim = snapshot(pack.parent / "victim")
    result = _cli("convert", str(tmp_path / "src"), str(pack), "--overwrite", "-q", "--format", fmt)
    assert result.exit_code == 0, result.output
    assert read_manifest(pack).num_samples == 6
    assert sorted(p.name for p in pack.parent.iterdir()) == sorted(["victim", pack.name])
    assert snapshot(pack.parent / "victim") == victim


def test_publish_refuses_a_destination_that_appeared_without_overwrite(
    templates: dict[str, Path], tmp_path: Path
) -> None:
    from packdata.conversion.publish import _publish

    pack = _pack(templates, tmp_path, "lmdb")
    partial = tmp_path / "packs" / ".new.lmdb.partial"
    shutil.copytree(pack, partial)
    around = snapshot(tmp_path)
    with pytest.raises(ConfigError, match="appeared while converting"):
        _publish(partial, pack, overwrite=False)
    assert snapshot(tmp_path) == around


def test_read_manifest_accepts_what_convert_writes(templates: dict[str, Path], tmp_path: Path) -> None:
    for fmt in FORMATS:
        manifest = read_manifest(_pack(templates, tmp_path / fmt, fmt))
        assert json.loads(json.dumps(manifest.to_dict())) == manifest.to_dict()
        assert "staged_from" not in manifest.to_dict()


def test_reading_a_manifest_allocates_what_it_holds_not_the_size_limit(
    templates: dict[str, Path], tmp_path: Path
) -> None:
    """The limit (256 MiB) was read as one request: every open of every pack allocated it (untouched, but traced)."""
    import tracemalloc

    pack = _pack(templates, tmp_path, "lmdb")
    tracemalloc.start()
    try:
        read_manifest(pack)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


@pytest.mark.timeout(120)  # the search was quadratic: about 6 hours for these classes, a hang is the failure
def test_a_class_named_twice_among_a_million_is_named_at_once(templates: dict[str, Path], tmp_path: Path) -> None:
    """Each class was looked for in all the classes before it: every command that read the manifest hung."""
    pack = _pack(templates, tmp_path, "lmdb")
    rewrite_manifest(pack, lambda d: d.update(classes=[f"c{i}" for i in range(1_000_000)] + ["c0"]))
    with pytest.raises(PackdataError, match=r"should name each class once \('c0' is there twice\)"):
        read_manifest(pack)
