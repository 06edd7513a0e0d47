"""The CLI through click's CliRunner: exit codes, one-line errors, stdout vs stderr."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import image_bytes, interrupted_convert
from conftest import packdata_as_nobody as _as_nobody

from packdata.cli import main
from packdata.conversion.destination import partial_path


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_convert_info_verify(bad_files: Path, tmp_path: Path) -> None:
    dst = str(tmp_path / "out.lmdb")
    result = _run("convert", str(bad_files), dst, "-q")
    assert result.exit_code == 0, result.output
    assert "packed 19 of 23 files" in result.output
    assert "SKIPPED 4 files: 1 corrupt image, 1 empty, 1 hidden, 1 not image" in result.output
    assert "cat/corrupt.jpg: corrupt image" in result.output
    info = _run("info", dst, "--json")
    assert info.exit_code == 0 and json.loads(info.output)["num_samples"] == 19
    assert "samples:  19" in _run("info", dst).output
    verified = _run("verify", dst, "-q")
    assert verified.exit_code == 0 and "ok: 19 records" in verified.output


def test_a_summary_of_one_file_or_one_skip_says_file_not_files(tmp_path: Path) -> None:
    """One of a thing is singular: "SKIPPED 1 sample: 1 missing field", never "1 samples"."""
    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    (src / "a.jpg").write_bytes(image_bytes(0))
    one = _run("convert", str(tmp_path / "src"), str(tmp_path / "one.lmdb"), "-q")
    assert one.exit_code == 0 and "packed 1 of 1 file into" in one.output, one.output
    (src / "b.jpg").write_bytes(b"")
    skipped = _run("convert", str(tmp_path / "src"), str(tmp_path / "two.lmdb"), "-q")
    assert "packed 1 of 2 files into" in skipped.output, skipped.output
    assert "SKIPPED 1 file: 1 empty (all listed in" in skipped.output, skipped.output
    grouped = tmp_path / "grouped"
    grouped.mkdir()
    for stem in ("0001", "0002"):
        (grouped / f"{stem}.jpg").write_bytes(image_bytes(1))
    (grouped / "0001.txt").write_text("a caption")
    required = _run("convert", str(grouped), str(tmp_path / "caps.lmdb"), "--require", "jpg,txt", "-q")
    assert "packed 1 of 2 samples into" in required.output, required.output
    assert "SKIPPED 1 sample: 1 missing field (all listed in" in required.output, required.output


def test_counts_are_printed_with_thousands_separators(tmp_path: Path) -> None:
    """A summary of 100 M files must be readable at a glance: "packed 1,200 of 1,200", not "1200 of 1200"."""
    src = tmp_path / "src" / "notes"
    src.mkdir(parents=True)
    for i in range(1200):
        (src / f"{i:04d}.txt").write_text(f"note {i}")
    dst = str(tmp_path / "out.lmdb")
    converted = _run("convert", str(src.parent), dst, "-q")
    assert converted.exit_code == 0 and "packed 1,200 of 1,200 files into" in converted.output
    assert re.search(r"out [0-9.]+ [KM]iB, [0-9,]+ files/s", converted.output), converted.output
    assert "samples:  1,200" in _run("info", dst).output
    assert "ok: 1,200 records" in _run("verify", dst, "-q").output
    exported = _run("export", dst, str(tmp_path / "back"))
    assert "exported 1,200 samples as 1,200 files" in exported.output, exported.output
    area = str(tmp_path / "area")
    assert _run("stage", dst, "--to", area, "-q").exit_code == 0
    assert "out.lmdb: 1 shard staged" in _run("stage", "--status", area).output
    merged = _run("merge", dst, dst, "-o", str(tmp_path / "twice.lmdb"), "--on-duplicate", "rename")
    assert merged.exit_code == 0 and "; 1,200 keys renamed)" in merged.output, merged.output
    photos = tmp_path / "photos" / "c"
    photos.mkdir(parents=True)
    for i in range(1001):
        (photos / f"{i:04d}.jpg").write_bytes(image_bytes(i, (16, 12)))
    small = str(tmp_path / "small.lmdb")
    resized = _run("convert", str(photos.parent), small, "--max-side", "8", "-q")
    assert resized.exit_code == 0 and ", 1,001 re-encoded" in resized.output, resized.output
    assert "reencode: 1,001 images re-encoded as JPEG to at most 8 px" in _run("info", small).output


def test_convert_json_summary(image_folder: Path, tmp_path: Path) -> None:
    result = _run("convert", str(image_folder), str(tmp_path / "out.lmdb"), "-q", "--json")
    summary = json.loads(result.output)
    assert summary["packed"] == 19 and summary["format"] == "lmdb" and summary["skipped"] == {}


def test_errors_are_one_line_with_exit_1(image_folder: Path, tmp_path: Path) -> None:
    dst = str(tmp_path / "out.lmdb")
    assert _run("convert", str(image_folder), dst, "-q").exit_code == 0
    again = _run("convert", str(image_folder), dst, "-q")
    assert again.exit_code == 1
    assert again.output.strip().splitlines() == [
        f"Error: {dst}: destination already exists. Pass --overwrite to replace it, or choose another path"
    ]
    missing = _run("info", str(tmp_path / "nope"))
    assert missing.exit_code == 1 and "no such pack" in missing.output
    odd = tmp_path / "two\nlines\x1b[2J"
    missing = _run("info", str(odd))  # a path holding a newline and an escape sequence: escaped, still one line
    assert missing.exit_code == 1 and missing.output.count("\n") == 1 and "\x1b" not in missing.output
    assert missing.output.startswith(f"Error: {tmp_path}/two\\nlines\\x1b[2J: no such pack"), missing.output


@pytest.mark.parametrize("command", ["info", "verify", "ls", "doctor"])
def test_a_file_given_for_the_pack_is_named_as_such(image_folder: Path, tmp_path: Path, command: str) -> None:
    """Not 'manifest.json cannot be looked at (Not a directory). The manifest is damaged ... convert the pack again'."""
    dst = tmp_path / "out.lmdb"
    assert _run("convert", str(image_folder), str(dst), "-q").exit_code == 0
    plain = tmp_path / "notes.txt"
    plain.write_text("x")
    for given, hint in (
        (plain, "Pass the pack's folder"),
        (dst / "manifest.json", f"Pass the folder that holds it: {dst}"),
    ):
        result = _run(command, str(given))
        assert result.exit_code == 1
        assert result.output == (
            f"Error: {given}: is a regular file, not a packdata pack (a folder holding manifest.json). {hint}\n"
        )


@pytest.mark.parametrize("command", ["info", "verify", "ls", "doctor", "stage"])
def test_a_shard_or_a_file_inside_a_pack_given_for_the_pack_names_the_pack(tmp_path: Path, command: str) -> None:
    """A shard's folder said 'not a packdata pack (no manifest.json). Convert a folder with `packdata convert SRC DST`
    first', and a shard's file 'Pass the pack's folder', of a pack right above them."""
    folder = tmp_path / "src" / "c"
    folder.mkdir(parents=True)
    (folder / "a.jpg").write_bytes(image_bytes(0))
    for fmt, pack in (("lmdb", tmp_path / "out.lmdb"), ("tfrecord", tmp_path / "records")):
        assert _run("convert", str(tmp_path / "src"), str(pack), "--format", fmt, "-q").exit_code == 0
    shard_folder = tmp_path / "out.lmdb" / "shard-00000.lmdb"
    record_file = next((tmp_path / "records").glob("*.tfrecord"))
    regular = "is a regular file, not a packdata pack (a folder holding manifest.json)"
    for given, what, pack in (
        (shard_folder, "not a packdata pack (no manifest.json)", tmp_path / "out.lmdb"),
        (shard_folder / "data.mdb", regular, tmp_path / "out.lmdb"),
        (record_file, regular, tmp_path / "records"),
    ):
        args = [command, str(given)] + (["--to", str(tmp_path / "area")] if command == "stage" else [])
        result = _run(*args)
        assert result.exit_code == 1
        assert result.output == f"Error: {given}: {what}. It lies inside the pack {pack}: pass that folder\n"
    assert not (tmp_path / "area").exists()


