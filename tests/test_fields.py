"""Multi-field samples: grouped folders, list files, the Python writer, readers, ls/cat/export, version-1 packs."""

from __future__ import annotations

import csv
import filecmp
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import assert_index_digests, flip_label, image_bytes, tar_with_a_hard_link
from faults.hostile import rewrite_manifest
from PIL import Image
from torch.utils.data import DataLoader

import packdata
from packdata.cli import main as cli
from packdata.conversion.destination import partial_path
from packdata.conversion.lists import _EXTRA, _SHORT, _rows, scan_list
from packdata.conversion.sources import Skip
from packdata.errors import ConfigError, PackFormatError, SourceError
from packdata.formats.contents import export_pack, list_samples, read_field
from packdata.formats.lmdb_env import DATA_FILE
from packdata.pack.fields import decode_block
from packdata.pack.manifest import manifest_checksum, read_manifest

FIXTURE = Path(__file__).parent / "fixtures" / "v1-imagefolder.lmdb"
KEYS = ["0001", "a b", "café", "x-2"]


def _grouped(root: Path) -> Path:
    """A grouped folder: image + caption + JSON (+ a mask for some), keys with spaces and unicode, one class folder."""
    root.mkdir()
    for i, key in enumerate(KEYS):
        (root / f"{key}.jpg").write_bytes(image_bytes(i))
        (root / f"{key}.txt").write_text(f"caption {i} ünï" if i else "", encoding="utf-8")  # an empty caption
        (root / f"{key}.json").write_text(json.dumps({"boxes": [i, i + 1]}), encoding="utf-8")
        if i % 2:
            (root / f"{key}.seg.png").write_bytes(image_bytes(100 + i, fmt="PNG"))
    (root / "lonely.jpg").write_bytes(image_bytes(7))  # no caption: skipped under --require jpg,txt
    (root / "dogs.v2").mkdir()  # a class folder with a dot: key "dogs.v2/d"
    (root / "dogs.v2" / "d.jpg").write_bytes(image_bytes(8))
    (root / "dogs.v2" / "d.txt").write_text("a dog", encoding="utf-8")
    return root


def _fields_of(folder: Path, key: str) -> dict[str, bytes]:
    folder_part, _, stem = key.rpartition("/")
    directory = folder / folder_part if folder_part else folder
    return {p.name[len(stem) + 1 :]: p.read_bytes() for p in directory.iterdir() if p.name.startswith(stem + ".")}


def test_grouped_folder_round_trip_through_a_dataloader(tmp_path: Path) -> None:
    src = _grouped(tmp_path / "src")
    result = packdata.convert(src, tmp_path / "out.lmdb", require=("jpg", "txt"), progress=False, shard_samples=2)
    assert result.kind == "fields"
    assert result.packed == 5 and result.skipped == {"missing field": 1}
    assert result.skip_examples[0]["key"] == "lonely"
    ds = packdata.LMDBDataset(tmp_path / "out.lmdb", decode="bytes")
    assert ds.classes == ["dogs.v2"]
    for i in range(len(ds)):
        sample = ds[i]
        key = sample.pop("__key__")
        label = sample.pop("cls", -1)
        assert label == (0 if key.startswith("dogs.v2/") else -1)
        assert sample == _fields_of(src, key), key
    for context in ("fork", "spawn"):
        loader = DataLoader(
            packdata.LMDBDataset(tmp_path / "out.lmdb", fields=("__key__", "txt")),
            batch_size=None,
            num_workers=2,
            multiprocessing_context=context,
        )
        got = sorted(key for key, _ in loader)
        assert got == sorted([*KEYS, "dogs.v2/d"])


def test_default_decoders_fields_tuple_and_transforms(tmp_path: Path) -> None:
    src = _grouped(tmp_path / "src")
    packdata.convert(src, tmp_path / "out.lmdb", require=("jpg", "txt"), progress=False)
    ds = packdata.LMDBDataset(tmp_path / "out.lmdb")
    sample = ds[ds.keys.index("a b")]
    assert sample["jpg"].mode == "RGB" and sample["seg.png"].mode == "RGB"
    assert sample["txt"] == "caption 1 ünï" and sample["json"] == {"boxes": [1, 2]}
    ds = packdata.LMDBDataset(
        tmp_path / "out.lmdb",
        fields=("txt", "__key__", "json"),
        decode={"json": "bytes"},
        transforms={"txt": str.upper},
        missing={"json": None},  # dogs.v2/d has none
    )
    assert ds[ds.keys.index("café")] == ("CAPTION 2 ÜNÏ", "café", b'{"boxes": [2, 3]}')
    assert ds[ds.keys.index("dogs.v2/d")] == ("A DOG", "dogs.v2/d", None)
    lack = r"fields asks for 'seg\.png', which 3 of the pack's 5 samples lack \(the first: sample '0001', index 0\)"
    with pytest.raises(ConfigError, match=lack):
        packdata.LMDBDataset(tmp_path / "out.lmdb", fields=("seg.png",))
    with pytest.raises(ConfigError, match=r"no field .jpeg.*jpg"):
        packdata.LMDBDataset(tmp_path / "out.lmdb", fields=("jpeg",))


def test_a_transform_of_the_key_applies_and_a_decoder_for_it_is_refused(tmp_path: Path) -> None:
    """transforms={'__key__': f} and decode={'__key__' or 'cls': ...} were taken and never used: the key came
    back untransformed, silently. Now the key's transform applies; a decoder for either is refused."""
    packdata.convert(_grouped(tmp_path / "src"), tmp_path / "out.lmdb", progress=False)
    ds = packdata.LMDBDataset(tmp_path / "out.lmdb", fields=("__key__",), transforms={"__key__": str.upper})
    assert ds[ds.keys.index("café")][0] == "CAFÉ"
    for name in ("__key__", "cls"):
        with pytest.raises(ConfigError, match=f"decode names '{name}', which is not stored encoded"):
            packdata.LMDBDataset(tmp_path / "out.lmdb", decode={name: "bytes"})


def test_index_holds_per_field_sizes(tmp_path: Path) -> None:
    packdata.convert(_grouped(tmp_path / "src"), tmp_path / "out.lmdb", progress=False)
    ds = packdata.LMDBDataset(tmp_path / "out.lmdb")
    sizes = ds.pack.index.field_sizes("seg.png")
    for i, key in enumerate(ds.keys):
        expected = _fields_of(tmp_path / "src", key)
        assert ds.pack.index.sample_fields(i) == {name: len(data) for name, data in expected.items()}
        assert sizes[i] == (len(expected["seg.png"]) if "seg.png" in expected else -1)


def _flip_inside(shard: Path, needle: bytes) -> None:
    data = bytearray((shard / DATA_FILE).read_bytes())
    at = data.find(needle)
    assert at >= 0
    data[at] ^= 0xFF
    (shard / DATA_FILE).write_bytes(bytes(data))


def test_a_damaged_field_is_named_and_other_fields_still_read(tmp_path: Path) -> None:
    src = _grouped(tmp_path / "src")
    packdata.convert(src, tmp_path / "out.lmdb", layout="grouped", progress=False)
    _flip_inside(tmp_path / "out.lmdb" / "shard-00000.lmdb", b'{"boxes": [2, 3]}')
    ds = packdata.LMDBDataset(tmp_path / "out.lmdb", fields=("txt",), missing={"txt": None})  # lonely has none
    i = ds.keys.index("café")
    assert ds[i] == ("caption 2 ünï",)  # only the caption was read: the damaged JSON is never touched
    with pytest.raises(PackFormatError, match=r"record .* is damaged"):
        packdata.LMDBDataset(tmp_path / "out.lmdb", fields=("json",), missing={"json": None})[i]
    with pytest.raises(PackFormatError):
        packdata.LMDBDataset(tmp_path / "out.lmdb")[i]
    with pytest.raises(PackFormatError, match="shard checksum"):
        packdata.verify_pack(tmp_path / "out.lmdb", progress=False)


