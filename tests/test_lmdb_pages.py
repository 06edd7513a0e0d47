"""LMDB's lookups and cursors never walk a damaged or crafted page out of data.mdb: one error, no crash."""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import image_bytes
from faults.hostile import rewrite_manifest
from PIL import Image
from torch.utils.data import DataLoader

from packdata import LMDBDataset, PackFormatError, convert, verify_pack
from packdata.formats import lmdb_reader
from packdata.formats.lmdb_pages import check_lmdb_tree, read_lmdb_meta, value_locations
from packdata.formats.lmdb_reader import LMDBShardReader
from packdata.pack.records import Sample, decode_record, encode_record, read_headers

_BRANCH, _LEAF, _BIGDATA = 0x01, 0x02, 0x01


def _noise_jpeg(seed: int) -> bytes:
    """A JPEG of noise, about 10 KB: stored on overflow pages, not inside a leaf."""
    pixels = np.random.default_rng(seed).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


@pytest.fixture
def pack(tmp_path: Path) -> Path:
    return _table_less_pack(tmp_path)


def _table_less_pack(tmp_path: Path) -> Path:
    """One shard two levels deep (a branch root over several leaves), small values inline and large ones on
    overflow pages, its records.i64 deleted so readers fall back to LMDB's lookup."""
    src = tmp_path / "src"
    for c, cls in enumerate(("cat", "dog")):
        (src / cls).mkdir(parents=True)
        for i in range(12):
            (src / cls / f"{i:02d}.jpg").write_bytes(image_bytes(10 * c + i))
        for i in range(3):
            (src / cls / f"big{i}.jpg").write_bytes(_noise_jpeg(10 * c + i))
    out = tmp_path / "out.lmdb"
    convert(src, out, progress=False)
    (out / "shard-00000.lmdb" / "records.i64").unlink()
    return out


