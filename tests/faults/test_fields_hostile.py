"""Hostile input to the multi-field paths: field blocks, field indexes, manifests and sources that lie."""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import struct
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import image_bytes

import packdata
from packdata.conversion.append import append_pack
from packdata.errors import ConfigError, PackFormatError, SourceError
from packdata.formats.contents import export_pack
from packdata.pack.fields import FieldError, decode_block, encode_block, read_directory
from packdata.pack.records import RECORD_MAGIC

from .hostile import overwrite_lmdb_record, rewrite_manifest


def _entry(name: bytes, length: int, crc: int = 0) -> bytes:
    return bytes((len(name),)) + name + struct.pack("<QI", length, crc)


@pytest.mark.parametrize(
    ("block", "problem"),
    [
        (b"PDF1" + struct.pack("<H", 1) + _entry(b"txt", 1 << 40) + b"abc", "runs past the end"),
        (b"PDF1" + struct.pack("<H", 3) + _entry(b"txt", 3), "runs past the block"),  # count past the directory
        (b"PDF1" + struct.pack("<H", 1) + _entry(b"txt", 1) + b"abcd", "does not account for"),
        (b"PDF1" + struct.pack("<H", 2) + _entry(b"a", 1) + _entry(b"a", 1) + b"xy", "names a field twice"),
        (b"PDF1" + struct.pack("<H", 1) + _entry(b"\xff\xfe", 0), "not UTF-8"),
        (b"XXXX" + struct.pack("<H", 0), "expected b'PDF1'"),
        (b"PD", "shorter than its"),
    ],
)
def test_a_lying_field_block_is_refused(block: bytes, problem: str) -> None:
    with pytest.raises(FieldError, match=problem):
        decode_block(block)


def test_a_short_prefix_asks_for_the_whole_block_instead_of_guessing() -> None:
    block = encode_block({"txt": b"x" * 100, "json": b"{}"})
    assert read_directory(block[:5], len(block)) is None
    assert read_directory(block[:20], len(block)) is None
    assert [e.name for e in read_directory(block[:40], len(block)) or []] == ["json", "txt"]


def _fields_pack(tmp_path: Path) -> Path:
    with packdata.PackWriter(tmp_path / "f.lmdb") as writer:
        for i in range(4):
            writer.write({"__key__": f"k{i}", "txt": f"t{i}", "json": {"i": i}})
    return tmp_path / "f.lmdb"


def _record(key: str, block: bytes, label: int = -1) -> bytes:
    k = key.encode()
    return struct.pack("<4sBiIH", RECORD_MAGIC, 2, label, zlib.crc32(block), len(k)) + k + block


def test_a_record_whose_field_directory_lies_is_named_not_read(tmp_path: Path) -> None:
    """A hostile author writes a record with a valid header and CRC around a field block that lies."""
    pack = _fields_pack(tmp_path)
    lying = b"PDF1" + struct.pack("<H", 1) + _entry(b"txt", 10_000) + b"short"
    overwrite_lmdb_record(pack, _record("k0", lying))
    (pack / "shard-00000.lmdb" / "records.i64").unlink()  # the reader takes LMDB's own lookup
    ds = packdata.LMDBDataset(pack)
    with pytest.raises(PackFormatError, match=r"record 0 is damaged: field 'txt' runs past the end"):
        ds[0]
    assert ds[1]["txt"] == "t1"  # the other records still read
    with pytest.raises(PackFormatError, match="record 0"):
        packdata.verify_pack(pack, progress=False)


def test_a_record_holding_another_samples_key_is_refused(tmp_path: Path) -> None:
    pack = _fields_pack(tmp_path)
    overwrite_lmdb_record(pack, _record("k3", encode_block({"txt": b"t3", "json": b'{"i": 3}'})))
    (pack / "shard-00000.lmdb" / "records.i64").unlink()
    with pytest.raises(PackFormatError, match=r"record 0 holds 'k3'.*sample index says 'k0'"):
        packdata.LMDBDataset(pack)[0]


@pytest.mark.parametrize(
    ("pairs", "problem"),
    [
        ([[0, 2], [7, 2]], "field number 7 is out of range for 2 fields"),  # past the manifest's list
        ([[-1, 2], [0, 2]], "field number -1 is out of range for 2 fields"),
        ([[0, -5], [1, 2]], "field size -5 is negative"),
    ],
)
def test_a_lying_field_index_is_refused_at_open(tmp_path: Path, pairs: list[list[int]], problem: str) -> None:
    pack = _fields_pack(tmp_path)
    sizes = pack / "index" / "field_sizes.i64"
    table = np.fromfile(sizes, dtype="<i8").reshape(-1, 2)
    table[: len(pairs)] = pairs
    table.astype("<i8").tofile(sizes)
    with pytest.raises(PackFormatError, match=problem):
        packdata.LMDBDataset(pack).pack.index  # noqa: B018


