"""pack.files: the one atomic write and the one file hash."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from packdata.pack.files import atomic_write, file_sha256


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


@pytest.mark.parametrize("size", [0, 1, 1_280_000, (4 << 20) - 1, 4 << 20, (4 << 20) + 1, (8 << 20) + 7])
def test_file_sha256_is_sha256(tmp_path: Path, size: int) -> None:
    """Whole, at any size: empty, under one block, a block's edges, several blocks."""
    data = (bytes(range(256)) * (size // 256 + 1))[:size]
    (tmp_path / "f").write_bytes(data)
    assert file_sha256(tmp_path / "f") == hashlib.sha256(data).hexdigest()
