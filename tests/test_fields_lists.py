"""Multi-field samples from list files (CSV, TSV, JSONL): labels, columns, quoting, rows naming one file twice."""

from __future__ import annotations

import csv
import json
import os
import re
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import image_bytes
from fields_helpers import _convert_in_an_ascii_locale

import packdata
from packdata.cli import main as cli
from packdata.conversion.list_rows import EXTRA, SHORT, read_list_rows
from packdata.conversion.lists import scan_list
from packdata.conversion.sources import Skip
from packdata.errors import SourceError


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".jsonl"])
def test_list_file_with_string_labels_and_extra_columns(tmp_path: Path, suffix: str) -> None:
    images = tmp_path / "imgs"
    images.mkdir()
    rows = []
    for i, label in enumerate(["zebra", "ant", "zebra"]):
        (images / f"im{i}.jpg").write_bytes(image_bytes(i))
        rows.append({"image": f"imgs/im{i}.jpg", "label": label, "caption": f"photo {i}", "score": str(i / 2)})
    absolute = tmp_path / "elsewhere.png"
    absolute.write_bytes(image_bytes(9, fmt="PNG"))
    rows.append({"image": str(absolute), "label": "ant", "caption": "abs", "score": "1"})
    rows.append({"image": "imgs/missing.jpg", "label": "ant", "caption": "gone", "score": "0"})
    listing = tmp_path / f"train{suffix}"
    if suffix == ".jsonl":
        listing.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    else:
        sep = "," if suffix == ".csv" else "\t"
        lines = [sep.join(rows[0])] + [sep.join(r.values()) for r in rows]
        listing.write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = packdata.convert(listing, tmp_path / "out.lmdb", path_column="image", label_column="label", progress=False)
    assert result.packed == 4 and result.skipped == {"vanished": 1}
    ds = packdata.LMDBDataset(tmp_path / "out.lmdb", decode={"jpg": "bytes", "png": "bytes"})
    assert ds.classes == ["ant", "zebra"]
    assert list(ds.targets) == [1, 0, 1, 0]
    first = ds[0]
    assert first["__key__"] == "imgs/im0" and first["jpg"] == (images / "im0.jpg").read_bytes()
    assert first["caption"] == "photo 0" and first["cls"] == 1
    assert ds[3]["png"] == absolute.read_bytes()


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_a_list_file_with_a_byte_order_mark_reads_its_first_column(tmp_path: Path, suffix: str) -> None:
    """Excel's 'CSV UTF-8' starts with a BOM: the first column was named '\\ufeffpath', and no row had 'path'."""
    (tmp_path / "a.txt").write_text("alpha", encoding="utf-8")
    listing = tmp_path / f"l{suffix}"
    text = "path,label\na.txt,cat\n" if suffix == ".csv" else json.dumps({"path": "a.txt", "label": "cat"}) + "\n"
    listing.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    packdata.convert(listing, tmp_path / "out.lmdb", label_column="label", progress=False)
    ds = packdata.LMDBDataset(tmp_path / "out.lmdb")
    assert ds.classes == ["cat"] and ds[0] == {"__key__": "a", "txt": "alpha", "cls": 0}


def test_a_label_column_no_row_has_is_named_before_packing(tmp_path: Path) -> None:
    """Every row was packed as a 'bad label' skip, then '.: no usable fields files ... Check the folder and --kind'."""
    (tmp_path / "a.txt").write_text("alpha", encoding="utf-8")
    listing = tmp_path / "l.csv"
    listing.write_text("path,label\na.txt,cat\n", encoding="utf-8")
    result = CliRunner().invoke(cli, ["convert", str(listing), str(tmp_path / "out.lmdb"), "--label-column", "lable"])
    assert result.exit_code == 1
    said = (
        f"{listing}: no row has a 'lable' column (columns: ['label', 'path']). Name the column with --label-column NAME"
    )
    assert result.output == f"Error: {said}\n"
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "l.csv"]


