"""Multi-field samples read back: datasets, decoders, damaged fields, field blocks, tf.data, field counts."""

from __future__ import annotations

import filecmp
import io
import json
import os
import pickle
import re
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import assert_index_digests, flip_label, image_bytes
from faults.hostile import rewrite_manifest
from fields_helpers import KEYS, _fields_of, _grouped, _listed, _same_tree
from torch.utils.data import DataLoader, default_collate

import packdata
from packdata.cli import main as cli
from packdata.errors import ConfigError, PackFormatError
from packdata.formats.contents import export_pack, list_samples, read_field
from packdata.formats.lmdb_env import DATA_FILE
from packdata.pack.fields import decode_block
from packdata.pack.manifest import manifest_checksum, read_manifest

FIXTURE = Path(__file__).parent / "fixtures" / "v1-imagefolder.lmdb"


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
def test_a_field_of_the_cls_codec_opens_and_reads_as_an_int(tmp_path: Path, fmt: str) -> None:
    """A field named ``x.cls`` (codec cls, not the label): its pack failed to open with a bare KeyError 'cls'.
    It reads as an int, as WebDataset's default decoder reads it (its bytes before)."""
    pack = tmp_path / "p"
    packdata.write_pack([{"__key__": "a", "txt": "hi", "x.cls": 3, "cls": 1}], pack, format=fmt, progress=False)
    indexed = packdata.LMDBDataset if fmt == "lmdb" else packdata.TFRecordIndexedDataset
    assert indexed(pack)[0] == {"__key__": "a", "txt": "hi", "x.cls": 3, "cls": 1}


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


def _partial_samples(root: Path, keys: range, *, txt_every: int = 3) -> Path:
    """A grouped folder whose samples all have a jpg, and a txt unless their number divides by ``txt_every``."""
    root.mkdir(parents=True)
    for i in keys:
        (root / f"s{i:02d}.jpg").write_bytes(image_bytes(i))
        if i % txt_every:
            (root / f"s{i:02d}.txt").write_text(f"caption {i}", encoding="utf-8")
    return root


def test_a_field_some_samples_lack_says_require_in_the_library_s_words_beside_the_command_line(tmp_path: Path) -> None:
    """The refusal of fields= naming a field some samples lack said only '`packdata convert --require txt` skips
    samples without it' to a dataset's Python caller; it names convert's keyword, require=['txt'], too."""
    pack = packdata.convert(_partial_samples(tmp_path / "src", range(4)), tmp_path / "p.lmdb", progress=False).pack
    with pytest.raises(ConfigError) as raised:
        packdata.LMDBDataset(pack, fields=("txt",))
    assert str(raised.value) == (
        f"{pack}: fields asks for 'txt', which 2 of the pack's 4 samples lack (the first: sample 's00', index 0). "
        "Pass missing={'txt': VALUE} to read VALUE in its place, or fields=None for a dict of the fields each sample "
        "holds; converting with require=['txt'] (`packdata convert --require txt`) skips samples without it"
    )


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


@pytest.mark.timeout(300)  # many DataLoaders of 2 workers, spawned ones too: 123 s once at load average 19
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


def _masked_for_some(root: Path, keys: range) -> Path:
    """A grouped folder: every sample has a jpg and a json, the even-numbered ones a mask.png too (WebDataset-style)."""
    root.mkdir(parents=True)
    for i in keys:
        (root / f"m{i}.jpg").write_bytes(image_bytes(i))
        (root / f"m{i}.json").write_text(json.dumps({"n": i}), encoding="utf-8")
        if i % 2 == 0:
            (root / f"m{i}.mask.png").write_bytes(image_bytes(50 + i, size=(8, 6), fmt="PNG"))
    return root


