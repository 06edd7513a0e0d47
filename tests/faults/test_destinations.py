"""Unwritable, special, full or linked destinations and unusable sources: one line, never a traceback."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from packdata.cli import main
from packdata.errors import CapacityError, ConfigError, PackdataError, SourceError

FORMATS = ["out.lmdb", "out.tfrecord"]


def _mount(path: Path, options: str) -> None:
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[dict[str, Path]]:
    """A full 64 KB tmpfs and a read-only tmpfs (root only)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount tmpfs")
    full, ro = tmp_path / "full", tmp_path / "ro"
    _mount(full, "size=64k")
    _mount(ro, "ro,size=1m")
    with open(full / "filler", "wb") as f, contextlib.suppress(OSError):  # fill the disk
        f.write(b"x" * (1 << 20))
    try:
        yield {"full": full, "ro": ro}
    finally:
        for m in (full, ro):
            subprocess.run(["umount", "-l", str(m)], check=False)


def _one_line_error(args: list[str], must_name: str) -> None:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert must_name in lines[0]
    assert "Traceback" not in result.output


def _destinations(tmp_path: Path) -> dict[str, tuple[Path, type[PackdataError], str]]:
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "real").mkdir()
    (tmp_path / "dirlink").symlink_to(tmp_path / "real")
    return {
        "regular file": (tmp_path / "a-file", ConfigError, "not a folder"),
        "dangling link": (tmp_path / "dangling", ConfigError, "symbolic link"),
        "link to a folder": (tmp_path / "dirlink", ConfigError, "symbolic link"),
        "parent is a file": (tmp_path / "a-file" / "PACK", ConfigError, "not a folder"),
        "proc": (Path("/proc/PACK"), ConfigError, "without storage"),
        "char device": (Path("/dev/null"), ConfigError, "not a folder"),
    }


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize(
    "case", ["regular file", "dangling link", "link to a folder", "parent is a file", "proc", "char device"]
)
def test_unusable_destination(text_folder: Path, tmp_path: Path, name: str, case: str) -> None:
    from packdata import convert

    dst, error, words = _destinations(tmp_path)[case]
    dst = dst.with_name(name) if dst.name == "PACK" else dst
    fmt = name.split(".")[1]
    with pytest.raises(error, match=words):
        convert(text_folder, dst, format=fmt, progress=False)
    _one_line_error(
        ["convert", str(text_folder), str(dst), "--format", fmt], str(dst.parent if dst.name == name else dst)
    )
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("name", FORMATS)
def test_missing_parents_are_created_with_the_pack(text_folder: Path, tmp_path: Path, name: str) -> None:
    from packdata import convert, verify_pack

    dst = tmp_path / "no" / "such" / name
    convert(text_folder, dst, format=name.split(".")[1], progress=False)
    assert verify_pack(dst, progress=False).records == 20


@pytest.mark.root
@pytest.mark.parametrize("name", FORMATS)
def test_full_and_read_only_disks(text_folder: Path, mounts: dict[str, Path], name: str) -> None:
    from packdata import convert

    with pytest.raises(CapacityError, match="full"):
        convert(text_folder, mounts["full"] / name, progress=False)
    with pytest.raises(ConfigError, match="not writable"):
        convert(text_folder, mounts["ro"] / name, progress=False)
    _one_line_error(["convert", str(text_folder), str(mounts["full"] / name)], str(mounts["full"]))
    _one_line_error(["convert", str(text_folder), str(mounts["ro"] / name)], str(mounts["ro"]))
    assert sorted(p.name for p in mounts["full"].iterdir()) == ["filler"]


@pytest.mark.root
def test_lmdb_shard_on_a_full_tmpfs_raises_instead_of_sigbus(mounts: dict[str, Path]) -> None:
    """LMDB maps its lock file: on a full tmpfs that write is a SIGBUS unless its blocks are allocated first."""
    code = (
        "from packdata.formats.lmdb_writer import LMDBShardWriter\n"
        "from packdata.errors import CapacityError\n"
        f"try:\n    LMDBShardWriter({str(mounts['full'] / 'shard')!r})\n"
        "except CapacityError as exc:\n    print('CapacityError', exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 0, (run.returncode, run.stderr[-1000:])
    assert run.stdout.startswith("CapacityError") and "full" in run.stdout


def test_unusable_sources(tmp_path: Path) -> None:
    (tmp_path / "file.jpg").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    for src, words in [
        (tmp_path / "file.jpg", "not a folder"),
        (tmp_path / "fifo", "not a folder"),
        (tmp_path / "missing", "no such folder"),
    ]:
        from packdata import convert

        with pytest.raises(SourceError, match=words):
            convert(src, tmp_path / "out.lmdb", progress=False)
        result = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out.lmdb")])
        assert result.exit_code in (1, 2), result.output  # click checks some SRCs itself: a usage error
        assert "Traceback" not in result.output
        assert next(line for line in result.output.splitlines() if line.startswith("Error: ")).count(str(src)) == 1


@pytest.mark.parametrize("case", ["regular file", "parent is a file"])
def test_stage_into_an_area_that_cannot_be_a_folder_is_one_line(text_folder: Path, tmp_path: Path, case: str) -> None:
    from packdata import convert, stage

    pack = convert(text_folder, tmp_path / "packs" / "train.lmdb", progress=False).pack
    area, _, _ = _destinations(tmp_path)[case]
    area = area.with_name("cache") if area.name == "PACK" else area
    with pytest.raises(ConfigError, match="cannot write the destination"):
        stage(pack, to=area, progress=False)
    if case == "parent is a file":  # click refuses a file given as --to itself (a usage error)
        _one_line_error(["stage", str(pack), "--to", str(area)], str(area))
    assert (tmp_path / "a-file").read_text() == "x"