def test_decreasing_field_offsets_are_refused(tmp_path: Path) -> None:
    pack = _fields_pack(tmp_path)
    offsets = pack / "index" / "field_offsets.i64"
    values = np.fromfile(offsets, dtype="<i8")
    values[2] = 0
    values.astype("<i8").tofile(offsets)
    with pytest.raises(PackFormatError, match="offsets decrease"):
        packdata.LMDBDataset(pack).pack.index  # noqa: B018


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m["codecs"].update(txt="pickle"),  # a codec packdata does not have
        lambda m: m["codecs"].pop("json"),  # a field without a codec
        lambda m: m["fields"].append("txt"),  # a field named twice
    ],
)
def test_a_manifest_whose_fields_lie_is_refused(tmp_path: Path, change) -> None:
    pack = _fields_pack(tmp_path)
    rewrite_manifest(pack, change)
    with pytest.raises(PackFormatError, match="codecs"):
        packdata.LMDBDataset(pack)


def test_a_list_naming_a_fifo_a_folder_or_nothing_skips_those_rows(tmp_path: Path) -> None:
    (tmp_path / "ok.jpg").write_bytes(image_bytes(1))
    os.mkfifo(tmp_path / "pipe.jpg")
    (tmp_path / "dir.jpg").mkdir()
    listing = tmp_path / "l.csv"
    listing.write_text("path\nok.jpg\npipe.jpg\ndir.jpg\nmissing.jpg\n\n")
    result = packdata.convert(listing, tmp_path / "out.lmdb", progress=False)
    assert result.packed == 1  # the FIFO is never opened for a blocking read: the run does not hang
    reasons = {e["key"]: e["reason"] for e in result.skip_examples}
    assert result.skipped == {"not a regular file": 2, "vanished": 1}
    assert reasons == {"pipe": "not a regular file", "dir": "not a regular file", "missing": "vanished"}