@pytest.mark.timeout(300)  # many DataLoaders of 2 workers, spawned ones too: 113 s once under heavy load
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_samples_of_different_fields_batch_with_fields_collate_and_the_default_collate_names_the_field(
    tmp_path: Path, method: str
) -> None:
    """A pack whose samples do not all hold a mask, read as dicts through a DataLoader with torch's default collate,
    raised a bare KeyError: 'mask.png' from default_collate. Now it names the pack, the sample and the way out
    (MissingFieldError, a KeyError too), and collate_fn=packdata.fields_collate batches them: a field some samples
    lack is a list with None."""
    src = _masked_for_some(tmp_path / "src", range(6))
    pack = packdata.convert(src, tmp_path / "p.lmdb", layout="grouped", progress=False).pack
    ds = packdata.LMDBDataset(pack, decode="bytes")
    way_out = (
        "The pack's samples do not all hold the same fields: batch them with collate_fn=packdata.fields_collate "
        "(a field a sample lacks reads None; packdata.FieldsCollate(missing=VALUE) reads VALUE), or pass "
        "missing={'mask.png': VALUE} to the dataset"
    )
    loader = DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context=method)
    lacking = f"{pack}: sample 'm1' holds no field 'mask.png' (it holds 'jpg', 'json'), which sample 'm0' of the same"
    with pytest.raises(packdata.MissingFieldError, match=re.escape(lacking) + ".*" + re.escape(way_out)):
        list(loader)
    loader = DataLoader(
        ds, batch_size=4, num_workers=2, collate_fn=packdata.fields_collate, multiprocessing_context=method
    )
    got: dict[str, tuple] = {}
    for batch in loader:
        assert set(batch) == {"__key__", "jpg", "json", "mask.png"}
        assert len(batch["mask.png"]) == len(batch["__key__"])
        for i, key in enumerate(batch["__key__"]):
            got[key] = (batch["jpg"][i], batch["json"][i], batch["mask.png"][i])
    assert sorted(got) == sorted(f"m{i}" for i in range(6))
    for key, (jpg, meta, mask) in got.items():
        fields = _fields_of(src, key)
        assert (jpg, meta, mask) == (fields["jpg"], fields["json"], fields.get("mask.png"))