def _graft_shards(pack: Path, donor: Path) -> None:
    """Put ``donor``'s shard files (same names) into ``pack``, keeping its index; its manifest describes them."""
    for item in donor.iterdir():
        if item.name not in ("manifest.json", "index", "skipped.jsonl"):
            target = pack / item.name
            shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
            (shutil.copytree if item.is_dir() else shutil.copyfile)(item, target)
    manifest = json.loads((pack / "manifest.json").read_text())
    manifest["shards"] = json.loads((donor / "manifest.json").read_text())["shards"]
    manifest["checksum"] = manifest_checksum(manifest)
    (pack / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_text_json_and_npy_that_cannot_be_decoded_are_named_by_pack_sample_and_field(tmp_path: Path, fmt: str) -> None:
    """Bytes their decoder refuses: one DecodeError naming pack, sample and field, never a bare ValueError."""
    good = io.BytesIO()
    np.save(good, np.arange(6, dtype=np.int64))
    cut_npy = good.getvalue()[:-8]  # a header asking for 48 bytes, 40 follow: refused before allocating
    object_npy = io.BytesIO()
    np.save(object_npy, np.array([1, "a"], dtype=object), allow_pickle=True)
    bad = [("txt", b"caf\xe9"), ("json", b'{"a": '), ("json", b"[" * 100_000), ("npy", cut_npy)]
    bad.append(("npy", object_npy.getvalue()))
    rows = [
        {"__key__": f"k{k}", **{n: (v if n == name else ok) for n, ok in _GOOD.items()}}
        for k, (name, v) in enumerate(bad)
    ]
    pack = tmp_path / "p"
    packdata.write_pack(rows, pack, format=fmt, progress=False)
    problems = [
        "text is not UTF-8",
        "JSON cannot be parsed",
        "JSON cannot be parsed",
        ".npy array cannot be read",
        ".npy array cannot be read (it holds Python objects",
    ]
    indexed = packdata.LMDBDataset if fmt == "lmdb" else packdata.TFRecordIndexedDataset
    for k, ((name, _), problem) in enumerate(zip(bad, problems, strict=True)):
        message = re.escape(f"{pack}: sample 'k{k}' (index {k}), field '{name}': {problem}")
        with pytest.raises(packdata.DecodeError, match=message + r".*packdata verify"):
            indexed(pack)[k]
    with pytest.raises(packdata.DecodeError, match=re.escape(f"{pack}: sample 'k0' (index 0), field 'txt'")):
        next(iter(DataLoader(indexed(pack), batch_size=2, num_workers=1)))  # named in the worker too
    assert indexed(pack, fields=("npy",))[0][0].tolist() == list(range(6))  # the fields asked for still read


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_write_pack_records_each_index_file_digest_and_a_flipped_label_is_named(tmp_path: Path, fmt: str) -> None:
    """A multi-field pack's manifest holds the SHA-256 of all six index files; one flipped label bit is refused."""
    rows = [{"__key__": f"k{i}", "txt": f"row {i}", "cls": i % 2} for i in range(6)]
    pack = tmp_path / "p"
    packdata.write_pack(rows, pack, format=fmt, shard_samples=4, progress=False)
    assert len(assert_index_digests(pack)) == 6  # the field sizes and their offsets too
    labels = flip_label(pack)
    indexed = packdata.LMDBDataset if fmt == "lmdb" else packdata.TFRecordIndexedDataset
    with pytest.raises(PackFormatError, match=re.escape(f"{labels}: sample index file labels.i32 does not match")):
        indexed(pack)


def test_a_multi_field_pack_with_a_changed_key_is_refused_when_it_opens(tmp_path: Path) -> None:
    """Every multi-field sample carries its ``__key__``: the keys are hashed when the dataset opens, not per worker."""
    rows = [{"__key__": f"k{i}", "txt": f"row {i}"} for i in range(6)]
    pack = tmp_path / "p"
    packdata.write_pack(rows, pack, format="lmdb", progress=False)
    keys = pack / json.loads((pack / "manifest.json").read_text(encoding="utf-8"))["index"]["dir"] / "keys.utf8"
    keys.write_bytes(keys.read_bytes().replace(b"k3", b"k9"))  # another sample's key, silently
    with pytest.raises(PackFormatError, match=re.escape(f"{keys}: sample index file keys.utf8 does not match")):
        packdata.LMDBDataset(pack)


_GOOD_NPY = io.BytesIO()
np.save(_GOOD_NPY, np.arange(6, dtype=np.int64))
_GOOD = {"txt": b"fine", "json": b'{"a": 1}', "npy": _GOOD_NPY.getvalue()}


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_a_field_of_the_cls_codec_reads_as_its_bytes(tmp_path: Path, fmt: str) -> None:
    """A field named ``x.cls`` (codec cls, not the label): its pack failed to open with a bare KeyError 'cls'."""
    pack = tmp_path / "p"
    packdata.write_pack([{"__key__": "a", "txt": "hi", "x.cls": 3, "cls": 1}], pack, format=fmt, progress=False)
    indexed = packdata.LMDBDataset if fmt == "lmdb" else packdata.TFRecordIndexedDataset
    assert indexed(pack)[0] == {"__key__": "a", "txt": "hi", "x.cls": b"3", "cls": 1}


def test_a_single_field_pack_read_with_a_decoder_that_refuses_names_the_sample(
    image_folder: Path, tmp_path: Path
) -> None:
    """decode="text" over image bytes: a DecodeError naming pack and sample, for single reads and batches."""
    pack = tmp_path / "p.lmdb"
    packdata.convert(image_folder, pack, progress=False)
    key = packdata.LMDBDataset(pack).keys[1]
    message = re.escape(f"{pack}: sample {key!r} (index 1): text is not UTF-8") + r".*decode=.*packdata verify"
    with pytest.raises(packdata.DecodeError, match=message):
        packdata.LMDBDataset(pack, decode="text")[1]
    with pytest.raises(packdata.DecodeError, match=message):
        packdata.LMDBDataset(pack, decode="text").__getitems__([1, 0])


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_a_field_the_manifest_does_not_list_is_named(tmp_path: Path, fmt: str) -> None:
    """A record holding a field the manifest lacks: one PackFormatError naming pack and sample, not a KeyError."""
    rows = [{"__key__": f"k{i}", "json": {"i": i}, "txt": f"t{i}"} for i in range(3)]
    pack, donor = tmp_path / "a" / "p", tmp_path / "b" / "p"
    pack.parent.mkdir(), donor.parent.mkdir()
    packdata.write_pack(rows, pack, format=fmt, progress=False)
    packdata.write_pack([{**rows[0], "zz.bin": b"extra"}, *rows[1:]], donor, format=fmt, progress=False)
    _graft_shards(pack, donor)
    message = re.escape(f"{pack}: sample 'k0' (index 0) holds field 'zz.bin', which is not in the manifest")
    indexed = packdata.LMDBDataset if fmt == "lmdb" else packdata.TFRecordIndexedDataset
    for first in (
        lambda: indexed(pack)[0],
        lambda: next(iter(indexed(pack))),
        *([lambda: next(iter(packdata.TFRecordDataset(pack, shuffle=False)))] if fmt == "tfrecord" else []),
    ):
        with pytest.raises(PackFormatError, match=message + r".*packdata verify"):
            first()
    assert indexed(pack, fields=("json", "txt"))[0] == ({"i": 0}, "t0")  # the extra field is not asked for


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
    said = f"{listing}: no row has a 'lable' column (columns: ['label', 'path']). Name the column with --label-column"
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
    from packdata.conversion import lists

    monkeypatch.setattr(lists, "MAX_JSONL_LINE", 100)
    (tmp_path / "a.txt").write_text("alpha", encoding="utf-8")
    listing = tmp_path / "l.jsonl"
    long_line = json.dumps({"path": "a.txt", "caption": "x" * 150})
    listing.write_text(json.dumps({"path": "a.txt"}) + "\n" + long_line + "\n", encoding="utf-8")
    with pytest.raises(SourceError, match=r"l\.jsonl: line 2 is longer than 100 characters"):
        packdata.convert(listing, tmp_path / "out.lmdb", progress=False)
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


def test_pack_writer_is_atomic_and_checks_its_input(tmp_path: Path) -> None:
    dst = tmp_path / "w.lmdb"
    with pytest.raises(RuntimeError, match="boom"), packdata.PackWriter(dst) as writer:
        writer.write({"__key__": "a", "txt": "x"})
        raise RuntimeError("boom")
    assert sorted(os.listdir(tmp_path)) == []  # no pack, no partial, no lock left
    with packdata.PackWriter(dst, shard_samples=2) as writer:
        for i in range(5):
            writer.write({"__key__": f"s/{i}", "jpg": image_bytes(i), "npy": np.arange(i), "json": [i], "cls": i % 3})
        with pytest.raises(ConfigError, match="written before"):
            writer.write({"__key__": "s/0", "txt": "again"})
        with pytest.raises(ConfigError, match="npy"):
            writer.write({"__key__": "obj", "npy": np.array([object()], dtype=object)})
        with pytest.raises(ConfigError, match="__key__"):
            writer.write({"txt": "no key"})
    assert writer.result is not None and writer.result.shards == 3
    ds = packdata.LMDBDataset(dst, fields=("__key__", "npy", "json", "cls"))
    for i in range(5):
        key, array, meta, label = ds[i]
        assert (key, meta, label) == (f"s/{i}", [i], i % 3) and np.array_equal(array, np.arange(i))
    assert packdata.verify_pack(dst, progress=False).records == 5
    with pytest.raises(ConfigError, match="already exists"):
        packdata.PackWriter(dst)


def test_a_pack_writer_once_closed_or_aborted_leaves_its_path_to_the_next_writer(tmp_path: Path) -> None:
    """abort() after close(), or a second abort(), deleted the partial pack of the writer that held the path by
    then (whose close() failed with FileNotFoundError); close() after abort() raised a bare AssertionError."""
    closed, aborted = packdata.PackWriter(tmp_path / "c.lmdb"), packdata.PackWriter(tmp_path / "a.lmdb")
    for writer in (closed, aborted):
        writer.write({"__key__": "old", "txt": "x"})
    closed.close()
    aborted.abort()
    with pytest.raises(ConfigError, match="this PackWriter was aborted: it published nothing"):
        aborted.close()
    after = [packdata.PackWriter(tmp_path / "c.lmdb", overwrite=True), packdata.PackWriter(tmp_path / "a.lmdb")]
    for writer in after:
        writer.write({"__key__": "new", "txt": "y"})
    closed.abort()
    aborted.abort()
    for writer in after:
        writer.close()
        assert [s["__key__"] for s in packdata.LMDBDataset(writer.dst)] == ["new"]


def test_a_pack_writer_given_a_relative_path_writes_there_whatever_the_working_folder_becomes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After os.chdir between writes, the next shard's write failed with a bare FileNotFoundError (paths were
    relative to the working folder), leaving the partial pack and its lock behind."""
    first, then = tmp_path / "first", tmp_path / "then"
    first.mkdir()
    then.mkdir()
    monkeypatch.chdir(first)
    with packdata.PackWriter("w.lmdb", shard_samples=2) as writer:
        for i in range(5):
            writer.write({"__key__": f"{i}", "txt": "x"})
            if i == 2:
                monkeypatch.chdir(then)
    assert sorted(os.listdir(first)) == ["w.lmdb"] and os.listdir(then) == []
    assert len(packdata.LMDBDataset(first / "w.lmdb")) == 5


def test_pack_writer_refuses_a_label_that_would_name_too_many_classes(tmp_path: Path) -> None:
    """cls 2**31 - 1 passed, and close() then named every class up to it in the manifest: a MemoryError at the end."""
    with packdata.PackWriter(tmp_path / "w.lmdb") as writer:
        message = "sample 'big': cls 1048576 would name 1048577 classes; without classes= a label is below 1048576"
        with pytest.raises(ConfigError, match=re.escape(message)):
            writer.write({"__key__": "big", "txt": "x", "cls": 1 << 20})
        writer.write({"__key__": "small", "txt": "y", "cls": 2})
    assert writer.count == 1 and packdata.LMDBDataset(tmp_path / "w.lmdb").classes == ["0", "1", "2"]


@pytest.mark.parametrize("classes", [["a", "a"], [1, 2], ["a", None], "ab", ["caf\udce9", "x"]])
def test_pack_writer_refuses_classes_no_manifest_holds_before_it_writes(tmp_path: Path, classes: object) -> None:
    """Such classes were taken: the writer published a pack its readers then refused as damaged (or close() failed
    with a raw UnicodeEncodeError after every sample was written), and a str named one class per letter."""
    with pytest.raises(ConfigError, match=r"classes should (be a list of|name each class once)"):
        packdata.PackWriter(tmp_path / "w.lmdb", classes=classes)  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == []
    with packdata.PackWriter(tmp_path / "w.lmdb", classes=("b", "a")) as writer:
        writer.write({"__key__": "k", "txt": "x", "cls": 1})
    assert packdata.LMDBDataset(tmp_path / "w.lmdb").classes == ["b", "a"]


def test_pack_writer_takes_numpy_integers_as_labels_and_numbers(tmp_path: Path) -> None:
    """A label from a NumPy array (np.int64(3)) was refused: "cls should be an integer >= 0, but got np.int64(3)"."""
    labels = np.array([3, 0, 2])
    with packdata.PackWriter(tmp_path / "w.lmdb") as writer:
        for i, label in enumerate(labels):
            writer.write({"__key__": f"{i}", "cls": label, "count.txt": np.uint8(i), "x.cls": np.int32(-i)})
        for bad in (np.bool_(True), np.float64(1.0), np.int64(-2)):
            with pytest.raises(ConfigError, match="cls should be an integer >= 0"):
                writer.write({"__key__": "bad", "txt": "x", "cls": bad})
    got = [(s["cls"], s["count.txt"], s["x.cls"]) for s in packdata.LMDBDataset(tmp_path / "w.lmdb")]
    assert got == [(3, "0", b"0"), (0, "1", b"-1"), (2, "2", b"-2")] and all(type(g[0]) is int for g in got)


def test_pack_writer_names_a_field_name_or_number_it_cannot_store_in_one_config_error(tmp_path: Path) -> None:
    """A non-string field name raised a bare AttributeError; an int of 5,000 digits a bare ValueError."""
    with packdata.PackWriter(tmp_path / "w.lmdb") as writer:
        with pytest.raises(ConfigError, match=r"sample 'a': a field name should be a non-empty string, but got 3"):
            writer.write({"__key__": "a", 3: b"x"})  # type: ignore[dict-item]
        with pytest.raises(ConfigError, match=r"sample 'b': field 'txt': .*4300 digits"):
            writer.write({"__key__": "b", "txt": 10**5000})
        writer.write({"__key__": "c", "txt": 10**4000})
    assert packdata.LMDBDataset(tmp_path / "w.lmdb")[0]["txt"] == str(10**4000)


def test_pack_writer_refuses_text_in_an_image_field(tmp_path: Path) -> None:
    """A file's path passed for its image ({"jpg": "/data/0001.jpg"}) was stored as the image: every read failed."""
    with packdata.PackWriter(tmp_path / "w.lmdb") as writer:
        for name in ("jpg", "seg.png"):
            with pytest.raises(
                ConfigError, match=rf"field '{name}': a str is not an image; pass the image file's bytes"
            ):
                writer.write({"__key__": "a", name: "/data/0001.jpg"})
        writer.write({"__key__": "b", "jpg": image_bytes(0), "txt": "/data/0001.jpg"})
    assert packdata.LMDBDataset(tmp_path / "w.lmdb", decode="bytes")[0]["jpg"] == image_bytes(0)


def test_pack_writer_refuses_json_nested_past_the_encoder_in_one_config_error(tmp_path: Path) -> None:
    """A value nested 100,000 lists deep raised a bare RecursionError from write()."""
    nested: list = []
    for _ in range(100_000):
        nested = [nested]
    with packdata.PackWriter(tmp_path / "w.lmdb") as writer:
        with pytest.raises(
            ConfigError, match=r"sample 'deep': field 'json': value is not JSON-serialisable \(.*recursion"
        ):
            writer.write({"__key__": "deep", "json": nested})
        writer.write({"__key__": "flat", "json": [[1]]})
    assert packdata.LMDBDataset(tmp_path / "w.lmdb")[0]["json"] == [[1]]


def test_write_pack_names_a_sample_that_is_not_a_dict(tmp_path: Path) -> None:
    """A torchvision-style dataset of (image, label) pairs failed with "'tuple' object has no attribute 'get'"."""
    pairs = [(image_bytes(0), 1)]
    with pytest.raises(ConfigError, match=r"a sample should be a dict such as .*, but got a tuple"):
        packdata.write_pack(pairs, tmp_path / "w.lmdb", progress=False)
    assert os.listdir(tmp_path) == []


def test_write_pack_takes_a_map_style_dataset(tmp_path: Path) -> None:
    class Squares:
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> dict:
            return {"__key__": f"{i:03d}", "txt": str(i * i)}

    result = packdata.write_pack(Squares(), tmp_path / "sq.lmdb", progress=False)
    assert result.packed == 4
    assert [s["txt"] for s in packdata.LMDBDataset(tmp_path / "sq.lmdb")] == ["0", "1", "4", "9"]


def test_pil_images_are_saved_in_their_fields_format(tmp_path: Path) -> None:
    rgba = Image.fromarray(np.random.default_rng(0).integers(0, 255, (12, 16, 4), dtype=np.uint8), "RGBA")
    with packdata.PackWriter(tmp_path / "pil.lmdb") as writer:
        writer.write({"__key__": "a", "seg.png": rgba, "jpg": rgba, "webp": rgba})
    raw = packdata.LMDBDataset(tmp_path / "pil.lmdb", decode="bytes")[0]
    for name in ("seg.png", "webp"):  # lossless, alpha kept
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(raw[name]))), np.asarray(rgba)), name
    assert raw["jpg"][:3] == b"\xff\xd8\xff" and Image.open(io.BytesIO(raw["jpg"])).mode == "RGB"
    assert packdata.LMDBDataset(tmp_path / "pil.lmdb")[0]["jpg"].size == (16, 12)