@pytest.mark.parametrize("path", ["b\u0000.txt", "x\u0000/../b.txt", "/x\u0000/b.txt"])
def test_a_list_path_holding_a_nul_byte_is_a_skip_not_a_traceback(tmp_path: Path, path: str) -> None:
    """JSON can spell a NUL (\\u0000) that no file name holds: os.stat raised a bare ValueError in a reader thread
    (and, for a path with '..', realpath did in the walk while reading its key from the list's folder)."""
    (tmp_path / "a.txt").write_text("a")
    rows = [{"path": "a.txt"}, {"path": path}]
    (tmp_path / "l.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = packdata.convert(tmp_path / "l.jsonl", tmp_path / "out.lmdb", progress=False)
    assert result.packed == 1 and result.skipped == {"bad path": 1}
    detail = "row 2: the path holds a NUL byte, which no file name can"
    assert result.skip_examples == [{"key": path.rpartition(".")[0], "reason": "bad path", "detail": detail}]


def test_a_jsonl_lone_surrogate_is_a_skip_not_a_traceback(tmp_path: Path) -> None:
    """JSON spells "\\ud800", which no UTF-8 holds: in a path, a value or a label, each was a raw UnicodeEncodeError.

    (The label's only after every file was packed, in the manifest's checksum; the path's
    surrogateescape form "\\udcff" named the file b\\xff.txt, whose key no index can hold.)
    """
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "b.txt").write_text("b")
    (tmp_path / "b\udcff.txt").write_text("not UTF-8")  # the file the path's surrogateescape form names
    rows = [
        {"path": "a.txt", "label": "x"},
        {"path": "c\ud800.txt", "label": "x"},
        {"path": "b\udcff.txt", "label": "x"},
        {"path": "b.txt", "label": "x", "note": "y\ud800"},
        {"path": "d.txt", "label": "z\ud800"},
    ]
    (tmp_path / "l.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = packdata.convert(tmp_path / "l.jsonl", tmp_path / "out.lmdb", label_column="label", progress=False)
    assert result.packed == 1 and result.skipped == {"bad path": 2, "bad value": 1, "bad label": 1}
    assert [(e["key"], e["detail"]) for e in result.skip_examples] == [
        ("row 2", "the path 'c\\ud800.txt' is not valid UTF-8 (a lone surrogate)"),
        ("row 3", "the path 'b\\udcff.txt' is not valid UTF-8 (a lone surrogate)"),
        ("b", "row 4: field 'note': the text is not valid UTF-8 (surrogates not allowed)"),
        ("d", "row 5: label 'z\\ud800' is not a class or a non-negative integer below 1"),
    ]
    assert packdata.LMDBDataset(tmp_path / "out.lmdb").classes == ["x"]


def test_a_list_column_named_like_the_files_field_is_a_skip_not_a_lost_value(tmp_path: Path) -> None:
    """Path a.txt gives field txt; a column txt gave one too, and the file's bytes silently replaced its value."""
    (tmp_path / "a.txt").write_text("file a")
    (tmp_path / "b.jpg").write_bytes(image_bytes(1))
    (tmp_path / "l.csv").write_text("path,txt\na.txt,column a\nb.jpg,column b\n")
    result = packdata.convert(tmp_path / "l.csv", tmp_path / "out.lmdb", progress=False)
    assert result.packed == 1 and result.skipped == {"duplicate field": 1}
    detail = "row 2: the file (a.txt) and column 'txt' both give field 'txt'"
    assert result.skip_examples == [{"key": "a", "reason": "duplicate field", "detail": detail}]
    [sample] = packdata.LMDBDataset(tmp_path / "out.lmdb", decode="bytes")
    assert (sample["__key__"], bytes(sample["txt"])) == ("b", b"column b")


def test_require_holds_for_a_list_and_a_name_that_is_no_field_is_one_line(tmp_path: Path) -> None:
    """A list's rows were packed whatever require named (it was never passed on); require=_x was a raw FieldError."""
    (tmp_path / "a.jpg").write_bytes(image_bytes(1))
    (tmp_path / "b.jpg").write_bytes(image_bytes(2))
    (tmp_path / "c.txt").write_text("c")
    rows = [{"path": "a.jpg", "caption": "one"}, {"path": "b.jpg"}, {"path": "c.txt", "caption": "three"}]
    (tmp_path / "l.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = packdata.convert(tmp_path / "l.jsonl", tmp_path / "out.lmdb", require=["jpg", "caption"], progress=False)
    assert result.packed == 1 and result.skipped == {"missing field": 2}
    assert [(e["key"], e["detail"]) for e in result.skip_examples] == [
        ("b", "row 2: no caption field (required: jpg, caption)"),
        ("c", "row 3: no jpg field (required: jpg, caption)"),
    ]
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")] == ["a"]
    for src in (tmp_path / "l.jsonl", tmp_path):
        with pytest.raises(ConfigError, match=re.escape("require=FIELDS names no field: '_x' cannot name a field")):
            packdata.convert(src, tmp_path / "x.lmdb", layout="grouped", require=["jpg", "_x"], progress=False)
    assert not (tmp_path / "x.lmdb").exists()


def test_a_list_row_whose_file_name_starts_with_a_dot_gives_no_empty_key(tmp_path: Path) -> None:
    """A key ends at the file name's first dot: .env.txt was packed under key '' (PackWriter refuses an empty key)."""
    (tmp_path / "sub").mkdir()
    (tmp_path / ".env.txt").write_text("hidden")
    (tmp_path / "sub" / ".x.txt").write_text("hidden too")
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "l.csv").write_text("path\n.env.txt\nsub/.x.txt\na.txt\n")
    result = packdata.convert(tmp_path / "l.csv", tmp_path / "out.lmdb", progress=False)
    assert result.packed == 1 and result.skipped == {"no key": 2}
    detail = "the file name of '.env.txt' starts with a dot (or is empty): it gives no key (a key is the path up to"
    assert result.skip_examples[0]["key"] == "row 2" and result.skip_examples[0]["detail"].startswith(detail)
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")] == ["a"]


def test_a_csv_row_with_more_values_than_columns_is_a_skip_not_a_cut_value(tmp_path: Path) -> None:
    """A caption with an unquoted comma ('a dog, running') was packed as 'a dog', the rest dropped without a word."""
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "b.txt").write_text("b")
    (tmp_path / "l.csv").write_text('path,caption\na.txt,a dog, running\nb.txt,"a cat, sitting"\n')
    result = packdata.convert(tmp_path / "l.csv", tmp_path / "out.lmdb", progress=False)
    assert result.packed == 1 and result.skipped == {"bad row": 1}
    detail = "1 value past the header's columns (a delimiter not in quotes?)"
    assert result.skip_examples == [{"key": "row 2", "reason": "bad row", "detail": detail}]
    [sample] = packdata.LMDBDataset(tmp_path / "out.lmdb")
    assert (sample["__key__"], sample["caption"]) == ("b", "a cat, sitting")