def test_fields_collate_stacks_what_every_sample_holds_and_lists_the_rest() -> None:
    """Numbers and arrays of one shape that every sample holds are stacked as the default collate would; text,
    arrays of different shapes and a field some samples lack stay lists, missing= filling the gaps."""
    batch = [
        {"__key__": "a", "cls": 1, "npy": np.zeros((2, 3), np.float32), "seg": np.zeros(2), "txt": "x"},
        {"__key__": "b", "cls": 0, "npy": np.ones((2, 3), np.float32), "seg": np.zeros(3), "box": [1]},
    ]
    out = packdata.FieldsCollate(missing=-1)(batch)
    assert list(out) == ["__key__", "cls", "npy", "seg", "txt", "box"]
    assert out["__key__"] == ["a", "b"] and out["txt"] == ["x", -1] and out["box"] == [-1, [1]]
    assert out["cls"].dtype == torch.int64 and out["cls"].tolist() == [1, 0]
    assert out["npy"].shape == (2, 2, 3) and out["npy"].dtype == torch.float32
    assert [len(seg) for seg in out["seg"]] == [2, 3]
    with pytest.raises(TypeError, match=re.escape("fields_collate collates samples read as dicts (fields=None)")):
        packdata.fields_collate([("a", 1)])


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_every_dataset_s_dict_samples_name_the_field_they_lack_to_the_default_collate(tmp_path: Path, fmt: str) -> None:
    """LMDBDataset, TFRecordIndexedDataset and TFRecordDataset read a sample as a dict whose lookup of a field it
    lacks names the pack, the sample and the way out; fields_collate batches the same samples."""
    pack = packdata.convert(_masked_for_some(tmp_path / "src", range(3)), tmp_path / "p", format=fmt, progress=False)
    for ds in _datasets(pack.pack, fmt, decode="bytes"):
        samples = list(ds)
        assert [sample["__key__"] for sample in samples] == ["m0", "m1", "m2"]
        lacking = f"{pack.pack}: sample 'm1' holds no field 'mask.png' (it holds 'jpg', 'json'), which sample 'm0'"
        with pytest.raises(packdata.MissingFieldError, match=re.escape(lacking)):
            default_collate(samples)
        assert samples[1].get("mask.png") is None and "mask.png" not in samples[1]
        batch = packdata.fields_collate(samples)
        assert batch["__key__"] == ["m0", "m1", "m2"] and batch["mask.png"][1] is None


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_a_batch_whose_first_sample_lacks_a_field_is_refused_by_the_default_collate_not_dropped(
    tmp_path: Path, fmt: str, num_workers: int
) -> None:
    """Torch's default collate keeps the fields of a batch's first sample: a batch whose first sample had no mask
    while the next had one came out without 'mask.png', the mask lost without a word. Now the default collate of
    such a batch raises MissingFieldError naming the pack, the sample, the field and the ways out, through every
    dataset and DataLoader workers; a batch whose samples hold the same fields collates as before, and
    fields_collate or a collate of one's own gets every field (no false alarm)."""
    src = _masked_for_some(tmp_path / "src", range(1, 5))  # m1 and m3 lack the mask, m2 and m4 hold one
    pack = packdata.convert(src, tmp_path / "p", format=fmt, progress=False).pack
    lacking = (
        f"{pack}: sample 'm1' holds no field 'mask.png' (it holds 'jpg', 'json'), which sample 'm2' of the same "
        "batch holds: torch's default collate cannot batch dicts of different fields (it keeps the first sample's). "
        "The pack's samples do not all hold the same fields: batch them with collate_fn=packdata.fields_collate "
        "(a field a sample lacks reads None; packdata.FieldsCollate(missing=VALUE) reads VALUE), or pass "
        "missing={'mask.png': VALUE} to the dataset to read VALUE in its place"
    )
    for ds in _datasets(pack, fmt, decode="bytes"):
        loader = DataLoader(ds, batch_size=2, num_workers=num_workers)
        with pytest.raises(packdata.MissingFieldError, match=re.escape(lacking)):
            list(loader)
        loader = DataLoader(ds, batch_size=2, num_workers=num_workers, collate_fn=packdata.fields_collate)
        masks = {key: mask for batch in loader for key, mask in zip(batch["__key__"], batch["mask.png"], strict=True)}
        held = {key: (src / f"{key}.mask.png").read_bytes() for key in ("m2", "m4")}
        assert masks == {"m1": None, "m3": None} | held
        loader = DataLoader(ds, batch_size=2, num_workers=num_workers, collate_fn=_listed)
        got = {sample["__key__"]: sorted(sample) for batch in loader for sample in batch}
        assert got["m1"] == ["__key__", "jpg", "json"] and got["m2"] == ["__key__", "jpg", "json", "mask.png"]
        if not isinstance(ds, packdata.TFRecordDataset):  # map-style: a batch of samples of the same fields
            (batch,) = DataLoader(ds, batch_size=2, sampler=[0, 2], num_workers=num_workers)
            assert (
                batch["__key__"] == ["m1", "m3"]
                and "mask.png" not in batch
                and [json.loads(meta) for meta in batch["json"]] == [{"n": 1}, {"n": 3}]
            )
            with pytest.raises(
                KeyError, match=re.escape(f"{pack}: the batch holds no field 'mask.png': none of its 2")
            ):
                batch["mask.png"]


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_a_misspelt_field_names_the_packs_fields_and_the_closest_not_a_lacking_field(tmp_path: Path, fmt: str) -> None:
    """sample["jgp"] raised MissingFieldError saying the sample holds no field 'jgp' and advising fields_collate
    or missing= for samples that do not all hold the same fields: a field no sample of the pack holds is a typo.
    Now it names the pack's fields and the closest of them, in a dict read through DataLoader workers, in a batch
    of them and at fields=; `in` and get() stay a dict's; a field some samples lack keeps its message."""
    pack = packdata.convert(_masked_for_some(tmp_path / "src", range(2)), tmp_path / "p", format=fmt, progress=False)
    typo = (
        f"{pack.pack}: the pack has no field 'jgp' (its fields: '__key__', 'cls', 'jpg', 'json', 'mask.png'). "
        "Did you mean 'jpg'? Name one of the pack's fields (`packdata info` lists them)"
    )
    for ds in _datasets(pack.pack, fmt, decode="bytes"):
        samples = list(DataLoader(ds, batch_size=None, num_workers=2))
        assert [sample["__key__"] for sample in samples] == ["m0", "m1"]
        for sample in samples:
            assert "jgp" not in sample and sample.get("jgp") is None
            with pytest.raises(packdata.MissingFieldError, match=re.escape(typo)) as raised:
                sample["jgp"]
            assert isinstance(raised.value, KeyError)
        with pytest.raises(packdata.MissingFieldError, match=re.escape("holds no field 'mask.png' (it holds")):
            samples[1]["mask.png"]  # a field the pack holds, this sample not: as before
        for batch in (packdata.fields_collate(samples), default_collate(samples[:1])):
            with pytest.raises(KeyError, match=re.escape(typo)):
                batch["jgp"]
        with pytest.raises(
            KeyError, match=re.escape(typo.replace("'jgp'", "'zzz'", 1).replace("Did you mean 'jpg'? ", ""))
        ):
            samples[0]["zzz"]
    with pytest.raises(
        ConfigError, match=re.escape(typo.replace("'jgp'", "'mask'", 1).replace("'jpg'?", "'mask.png'?"))
    ):
        _datasets(pack.pack, fmt, fields=("__key__", "mask"))


