"""The ``.tfpayload`` record table: mapped and shared by every worker, checked, and never read as other bytes."""

from __future__ import annotations

import os
import pickle
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from conftest import image_bytes
from torch.utils.data import DataLoader

import packdata
from packdata import PackFormatError, TFRecordDataset, TFRecordIndexedDataset, convert, verify_pack
from packdata.formats.tfrecord_tables import has_record_table, map_record_table, payload_path, shard_records
from packdata.pack.manifest import read_manifest


def _texts(root: Path, n: int) -> Path:
    """``n`` text files in two classes, each holding its own key (so a payload names its sample)."""
    for i in range(n):
        key = f"c{i % 2}/t{i:04d}.txt"
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_text(f"{key}|" * (1 + i % 7), encoding="utf-8")
    return root


def _pack(tmp_path: Path, n: int, shards: int = 4, name: str = "p") -> Path:
    pack = tmp_path / name
    convert(_texts(tmp_path / f"src-{n}", n), pack, format="tfrecord", shard_samples=-(-n // shards), progress=False)
    return pack


def _key(data: bytes) -> str:
    return data.split(b"|", 1)[0].decode()


def _as_list(batch: list) -> list:
    return batch


def _all(ds: TFRecordIndexedDataset) -> list[tuple[bytes, int]]:
    return [ds[i] for i in range(len(ds))]


def _parsed(ds: TFRecordIndexedDataset) -> dict:
    """Shard -> its records parsed from the ``.tfindex`` in ``__init__`` (shards without a valid record table)."""
    return {k: kw["parsed"] for k, kw in enumerate(ds._readers.kwargs) if kw["parsed"] is not None}


def _shard0(pack: Path) -> tuple[Path, Path]:
    shard = pack / read_manifest(pack).shards[0].file
    return shard, payload_path(shard)


def _table_wrong(shard: Path) -> str:
    """What a reader says of a payload-table row that misses its sound record's payload: the table, not the shard."""
    return (
        re.escape(f"{payload_path(shard)}: the payload table does not point at the payload of the record at byte ")
        + r"offset \d+ "
        + re.escape(f"of {shard.name}, and the record is sound (its CRC32Cs match): the table is damaged, not the ")
        + re.escape("shard. Convert or stage the pack again to rebuild the table (or delete it: readers then parse")
    )


def test_pickled_dataset_does_not_grow_with_samples(tmp_path: Path) -> None:
    sizes = []
    for n in (40, 4000):
        ds = TFRecordIndexedDataset(_pack(tmp_path, n, name=f"p{n}"), decode="bytes")
        before = len(pickle.dumps(ds))
        assert _key(ds[n - 1][0]) == ds.keys[n - 1]  # the last shard's table is mapped now
        assert len(pickle.dumps(ds)) == before  # maps are dropped when pickled
        assert not _parsed(ds)  # every shard read through its record table
        sizes.append(before)
    assert sizes[1] - sizes[0] < 256  # longer numbers in the manifest; 3960 samples more would add over 60 KB
    maps = Path("/proc/self/maps")
    if maps.is_file():  # the table is a shared mapping of the file, not a private copy
        assert str(payload_path(ds._shard_paths[-1])) in maps.read_text()


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_read_every_key_once(tmp_path: Path, context: str) -> None:
    pack = _pack(tmp_path, 30)
    ds = TFRecordIndexedDataset(pack, decode="bytes")
    ds[7]  # maps and descriptors opened in the parent are never used by a worker
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=context, collate_fn=_as_list)
    keys = [_key(data) for batch in loader for data, _ in batch]
    assert sorted(keys) == sorted(f"c{i % 2}/t{i:04d}.txt" for i in range(30)) == sorted(ds.keys)


def _rows(table: Path) -> np.ndarray:
    return np.fromfile(table, dtype="<i8").reshape(-1, 3)


def _edit(table: Path, change) -> None:  # type: ignore[no-untyped-def]
    raw = _rows(table)
    change(raw)
    raw.tofile(table)


def _other_shard(pack: Path, table: Path) -> None:
    shard1 = pack / read_manifest(pack).shards[1].file
    shutil.copyfile(payload_path(shard1), table)


DAMAGES = {  # name -> (damage, whether the reader can only name it)
    "row_offset": (lambda pack, t: _edit(t, lambda r: r.__setitem__((3, 0), r[3, 0] + 1)), False),
    "row_offset_past_end": (lambda pack, t: _edit(t, lambda r: r.__setitem__((3, 0), 1 << 40)), False),
    "span_offset": (lambda pack, t: _edit(t, lambda r: r.__setitem__((3, 1), r[3, 1] - 1)), True),
    "span_length": (lambda pack, t: _edit(t, lambda r: r.__setitem__((3, 2), r[3, 2] - 1)), True),
    "span_outside": (lambda pack, t: _edit(t, lambda r: r.__setitem__((3, 2), 1 << 40)), False),
    "truncated": (lambda pack, t: t.write_bytes(t.read_bytes()[:-8]), False),
    "wrong_count": (lambda pack, t: _edit(t, lambda r: r.__setitem__((0, 2), r[0, 2] + 1)), False),
    "wrong_size": (lambda pack, t: _edit(t, lambda r: r.__setitem__((1, 0), r[1, 0] - 1)), False),
    "bad_flag": (lambda pack, t: _edit(t, lambda r: r.__setitem__((1, 2), 7)), False),
    "other_shard": (_other_shard, False),
    "row_offset_negative": (lambda pack, t: _edit(t, lambda r: r.__setitem__((3, 0), -16)), False),
    "span_negative": (lambda pack, t: _edit(t, lambda r: r.__setitem__((3, 1), -1)), False),
    "empty": (lambda pack, t: t.write_bytes(b""), False),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damaged_table_is_named_or_ignored(tmp_path: Path, damage: str) -> None:
    """Each reader names the damage or reads the clean bytes (the ``.tfindex`` checked instead); verify names it."""
    pack = _pack(tmp_path, 24)
    clean = _all(TFRecordIndexedDataset(pack, decode="bytes"))
    shard, table = _shard0(pack)
    change, only_named = DAMAGES[damage]
    change(pack, table)
    info = read_manifest(pack).shards[0]
    mapped = map_record_table(shard, info.num_samples, info.bytes, info.sha256, payloads=True)
    assert (mapped is not None) == only_named  # a table that fails its checks is never used
    for make in (
        lambda: _all(TFRecordIndexedDataset(pack, decode="bytes")),
        lambda: list(TFRecordDataset(pack, decode="bytes", shuffle=False)),
    ):
        if only_named:
            with pytest.raises(PackFormatError, match=_table_wrong(shard)):
                make()
        else:
            assert make() == clean
    with pytest.raises(PackFormatError, match=re.escape(str(table))):
        verify_pack(pack, progress=False)


def test_random_flips_in_table_are_named_or_read_right(tmp_path: Path) -> None:
    pack = _pack(tmp_path, 24)
    clean = _all(TFRecordIndexedDataset(pack, decode="bytes"))
    shard, table = _shard0(pack)
    original = table.read_bytes()
    rng = np.random.default_rng(7)
    outcomes = set()
    for _ in range(60):
        raw = bytearray(original)
        at = int(rng.integers(len(raw)))
        raw[at] ^= 1 << int(rng.integers(8))
        table.write_bytes(bytes(raw))
        try:
            got = _all(TFRecordIndexedDataset(pack, decode="bytes"))
        except PackFormatError as exc:
            assert str(shard) in str(exc) or str(table) in str(exc), str(exc)
            outcomes.add("named")
        else:
            assert got == clean
            outcomes.add("exact")
        with pytest.raises(PackFormatError, match=re.escape(str(table))):
            verify_pack(pack, progress=False)
    assert outcomes == {"named", "exact"}


def _sources(root: Path, kind: str) -> Path:
    """Two records per class: small texts, images, or texts over 16 KB (streamed one positioned read each)."""
    for i in range(4):
        key = root / f"c{i % 2}/s{i}.{'png' if kind == 'image' else 'txt'}"
        key.parent.mkdir(parents=True, exist_ok=True)
        if kind == "image":
            key.write_bytes(image_bytes(i, (8, 8), "PNG"))
        else:
            key.write_text(f"sample {i} " * (3000 if kind == "large" else 1), encoding="utf-8")
    return root


@pytest.mark.parametrize("kind", ["text", "image", "large"])
def test_a_row_pointing_at_another_bytes_value_is_named(tmp_path: Path, kind: str) -> None:
    """A row moved onto the record's ``image/filename`` or ``image/format`` value is named, never read as the payload.

    Such a value has the same protobuf header (tag 1, its length) as the payload:
    only the feature name and the Feature/BytesList framing before it tell them apart.
    """
    pack = tmp_path / "p"
    convert(_sources(tmp_path / "src", kind), pack, format="tfrecord", progress=False)
    shard, table = _shard0(pack)
    ds = TFRecordIndexedDataset(pack, decode="bytes")
    clean = _all(ds)
    name, value = (b"image/format", b"png") if kind == "image" else (b"image/filename", ds.keys[1].encode())
    blob = shard.read_bytes()
    rows = _rows(table)
    record = blob[rows[3, 0] + 12 : rows[3, 0] + 12 + int.from_bytes(blob[rows[3, 0] : rows[3, 0] + 8], "little")]
    at = record.index(value, record.rindex(name))  # the value that follows the feature's name
    _edit(table, lambda r: r.__setitem__((3, slice(1, 3)), (at, len(value))))  # record 1's row
    for make in (
        lambda: _all(TFRecordIndexedDataset(pack, decode="bytes")),
        lambda: list(TFRecordDataset(pack, decode="bytes", shuffle=False)),  # copied: one read per record
        lambda: list(TFRecordDataset(pack, decode="bytes", shuffle=True)),  # views into mapped chunks
    ):
        with pytest.raises(PackFormatError, match=_table_wrong(shard)):
            make()
    assert TFRecordIndexedDataset(pack, decode="bytes")[0] == clean[0]
    with pytest.raises(PackFormatError, match=re.escape(str(table))):
        verify_pack(pack, progress=False)


@pytest.mark.parametrize("kind", ["text", "large"])
def test_a_shard_damaged_where_a_table_row_points_is_named_as_the_shards_damage(tmp_path: Path, kind: str) -> None:
    """A flipped byte just before a record's payload (its length's varint: the table's row no longer points at
    a payload) is the shard's damage, never blamed on the table, by every reader; the large records' copied
    stream, which looks at the row before the record's CRC32C, named the shard with the table's wording."""
    pack = tmp_path / "p"
    convert(_sources(tmp_path / "src", kind), pack, format="tfrecord", progress=False)
    shard, table = _shard0(pack)
    rows = _rows(table)
    offset, at = int(rows[3, 0]), int(rows[3, 1])  # record 1's row, after the two header rows
    blob = bytearray(shard.read_bytes())
    blob[offset + 12 + at - 1] ^= 0x01
    shard.write_bytes(bytes(blob))
    damaged = re.escape(f"{shard}: record at byte offset {offset} is damaged: CRC32C of the data does not match")
    for make in (
        lambda: _all(TFRecordIndexedDataset(pack, decode="bytes")),
        lambda: list(TFRecordDataset(pack, decode="bytes", shuffle=False)),  # copied: large ones record by record
        lambda: list(TFRecordDataset(pack, decode="bytes", shuffle=True)),  # views into mapped chunks
    ):
        with pytest.raises(PackFormatError, match=damaged):
            make()


def _to_version_1(table: Path, count: int, sha256_hex: str) -> None:
    """Rewrite a record table as packdata's earlier payload table: ``(count, SHA-256 prefix)``, then spans."""
    spans = _rows(table)[2:, 1:]
    prefix = int.from_bytes(bytes.fromhex(sha256_hex[:16]), "little", signed=True)
    table.write_bytes(struct.pack("<qq", count, prefix) + spans.astype("<i8").tobytes())


@pytest.mark.parametrize("layout", ["version_1", "none"])
def test_older_packs_read_through_the_offsets_index(tmp_path: Path, layout: str) -> None:
    pack = _pack(tmp_path, 24)
    clean = _all(TFRecordIndexedDataset(pack, decode="bytes"))
    for info in read_manifest(pack).shards:
        table = payload_path(pack / info.file)
        if layout == "none":
            table.unlink()
        else:
            _to_version_1(table, info.num_samples, info.sha256)
    ds = TFRecordIndexedDataset(pack, decode="bytes")
    assert sorted(_parsed(ds)) == list(range(4))  # parsed in __init__, as before record tables
    assert all((t.payloads is not None) == (layout == "version_1") for t in _parsed(ds).values())
    assert _all(ds) == clean == _all(pickle.loads(pickle.dumps(ds)))
    assert list(TFRecordDataset(pack, decode="bytes", shuffle=False)) == clean
    verify_pack(pack, progress=False)
    index = pack / read_manifest(pack).shards[0].file.replace(".tfrecord", ".tfindex")
    index.write_text(index.read_text().replace("\n", "\n1 ", 1))  # the checked path still names a bad index
    with pytest.raises(PackFormatError, match=re.escape(str(index))):
        TFRecordIndexedDataset(pack, decode="bytes")


def test_a_version_1_span_whose_end_wraps_past_2_63_is_refused(tmp_path: Path) -> None:
    """A version-1 payload table's spans were bounded by ``at + m <= length - 16`` in int64: a length of 2**63
    minus the offset wraps the sum negative, so the table was used and an intact record read as damaged
    ("does not point at the payload"), and ``verify`` blamed the shard. The table is refused: the record is
    parsed from the shard, and ``verify`` names the table."""
    pack = _pack(tmp_path, 24)
    clean = _all(TFRecordIndexedDataset(pack, decode="bytes"))
    info = read_manifest(pack).shards[0]
    table = payload_path(pack / info.file)
    _to_version_1(table, info.num_samples, info.sha256)
    raw = np.fromfile(table, dtype="<i8")
    raw[2 + 1] = (1 << 63) - int(raw[2])  # row 0 (after the two-int header): its length wraps at + m past 2**63
    raw.tofile(table)
    ds = TFRecordIndexedDataset(pack, decode="bytes")
    assert _parsed(ds)[0].payloads is None  # the table is not used
    assert _all(ds) == clean
    with pytest.raises(PackFormatError, match=re.escape(str(table))):
        verify_pack(pack, progress=False)


def test_an_offsets_index_whose_lengths_wrap_past_2_63_does_not_tile_the_shard(tmp_path: Path) -> None:
    """The ``.tfindex`` is checked to tile the shard by a cumulative sum of its lengths in int64: four lengths
    of 2**62 sum to 0 mod 2**64, so lines ``0 2**62``, ``2**62 2**62``, ``-2**63 2**62``, ``-2**62 2**62``
    ahead of lines tiling the shard "tiled" it too, and the dataset opened on it. Such an index is refused
    at open, naming it."""
    pack = _pack(tmp_path, 24)
    shard = pack / read_manifest(pack).shards[0].file
    payload_path(shard).unlink()  # the index is parsed and checked, as for a pack of another tool
    index = shard.with_name(shard.name.replace(".tfrecord", ".tfindex"))
    lines = [f"{(k << 62) - (1 << 64 if k >= 2 else 0)} {1 << 62}" for k in range(4)]
    first = int(index.read_text().split()[1])  # the real records: the first, then the other five as one line
    lines += [f"0 {first}", f"{first} {shard.stat().st_size - first}"]  # six lines: the manifest's count
    index.write_text("\n".join(lines) + "\n")
    with pytest.raises(PackFormatError, match=re.escape(str(index)) + ".*does not tile"):
        TFRecordIndexedDataset(pack, decode="bytes")


def _open_first_shard(pack: Path) -> tuple[str, int]:
    """What opening the first shard's records says (``read``, or the error), and the peak MB traced meanwhile."""
    import tracemalloc

    info = read_manifest(pack).shards[0]
    tracemalloc.start()
    try:
        shard_records(pack / info.file, info.num_samples, info.bytes, info.sha256, payloads=True)
        said = "read"
    except PackFormatError as exc:
        said = str(exc)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return said, peak >> 20


def test_a_sparse_gigabyte_table_or_index_is_not_read_into_memory(tmp_path: Path) -> None:
    """A ``.tfpayload`` of a size no table of its shard has was read whole before its size was looked at, and a
    ``.tfindex`` before its lines were counted: a sparse file of 1 GB (no disk used) made opening a 24-sample
    pack take 1.3 GB of memory (the table) and 2.3 GB (the index). Each is read only as far as its count allows."""
    pack = _pack(tmp_path, 24)
    clean = _all(TFRecordIndexedDataset(pack, decode="bytes"))
    shard, table = _shard0(pack)
    table.write_bytes(b"")
    os.truncate(table, 1 << 30)
    said, grown = _open_first_shard(pack)
    assert said == "read" and grown < 10  # the table ignored, the .tfindex parsed instead
    assert _all(TFRecordIndexedDataset(pack, decode="bytes")) == clean
    table.unlink()
    index = shard.with_name(shard.name.replace(".tfrecord", ".tfindex"))
    os.truncate(index, 1 << 30)
    said, grown = _open_first_shard(pack)
    assert "offsets index is longer than the lines of the 6 records" in said and grown < 10
    with pytest.raises(PackFormatError, match=re.escape(str(index)) + ": offsets index is longer than"):
        TFRecordIndexedDataset(pack, decode="bytes")


def test_verify_reads_no_more_of_a_sparse_gigabyte_index_than_its_shard_could_list(tmp_path: Path) -> None:
    """verify walked each shard after reading its whole .tfindex (and again for the .tfpayload check), so a
    sparse 1 GB index (no disk used) took 2.3 GB of memory; it is read only as far as the shard's records
    (16 bytes each at least) could fill it, and named."""
    import tracemalloc

    pack = _pack(tmp_path, 24)
    shard, _ = _shard0(pack)
    index = shard.with_name(shard.name.replace(".tfrecord", ".tfindex"))
    os.truncate(index, 1 << 30)
    tracemalloc.start()
    try:
        with pytest.raises(PackFormatError, match=re.escape(str(index)) + ": offsets index is longer than"):
            verify_pack(pack, progress=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


@pytest.mark.parametrize(
    "row", ["offset negative", "offset past the shard", "span past the record", "span length negative"]
)
def test_a_row_changed_in_place_after_open_is_named(tmp_path: Path, row: str) -> None:
    """The table is checked when a shard opens, then read through its map: a row rewritten in place since
    (an offset negative or past the shard: a bare OSError from ``pread``; a span past its record or of a
    negative length: a damage of the shard) is named as the table changed, and the other records still read
    right (record 1 ends where record 2 starts: its row is changed too when record 2's offset is)."""
    pack = _pack(tmp_path, 24)
    ds = TFRecordIndexedDataset(pack, decode="bytes")
    clean = _all(ds)  # every shard's table mapped and checked
    shard, table = _shard0(pack)
    field, value = {
        "offset negative": (0, -16),
        "offset past the shard": (0, shard.stat().st_size + 64),
        "span past the record": (1, 1 << 20),
        "span length negative": (2, -1),
    }[row]
    with open(table, "r+b") as f:  # in place: the dataset's map sees the new row
        f.seek(48 + 24 * 2 + 8 * field)  # two header rows, then record 2's row
        f.write(struct.pack("<q", value))
    with pytest.raises(PackFormatError, match=re.escape(str(table)) + ".*changed since"):
        ds[2]
    changed = {2} if field else {1, 2}
    if not field:
        with pytest.raises(PackFormatError, match=re.escape(str(table)) + ".*changed since"):
            ds[1]
    assert [ds[i] for i in range(len(ds)) if i not in changed] == [x for i, x in enumerate(clean) if i not in changed]


def test_multi_field_pack_maps_offsets_and_parses_records(tmp_path: Path) -> None:
    samples = [{"__key__": f"k{i:02d}", "txt": f"text {i}", "cls": i % 3} for i in range(12)]
    pack = tmp_path / "f.tfrecord"
    packdata.write_pack(samples, pack, shard_samples=5, progress=False)
    for info in read_manifest(pack).shards:
        shard = pack / info.file
        assert has_record_table(shard, info.num_samples, info.bytes, info.sha256)
        table = map_record_table(shard, info.num_samples, info.bytes, info.sha256, payloads=True)
        assert table is not None and table.payloads is None  # no one payload: the Example is parsed
    ds = TFRecordIndexedDataset(pack, decode="bytes")
    assert not _parsed(ds)
    assert [ds[i]["txt"] for i in range(12)] == [f"text {i}".encode() for i in range(12)]
    verify_pack(pack, progress=False)


def test_a_fifo_in_place_of_a_table_or_index_never_blocks(tmp_path: Path) -> None:
    """A FIFO is not read (it would block the open forever): a table FIFO is ignored, an index FIFO is named."""
    import os

    from packdata.formats import get_format
    from packdata.formats.tfrecord_tables import index_path

    pack = _pack(tmp_path, 24)
    clean = _all(TFRecordIndexedDataset(pack, decode="bytes"))
    shard, table = _shard0(pack)
    info = read_manifest(pack).shards[0]
    table.unlink()
    os.mkfifo(table)
    assert _all(TFRecordIndexedDataset(pack, decode="bytes")) == clean  # the .tfindex, checked, instead
    assert list(TFRecordDataset(pack, decode="bytes", shuffle=False)) == clean
    assert get_format("tfrecord").record_spans(shard, info.bytes) is not None  # hints from the .tfindex
    index_path(shard).unlink()
    os.mkfifo(index_path(shard))
    with pytest.raises(PackFormatError, match=re.escape(str(index_path(shard))) + ".*not a regular file"):
        TFRecordIndexedDataset(pack, decode="bytes")
    assert get_format("tfrecord").record_spans(shard, info.bytes) is None


def test_a_fifo_in_place_of_an_lmdb_records_table_is_ignored(tmp_path: Path) -> None:
    import os

    from packdata.formats import get_format

    pack = tmp_path / "p.lmdb"
    convert(_texts(tmp_path / "src", 24), pack, shard_samples=8, progress=False)
    clean = [packdata.LMDBDataset(pack, decode="bytes")[i] for i in range(24)]
    shard = pack / read_manifest(pack).shards[0].file
    (shard / "records.i64").unlink()
    os.mkfifo(shard / "records.i64")
    ds = packdata.LMDBDataset(pack, decode="bytes")
    assert [ds[i] for i in range(24)] == clean  # LMDB's own lookup instead
    assert ds.__getitems__(list(range(24))) == clean
    assert get_format("lmdb").record_spans(shard, read_manifest(pack).shards[0].bytes) is None