@pytest.mark.parametrize(
    ("name", "text", "problem"),
    [
        ("l.csv", "path,tag,tag\na.txt,x,y\n", "the header names column 'tag' twice"),
        ("l.jsonl", '{"path": "a.txt", "tag": "x", "tag": "y"}\n', "line 1 is not JSON: key 'tag' twice in one object"),
    ],
)
def test_a_list_naming_a_column_twice_is_refused_not_read_as_its_last(
    tmp_path: Path, name: str, text: str, problem: str
) -> None:
    """csv.DictReader and json.loads keep the last value of a name given twice: tag 'x' was dropped without a word."""
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / name).write_text(text)
    with pytest.raises(SourceError, match=re.escape(f"{tmp_path / name}: {problem}")):
        packdata.convert(tmp_path / name, tmp_path / "out.lmdb", progress=False)
    assert not (tmp_path / "out.lmdb").exists()


def test_a_list_label_claims_no_more_classes_than_the_list_may_have(tmp_path: Path) -> None:
    """Integer labels name classes 0..N: a one-row list labelled 10**11 built a list of 10**11 class names."""
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "b.txt").write_text("b")
    rows = [{"path": "a.txt", "label": 10**11}, {"path": "b.txt", "label": 2}]
    (tmp_path / "l.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = packdata.convert(tmp_path / "l.jsonl", tmp_path / "out.lmdb", label_column="label", progress=False)
    assert result.packed == 1 and result.skipped == {"bad label": 1}
    detail = "row 1: label 100000000000 is not a class or a non-negative integer below 3"
    assert result.skip_examples[0] == {"key": "a", "reason": "bad label", "detail": detail}
    assert packdata.LMDBDataset(tmp_path / "out.lmdb").classes == ["0", "1", "2"]


@pytest.mark.parametrize("source", ["tar", "grouped"])
def test_a_cls_label_claims_no_more_classes_than_a_source_may_have(tmp_path: Path, source: str) -> None:
    """A 9-byte cls member holding 999999999 had the manifest name a billion classes: a MemoryError after packing."""
    members = {"a.txt": b"a", "a.cls": b"1048576", "b.txt": b"b", "b.cls": b"2"}  # 1048576: the first label refused
    if source == "tar":
        src = tmp_path / "d.tar"
        with tarfile.open(src, "w") as tar:
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    else:
        src = tmp_path / "src"
        src.mkdir()
        for name, data in members.items():
            (src / name).write_bytes(data)
    result = packdata.convert(
        src, tmp_path / "out.lmdb", layout="grouped" if source == "grouped" else "auto", progress=False
    )
    assert result.packed == 1 and result.skipped == {"bad label": 1}
    detail = "field 'cls': cls file holds 1048576: a cls label is below 1048576, each class named"
    assert [(e["key"], e["detail"]) for e in result.skip_examples] == [("a", detail)]
    assert packdata.LMDBDataset(tmp_path / "out.lmdb").classes == ["0", "1", "2"]


@pytest.mark.parametrize("label", ["\u00b2", "1" * 5000])  # a digit to str.isdigit, not int(); past int()'s 4,300
def test_a_csv_label_int_refuses_is_a_class_name_not_a_traceback(tmp_path: Path, label: str) -> None:
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "b.txt").write_text("b")
    (tmp_path / "l.csv").write_text(f"path,label\na.txt,{label}\nb.txt,x\n", encoding="utf-8")
    result = packdata.convert(tmp_path / "l.csv", tmp_path / "out.lmdb", label_column="label", progress=False)
    assert result.packed == 2 and packdata.LMDBDataset(tmp_path / "out.lmdb").classes == sorted([label, "x"])
    (tmp_path / "l.csv").write_text(f"path,label\na.txt,{label}\nb.txt,7\n", encoding="utf-8")
    with pytest.raises(SourceError, match=r"holds both integer labels \('7'\) and class names \('(²|1+\.\.\.1+)'\)"):
        packdata.convert(tmp_path / "l.csv", tmp_path / "o2.lmdb", label_column="label", progress=False)


@pytest.mark.parametrize(
    ("value", "problem"),
    [("1" * 5000, "line 2 is not JSON: Exceeds the limit"), ("[" * 100_000, "line 2 is not JSON: nested deeper")],
)
def test_a_jsonl_row_json_cannot_hold_is_one_source_error(tmp_path: Path, value: str, problem: str) -> None:
    """A 5,000-digit number or 100,000 nested lists: json.loads raised a bare ValueError or RecursionError."""
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "l.jsonl").write_text(f'{{"path": "a.txt"}}\n{{"path": "a.txt", "n": {value}}}\n')
    with pytest.raises(SourceError, match=re.escape(f"{tmp_path / 'l.jsonl'}: {problem}")):
        packdata.convert(tmp_path / "l.jsonl", tmp_path / "out.lmdb", progress=False)