@pytest.mark.parametrize("command", ["export", "stage"])
def test_a_destination_that_cannot_be_made_is_one_line(image_folder: Path, tmp_path: Path, command: str) -> None:
    """export DST and stage --to DIR under a file (or read-only): mkdir's raw OSError was a traceback, then
    'cannot write the destination (Not a directory)', which named no file."""
    pack = tmp_path / "out.lmdb"
    assert _run("convert", str(image_folder), str(pack), "-q").exit_code == 0
    (tmp_path / "a-file").write_text("x")
    dest = tmp_path / "a-file" / "dest"
    args = ["export", str(pack), str(dest)] if command == "export" else ["stage", str(pack), "--to", str(dest)]
    result = _run(*args)
    assert result.exit_code == 1
    assert result.output == (
        f"Error: {dest}: cannot write the destination: {tmp_path / 'a-file'} is a file, not a folder. "
        "Choose a destination whose parents are folders (or can be made)\n"
    )


def test_a_pack_still_being_converted_is_named_with_the_flag_to_finish_it(image_folder: Path, tmp_path: Path) -> None:
    """info has no --resume: its hint said 'rerun it with resume=True', a Python keyword on the command line."""
    (tmp_path / ".out.lmdb.partial").mkdir()
    for command in ("info", "verify", "ls"):
        result = _run(command, str(tmp_path / "out.lmdb"))
        assert result.exit_code == 1
        assert result.output == (
            f"Error: {tmp_path / 'out.lmdb'}: no such pack. A conversion into it was interrupted: "
            "finish it with resume (`packdata convert SRC DST --resume`); a PackWriter's cannot be resumed: "
            "write it again\n"
        )


@pytest.mark.parametrize("command", ["convert", "info", "verify", "ls", "cat", "stage"])
def test_storage_options_that_are_not_a_json_object_are_a_usage_error(tmp_path: Path, command: str) -> None:
    """json.loads ran in each command's body: '{bad' was a JSONDecodeError traceback. The error echoed the value,
    credentials and all."""
    args = {"convert": ["SRC", "DST"], "cat": ["PACK", "#0"]}.get(command, ["PACK"])
    secret = "never-echo-this-secret-0c41"
    for value, problem in (
        ('{"key": "id", "secret": "' + secret + '",}', "invalid JSON: Expecting property name enclosed in double "
         "quotes at character 55 of 55"),
        (f'["{secret}"]', "a JSON list"),
    ):  # fmt: skip
        result = _run(command, *[str(tmp_path / a) if a != "#0" else a for a in args], "--storage-options", value)
        assert result.exit_code == 2, result.output
        assert "Invalid value for '--storage-options': should be a JSON object such as '{\"anon\": true}', " in (
            result.output
        )
        assert f"but got {problem}" in result.output and secret not in result.output


@pytest.mark.parametrize("command", ["info", "stage"])
def test_storage_options_nested_too_deeply_are_a_usage_error(tmp_path: Path, command: str) -> None:
    """json.loads raises RecursionError, not a JSONDecodeError, on '[[[[...': a bare traceback, not the one line."""
    value = "[" * 100_000 + "]" * 100_000
    result = _run(command, str(tmp_path / "PACK"), "--storage-options", value)
    assert result.exit_code == 2, result.output
    expected = (
        "Invalid value for '--storage-options': should be a JSON object such as '{\"anon\": true}', but got JSON "
        "nested too deeply to read (200000 characters)"
    )
    assert expected in result.output
    assert "[[[[" not in result.output


def test_an_option_that_does_not_apply_is_named_as_a_flag(image_folder: Path, tmp_path: Path) -> None:
    """'require is for grouped files ...' and 'cache_limit applies ...' named keyword arguments on the command line.

    --path-column on a folder was ignored without a word.
    """
    pack = tmp_path / "out.lmdb"
    cases = [
        (
            ["convert", str(image_folder), str(pack), "--require", "jpg"],
            "--require FIELDS is for grouped files and list files. Pass --layout grouped",
        ),
        (
            ["convert", str(image_folder), str(pack), "--label-column", "y"],
            "--label-column COLUMN is for list files. Class folders give labels: drop it",
        ),
        (  # it was ignored without a word
            ["convert", str(image_folder), str(pack), "--path-column", "x"],
            "--path-column COLUMN is for list files. A folder's files are found by walking it: drop it",
        ),
    ]
    for args, said in cases:
        result = _run(*args)
        assert result.exit_code == 1 and result.output == f"Error: {said}\n", result.output
    assert _run("convert", str(image_folder), str(pack), "-q").exit_code == 0
    result = _run("stage", str(pack), "--to", str(tmp_path / "area"), "--cache-limit", "1G")
    said = "--cache-limit SIZE applies to packs staged from a URL. Use --budget SIZE for a local pack"
    assert result.exit_code == 1 and result.output == f"Error: {said}\n", result.output