def test_a_conversion_that_packs_nothing_names_the_source_and_the_option_to_check(tmp_path: Path) -> None:
    """It said 'no usable fields files', named a list's or a tar's folder and always hinted at the folder and --kind."""
    grouped = tmp_path / "grouped"
    grouped.mkdir()
    for i in range(2):
        (grouped / f"{i}.jpg").write_bytes(image_bytes(i))
        (grouped / f"{i}.txt").write_text(f"caption {i}", encoding="utf-8")
    listing = tmp_path / "l.csv"
    listing.write_text("path\ngone.txt\n", encoding="utf-8")
    tar = tmp_path / "bad.tar"
    tar.write_bytes(b"not a tar")
    cases = [
        (
            [str(tar), str(tmp_path / "t.lmdb")],
            f"{tar}: no usable samples (skipped: 1 corrupt tar). "
            "Check the tar shards: each sample is files sharing a key, as WebDataset writes them",
        ),
        (
            [str(grouped), str(tmp_path / "g.lmdb"), "--layout", "grouped", "--require", "jpg,json"],
            f"{grouped}: no usable samples (skipped: 2 missing field). "
            "Check --require FIELDS: it names the fields every sample must have",
        ),
        (
            [str(listing), str(tmp_path / "l.lmdb")],
            f"{listing}: no usable samples (skipped: 1 vanished). Check the paths and labels the list gives",
        ),
    ]
    for args, said in cases:
        result = CliRunner().invoke(cli, ["convert", "-q", *args])
        assert result.exit_code == 1 and result.output == f"Error: {said}\n", result.output


