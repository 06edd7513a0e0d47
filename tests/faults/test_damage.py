"""Every damage against every reader and ``packdata verify``: a clear error naming the file, or the right bytes."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import IMAGE_EXTS, expected_samples, image_bytes
from torch.utils.data import DataLoader

from faults.damage import DAMAGES, shard_files, swap_foreign_shard
from faults.hostile import rewrite_manifest
from packdata import ConfigError, LMDBDataset, PackFormatError, convert
from packdata.cli import main
from packdata.formats import lmdb_reader
from packdata.reading.streaming import TFRecordDataset
from packdata.reading.tfrecord_indexed import TFRecordIndexedDataset

READERS = {
    "lmdb": [lambda p: LMDBDataset(p, decode="bytes")],
    "tfrecord": [
        lambda p: TFRecordDataset(p, decode="bytes", shuffle=False),
        lambda p: TFRecordIndexedDataset(p, decode="bytes"),
    ],
}


def _pack(folder: Path, tmp_path: Path, fmt: str, name: str = "out") -> Path:
    dst = tmp_path / f"{name}.{fmt}"
    convert(folder, dst, shard_samples=5, progress=False)
    return dst


def _read_all(ds) -> dict[str, tuple[bytes, int]]:
    """key -> (bytes, label) of every sample, through the reader's own iteration."""
    keys = ds.keys
    if isinstance(ds, TFRecordDataset):
        return dict(zip(keys, ds, strict=True))  # shuffle=False: pack order
    return {keys[i]: ds[i] for i in range(len(ds))}


def _assert_error_or_exact(make, pack: Path, damaged: Path, expected: dict) -> str:
    """Read every sample: either a PackFormatError naming ``damaged`` (or its shard), or exactly the source bytes."""
    try:
        got = _read_all(make(pack))
    except PackFormatError as exc:
        names = {str(damaged), str(damaged.parent)}
        assert any(n in str(exc) for n in names) or "index" in str(damaged), str(exc)
        assert "\n" not in str(exc)
        return "error"
    assert got == expected  # fallback: never wrong or empty bytes
    return "exact"


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damage_is_named_or_read_right(image_folder: Path, tmp_path: Path, fmt: str, damage: str) -> None:
    pack = _pack(image_folder, tmp_path, fmt)
    expected = expected_samples(image_folder, IMAGE_EXTS)
    damaged = DAMAGES[damage](pack)
    outcomes = [_assert_error_or_exact(make, pack, damaged, expected) for make in READERS[fmt]]
    if damage in ("truncate", "flip_payload", "labels_out_of_range", "label_flipped"):
        assert outcomes == ["error"] * len(outcomes)  # the data itself is wrong: no fallback can help
    if damage in ("labels_out_of_range", "label_flipped"):
        with pytest.raises(PackFormatError, match=re.escape(str(damaged)) + r": sample index file labels\.i32"):
            READERS[fmt][0](pack)
    if damage == "labels_out_of_range":  # a pack written before the index digests: the range check names it
        rewrite_manifest(pack, lambda d: d["index"].pop("sha256"))
        with pytest.raises(PackFormatError, match=re.escape(str(damaged)) + r": sample 2 has label 3"):
            READERS[fmt][0](pack)
    result = CliRunner().invoke(main, ["verify", "-q", str(pack)])
    assert result.exit_code == 1, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("Error: ") and (str(damaged) in line or str(damaged.parent) in line), result.output


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_foreign_shard_swapped_in(image_folder: Path, tmp_path: Path, fmt: str) -> None:
    pack = _pack(image_folder, tmp_path, fmt)
    other_src = tmp_path / "other"
    (other_src / "x").mkdir(parents=True)
    for i, data in enumerate(sorted(expected_samples(image_folder, IMAGE_EXTS).values())):
        (other_src / "x" / f"{i:02d}.jpg").write_bytes(data[0])
    foreign = _pack(other_src, tmp_path, fmt, "foreign")
    damaged = swap_foreign_shard(pack, foreign)
    for make in READERS[fmt]:
        named = str(damaged.parent) if fmt == "lmdb" else str(damaged.with_suffix(""))  # the shard or its index
        with pytest.raises(PackFormatError, match=re.escape(named)):
            _read_all(make(pack))


