"""ls, cat, export and doctor given wrong inputs: one line each, naming the path and what to do."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import image_bytes

from packdata.cli import main


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture
def pack(tmp_path: Path) -> Path:
    """A pack of 6 images in a folder whose name holds a space (the command in a hint must paste)."""
    for i in range(6):
        (tmp_path / "src" / "c").mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / "c" / f"{i}.jpg").write_bytes(image_bytes(i))
    out = tmp_path / "my packs" / "train.lmdb"
    done = _run("convert", str(tmp_path / "src"), str(out), "-q")
    assert done.exit_code == 0, done.output
    return out


def test_cat_of_an_index_out_of_range_says_the_valid_range_and_how_to_list_keys(pack: Path) -> None:
    """It said 'index 99 is out of range for 6 samples' and nothing of which indices there are or how to see keys."""
    result = _run("cat", str(pack), "#99")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr == (
        f"Error: {pack}: index 99 is out of range for 6 samples. "
        f"Pick #0 to #5, or a key (`packdata ls '{pack}'` lists them)\n"
    )
    assert _run("cat", str(pack), "#5").exit_code == 0  # the last one the hint names is there