def test_a_pil_image_its_field_cannot_hold_exactly_is_refused_not_changed(tmp_path: Path) -> None:
    """A 16-bit depth map in a webp field was stored as 8-bit RGB, in a jpg field as white; RGBA lost its alpha
    in bmp; a palette image without a palette lost its indices in png; modes PIL cannot write raised OSError."""
    rng = np.random.default_rng(0)
    depth = Image.fromarray(rng.integers(256, 65535, (6, 7), dtype=np.uint16))
    rgba = Image.fromarray(rng.integers(0, 255, (6, 7, 4), dtype=np.uint8), "RGBA")
    indices = Image.fromarray(rng.integers(0, 16, (6, 7), dtype=np.uint8), "P")  # no palette
    refused = {"webp": depth, "jpg": depth, "bmp": rgba, "png": indices, "x.png": Image.new("F", (3, 3))}
    with packdata.PackWriter(tmp_path / "w.lmdb") as writer:
        for name, image in refused.items():
            with pytest.raises(ConfigError, match=rf"field {re.escape(repr(name))}: .*cannot hold"):
                writer.write({"__key__": name, name: image})
        writer.write({"__key__": "kept", "depth.png": depth, "depth.tif": depth, "rgba.webp": rgba})
    stored = packdata.LMDBDataset(tmp_path / "w.lmdb", decode="bytes")[0]
    for name, image in (("depth.png", depth), ("depth.tif", depth), ("rgba.webp", rgba)):
        back = Image.open(io.BytesIO(stored[name]))
        assert back.mode == image.mode and back.tobytes() == image.tobytes(), name


def test_a_pil_image_past_the_decompression_bomb_limit_is_refused_in_one_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading the saved image back to check it raised PIL's bare DecompressionBombError."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 2x past it is an error: a 20x20 image here
    with packdata.PackWriter(tmp_path / "w.lmdb") as writer:
        with pytest.raises(ConfigError, match=r"field 'png': a PNG file cannot hold an image of mode L \(Image size"):
            writer.write({"__key__": "big", "png": Image.new("L", (20, 20))})
        writer.write({"__key__": "small", "png": Image.new("L", (5, 5))})


class _Slow:
    """A map-style dataset whose items take different times, so threads finish out of order."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n, self.fail_at = n, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if i == self.fail_at:
            raise RuntimeError(f"cannot load item {i}")
        time.sleep(0.002 * (i % 5))
        image = Image.fromarray(np.full((20 + i % 7, 30, 3), i % 255, dtype=np.uint8))
        return {"__key__": f"{i:04d}", "jpg": image, "npy": np.arange(i), "json": {"i": i}, "cls": i % 4}


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_write_pack_threads_write_the_same_pack(tmp_path: Path, fmt: str) -> None:
    packs = {}
    for workers in (0, 3):
        dst = tmp_path / f"w{workers}.{fmt}"
        packdata.write_pack(_Slow(120), dst, workers=workers, shard_samples=50, progress=False)
        packs[workers] = dst
    one, many = (read_manifest(packs[w]) for w in (0, 3))
    assert [(s.num_samples, s.sha256) for s in one.shards] == [(s.num_samples, s.sha256) for s in many.shards]
    for name in sorted(os.listdir(packs[0] / "index")):
        assert (packs[0] / "index" / name).read_bytes() == (packs[3] / "index" / name).read_bytes(), name
    assert len(one.shards) == 3 and one.num_samples == 120


def test_write_pack_stores_what_a_generator_yields_even_if_it_reuses_its_buffers(tmp_path: Path) -> None:
    """A generator that refills one array and one bytearray per sample: threads encoded samples after the
    generator had moved on, so 46 of 50 samples silently held a later sample's array and bytes."""

    def reusing():
        array, buffer = np.zeros(4, dtype=np.int64), bytearray(3)
        for i in range(50):
            array[:] = i
            buffer[:] = bytes((i, i, i))
            yield {"__key__": f"{i:02d}", "npy": array, "bin": buffer}

    packdata.write_pack(reusing(), tmp_path / "w.lmdb", workers=2, progress=False)
    for i, sample in enumerate(packdata.LMDBDataset(tmp_path / "w.lmdb")):
        assert (sample["__key__"], sample["npy"].tolist(), sample["bin"]) == (f"{i:02d}", [i] * 4, bytes((i,) * 3))


def _listed(batch: list) -> list:
    return batch


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_every_written_field_reads_back_byte_for_byte_through_dataloader_workers(tmp_path: Path, fmt: str) -> None:
    """Fields some samples lack, empty ones, pickle bytes (never unpickled), keys with NUL, newline and unicode."""
    rng = np.random.default_rng(0)
    samples = []
    for i in range(23):
        sample = {"__key__": f"{i:03d}" if i % 5 else f"d/{i}/ü\x00\n", "jpg": rng.bytes(int(rng.integers(0, 90)))}
        sample |= {"txt": rng.bytes(7), "bin": b"" if i % 3 == 0 else rng.bytes(5), "pyd": b"\x80\x04K\x01."}
        if i % 2:
            sample["seg.png"] = rng.bytes(30)
        if i % 4:
            sample["cls"] = i % 6
        samples.append(sample)
    pack = tmp_path / f"p.{fmt}"
    packdata.write_pack(samples, pack, format=fmt, shard_samples=5, progress=False)
    datasets = [packdata.LMDBDataset(pack, decode="bytes")] if fmt == "lmdb" else []
    if fmt == "tfrecord":
        datasets += [
            packdata.TFRecordIndexedDataset(pack, decode="bytes"),
            packdata.TFRecordDataset(pack, decode="bytes"),
        ]
    for ds in datasets:
        for method in ("fork", "spawn"):
            loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=_listed, multiprocessing_context=method)
            read = [s for batch in loader for s in batch]
            by_key = {s["__key__"]: s for s in read}  # each key once, every field's bytes and the label as written
            assert len(read) == len(by_key) == len(samples), (type(ds).__name__, method)
            assert all(by_key[s["__key__"]] == s for s in samples), (type(ds).__name__, method)


def test_write_pack_failure_in_a_thread_leaves_no_pack(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="cannot load item 77"):
        packdata.write_pack(_Slow(200, fail_at=77), tmp_path / "w.lmdb", workers=4, progress=False)
    assert os.listdir(tmp_path) == []
    with pytest.raises(ConfigError, match="workers should be 0 or more"):
        packdata.write_pack([], tmp_path / "w.lmdb", workers=-1, progress=False)


def test_a_group_split_by_a_subfolder_named_like_it_is_one_sample(tmp_path: Path) -> None:
    """a.bin, then the folder a.d/ (sorted between them), then a.json: once two samples keyed 'a', one field each."""
    src = tmp_path / "src"
    (src / "a.d").mkdir(parents=True)
    (src / "a.bin").write_bytes(b"\x00\x01")
    (src / "a.d" / "x.txt").write_text("inside", encoding="utf-8")
    (src / "a.d" / "x.json").write_text("[2]", encoding="utf-8")
    (src / "a.json").write_text("[1]", encoding="utf-8")
    (src / "b.json").write_text("[3]", encoding="utf-8")
    result = packdata.convert(src, tmp_path / "out.lmdb", layout="grouped", progress=False)
    assert (result.found, result.packed, result.skipped) == (3, 3, {})
    samples = {s["__key__"]: s for s in packdata.LMDBDataset(tmp_path / "out.lmdb", decode="bytes")}
    assert sorted(samples) == ["a", "a.d/x", "b"]
    assert (bytes(samples["a"]["bin"]), bytes(samples["a"]["json"])) == (b"\x00\x01", b"[1]")
    assert (bytes(samples["a.d/x"]["txt"]), bytes(samples["a.d/x"]["json"])) == (b"inside", b"[2]")