def test_ls_of_a_pack_missing_an_index_file_names_it_with_the_fix(image_folder: Path, tmp_path: Path) -> None:
    """It printed Python's '[Errno 2] No such file or directory: '...'' and no hint."""
    dst = tmp_path / "out.lmdb"
    assert _run("convert", str(image_folder), str(dst), "-q").exit_code == 0
    (dst / "index" / "labels.i32").unlink()
    result = _run("ls", str(dst))
    assert result.exit_code == 1
    said = f"{dst / 'index'}: sample index is missing or damaged: labels.i32: No such file or directory"
    assert result.output == f"Error: {said}. Convert the pack again\n"


def test_verify_fails_on_a_damaged_shard(image_folder: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out.lmdb"
    _run("convert", str(image_folder), str(dst), "-q")
    data = dst / "shard-00000.lmdb" / "data.mdb"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    result = _run("verify", str(dst), "-q")
    assert result.exit_code == 1 and "checksum does not match" in result.output and "data.mdb" in result.output
    # with --json, stdout had nothing for a script to read: the line was on stderr only
    result = _run("verify", str(dst), "-q", "--json")
    assert result.exit_code == 1
    said = result.stderr.removeprefix("Error: ").removesuffix("\n")
    assert "checksum does not match" in said and "\n" not in said
    assert json.loads(result.stdout) == {"ok": False, "error": said, "path": str(dst)}


def test_verify_reads_only_the_packs_own_skip_report_and_location_tables(bad_files: Path, tmp_path: Path) -> None:
    """A skip report or records.i64 that is a symlink or a FIFO is named, never followed or read.

    verify followed a skipped.jsonl linked to an outside file: its line count
    showed in the error, and a file of the right count passed.
    """
    dst = tmp_path / "out.lmdb"
    assert _run("convert", str(bad_files), str(dst), "-q").exit_code == 0
    outside = tmp_path / "outside.txt"
    outside.write_text("secret\n" * 4)  # as many lines as the 4 skips the manifest counts
    report, table = dst / "skipped.jsonl", dst / "shard-00000.lmdb" / "records.i64"
    kept = {report: report.read_bytes(), table: table.read_bytes()}
    for victim in (report, table):
        for stand_in, what in (("link", "is a symlink, not a regular file of the pack"), ("fifo", "a FIFO")):
            victim.unlink()
            if stand_in == "fifo":
                os.mkfifo(victim)
            else:  # the table's link stays inside the shard (one leading out of it is refused with the shard)
                victim.symlink_to(outside if victim == report else "data.mdb")
            result = _run("verify", str(dst), "-q")
            lines = result.output.strip().splitlines()
            assert result.exit_code == 1 and len(lines) == 1, result.output
            assert lines[0].startswith(f"Error: {victim}: ") and what in lines[0], lines[0]
            victim.unlink()
            victim.write_bytes(kept[victim])
    assert _run("verify", str(dst), "-q").exit_code == 0


def test_bad_options_exit_2(image_folder: Path, tmp_path: Path) -> None:
    result = _run("convert", str(image_folder), str(tmp_path / "o.lmdb"), "--shard-size", "3 apples")
    assert result.exit_code == 2 and "invalid size" in result.output
    assert _run("convert", str(image_folder), str(tmp_path / "o.lmdb"), "--workers", "0").exit_code == 2


def test_help_teaches() -> None:
    result = _run("convert", "--help")
    assert result.exit_code == 0 and "Examples:" in result.output and "--resume" in result.output


@pytest.mark.parametrize("command", ["bench", "tune"])
def test_decode_choices_are_explained_in_help(command: str) -> None:
    """tune --help listed --decode [bytes|pil|reduced|crop] with no word on what each does (bench's did)."""
    result = _run(command, "--help")
    text = " ".join(result.output.split())
    assert result.exit_code == 0
    for said in ("bytes: no decoding", "pil: full decode", "reduced: JPEG DCT-scaled decode", "crop: DecodeCrop"):
        assert said in text, (command, said)


def test_library_keywords_are_said_as_the_commands_flags() -> None:
    from packdata.cli import as_flags

    flags = {"overwrite": "--overwrite", "to": "--to", "batch_size": "--batch-size", "on_error": "--on-error"}
    assert as_flags("Pass overwrite=True to replace it", flags) == "Pass --overwrite to replace it"
    assert as_flags("give to=DIR, or a smaller batch_size=N", flags) == "give --to DIR, or a smaller --batch-size N"
    assert as_flags("pass on_error='skip'", flags) == "pass --on-error skip"
    assert as_flags("keep shard_size=256MB and x.to=1", flags) == "keep shard_size=256MB and x.to=1"
    assert as_flags("to should be a folder; to should", flags) == "--to should be a folder; to should"
    assert as_flags("format should be lmdb", flags) == "format should be lmdb"
    both = "best with batch_size=4, to=DIR: fast"  # keywords listed: a command line to paste
    assert as_flags(both, flags) == "best with --batch-size 4 --to DIR: fast"
    assert as_flags("with batch_size=4, shards=2", flags) == "with --batch-size 4, shards=2"  # one has no flag


def test_a_keyword_that_ends_a_clause_is_said_as_its_flag_without_the_punctuation() -> None:
    """'Run again with resume=True: ...' was said 'Run again with --resume True: ...' (the colon read as the value)."""
    from packdata.cli import as_flags

    flags = {"resume": "--resume", "to": "--to"}
    said = as_flags("Run again with resume=True: files are kept. Or give to=DIR.", flags)
    assert said == "Run again with --resume: files are kept. Or give --to DIR."


def test_a_false_keyword_is_said_as_the_off_flag_or_left_out_never_as_flag_false() -> None:
    """``x=False`` was said ``--x False``: no command takes that (a boolean flag is ``--no-x``, or not given)."""
    from packdata.cli import as_flags

    flags = {"pin_memory": "--pin-memory/--no-pin-memory", "overwrite": "--overwrite", "num_workers": "--workers"}
    assert as_flags("pass pin_memory=False to save memory", flags) == "pass --no-pin-memory to save memory"
    assert as_flags("pass pin_memory=True.", flags) == "pass --pin-memory."
    assert as_flags("with overwrite=False (this run: True)", flags) == "with no --overwrite (this run: True)"
    assert as_flags("run overwrite=False:", flags) == "run no --overwrite:"
    line = "best: with num_workers=2, pin_memory=False, overwrite=False: fast"  # a command line to paste
    assert as_flags(line, flags) == "best: with --workers 2 --no-pin-memory: fast"
    assert as_flags("with num_workers=2, overwrite=False.", flags) == "with --workers 2."
    assert as_flags("pin_memory should be a bool", flags) == "--pin-memory should be a bool"


def test_a_resume_with_another_flag_says_the_interrupted_runs_as_a_flag_not_flag_false(
    image_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """convert --resume --verify-images of a run without it said '--verify-images False (this run: True)'."""
    dst = tmp_path / "out.lmdb"
    interrupted_convert(image_folder, dst, monkeypatch)
    result = _run("convert", str(image_folder), str(dst), "--resume", "--verify-images", "-q")
    assert result.exit_code == 1
    assert result.output == (
        f"Error: {partial_path(dst)}: the interrupted conversion used other options: "
        "no --verify-images (this run: True). Resume with the same options, or start again with --overwrite\n"
    )


def test_a_resume_without_an_option_the_interrupted_run_had_unset_says_no_flag_never_flag_none(
    image_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """convert --resume --max-side 16 of a run without --max-side said '--max-side None (this run: 16)': no command
    takes 'None' (an option left unset is not given)."""
    from packdata.cli import as_flags

    dst = tmp_path / "out.lmdb"
    interrupted_convert(image_folder, dst, monkeypatch)
    result = _run("convert", str(image_folder), str(dst), "--resume", "--max-side", "16", "-q")
    assert result.exit_code == 1
    assert result.output == (
        f"Error: {partial_path(dst)}: the interrupted conversion used other options: "
        "no --max-side (this run: 16). Resume with the same options, or start again with --overwrite\n"
    )
    flags = {"max_side": "--max-side", "shuffle": "--shuffle/--no-shuffle", "num_workers": "--workers"}
    assert as_flags("with num_workers=2, max_side=None.", flags) == "with --workers 2."  # a command line to paste
    assert as_flags("pass shuffle=None:", flags) == "pass no --shuffle:"  # None is unset, not the off form


def test_a_resume_of_a_complete_pack_says_overwrite_to_python_and_the_flag_to_the_cli(
    image_folder: Path, tmp_path: Path
) -> None:
    """convert's hints named the CLI's flag ('pass --overwrite to convert it again') to a Python caller, who passes
    overwrite=True; the CLI, which maps it (as_flags), still says --overwrite."""
    import packdata

    dst = tmp_path / "out.lmdb"
    packdata.convert(image_folder, dst, progress=False)
    with pytest.raises(packdata.ConfigError) as raised:
        packdata.convert(image_folder, dst, progress=False, resume=True)
    said = f"{dst}: is already complete: there is no interrupted conversion to resume. Use the pack as it is, or pass "
    assert str(raised.value) == said + "overwrite=True to convert it again"
    result = _run("convert", str(image_folder), str(dst), "--resume", "-q")
    assert result.exit_code == 1
    assert result.output == f"Error: {said}--overwrite to convert it again\n"


def test_a_merge_into_an_existing_pack_says_overwrite_to_python_and_the_flag_to_the_cli(
    image_folder: Path, tmp_path: Path
) -> None:
    """merge_packs' refusal of an existing output said 'Pass --overwrite' to a Python caller; merge's CLI still does."""
    import packdata

    packs = [tmp_path / "a.lmdb", tmp_path / "b.lmdb"]
    for number, pack in enumerate(packs):  # one sample each, of keys apart
        src = tmp_path / f"src-{pack.stem}" / "cat"
        src.mkdir(parents=True)
        (src / f"{pack.stem}.jpg").write_bytes(image_bytes(number))
        packdata.convert(src.parent, pack, progress=False)
    out = tmp_path / "m.lmdb"
    out.mkdir()
    with pytest.raises(packdata.ConfigError) as raised:
        packdata.merge_packs(packs, out)
    said = f"{out}: destination already exists. Pass "
    assert str(raised.value) == said + "overwrite=True to replace it, or choose another path"
    result = _run("merge", *map(str, packs), "-o", str(out))
    assert result.exit_code == 1
    assert result.output == f"Error: {said}--overwrite to replace it, or choose another path\n"


def test_a_stage_with_no_staging_area_says_tmpfs_and_to_to_python_and_the_flags_to_the_cli(
    lmdb_pack: Path, tmp_path: Path
) -> None:
    """stage's refusal of a missing area said 'Prepare one with `sudo packdata stage --tmpfs 30G`, or give --to DIR'
    to a Python caller, who passes tmpfs= or to=; the CLI, which maps them, says --tmpfs SIZE and --to DIR."""
    import packdata

    area = tmp_path / "no-area"
    with pytest.raises(packdata.ConfigError) as raised:
        packdata.stage(lmdb_pack, mount=area, progress=False)
    said = f"{area}: no staging area here. Prepare one with "
    assert str(raised.value) == said + "tmpfs=SIZE (as root), or give to=DIR"
    result = _run("stage", str(lmdb_pack), "--mount", str(area))
    assert result.exit_code == 1
    assert result.output == f"Error: {said}--tmpfs SIZE (as root), or give --to DIR\n"
    assert not area.exists()


def _logged_runs(image_folder: Path, tmp_path: Path) -> list[subprocess.CompletedProcess[str]]:
    """convert, verify and stage run as a user's script would, stdout and stderr going to a log (not a terminal)."""
    env = {**os.environ, "PACKDATA_PROGRESS_SECONDS": "0"}
    pack = tmp_path / "p.lmdb"
    runs = []
    for args in (
        ["convert", str(image_folder), str(pack)],
        ["verify", str(pack)],
        ["stage", str(pack), "--to", str(tmp_path / "fast")],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "packdata.cli", *args], capture_output=True, text=True, env=env, timeout=120
        )
        assert done.returncode == 0, done.stderr
        runs.append(done)
    return runs


def test_progress_in_a_log_is_plain_lines_with_a_total(image_folder: Path, tmp_path: Path) -> None:
    """Piped into a log, convert, verify and stage print plain lines (no carriage returns) with totals."""
    for done in _logged_runs(image_folder, tmp_path):
        assert "\r" not in done.stderr
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert lines and all(": " in line for line in lines), done.stderr
        assert re.search(r"(of [\d,.]+ (files|records|[KMGT]iB|B)).*(done in|ETA)", lines[-1]), lines[-1]


def test_a_command_whose_stdout_reader_went_away_exits_141_quietly(tmp_path: Path) -> None:
    """`packdata ls PACK | head -1` exited 1 (packdata's Error status) saying nothing; cat exited 0 having dropped
    all but 64 KiB. git and seq die of SIGPIPE: 141."""
    src = tmp_path / "src" / "notes"
    src.mkdir(parents=True)
    for i in range(2000):  # ls lists 100 KB: more than a pipe holds, so it writes after head has gone
        (src / f"{i:04d}.txt").write_text(f"note {i}")
    (src / "big.txt").write_bytes(b"x" * (1 << 20))
    pack = tmp_path / "p.lmdb"
    assert _run("convert", str(src.parent), str(pack), "-q").exit_code == 0
    cli = f"{sys.executable} -m packdata.cli"
    first = json.dumps(
        {
            "index": 0,
            "key": "notes/0000.txt",
            "label": 0,
            "class": "notes",
            "fields": {"text": 6},
            "shard": "shard-00000.lmdb",
        }
    )
    for command, reader, shown in (
        (f"ls {pack} --limit 0", "head -1", "#0\tnotes/0000.txt\t0 (notes)\ttext:6 B\tshard-00000.lmdb\n"),
        (f"ls {pack} --limit 0 --json", "head -1", first + "\n"),
        (f"cat {pack} notes/big.txt", "head -c 1", "x"),
    ):
        script = f"set -o pipefail; {cli} {command} | {reader}"  # the pipeline's status: the CLI's (head's is 0)
        done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
        assert (done.returncode, done.stderr, done.stdout) == (141, "", shown), command  # no traceback, no Error line
    assert _run("ls", str(pack), "--limit", "1").exit_code == 0  # a reader that stays: 0, as before


def test_small_things_a_new_user_trips_on(bad_files: Path, tmp_path: Path) -> None:
    dst = str(tmp_path / "out.lmdb")
    assert _run("convert", str(bad_files), dst, "-q", "--format", "LMDB").exit_code == 0  # any letter case
    again = _run("convert", str(bad_files), dst, "-q", "--resume")
    assert again.exit_code == 1 and "is already complete: there is no interrupted conversion" in again.output
    verified = _run("verify", dst, "-q", "--json")
    assert verified.exit_code == 0 and json.loads(verified.output)["records"] == 19
    assert json.loads(verified.output)["ok"] is True
    info = _run("info", dst).output
    assert "{" not in info and "skipped:  4 at conversion (1 corrupt image, 1 empty, 1 hidden" in info
    for command in ("info", "verify", "doctor", "tune", "unstage", "stage", "convert", "ls", "cat", "export", "merge"):
        assert "Examples:" in _run(command, "--help").output, command
    for command in ("stage", "convert"):
        assert "powers of 1000" in _run(command, "--help").output, command


def test_every_option_that_has_a_default_says_it() -> None:
    """Each option with a value either shows its default or says in its help what happens without it."""
    import click

    missing = []
    for name, command in main.commands.items():
        for param in command.params:
            if not isinstance(param, click.Option) or param.is_flag or param.name == "help":
                continue
            says = param.show_default or "default" in (param.help or "").lower()
            if not says and name in ("bench", "tune", "convert", "stage"):
                missing.append(f"{name} {param.opts[0]}")
    # Options that are plainly off when absent (an output file, a destination, a URL's options) need no default.
    exempt = {
        "bench --json",
        "bench --plot",
        "convert --require",
        "convert --label-column",
        "convert --storage-options",
        "stage --to",
        "stage --tmpfs",
        "stage --shards",
        "stage --storage-options",
    }
    assert sorted(set(missing) - exempt) == []


def test_one_unit_style_for_sizes_and_rates(image_folder: Path, tmp_path: Path) -> None:
    """convert, verify and stage print sizes and rates in binary units (KiB, MiB/s), never decimal MB beside them."""
    for done in _logged_runs(image_folder, tmp_path):
        both = done.stdout + done.stderr
        assert not re.search(r"\d (MB|KB|GB)\b", both), both
        assert re.search(r"\d (KiB|MiB)\b", done.stdout), done.stdout


def test_info_shows_a_manifests_strings_escaped(image_folder: Path, tmp_path: Path) -> None:
    """A stranger's manifest may hold any string: info printed them raw, so an escape sequence in a class
    name ran in the terminal and a newline made a line of its own. Now each is shown quoted and escaped."""
    from faults.hostile import rewrite_manifest

    pack = tmp_path / "out.lmdb"
    assert _run("convert", str(image_folder), str(pack), "-q").exit_code == 0

    def lie(data: dict) -> None:
        data["classes"][0] = "cat\x1b]0;owned\x07\nreal"
        data["packdata_version"] = "1.0\x1b[2J"
        data["skipped"] = {"count": 1, "by_reason": {"bad\x1b[31m": 1}, "report": "r\x1b.jsonl"}
        data["reencode"] = {"count": 1, "max_side": 9, "quality": 90}
        (pack / "r\x1b.jsonl").write_text("x\n")

    rewrite_manifest(pack, lie)
    result = _run("info", str(pack))
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "\x07" not in result.output
    assert result.output.count("\n") == 7  # pack, format, samples, classes, shards, skipped, reencode
    assert "classes:  3 ('cat\\x1b]0;owned\\x07\\nreal', " in result.output


def test_ls_shows_a_shard_name_from_the_manifest_escaped(image_folder: Path, tmp_path: Path) -> None:
    """ls escaped keys and class names but printed shard (and field) names raw: an escape sequence ran."""
    from faults.hostile import rewrite_manifest

    pack = tmp_path / "out.lmdb"
    assert _run("convert", str(image_folder), str(pack), "-q").exit_code == 0
    name = "s\x1b]0;owned\x07\n.lmdb"
    (pack / "shard-00000.lmdb").rename(pack / name)
    rewrite_manifest(pack, lambda d: d["shards"][0].__setitem__("file", name))
    result = _run("ls", str(pack), "--limit", "3")
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and result.stdout.count("\n") == 3
    assert result.output.splitlines()[0].endswith("\t's\\x1b]0;owned\\x07\\n.lmdb'")


def test_a_pack_path_that_cannot_be_read_is_one_line(tmp_path: Path) -> None:
    """A name too long for the file system (or a folder this process may not search, as /proc/1/cwd is to
    root without the right to trace PID 1) gave an OSError traceback from info, verify and ls."""
    too_long, near = tmp_path / ("a" * 300), tmp_path / ("b" * 250)  # near: its .NAME.partial is too long
    for command in ("info", "verify", "ls"):
        result = _run(command, str(too_long))
        assert result.exit_code == 1 and result.output == (
            f"Error: {too_long}: cannot be read (File name too long). Name a pack's folder that this process may read\n"
        ), result.output
        result = _run(command, str(near))
        assert result.exit_code == 1 and result.output.startswith(f"Error: {near}: no such pack."), result.output


def test_json_output_escapes_c1_controls_and_keeps_other_scripts(tmp_path: Path) -> None:
    """ls --json and info --json wrote U+0080-U+009F from a pack raw: U+009B opens an escape sequence in some
    terminals. They are now JSON \\u escapes (read back the same); other non-ASCII stays as it is."""
    cls, key = "chat\x85é", "a\x9b31m\x7f猫.jpg"
    (tmp_path / "src" / cls).mkdir(parents=True)
    (tmp_path / "src" / cls / key).write_bytes(image_bytes(1))
    pack = str(tmp_path / "p.lmdb")
    assert _run("convert", str(tmp_path / "src"), pack, "-q").exit_code == 0
    listed, info = _run("ls", pack, "--json"), _run("info", pack, "--json")
    for result in (listed, info):
        assert result.exit_code == 0, result.output
        assert not re.search("[\x7f-\x9f]", result.output) and "é" in result.output
    assert "\\u009b" in listed.output and "猫" in listed.output
    assert json.loads(listed.output)["key"] == f"{cls}/{key}" and json.loads(info.output)["classes"] == [cls]


def _cat_to_terminal(pack: Path, *args: str) -> tuple[int, bytes, str]:
    """``packdata cat`` with stdout on a real pseudo-terminal: exit code, bytes the terminal got, stderr."""
    import pty

    leader, follower = pty.openpty()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "packdata.cli", "cat", str(pack), *args],
            stdout=follower,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
        os.set_blocking(leader, False)
        try:
            shown = os.read(leader, 1 << 20)
        except BlockingIOError:
            shown = b""
    finally:
        os.close(follower)
        os.close(leader)
    return done.returncode, shown, done.stderr


def test_cat_refuses_binary_bytes_on_a_terminal_and_writes_text(tmp_path: Path) -> None:
    """``packdata cat pack '#0'``, typed without ``> x.jpg``, must not spray a JPEG or escape codes on the terminal."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "0001.jpg").write_bytes(image_bytes(0))
    (src / "0001.txt").write_text("a caption, é 猫\n")
    (src / "0002.jpg").write_bytes(image_bytes(1))
    (src / "0002.txt").write_text("\x1b]0;pwned\x07 title")
    pack = tmp_path / "p.lmdb"
    assert _run("convert", str(src), str(pack), "-q").exit_code == 0

    code, shown, err = _cat_to_terminal(pack, "0001", "--field", "jpg")
    assert code == 1 and shown == b""
    assert err.startswith(f"Error: {pack}: sample 0001 holds ") and "Redirect it to a file" in err
    assert err.count("\n") == 1
    code, shown, err = _cat_to_terminal(pack, "0002", "--field", "txt")
    assert code == 1 and shown == b"" and "control characters" in err
    code, shown, err = _cat_to_terminal(pack, "0001", "--field", "txt")
    assert code == 0 and shown.replace(b"\r\n", b"\n") == "a caption, é 猫\n".encode(), err
    piped = subprocess.run(
        [sys.executable, "-m", "packdata.cli", "cat", str(pack), "0001", "--field", "jpg"], capture_output=True
    )
    assert piped.returncode == 0 and piped.stdout == image_bytes(0)


@pytest.mark.parametrize(
    ("command", "option", "value"),
    [
        ("bench", "--batch-size", "64,0"),
        ("bench", "--prefetch-factor", "0"),
        ("bench", "--workers", "0,,2"),
        ("bench", "--workers", "-1"),
        ("tune", "--batch-size", "64,,128"),
        ("tune", "--batch-size", "0"),
    ],
)
def test_number_lists_name_the_option_they_refuse(tmp_path: Path, command: str, option: str, value: str) -> None:
    """A zero batch size or a stray comma is a usage error naming its option, before anything is measured."""
    result = _run(command, str(tmp_path), option, value)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}': should be comma-separated integers" in result.output


def test_ls_says_on_stderr_when_the_limit_cut_the_list(tmp_path: Path) -> None:
    """``ls --json > samples.jsonl`` without --limit 0 kept 20 samples and said nothing: a silently short list."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(5):
        (src / f"{i}.txt").write_text(f"text {i}")
    pack = tmp_path / "p.lmdb"
    assert _run("convert", str(src), str(pack), "-q").exit_code == 0
    cut = _run("ls", str(pack), "--limit", "3", "--json")
    assert cut.exit_code == 0 and [json.loads(line)["index"] for line in cut.stdout.splitlines()] == [0, 1, 2]
    assert cut.stderr == "(the first 3 samples; more follow: --limit 0 lists all)\n"
    for limit in ("5", "9", "0"):
        whole = _run("ls", str(pack), "--limit", limit)
        assert (whole.exit_code, whole.stderr, len(whole.stdout.splitlines())) == (0, "", 5)


def test_merge_of_one_pack_is_a_usage_error(tmp_path: Path) -> None:
    """A forgotten second pack is a mistake in the command line: exit 2 with the usage, as click does for the rest."""
    result = _run("merge", str(tmp_path / "a.lmdb"), "-o", str(tmp_path / "all.lmdb"))
    assert result.exit_code == 2 and "Usage: main merge" in result.output
    assert result.output.endswith("Error: merge needs at least two PACKS, but got 1\n")
    assert not (tmp_path / "all.lmdb").exists()


def _help(command: str) -> str:
    """``packdata COMMAND --help`` with its lines joined: a phrase click wrapped reads whole."""
    result = CliRunner().invoke(main, [command, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split()).replace("- ", "-")


def test_convert_help_says_the_ray_engines_own_defaults() -> None:
    """--shard-size said 'Default: 256MB' and --workers '4 per CPU, at most 32' with --engine ray too, whose shards
    are DEFAULT_TASK_SAMPLES samples each (no size) and whose tasks read with DEFAULT_TASK_THREADS threads."""
    from packdata.conversion.ray import DEFAULT_TASK_SAMPLES, DEFAULT_TASK_THREADS
    from packdata.formats import DEFAULT_SHARD_BYTES

    text = _help("convert")
    assert f"Default: {DEFAULT_SHARD_BYTES // 10**6}MB (the unit stage copies); with --engine ray, none" in text
    assert f"with --engine ray and no --shard-size, {DEFAULT_TASK_SAMPLES:,} (one task a shard)" in text
    assert f"with --engine ray, {DEFAULT_TASK_THREADS} per task" in text


def test_stage_help_says_the_default_copy_threads_and_downloads_of_a_url() -> None:
    """--workers said 'Default: up to 4' for a PACK URL too, which a stage downloads with 16 requests at a time."""
    from packdata.staging.copy import COPY_WORKERS
    from packdata.staging.remote import FETCH_WORKERS

    text = _help("stage")
    assert f"Default: up to {COPY_WORKERS}; from a PACK URL, {FETCH_WORKERS} range downloads at a time." in text


def test_bench_help_says_the_plot_is_written_in_its_suffixs_format() -> None:
    """--plot said 'to this PNG': a plot is written in the format its file's suffix names (bench.svg is an SVG)."""
    pytest.importorskip("matplotlib")
    from packdata.measure.plot import check_plot_path

    text = _help("bench")
    said = re.search(r"in the format its suffix names \(((?:\.\w+, )+)\.\.\.; PNG without one", text)
    assert said is not None, text
    for suffix in said.group(1).rstrip(", ").split(", "):
        check_plot_path(f"bench{suffix}")  # a format matplotlib writes: no ConfigError
    assert "to this PNG" not in text


def test_a_bench_whose_every_source_cannot_be_opened_prints_one_error_line_and_no_empty_table(tmp_path: Path) -> None:
    """It printed the table's header and its legend with no row under them, then the error: a run that measured."""
    empty = tmp_path / "empty"
    empty.mkdir()
    plot = tmp_path / "bench.png"
    result = CliRunner().invoke(
        main, ["bench", str(empty), "--workers", "0", "--batches", "1", "-q", "--plot", str(plot)]
    )
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.startswith(f"Error: could not measure {empty}: no image or text files found. Images are ")
    assert result.stderr.count("\n") == 1
    assert not plot.exists()


@pytest.mark.root
def test_a_source_or_destination_behind_a_folder_the_user_may_not_search_is_one_line(tmp_path: Path) -> None:
    """As a user who may not search a folder above it (mode 700, root's), convert's SRC or DST, and merge's
    --output, raised PermissionError with a traceback (from Path.is_file, Path.is_symlink)."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run the command as another user")
    hidden = tmp_path / "hidden"
    (hidden / "src" / "c").mkdir(parents=True)
    (hidden / "src" / "c" / "a.jpg").write_bytes(image_bytes(0))
    hidden.chmod(0o700)  # root's: the user nobody may not look inside
    shared = Path(tempfile.mkdtemp(prefix="packdata_shared_"))  # where nobody may write, outside the hidden one
    try:
        shared.chmod(0o777)
        (shared / "src" / "c").mkdir(parents=True)
        (shared / "src" / "c" / "a.jpg").write_bytes(image_bytes(0))
        (shared / "src").chmod(0o755)
        (shared / "src" / "c").chmod(0o755)
        assert _run("convert", str(shared / "src"), str(shared / "a.lmdb"), "-q").exit_code == 0
        assert _run("convert", str(shared / "src"), str(shared / "b.lmdb"), "-q").exit_code == 0
        for pack in ("a.lmdb", "b.lmdb"):
            subprocess.run(["chmod", "-R", "a+rX", str(shared / pack)], check=True)
        cases = (
            (
                ["convert", str(hidden / "src"), str(shared / "out.lmdb"), "-q"],
                hidden / "src",
                "cannot be looked at",
                "Check the permissions of the folders above it: each needs search (x) permission for this user",
            ),
            (
                ["convert", str(shared / "src"), str(hidden / "out.lmdb"), "-q"],
                hidden / "out.lmdb",
                "the destination cannot be looked at",
                "Choose a destination whose folders this user may search and write",
            ),
            (
                ["merge", str(shared / "a.lmdb"), str(shared / "b.lmdb"), "-o", str(hidden / "ab.lmdb")],
                hidden / "ab.lmdb",
                "the destination cannot be looked at",
                "Choose a destination whose folders this user may search and write",
            ),
        )
        for args, named, what, hint in cases:
            run = _as_nobody(*args)
            assert (run.returncode, run.stdout) == (1, ""), run.stderr[-2000:]
            assert run.stderr == f"Error: {named}: {what} (Permission denied). {hint}\n"
        assert sorted(p.name for p in shared.iterdir()) == ["a.lmdb", "b.lmdb", "src"]  # nothing written
        assert sorted(p.name for p in hidden.iterdir()) == ["src"]
    finally:
        shutil.rmtree(shared)


@pytest.mark.root
@pytest.mark.parametrize("command", ["bench", "tune"])
def test_bench_and_tune_of_a_pack_behind_a_folder_the_user_may_not_search_is_one_line(
    tmp_path: Path, command: str
) -> None:
    """bench said 'no such pack or folder' of a pack that is there, and tune raised PermissionError with a traceback."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run the command as another user")
    (tmp_path / "src" / "c").mkdir(parents=True)
    (tmp_path / "src" / "c" / "a.jpg").write_bytes(image_bytes(0))
    pack = tmp_path / "hidden" / "train.lmdb"
    assert _run("convert", str(tmp_path / "src"), str(pack), "-q").exit_code == 0
    (tmp_path / "hidden").chmod(0o700)  # root's: the user nobody may not look inside
    run = _as_nobody(command, str(pack), "--batches", "1", "-q")
    assert (run.returncode, run.stdout) == (1, ""), run.stderr[-2000:]
    assert run.stderr == (
        f"Error: {pack}: cannot be looked at (Permission denied). "
        "Check the permissions of the folders above it: each needs search (x) permission for this user\n"
    )


@pytest.mark.root
def test_export_and_stage_into_a_folder_the_user_may_not_search_or_write_is_one_line(tmp_path: Path) -> None:
    """export DST, stage --to DIR and stage --status --mount DIR behind a folder this user may not search (mode 700,
    root's) raised PermissionError with a traceback (from Path.is_symlink, Path.exists); into a folder it may search
    but not write, the hint sent it to 'a writable local or network file system'."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run the command as another user")
    (tmp_path / "src" / "c").mkdir(parents=True)
    (tmp_path / "src" / "c" / "a.jpg").write_bytes(image_bytes(0))
    shared = Path(tempfile.mkdtemp(prefix="packdata_shared_"))  # one nobody may search, outside tmp_path's
    try:
        shared.chmod(0o755)
        pack = shared / "train.lmdb"
        assert _run("convert", str(tmp_path / "src"), str(pack), "-q").exit_code == 0
        subprocess.run(["chmod", "-R", "a+rX", str(pack)], check=True)
        hidden = shared / "hidden"
        hidden.mkdir(mode=0o700)  # root's: the user nobody may not look inside
        _refused_as_nobody(pack, hidden)
        for args, named in (
            (["export", str(pack), str(shared / "out")], shared / "out"),
            (["stage", str(pack), "--to", str(shared / "area"), "-q"], shared / "area"),
        ):  # a folder nobody may search but not write (root's, 755): it is the rights, not the file system
            run = _as_nobody(*args)
            assert (run.returncode, run.stdout) == (1, ""), run.stderr[-2000:]
            assert run.stderr == (
                f"Error: {named}: cannot write the destination (Permission denied). "
                "Choose a destination in a folder this user may write\n"
            )
        assert sorted(p.name for p in hidden.iterdir()) == []  # nothing written
        assert sorted(p.name for p in shared.iterdir()) == ["hidden", "train.lmdb"]
    finally:
        shutil.rmtree(shared)


def _refused_as_nobody(pack: Path, hidden: Path) -> None:
    """export, stage --to and stage --status --mount into ``hidden`` as nobody: one line each, exit 1."""
    cases = (
        (
            ["export", str(pack), str(hidden / "out")],
            f"{hidden / 'out'}: the export destination cannot be looked at (Permission denied). "
            "Choose a folder this user may search and write",
        ),
        (
            ["stage", str(pack), "--to", str(hidden / "area"), "-q"],
            f"{hidden / 'area' / 'train.lmdb'}: the staging destination cannot be looked at (Permission denied). "
            "Give a --to DIR whose folders this user may search",
        ),
        (
            ["stage", "--status", "--mount", str(hidden / "area")],
            f"{hidden / 'area'}: cannot be read (Permission denied). "
            "Name a staging area or staged pack that you may read",
        ),
    )
    for args, said in cases:
        run = _as_nobody(*args)
        assert (run.returncode, run.stdout) == (1, ""), run.stderr[-2000:]
        assert run.stderr == f"Error: {said}\n"


def test_help_names_what_an_options_value_is_not_its_click_type() -> None:
    """--help showed '--shard-size TEXT', '--seconds FINITE FLOAT RANGE', '--workers TEXT' (a list),
    '--storage-options TEXT', '--require TEXT', '--shards TEXT' and '--limit INTEGER RANGE', which say nothing of
    what to write."""
    said = {
        "convert": [
            "--shard-size SIZE",
            "--storage-options JSON",
            "--require FIELD,FIELD,...",
            "--path-column COLUMN",
            "--label-column COLUMN",
            "--address ADDRESS",
            "--workers N",
        ],
        "bench": ["--workers N,N,...", "--batch-size N,N,...", "--seconds SECONDS", "--step-ms MS", "--batches N"],
        "tune": ["--memory-budget SIZE", "--batch-size N,N,...", "--seconds SECONDS", "--device DEVICE"],
        "stage": [
            "--tmpfs SIZE",
            "--budget SIZE",
            "--reserve SIZE",
            "--cache-limit SIZE",
            "--storage-options JSON",
            "--shards SHARD,SHARD,...",
            "--name NAME",
        ],
        "monitor": ["--interval SECONDS", "--name WORD"],
        "info": ["--storage-options JSON"],
        "cat": ["--field FIELD"],
        "ls": ["--limit N"],
    }
    for name in main.commands:
        result = _run(name, "--help")
        assert result.exit_code == 0
        for generic in ("FINITE FLOAT RANGE", "INTEGER RANGE", " TEXT "):  # click's types, not what to write
            assert generic not in result.output, (name, generic)
        for option in said.get(name, []):
            assert re.search(rf"^  {re.escape(option)}  ", result.output, re.M), (name, option)


def test_a_file_given_as_convert_source_says_what_it_is_and_what_convert_takes(tmp_path: Path) -> None:
    """It said 'notes.txt: not a folder. Pass the folder that holds the files', though convert also takes a list file
    or tar shards: a user who meant one of them was not told."""
    notes = tmp_path / "notes.txt"
    notes.write_text("a photo of a cat\n")
    result = _run("convert", str(notes), str(tmp_path / "out.lmdb"), "-q")
    assert result.exit_code == 1
    assert result.output == (
        f"Error: {notes}: is a regular file, not a folder. Pass the folder that holds the files, a list file "
        "(.csv, .tsv or .jsonl) or WebDataset tar shards (.tar, .tar.gz or .tgz)\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
