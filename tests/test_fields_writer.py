"""The Python writer of multi-field packs (PackWriter, write_pack): atomic, what it refuses, images, threads."""

from __future__ import annotations

import io
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import image_bytes
from fields_helpers import _listed
from PIL import Image
from torch.utils.data import DataLoader

import packdata
from packdata.errors import ConfigError
from packdata.pack.manifest import read_manifest


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
    assert got == [(3, "0", 0), (0, "1", -1), (2, "2", -2)] and all(type(g[0]) is type(g[2]) is int for g in got)


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
                writer.write({"__key__": name.replace(".", "_"), name: image})  # no dot in a key
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


def test_pack_writer_refuses_an_array_whose_npy_it_could_not_read_back(tmp_path: Path) -> None:
    """A structured array of 400 fields was written, its .npy header past numpy's safe limit: every read failed."""
    names = [f"column_number_{i:04d}" for i in range(400)]
    wide = np.zeros(2, dtype=[(name, "<f8") for name in names])
    with packdata.PackWriter(tmp_path / "w.lmdb") as writer:
        with pytest.raises(ConfigError, match=r"sample 'wide': field 'npy': .*Header info length"):
            writer.write({"__key__": "wide", "npy": wide})
        writer.write({"__key__": "narrow", "npy": wide[names[:2]]})
    assert packdata.LMDBDataset(tmp_path / "w.lmdb")[0]["npy"].dtype.names == tuple(names[:2])


def test_pack_writer_refuses_a_key_whose_last_part_holds_a_dot_and_writes_the_rest(tmp_path: Path) -> None:
    """PackWriter took '__key__': 'a.b' and wrote a sample whose files a.b.txt a grouped folder, a tar and WebDataset
    read back as key 'a' (export then refused it); '.f' gave hidden files. Both are refused as they are written;
    a dot in a folder of the key is fine, and the writer goes on."""
    dst = tmp_path / "dots.lmdb"
    rule = (
        r"\. A grouped folder, a tar and WebDataset take a sample's key as its files' name up to the first dot: "
        r"keep dots out of the key's last part \(a folder's, as in 'v1\.2/a', is fine\)$"
    )
    with packdata.PackWriter(dst) as writer:
        with pytest.raises(ConfigError) as held:
            writer.write({"__key__": "a.b", "txt": "x", "cls": 3})
        assert re.fullmatch(
            re.escape(f"{dst}: sample 'a.b': the key's last part holds a dot: its files a.b.FIELD read back as key 'a'")
            + rule,
            str(held.value),
        )
        with pytest.raises(ConfigError, match=re.escape("sample 'v1.2/.f': the key's last part starts with a dot")):
            writer.write({"__key__": "v1.2/.f", "txt": "hidden"})
        writer.write({"__key__": "v1.2/g", "txt": "w"})
    assert [sample["__key__"] for sample in packdata.LMDBDataset(dst)] == ["v1.2/g"]
    with pytest.raises(ConfigError, match=re.escape("sample 'x/c.d': the key's last part holds a dot")):
        packdata.write_pack([{"__key__": "x/c", "txt": "y"}, {"__key__": "x/c.d", "txt": "z"}], tmp_path / "t.lmdb")
    assert not (tmp_path / "t.lmdb").exists()


def test_a_cls_field_holds_one_rule_in_pack_writer_and_convert_and_round_trips_through_export(tmp_path: Path) -> None:
    """PackWriter stored x.cls = -1 (and 2**64, which no DataLoader collates), while convert refused '-1' in a cls
    field as 'not a non-negative integer': the export of a PackWriter's pack did not convert back. Now one rule
    (pack.fields.cls_problem): a cls field such as x.cls holds a decimal integer within int64, negative or not, as
    webdataset's int(text) reads it; the label (the field named cls) is also at least 0, in both paths."""
    from packdata.formats.contents import export_pack

    with packdata.PackWriter(tmp_path / "w.lmdb") as writer:
        writer.write({"__key__": "a", "cls": 2, "x.cls": -1, "txt": "a"})
        writer.write({"__key__": "b", "x.cls": "-9223372036854775808", "txt": "b"})
        int64 = "an integer within int64, read as an int, not "
        for bad, says in (
            (2**63, int64 + "9223372036854775808"),
            (-(2**300), int64 + "an integer of 301 bits"),
            ("1e3", "a decimal integer, read as an int, not b'1e3'"),
        ):
            with pytest.raises(ConfigError, match=re.escape(f"sample 'bad': field 'x.cls': a cls field holds {says}")):
                writer.write({"__key__": "bad", "x.cls": bad})
        with pytest.raises(ConfigError, match="cls should be an integer >= 0, but got -2"):
            writer.write({"__key__": "bad", "cls": -2, "txt": "x"})
    export_pack(tmp_path / "w.lmdb", tmp_path / "out")
    src = tmp_path / "out"
    (src / "c.x.cls").write_bytes(b"9223372036854775808\n")  # past int64: refused as PackWriter refuses it
    (src / "c.txt").write_bytes(b"c")
    (src / "d.cls").write_bytes(b"-1\n")  # the label itself is at least 0, as PackWriter's
    (src / "d.txt").write_bytes(b"d")
    result = packdata.convert(src, tmp_path / "back.lmdb", layout="grouped", progress=False)
    assert result.packed == 2 and result.skipped == {"bad label": 2}
    assert sorted((e["key"], e["detail"]) for e in result.skip_examples) == [
        ("c", "field 'x.cls': cls file holds b'9223372036854775808\\n', not a decimal integer within int64"),
        ("d", "field 'cls': cls file holds b'-1\\n', not a non-negative integer"),
    ]
    for pack in (tmp_path / "w.lmdb", tmp_path / "back.lmdb"):
        got = list(packdata.LMDBDataset(pack, fields=("__key__", "cls", "x.cls"), missing={"cls": -1}))
        assert got == [("a", 2, -1), ("b", -1, -(2**63))]
