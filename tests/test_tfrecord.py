"""TFRecord packs: writer format, readers, splitting across ranks and workers, damage."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import pickle
import re
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import assert_index_digests, flip_label, image_bytes
from google.protobuf.message import DecodeError as ProtobufDecodeError
from tfrecord import example_pb2
from tfrecord.reader import tfrecord_loader
from torch.utils.data import DataLoader

import packdata
import packdata.reading.streaming as tfd
from packdata import PackFormatError, TFRecordDataset, TFRecordIndexedDataset, convert, verify_pack
from packdata.cli import main
from packdata.formats.tfrecord_example import encode_example, encode_with_span
from packdata.formats.tfrecord_framing import frame_record
from packdata.formats.tfrecord_parse import example_fields, parse_example
from packdata.formats.tfrecord_tables import index_path, map_record_table, payload_path
from packdata.formats.tfrecord_writer import TFRecordShardWriter
from packdata.pack.manifest import read_manifest
from packdata.pack.records import RecordError, Sample


def _expected(root: Path) -> dict[str, tuple[bytes, int]]:
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    return {
        p.relative_to(root).as_posix(): (p.read_bytes(), classes.index(p.parent.name) if p.parent != root else -1)
        for p in root.rglob("*")
        if p.is_file()
    }


@pytest.fixture
def tf_images(tmp_path: Path) -> Path:
    """3 classes of JPEGs and PNGs, odd names, and an unlabelled image at the root: 13 images."""
    root = tmp_path / "images"
    for c, cls in enumerate(["cat", "dog", "zebra"]):
        (root / cls).mkdir(parents=True)
        for i, name in enumerate(["a.jpg", "b c.JPEG", "ünï.png", "d.jpg"]):
            (root / cls / name).write_bytes(
                image_bytes(10 * c + i, (20, 16), "PNG" if name.endswith(".png") else "JPEG")
            )
    (root / "root.jpg").write_bytes(image_bytes(99, (20, 16)))
    return root


@pytest.fixture
def tf_texts(tmp_path: Path) -> Path:
    """2 classes x 15 small text files."""
    root = tmp_path / "texts"
    for cls in ("neg", "pos"):
        (root / cls).mkdir(parents=True)
        for i in range(15):
            (root / cls / f"doc{i:02d}.txt").write_text(f"{cls} document {i} café " * (i + 1), encoding="utf-8")
    return root


def _text_pack(tf_texts: Path, tmp_path: Path, shard_samples: int) -> Path:
    dst = tmp_path / f"texts-{shard_samples}"
    convert(tf_texts, dst, format="tfrecord", shard_samples=shard_samples, progress=False)
    return dst


def _masked(data: bytes) -> int:
    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _records(path: Path) -> list[tuple[int, bytes]]:
    """An independent TFRecord framing walker: ``(offset, data)`` with both CRCs asserted."""
    blob = path.read_bytes()
    out, pos = [], 0
    while pos < len(blob):
        (length,) = struct.unpack_from("<Q", blob, pos)
        (length_crc,) = struct.unpack_from("<I", blob, pos + 8)
        assert length_crc == _masked(blob[pos : pos + 8])
        data = blob[pos + 12 : pos + 12 + length]
        (data_crc,) = struct.unpack_from("<I", blob, pos + 12 + length)
        assert data_crc == _masked(data)
        out.append((pos, data))
        pos += 16 + length
    assert pos == len(blob)
    return out


def test_round_trip_every_byte_key_and_label(tf_images: Path, tmp_path: Path) -> None:
    result = convert(tf_images, tmp_path / "out", format="tfrecord", shard_samples=4, progress=False)
    expected = _expected(tf_images)
    assert result.packed == len(expected) == 13 and result.shards == 4
    pack = tmp_path / "out"
    names = sorted(p.name for p in pack.glob("*.tfrecord"))
    assert names == [f"out-{i:05d}-of-00004.tfrecord" for i in range(4)]
    assert all(index_path(pack / n).is_file() for n in names)
    indexed = TFRecordIndexedDataset(pack, decode="bytes")
    assert {indexed.keys[i]: indexed[i] for i in range(len(indexed))} == expected
    assert indexed.classes == ["cat", "dog", "zebra"] and indexed.class_to_idx["zebra"] == 2
    assert list(indexed.targets) == [expected[k][1] for k in indexed.keys]
    streamed = [s for s in TFRecordDataset(pack, decode="bytes", shuffle=False)]
    assert streamed == [expected[k] for k in indexed.keys]  # pack order
    manifest = json.loads((pack / "manifest.json").read_text())
    assert [s["file"] for s in manifest["shards"]] == names
    assert verify_pack(pack, progress=False).records == 13


def test_framing_crcs_and_features_checked_independently(tf_images: Path, tmp_path: Path) -> None:
    convert(tf_images, tmp_path / "out", format="tfrecord", shard_samples=5, progress=False)
    expected = _expected(tf_images)
    seen = {}
    for shard in sorted((tmp_path / "out").glob("*.tfrecord")):
        records = _records(shard)
        lines = index_path(shard).read_text().splitlines()
        assert lines == [f"{offset} {len(data) + 16}" for offset, data in records]
        for _, data in records:
            example = example_pb2.Example()
            example.ParseFromString(data)
            feature = example.features.feature
            key = feature["image/filename"].bytes_list.value[0].decode()
            fmt = feature["image/format"].bytes_list.value[0]
            assert fmt == (b"png" if key.endswith(".png") else b"jpeg")
            seen[key] = (feature["image/encoded"].bytes_list.value[0], feature["image/class/label"].int64_list.value[0])
    assert seen == expected


def test_tfrecord_package_reads_shards_with_their_index(tf_images: Path, tmp_path: Path) -> None:
    convert(
        tf_images, tmp_path / "out", format="tfrecord", shard_samples=5, progress=False
    )  # its loader needs 2+ lines
    expected = _expected(tf_images)
    seen = {}
    for shard in sorted((tmp_path / "out").glob("*.tfrecord")):
        for shard_part in range(2):  # index-based splitting, as its torch dataset does it
            for ex in tfrecord_loader(str(shard), str(index_path(shard)), shard=(shard_part, 2)):
                seen[ex["image/filename"].decode()] = (ex["image/encoded"], int(ex["image/class/label"][0]))
    assert seen == expected


def test_text_pack_uses_text_encoded(tf_texts: Path, tmp_path: Path) -> None:
    pack = _text_pack(tf_texts, tmp_path, 8)
    for _, data in _records(next(pack.glob("*.tfrecord"))):
        example = example_pb2.Example()
        example.ParseFromString(data)
        assert set(example.features.feature) == {"text/encoded", "image/class/label", "image/filename"}
    ds = TFRecordIndexedDataset(pack, decode="text")
    assert ds[0] == ("neg document 0 café ", 0)
    assert sorted(k for _, k in TFRecordDataset(pack, decode="text")) == [0] * 15 + [1] * 15


def test_parser_reads_examples_written_by_others() -> None:
    example = example_pb2.Example()
    feature = example.features.feature
    feature["image/height"].int64_list.value.append(7)  # unknown features are skipped
    feature["image/class/label"].int64_list.value.extend([-3, 5])
    feature["image/encoded"].bytes_list.value.append(b"\xff\xd8payload")
    feature["image/filename"].bytes_list.value.append("x/ü.jpg".encode())
    for deterministic in (True, False):
        parsed = parse_example(example.SerializeToString(deterministic=deterministic))
        assert (bytes(parsed.data), parsed.label, parsed.key, parsed.kind) == (
            b"\xff\xd8payload",
            -3,
            "x/ü.jpg".encode(),
            "image",
        )
    minimal = example_pb2.Example()
    minimal.features.feature["image/encoded"].bytes_list.value.append(b"abc")
    parsed = parse_example(minimal.SerializeToString())
    assert (bytes(parsed.data), parsed.label, parsed.key) == (b"abc", -1, b"")
    # int64 written unpacked (field 1, wire type 0) instead of packed
    entry_value = b"\x1a\x02\x08\x09"  # Feature.int64_list { value: 9 } unpacked
    entry = b"\x0a\x11image/class/label\x12" + bytes([len(entry_value)]) + entry_value
    blob = b"\x0a" + bytes([len(entry) + 2]) + b"\x0a" + bytes([len(entry)]) + entry
    blob = minimal.SerializeToString() + blob  # Features messages merge
    assert parse_example(blob).label == 9


def test_writer_resume_gives_identical_shard(tmp_path: Path) -> None:
    samples = [(i, Sample(f"k{i}.jpg", i % 3, bytes([i]) * (100 + i))) for i in range(9)]
    whole = TFRecordShardWriter(tmp_path / "a.tfrecord")
    whole.write(samples)
    expected = whole.close()
    part = TFRecordShardWriter(tmp_path / "b.tfrecord")
    part.write(samples[:6])
    part.sync()
    part._file.close()
    part._index.close()  # killed after its checkpoint at 4 (records 4 and 5 are past it)
    resumed = TFRecordShardWriter(tmp_path / "b.tfrecord", resume_at=4)
    resumed.write(samples[4:])
    assert resumed.close() == expected
    assert (tmp_path / "a.tfrecord").read_bytes() == (tmp_path / "b.tfrecord").read_bytes()
    assert (tmp_path / "a.tfindex").read_bytes() == (tmp_path / "b.tfindex").read_bytes()
    assert frame_record(b"")[:8] == b"\0" * 8


class _FakeWorker:
    def __init__(self, id: int, num_workers: int) -> None:
        self.id, self.num_workers = id, num_workers


def _epoch(pack: Path, world: int, workers: int, monkeypatch: pytest.MonkeyPatch, **kw) -> list[list[int]]:
    """Labels-and-keys stand-in: each rank's list of sample ids for one epoch, workers simulated."""
    per_rank = []
    for rank in range(world):
        ds = TFRecordDataset(pack, decode="bytes", rank=rank, world_size=world, **kw)
        ids: list[int] = []
        for w in range(max(workers, 1)):
            info = _FakeWorker(w, workers) if workers else None
            monkeypatch.setattr(tfd, "get_worker_info", lambda info=info: info)
            ids.extend(_sample_id(data) for data, _ in ds)
        assert len(ids) == len(ds)
        per_rank.append(ids)
    return per_rank


