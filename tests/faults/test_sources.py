"""Sources that are not regular files, unlistable folders, link loops, vanishing and growing files."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import image_bytes

from packdata import LMDBDataset, convert
from packdata.conversion.destination import partial_path
from packdata.conversion.layouts import scan_grouped
from packdata.conversion.load import _read_regular
from packdata.conversion.sources import Skip, scan_source
from packdata.errors import SourceError

pytestmark = pytest.mark.timeout(60)


def tree_snapshot(root: Path) -> dict[str, tuple[int, str]]:
    """Every entry's relative path -> (mode, SHA-256 of a regular file's bytes): never opens FIFOs or devices."""
    out: dict[str, tuple[int, str]] = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(d, name)
            st = os.lstat(p)
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else ""
            out[os.path.relpath(p, root)] = (st.st_mode, digest)
    return out


def _report(pack: Path) -> dict[str, dict[str, str]]:
    lines = (pack / "skipped.jsonl").read_text(encoding="utf-8").splitlines()
    return {d["key"]: d for d in map(json.loads, lines)}


def test_fifo_device_and_socket_are_skipped_without_blocking(image_folder: Path, tmp_path: Path) -> None:
    os.mkfifo(image_folder / "cat" / "fifo.jpg")
    (image_folder / "cat" / "zero.jpg").symlink_to("/dev/zero")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(os.fspath(image_folder / "dog" / "sock.jpg"))
    try:
        before = tree_snapshot(image_folder)
        result = convert(image_folder, tmp_path / "out.lmdb", progress=False)
    finally:
        sock.close()
    assert result.skipped == {"not a regular file": 3}
    report = _report(tmp_path / "out.lmdb")
    assert report["cat/fifo.jpg"]["detail"] == "a FIFO"
    assert report["cat/zero.jpg"]["detail"] == "a character device"
    assert report["dog/sock.jpg"]["detail"] == "a socket"
    assert result.packed == 19
    assert tree_snapshot(image_folder) == before


def test_read_refuses_a_fifo_put_in_place_of_a_file(tmp_path: Path) -> None:
    """Between the walk and the read a file may become a FIFO: the read neither blocks nor reads it."""
    os.mkfifo(tmp_path / "swapped.jpg")
    with pytest.raises(Exception, match="not a regular file"):
        _read_regular(os.fspath(tmp_path / "swapped.jpg"))


@pytest.mark.timeout(60)
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")
def test_list_rows_naming_system_files_are_skipped_each_with_its_reason_never_read_on(tmp_path: Path) -> None:
    """A list's rows may name any path: /dev/zero (endless), a FIFO (blocks), a folder, /proc/self/status (stat
    says 0 bytes, it reads more). Each is a skip with its reason, read at most one byte past its size; the /proc
    file was said to be 'changed while read ... being written to', which it was not: it is now 'size unknown'."""
    os.mkfifo(tmp_path / "fifo.txt")
    os.chmod(tmp_path / "fifo.txt", 0o644)  # whatever the umask
    (tmp_path / "fine.txt").write_text("fine", encoding="utf-8")
    paths = ["/dev/zero", "fifo.txt", "/proc/self", "/proc/self/status", "fine.txt"]
    (tmp_path / "l.csv").write_text("path\n" + "".join(f"{p}\n" for p in paths), encoding="utf-8")
    result = convert(tmp_path / "l.csv", tmp_path / "out.lmdb", progress=False)
    assert result.packed == 1 and result.skipped == {"not a regular file": 3, "size unknown": 1}
    report = _report(tmp_path / "out.lmdb")
    assert report["/dev/zero"]["detail"] == "field 'bytes': mode crw-rw-rw-, never opened"
    assert report["fifo"]["detail"] == "field 'txt': mode prw-r--r--, never opened"
    assert report["/proc/self"]["detail"].startswith("field 'bytes': mode dr-xr-xr-x")
    assert report["/proc/self/status"]["detail"] == (
        "field 'bytes': stat gives 0 bytes but more were read, the file unchanged: a file of /proc or /sys, whose "
        "length no stat gives; copy it into a regular file to pack it"
    )
    assert [s["__key__"] for s in LMDBDataset(tmp_path / "out.lmdb")] == ["fine"]


def test_symlink_loop_and_duplicate_folder_are_reported(image_folder: Path, tmp_path: Path) -> None:
    (image_folder / "cat" / "loop").symlink_to(image_folder / "cat")
    (image_folder / "again").symlink_to(image_folder / "dog")
    result = convert(image_folder, tmp_path / "out.lmdb", progress=False)
    report = _report(tmp_path / "out.lmdb")
    assert report["cat/loop"]["reason"] == "symlink loop"
    assert report["again"]["reason"] == "duplicate folder"
    assert "dog" in report["again"]["detail"]
    assert result.packed == 19


def test_a_folder_nested_deeper_than_pythons_recursion_limit_is_walked(tmp_path: Path) -> None:
    """The walk recursed once per folder level: a source with a folder 1,200 levels deep (paths of 2,400
    characters, well inside PATH_MAX) stopped the conversion with a RecursionError traceback."""
    src = tmp_path / "src"
    (src / "top").mkdir(parents=True)
    (src / "top" / "a.txt").write_text("near")
    fd = os.open(src / "top", os.O_RDONLY)
    try:
        for _ in range(1200):  # one folder at a time, by descriptor: every path-based helper recurses too
            os.mkdir("d", dir_fd=fd)
            inner = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = inner
        leaf = os.open("deep.txt", os.O_WRONLY | os.O_CREAT, dir_fd=fd)
        os.write(leaf, b"far down")
        os.close(leaf)
    finally:
        os.close(fd)
    try:
        result = convert(src, tmp_path / "out.lmdb", progress=False)
        assert result.packed == 2
        ds = LMDBDataset(tmp_path / "out.lmdb", decode="bytes")
        deep_key = "top/" + "d/" * 1200 + "deep.txt"
        assert dict(zip(ds.keys, (ds[i][0] for i in range(len(ds))), strict=True)) == {
            "top/a.txt": b"near",
            deep_key: b"far down",
        }
    finally:  # shutil.rmtree (pytest's clean-up of old temporary folders) recurses once per level as well
        subprocess.run(["rm", "-rf", str(src)], check=True)


def test_vanished_file_is_a_defined_skip(image_folder: Path, tmp_path: Path) -> None:
    source = scan_source(image_folder)
    entries = list(source.walk())
    os.unlink(image_folder / "cat" / "a.jpg")
    from packdata.conversion.load import _load, _Options

    opts = _Options("lmdb", "image", "skip", False, None, 90, None, None)
    first = next(e for e in entries if e.key == "cat/a.jpg")
    skip, _ = _load(first, opts)  # type: ignore[arg-type]
    assert (skip.reason, skip.key) == ("vanished", "cat/a.jpg")  # type: ignore[union-attr]


def test_file_growing_while_read_is_refused(tmp_path: Path) -> None:
    """A writer appending without end: the read stops at the size seen at open and reports the change."""
    path = tmp_path / "growing.txt"
    path.write_bytes(b"x" * 4096)
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            # until killed, 1 KiB a millisecond: it outlives any stall of this process, and never fills the disk
            f"import time\nf=open({os.fspath(path)!r},'ab',buffering=0)\n"
            "while True: f.write(b'y'*1024); time.sleep(0.001)",
        ]
    )
    try:
        while path.stat().st_size <= 4096:
            time.sleep(0.01)
        outcomes = set()
        while writer.poll() is None and "changed while read" not in outcomes:
            try:
                _read_regular(os.fspath(path))
                outcomes.add("read")
            except Exception as exc:
                outcomes.add(str(exc).split(":")[0])
        assert "changed while read" in outcomes
    finally:
        writer.kill()
        writer.wait()


def _drop_dac_caps() -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP: gone from the bounding set, so after exec too
            raise OSError(ctypes.get_errno(), "prctl")


def _convert_without_dac(src: Path, dst: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``packdata convert SRC DST`` as root without the permission-override capabilities (so modes count)."""
    return subprocess.run(
        [sys.executable, "-m", "packdata.cli", "convert", str(src), str(dst), *args],
        preexec_fn=_drop_dac_caps,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        timeout=120,
    )