def test_a_pickled_npy_file_is_never_loaded(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("ok", encoding="utf-8")
    with open(src / "a.npy", "wb") as f:
        np.save(f, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    (src / "b.txt").write_text("fine", encoding="utf-8")
    (src / "b.npy").write_bytes(_npy(np.ones(3)))
    result = packdata.convert(src, tmp_path / "out.lmdb", layout="grouped", progress=False)
    assert result.skipped == {"not npy": 1}
    assert np.array_equal(packdata.LMDBDataset(tmp_path / "out.lmdb")[0]["npy"], np.ones(3))


def test_a_source_json_nested_past_the_parser_is_skipped_not_a_traceback(tmp_path: Path) -> None:
    """Convert's check of a .json let json.loads's RecursionError out: the whole conversion died with a traceback."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("deep", encoding="utf-8")
    (src / "a.json").write_text("[" * 100_000, encoding="utf-8")
    (src / "b.txt").write_text("flat", encoding="utf-8")
    (src / "b.json").write_text("[1]", encoding="utf-8")
    result = packdata.convert(src, tmp_path / "out.lmdb", layout="grouped", progress=False)
    assert result.skipped == {"not JSON": 1}
    assert result.skip_examples[0]["detail"] == "field 'json': nested deeper than the JSON parser goes"
    assert [s["json"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")] == [[1]]


@pytest.mark.parametrize("descr", ["|S0", "|V0", "<U0", []])
def test_an_npy_of_zero_byte_elements_is_refused_past_one_element_a_byte(tmp_path: Path, descr: object) -> None:
    """A header alone declared 10**18 elements of 0 bytes: checked sound, np.load gave an array no loop finishes."""
    from numpy.lib import format as npy_format

    header = io.BytesIO()
    npy_format.write_array_header_1_0(header, {"descr": descr, "fortran_order": False, "shape": (10**18,)})
    huge = header.getvalue()
    problem = "its header's shape (1000000000000000000,) holds 1000000000000000000 elements of 0 bytes"
    small = _npy(np.zeros(4, dtype=("f8", (0,))))  # numpy writes this: 4 elements of 0 bytes (|V0), 128 bytes
    pack = tmp_path / "p.lmdb"
    packdata.write_pack([{"__key__": "huge", "npy": huge}, {"__key__": "small", "npy": small}], pack, progress=False)
    named = f"sample 'huge' (index 0), field 'npy': .npy array cannot be read ({problem}"
    with pytest.raises(packdata.DecodeError, match=re.escape(named)):
        packdata.LMDBDataset(pack)[0]
    assert packdata.LMDBDataset(pack)[1]["npy"].shape == (4,)
    src = tmp_path / "src"
    src.mkdir()
    for key, data in [("huge", huge), ("small", small)]:
        (src / f"{key}.txt").write_text(key, encoding="utf-8")
        (src / f"{key}.npy").write_bytes(data)
    result = packdata.convert(src, tmp_path / "out.lmdb", layout="grouped", progress=False)
    assert result.skipped == {"not npy": 1} and result.skip_examples[0]["detail"].startswith(f"field 'npy': {problem}")
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")] == ["small"]


def test_pack_writer_refuses_an_array_whose_npy_it_could_not_read_back(tmp_path: Path) -> None:
    """A structured array of 400 fields was written, its .npy header past numpy's safe limit: every read failed."""
    names = [f"column_number_{i:04d}" for i in range(400)]
    wide = np.zeros(2, dtype=[(name, "<f8") for name in names])
    with packdata.PackWriter(tmp_path / "w.lmdb") as writer:
        with pytest.raises(ConfigError, match=r"sample 'wide': field 'npy': .*Header info length"):
            writer.write({"__key__": "wide", "npy": wide})
        writer.write({"__key__": "narrow", "npy": wide[names[:2]]})
    assert packdata.LMDBDataset(tmp_path / "w.lmdb")[0]["npy"].dtype.names == tuple(names[:2])


def _npy(array: np.ndarray) -> bytes:
    import io

    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def test_version_1_pack_still_reads(tmp_path: Path) -> None:
    pack = tmp_path / "v1.lmdb"
    shutil.copytree(FIXTURE, pack)
    manifest = json.loads((pack / "manifest.json").read_text())
    assert manifest["format_version"] == 1 and manifest["kind"] == "image"
    ds = packdata.LMDBDataset(pack)
    assert ds.classes == ["cat", "dog"] and list(ds.targets) == [0, 0, 0, 1, 1, 1]
    image, label = ds[4]
    assert image.size == (16, 12) and label == 1
    assert packdata.verify_pack(pack, progress=False).records == 6
    assert (pack / "shard-00000.lmdb" / DATA_FILE).read_bytes().count(b"PDR1") == 6  # version-1 records


def test_text_pack_decodes_as_text_by_default(tmp_path: Path) -> None:
    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    (src / "a.txt").write_text("hello", encoding="utf-8")
    packdata.convert(tmp_path / "src", tmp_path / "t.lmdb", progress=False)
    assert packdata.LMDBDataset(tmp_path / "t.lmdb")[0] == ("hello", 0)


def test_ls_cat_export_round_trip(tmp_path: Path) -> None:
    src = _grouped(tmp_path / "src")
    (src / "lonely.jpg").unlink()
    pack = tmp_path / "out.lmdb"
    runner = CliRunner()
    done = runner.invoke(cli, ["convert", str(src), str(pack), "-q", "--layout", "grouped"])
    assert done.exit_code == 0, done.output
    listed = runner.invoke(cli, ["ls", str(pack), "--json", "--limit", "0"])
    rows = [json.loads(line) for line in listed.output.splitlines()]
    assert sorted(r["key"] for r in rows) == sorted([*KEYS, "dogs.v2/d"])
    assert rows[0]["fields"] == {n: len(d) for n, d in _fields_of(src, rows[0]["key"]).items()}
    shown = runner.invoke(cli, ["cat", str(pack), "café", "--field", "txt"])
    assert shown.exit_code == 0 and shown.stdout_bytes == (src / "café.txt").read_bytes()
    assert read_field(pack, "#0", "jpg") == (src / f"{rows[0]['key']}.jpg").read_bytes()
    missing = runner.invoke(cli, ["cat", str(pack), "nope"])
    assert missing.exit_code == 1 and "no sample has the key 'nope'" in missing.output
    for odd, said in [("#²", "no sample has the key '#²'"), ("#" + "9" * 5000, "index 999999999999999999... is out")]:
        refused = runner.invoke(cli, ["cat", str(pack), odd])  # a raw ValueError each (isdigit takes '²'; int() 4,300)
        assert refused.exit_code == 1 and said in refused.output, refused.output
    out = tmp_path / "exported"
    done = runner.invoke(cli, ["export", str(pack), str(out)])
    assert done.exit_code == 0, done.output
    comparison = filecmp.dircmp(src, out)
    assert _same_tree(comparison), comparison.report_full_closure()


def test_ls_and_convert_show_keys_with_newlines_and_control_characters_escaped(tmp_path: Path) -> None:
    """A key holding a newline prints as one line, quoted; an escape sequence never reaches the terminal raw."""
    odd = "cat\x1b[2J"
    keys = [f"{odd}/a\nb.jpg", f"{odd}/tab\there.jpg", "dog/plain café.jpg"]
    for k, key in enumerate(keys):
        (tmp_path / "src" / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / key).write_bytes(image_bytes(k))
    bad = f"{odd}/bad\nname.jpg"
    (tmp_path / "src" / bad).write_bytes(b"not an image")
    pack = tmp_path / "out.lmdb"
    runner = CliRunner()
    done = runner.invoke(cli, ["convert", str(tmp_path / "src"), str(pack), "--verify-images"])
    assert done.exit_code == 0, done.output
    assert f"    {bad!r}: corrupt image: " in done.output
    assert "\x1b" not in done.output
    listed = runner.invoke(cli, ["ls", str(pack)])
    assert listed.exit_code == 0 and "\x1b" not in listed.output, listed.output
    columns = [line.split("\t") for line in listed.output.splitlines()]
    assert [c[1] for c in columns] == [repr(keys[0]), repr(keys[1]), keys[2]]  # one line each; plain keys as they are
    assert [c[2] for c in columns] == [f"0 ({odd!r})", f"0 ({odd!r})", "1 (dog)"]
    rows = [json.loads(line) for line in runner.invoke(cli, ["ls", str(pack), "--json"]).output.splitlines()]
    assert [row["key"] for row in rows] == keys  # JSON: exact


def test_export_of_an_imagefolder_pack_gives_the_source_back(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for c in ("a", "b"):
        (src / c).mkdir(parents=True)
        for i in range(3):
            (src / c / f"{i}.jpg").write_bytes(image_bytes(i + ord(c)))
    packdata.convert(src, tmp_path / "p.lmdb", progress=False)
    result = export_pack(tmp_path / "p.lmdb", tmp_path / "back")
    assert result.samples == 6 and not result.refused
    assert _same_tree(filecmp.dircmp(src, tmp_path / "back"))
    assert [r["class"] for r in list_samples(tmp_path / "p.lmdb")] == ["a"] * 3 + ["b"] * 3


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_cat_and_export_give_what_a_dataset_reads_from_the_index_or_refuse(tmp_path: Path, fmt: str) -> None:
    """They read records alone: a label the index (which datasets read) no longer shares was exported and cat as it was.

    A pack written before the manifest held index digests: only reading the records against the index tells.
    """
    src = tmp_path / "src"
    for c in ("a", "b"):
        (src / c).mkdir(parents=True)
        for i in range(3):
            (src / c / f"{i}.jpg").write_bytes(image_bytes(i + ord(c)))
    pack = packdata.convert(src, tmp_path / "p", format=fmt, progress=False).pack
    rewrite_manifest(pack, lambda d: d["index"].pop("sha256"))
    flip_label(pack)  # sample 0 (a/0.jpg): label 1 in the index, 0 in its record
    assert next(iter(list_samples(pack)))["label"] == 1
    if fmt == "lmdb":
        assert packdata.LMDBDataset(pack, decode="bytes")[0][1] == 1  # what training sees
    out = CliRunner().invoke(cli, ["cat", str(pack), "#0", "--field", "cls"])
    assert out.exit_code == 1 and "record 0 (key 'a/0.jpg') does not match the sample index" in out.output
    out = CliRunner().invoke(cli, ["export", str(pack), str(tmp_path / "back")])
    assert out.exit_code == 1 and "record 0 (key 'a/0.jpg') does not match the sample index" in out.output
    assert not any((tmp_path / "back").rglob("*.jpg"))


def test_export_refuses_keys_that_leave_the_folder(tmp_path: Path) -> None:
    with packdata.PackWriter(tmp_path / "evil.lmdb") as writer:
        writer.write({"__key__": "../escape", "txt": "x"})
        writer.write({"__key__": "/abs/path", "txt": "y"})
        writer.write({"__key__": "fine/one", "txt": "z"})
        writer.write({"__key__": "fine/one.txt/x", "txt": "a folder where a file is"})
    result = export_pack(tmp_path / "evil.lmdb", tmp_path / "out")
    assert result.samples == 1
    assert [r["key"] for r in result.refused] == ["../escape", "/abs/path", "fine/one.txt/x"]
    assert not (tmp_path / "escape.txt").exists()
    assert (tmp_path / "out" / "fine" / "one.txt").read_text() == "z"


def test_export_refuses_a_key_the_file_system_rejects_and_goes_on(tmp_path: Path) -> None:
    with packdata.PackWriter(tmp_path / "long.lmdb") as writer:
        writer.write({"__key__": "a", "txt": "first"})
        writer.write({"__key__": "x" * 300, "txt": "a name too long for the file system"})
        writer.write({"__key__": "d/" + "y" * 300, "txt": "its folder is made, then removed"})
        writer.write({"__key__": "z", "txt": "last"})
    result = export_pack(tmp_path / "long.lmdb", tmp_path / "out")
    assert (result.samples, result.files) == (2, 2)
    assert [r["key"] for r in result.refused] == ["x" * 300, "d/" + "y" * 300]
    assert all("the file system refuses its files (File name too long)" in r["reason"] for r in result.refused)
    assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == ["a.txt", "z.txt"]
    done = CliRunner().invoke(cli, ["export", str(tmp_path / "long.lmdb"), str(tmp_path / "cli")])
    assert done.exit_code == 1 and "exported 2 samples as 2 files" in done.output  # refusals exit 1, listed
    assert f"{'x' * 300}: the file system refuses its files (File name too long)" in done.output
    assert done.exception is None or isinstance(done.exception, SystemExit)


def test_export_of_a_key_of_many_folders_writes_it_without_running_out_of_stack(tmp_path: Path) -> None:
    """A key of 1,500 parts (3,000 bytes: a path Linux takes): Path.mkdir(parents=True) recursed once a folder."""
    deep = "d/" * 1500 + "leaf"
    with packdata.PackWriter(tmp_path / "deep.lmdb") as writer:
        writer.write({"__key__": deep, "txt": "deep"})
        writer.write({"__key__": "d/" * 1499 + "e", "txt": "beside it, in folders already made"})
        writer.write({"__key__": "z", "txt": "last"})
    try:
        result = export_pack(tmp_path / "deep.lmdb", tmp_path / "out")
        assert (result.samples, result.files, result.refused) == (3, 3, [])
        assert (tmp_path / "out" / f"{deep}.txt").read_text() == "deep"
        assert (tmp_path / "out" / ("d/" * 1499 + "e.txt")).read_text() == "beside it, in folders already made"
        assert (tmp_path / "out" / "z.txt").read_text() == "last"
    finally:  # shutil.rmtree (pytest's clean-up of old temporary folders) recurses once per level: a crash later
        subprocess.run(["rm", "-rf", str(tmp_path / "out")], check=True)


def test_export_onto_a_full_disk_stops_with_one_capacity_error(tmp_path: Path) -> None:
    """A real 1 MiB tmpfs: two samples of 400 KB fit, the third fills it."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    with packdata.PackWriter(tmp_path / "p.lmdb") as writer:
        for key in ("a", "b", "c"):
            writer.write({"__key__": key, "txt": key * 400_000})
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=True)
    try:
        done = CliRunner().invoke(cli, ["export", str(tmp_path / "p.lmdb"), str(disk / "out")])
        assert done.exit_code == 1
        assert done.output == (
            f"Error: {disk / 'out'}: the disk is full (No space left on device) after 2 samples were exported. "
            "Free space, delete the partial export and run it again\n"
        )
        assert sorted(p.name for p in (disk / "out").iterdir()) == ["a.txt", "b.txt"]  # c's partly written file is gone
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _same_tree(comparison: filecmp.dircmp) -> bool:
    _, mismatch, errors = filecmp.cmpfiles(comparison.left, comparison.right, comparison.common_files, shallow=False)
    if comparison.left_only or comparison.right_only or mismatch or errors:
        return False
    return all(_same_tree(sub) for sub in comparison.subdirs.values())


def test_field_block_is_self_checking() -> None:
    from packdata.pack.fields import FieldError, encode_block

    block = encode_block({"txt": b"hello", "json": b"{}"})
    assert decode_block(block) == {"json": b"{}", "txt": b"hello"}
    assert decode_block(block, ["txt"]) == {"txt": b"hello"}
    for cut in (3, len(block) - 1):
        with pytest.raises(FieldError):
            decode_block(block[:cut])
    with pytest.raises(FieldError, match="CRC"):
        decode_block(block[:-1] + bytes([block[-1] ^ 1]))
    with pytest.raises(FieldError):
        encode_block({"../x": b""})


def test_multi_field_tfrecord_is_one_feature_per_field(tmp_path: Path) -> None:
    from tfrecord import example_pb2

    src = _grouped(tmp_path / "src")
    pack = tmp_path / "caps"
    packdata.convert(src, pack, format="tfrecord", require=("jpg", "txt"), shard_samples=2, progress=False)
    assert packdata.verify_pack(pack, progress=False).records == 5
    shard = sorted(pack.glob("*.tfrecord"))[0]
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    example = example_pb2.Example()
    example.ParseFromString(raw[12 : 12 + n])
    feature = example.features.feature
    key = feature["image/filename"].bytes_list.value[0].decode()
    files = _fields_of(src, key)
    assert feature["image/encoded"].bytes_list.value[0] == files["jpg"]
    assert feature["image/format"].bytes_list.value[0] == b"jpeg"
    assert feature["txt"].bytes_list.value[0] == files["txt"]
    assert feature["json"].bytes_list.value[0] == files["json"]
    assert list(feature["packdata/fields"].bytes_list.value) == sorted(n.encode() for n in files)
    for reader in (
        packdata.TFRecordIndexedDataset(pack, decode="bytes"),
        packdata.TFRecordDataset(pack, decode="bytes", shuffle=False),
    ):
        for sample in reader:
            sample = dict(sample)
            key = sample.pop("__key__")
            sample.pop("cls", None)
            assert sample == _fields_of(src, key)
    loader = DataLoader(packdata.TFRecordDataset(pack, fields=("__key__", "txt")), batch_size=None, num_workers=2)
    assert sorted(k for k, _ in loader) == sorted([*KEYS, "dogs.v2/d"])
    out = tmp_path / "back"
    export_pack(pack, out)
    (src / "lonely.jpg").unlink()
    assert _same_tree(filecmp.dircmp(src, out))


_TF_CHECK = """
import sys
import tensorflow as tf
pack, src = sys.argv[1], sys.argv[2]
spec = {name: tf.io.FixedLenFeature([], tf.string) for name in ("image/encoded", "image/filename", "txt", "json")}
spec["image/class/label"] = tf.io.FixedLenFeature([], tf.int64)
files = sorted(tf.io.gfile.glob(pack + "/*.tfrecord"))
n = 0
for rec in tf.data.TFRecordDataset(files).map(lambda r: tf.io.parse_single_example(r, spec)):
    key = rec["image/filename"].numpy().decode()
    for field, feature in (("jpg", "image/encoded"), ("txt", "txt"), ("json", "json")):
        assert rec[feature].numpy() == open(f"{src}/{key}.{field}", "rb").read(), (key, field)
    tf.io.decode_jpeg(rec["image/encoded"])
    n += 1
print(n)
"""


def test_tf_data_reads_every_field(tmp_path: Path) -> None:
    """tf.data + parse_single_example read every field; TensorFlow runs in PACKDATA_TF_PYTHON or this interpreter."""
    import importlib.util
    import subprocess
    import sys

    python = os.environ.get("PACKDATA_TF_PYTHON") or (
        sys.executable if importlib.util.find_spec("tensorflow") else None
    )
    if python is None:
        pytest.skip("TensorFlow is optional: install it, or point PACKDATA_TF_PYTHON at a Python that has it")
    src = _grouped(tmp_path / "src")
    for name in ("lonely.jpg", "dogs.v2/d.jpg", "dogs.v2/d.txt"):
        (src / name).unlink()
    pack = tmp_path / "caps"
    packdata.convert(src, pack, format="tfrecord", require=("jpg", "txt", "json"), progress=False)
    done = subprocess.run([python, "-c", _TF_CHECK, str(pack), str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == str(len(KEYS))


def _wds_shards(folder: Path, count: int = 7, per_shard: int = 3) -> list[dict]:
    """Tars written by the webdataset package itself; returns the samples as written."""
    wds = pytest.importorskip("webdataset")
    folder.mkdir()
    samples = [
        {"__key__": f"s/{i:04d}", "jpg": image_bytes(i), "txt": f"caption {i}", "json": {"i": i}, "cls": i % 3}
        for i in range(count)
    ]
    with wds.ShardWriter(str(folder / "data-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for sample in samples:
            sink.write(sample)
    return samples


def test_webdataset_tars_convert_field_equal(tmp_path: Path) -> None:
    samples = _wds_shards(tmp_path / "tars")
    pattern = str(tmp_path / "tars" / "data-{000000..000002}.tar")
    result = packdata.convert(pattern, tmp_path / "out.lmdb", progress=False)
    assert result.packed == 7 and not result.skipped
    ds = packdata.LMDBDataset(tmp_path / "out.lmdb", decode={"jpg": "bytes"})
    assert ds.classes == ["0", "1", "2"]
    for i, expected in enumerate(samples):
        assert ds[i] == {**expected, "txt": expected["txt"]}
    again = packdata.convert(str(tmp_path / "tars" / "data-*.tar"), tmp_path / "glob.lmdb", progress=False)
    assert again.packed == 7


def test_a_tar_of_a_folder_made_with_tar_c_dot_keys_samples_without_its_dot_prefix(tmp_path: Path) -> None:
    """``tar -cf x.tar -C DIR .`` names members ./KEY.FIELD: the key is KEY (a '.' part would stop export)."""
    files = tmp_path / "files"
    (files / "sub").mkdir(parents=True)
    for key in ("000", "sub/001"):
        (files / f"{key}.jpg").write_bytes(image_bytes(int(key[-1])))
        (files / f"{key}.txt").write_text(f"caption {key}", encoding="utf-8")
    subprocess.run(["tar", "-cf", str(tmp_path / "x.tar"), "-C", str(files), "."], check=True)
    result = packdata.convert(str(tmp_path / "x.tar"), tmp_path / "out.lmdb", progress=False)
    assert result.packed == 2 and not result.skipped
    assert packdata.LMDBDataset(tmp_path / "out.lmdb").keys[:] == ["000", "sub/001"]
    export_pack(tmp_path / "out.lmdb", tmp_path / "back")
    assert not filecmp.dircmp(files, tmp_path / "back").diff_files
    assert sorted(p.relative_to(tmp_path / "back").as_posix() for p in (tmp_path / "back").rglob("*.*")) == [
        "000.jpg",
        "000.txt",
        "sub/001.jpg",
        "sub/001.txt",
    ]


def test_tar_member_names_become_relative_keys_and_one_leading_out_is_a_bad_key(tmp_path: Path) -> None:
    """Members named '../x.txt', '/abs/y.txt', 'a/./w.txt', 'a//v.txt', 'a/../u.txt' were packed under those
    keys verbatim, where a key is a relative path (export refused each). They are now keyed as tar extracts them
    (leading '/', '.', empty parts and an inner '..' dropped); one whose '..' leads out is a 'bad key' skip."""
    names = ["../x.txt", "/abs/y.txt", "./z.txt", "a/./w.txt", "a//v.txt", "a/../u.txt", "a/b/../../../t.txt"]
    (tmp_path / "d.tar").write_bytes(_tar_of([(name, name.encode()) for name in names]))
    result = packdata.convert(str(tmp_path / "d.tar"), tmp_path / "out.lmdb", progress=False)
    assert (result.packed, result.skipped) == (5, {"bad key": 2})
    detail = "its '..' leads out of the tar's top folder: a key is a relative path inside it (tar refuses it too)"
    assert result.skip_examples == [
        {"key": f"d.tar:{name}", "reason": "bad key", "detail": detail} for name in ("../x.txt", "a/b/../../../t.txt")
    ]
    packed = {s["__key__"]: s["txt"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")}
    assert packed == {"abs/y": "/abs/y.txt", "z": "./z.txt", "a/w": "a/./w.txt", "a/v": "a//v.txt", "u": "a/../u.txt"}
    assert export_pack(tmp_path / "out.lmdb", tmp_path / "back").refused == []


def test_tars_are_read_once_even_with_a_progress_bar(tmp_path: Path, monkeypatch) -> None:
    from packdata.conversion.tars import TarSource

    _wds_shards(tmp_path / "tars")
    reads: list[str] = []
    real = TarSource._read

    def counting(self, shard):
        reads.append(shard)
        return real(self, shard)

    monkeypatch.setattr(TarSource, "_read", counting)
    result = packdata.convert(str(tmp_path / "tars" / "data-*.tar"), tmp_path / "out.lmdb", progress=True)
    assert result.packed == 7 and sorted(reads) == sorted(set(reads)) and len(reads) == 3  # no counting walk


_LOW_MEMORY_CLI = """
import resource, sys
from packdata.cli import main
vm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))  # 1 GiB more address space
main(sys.argv[1:])
"""


def test_a_local_tar_that_fails_not_as_a_damaged_tar_is_named_by_its_path_with_a_hint_for_a_file(
    tmp_path: Path,
) -> None:
    """It said '://data.tar: cannot read the tar ... Check the URL, the endpoint and the credentials': not a URL."""
    tar = tmp_path / "data.tar"
    size = 1_500_000_000  # one member past the child's memory: reading it raises MemoryError
    info = tarfile.TarInfo("s000.bin")
    info.size = size
    header = info.tobuf(format=tarfile.USTAR_FORMAT)
    with open(tar, "wb") as f:  # sparse: no disk used, read back as zeros
        f.write(header)
        f.truncate(len(header) + size + (-size % 512) + 1024)
    dst = tmp_path / "out.lmdb"
    args = [sys.executable, "-c", _LOW_MEMORY_CLI, "convert", str(tar), str(dst), "-q"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == (
        f"Error: {tar}: cannot read the tar (MemoryError). "
        "Free memory (or convert on a machine with more), then rerun with --resume"
    )
    assert partial_path(dst).is_dir() and not dst.exists()  # kept, to resume


def test_gzipped_damaged_and_duplicate_tars(tmp_path: Path) -> None:
    import gzip

    _wds_shards(tmp_path / "tars", count=4, per_shard=2)
    first = tmp_path / "tars" / "data-000000.tar"
    (tmp_path / "tars" / "data-000000.tar.gz").write_bytes(gzip.compress(first.read_bytes()))
    copy = tmp_path / "tars" / "data-000002.tar"  # the same keys again: duplicates
    shutil.copy(first, copy)
    cut = tmp_path / "tars" / "data-000003.tar"
    with tarfile.open(cut, "w") as tar:
        link = tarfile.TarInfo("x/0.txt")
        link.type = tarfile.SYMTYPE
        link.linkname = "/etc/passwd"
        tar.addfile(link)
        for name, data in (("x/1.txt", b"one"), ("x/2.txt", b"two" * 4000)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    cut.write_bytes(cut.read_bytes()[:3500])  # cut inside x/2's data
    result = packdata.convert(
        str(tmp_path / "tars" / "data-{000000..000003}.tar"), tmp_path / "out.lmdb", progress=False
    )
    assert result.packed == 5  # 4 good samples + x/1 before the cut; x/2 is cut and dropped
    assert result.skipped == {"duplicate key": 2, "corrupt tar": 1, "not a regular file": 1}
    assert packdata.LMDBDataset(tmp_path / "out.lmdb")[4] == {"__key__": "x/1", "txt": "one"}
    gz = packdata.convert(str(tmp_path / "tars" / "data-000000.tar.gz"), tmp_path / "gz.lmdb", progress=False)
    assert gz.packed == 2
    with pytest.raises(packdata.SourceError, match="no such tar shard"):
        packdata.convert(str(tmp_path / "tars" / "data-{000000..000009}.tar"), tmp_path / "x.lmdb", progress=False)


def test_a_tar_pattern_naming_too_many_shards_in_all_is_one_line(tmp_path: Path) -> None:
    """Each range was bounded, not their product: two ranges of a million named a trillion, a MemoryError.

    (1001 x 1001 here: past the bound, yet cheap to expand on the previous commit, which then looked each up.)
    """
    pattern = str(tmp_path / "data-{0..1000}-{0..1000}.tar")  # 1,002,001 names
    result = CliRunner().invoke(cli, ["convert", pattern, str(tmp_path / "x.lmdb"), "-q"])
    assert (result.exit_code, result.output) == (1, f"Error: {pattern}: the pattern names more than 1000000 shards\n")
    assert os.listdir(tmp_path) == []


def _tar_of(members: list[tuple[str | bytes, bytes]]) -> bytes:

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(os.fsdecode(name) if isinstance(name, bytes) else name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


@pytest.mark.parametrize("damage", ["cut at a member's end", "a damaged header", "a zeroed header"])
def test_a_tar_damaged_between_members_is_named_not_ended_in_silence(tmp_path: Path, damage: str) -> None:
    """tarfile's stream mode ended the archive without a word at such a header: the samples after it were lost."""
    raw = bytearray(_tar_of([(f"s{i}.txt", b"sample %d " % i * 50) for i in range(4)]))
    header = 2 * 1024  # the third member's header (each member: a header block and one data block)
    if damage == "cut at a member's end":
        raw = raw[:header]
    elif damage == "a damaged header":
        raw[header + 3] ^= 0xFF
    else:
        raw[header : header + 512] = bytes(512)
    (tmp_path / "data.tar").write_bytes(bytes(raw))
    result = packdata.convert(str(tmp_path / "data.tar"), tmp_path / "out.lmdb", progress=False)
    assert result.skipped == {"corrupt tar": 1}
    assert result.packed == 1  # s0; s1 (the sample being read) is dropped, never packed partly
    assert result.skip_examples[0]["key"] == "data.tar:s1"


def test_a_gzipped_tar_is_checked_whole_before_any_sample_is_packed(tmp_path: Path) -> None:
    """gzip's CRC is at its end, and tarfile's stream mode never read it: a flipped byte was packed as data."""
    import gzip

    first = os.urandom(3000)  # incompressible: stored, so the flip lands in the member's bytes
    packed = bytearray(gzip.compress(_tar_of([("a.bin", first), ("b.bin", os.urandom(3000))]), compresslevel=0))
    packed[packed.index(first[:64]) + 100] ^= 0xFF
    (tmp_path / "flip.tar.gz").write_bytes(bytes(packed))
    (tmp_path / "cut.tar.gz").write_bytes(gzip.compress(_tar_of([("c.bin", b"c" * 3000)]))[:-12])
    for name in ("flip.tar.gz", "cut.tar.gz"):
        with pytest.raises(packdata.SourceError, match=r"skipped: 1 corrupt tar"):
            packdata.convert(str(tmp_path / name), tmp_path / f"{name}.lmdb", progress=False)
    whole = tmp_path / "whole.tar.gz"
    whole.write_bytes(gzip.compress(_tar_of([("a.bin", first)])))
    assert (
        packdata.LMDBDataset(packdata.convert(str(whole), tmp_path / "w.lmdb", progress=False).pack)[0]["bin"] == first
    )


def test_a_fifo_matched_by_a_shard_glob_is_skipped_as_corrupt_not_waited_on(tmp_path: Path) -> None:
    (tmp_path / "data-0.tar").write_bytes(_tar_of([("a.txt", b"x")]))
    os.mkfifo(tmp_path / "data-1.tar")  # an open() for reading would block until a writer came
    result = packdata.convert(str(tmp_path / "data-*.tar"), tmp_path / "out.lmdb", progress=False)
    assert result.packed == 1 and result.skipped == {"corrupt tar": 1}
    assert "a FIFO" in result.skip_examples[0]["detail"]


def test_a_tar_member_named_in_non_utf8_bytes_is_skipped_by_name(tmp_path: Path) -> None:
    """It once reached the sample index, which cannot hold it: a traceback, and no resume could pass it."""
    (tmp_path / "data.tar").write_bytes(_tar_of([(b"caf\xe9.txt", b"x"), ("ok.txt", b"y")]))
    result = packdata.convert(str(tmp_path / "data.tar"), tmp_path / "out.lmdb", progress=False)
    assert result.packed == 1 and result.skipped == {"name not UTF-8": 1}


def test_a_tar_member_named_in_non_utf8_bytes_past_its_key_skips_its_sample(tmp_path: Path) -> None:
    """c.cls\\xe9 was skipped by name alone and sample c packed without its label (-1). Now c is skipped whole."""
    members: list[tuple[str | bytes, bytes]] = [("c.json", b"[3]"), (b"c.cls\xe9", b"3"), ("d.json", b"[4]")]
    (tmp_path / "data.tar").write_bytes(_tar_of(members))
    result = packdata.convert(str(tmp_path / "data.tar"), tmp_path / "out.lmdb", progress=False)
    assert result.packed == 1 and result.skipped == {"name not UTF-8": 1}
    said = "member 'c.cls\\xe9' is named in bytes not UTF-8: the sample is skipped whole"
    assert [(e["key"], e["detail"]) for e in result.skip_examples] == [("data.tar:c", said)]
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")] == ["d"]


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_a_tar_member_whose_key_no_record_holds_is_skipped(tmp_path: Path, fmt: str) -> None:
    """A pax name of 70,000 bytes; an LMDB record holds 65,535 (a uint16 length): it once crashed the writer."""

    key = "k" * 70_000
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in (f"{key}.txt", "ok.txt"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    (tmp_path / "data.tar").write_bytes(out.getvalue())
    result = packdata.convert(str(tmp_path / "data.tar"), tmp_path / f"out.{fmt}", progress=False)
    assert result.packed == 1 and result.skipped == {"key too long": 1}
    assert result.skip_examples[0] == {
        "key": f"{key[:100]}...",
        "reason": "key too long",
        "detail": "70000 bytes in UTF-8, at most 65535 fit",
    }


def test_pack_writer_refuses_a_key_no_record_holds_when_it_is_written(tmp_path: Path) -> None:
    """Such keys were taken, then failed the whole pack at close with a raw RecordError or UnicodeEncodeError."""
    with packdata.PackWriter(tmp_path / "w.lmdb") as writer:
        with pytest.raises(ConfigError, match=r"is longer than 65535 bytes in UTF-8"):
            writer.write({"__key__": "k" * 65_536, "txt": "x"})
        with pytest.raises(ConfigError, match=r"key 'caf\\udce9' is not valid UTF-8"):
            writer.write({"__key__": "caf\udce9", "txt": "x"})
        writer.write({"__key__": "k" * 65_535, "txt": "the longest key fits"})
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "w.lmdb")] == ["k" * 65_535]


