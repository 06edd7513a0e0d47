"""ls, cat, export and doctor given wrong inputs: one line each, naming the path and what to do."""

from __future__ import annotations

import os
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


def test_cat_of_a_missing_key_names_the_command_that_lists_keys_and_the_indices(pack: Path) -> None:
    """It said 'List keys with `packdata ls`', without the pack, and nothing of which #N there are."""
    result = _run("cat", str(pack), "c/9.jpg")
    assert result.exit_code == 1
    assert result.stderr == (
        f"Error: {pack}: no sample has the key 'c/9.jpg'. "
        f"List keys with `packdata ls '{pack}'`; #N picks by index (#0 to #5)\n"
    )


def test_cat_of_a_field_a_sample_lacks_or_of_no_field_says_how_to_name_one(pack: Path, tmp_path: Path) -> None:
    """'this pack holds one image per sample, not field 'txt'', 'sample 's0' has fields jpg, txt: name one' and
    'has no field 'png' (jpg, txt)' said nothing of --field."""
    grouped = tmp_path / "grouped"
    grouped.mkdir()
    (grouped / "s0.jpg").write_bytes(image_bytes(0))
    (grouped / "s0.txt").write_text("a cat\n")
    fields = tmp_path / "fields.lmdb"
    assert _run("convert", str(grouped), str(fields), "--layout", "grouped", "-q").exit_code == 0
    cases = (
        (["cat", str(pack), "#0", "--field", "txt"], pack, "this pack holds one image per sample, not field 'txt'. "
         "Leave the field out, or pass --field image"),
        (["cat", str(fields), "s0"], fields, "sample 's0' has fields jpg, txt: name one. Pass --field NAME (such as "
         "--field jpg)"),
        (["cat", str(fields), "s0", "--field", "png"], fields, "sample 's0' has no field 'png' (jpg, txt). "
         "Pass --field NAME (such as --field jpg)"),
        (["export", str(fields), str(tmp_path / "out"), "--layout", "imagefolder"], fields,
         "a multi-field pack exports as grouped files. Pass --layout grouped"),
    )  # fmt: skip
    for args, named, said in cases:
        result = _run(*args)
        assert (result.exit_code, result.stdout) == (1, ""), result.output
        assert result.stderr == f"Error: {named}: {said}\n"
    assert _run("cat", str(fields), "s0", "--field", "txt").stdout == "a cat\n"
    assert not (tmp_path / "out").exists()


def test_ls_limit_1_says_the_first_sample(pack: Path) -> None:
    """It said '(the first 1 samples; ...)'."""
    result = _run("ls", str(pack), "--limit", "1")
    assert result.exit_code == 0
    assert result.stdout.count("\n") == 1
    assert result.stderr == "(the first sample; more follow: --limit 0 lists all)\n"


def test_export_to_a_file_or_a_link_says_what_is_there(pack: Path, tmp_path: Path) -> None:
    """A file or a link given as DST was called 'not an empty folder'; a folder holding files still is."""
    (tmp_path / "notes.txt").write_text("keep me\n")
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    for name, what in [("notes.txt", "a file, not a folder"), ("link", "a symbolic link, not a folder"),
                       ("full", "not an empty folder")]:  # fmt: skip
        result = _run("export", str(pack), str(tmp_path / name))
        assert (result.exit_code, result.stdout) == (1, ""), result.output
        assert result.stderr == f"Error: {tmp_path / name}: export destination is {what}. Choose a new folder\n"
    assert (tmp_path / "notes.txt").read_text() == "keep me\n"
    assert not (tmp_path / "elsewhere").exists()
    assert os.listdir(tmp_path / "full") == ["x"]
