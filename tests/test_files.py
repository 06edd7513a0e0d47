"""pack.files: the one atomic write, the one file hash, and the one way a file's type is checked and named."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from pathlib import Path

import pytest

from packdata.errors import PackFormatError
from packdata.pack.files import atomic_write, file_kind, file_sha256, open_regular
from packdata.staging.copy import sha256_of


def test_atomic_write_replaces_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_bytes(b"old")
    atomic_write(target, b"new contents")
    assert target.read_bytes() == b"new contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "taken"
    target.mkdir()  # a rename of a file onto a folder fails, as a crash at the rename would
    (target / "keep").write_text("x")
    with pytest.raises(OSError):
        atomic_write(target, b"new")
    assert (target / "keep").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_atomic_write_never_follows_a_symlink_planted_as_its_temporary(tmp_path: Path) -> None:
    """A leftover ``.NAME.tmp`` that points elsewhere is replaced, its target untouched (stage, convert, append)."""
    victim = tmp_path / "precious.txt"
    victim.write_text("user data")
    pack = tmp_path / "pack"
    pack.mkdir()
    (pack / ".manifest.json.tmp").symlink_to(victim)
    atomic_write(pack / "manifest.json", b"{}")
    assert victim.read_text() == "user data"
    assert (pack / "manifest.json").read_bytes() == b"{}"
    assert not (pack / "manifest.json").is_symlink()
    assert sorted(p.name for p in pack.iterdir()) == ["manifest.json"]


@pytest.mark.parametrize("size", [0, 1, 1_280_000, (4 << 20) - 1, 4 << 20, (4 << 20) + 1, (8 << 20) + 7])
def test_file_sha256_is_sha256(tmp_path: Path, size: int) -> None:
    """Whole, at any size: empty, under one block, a block's edges, several blocks."""
    data = (bytes(range(256)) * (size // 256 + 1))[:size]
    (tmp_path / "f").write_bytes(data)
    assert file_sha256(tmp_path / "f") == hashlib.sha256(data).hexdigest()


def test_file_kind_names_each_type(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "file").write_bytes(b"x")
    os.symlink(tmp_path / "file", tmp_path / "link")
    kinds = {name: file_kind(os.lstat(tmp_path / name).st_mode) for name in ("fifo", "file", "link")}
    assert kinds == {"fifo": "a FIFO", "file": "a regular file", "link": "a symlink"}
    assert file_kind(os.stat(tmp_path).st_mode) == "a folder"
    assert file_kind(os.stat("/dev/null").st_mode) == "a character device"


def test_open_regular_refuses_what_is_not_a_regular_file_and_says_what_it_is(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "file").write_bytes(b"data")
    os.symlink(tmp_path / "file", tmp_path / "link")
    with pytest.raises(OSError, match="not a regular file: a FIFO") as fifo:
        open_regular(tmp_path / "fifo")  # O_NONBLOCK: refused at once, never waits for a writer
    assert fifo.value.errno == errno.EINVAL
    with pytest.raises(OSError, match="not a regular file: a folder"):
        open_regular(tmp_path)
    os.close(open_regular(tmp_path / "link"))  # followed by default
    with pytest.raises(OSError) as link:
        open_regular(tmp_path / "link", follow_symlinks=False)
    assert link.value.errno == errno.ELOOP


def test_open_regular_never_opens_a_fifo_or_a_device_node(tmp_path: Path) -> None:
    """Opening a device can act on it (a tape rewinds): refused from its type, not after an open."""
    from faults.hostile import opens_of

    os.mkfifo(tmp_path / "fifo")
    planted = {"fifo": "a FIFO"}
    if os.geteuid() == 0:
        os.mknod(tmp_path / "device", 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
        planted["device"] = "a character device"
    for name, what in planted.items():
        for follow in (True, False):
            with opens_of(tmp_path / name) as opens:
                with pytest.raises(OSError, match=f"not a regular file: {what}") as refused:
                    open_regular(tmp_path / name, follow_symlinks=follow)
                assert refused.value.errno == errno.EINVAL and opens() == 0


def test_staging_hashes_only_a_packs_own_regular_files(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "file").write_bytes(b"data")
    os.symlink(tmp_path / "file", tmp_path / "link")
    assert sha256_of(tmp_path / "file") == hashlib.sha256(b"data").hexdigest()
    with pytest.raises(PackFormatError, match="fifo: is not a regular file: a FIFO"):
        sha256_of(tmp_path / "fifo")
    with pytest.raises(PackFormatError, match="link: is a symlink"):
        sha256_of(tmp_path / "link")