def test_token_buckets_measure_the_text_field(tmp_path: Path) -> None:
    with packdata.PackWriter(tmp_path / "t.lmdb") as w:
        for i in range(6):
            w.write({"__key__": f"{i}", "txt": "x" * (10 * (i + 1)), "jpg": image_bytes(i)})
        w.write({"__key__": "no-text", "jpg": image_bytes(9)})
    ds = packdata.LMDBDataset(tmp_path / "t.lmdb")
    sampler = packdata.TokenBucketSampler(ds, max_tokens=60, field="txt", shuffle=False)
    assert list(sampler.lengths) == [10, 20, 30, 40, 50, 60, 1]
    assert sorted(i for batch in sampler for i in batch) == list(range(7))
    with pytest.raises(ConfigError, match="field should name"):
        packdata.TokenBucketSampler(ds, max_tokens=60)


@pytest.mark.parametrize("size", [0, 1, 63, 4096, (1 << 20) + 3])
def test_record_and_field_crcs_are_zlibs(size: int) -> None:
    """The CRC-32 (computed by zlib-ng) is the stdlib's zlib.crc32: packs written before still check, any tool can."""
    import struct
    import zlib

    from packdata.pack.fields import encode_block, read_directory
    from packdata.pack.records import Sample, encode_record

    data = os.urandom(size)
    assert struct.unpack_from("<4sBiIH", encode_record(Sample("k", 0, data)))[3] == zlib.crc32(data)
    entries = read_directory(encode_block({"a": data, "b": data[::-1]}))
    assert entries is not None
    assert [e.crc for e in entries] == [zlib.crc32(data), zlib.crc32(data[::-1])]