class _Touch:
    """Unpickled, it creates the file at ``path``: what a pickle in a pack could do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))


def _tar(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in sorted(members.items()):  # a sample's members together, as WebDataset shards hold them
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("num_workers", [0, 2])
def test_webdataset_s_integer_fields_read_as_ints_as_webdataset_reads_them_and_pickles_as_bytes_never_unpickled(
    tmp_path: Path, num_workers: int
) -> None:
    """A WebDataset shard's seg.cls field (checked an integer at convert) read back as bytes (b'3\\n'), where
    webdataset's default decoder gives 3, and decode= had no integer decoder for its cls2 or index fields. Now a cls
    field reads as an int and decode={'cls2': 'int'} gives one, equal to what webdataset reads from the same
    members, through DataLoader workers; a cls field PackWriter is given that is no integer is refused. The pyd,
    pickle, pkl and pth fields webdataset unpickles read as their bytes, and no decoder name unpickles."""
    wds = pytest.importorskip("webdataset")
    marker = tmp_path / "unpickled"
    evil = pickle.dumps(_Touch(str(marker)))
    safe: dict[str, bytes] = {}
    for i in range(3):
        safe |= {f"s{i}.jpg": image_bytes(i), f"s{i}.seg.cls": b"%d\n" % (i + 3), f"s{i}.cls2": b"%d" % (10 + i)}
    pickles = {f"s{i}.{ext}": evil for i in range(3) for ext in ("pyd", "pickle", "pkl", "pth")}
    pack = packdata.convert(_tar(tmp_path / "all.tar", safe | pickles), tmp_path / "p.lmdb", progress=False).pack
    ds = packdata.LMDBDataset(pack, decode={"jpg": "bytes", "cls2": "int"})
    got = {sample["__key__"]: sample for sample in DataLoader(ds, batch_size=None, num_workers=num_workers)}
    theirs = {
        s["__key__"]: s for s in wds.WebDataset(str(_tar(tmp_path / "safe.tar", safe)), shardshuffle=False).decode()
    }
    assert sorted(got) == sorted(theirs) == ["s0", "s1", "s2"]
    for i, key in enumerate(sorted(got)):
        assert type(got[key]["seg.cls"]) is int and got[key]["seg.cls"] == theirs[key]["seg.cls"] == i + 3
        assert type(got[key]["cls2"]) is int and got[key]["cls2"] == theirs[key]["cls2"] == 10 + i
        assert {ext: got[key][ext] for ext in ("pyd", "pickle", "pkl", "pth")} == dict.fromkeys(
            ("pyd", "pickle", "pkl", "pth"), evil
        )
    assert not marker.exists()
    with pytest.raises(ValueError, match=re.escape("'npy', 'int' or a callable, but got decode='pickle'")):
        packdata.LMDBDataset(pack, decode={"pyd": "pickle"})
    refused = "field 'seg.cls': a cls field holds a decimal integer, read as an int, not b'three'"
    with pytest.raises(packdata.PackdataError, match=re.escape(refused)), packdata.PackWriter(tmp_path / "w") as writer:
        writer.write({"__key__": "a", "seg.cls": "three"})


def test_webdataset_s_other_decoded_fields_read_as_bytes_and_as_webdataset_reads_them_when_asked(
    tmp_path: Path,
) -> None:
    """webdataset 1.0.2's default decoders also read inx, index and id as ints, jsn as JSON and transcript as text.
    packdata keeps their codec bytes, so an id holding no integer (a hash) or a jsn holding no JSON still converts
    and a pack merges with the packs converted before it (merge refuses a field of two codecs); decode= gives what
    webdataset gives, through a DataLoader worker."""
    wds = pytest.importorskip("webdataset")
    members: dict[str, bytes] = {}
    for i in range(3):
        members |= {f"s{i}.inx": b"%d" % i, f"s{i}.index": b" %d\n" % (i - 1), f"s{i}.id": b"%d" % (100 + i)}
        members |= {f"s{i}.jsn": b'{"i": %d}' % i, f"s{i}.transcript": "caf\u00e9 %d".encode() % i}
    pack = packdata.convert(_tar(tmp_path / "t.tar", members), tmp_path / "p.lmdb", progress=False).pack
    names = ("inx", "index", "id", "jsn", "transcript")
    assert {name: read_manifest(pack).codecs[name] for name in names} == dict.fromkeys(names, "bytes")
    asked = {"inx": "int", "index": "int", "id": "int", "jsn": "json", "transcript": "text"}
    ds = packdata.LMDBDataset(pack, decode=asked)
    got = {sample["__key__"]: sample for sample in DataLoader(ds, batch_size=None, num_workers=1)}
    theirs = {s["__key__"]: s for s in wds.WebDataset(str(tmp_path / "t.tar"), shardshuffle=False).decode()}
    assert sorted(got) == sorted(theirs) == ["s0", "s1", "s2"]
    for key in got:
        assert {name: got[key][name] for name in names} == {name: theirs[key][name] for name in names}
    assert packdata.LMDBDataset(pack)[0]["id"] == b"100"  # by default: its bytes, as in a pack written before
    (tmp_path / "u").mkdir()
    (tmp_path / "u" / "a.id").write_bytes(b"9f86d081")  # an id that is a hash, not an integer: packed, as before
    (tmp_path / "u" / "a.jsn").write_bytes(b"not json")
    assert packdata.convert(tmp_path / "u", tmp_path / "u.lmdb", layout="grouped", progress=False).packed == 1
    assert packdata.merge_packs([pack, tmp_path / "u.lmdb"], tmp_path / "m.lmdb").samples == 4