def _sample_id(data: bytes) -> int:
    cls, _, i = data.decode().split(" ")[:3]
    return (cls == "pos") * 100 + int(i)


ALL_IDS = sorted([i for i in range(15)] + [100 + i for i in range(15)])


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("workers", [0, 1, 2, 3])
@pytest.mark.parametrize("shard_samples", [16, 2])  # 2 shards (fewer than readers) and 15 shards (more)
def test_exactly_once_per_epoch(
    tf_texts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, world: int, workers: int, shard_samples: int
) -> None:
    pack = _text_pack(tf_texts, tmp_path, shard_samples)
    for drop in (False, True):
        ranks = _epoch(pack, world, workers, monkeypatch, drop_uneven=drop, seed=3)
        counts = Counter(i for ids in ranks for i in ids)
        assert len({len(ids) for ids in ranks}) == 1  # equal per-rank counts
        if drop:
            assert len(ranks[0]) == 30 // world and set(counts) <= set(ALL_IDS)
            assert max(counts.values()) == 1 and len(counts) == world * (30 // world)
        else:
            assert len(ranks[0]) == -(-30 // world) and set(counts) == set(ALL_IDS)
            assert sum(counts.values()) - 30 == world * len(ranks[0]) - 30  # only padding repeats


def test_a_pack_of_no_samples_is_named_as_such_not_as_drop_uneven(tf_texts: Path, tmp_path: Path) -> None:
    """A manifest of 0 samples (one empty shard, an empty index: packdata writes none) was refused as
    'drop_uneven=True leaves no samples ... Pass drop_uneven=False' with drop_uneven=False already."""
    import hashlib

    from faults.hostile import rewrite_manifest

    pack = _text_pack(tf_texts, tmp_path, 100)
    shard = pack / read_manifest(pack).shards[0].file
    shard.write_bytes(b"")
    index_path(shard).write_bytes(b"")
    payload_path(shard).unlink()
    for name in ("labels.i32", "sizes.i64", "keys.utf8"):
        (pack / "index" / name).write_bytes(b"")
    (pack / "index" / "key_offsets.i64").write_bytes(bytes(8))

    def empty(d: dict) -> None:
        d["num_samples"] = d["source"]["files_found"] = 0
        d["shards"][0].update(num_samples=0, bytes=0, sha256=hashlib.sha256(b"").hexdigest())
        d["index"]["sha256"] = {
            n: hashlib.sha256((pack / "index" / n).read_bytes()).hexdigest() for n in d["index"]["sha256"]
        }

    rewrite_manifest(pack, empty)
    assert len(TFRecordIndexedDataset(pack)) == 0
    with pytest.raises(PackFormatError, match=re.escape(str(pack)) + ": pack holds no samples"):
        TFRecordDataset(pack, drop_uneven=False)


def test_drop_uneven_leaving_no_samples_is_an_option_error_not_a_damaged_pack(tf_texts: Path, tmp_path: Path) -> None:
    """It was a PackFormatError (a damaged pack) for 30 samples over world_size=31: the options are what is wrong."""
    import packdata

    pack = _text_pack(tf_texts, tmp_path, 16)
    with pytest.raises(
        packdata.ConfigError, match=r"drop_uneven=True leaves no samples: 30 samples over world_size=31"
    ):
        TFRecordDataset(pack, rank=0, world_size=31, drop_uneven=True)
    assert len(TFRecordDataset(pack, rank=0, world_size=31)) == 1  # padded


def test_order_changes_per_epoch_and_repeats_for_same_seed(tf_texts: Path, tmp_path: Path) -> None:
    pack = _text_pack(tf_texts, tmp_path, 4)

    def order(epoch: int, seed: int = 0) -> list[int]:
        ds = TFRecordDataset(pack, decode="bytes", seed=seed, shuffle_buffer=8)
        ds.set_epoch(epoch)
        return [_sample_id(d) for d, _ in ds]

    assert order(0) == order(0) and order(1) == order(1)
    assert order(0) != order(1) and order(0) != order(0, seed=1)
    assert sorted(order(0)) == ALL_IDS
    assert [_sample_id(d) for d, _ in TFRecordDataset(pack, decode="bytes", shuffle=False)] == ALL_IDS


def _as_list(batch: list) -> list:
    return batch


def test_dataloader_fork_workers_exactly_once(tf_texts: Path, tmp_path: Path) -> None:
    pack = _text_pack(tf_texts, tmp_path, 4)
    seen: list[int] = []
    for rank in range(2):
        ds = TFRecordDataset(pack, decode="bytes", rank=rank, world_size=2, seed=5)
        loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork", collate_fn=_as_list)
        ids = [_sample_id(d) for batch in loader for d, _ in batch]
        assert len(ids) == len(ds) == 15
        seen += ids
    assert sorted(seen) == ALL_IDS
    indexed = TFRecordIndexedDataset(pack, decode="bytes")
    indexed[3]  # a descriptor opened in the parent must not leak into workers
    loader = DataLoader(indexed, batch_size=5, num_workers=2, multiprocessing_context="fork", collate_fn=_as_list)
    assert sorted(_sample_id(d) for batch in loader for d, _ in batch) == ALL_IDS


def test_dataloader_spawn_workers_exactly_once(tf_texts: Path, tmp_path: Path) -> None:
    """One spawn run (each spawned worker imports torch afresh: seconds each)."""
    pack = _text_pack(tf_texts, tmp_path, 4)
    ds = TFRecordDataset(pack, decode="bytes", seed=5)
    ds.set_epoch(2)
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="spawn", collate_fn=_as_list)
    ids = [_sample_id(d) for batch in loader for d, _ in batch]
    assert sorted(ids) == ALL_IDS


@pytest.mark.parametrize(
    ("context", "copy_by"), [("fork", None), ("spawn", None), ("fork", "pickle"), ("fork", "deepcopy")]
)
def test_set_epoch_reaches_persistent_workers(tf_texts: Path, tmp_path: Path, context: str, copy_by: str) -> None:
    """Each epoch of a persistent_workers loader yields that epoch's order: the one a fresh loader yields.

    Also for a copy of the dataset (pickle or deepcopy): it kept the unshared tensor it was copied with and read
    its epoch there, so its forked workers never saw ``set_epoch``.
    """
    pack = _text_pack(tf_texts, tmp_path, 4)
    ds = TFRecordDataset(pack, decode="bytes", seed=5, shuffle_buffer=4)
    if copy_by == "pickle":
        ds = pickle.loads(pickle.dumps(ds))
    elif copy_by == "deepcopy":
        ds = copy.deepcopy(ds)
    kw = {"batch_size": 4, "num_workers": 2, "collate_fn": _as_list}
    persistent = DataLoader(ds, multiprocessing_context=context, persistent_workers=True, **kw)
    orders = []
    for epoch in (0, 1, 1, 2):  # epoch 1 twice: the same order again
        ds.set_epoch(epoch)
        got = [_sample_id(d) for batch in persistent for d, _ in batch]
        fresh = [_sample_id(d) for batch in DataLoader(ds, multiprocessing_context="fork", **kw) for d, _ in batch]
        assert got == fresh, f"epoch {epoch}"
        orders.append(got)
    assert sorted(orders[0]) == ALL_IDS
    assert orders[1] == orders[2] and len({tuple(orders[0]), tuple(orders[1]), tuple(orders[3])}) == 3


def _shared_memory_files() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/shm/")
    return count


def test_a_stream_takes_shared_memory_only_for_spawned_workers(tf_texts: Path, tmp_path: Path) -> None:
    """Each TFRecordDataset made a shared-memory tensor when built (a file of /dev/shm held open, and no
    dataset at all where /dev/shm is unusable), though only a copy pickled for a spawned worker needs one."""
    pack = _text_pack(tf_texts, tmp_path, 4)
    before = _shared_memory_files()
    streams = [TFRecordDataset(pack, decode="bytes", seed=5) for _ in range(3)]
    for ds in streams:
        ds.set_epoch(1)
        list(DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork", collate_fn=_as_list))
    assert _shared_memory_files() == before
    pickle.dumps(streams[0])  # as for a spawned worker: now it has one
    assert _shared_memory_files() == before + 1


def test_datasets_pickle(tf_texts: Path, tmp_path: Path) -> None:
    pack = _text_pack(tf_texts, tmp_path, 8)
    indexed = TFRecordIndexedDataset(pack, decode="bytes")
    indexed[0]
    clone = pickle.loads(pickle.dumps(indexed))
    assert [clone[i] for i in range(30)] == [indexed[i] for i in range(30)]
    stream = TFRecordDataset(pack, decode="bytes", seed=2)
    stream.set_epoch(4)
    assert list(pickle.loads(pickle.dumps(stream))) == list(stream)


def _corrupt(pack: Path, mode: str) -> tuple[Path, int]:
    """Damage the second record of the first shard; return the shard and that record's offset."""
    shard = sorted(pack.glob("*.tfrecord"))[0]
    offset, length = (int(v) for v in index_path(shard).read_text().splitlines()[1].split())
    blob = bytearray(shard.read_bytes())
    if mode == "flip":
        blob[offset + 12 + 5] ^= 0x10  # a bit inside the Example
    else:
        del blob[offset + length // 2 :]
    shard.write_bytes(bytes(blob))
    return shard, offset


def test_indexed_reads_slice_payloads_by_the_table_and_name_a_damaged_row(tf_texts: Path, tmp_path: Path) -> None:
    """With CRCs on, a payload comes from the payload table (no Example parse): the same bytes as parsing gives."""
    pack = _text_pack(tf_texts, tmp_path, 4)
    fast = TFRecordIndexedDataset(pack, decode="bytes")
    parsed = TFRecordIndexedDataset(pack, decode="bytes", check_crc=False)  # parses every record
    assert [fast[i] for i in range(len(fast))] == [parsed[i] for i in range(len(parsed))]
    table = payload_path(pack / read_manifest(pack).shards[0].file)
    raw = bytearray(table.read_bytes())
    raw[48 + 24 + 8] -= 1  # the second record's payload offset, one byte back (rows 0 and 1 are the header)
    table.write_bytes(bytes(raw))
    damaged = TFRecordIndexedDataset(pack, decode="bytes")
    assert damaged[0] == fast[0]
    with pytest.raises(
        PackFormatError,
        match=r"00000-of-\d+\.tfpayload: the payload table does not point at the payload .* the table is damaged",
    ):
        damaged[1]


@pytest.mark.parametrize("mode", ["flip", "truncate"])
def test_damaged_shard_names_shard_and_offset(tf_texts: Path, tmp_path: Path, mode: str) -> None:
    pack = _text_pack(tf_texts, tmp_path, 10)
    shard, offset = _corrupt(pack, mode)
    message = re.escape(str(shard)) + r".*byte offset " + str(offset)
    if mode == "truncate":  # caught before any record is read: the file is not the manifest's size
        message = re.escape(str(shard)) + r": shard is \d+ bytes, the manifest .* says \d+"
    with pytest.raises(PackFormatError, match=message):
        list(TFRecordDataset(pack, decode="bytes", shuffle=False))
    with pytest.raises(PackFormatError, match=message):
        TFRecordIndexedDataset(pack, decode="bytes")[1]
    with pytest.raises(PackFormatError, match=re.escape(str(shard))):
        verify_pack(pack, progress=False)
    if mode == "flip":
        # opting out of CRCs still checks framing and the label against the index: the flipped
        # bit renames the label feature, so the record's label is missing
        with pytest.raises(PackFormatError, match=re.escape(str(shard)) + r".*the sample index says 0"):
            TFRecordIndexedDataset(pack, decode="bytes", check_crc=False)[1]
    runner = CliRunner()
    result = runner.invoke(main, ["verify", "-q", str(pack)])
    assert result.exit_code == 1 and "Error:" in result.output and str(shard) in result.output


def test_records_swapped_within_a_label_are_named_by_key(tf_images: Path, tmp_path: Path) -> None:
    """Two records of one class swapped (index rewritten, record table gone, manifest kept): the key is compared.

    The shard keeps its size, and both records carry the label the index expects
    at each place: only the record's own key (``image/filename``) tells the swap.
    """
    pack = tmp_path / "swapped"
    convert(tf_images, pack, format="tfrecord", shard_samples=5, progress=False)
    ds = TFRecordIndexedDataset(pack, decode="bytes")
    assert ds.targets[0] == ds.targets[1]
    shard = pack / read_manifest(pack).shards[0].file
    records = [frame_record(data) for _, data in _records(shard)]
    records[0], records[1] = records[1], records[0]
    shard.write_bytes(b"".join(records))
    starts = np.cumsum([0] + [len(r) for r in records])
    index_path(shard).write_text("".join(f"{start} {len(r)}\n" for start, r in zip(starts, records, strict=False)))
    payload_path(shard).unlink()  # as another TFRecord tool rewrites a shard: records are parsed
    message = re.escape(str(shard)) + r": record 0 at byte offset 0 is damaged: it holds key 'cat/b c.JPEG', "
    message += r"the sample index says 'cat/a.jpg'"
    for make in (
        lambda: TFRecordIndexedDataset(pack, decode="bytes")[0],
        lambda: TFRecordIndexedDataset(pack, decode="bytes", check_crc=False)[0],
        lambda: next(iter(TFRecordDataset(pack, decode="bytes", shuffle=False))),
        lambda: list(TFRecordDataset(pack, shuffle=True)),  # decoded: the same check before the decode
    ):
        with pytest.raises(PackFormatError, match=message):
            make()


@pytest.mark.parametrize(
    ("case", "old", "new"), [("key", b"\x0a\x02k0", b"\x0a\x02k\xff"), ("field", b"json", b"js\xffn")]
)
def test_a_multi_field_record_not_utf8_is_named(tmp_path: Path, case: str, old: bytes, new: bytes) -> None:
    """A record whose key or a field name is not UTF-8 (CRCs valid) is one PackFormatError naming shard and record."""
    pack = tmp_path / "f"
    samples = [{"__key__": f"k{i}", "json": {"i": i}, "txt": f"t{i}"} for i in range(3)]
    packdata.write_pack(samples, pack, format="tfrecord", progress=False)
    shard = pack / read_manifest(pack).shards[0].file
    (offset, data), *_ = _records(shard)
    assert data.count(old) == (1 if case == "key" else 2)  # the field's feature and its name in packdata/fields
    blob = shard.read_bytes()
    record = frame_record(data.replace(old, new))  # the same length: the shard keeps the manifest's size
    shard.write_bytes(blob[:offset] + record + blob[offset + len(record) :])
    message = re.escape(str(shard)) + r": record 0 at byte offset 0 is damaged: .* which is not UTF-8"
    for make in (
        lambda: TFRecordIndexedDataset(pack)[0],
        lambda: next(iter(TFRecordDataset(pack, shuffle=False))),
    ):
        with pytest.raises(PackFormatError, match=message):
            make()
    with pytest.raises(PackFormatError, match=re.escape(str(shard))):
        verify_pack(pack, progress=False)


def test_an_image_that_cannot_be_decoded_is_named_by_key_in_both_readers(tf_images: Path, tmp_path: Path) -> None:
    whole = image_bytes(4, (128, 96), "PNG")
    (tf_images / "dog" / "half.png").write_bytes(whole[: len(whole) // 2])  # packed: not decoded at convert
    pack = tmp_path / "p"
    convert(tf_images, pack, format="tfrecord", shard_samples=5, progress=False)
    ds = TFRecordIndexedDataset(pack)
    i = ds.keys.index("dog/half.png")
    message = re.escape(f"{pack}: sample 'dog/half.png' (index {i}): image data is truncated or damaged")
    for make in (lambda: ds[i], lambda: list(TFRecordDataset(pack, shuffle=True))):
        with pytest.raises(packdata.ImageFormatError, match=message):
            make()


@pytest.mark.timeout(60)  # a FIFO opened for reading blocks until a writer comes: a hang is the failure
def test_a_fifo_in_place_of_a_shard_is_named_and_never_opened(tf_texts: Path, tmp_path: Path) -> None:
    import os

    pack = _text_pack(tf_texts, tmp_path, 10)
    shard = sorted(pack.glob("*.tfrecord"))[0]
    shard.unlink()
    os.mkfifo(shard)
    message = re.escape(str(shard)) + r": shard file is not a regular file \(mode prw"
    with pytest.raises(PackFormatError, match=message):
        list(TFRecordDataset(pack, decode="bytes", shuffle=False))
    with pytest.raises(PackFormatError, match=message):
        TFRecordIndexedDataset(pack, decode="bytes")[0]
    with pytest.raises(PackFormatError, match=message):
        verify_pack(pack, progress=False)


def test_cat_and_export_of_a_pack_missing_a_shard_name_it(tf_texts: Path, tmp_path: Path) -> None:
    """Its offsets index still there, the shard's open raised a raw FileNotFoundError (a traceback)."""
    pack = _text_pack(tf_texts, tmp_path, 10)
    shard = sorted(pack.glob("*.tfrecord"))[0]
    shard.unlink()
    line = f"Error: {shard}: the shard file is missing. The pack is incomplete: convert or stage it again\n"
    for args in (["cat", str(pack), "#0"], ["export", str(pack), str(tmp_path / "files")]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1 and result.output == line, result.output


def test_cli_info_and_verify(tf_images: Path, tmp_path: Path) -> None:
    convert(tf_images, tmp_path / "out.tfrecord", shard_samples=5, progress=False)
    runner = CliRunner()
    info = runner.invoke(main, ["info", str(tmp_path / "out.tfrecord")])
    assert info.exit_code == 0 and "tfrecord" in info.output and "shards:   3" in info.output
    verify = runner.invoke(main, ["verify", "-q", str(tmp_path / "out.tfrecord")])
    assert verify.exit_code == 0 and "ok: 13 records" in verify.output
    assert (tmp_path / "out.tfrecord" / "out-00002-of-00003.tfrecord").is_file()


def test_resumed_convert_matches_uninterrupted(
    tf_images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conv = sys.modules["packdata.conversion.local"]

    convert(tf_images, tmp_path / "whole", format="tfrecord", shard_samples=5, progress=False)
    monkeypatch.setattr(conv, "_COMMIT_SAMPLES", 3)
    calls = {"n": 0}
    real = conv._Packer._commit

    def crash_after_two(self: conv._Packer) -> None:
        real(self)
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(conv._Packer, "_commit", crash_after_two)
    with pytest.raises(KeyboardInterrupt):
        convert(tf_images, tmp_path / "cut", format="tfrecord", shard_samples=5, progress=False)
    monkeypatch.setattr(conv._Packer, "_commit", real)
    convert(tf_images, tmp_path / "cut", format="tfrecord", shard_samples=5, progress=False, resume=True)
    for shard in sorted((tmp_path / "whole").glob("*.tf*")):
        other = tmp_path / "cut" / shard.name.replace("whole", "cut")
        assert other.read_bytes() == shard.read_bytes()


def test_rank_and_world_from_environment(tf_texts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pack = _text_pack(tf_texts, tmp_path, 8)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    ds = TFRecordDataset(pack, decode="bytes")
    assert (ds.rank, ds.world_size, len(ds)) == (2, 4, 8)
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="rank should be in"):
        TFRecordDataset(pack, rank=4, world_size=4)


def test_parser_agrees_with_protobuf_on_random_examples() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        example = example_pb2.Example()
        feature = example.features.feature
        names = ["image/encoded", "image/class/label", "image/filename", "image/format", "extra/x"]
        for name in rng.permutation(names):
            if name == "image/class/label":
                feature[name].int64_list.value.append(int(rng.integers(-(2**40), 2**40)))
            elif name == "extra/x":
                feature[name].float_list.value.extend(rng.random(int(rng.integers(0, 4))).tolist())
            else:
                size = int(rng.choice([0, 1, 127, 128, 300, 20000]))
                feature[name].bytes_list.value.append(rng.bytes(size))
        blob = example.SerializeToString()
        parsed = parse_example(blob)
        assert bytes(parsed.data) == feature["image/encoded"].bytes_list.value[0]
        assert parsed.label == feature["image/class/label"].int64_list.value[0]
        assert parsed.key == feature["image/filename"].bytes_list.value[0]
        cut = blob[: int(rng.integers(1, len(blob)))]
        with pytest.raises(RecordError):
            parse_example(cut)


def _field(tag: int, body: bytes, length: int | None = None) -> bytes:
    """Protobuf field ``tag`` (its key byte) holding ``body``, its length ``length`` when given (a lie)."""
    n = len(body) if length is None else length
    return bytes((tag,)) + (bytes((n,)) if n < 0x80 else bytes((n & 0x7F | 0x80, n >> 7))) + body


_KEY_ENTRY = _field(0x0A, _field(0x0A, b"image/filename") + _field(0x12, _field(0x0A, _field(0x0A, b"k.txt"))))
_TEXT = _field(0x0A, b"text/encoded")


@pytest.mark.parametrize(
    "blob",
    [
        # the text value claims the next feature's bytes too; its own feature ends after "hello"
        _field(
            0x0A, _field(0x0A, _TEXT + _field(0x12, _field(0x0A, _field(0x0A, b"hello" + _KEY_ENTRY))), 25) + _KEY_ENTRY
        ),
        # a feature longer than the features holding it (the rest would be read as Example fields)
        _field(0x0A, _field(0x0A, _TEXT + _field(0x12, _field(0x0A, _field(0x0A, b"hello")))), 3)
        + _field(0x0A, _KEY_ENTRY),
        # a label's packed values run past their list, and an unpacked one past its list
        _field(
            0x0A,
            _field(0x0A, _TEXT + _field(0x12, _field(0x0A, _field(0x0A, b"hi"))))
            + _field(0x0A, _field(0x0A, b"image/class/label") + _field(0x12, _field(0x1A, _field(0x0A, b"\x05", 9)))),
        )
        + _KEY_ENTRY,
        _field(
            0x0A,
            _field(0x0A, _TEXT + _field(0x12, _field(0x0A, _field(0x0A, b"hi"))))
            + _field(0x0A, _field(0x0A, b"image/class/label") + _field(0x12, _field(0x1A, b"\x08\x85", 2) + b"\x01")),
        )
        + _KEY_ENTRY,
        # a packed run of one byte whose varint continues past it (into the next run of the list)
        _field(
            0x0A,
            _field(0x0A, _TEXT + _field(0x12, _field(0x0A, _field(0x0A, b"hi"))))
            + _field(
                0x0A,
                _field(0x0A, b"image/class/label")
                + _field(0x12, _field(0x1A, _field(0x0A, b"\x85") + _field(0x0A, b"\x01"))),
            ),
        )
        + _KEY_ENTRY,
    ],
    ids=["value-past-feature", "feature-past-features", "packed-past-list", "varint-past-list", "varint-past-run"],
)
def test_a_length_that_runs_past_its_enclosing_message_is_refused_as_protobuf_does(blob: bytes) -> None:
    """Each nested length must end inside its parent: before, the first read the next feature as text.

    On the previous commit the parser returned b"hello" plus the filename
    feature's bytes as the text, read a feature that its features do not hold,
    or a label from outside its list.
    """
    with pytest.raises(ProtobufDecodeError, match="Error parsing message"):
        example_pb2.Example().ParseFromString(blob)
    with pytest.raises(RecordError, match=r"runs? past"):
        parse_example(blob)


def test_payload_table_used_when_valid_and_ignored_when_stale(tf_images: Path, tmp_path: Path) -> None:
    convert(tf_images, tmp_path / "out", format="tfrecord", shard_samples=4, progress=False)
    pack = tmp_path / "out"
    expected = _expected(tf_images)
    manifest = json.loads((pack / "manifest.json").read_text())
    shards = [pack / s["file"] for s in manifest["shards"]]
    for shard, info in zip(shards, manifest["shards"], strict=True):
        table = map_record_table(shard, info["num_samples"], info["bytes"], info["sha256"], payloads=True)
        assert table is not None and table.payloads is not None
        records = _records(shard)
        assert table.offsets.tolist() == [offset for offset, _ in records]
        for (_, data), (at, n) in zip(records, table.payloads.tolist(), strict=True):
            assert data[at : at + n] == bytes(parse_example(data).data)
    keys = TFRecordIndexedDataset(pack, decode="bytes").keys
    want = [expected[k] for k in keys]
    calls = []
    real = tfd.TFRecordDataset._parse

    def counting(self, *a):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(self, *a)

    tfd.TFRecordDataset._parse = counting  # type: ignore[method-assign]
    try:
        assert list(TFRecordDataset(pack, decode="bytes", shuffle=False)) == want
        assert not calls  # every shard's table is valid: no Example parsed
        stale = payload_path(shards[1])
        raw = bytearray(stale.read_bytes())
        raw[32] ^= 1  # header no longer matches the shard's SHA-256
        stale.write_bytes(bytes(raw))
        payload_path(shards[2]).write_bytes(b"\0" * 16)  # an unfinished table
        payload_path(shards[3]).unlink()  # written by another tool
        assert list(TFRecordDataset(pack, decode="bytes", shuffle=False)) == want
        assert len(calls) == sum(s["num_samples"] for s in manifest["shards"][1:])
    finally:
        tfd.TFRecordDataset._parse = real  # type: ignore[method-assign]
    # a bit flipped in a payload is still caught by the data CRC on the table path
    convert(tf_images, tmp_path / "again", format="tfrecord", shard_samples=4, progress=False)
    shard = sorted((tmp_path / "again").glob("*.tfrecord"))[0]
    offset = int(index_path(shard).read_text().split()[0])
    info = json.loads((tmp_path / "again" / "manifest.json").read_text())["shards"][0]
    table = map_record_table(shard, 4, info["bytes"], info["sha256"], payloads=True)
    assert table is not None and table.payloads is not None
    at = int(table.payloads[0, 0])
    blob = bytearray(shard.read_bytes())
    blob[offset + 12 + at + 3] ^= 0x10
    shard.write_bytes(bytes(blob))
    with pytest.raises(PackFormatError, match="CRC32C of the data"):
        list(TFRecordDataset(tmp_path / "again", decode="bytes", shuffle=False))


def test_payload_table_follows_resume(tmp_path: Path) -> None:
    samples = [(i, Sample(f"k{i}.jpg", i % 3, bytes([i]) * (100 + i))) for i in range(9)]
    whole = TFRecordShardWriter(tmp_path / "a.tfrecord")
    whole.write(samples)
    _, digest = whole.close()
    part = TFRecordShardWriter(tmp_path / "b.tfrecord")
    part.write(samples[:6])
    part.sync()
    # not closed: invalid
    assert map_record_table(tmp_path / "b.tfrecord", 6, part.bytes, part._sha.hexdigest(), payloads=True) is None
    resumed = TFRecordShardWriter(tmp_path / "b.tfrecord", resume_at=4)
    resumed.write(samples[4:])
    size, _ = resumed.close()
    assert (tmp_path / "a.tfpayload").read_bytes() == (tmp_path / "b.tfpayload").read_bytes()
    assert map_record_table(tmp_path / "b.tfrecord", 9, size, digest, payloads=True) is not None
    payload_path(tmp_path / "b.tfrecord").unlink()  # resuming a shard without a table writes none
    again = TFRecordShardWriter(tmp_path / "b.tfrecord", resume_at=4)
    again.write(samples[4:])
    assert again.close()[1] == digest
    assert not payload_path(tmp_path / "b.tfrecord").exists()


def test_large_records_read_one_by_one_checked(tmp_path: Path) -> None:
    """Records of 16 KB and more stream through one positioned read each: same samples, same checks."""
    root = tmp_path / "big"
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True)
        for i in range(6):
            (root / cls / f"t{i}.txt").write_text(f"{cls}{i} " * (6000 + 997 * i), encoding="utf-8")
    pack = tmp_path / "bigpack"
    convert(root, pack, format="tfrecord", shard_samples=5, progress=False)
    expected = _expected(root)
    keys = TFRecordIndexedDataset(pack, decode="bytes").keys
    want = [expected[k] for k in keys]
    got = list(TFRecordDataset(pack, decode="bytes", shuffle=False))
    assert got == want and all(type(data) is bytes for data, _ in got)
    assert sorted(TFRecordDataset(pack, decode="bytes", shuffle=True)) == sorted(want)
    for table in pack.glob("*.tfpayload"):
        table.unlink()  # parsed instead: the same samples
    assert list(TFRecordDataset(pack, decode="bytes", shuffle=False)) == want
    for mode in ("flip", "truncate"):
        damaged = tmp_path / f"damaged-{mode}"
        convert(root, damaged, format="tfrecord", shard_samples=5, progress=False)
        shard, offset = _corrupt(damaged, mode)
        match = re.escape(str(shard)) + r".*byte offset " + str(offset)
        if mode == "truncate":  # caught at open: the file is not the manifest's size
            match = re.escape(str(shard)) + r": shard is \d+ bytes, the manifest"
        with pytest.raises(PackFormatError, match=match):
            list(TFRecordDataset(damaged, decode="bytes", shuffle=False))


@pytest.mark.parametrize(
    "sample",
    [
        Sample("cat/ä 1.jpg", 3, b"\xff\xd8\xff" + bytes(range(256)) * 3, "image"),
        Sample("root.png", -1, b"\x89PNG\r\n\x1a\n", "image"),
        Sample("t/x.txt", 0, b"", "text"),
        Sample("t/y.txt", 2**40, b"t" * 127, "text"),  # lengths at each varint's edge: 127, 128, 2**14, 2**21
        Sample("k" * 200 + ".jpg", -(2**31), b"\xff\xd8\xff" + b"j" * 125, "image"),
        Sample("t/z.txt", 1, b"t" * 2**14, "text"),
        Sample("big.jpg", 5, b"\xff\xd8\xff" + b"j" * (2**21), "image"),
    ],
)
def test_hand_written_example_encoding_equals_protobufs(sample: Sample) -> None:
    """encode_example writes, without protobuf, the bytes protobuf's deterministic serialization writes;
    the payload's span it gives is where the parser finds the payload (it was parsed back, 22% of a
    TFRecord convert of small texts)."""
    example = example_pb2.Example()
    feature = example.features.feature
    if sample.kind == "text":
        feature["text/encoded"].bytes_list.value.append(sample.data)
    else:
        feature["image/encoded"].bytes_list.value.append(sample.data)
        feature["image/format"].bytes_list.value.append(b"jpeg" if sample.key.endswith(".jpg") else b"png")
    feature["image/class/label"].int64_list.value.append(sample.label)
    feature["image/filename"].bytes_list.value.append(sample.key.encode())
    assert encode_example(sample) == example.SerializeToString(deterministic=True)
    encoded, span = encode_with_span(sample)
    found = parse_example(memoryview(encoded), with_key=False).data
    address = np.frombuffer(found, dtype=np.uint8).ctypes.data if len(found) else 0
    at = address - np.frombuffer(encoded, dtype=np.uint8).ctypes.data
    assert span == ((at, len(found)) if len(found) else (0, 0))
    assert encoded[span[0] : span[0] + span[1]] == sample.data


def test_multi_field_example_encoding_equals_protobufs() -> None:
    from packdata.pack.fields import encode_block

    fields = {"jpg": b"\xff\xd8\xff1", "txt": "é".encode(), "seg.png": b"\x89PNG\r\n\x1a\n2", "e": b""}
    sample = Sample("k", 7, encode_block(fields), "fields")
    example = example_pb2.Example()
    feature = example.features.feature
    feature["packdata/fields"].bytes_list.value.extend(n.encode() for n in sorted(fields))
    feature["image/encoded"].bytes_list.value.append(fields["jpg"])
    feature["image/format"].bytes_list.value.append(b"jpeg")
    feature["packdata/primary"].bytes_list.value.append(b"jpg")
    for name in ("txt", "seg.png", "e"):
        feature[name].bytes_list.value.append(fields[name])
    feature["cls"].int64_list.value.append(7)
    feature["image/class/label"].int64_list.value.append(7)
    feature["image/filename"].bytes_list.value.append(b"k")
    assert encode_example(sample) == example.SerializeToString(deterministic=True)

    assert example_fields(encode_example(sample)) == (fields, 7, "k")


def test_writing_tfrecord_does_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys, packdata\n"
        f"packdata.write_pack([{{'__key__': 'a', 'txt': 'x'}}], {str(tmp_path / 'p.tfrecord')!r}, progress=False)\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_indexed_batched_reads_equal_single_reads(tf_images: Path, tmp_path: Path) -> None:
    convert(tf_images, tmp_path / "p", format="tfrecord", shard_samples=4, progress=False)
    ds = TFRecordIndexedDataset(tmp_path / "p", decode="bytes")
    order = [len(ds) - 1, 0, 5, 5, -2, 2]
    assert ds.__getitems__(order) == [ds[i] for i in order]


def test_indexed_reads_as_stored_equal_reads_through_the_decode_and_transform_layers(
    tf_images: Path, tmp_path: Path
) -> None:
    """``decode="bytes"`` with no transform skips those layers; with them, the same bytes and labels go through."""
    convert(tf_images, tmp_path / "p", format="tfrecord", shard_samples=4, progress=False)
    plain = TFRecordIndexedDataset(tmp_path / "p", decode="bytes")
    layered = TFRecordIndexedDataset(
        tmp_path / "p", decode=lambda data: data[::-1], transform=bytes.hex, target_transform=lambda y: -y - 1
    )
    parsed = TFRecordIndexedDataset(tmp_path / "p", decode="bytes", check_crc=False)  # parses each Example
    expected = [parsed[i] for i in range(len(parsed))]
    assert [label for _, label in expected] == list(plain.targets)
    assert sorted(data for data, _ in expected) == sorted(
        data for data, _ in TFRecordDataset(tmp_path / "p", decode="bytes")
    )
    assert [plain[i] for i in range(len(plain))] == expected
    assert all(type(data) is bytes for data, _ in expected)
    assert [layered[i] for i in range(len(layered))] == [(d[::-1].hex(), -y - 1) for d, y in expected]
    assert plain[-1] == expected[-1]


def test_a_changed_key_is_named_when_either_dataset_opens(tf_images: Path, tmp_path: Path) -> None:
    """Every TFRecord read matches the record to its key: the keys are hashed once, when the dataset opens.

    (LMDB datasets hash them at the first key read; a forked worker inherits the check either way.)
    """
    pack = tmp_path / "out"
    convert(tf_images, pack, format="tfrecord", shard_samples=4, progress=False)
    keys = pack / json.loads((pack / "manifest.json").read_text(encoding="utf-8"))["index"]["dir"] / "keys.utf8"
    blob = bytearray(keys.read_bytes())
    blob[-1] ^= 1  # the last key's last letter: still ASCII
    keys.write_bytes(bytes(blob))
    for dataset in (TFRecordIndexedDataset, TFRecordDataset):
        with pytest.raises(PackFormatError, match=rf"{re.escape(str(keys))}: sample index file keys\.utf8 does not"):
            dataset(pack)


def test_a_flipped_label_in_range_is_named_when_either_dataset_opens(tf_images: Path, tmp_path: Path) -> None:
    """Both TFRecord datasets read labels from ``labels.i32`` (the ``.tfpayload`` path reads only payloads).

    One bit flipped, the label still a class: each refuses to open naming the
    file and ``packdata verify``, and verify names it; without the digests (a
    pack written before them) the pack opens as before.
    """
    from faults.hostile import rewrite_manifest

    pack = tmp_path / "out"
    convert(tf_images, pack, format="tfrecord", shard_samples=4, progress=False)
    assert_index_digests(pack)
    labels = flip_label(pack)
    damaged = rf"{re.escape(str(labels))}: sample index file labels\.i32 does not match its SHA-256 in the manifest"
    for dataset in (TFRecordIndexedDataset, TFRecordDataset):
        with pytest.raises(PackFormatError, match=rf"{damaged}\. .*Run `packdata verify`"):
            dataset(pack)
    with pytest.raises(PackFormatError, match=damaged):
        verify_pack(pack, progress=False)
    rewrite_manifest(pack, lambda d: d["index"].pop("sha256"))
    assert len(TFRecordIndexedDataset(pack)) == len(TFRecordDataset(pack)) == 13