def test_tar_members_with_escaping_names_never_become_keys_or_paths(tmp_path: Path) -> None:
    """An absolute member is keyed as tar extracts it (etc/owned), one leading out through '..' is a skip."""
    tar_path = tmp_path / "evil.tar"
    with tarfile.open(tar_path, "w") as tar:
        for name in ("../../escape.txt", "/etc/owned.txt", "fine/a.txt"):
            info = tarfile.TarInfo(name)
            info.size = 3
            tar.addfile(info, io.BytesIO(b"abc"))
    result = packdata.convert(str(tar_path), tmp_path / "t.lmdb", progress=False)
    assert (result.packed, result.skipped) == (2, {"bad key": 1})  # the tar is never extracted
    assert not (tmp_path.parent.parent / "escape.txt").exists()
    out = export_pack(tmp_path / "t.lmdb", tmp_path / "out")
    assert out.refused == []
    files = (tmp_path / "out").rglob("*")
    assert sorted(p.relative_to(tmp_path / "out").as_posix() for p in files if p.is_file()) == [
        "etc/owned.txt",
        "fine/a.txt",
    ]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("suffix", [".tar", ".tar.gz"])
def test_a_tar_member_claiming_more_bytes_than_the_tar_holds_is_named_not_read_forever(
    tmp_path: Path, suffix: str
) -> None:
    """A 10 KB tar whose pax header says size=10**30: tarfile's stream skipped to it 10 KB at a time, without end."""
    plain = io.BytesIO()
    with tarfile.open(fileobj=plain, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in ("a.txt", "b.txt", "c.txt"):
            info = tarfile.TarInfo(name)
            info.size = 5
            if name == "c.txt":
                info.pax_headers = {"size": str(10**30)}
            tar.addfile(info, io.BytesIO(b"hello"))
    src = tmp_path / f"t{suffix}"
    src.write_bytes(plain.getvalue() if suffix == ".tar" else gzip.compress(plain.getvalue()))
    result = packdata.convert(str(src), tmp_path / "out.lmdb", progress=False)
    assert result.packed == 2 and result.skipped == {"corrupt tar": 1}
    [skip] = result.skip_examples
    assert skip["key"] == f"t{suffix}:c"
    assert skip["detail"].startswith(f"member 'c.txt' claims {10**30} bytes, past the tar's end (byte 10240)")
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")] == ["a", "b"]


@pytest.mark.parametrize("source", ["jsonl", "tar"])
def test_a_sample_with_more_fields_than_a_block_holds_is_skipped_not_a_traceback(tmp_path: Path, source: str) -> None:
    """A list row with 65535 columns beside its file, or a tar with 65536 members of one key: once a raw FieldError."""
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "b.txt").write_text("b")
    if source == "jsonl":
        rows = [{"path": "a.txt", **{f"c{i}": "v" for i in range(65535)}}, {"path": "b.txt"}]
        src = tmp_path / "list.jsonl"
        src.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        src = tmp_path / "data.tar"
        with tarfile.open(src, "w", format=tarfile.GNU_FORMAT) as tar:
            for name in [f"a.f{i}" for i in range(65536)] + ["b.txt"]:
                tar.addfile(tarfile.TarInfo(name), io.BytesIO(b""))
    result = packdata.convert(src, tmp_path / "out.lmdb", progress=False)
    assert result.packed == 1 and result.skipped == {"too many fields": 1}
    assert result.skip_examples[0]["key"] == "a"
    assert result.skip_examples[0]["detail"] == "a sample has 65536 fields, at most 65535 fit"
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")] == ["b"]


def test_leftover_links_from_a_killed_append_are_unlinked_never_followed(tmp_path: Path) -> None:
    pack = _fields_pack(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep me")
    (pack / "shard-a9-00000-of-00001.lmdb").symlink_to(outside, target_is_directory=True)
    with packdata.PackWriter(tmp_path / "more.lmdb") as writer:
        writer.write({"__key__": "new", "txt": "n"})
    append_pack(pack, tmp_path / "more.lmdb")
    assert (outside / "precious").read_text() == "keep me"
    assert not (pack / "shard-a9-00000-of-00001.lmdb").is_symlink()
    assert len(packdata.LMDBDataset(pack)) == 5