def test_list_file_integer_labels_stay(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("alpha", encoding="utf-8")
    (tmp_path / "b.txt").write_text("beta", encoding="utf-8")
    listing = tmp_path / "l.jsonl"
    listing.write_text(
        json.dumps({"path": "a.txt", "y": 3, "meta": {"n": 1}}) + "\n" + json.dumps({"path": "b.txt", "y": 0}) + "\n",
        encoding="utf-8",
    )
    packdata.convert(listing, tmp_path / "out.lmdb", label_column="y", progress=False)
    ds = packdata.LMDBDataset(tmp_path / "out.lmdb")
    assert list(ds.targets) == [3, 0] and ds.classes == ["0", "1", "2", "3"]
    assert ds[0] == {"__key__": "a", "txt": "alpha", "meta": {"n": 1}, "cls": 3}
    assert ds[1] == {"__key__": "b", "txt": "beta", "cls": 0}


def test_a_jsonl_line_past_the_limit_is_refused_unread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A JSONL line was read whole, however long: a list of one 10 GB line (a stranger's) filled the memory.
    Now a line is read to MAX_JSONL_LINE characters at most (64 Mi; 100 here) and one longer is refused."""
    from packdata.conversion import list_rows as rows_module

    monkeypatch.setattr(rows_module, "MAX_JSONL_LINE", 100)
    (tmp_path / "a.txt").write_text("alpha", encoding="utf-8")
    listing = tmp_path / "l.jsonl"
    long_line = json.dumps({"path": "a.txt", "caption": "x" * 150})
    listing.write_text(json.dumps({"path": "a.txt"}) + "\n" + long_line + "\n", encoding="utf-8")
    with pytest.raises(SourceError, match=r"l\.jsonl: line 2 is longer than 100 characters"):
        packdata.convert(listing, tmp_path / "out.lmdb", progress=False)
    assert not (tmp_path / "out.lmdb").exists()


@pytest.mark.parametrize("row", ["commas", "quoted lines"])
def test_a_csv_row_past_the_limit_is_refused_unread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, row: str) -> None:
    """csv limits a field (128 Ki), not a row: 100 MB of commas, a row of 100 M fields, took 1.5 GB.
    Now a CSV or TSV row, its lines together, is read to MAX_JSONL_LINE characters at most (100 here)."""
    from packdata.conversion import list_rows as rows_module

    monkeypatch.setattr(rows_module, "MAX_JSONL_LINE", 100)
    (tmp_path / "a.txt").write_text("alpha", encoding="utf-8")
    long_row = "a.txt,x" + "," * 150 if row == "commas" else 'a.txt,"' + "x\n" * 75 + '"'
    (tmp_path / "l.csv").write_text(f"path,caption\na.txt,short\n{long_row}\n", encoding="utf-8")
    with pytest.raises(SourceError, match=r"l\.csv: the row at line 3 is longer than 100 characters. Store large"):
        packdata.convert(tmp_path / "l.csv", tmp_path / "out.lmdb", progress=False)
    assert not (tmp_path / "out.lmdb").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a character device needs root")
def test_list_rows_naming_a_device_or_fifo_are_skipped_without_opening_them(tmp_path: Path) -> None:
    """A list from elsewhere names any path: a device is refused from its type, never opened (a tape rewinds)."""
    from faults.hostile import opens_of

    (tmp_path / "a.txt").write_text("alpha", encoding="utf-8")
    os.mknod(tmp_path / "dev.txt", 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
    os.mkfifo(tmp_path / "fifo.txt")
    listing = tmp_path / "l.csv"
    listing.write_text("path\na.txt\ndev.txt\nfifo.txt\n", encoding="utf-8")
    with opens_of(tmp_path / "dev.txt") as dev_opens, opens_of(tmp_path / "fifo.txt") as fifo_opens:
        result = packdata.convert(listing, tmp_path / "out.lmdb", progress=False)
        assert (dev_opens(), fifo_opens()) == (0, 0)
    assert result.packed == 1 and result.skipped == {"not a regular file": 2}
    details = sorted(example["detail"] for example in result.skip_examples)
    assert re.fullmatch(r"field 'txt': mode c[-rwx]{9}, never opened", details[0]), details
    assert re.fullmatch(r"field 'txt': mode p[-rwx]{9}, never opened", details[1]), details


def test_list_rows_whose_paths_differ_after_the_first_dot_are_one_key_reported(tmp_path: Path) -> None:
    """A key is the path up to the first dot (WebDataset's rule): the second row is skipped, naming both files."""
    for name in ("a.txt", "a.md.txt", "b.txt"):
        (tmp_path / name).write_text(name, encoding="utf-8")
    listing = tmp_path / "l.csv"
    listing.write_text("path\na.txt\na.md.txt\nb.txt\n", encoding="utf-8")
    result = packdata.convert(listing, tmp_path / "out.lmdb", progress=False)
    assert result.packed == 2 and result.skipped == {"duplicate key": 1}
    assert result.skip_examples == [
        {
            "key": "a",
            "reason": "duplicate key",
            "detail": "row 3 (a.md.txt) has the key of row 2: a key is the path up to the first dot of the "
            "file name, without '.' or empty folder parts",
        }
    ]
    assert [s["txt"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")] == ["a.txt", "b.txt"]


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_a_blank_label_cell_is_a_bad_label_not_a_class_that_renumbers_the_others(tmp_path: Path, suffix: str) -> None:
    """A blank label cell was the class '': labels 0, 10, 2 then became classes ['', '0', '10', '2'] sorted as
    names, so every row was packed with another label (2 as 3) without a word. Now the row is a 'bad label' skip."""
    for name in "abcd":
        (tmp_path / f"{name}.txt").write_text(name, encoding="utf-8")
    for labels, classes, targets in (
        (["0", "", "10", "2"], [str(i) for i in range(11)], [0, 10, 2]),
        (["cat", " ", "dog", "cat"], ["cat", "dog"], [0, 1, 0]),
    ):
        rows = [{"path": f"{name}.txt", "label": label} for name, label in zip("abcd", labels, strict=True)]
        listing = tmp_path / f"l{suffix}"
        if suffix == ".csv":
            listing.write_text("path,label\n" + "".join(f"{r['path']},{r['label']}\n" for r in rows), encoding="utf-8")
        else:
            listing.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        result = packdata.convert(listing, tmp_path / "out.lmdb", label_column="label", overwrite=True, progress=False)
        assert result.packed == 3 and result.skipped == {"bad label": 1}
        row = 3 if suffix == ".csv" else 2  # a CSV's header is line 1
        detail = f"row {row}: no label: column 'label' is empty or missing"
        assert result.skip_examples[0]["key"] == "b" and result.skip_examples[0]["detail"] == detail
        ds = packdata.LMDBDataset(tmp_path / "out.lmdb")
        assert ds.classes == classes and list(ds.targets) == targets
        assert [ds[i]["__key__"] for i in range(3)] == ["a", "c", "d"]


def test_a_list_naming_one_file_again_as_dot_slash_packs_it_once(tmp_path: Path) -> None:
    """imgs/a.txt, ./imgs/a.txt and imgs//a.txt name one file, but gave keys imgs/a, ./imgs/a and imgs//a:
    that file was packed three times, three samples of one. Now '.' and empty folder parts leave the key."""
    (tmp_path / "imgs").mkdir()
    for name in "ab":
        (tmp_path / "imgs" / f"{name}.txt").write_text(name, encoding="utf-8")
    paths = ["imgs/a.txt", "./imgs/a.txt", "imgs//a.txt", "imgs/./a.txt", "imgs/b.txt", f"{tmp_path}//imgs/./b.txt"]
    (tmp_path / "l.csv").write_text("path\n" + "".join(f"{p}\n" for p in paths), encoding="utf-8")
    result = packdata.convert(tmp_path / "l.csv", tmp_path / "out.lmdb", progress=False)
    assert result.packed == 2 and result.skipped == {"duplicate key": 4}
    assert [s["key"] for s in result.skip_examples] == ["imgs/a"] * 3 + [f"{tmp_path}/imgs/b"]
    said = [s["detail"].split(": a key is")[0] for s in result.skip_examples]
    assert said[:3] == [f"row {n} ({p}) has the key of row 2" for n, p in zip((3, 4, 5), paths[1:4], strict=True)]
    assert said[3] == f"row 7 ({paths[5]}) has the key of row 6 (as 'imgs/b', from the list's folder)"
    ds = packdata.LMDBDataset(tmp_path / "out.lmdb")
    assert [s["__key__"] for s in ds] == ["imgs/a", "imgs/b"]


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_a_list_naming_one_file_by_its_absolute_path_or_through_dotdot_packs_it_once(
    tmp_path: Path, suffix: str
) -> None:
    """a.txt named again as /LIST_FOLDER/a.txt, or as x/../a.txt, gave keys a, /LIST_FOLDER/a and x/../a: one
    file packed as two or three samples, without a word. The later rows are now 'duplicate key' skips naming the
    row first given (the first spelling's key is packed); a file outside the list's folder, and one named through
    a link to it (not looked for: a stat a row), stay samples of their own."""
    (tmp_path / "x").mkdir()
    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.txt").write_text(name, encoding="utf-8")
    (tmp_path / "link.txt").symlink_to(tmp_path / "c.txt")
    outside = tmp_path.parent / f"{tmp_path.name}-outside.txt"
    outside.write_text("o", encoding="utf-8")
    paths = [f"{tmp_path}/b.txt", "a.txt", f"{tmp_path}/a.txt", "x/../a.txt", "b.txt", "c.txt", "link.txt"]
    paths += [str(outside), f"../{outside.name}"]
    listing = tmp_path / f"l{suffix}"
    rows = [json.dumps({"path": p}) if suffix == ".jsonl" else p for p in paths]
    listing.write_text(("" if suffix == ".jsonl" else "path\n") + "".join(f"{r}\n" for r in rows), encoding="utf-8")
    result = packdata.convert(listing, tmp_path / "out.lmdb", progress=False)
    assert result.skipped == {"duplicate key": 4}
    first = 1 if suffix == ".jsonl" else 2  # the line of the list's first row
    said = [(s["key"], s["detail"].split(": a key is")[0]) for s in result.skip_examples]
    as_a = "(as 'a', from the list's folder)"
    away = str(outside.with_suffix(""))
    assert said == [
        (f"{tmp_path}/a", f"row {first + 2} ({paths[2]}) has the key of row {first + 1} {as_a}"),
        ("x/../a", f"row {first + 3} (x/../a.txt) has the key of row {first + 1} {as_a}"),
        ("b", f"row {first + 4} (b.txt) has the key of row {first}"),
        (
            f"../{outside.stem}",
            f"row {first + 8} ({paths[8]}) has the key of row {first + 7} (as {away!r}, from the list's folder)",
        ),
    ]
    keys = [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")]
    assert keys == [f"{tmp_path}/b", "a", "c", "link", away]


def test_a_list_naming_a_file_in_utf8_reads_it_whatever_the_locale(tmp_path: Path) -> None:
    """A list names files in UTF-8, but Python encodes a path in the locale's encoding: under ASCII, os.stat of
    café.txt raised a UnicodeEncodeError in a reader thread (a traceback, no pack); under Latin-1 it was a
    'vanished' skip. The path is now opened by its UTF-8 bytes."""
    for name in ("café.txt", "ok.txt"):
        (tmp_path / name).write_text(name, encoding="utf-8")
    (tmp_path / "l.csv").write_text("path\ncafé.txt\nok.txt\n", encoding="utf-8")
    _convert_in_an_ascii_locale(tmp_path / "l.csv", tmp_path / "out.lmdb")
    assert list(packdata.LMDBDataset(tmp_path / "out.lmdb")) == [
        {"__key__": "café", "txt": "café.txt"},
        {"__key__": "ok", "txt": "ok.txt"},
    ]


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_a_label_column_of_integers_and_names_is_refused_not_renumbered(tmp_path: Path, suffix: str) -> None:
    """Labels 0, 2, 10 and one 'cat' were all read as class names sorted as text (['0', '10', '2', 'cat']): 2 was
    packed as 2, 10 as 1, without a word. Such a column is now refused before anything is packed."""
    rows = [("a.txt", "0"), ("b.txt", "2"), ("c.txt", "10"), ("d.txt", "cat")]
    for name, _ in rows:
        (tmp_path / name).write_text(name, encoding="utf-8")
    listing = tmp_path / f"l{suffix}"
    if suffix == ".csv":
        listing.write_text("path,label\n" + "".join(f"{p},{label}\n" for p, label in rows), encoding="utf-8")
    else:
        listing.write_text("".join(json.dumps({"path": p, "label": label}) + "\n" for p, label in rows))
    result = CliRunner().invoke(cli, ["convert", str(listing), str(tmp_path / "out.lmdb"), "--label-column", "label"])
    said = (
        f"{listing}: column 'label' holds both integer labels ('0') and class names ('cat'): as names, every "
        "integer would become another class number. Give every row a class name, or every row an integer label"
    )
    assert (result.exit_code, result.output) == (1, f"Error: {said}\n")
    assert not (tmp_path / "out.lmdb").exists()


def test_spaces_around_a_label_name_leave_its_class(tmp_path: Path) -> None:
    """'a.txt, cat' (a space after the comma) and 'b.txt,cat ' made classes ' cat', 'cat' and 'cat ': one class
    split in three, each row packed with another label. Spaces around a name are dropped, as around an integer."""
    rows = [("a.txt", " cat"), ("b.txt", "cat "), ("c.txt", "cat"), ("d.txt", " dog ")]
    for name, _ in rows:
        (tmp_path / name).write_text(name, encoding="utf-8")
    (tmp_path / "l.csv").write_text("path,label\n" + "".join(f"{p},{label}\n" for p, label in rows), encoding="utf-8")
    packdata.convert(tmp_path / "l.csv", tmp_path / "out.lmdb", label_column="label", progress=False)
    ds = packdata.LMDBDataset(tmp_path / "out.lmdb")
    assert ds.classes == ["cat", "dog"] and list(ds.targets) == [0, 0, 0, 1]


def test_a_csv_row_short_of_its_header_is_a_bad_row_not_a_sample_cut_short(tmp_path: Path) -> None:
    """A caption with a line break not in quotes split its row in two: 'a.txt,a dog' was packed with the caption
    cut at the break and no score, without a word (the rest, 'running,3', a row of its own). A row short of
    the header's columns is now a 'bad row' skip, as one past them is."""
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text(name, encoding="utf-8")
    (tmp_path / "l.csv").write_text("path,caption,score\na.txt,a dog\nrunning,3\nb.txt,a cat,4\n", encoding="utf-8")
    result = packdata.convert(tmp_path / "l.csv", tmp_path / "out.lmdb", progress=False)
    assert result.packed == 1 and result.skipped == {"bad row": 2}
    assert result.skip_examples == [
        {
            "key": "row 2",
            "reason": "bad row",
            "detail": "1 value short of the header's columns (a line break not in quotes?)",
        },
        {
            "key": "row 3",
            "reason": "bad row",
            "detail": "1 value short of the header's columns (a line break not in quotes?)",
        },
    ]
    assert list(packdata.LMDBDataset(tmp_path / "out.lmdb")) == [
        {"__key__": "b", "caption": "a cat", "score": "4", "txt": "b.txt"}
    ]


@pytest.mark.parametrize("suffix", [".tsv", ".csv"])
def test_a_list_value_that_opens_a_quote_it_never_closes_is_refused_not_merged(tmp_path: Path, suffix: str) -> None:
    """A caption that starts with a double quote: '"Hello" she said' was packed as 'Hello she said', and an
    unclosed one swallowed the rows after it into its value (c and d lost, no skip). Such a list is now refused
    in one line; quotes opened and closed as CSV writers write them still read."""
    sep = "\t" if suffix == ".tsv" else ","
    for name in "abcd":
        (tmp_path / f"{name}.txt").write_text(name, encoding="utf-8")
    listing = tmp_path / f"l{suffix}"
    for bad in ('"Hello" she said', '"unclosed'):
        rows = [("a.txt", "fine"), ("b.txt", bad), ("c.txt", "plain"), ("d.txt", 'says "hi"')]
        listing.write_text(f"path{sep}caption\n" + "".join(f"{p}{sep}{c}\n" for p, c in rows), encoding="utf-8")
        result = CliRunner().invoke(cli, ["convert", str(listing), str(tmp_path / "out.lmdb"), "-q"])
        assert result.exit_code == 1 and result.output.startswith(f"Error: {listing}: the row at line 3 is not")
        assert (
            result.output.endswith('must end with one: "say ""hi"" twice"\n') and not (tmp_path / "out.lmdb").exists()
        )
    listing.write_text(f'path{sep}caption\na.txt{sep}"say ""hi""{sep} twice"\nc.txt{sep}plain\n', encoding="utf-8")
    packdata.convert(listing, tmp_path / "out.lmdb", progress=False)
    assert [s["caption"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")] == [f'say "hi"{sep} twice', "plain"]


def test_a_list_given_a_column_while_converting_skips_that_row_not_a_traceback(tmp_path: Path) -> None:
    """A JSONL list appended to between its first read (columns, codecs, classes) and the walk: a row with a
    column the first read never saw stopped the conversion with a bare KeyError. It is a 'list changed' skip."""
    for name in "abc":
        (tmp_path / f"{name}.txt").write_text(name, encoding="utf-8")
    listing = tmp_path / "l.jsonl"
    listing.write_text(json.dumps({"path": "a.txt", "caption": "x"}) + "\n", encoding="utf-8")
    source = scan_list(listing)
    with open(listing, "a", encoding="utf-8") as f:
        f.write(json.dumps({"path": "b.txt", "caption": "y", "extra": "z"}) + "\n")
        f.write(json.dumps({"path": "c.txt", "caption": "w"}) + "\n")
    walked = list(source.walk())
    assert [entry.key for entry in walked] == ["a", "b", "c"]
    assert walked[1] == Skip(
        "b",
        "list changed",
        "row 2: column 'extra' was not in the list when it was read first: it changed while converting (convert again)",
    )


@pytest.mark.parametrize("suffix", [".tsv", ".csv"])
def test_a_list_value_whose_quote_closes_rows_later_is_refused_not_merged(tmp_path: Path, suffix: str) -> None:
    """'a.txt,"a dog' ... 'c.txt,runs"': an opened quote closed by a later row's value before a delimiter read as
    one row whose caption held the rows between (b and c lost, no skip; standard CSV reads it so). A value whose
    line names a file beside the list, where rows name theirs, is now refused naming the lines; a caption of
    several lines that names no file still reads."""
    sep = "\t" if suffix == ".tsv" else ","
    for name in "abcd":
        (tmp_path / f"{name}.txt").write_text(name, encoding="utf-8")
    listing = tmp_path / f"l{suffix}"
    rows = ["a.txt{0}fine{0}1", 'b.txt{0}"a dog{0}2', "c.txt{0}plain{0}3", 'd.txt{0}runs"{0}4']
    listing.write_text("".join(f"{r.format(sep)}\n" for r in ["path{0}caption{0}n", *rows]), encoding="utf-8")
    result = CliRunner().invoke(cli, ["convert", str(listing), str(tmp_path / "out.lmdb"), "-q"])
    name = "TSV" if suffix == ".tsv" else "CSV"
    assert result.exit_code == 1 and result.output == (
        f"Error: {listing}: the row at line 3 is not {name}: its value of column 'caption' runs on to line 5, and "
        "its line 4 names a file as a row does ('c.txt'): a quote not closed swallowed the rows between. A value "
        'that starts with a double quote must end with one: "say ""hi"" twice"\n'
    )
    assert not (tmp_path / "out.lmdb").exists()
    listing.write_text(
        f'path{sep}caption\na.txt{sep}"two\nlines{sep} x.txt"\nc.txt{sep}"one\r\nmore"\n', encoding="utf-8"
    )
    packdata.convert(listing, tmp_path / "out.lmdb", progress=False)
    assert [s["caption"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")] == [
        f"two\nlines{sep} x.txt",
        "one\r\nmore",
    ]


@pytest.mark.parametrize("delimiter", [",", "\t"])
def test_a_lists_rows_are_those_csv_dictreader_reads(tmp_path: Path, delimiter: str) -> None:
    """The walk reads a CSV or TSV list with csv.reader, making each row's dict itself (quicker than DictReader's):
    its rows, values past the header's columns, columns not given and blank lines are DictReader's."""
    lines = ["path,label,caption", "a.jpg,cat,x", "", "b.jpg,dog", 'c.jpg,cat,"q,r",extra,more', "d.jpg", "", ""]
    listing = tmp_path / f"l.{'csv' if delimiter == ',' else 'tsv'}"
    listing.write_text("\n".join(line.replace(",", delimiter) for line in lines) + "\n", encoding="utf-8")
    with open(listing, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter=delimiter, restkey=EXTRA, strict=True)
        expected = []
        for row in reader:
            short = sum(value is None for value in row.values())
            expected.append((reader.line_num, {**row, **({SHORT: short} if short else {})}))
    assert list(read_list_rows(listing)) == expected
    assert [row.get(SHORT, 0) for _, row in expected] == [0, 1, 0, 2]