@pytest.mark.root
def test_unreadable_subfolder_is_skipped_not_a_traceback(image_folder: Path, tmp_path: Path) -> None:
    """Root reads everything, so the CLI runs as root without the permission-override capabilities."""
    if os.geteuid() != 0:
        pytest.skip("needs root to drop capabilities in a child")
    locked = image_folder / "zebra" / "locked"
    locked.mkdir()
    (locked / "x.jpg").write_bytes((image_folder / "cat" / "a.jpg").read_bytes())
    locked.chmod(0)
    try:
        run = _convert_without_dac(image_folder, tmp_path / "out.lmdb")
    finally:
        locked.chmod(0o755)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    report = _report(tmp_path / "out.lmdb")
    assert report["zebra/locked"]["reason"] == "unreadable folder"
    assert "Permission denied" in report["zebra/locked"]["detail"]


@pytest.mark.root
def test_a_source_whose_every_class_folder_cannot_be_listed_says_so_not_that_it_holds_no_files(tmp_path: Path) -> None:
    """It said 'no image or text files found. Images are .bmp, ...', as of an empty folder, though the files were
    there in folders this user may not list."""
    if os.geteuid() != 0:
        pytest.skip("needs root to drop capabilities in a child")
    src = tmp_path / "src"
    for name in ("a", "b"):
        (src / name).mkdir(parents=True)
        (src / name / "x.jpg").write_bytes(image_bytes(0))
        (src / name).chmod(0)
    try:
        run = _convert_without_dac(src, tmp_path / "out.lmdb", "-q")
    finally:
        for name in ("a", "b"):
            (src / name).chmod(0o755)
    assert run.returncode == 1, run.stderr[-2000:]
    assert run.stderr == (
        f"Error: {src}: no image or text files found, and 2 folders could not be listed ('a': Permission denied). "
        "Check the folders' permissions, or convert as a user who may read them\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no pack, no .out.lmdb.partial


def _engine_params() -> list:
    return [
        pytest.param("local", id="local"),
        pytest.param("ray", id="ray", marks=[pytest.mark.ray, pytest.mark.slow]),
    ]


def _ray_kwargs(engine: str) -> dict:
    """Engine options; with Ray, a small local instance (skipped when Ray is not installed)."""
    if engine == "local":
        return {}
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'packdata[ray]')")
    return {"engine": "ray", "workers": 2}