class _Page:
    """One page LMDB reaches from the main DB's root: its number, flags and nodes (file offsets)."""

    def __init__(self, raw: bytes | bytearray, number: int, psize: int) -> None:
        self.number = number
        base = number * psize
        self.flags, lower = struct.unpack_from("<HH", raw, base + 10)
        self.pointers = [base + 16 + 2 * i for i in range((lower - 16) // 2)]  # where each node's offset is
        self.nodes = [base + struct.unpack_from("<H", raw, at)[0] for at in self.pointers]


def _layout(raw: bytes | bytearray) -> tuple[int, int, list[_Page]]:
    """``(page size, the meta page LMDB uses, every tree page in depth-first order)``, as mdb_stat -a would walk."""
    psize = struct.unpack_from("<I", raw, 40)[0]
    txnids = [struct.unpack_from("<Q", raw, n * psize + 144)[0] for n in (0, 1)]
    meta = int(txnids[0] < txnids[1])
    pages, todo = [], [struct.unpack_from("<Q", raw, meta * psize + 128)[0]]
    while todo:
        page = _Page(raw, todo.pop(), psize)
        pages.append(page)
        if page.flags == _BRANCH:
            todo.extend(_child(raw, node) for node in reversed(page.nodes))
    return psize, meta, pages


def _child(raw: bytes | bytearray, node: int) -> int:
    lo, hi, flags = struct.unpack_from("<HHH", raw, node)
    return lo | hi << 16 | flags << 32


def _big_node(pages: list[_Page], raw: bytes | bytearray) -> tuple[_Page, int]:
    """The first leaf node whose value lies on overflow pages: its page and index."""
    for page in pages:
        for i, node in enumerate(page.nodes):
            if page.flags == _LEAF and struct.unpack_from("<H", raw, node + 4)[0] & _BIGDATA:
                return page, i
    raise AssertionError("no overflow value in the pack")


def _set_pgno(raw: bytearray, node: int, pgno: int) -> None:
    struct.pack_into("<HHH", raw, node, pgno & 0xFFFF, pgno >> 16 & 0xFFFF, pgno >> 32)


def _branch_child_past_the_end(raw: bytearray) -> str:
    _, _, pages = _layout(raw)
    root = pages[0]
    assert root.flags == _BRANCH, "the pack should be two levels deep"
    past = len(raw) // 4096 + 100  # 4 KB pages on x86
    _set_pgno(raw, root.nodes[1], past)
    return rf"page {root.number} \(the root\): node 1 points at page {past}, outside 2-"


def _overflow_page_past_the_end(raw: bytearray) -> str:
    _, _, pages = _layout(raw)
    page, i = _big_node(pages, raw)
    past = len(raw) // 4096 + 7
    struct.pack_into("<Q", raw, page.nodes[i] + 8 + 8, past)  # after the node header and the 8-byte key
    return rf"page {page.number} \(a child of page \d+\): node {i}'s value is on page {past}, outside 2-"


def _overflow_run_huge(raw: bytearray) -> str:
    psize, _, pages = _layout(raw)
    page, i = _big_node(pages, raw)
    first = struct.unpack_from("<Q", raw, page.nodes[i] + 16)[0]
    struct.pack_into("<I", raw, first * psize + 12, 0xFFFFFFF0)
    return rf"overflow page {first} \(a value of leaf page {page.number}\): a run of 4294967280 pages runs past"


def _overflow_value_huge(raw: bytearray) -> str:
    _, _, pages = _layout(raw)
    page, i = _big_node(pages, raw)
    struct.pack_into("<HH", raw, page.nodes[i], 0xFFFF, 0x7FFF)  # a 2 GiB value where ~10 KB are stored
    return (
        rf"overflow page \d+ \(a value of leaf page {page.number}\): a run of \d+ pages is too short for its 2147483647"
    )


def _node_offset_out_of_its_page(raw: bytearray) -> str:
    psize, _, pages = _layout(raw)
    last = max((p for p in pages if p.flags == _LEAF), key=lambda p: p.number)  # the leaf nearest the file's end
    struct.pack_into("<H", raw, last.pointers[1], 0xFFF0)  # 64 KB on: past the end of the file
    assert last.number * psize + 0xFFF0 > len(raw)
    return rf"page {last.number} \(a child of page \d+\): node 1's offset 65520 is outside its area \d+-4096"


def _inline_value_off_its_page(raw: bytearray) -> str:
    _, _, pages = _layout(raw)
    last = max((p for p in pages if p.flags == _LEAF), key=lambda p: p.number)
    i = next(i for i, node in enumerate(last.nodes) if not struct.unpack_from("<H", raw, node + 4)[0] & _BIGDATA)
    struct.pack_into("<H", raw, last.nodes[i] + 2, 0x10)  # its size + 1 MiB
    return rf"page {last.number} \(a child of page \d+\): node {i} runs to byte \d+, past its 4096-byte page"


def _meta_root_past_the_end(raw: bytearray) -> str:
    psize, meta, _ = _layout(raw)
    past = len(raw) // psize + 5
    struct.pack_into("<Q", raw, meta * psize + 128, past)
    return rf"meta page {meta}: the main DB's root page {past} is outside pages 2-"


def _meta_page_size_zero(raw: bytearray) -> str:
    struct.pack_into("<I", raw, 40, 0)  # LMDB refuses it too, as 'not an LMDB file'
    return r"meta page 0: page size 0, not a power of two in \[512, 32768\]"


def _meta_last_page_past_the_end(raw: bytearray) -> str:
    psize, meta, _ = _layout(raw)
    struct.pack_into("<Q", raw, meta * psize + 136, 1 << 40)  # LMDB maps that much: 'Cannot allocate memory'
    return rf"is truncated: \d+ bytes, but LMDB's meta page {meta} says \d+ are in use"


DAMAGE: dict[str, Callable[[bytearray], str]] = {
    "branch child past the end": _branch_child_past_the_end,
    "overflow page past the end": _overflow_page_past_the_end,
    "overflow run huge": _overflow_run_huge,
    "overflow value huge": _overflow_value_huge,
    "node offset out of its page": _node_offset_out_of_its_page,
    "inline value off its page": _inline_value_off_its_page,
    "meta root past the end": _meta_root_past_the_end,
    "meta page size zero": _meta_page_size_zero,
    "meta last page past the end": _meta_last_page_past_the_end,
}


def _damage(pack: Path, how: Callable[[bytearray], str]) -> str:
    """Damage data.mdb and reseal the manifest (size, checksum) as a stranger's pack would be; the error expected."""
    data = pack / "shard-00000.lmdb" / "data.mdb"
    raw = bytearray(data.read_bytes())
    expected = how(raw)
    data.write_bytes(bytes(raw))

    def reseal(manifest: dict) -> None:
        manifest["shards"][0]["sha256"] = hashlib.sha256(raw).hexdigest()

    rewrite_manifest(pack, reseal)
    return expected


_READ_THREE_WAYS = """
import sys
from torch.utils.data import DataLoader
import packdata
from packdata import LMDBDataset, PackFormatError
pack = sys.argv[1]
ds = LMDBDataset(pack, decode="bytes")
ways = {
    "item": lambda: [ds[i] for i in range(len(ds))],
    "loader": lambda: list(DataLoader(LMDBDataset(pack, decode="bytes"), batch_size=4, num_workers=2)),
    "verify": lambda: packdata.verify_pack(pack, progress=False),
}
for name, way in ways.items():
    try:
        way()
        print(name, "read without an error", flush=True)
    except PackFormatError as exc:
        print(name, str(exc).replace("\\n", " "), flush=True)
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_page_is_one_error_naming_data_mdb_never_a_crash(pack: Path, how: str) -> None:
    """Each damage, met by every item, every batch of a DataLoader (2 workers) and verify, in a subprocess.

    Before the check LMDB followed them: a value size past the file killed the
    process (SIGSEGV), a node offset 64 KB past its page was read from other
    memory of the process ("record 26 is missing"), a huge overflow run read
    without an error, and the rest were LMDB errors naming neither data.mdb nor the page.
    """
    expected = _damage(pack, DAMAGE[how])
    done = subprocess.run(
        [sys.executable, "-c", _READ_THREE_WAYS, str(pack)], capture_output=True, text=True, timeout=150
    )
    assert done.returncode == 0, (
        signal.Signals(-done.returncode).name if done.returncode < 0 else done.returncode,
        done.stdout,
        done.stderr[-2000:],
    )
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["item", "loader", "verify"], done.stdout
    data = re.escape(str(pack / "shard-00000.lmdb" / "data.mdb"))
    for line in lines:
        assert re.search(rf"{data}: {expected}.*packdata verify", line), (expected, line)


def test_a_table_less_pack_reads_every_sample_as_its_table_does(pack: Path, tmp_path: Path) -> None:
    """The shard's own pages, walked for its values, give every sample's bytes and label as the table's preads."""
    with_table = tmp_path / "with-table.lmdb"
    convert(tmp_path / "src", with_table, progress=False)
    assert not (pack / "shard-00000.lmdb" / "records.i64").exists()

    def every_sample(path: Path) -> dict[str, tuple[bytes, int]]:
        ds = LMDBDataset(path, decode="bytes")
        loader = DataLoader(ds, batch_size=None, num_workers=2)
        return {ds.keys[i]: (bytes(data), int(label)) for i, (data, label) in enumerate(loader)}

    expected = every_sample(with_table)
    assert len(expected) == 30
    assert every_sample(pack) == expected
    assert verify_pack(pack, progress=False).records == 30


def _index_of(pack: Path) -> Callable[[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """What the sample index says of records a to b of the pack's one shard: labels, key bytes, key lengths."""
    ds = LMDBDataset(pack, decode="bytes")
    labels = np.asarray(ds.targets, dtype=np.int32)
    keys = [k.encode() for k in ds.keys]

    def expected(a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        blob = np.frombuffer(b"".join(keys[a:b]), dtype=np.uint8).copy()
        return labels[a:b].copy(), blob, np.array([len(k) for k in keys[a:b]], dtype=np.int64)

    return expected


def test_a_table_less_shard_takes_payload_rows_from_headers_only_when_they_match_the_index(
    pack: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without records.i64, each read used to copy the whole record and check it alone (a third of a table's rate).

    The reader now takes (offset, length, CRC-32) rows from its records' own
    headers, read in chunks (5 records here), once every key and label is the
    sample index's; then payloads are read as through a table. One label, one
    key byte or one header that differs: it takes none, and each read stays a
    whole record checked on its own.
    """
    monkeypatch.setattr(lmdb_reader, "_HEADERS_AT_ONCE", 5)
    shard = pack / "shard-00000.lmdb"
    expected = _index_of(pack)
    whole = LMDBShardReader(shard)
    payloads = [decode_record(whole.get(i)).data for i in range(whole.entries)]
    assert whole.unbound and whole.payload(0) is None

    def lie(what: str) -> Callable[[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]]:
        def told(a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            labels, keys, lengths = expected(a, b)
            if a <= 17 < b:
                if what == "label":
                    labels[17 - a] += 1
                else:
                    keys[int(lengths[: 17 - a].sum())] ^= 1
            return labels, keys, lengths

        return told

    for what in ("label", "key"):
        reader = LMDBShardReader(shard)
        assert not reader.rows_from_headers(lie(what)), what
        assert reader.payload(3) is None and reader.payloads(np.arange(3)) == [None] * 3, what
    reader = LMDBShardReader(shard)
    assert reader.rows_from_headers(expected) and not reader.unbound
    assert [reader.payload(i) for i in range(reader.entries)] == payloads
    order = np.random.default_rng(0).permutation(reader.entries)
    assert reader.payloads(order) == [payloads[i] for i in order]

    first = value_locations(shard / "data.mdb").locations[0, 0]  # record 0's magic, b"PDR1"
    data = bytearray((shard / "data.mdb").read_bytes())
    data[first] ^= 0x20
    (shard / "data.mdb").write_bytes(bytes(data))
    reader = LMDBShardReader(shard)
    assert not reader.rows_from_headers(expected)
    with pytest.raises(PackFormatError, match=r"shard-00000\.lmdb: record 0 is damaged: record starts with b'pDR1'"):
        LMDBDataset(pack, decode="bytes")[0]


def test_read_headers_reads_what_decode_record_reads_and_refuses_any_unsound_header() -> None:
    """Headers read at once give each record's label, CRC-32, key and payload span as decode_record does, one
    by one; a record shorter than its header, a key past its record's end, a wrong magic or kind: None."""
    rng = np.random.default_rng(1)
    samples = [
        Sample(f"k{'é' * int(rng.integers(0, 40))}{i}", int(rng.integers(-1, 9)), rng.bytes(int(rng.integers(0, 99))))
        for i in range(50)
    ]
    records = [encode_record(s) for s in samples]
    offsets = np.cumsum([7] + [len(r) + 3 for r in records[:-1]]).astype(np.int64)  # gaps between records
    buffer = np.zeros(int(offsets[-1]) + len(records[-1]) + 5, dtype=np.uint8)
    for at, record in zip(offsets, records, strict=True):
        buffer[at : at + len(record)] = np.frombuffer(record, dtype=np.uint8)
    lengths = np.array([len(r) for r in records], dtype=np.int64)
    found = read_headers(buffer, offsets, lengths)
    assert found is not None
    assert found.labels.tolist() == [s.label for s in samples]
    assert found.keys.tobytes() == b"".join(s.key.encode() for s in samples)
    assert found.key_lengths.tolist() == [len(s.key.encode()) for s in samples]
    spans = zip(found.payload_offsets.tolist(), found.payload_lengths.tolist(), strict=True)
    assert [buffer[a : a + n].tobytes() for a, n in spans] == [s.data for s in samples]
    assert found.crcs.tolist() == [zlib.crc32(s.data) for s in samples]
    for at, value in ((0, ord("p")), (4, 3), (13, 255)):  # magic, kind, the key's length (past the record)
        bad = buffer.copy()
        bad[offsets[20] + at] = value
        assert read_headers(bad, offsets, lengths) is None, at
    short = lengths.copy()
    short[7] = 14
    assert read_headers(buffer, offsets, short) is None
    assert read_headers(buffer, offsets[:0], lengths[:0]) is not None


def test_a_table_less_shard_names_a_payload_damaged_after_its_headers_matched(pack: Path) -> None:
    """A payload byte flipped (its header sound): the read through the headers' rows fails its CRC-32, by offset."""
    shard = pack / "shard-00000.lmdb"
    locations = value_locations(shard / "data.mdb").locations
    offset, length = (int(v) for v in locations[5])
    data = bytearray((shard / "data.mdb").read_bytes())
    data[offset + length - 1] ^= 0x01
    (shard / "data.mdb").write_bytes(bytes(data))
    ds = LMDBDataset(pack, decode="bytes")
    damaged = r"shard-00000\.lmdb/data\.mdb: record 5 is damaged: the payload at byte offset \d+: its CRC-32 does not"
    with pytest.raises(PackFormatError, match=damaged):
        ds[5]
    with pytest.raises(PackFormatError, match=damaged):
        ds.__getitems__([4, 5, 6])
    assert len(ds[4][0]) and len(ds.__getitems__([6, 4])) == 2


def test_a_shard_that_shrinks_after_its_meta_page_was_read_is_named(pack: Path) -> None:
    """Truncated between the meta read and the map, the page map raised mmap's bare ValueError."""
    from packdata.formats.lmdb_pages import _map_pages

    data = pack / "shard-00000.lmdb" / "data.mdb"
    meta = read_lmdb_meta(data)
    os.truncate(data, data.stat().st_size // 2)
    with pytest.raises(PackFormatError, match=r"data\.mdb: .*shrank below the \d+ bytes in use while read"):
        _map_pages(str(data), meta)


def test_value_locations_find_the_values_lmdbs_cursor_returns(tmp_path: Path) -> None:
    """An environment written by plain py-lmdb (values inline and in overflow runs of every length, a tree
    of several levels): the walk finds each key's value where LMDB's cursor hands it back, byte for byte."""
    import lmdb

    rng = np.random.default_rng(0)
    values = [rng.bytes(int(n)) for n in rng.integers(0, 12_000, 3000)]  # LMDB's pages: the OS page size
    env = lmdb.open(str(tmp_path), map_size=1 << 28, subdir=True)
    with env.begin(write=True) as txn:
        for i in rng.permutation(len(values)).tolist():  # out of order: pages split as they fill
            txn.put(struct.pack(">Q", i), values[i])
    with env.begin() as txn:
        expected = [bytes(value) for _, value in txn.cursor()]
        depth = env.stat()["depth"]
    env.close()
    found = value_locations(tmp_path / "data.mdb")
    raw = (tmp_path / "data.mdb").read_bytes()
    assert depth >= 2 and len(found.locations) == len(values)
    assert [raw[o : o + n] for o, n in found.locations.tolist()] == expected == values


def test_value_locations_refuse_keys_that_are_not_the_record_numbers(tmp_path: Path) -> None:
    """A shard whose keys skip a number (0, 1, 3: a stranger's, or a damaged one) would shift every record
    after the gap onto the wrong index: the walk names the first missing record instead."""
    import lmdb

    env = lmdb.open(str(tmp_path), map_size=1 << 24, subdir=True)
    with env.begin(write=True) as txn:
        for i in (0, 1, 3):
            txn.put(struct.pack(">Q", i), b"value %d" % i)
    env.close()
    with pytest.raises(PackFormatError, match=r"data\.mdb: record 2 is missing \(the key in its place is 3\)"):
        value_locations(tmp_path / "data.mdb")


def _mdb_stat(shard: Path) -> dict[str, int]:
    """Branch, leaf and overflow page counts of the main DB, as ``mdb_stat`` prints them."""
    out = subprocess.run(["mdb_stat", str(shard)], capture_output=True, text=True, check=True).stdout
    return {m[1]: int(m[2]) for m in re.finditer(r"(Branch|Leaf|Overflow) pages: (\d+)", out)}


def _counted(raw: bytes) -> dict[str, int]:
    """The same counts from walking the tree with :func:`_layout`."""
    psize, _, pages = _layout(raw)
    runs = [
        struct.unpack_from("<I", raw, struct.unpack_from("<Q", raw, node + 16)[0] * psize + 12)[0]
        for page in pages
        if page.flags == _LEAF
        for node in page.nodes
        if struct.unpack_from("<H", raw, node + 4)[0] & _BIGDATA
    ]
    kinds = [page.flags for page in pages]
    return {"Branch": kinds.count(_BRANCH), "Leaf": kinds.count(_LEAF), "Overflow": sum(runs)}


@pytest.mark.skipif(not shutil.which("mdb_stat"), reason="needs mdb_stat (lmdb-utils)")
def test_the_check_accepts_every_shard_the_writer_makes(image_folder: Path, text_folder: Path, tmp_path: Path) -> None:
    """Images and text, several shards each, inline and overflow values, and shards appended to a pack.

    The test's own walk of each shard counts the pages mdb_stat counts, so the damage above lands where it says.
    """
    images, texts = tmp_path / "images.lmdb", tmp_path / "texts.lmdb"
    convert(image_folder, images, shard_samples=8, progress=False)
    convert(text_folder, texts, kind="text", shard_samples=7, progress=False)
    _table_less_pack(tmp_path / "big")
    convert(tmp_path / "big" / "src", images, append=True, shard_samples=16, progress=False)
    shards = sorted(images.glob("shard-*.lmdb")) + sorted(texts.glob("shard-*.lmdb"))
    assert len(shards) == 3 + 2 + 3
    for shard in shards:
        raw = (shard / "data.mdb").read_bytes()
        meta = check_lmdb_tree(shard / "data.mdb")
        assert meta == read_lmdb_meta(shard / "data.mdb")
        assert meta.page_size == 4096 and meta.last_page < meta.file_pages
        assert _counted(raw) == _mdb_stat(shard), shard
    assert verify_pack(images, progress=False).records == 19 + 30
    assert verify_pack(texts, progress=False).records == 20


def test_key_offsets_that_lie_give_no_rows_from_headers() -> None:
    """encoded_range (what a table-less shard's headers are matched against) refuses offsets that fall, run
    past the keys' file or start below 0: None, so the reader keeps its whole-record checked reads."""
    from packdata.pack.index import KeyList

    blob = np.frombuffer(b"abcdef", dtype=np.uint8)
    sound = KeyList(blob, np.array([0, 2, 4, 6])).encoded_range(0, 3)
    assert sound is not None and sound[0].tobytes() == b"abcdef" and sound[1].tolist() == [2, 2, 2]
    for offsets in ([0, 4, 2, 6], [0, 2, 4, 99], [-1, 2, 4, 6]):
        assert KeyList(blob, np.array(offsets)).encoded_range(0, 3) is None, offsets