def test_a_file_or_tar_member_over_the_sample_limit_is_skipped_unread(tmp_path: Path) -> None:
    """A sample over 2 GiB fits no Example protobuf parses (nor, over 4 GiB, an LMDB value): skipped, never read."""
    import resource

    from packdata.pack.records import MAX_SAMPLE_BYTES

    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("alpha", encoding="utf-8")
    with open(texts / "huge.txt", "wb") as f:
        f.truncate(MAX_SAMPLE_BYTES + 1)  # sparse: nothing is written
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = packdata.convert(texts, tmp_path / "texts.lmdb", progress=False)
    assert result.packed == 1 and result.skipped == {"too large": 1}
    assert (
        result.skip_examples[0]["detail"]
        == f"{MAX_SAMPLE_BYTES + 1} bytes; a sample holds at most {MAX_SAMPLE_BYTES} (2 GiB less 1 MiB)"
    )
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 512 * 1024  # KiB: the file was never read

    out = io.BytesIO()  # a member whose header claims more than the limit, then the tar ends: named, never read
    with tarfile.open(fileobj=out, mode="w") as tar:
        info = tarfile.TarInfo("ok.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    header = tarfile.TarInfo("big.txt")
    header.size = MAX_SAMPLE_BYTES + 1
    (tmp_path / "data.tar").write_bytes(out.getvalue()[:1024] + header.tobuf())
    result = packdata.convert(str(tmp_path / "data.tar"), tmp_path / "tar.lmdb", progress=False, on_error="skip")
    assert result.packed == 1 and result.skipped == {"corrupt tar": 1}
    claim = f"member 'big.txt' claims {MAX_SAMPLE_BYTES + 1} bytes, past the tar's end (byte 1536)"
    assert result.skip_examples[0]["detail"].startswith(claim)


def test_pack_writer_and_list_groups_refuse_a_sample_over_the_limit(tmp_path: Path, monkeypatch) -> None:
    """The limit is checked on the whole encoded sample too (a group of files, an object read whole, write_pack)."""
    from packdata.conversion import load, writer

    monkeypatch.setattr(writer, "MAX_SAMPLE_BYTES", 100)
    with packdata.PackWriter(tmp_path / "w.lmdb") as pack:
        with pytest.raises(ConfigError, match=r"sample 'big' is \d+ bytes; a sample holds at most 100"):
            pack.write({"__key__": "big", "txt": "x" * 200})
        pack.write({"__key__": "small", "txt": "fits"})
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "w.lmdb")] == ["small"]

    monkeypatch.setattr(load, "MAX_SAMPLE_BYTES", 100)
    for name, text in (("a.txt", "x" * 60), ("b.txt", "fits")):  # each file under the limit: the block over it
        (tmp_path / name).write_text(text, encoding="utf-8")
    (tmp_path / "l.csv").write_text(f"path,caption\na.txt,{'y' * 60}\nb.txt,short\n", encoding="utf-8")
    result = packdata.convert(tmp_path / "l.csv", tmp_path / "l.lmdb", progress=False)
    assert result.packed == 1 and result.skipped == {"too large": 1}
    assert result.skip_examples[0]["key"] == "a"


def test_a_tar_sample_with_a_member_over_the_limit_is_skipped_whole(tmp_path: Path, monkeypatch) -> None:
    """Never packed in part: the sample's other members go with it (as a folder's or a list's would)."""
    from packdata.conversion import tars

    monkeypatch.setattr(tars, "MAX_SAMPLE_BYTES", 100)
    (tmp_path / "x.tar").write_bytes(
        _tar_of([("s1.txt", b"one"), ("s1.bin", b"x" * 200), ("s1.json", b"{}"), ("s2.txt", b"two")])
    )
    result = packdata.convert(str(tmp_path / "x.tar"), tmp_path / "out.lmdb", progress=False)
    assert result.packed == 1 and result.skipped == {"too large": 1}
    assert result.skip_examples[0]["key"] == "x.tar:s1"
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")] == ["s2"]


def test_a_tar_sample_whose_members_together_pass_the_limit_is_skipped_before_the_one_that_passes_it(
    tmp_path: Path, monkeypatch
) -> None:
    """Each member fits, not all of them: a .tar.gz of 1.5 GB members of one key was read whole, then refused."""
    from packdata.conversion import tars

    monkeypatch.setattr(tars, "MAX_SAMPLE_BYTES", 100)
    (tmp_path / "x.tar").write_bytes(
        _tar_of([("s1.a", b"x" * 60), ("s1.b", b"y" * 60), ("s1.c", b"z"), ("s2.txt", b"two")])
    )
    result = packdata.convert(str(tmp_path / "x.tar"), tmp_path / "out.lmdb", progress=False)
    assert result.packed == 1 and result.skipped == {"too large": 1}
    assert result.skip_examples[0]["key"] == "x.tar:s1"
    assert result.skip_examples[0]["detail"].startswith("field 'b': 120 bytes; a sample holds at most")
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")] == ["s2"]


def test_a_sparse_tar_member_is_skipped_not_read_as_its_claimed_size_of_zeros(tmp_path: Path) -> None:
    """A 10 KB tar of two pax sparse members claiming 1 GiB each (no data): tarfile reads the holes as zeros."""
    import resource

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in ("s1.a", "s1.b"):
            info = tarfile.TarInfo(f"GNUSparseFile.0/{name}")
            info.pax_headers = {
                "GNU.sparse.major": "1",
                "GNU.sparse.minor": "0",
                "GNU.sparse.name": name,
                "GNU.sparse.realsize": str(1 << 30),
            }
            sparse_map = b"1\n0\n0\n".ljust(512, b"\0")  # one chunk of 0 bytes at 0: the rest is a hole
            info.size = len(sparse_map)
            tar.addfile(info, io.BytesIO(sparse_map))
        info = tarfile.TarInfo("s2.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"two"))
    (tmp_path / "x.tar").write_bytes(out.getvalue())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = packdata.convert(str(tmp_path / "x.tar"), tmp_path / "out.lmdb", progress=False)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 512 * 1024  # KiB: never read
    assert result.packed == 1 and result.skipped == {"not a regular file": 1}  # sample s1, skipped whole
    assert [e["key"] for e in result.skip_examples] == ["x.tar:s1"]
    said = f"member 's1.a' is a sparse member ({1 << 30} bytes, 0 stored): the sample is skipped whole"
    assert result.skip_examples[0]["detail"] == said
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")] == ["s2"]


def test_a_tar_whose_pax_sparse_map_is_not_numbers_is_a_corrupt_tar_not_a_failed_request(tmp_path: Path) -> None:
    """tarfile's int() of GNU.sparse.map raised a bare ValueError: the run stopped, 'Check the URL ... resume'."""

    for name, pax in (("a.tar", {}), ("b.tar", {"GNU.sparse.map": "x,y", "GNU.sparse.size": "3"})):
        with tarfile.open(tmp_path / name, "w", format=tarfile.PAX_FORMAT) as tar:
            for member in (f"{name[0]}1.txt", f"{name[0]}2.txt"):
                info = tarfile.TarInfo(member)
                info.size = 3
                info.pax_headers = pax if member.endswith("2.txt") else {}
                tar.addfile(info, io.BytesIO(b"abc"))
    result = packdata.convert(str(tmp_path / "{a,b}.tar"), tmp_path / "out.lmdb", progress=False)
    assert result.packed == 2 and result.skipped == {"corrupt tar": 1}
    assert result.skip_examples[0]["key"] == "b.tar:b1"
    assert "damaged member header at byte 3072: invalid literal for int()" in result.skip_examples[0]["detail"]
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")] == ["a1", "a2"]


def test_a_source_npy_whose_header_claims_a_huge_array_is_skipped_unallocated(tmp_path: Path) -> None:
    """Convert checked a .npy with np.load, which allocates the declared shape first: 80 GB from a 200-byte file."""
    from numpy.lib import format as npy_format

    header = io.BytesIO()
    npy_format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False, "shape": (10**10,)})
    (tmp_path / "a.npy").write_bytes(header.getvalue() + bytes(64))
    good = io.BytesIO()
    np.save(good, np.arange(3))
    (tmp_path / "b.npy").write_bytes(good.getvalue())
    (tmp_path / "l.csv").write_text("path\na.npy\nb.npy\n", encoding="utf-8")
    result = packdata.convert(tmp_path / "l.csv", tmp_path / "out.lmdb", progress=False)
    assert result.packed == 1 and result.skipped == {"not npy": 1}
    detail = "field 'npy': its header asks for 80000000000 bytes of array data, 64 follow"
    assert result.skip_examples[0]["detail"] == detail
    assert np.array_equal(packdata.LMDBDataset(tmp_path / "out.lmdb")[0]["npy"], np.arange(3))


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