@pytest.mark.parametrize("context", ["fork", "spawn"])
@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_truncated_shard_through_workers(image_folder: Path, tmp_path: Path, fmt: str, context: str) -> None:
    pack = _pack(image_folder, tmp_path, fmt)
    damaged = DAMAGES["truncate"](pack)
    for make in READERS[fmt]:
        loader = DataLoader(make(pack), batch_size=None, num_workers=2, multiprocessing_context=context)
        with pytest.raises(PackFormatError, match=re.escape(str(damaged))):
            list(loader)


def test_a_damaged_field_name_read_through_the_table_is_named_not_a_missing_field(tmp_path: Path) -> None:
    """A field read alone through ``records.i64`` is checked against its own CRC-32; the directory naming it is not.

    One flipped bit in record 1's directory ("txt" -> "tyt") made ``raw_fields(1, ["txt"])`` return ``{}``
    and ``ds[1]`` with ``fields=("__key__", "txt")`` raise a bare ``KeyError`` ("has no field 'txt'"), as for a
    sample without a caption, where the whole record read says it is damaged. A field a sample really lacks
    still reads as missing (its ``missing`` value).
    """
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"k{i}.jpg").write_bytes(image_bytes(i))
        (src / f"k{i}.txt").write_text(f"caption {i}")
    (src / "k4.jpg").write_bytes(image_bytes(4))  # no caption
    pack = tmp_path / "out.lmdb"
    convert(src, pack, progress=False)
    data = shard_files(pack)["data"]
    offset = int(np.fromfile(shard_files(pack)["table"], dtype="<i8").reshape(-1, 3)[3, 0])  # record 1's payload
    blob = bytearray(data.read_bytes())
    at = offset + bytes(blob[offset : offset + 64]).index(b"\x03txt") + 2
    blob[at] ^= 0x01
    data.write_bytes(bytes(blob))
    ds = LMDBDataset(pack, decode="bytes")
    damaged = re.escape(f"{data}: record 1 is damaged")
    with pytest.raises(PackFormatError, match=damaged):
        ds.raw_fields(1, ["txt"])
    with pytest.raises(PackFormatError, match=damaged):
        LMDBDataset(pack, fields=("__key__", "txt"), missing={"txt": None})[1]
    assert ds.raw_fields(2, ["txt"]) == {"txt": b"caption 2"}
    assert ds.raw_fields(4, ["txt"]) == {}  # k4 has no caption
    assert LMDBDataset(pack, fields=("__key__", "txt"), missing={"txt": None})[4] == ("k4", None)
    with pytest.raises(ConfigError, match="fields asks for 'txt', which 1 of the pack's 5 samples lack"):
        LMDBDataset(pack, fields=("__key__", "txt"))


@pytest.mark.parametrize("change", ["cut", "offset_negative", "length_past_end"])
def test_a_table_changed_in_place_after_the_open_is_named_never_read_as_an_empty_sample(
    image_folder: Path, tmp_path: Path, change: str
) -> None:
    """``records.i64`` is checked when a reader opens it, then read through its map on every read.

    Cut in place to its header (a table under a page: the rows read as zeros) it gave every sample of the
    shard as ``b""`` with its label, ``ds[i]`` and batches alike (offset 0, length 0, CRC32C 0 "match"); a
    row rewritten in place to a negative offset or a length past the file was called damage of ``data.mdb``
    (warm) or, read by ``pread`` (cold), a bare ``OSError`` or ``MemoryError``. Each now raises a
    PackFormatError naming the table; the other shards read as before.
    """
    pack = _pack(image_folder, tmp_path, "lmdb")
    expected = expected_samples(image_folder, IMAGE_EXTS)
    ds = LMDBDataset(pack, decode="bytes")
    assert ds[0] == expected[ds.keys[0]] and ds.__getitems__([1]) == [expected[ds.keys[1]]]  # the reader is open
    table = shard_files(pack)["table"]
    raw = np.fromfile(table, dtype="<i8").reshape(-1, 3)
    if change == "cut":
        os.truncate(table, 48)
    else:
        raw[3] = (-100, raw[3, 1], raw[3, 2]) if change == "offset_negative" else (raw[3, 0], 1 << 40, raw[3, 2])
        with open(table, "r+b") as f:  # in place: the reader's map sees it
            f.write(raw.tobytes())
    message = re.escape(f"{table}: record ") + r"{}'s row says its payload is .*the table changed since the shard"
    with pytest.raises(PackFormatError, match=message.format(1)):
        ds[1]
    with pytest.raises(PackFormatError, match=message.format(0 if change == "cut" else 1)):  # the first changed
        ds.__getitems__([0, 1, 2])
    assert ds[5] == expected[ds.keys[5]]  # shard 1