@pytest.mark.parametrize("engine", _engine_params())
def test_walk_problems_are_listed_as_examples_like_read_errors(image_folder: Path, tmp_path: Path, engine: str) -> None:
    """A FIFO and a link loop found by the walk are in skip_examples; hidden files (skipped by rule) are not."""
    os.mkfifo(image_folder / "cat" / "fifo.jpg")
    (image_folder / "dog" / "loop").symlink_to(image_folder / "dog")
    (image_folder / "cat" / ".hidden.jpg").write_bytes(b"x")
    result = convert(image_folder, tmp_path / "out.lmdb", progress=False, **_ray_kwargs(engine))
    examples = {(e["key"], e["reason"]) for e in result.skip_examples}
    assert ("cat/fifo.jpg", "not a regular file") in examples
    assert ("dog/loop", "symlink loop") in examples
    assert not any(key == "cat/.hidden.jpg" for key, _ in examples)
    assert {"cat/fifo.jpg", "dog/loop", "cat/.hidden.jpg"} <= set(_report(tmp_path / "out.lmdb"))


@pytest.mark.parametrize("engine", _engine_params())
def test_on_error_fail_stops_at_a_walk_problem_naming_it(image_folder: Path, tmp_path: Path, engine: str) -> None:
    """With on_error="fail", a FIFO found by the walk stops the conversion like an unreadable file, naming its path."""
    os.mkfifo(image_folder / "cat" / "fifo.jpg")
    dst = tmp_path / "out.lmdb"
    fifo = image_folder / "cat" / "fifo.jpg"
    with pytest.raises(SourceError, match=rf"{re.escape(str(fifo))}: not a regular file: a FIFO.*on_error='skip'"):
        convert(image_folder, dst, progress=False, on_error="fail", **_ray_kwargs(engine))
    assert not dst.exists() and not partial_path(dst).exists()


def test_on_error_fail_ignores_files_skipped_by_rule(image_folder: Path, tmp_path: Path) -> None:
    """Hidden files and other extensions are left out by rule: on_error="fail" does not stop on them."""
    (image_folder / "cat" / ".hidden.jpg").write_bytes(b"x")
    (image_folder / "cat" / "notes.txt").write_text("not an image")
    result = convert(image_folder, tmp_path / "out.lmdb", progress=False, on_error="fail")
    assert result.skipped == {"hidden": 1, "not image": 1} and result.skip_examples == []


@pytest.mark.parametrize("layout", ["classes", "grouped"])
def test_a_class_folder_made_while_walking_is_a_skip_not_a_keyerror_or_no_label(tmp_path: Path, layout: str) -> None:
    """A class folder made after the scan (a dataset still being written): a raw KeyError, or grouped, label -1."""
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "a.txt").write_text("a")
    (tmp_path / "cat" / "a.json").write_text("[1]")
    source = scan_source(tmp_path, "text") if layout == "classes" else scan_grouped(tmp_path)
    (tmp_path / "dog").mkdir()
    (tmp_path / "dog" / "b.txt").write_text("b")
    key = "dog/b.txt" if layout == "classes" else "dog/b"
    detail = "folder 'dog' was not there, or held no file to pack, when the classes were read: convert again to pack it"
    assert Skip(key, "not a class", detail) in list(source.walk())
    packed = ["cat/a.json", "cat/a.txt"] if layout == "classes" else ["cat/a"]
    assert [e.key for e in source.walk() if not isinstance(e, Skip)] == packed


@pytest.mark.timeout(60)
def test_a_tar_shard_named_that_is_a_fifo_or_folder_says_what_it_is(tmp_path: Path) -> None:
    """A FIFO (or a folder) named x.tar was refused as 'no such tar shard. Check the pattern's range', a file
    that is there. It is now named for what it is, never opened."""
    os.mkfifo(tmp_path / "fifo.tar")
    (tmp_path / "folder.tar").mkdir()
    for name, kind in (("fifo.tar", "a FIFO"), ("folder.tar", "a folder")):
        with pytest.raises(SourceError) as raised:
            convert(os.fspath(tmp_path / name), tmp_path / "out.lmdb", progress=False)
        hint = "Name regular tar files (a FIFO or device is never opened)"
        assert str(raised.value) == f"{tmp_path / name}: not a tar file: {kind}. {hint}"
    assert not (tmp_path / "out.lmdb").exists()