def test_grouped_field_names_are_lower_cased_and_two_files_of_one_field_skip_the_sample(tmp_path: Path) -> None:
    """IMG_1.JPG gave field 'JPG' where IMG_2.jpg gave 'jpg': fields=("jpg", "txt") raised a KeyError in a worker
    mid-epoch, and c.jpg beside c.JPG packed both images as two fields. Fields are now lower-cased, as tars'
    and lists' are (and WebDataset's), and two files of one field skip their sample, naming both."""
    src = tmp_path / "src"
    src.mkdir()
    files = {"IMG_1.JPG": image_bytes(1), "IMG_2.jpg": image_bytes(2), "c.jpg": image_bytes(3), "c.JPG": image_bytes(4)}
    files |= {"IMG_1.TXT": b"one", "IMG_2.txt": b"two", "c.txt": b"three"}
    for name, data in files.items():
        (src / name).write_bytes(data)
    result = packdata.convert(src, tmp_path / "out.lmdb", layout="grouped", progress=False)
    assert result.packed == 2 and result.skipped == {"duplicate field": 1}
    detail = "files c.JPG and c.jpg both give field 'jpg'"
    assert result.skip_examples == [{"key": "c", "reason": "duplicate field", "detail": detail}]
    ds = packdata.LMDBDataset(tmp_path / "out.lmdb", fields=("__key__", "jpg", "txt"), decode={"jpg": "bytes"})
    got = [(key, bytes(jpg), txt) for key, jpg, txt in DataLoader(ds, batch_size=None, num_workers=2)]
    assert got == [("IMG_1", files["IMG_1.JPG"], "one"), ("IMG_2", files["IMG_2.jpg"], "two")]


def test_require_names_a_grouped_field_in_the_case_of_its_files(tmp_path: Path) -> None:
    """Grouped fields are lower-cased: --require JPG,TXT (as the camera's files are named) then matched no field,
    and every sample was a 'missing field' skip. Required names are lower-cased as the fields are."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "IMG_1.JPG").write_bytes(image_bytes(1))
    (src / "IMG_1.TXT").write_text("one", encoding="utf-8")
    (src / "IMG_2.JPG").write_bytes(image_bytes(2))
    result = packdata.convert(src, tmp_path / "out.lmdb", layout="grouped", require=("JPG", "TXT"), progress=False)
    assert result.packed == 1 and result.skipped == {"missing field": 1}
    assert result.skip_examples[0]["detail"] == "no txt file (required: jpg, txt)"


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


def test_tar_member_names_are_read_as_utf8_whatever_the_locale(tmp_path: Path) -> None:
    """tarfile decoded a GNU tar's names in the locale's encoding: under LC_ALL=C with PYTHONUTF8=0 (ASCII) the
    member café.txt was a 'name not UTF-8' skip, a sample lost on that machine alone (Latin-1 gave another key)."""
    (tmp_path / "data.tar").write_bytes(_tar_of([("café.txt", b"x"), ("ok.txt", b"y")]))
    _convert_in_an_ascii_locale(tmp_path / "data.tar", tmp_path / "c.lmdb")
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "c.lmdb")] == ["café", "ok"]


def _convert_in_an_ascii_locale(src: Path, dst: Path) -> None:
    """Convert in a Python whose file names decode as ASCII (a machine whose locale is not UTF-8)."""
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    code = "import sys, packdata; packdata.convert(sys.argv[1], sys.argv[2], progress=False)"
    subprocess.run([sys.executable, "-c", code, str(src), str(dst)], env=env, check=True)


@pytest.mark.parametrize("layout", ["classes", "grouped"])
def test_a_folder_gives_the_same_keys_and_classes_whatever_the_locale(tmp_path: Path, layout: str) -> None:
    """Python decodes file names in the locale's encoding: under ASCII, cafés/ü.txt was a 'name not UTF-8' skip
    (and its folder no class); under Latin-1 its key was cafÃ©s/Ã¼. Names are now read as UTF-8 everywhere."""
    src = tmp_path / "src"
    for folder in ("cafés", "plain"):
        (src / folder).mkdir(parents=True)
        for stem in ("ü", "a"):
            (src / folder / f"{stem}.txt").write_text(f"{folder} {stem}", encoding="utf-8")
            if layout == "grouped":
                (src / folder / f"{stem}.json").write_text("[1]", encoding="utf-8")
    packdata.convert(src, tmp_path / "utf8.lmdb", progress=False)
    _convert_in_an_ascii_locale(src, tmp_path / "ascii.lmdb")
    utf8, ascii = (packdata.LMDBDataset(tmp_path / f"{name}.lmdb") for name in ("utf8", "ascii"))
    assert ascii.classes == utf8.classes == ["cafés", "plain"]
    assert list(ascii.targets) == list(utf8.targets) == [0, 0, 1, 1]
    keys = [f"{key}{'.txt' * (layout == 'classes')}" for key in ("cafés/a", "cafés/ü", "plain/a", "plain/ü")]
    assert [ascii.keys[i] for i in range(4)] == [utf8.keys[i] for i in range(4)] == keys


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


def test_a_tar_sample_with_two_members_of_one_field_is_skipped_whole(tmp_path: Path) -> None:
    """a.bin then a.BIN (both field bin): the sample was packed with the first and the second reported as a
    member skipped, though nothing tells which is the sample's. It is skipped whole, as a grouped folder's is."""
    members = [("a.bin", b"first"), ("a.BIN", b"second"), ("a.txt", b"cap a"), ("b.bin", b"only"), ("b.txt", b"b")]
    (tmp_path / "data.tar").write_bytes(_tar_of(members))
    result = packdata.convert(str(tmp_path / "data.tar"), tmp_path / "out.lmdb", progress=False)
    assert (result.found, result.packed, result.skipped) == (2, 1, {"duplicate field": 1})
    detail = "two members give field 'bin', the second 'a.BIN'"
    assert result.skip_examples == [{"key": "data.tar:a", "reason": "duplicate field", "detail": detail}]
    assert list(packdata.LMDBDataset(tmp_path / "out.lmdb", decode="bytes")) == [
        {"__key__": "b", "bin": b"only", "txt": b"b"}
    ]


def test_a_hard_link_in_a_tar_is_read_from_the_member_it_names(tmp_path: Path) -> None:
    """tar and tarfile.add store a file's second name as a hard link member: b.txt was skipped as 'not a regular
    file' and sample b packed without its caption. It is now read from a.txt's bytes in the tar."""
    tar_with_a_hard_link(tmp_path / "src", tmp_path / "data.tar")
    with tarfile.open(tmp_path / "data.tar") as tar:
        assert tar.getmember("b.txt").islnk()
    result = packdata.convert(str(tmp_path / "data.tar"), tmp_path / "out.lmdb", progress=False)
    assert (result.packed, result.skipped) == (2, {})
    assert list(packdata.LMDBDataset(tmp_path / "out.lmdb")) == [
        {"__key__": "a", "json": [1], "txt": "one caption"},
        {"__key__": "b", "json": [2], "txt": "one caption"},
    ]


def test_a_tar_member_left_unread_skips_its_sample_not_packed_without_it(tmp_path: Path) -> None:
    """A link the reader cannot follow (in a gzipped tar, or a symbolic one) was skipped and its sample packed
    without that field: b without its caption, or without its cls label. The sample is skipped whole now."""
    import gzip

    tar_with_a_hard_link(tmp_path / "src", tmp_path / "data.tar")
    (tmp_path / "data.tar.gz").write_bytes(gzip.compress((tmp_path / "data.tar").read_bytes()))
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in (("c.json", b"[3]"), ("d.json", b"[4]")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            if name == "c.json":
                link = tarfile.TarInfo("c.cls")
                link.type, link.linkname = tarfile.SYMTYPE, "labels/3.cls"
                tar.addfile(link)
    (tmp_path / "sym.tar").write_bytes(out.getvalue())
    for tar_name, skipped_key, kept in (("data.tar.gz", "b", "a"), ("sym.tar", "c", "d")):
        result = packdata.convert(str(tmp_path / tar_name), tmp_path / f"{tar_name}.lmdb", progress=False)
        assert (result.packed, result.skipped) == (1, {"not a regular file": 1})
        assert result.skip_examples[0]["key"] == f"{tar_name}:{skipped_key}"
        assert result.skip_examples[0]["detail"].endswith("is a link or device in the tar: the sample is skipped whole")
        assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / f"{tar_name}.lmdb")] == [kept]


def test_a_grouped_file_left_unread_skips_its_sample_not_packed_without_it(tmp_path: Path) -> None:
    """A FIFO b.txt, a file c.cls\\xe9 whose name is not UTF-8 past its key, a file 'd.' with no field name: each was
    skipped alone and its sample packed without that field (b without its caption, c without its label). Each
    sample is skipped whole now, as a tar's with a member left unread."""
    src = tmp_path / "src"
    src.mkdir()
    for key in "abcde":
        (src / f"{key}.json").write_text(json.dumps([key]), encoding="utf-8")
    (src / "a.txt").write_text("a caption", encoding="utf-8")
    os.mkfifo(src / "b.txt")
    try:
        Path(os.fsdecode(os.fsencode(src) + b"/c.cls\xe9")).write_text("3", encoding="utf-8")
    except OSError:
        pytest.skip("filesystem refuses non-UTF-8 names")
    (src / "d.").write_text("no field", encoding="utf-8")
    (src / "e.txt").write_text("e caption", encoding="utf-8")
    (src / "e.d").mkdir()  # a folder beside group e: no file of it (its files are group e.d/x's)
    (src / "e.d" / "x.txt").write_text("x caption", encoding="utf-8")
    result = packdata.convert(src, tmp_path / "out.lmdb", layout="grouped", progress=False)
    assert (result.found, result.packed) == (6, 3)
    assert result.skipped == {"not a regular file": 1, "name not UTF-8": 1, "bad field name": 1}
    details = {e["key"]: e["detail"] for e in result.skip_examples}
    assert details == {
        "b": "file 'b.txt' (a FIFO) is left unread: the sample is skipped whole",
        "c": "file 'c.cls\\xe9' is left unread: the sample is skipped whole",
        "d": "file 'd.': a field name should be a non-empty string, but got ''",
    }
    packed = [(s["__key__"], s["txt"]) for s in packdata.LMDBDataset(tmp_path / "out.lmdb")]
    assert packed == [("a", "a caption"), ("e.d/x", "x caption"), ("e", "e caption")]  # e open while e.d/ is walked


def _partial_samples(root: Path, keys: range, *, txt_every: int = 3) -> Path:
    """A grouped folder whose samples all have a jpg, and a txt unless their number divides by ``txt_every``."""
    root.mkdir(parents=True)
    for i in keys:
        (root / f"s{i:02d}.jpg").write_bytes(image_bytes(i))
        if i % txt_every:
            (root / f"s{i:02d}.txt").write_text(f"caption {i}", encoding="utf-8")
    return root


def _wds_tar(path: Path, samples: dict[str, dict[str, bytes]]) -> Path:
    with tarfile.open(path, "w") as tar:
        for key, fields in samples.items():
            for name, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{name}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_the_manifest_counts_the_samples_holding_each_field_and_appends_and_merges_add_them_up(
    tmp_path: Path, fmt: str
) -> None:
    """A pack whose samples did not all hold the same fields said nothing of it: its manifest listed the fields
    alone. Now it counts, per field, the samples that hold it, through convert, an append and a merge."""
    pack, other = tmp_path / "a", tmp_path / "b"
    packdata.convert(_partial_samples(tmp_path / "src", range(6)), pack, format=fmt, progress=False)
    assert read_manifest(pack).field_counts == {"jpg": 6, "txt": 4}
    tar = _wds_tar(tmp_path / "t.tar", {"t0": {"jpg": image_bytes(0), "json": b"{}"}, "t1": {"jpg": image_bytes(1)}})
    packdata.convert(tar, other, format=fmt, progress=False)
    assert read_manifest(other).field_counts == {"jpg": 2, "json": 1}
    packdata.merge_packs([pack, other], tmp_path / "merged")
    assert read_manifest(tmp_path / "merged").field_counts == {"jpg": 8, "txt": 4, "json": 1}
    packdata.convert(_partial_samples(tmp_path / "more", range(6, 10), txt_every=2), pack, append=True, progress=False)
    assert read_manifest(pack).field_counts == {"jpg": 10, "txt": 6}
    written = tmp_path / "w"
    packdata.write_pack([{"__key__": "k0", "txt": "a"}, {"__key__": "k1", "npy": np.zeros(2)}], written, format=fmt)
    assert read_manifest(written).field_counts == {"txt": 1, "npy": 1}
    for each in (pack, tmp_path / "merged", written):
        packdata.verify_pack(each, progress=False)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"jpg": -1, "txt": 4}, r"'field_counts\.jpg' should be an integer from 0 to num_samples \(6\), but got -1"),
        ({"jpg": 7, "txt": 4}, r"'field_counts\.jpg' should be an integer from 0 to num_samples \(6\), but got 7"),
        ({"jpg": 6, "txt": True}, r"'field_counts\.txt' should be an integer from 0 to num_samples \(6\)"),
        (
            {"jpg": 6, "txt": 4, "seg.png": 1},
            r"'field_counts' should count only the manifest's fields \(jpg, txt\), but got 'seg\.png'",
        ),
        ({"jpg": 6}, r"'field_counts' should count each of the manifest's fields \(jpg, txt\), but got \['jpg'\]"),
        ([6, 4], r"'field_counts' should be an object of field name -> sample count"),
    ],
)
def test_a_manifest_whose_field_counts_cannot_be_is_refused_in_one_line(
    tmp_path: Path, change: object, problem: str
) -> None:
    pack = tmp_path / "p.lmdb"
    packdata.convert(_partial_samples(tmp_path / "src", range(6)), pack, progress=False)
    rewrite_manifest(pack, lambda d: d.__setitem__("field_counts", change))
    with pytest.raises(PackFormatError, match=re.escape(str(pack / "manifest.json")) + ": manifest field " + problem):
        packdata.LMDBDataset(pack)