def test_a_table_row_whose_end_wraps_past_2_63_is_refused_not_read_cold(tmp_path: Path) -> None:
    """``records.i64`` rows were bounded by ``offsets + lengths <= size`` in int64: a length of 2**63 minus
    the offset wraps the sum negative, so the table was used, and the read of that record, cold (``pread``),
    raised a bare ``MemoryError`` (warm, a PackFormatError calling data.mdb damaged). The table is now refused
    at open: LMDB's lookup reads the record right, and ``verify`` names the table.
    """
    from PIL import Image

    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(16):  # ~4 MB of noise: the last record lies beyond the kernel's read-ahead of the meta pages
        Image.fromarray(rng.integers(0, 255, (300, 300, 3), dtype=np.uint8)).save(src / f"{i:02d}.png")
    pack = _pack(tmp_path / "src", tmp_path, "lmdb", name="big")
    table, data = shard_files(pack)["table"], shard_files(pack)["data"]
    raw = np.fromfile(table, dtype="<i8").reshape(-1, 3)
    last = len(raw) - 3
    raw[2 + last, 1] = (1 << 63) - int(raw[2 + last, 0])
    raw.tofile(table)
    fd = os.open(data, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold: the reader reads by pread
    finally:
        os.close(fd)
    ds = LMDBDataset(pack, decode="bytes")
    assert ds[last] == ((src / f"{last:02d}.png").read_bytes(), 0)
    result = CliRunner().invoke(main, ["verify", "-q", str(pack)])
    assert result.exit_code == 1 and f"{table}: records.i64 does not fit this shard" in result.output, result.output


def test_a_table_row_inside_lmdbs_meta_pages_is_not_used(image_folder: Path, tmp_path: Path) -> None:
    """No payload lies in LMDB's two meta pages: a table whose row points there does not fit the shard, so the
    record is read through LMDB's lookup (key and label checked), not as the meta page's bytes called damage of
    an intact data.mdb; ``verify`` names the table."""
    pack = _pack(image_folder, tmp_path, "lmdb")
    expected = expected_samples(image_folder, IMAGE_EXTS)
    table = shard_files(pack)["table"]
    raw = np.fromfile(table, dtype="<i8").reshape(-1, 3)
    raw[2, 0] = 0  # record 0's payload "at byte 0", its length and CRC32C as written
    raw.tofile(table)
    ds = LMDBDataset(pack, decode="bytes")
    assert [ds[i] for i in range(len(ds))] == [expected[key] for key in ds.keys]
    result = CliRunner().invoke(main, ["verify", "-q", str(pack)])
    assert result.exit_code == 1, result.output
    assert f"{table}: records.i64 row 0 does not point at record 0" in result.output, result.output


@pytest.mark.timeout(30)
@pytest.mark.parametrize("swap", ["fifo", "shorter"])
def test_a_data_file_swapped_while_the_shard_opens_is_named(
    image_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swap: str
) -> None:
    """data.mdb is looked at by path (its meta pages, its size), then opened for the table's reads: a FIFO swapped
    in between blocked that open forever, and a shorter file was read against the old one's table (its records
    called damaged). The swap is made by the real meta-page reader's caller, at that instant."""
    pack = _pack(image_folder, tmp_path, "lmdb")
    data = shard_files(pack)["data"]
    read_meta = lmdb_reader.read_lmdb_meta

    def read_then_swap(path):
        meta = read_meta(path)
        if Path(path) == data and not data.with_name("swapped").exists():
            data.with_name("swapped").write_bytes(data.read_bytes())  # the original, kept aside once
            data.unlink()
            if swap == "fifo":
                os.mkfifo(data)
            else:
                data.write_bytes(data.with_name("swapped").read_bytes()[:8192])
        return meta

    monkeypatch.setattr(lmdb_reader, "read_lmdb_meta", read_then_swap)
    ds = LMDBDataset(pack, decode="bytes")
    found = "cannot be opened: not a regular file: a FIFO" if swap == "fifo" else "changed while the shard was opened"
    with pytest.raises(PackFormatError, match=re.escape(f"{data}: ") + ".*" + found):
        ds[0]