def test_field_counts_the_sample_index_does_not_bear_out_are_named_by_verify_merge_and_append(tmp_path: Path) -> None:
    """Counts in range but false (7 of 6 samples would not pass; 6 of 6 for a field 4 samples hold does)."""
    pack = tmp_path / "p.lmdb"
    packdata.convert(_partial_samples(tmp_path / "src", range(6)), pack, progress=False)
    packdata.convert(_partial_samples(tmp_path / "src2", range(6, 8)), tmp_path / "q.lmdb", progress=False)
    rewrite_manifest(pack, lambda d: d["field_counts"].__setitem__("txt", 6))
    lie = f"{pack}/manifest.json: manifest field 'field_counts' says 6 samples hold field 'txt', but the sample index "
    lie += "lists it for 4"
    with pytest.raises(PackFormatError, match=re.escape(lie)):
        packdata.verify_pack(pack, progress=False)
    with pytest.raises(PackFormatError, match=re.escape(lie)):
        packdata.merge_packs([pack, tmp_path / "q.lmdb"], tmp_path / "m.lmdb")
    with pytest.raises(PackFormatError, match=re.escape(lie)):
        packdata.convert(tmp_path / "src2", pack, append=True, progress=False)
    assert not (tmp_path / "m.lmdb").exists()


def test_a_manifest_of_a_multi_field_pack_without_field_counts_still_reads(tmp_path: Path) -> None:
    """Packs written before the counts: their manifests have none, and read, verify and merge as before."""
    pack = tmp_path / "p.lmdb"
    packdata.convert(_partial_samples(tmp_path / "src", range(6)), pack, progress=False)
    rewrite_manifest(pack, lambda d: d.pop("field_counts"))
    assert read_manifest(pack).field_counts == {}
    assert "field_counts" not in packdata.pack_info(pack)
    assert len(packdata.LMDBDataset(pack)) == 6
    assert packdata.verify_pack(pack, progress=False).records == 6
    packdata.convert(_partial_samples(tmp_path / "more", range(6, 8)), pack, append=True, progress=False)
    assert read_manifest(pack).field_counts == {"jpg": 8, "txt": 5}


def _datasets(pack: Path, fmt: str, **options: object) -> list:
    """Every dataset class that reads a pack of ``fmt``, in pack order."""
    if fmt == "lmdb":
        return [packdata.LMDBDataset(pack, **options)]
    return [packdata.TFRecordIndexedDataset(pack, **options), packdata.TFRecordDataset(pack, shuffle=False, **options)]


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_a_field_some_samples_lack_is_refused_when_the_dataset_opens_or_read_with_its_missing_value(
    tmp_path: Path, fmt: str
) -> None:
    """fields=("__key__", "txt") on a pack where some samples have no txt (a grouped folder, a WebDataset tar with
    a member missing) opened fine and raised a bare KeyError in a DataLoader worker at the first such sample. Now it
    is refused at construction, naming the field, how many samples lack it and the first; missing= reads a value
    in its place, through workers of both start methods."""
    grouped, tarred = tmp_path / "g", tmp_path / "t"
    packdata.convert(_partial_samples(tmp_path / "src", range(6)), grouped, format=fmt, progress=False)
    tar = {f"t{i}": {"jpg": image_bytes(i)} | ({"txt": f"c{i}".encode()} if i % 3 else {}) for i in range(6)}
    packdata.convert(_wds_tar(tmp_path / "t.tar", tar), tarred, format=fmt, progress=False)
    for pack, first in ((grouped, "s00"), (tarred, "t0")):
        for ds in _datasets(pack, fmt, fields=("__key__", "jpg"), decode="bytes"):
            assert sorted(key for key, _ in ds) == sorted(f"{first[0]}{i:0{len(first) - 1}d}" for i in range(6))
        lack = f"{pack}: fields asks for 'txt', which 2 of the pack's 6 samples lack (the first: sample {first!r}, "
        lack += "index 0). Pass missing={'txt': VALUE} to read VALUE in its place"
        unlabelled = "fields asks for 'cls', which 6 of the pack's 6 samples lack"
        for options, problem in (({"fields": ("__key__", "txt")}, lack), ({"fields": ("cls",)}, unlabelled)):
            with pytest.raises(ConfigError, match=re.escape(problem)):
                _datasets(pack, fmt, **options)
        expected = [(key, data.get("txt", b"").decode() or None) for key, data in _source_fields(pack).items()]
        for ds in _datasets(pack, fmt, fields=("__key__", "txt"), missing={"txt": None}):
            for method in ("fork", "spawn"):
                loader = DataLoader(ds, batch_size=2, num_workers=2, collate_fn=_listed, multiprocessing_context=method)
                assert sorted(s for batch in loader for s in batch) == sorted(expected), (type(ds).__name__, method)
        for ds in _datasets(pack, fmt, decode="bytes", missing={"txt": b"", "cls": -1}):
            assert {(sample["__key__"], sample["txt"], sample["cls"]) for sample in ds} == {
                (key, data.get("txt", b""), -1) for key, data in _source_fields(pack).items()
            }
    with pytest.raises(ConfigError, match=re.escape(f"{grouped}: missing names '__key__', but every sample has a")):
        _datasets(grouped, fmt, missing={"__key__": ""})
    with pytest.raises(ConfigError, match=re.escape(f"{grouped}: missing names 'txt', but fields does not ask")):
        _datasets(grouped, fmt, fields=("jpg",), missing={"txt": ""})


def _source_fields(pack: Path) -> dict[str, dict[str, bytes]]:
    """Key -> stored fields of every sample of ``pack``, as ``packdata cat`` gives them."""
    return {
        row["key"]: {name: read_field(pack, row["key"], name) for name in row["fields"]} for row in list_samples(pack)
    }


def test_a_record_lacking_a_field_its_sample_index_lists_is_named_mid_epoch_not_a_bare_key_error(
    tmp_path: Path,
) -> None:
    """A record without a field that the sample index (and so the check at construction) says every sample holds,
    read in a DataLoader worker: a PackFormatError naming the pack, the sample's key and index, and the field."""
    whole, cut = tmp_path / "whole.lmdb", tmp_path / "cut.lmdb"
    src = _partial_samples(tmp_path / "src", range(1, 5), txt_every=99)  # s01 to s04, each with its txt
    packdata.convert(src, whole, progress=False)
    (src / "s04.txt").unlink()
    packdata.convert(src, cut, progress=False)
    shutil.rmtree(cut / "index")
    shutil.copytree(whole / "index", cut / "index")  # the index of the pack whose s04 has its txt
    whole_manifest = json.loads((whole / "manifest.json").read_text())
    rewrite_manifest(cut, lambda d: d.update(index=whole_manifest["index"], field_counts={"jpg": 4, "txt": 4}))
    loader = DataLoader(packdata.LMDBDataset(cut, fields=("__key__", "txt")), batch_size=None, num_workers=2)
    with pytest.raises(PackFormatError, match=re.escape(f"{cut}: sample 's04' (index 3) holds no field 'txt'")):
        list(loader)


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_a_dataset_refuses_field_counts_its_sample_index_does_not_bear_out(tmp_path: Path, fmt: str) -> None:
    """A manifest saying every sample holds txt (6 of 6) where 4 do opened, and read as if they all did."""
    pack = tmp_path / "p"
    packdata.convert(_partial_samples(tmp_path / "src", range(6)), pack, format=fmt, progress=False)
    rewrite_manifest(pack, lambda d: d["field_counts"].__setitem__("txt", 6))
    lie = f"{pack}/manifest.json: manifest field 'field_counts' says 6 samples hold field 'txt', but the sample index "
    for options in ({}, {"fields": ("__key__", "txt")}):
        with pytest.raises(PackFormatError, match=re.escape(lie)):
            _datasets(pack, fmt, **options)


def test_convert_append_merge_and_info_name_the_fields_some_samples_lack(tmp_path: Path) -> None:
    """Converting samples that do not all hold the same fields succeeded without a word of it; now convert, an
    append, a merge and info say which fields some samples lack, and how many."""
    runner = CliRunner()
    full, partial = tmp_path / "full.lmdb", tmp_path / "partial.lmdb"
    everything = _partial_samples(tmp_path / "all", range(10, 14), txt_every=99)  # a caption in every sample
    done = runner.invoke(cli, ["convert", str(everything), str(full), "-q"])
    assert done.exit_code == 0 and "SOME SAMPLES LACK" not in done.output
    done = runner.invoke(cli, ["convert", str(_partial_samples(tmp_path / "src", range(6))), str(partial), "-q"])
    assert done.exit_code == 0, done.output
    assert (
        "FIELDS SOME SAMPLES LACK: txt (2 samples); a dataset whose fields= asks for one needs missing=" in done.output
    )
    as_json = runner.invoke(cli, ["convert", str(tmp_path / "src"), str(tmp_path / "j.lmdb"), "-q", "--json"])
    assert json.loads(as_json.output)["missing_fields"] == {"txt": 2}
    info = runner.invoke(cli, ["info", str(partial)])
    assert "fields:   jpg (image), txt (txt, in 4 of 6 samples)\n" in info.output
    merged = runner.invoke(cli, ["merge", str(full), str(partial), "-o", str(tmp_path / "m.lmdb")])
    assert merged.exit_code == 0 and "FIELDS SOME SAMPLES LACK: txt (2 samples)" in merged.output
    more = tmp_path / "more"
    more.mkdir()
    (more / "x.jpg").write_bytes(image_bytes(9))  # no caption: the pack's txt is no longer in every sample
    appended = runner.invoke(cli, ["convert", str(more), str(full), "--append", "--layout", "grouped", "-q"])
    assert appended.exit_code == 0, appended.output
    assert "FIELDS SOME SAMPLES LACK: txt (1 sample)" in appended.output
    assert "txt (txt, in 4 of 5 samples)" in runner.invoke(cli, ["info", str(full)]).output


def test_a_field_index_file_damaged_so_its_counts_differ_from_the_manifests_is_named_as_itself(tmp_path: Path) -> None:
    """A field number flipped in field_sizes.i64 (txt read as jpg): the counts differ from the manifest's, and the
    file, not the manifest, is named."""
    pack = tmp_path / "p.lmdb"
    packdata.convert(_partial_samples(tmp_path / "src", range(6)), pack, progress=False)
    sizes = pack / "index" / "field_sizes.i64"
    pairs = np.fromfile(sizes, dtype="<i8").reshape(-1, 2)
    pairs[np.flatnonzero(pairs[:, 0] == 1)[0], 0] = 0  # a txt pair now names jpg: still in range
    pairs.tofile(sizes)
    with pytest.raises(PackFormatError, match=re.escape(f"{sizes}: sample index file field_sizes.i64 does not match")):
        packdata.LMDBDataset(pack)


def test_a_sample_without_a_field_asked_for_with_missing_reads_only_its_directory(tmp_path: Path) -> None:
    """fields=("__key__", "txt") with missing={"txt": None}: a sample without a caption whose directory is the
    index's read its whole record (image included) to be sure, so a damaged image it was never asked for failed
    the read. Now its directory, matching the sample index, settles it: only the fields asked for are read."""
    pack = tmp_path / "p.lmdb"
    packdata.convert(_partial_samples(tmp_path / "src", range(6)), pack, progress=False)
    _flip_inside(pack / "shard-00000.lmdb", image_bytes(0)[-60:-20])  # inside s00's jpg: s00 has no txt
    ds = packdata.LMDBDataset(pack, fields=("__key__", "txt"), missing={"txt": None})
    loader = DataLoader(ds, batch_size=2, num_workers=2, collate_fn=_listed)
    assert sorted(s for batch in loader for s in batch)[0] == ("s00", None)
    assert ds.raw_fields(0, ["txt"]) == {}
    with pytest.raises(PackFormatError, match="record 0 is damaged"):
        packdata.LMDBDataset(pack, fields=("jpg",))[0]


@pytest.mark.parametrize("delimiter", [",", "\t"])
def test_a_lists_rows_are_those_csv_dictreader_reads(tmp_path: Path, delimiter: str) -> None:
    """The walk reads a CSV or TSV list with csv.reader, making each row's dict itself (quicker than DictReader's):
    its rows, values past the header's columns, columns not given and blank lines are DictReader's."""
    lines = ["path,label,caption", "a.jpg,cat,x", "", "b.jpg,dog", 'c.jpg,cat,"q,r",extra,more', "d.jpg", "", ""]
    listing = tmp_path / f"l.{'csv' if delimiter == ',' else 'tsv'}"
    listing.write_text("\n".join(line.replace(",", delimiter) for line in lines) + "\n", encoding="utf-8")
    with open(listing, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter=delimiter, restkey=_EXTRA, strict=True)
        expected = []
        for row in reader:
            short = sum(value is None for value in row.values())
            expected.append((reader.line_num, {**row, **({_SHORT: short} if short else {})}))
    assert list(_rows(listing)) == expected
    assert [row.get(_SHORT, 0) for _, row in expected] == [0, 1, 0, 2]
