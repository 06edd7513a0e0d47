"""LMDBDataset: exactly once through real DataLoaders, worker safety, errors, safety."""

from __future__ import annotations

import json
import os
import pickle
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_index_digests, flip_label, image_bytes
from faults.hostile import overwrite_lmdb_record
from torch.utils.data import DataLoader, DistributedSampler

from packdata import (
    ImageFormatError,
    LMDBDataset,
    PackFormatError,
    TFRecordIndexedDataset,
    convert,
    verify_pack,
    write_pack,
)
from packdata.pack.manifest import read_manifest


@pytest.fixture
def pack(image_folder: Path, tmp_path: Path) -> Path:
    convert(image_folder, tmp_path / "out.lmdb", shard_samples=8, progress=False)  # 3 shards
    return tmp_path / "out.lmdb"


class KeyedDataset(torch.utils.data.Dataset):
    """Wraps LMDBDataset to return each sample's key, proving which sample was read."""

    def __init__(self, ds: LMDBDataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> tuple[str, int, int]:
        data, label = self.ds[i]
        return self.ds.keys[i], label, zlib.crc32(data)


@pytest.mark.parametrize("context", ["fork", "spawn"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_sample_exactly_once_per_epoch(pack: Path, num_workers: int, context: str) -> None:
    ds = LMDBDataset(pack, decode="bytes")
    expected = sorted(ds.keys)
    loader = DataLoader(
        KeyedDataset(ds),
        batch_size=4,
        shuffle=True,
        num_workers=num_workers,
        multiprocessing_context=context if num_workers else None,
        persistent_workers=num_workers > 0,
    )
    for _ in range(2):
        seen = [k for keys, _, _ in loader for k in keys]
        assert sorted(seen) == expected


def test_read_in_parent_before_fork_and_two_datasets_in_one_process(pack: Path) -> None:
    train = LMDBDataset(pack, decode="bytes")
    val = LMDBDataset(pack, decode="bytes", transform=len)  # same pack, other transform
    assert train[0][0] and val[0][0] == len(train[0][0])
    loader = DataLoader(KeyedDataset(train), batch_size=5, num_workers=2, multiprocessing_context="fork")
    assert sorted(k for keys, _, _ in loader for k in keys) == sorted(train.keys)
    assert val[len(val) - 1][0] == len(train[len(train) - 1][0])  # parent handles still work


def test_labels_and_bytes_through_workers_match_the_main_process(pack: Path) -> None:
    ds = LMDBDataset(pack, decode="bytes")
    direct = {ds.keys[i]: (ds[i][1], zlib.crc32(ds[i][0])) for i in range(len(ds))}
    loader = DataLoader(KeyedDataset(ds), batch_size=3, num_workers=2, multiprocessing_context="spawn")
    via_workers = {
        k: (int(lab), int(crc))
        for keys, labels, crcs in loader
        for k, lab, crc in zip(keys, labels, crcs, strict=False)
    }
    assert via_workers == direct


@pytest.mark.parametrize("world_size", [2, 3])
def test_distributed_sampler_covers_the_pack(pack: Path, world_size: int) -> None:
    ds = LMDBDataset(pack, decode="bytes")
    seen = []
    for rank in range(world_size):
        sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=1, drop_last=False)
        loader = DataLoader(KeyedDataset(ds), batch_size=4, sampler=sampler, num_workers=1)
        seen += [k for keys, _, _ in loader for k in keys]
    assert set(seen) == set(ds.keys) and len(seen) == len(sampler) * world_size


def test_pickles_without_handles(pack: Path) -> None:
    ds = LMDBDataset(pack, decode="bytes")
    ds[0]
    _ = ds.targets
    blob = pickle.dumps(ds)
    assert len(blob) < 4096  # paths and options, not handles or arrays
    clone = pickle.loads(blob)
    assert clone[3] == ds[3] and list(clone.keys) == list(ds.keys)


def test_imagefolder_attributes(pack: Path) -> None:
    """torchvision's ImageFolder attribute names and types, served from the manifest and index."""
    ds = LMDBDataset(pack)
    assert ds.classes == ["cat", "dog", "zebra"] and ds.class_to_idx["dog"] == 1
    assert ds.targets.count(1) == 6 and ds.targets.tolist().count(1) == 6
    assert json.dumps(ds.targets[:3]) == "[0, 0, 0]"  # ints, not numpy scalars (json refused those)
    assert isinstance(ds.targets[0], int) and ds[-1][1] == ds.targets[-1]
    assert np.asarray(ds.targets).dtype == np.int32 and len(ds.targets) == len(ds)
    assert ds.samples[0] == (ds.keys[0], 0) and ds.imgs[-1] == (ds.keys[-1], ds.targets[-1])
    assert [label for _, label in ds.samples] == ds.targets.tolist()
    assert ds.root == str(pack) and ds.loader(ds.raw(0)[0]).mode == "RGB"
    assert ".jpg" in ds.extensions
    with pytest.raises(IndexError, match="out of range"):
        ds[len(ds)]


def test_errors_name_the_path_and_what_to_do(pack: Path, tmp_path: Path) -> None:
    with pytest.raises(PackFormatError, match=r"missing\.lmdb: no such pack"):
        LMDBDataset(tmp_path / "missing.lmdb")
    (tmp_path / "plain").mkdir()
    with pytest.raises(PackFormatError, match=r"plain: not a packdata pack.*packdata convert"):
        LMDBDataset(tmp_path / "plain")
    for stand_in, what in (
        ("fifo", r"not a regular file \(mode prw"),
        ("dir", "not a regular file"),
        ("link", "a broken link"),
    ):
        odd = tmp_path / stand_in
        odd.mkdir()
        {"fifo": os.mkfifo, "dir": os.mkdir, "link": lambda p: p.symlink_to("gone")}[stand_in](odd / "manifest.json")
        with pytest.raises(PackFormatError, match=rf"{stand_in}/manifest\.json: manifest\.json is {what}"):
            LMDBDataset(odd)  # named as what it is (a FIFO is never opened: reading it would block)
    manifest = json.loads((pack / "manifest.json").read_text())
    manifest["format_version"] = 99
    (pack / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PackFormatError, match=r"version 99 is newer.*Upgrade packdata"):
        LMDBDataset(pack)


def test_a_pack_of_the_other_format_names_the_datasets_that_read_it(
    pack: Path, image_folder: Path, tmp_path: Path
) -> None:
    """The hint said 'Open it with the tfrecord dataset instead': no class is called that."""
    from packdata import TFRecordDataset

    records = tmp_path / "records"
    convert(image_folder, records, format="tfrecord", progress=False)
    with pytest.raises(PackFormatError) as lmdb_on_tfrecord:
        LMDBDataset(records)
    assert str(lmdb_on_tfrecord.value) == (
        f"{records}: pack is in tfrecord format, not lmdb. Open it with packdata.TFRecordIndexedDataset or "
        "packdata.TFRecordDataset, or with packdata.open_dataset, which picks the dataset by the pack's format"
    )
    for reader in (TFRecordDataset, TFRecordIndexedDataset):
        with pytest.raises(PackFormatError) as tfrecord_on_lmdb:
            reader(pack)
        assert str(tfrecord_on_lmdb.value) == (
            f"{pack}: pack is in lmdb format, not tfrecord. Open it with packdata.LMDBDataset, "
            "or with packdata.open_dataset, which picks the dataset by the pack's format"
        )


@pytest.mark.parametrize("stand_in", ["fifo", "dir", "link", "gone"])
def test_a_shard_file_that_is_not_a_file_is_named_as_such_by_readers_and_verify(pack: Path, stand_in: str) -> None:
    """A FIFO, a folder or a broken link where data.mdb should be is named; a FIFO is never opened (it would block)."""
    from packdata import verify_pack

    data = next(pack.glob("shard-*.lmdb")) / "data.mdb"
    data.unlink()
    {"fifo": os.mkfifo, "dir": os.mkdir, "link": lambda p: p.symlink_to("gone.mdb"), "gone": str}[stand_in](data)
    what = {
        "fifo": r"is not a regular file \(mode prw",
        "dir": r"is not a regular file \(mode d",
        "link": "is a broken link",
        "gone": "is missing",
    }[stand_in]
    with pytest.raises(PackFormatError, match=rf"data\.mdb: shard file {what}"):
        verify_pack(pack)
    ds = LMDBDataset(pack, decode="bytes")
    with pytest.raises(PackFormatError, match=rf"data\.mdb: the shard's data\.mdb {what}"):
        ds[0]


def test_a_shard_open_elsewhere_in_the_process_does_not_stop_a_dataset(pack: Path) -> None:
    """py-lmdb refuses a second handle on a file in one process: a user's own lmdb.open of a shard
    (a notebook's look inside) made the dataset call the intact shard damaged, and later refuse it as
    open elsewhere. Neither a dataset nor verify opens LMDB now, with the shard's records.i64 table or without."""
    import lmdb

    shard = pack / "shard-00000.lmdb"
    own = lmdb.open(str(shard), readonly=True, lock=False)
    try:
        first = LMDBDataset(pack, decode="bytes")[0]  # through the table
        verify_pack(pack, progress=False)  # its rows checked against the records: by walking the pages too
        (shard / "records.i64").unlink()  # the same shard through its own pages
        assert LMDBDataset(pack, decode="bytes")[0] == first
        with own.begin() as txn:  # and the user's handle reads on beside it
            assert txn.stat()["entries"] > 0
    finally:
        own.close()


def test_damaged_record_raises_naming_shard_and_record(pack: Path) -> None:
    overwrite_lmdb_record(pack, b"XXXX" + b"\0" * 40)
    with pytest.raises(PackFormatError, match=r"shard-00000\.lmdb: record 0 is damaged.*packdata verify"):
        LMDBDataset(pack, decode="bytes")[0]


def test_a_payload_that_fails_its_table_crc_is_named_and_never_looked_up_by_lmdb(
    pack: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The table is bound to this file, so a mismatch is damage: LMDB's lookup (whose damaged pages
    could lead it past its map, a SIGBUS) is not tried."""
    from packdata.formats.lmdb_reader import LMDBShardReader
    from packdata.formats.lmdb_tables import record_locations

    shard = next(pack.glob("shard-*.lmdb"))
    _, rows = record_locations(shard)
    offset, length, _ = (int(v) for v in rows[2])
    with open(shard / "data.mdb", "r+b") as f:
        f.seek(offset + length // 2)
        byte = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([byte[0] ^ 0xFF]))

    def no_lookup(self, index):
        raise AssertionError("LMDB's lookup was used")

    monkeypatch.setattr(LMDBShardReader, "get", no_lookup)
    ds = LMDBDataset(pack, decode="bytes")
    message = rf"shard-00000\.lmdb/data\.mdb: record 2 is damaged: the payload at byte offset {offset}: its CRC32C"
    with pytest.raises(PackFormatError, match=message):
        ds[2]
    with pytest.raises(PackFormatError, match=message):
        ds.__getitems__([0, 1, 2, 3])
    assert ds[3][0] == ds.__getitems__([3])[0][0]  # the others read as before


def test_an_image_that_cannot_be_decoded_is_named_by_pack_and_key(image_folder: Path, tmp_path: Path) -> None:
    """A truncated image (PIL's OSError) or one of 2 bytes (PIL's struct.error): ImageFormatError naming the sample."""
    whole = image_bytes(4, size=(128, 96), fmt="PNG")
    (image_folder / "cat" / "half.png").write_bytes(whole[: len(whole) // 2])  # packed: not decoded at convert
    pack = tmp_path / "out.lmdb"
    convert(image_folder, pack, progress=False)
    ds = LMDBDataset(pack)
    i = ds.keys.index("cat/half.png")
    message = re.escape(f"{pack}: sample 'cat/half.png' (index {i}): image data is truncated or damaged")
    with pytest.raises(ImageFormatError, match=message + r".*verify_images=True"):
        ds[i]
    with pytest.raises(ImageFormatError, match=message):
        ds.__getitems__([0, i])
    fields = tmp_path / "fields.lmdb"
    write_pack(
        [{"__key__": "k0", "jpg": b"BM"}, {"__key__": "k1", "png": whole[: len(whole) // 2]}], fields, progress=False
    )
    for k, problem in enumerate(("not an image in a known format", "image data is truncated or damaged")):
        with pytest.raises(
            ImageFormatError,
            match=re.escape(f"{fields}: sample 'k{k}' (index {k}), field '{('jpg', 'png')[k]}': {problem}"),
        ):
            LMDBDataset(fields)[k]


def test_a_malicious_pack_cannot_run_code(pack: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    payload = pickle.dumps(Exploit())
    key = b"cat/a.jpg"
    header = struct.pack("<4sBiIH", b"PDR1", 0, 0, zlib.crc32(payload), len(key))
    overwrite_lmdb_record(pack, header + key + payload)
    data, label = LMDBDataset(pack, decode="bytes", verify=True)[0]
    assert data == payload and label == 0
    with pytest.raises(OSError):  # PIL refuses it as an image; nothing is unpickled
        LMDBDataset(pack)[0]
    loader = DataLoader(LMDBDataset(pack, decode="bytes"), batch_size=None, num_workers=1)
    assert next(iter(loader))[0] == payload
    assert not marker.exists()


_WORKER_MEMORY = """
import sys
import torch.utils.data
from torch.utils.data import DataLoader
from packdata import LMDBDataset


def private_dirty_bytes():
    # pages this process alone has written: where copy-on-access of parent objects shows up (a page shared
    # with the parent after fork is Shared_Dirty; touching a Python object on it, even to count a reference,
    # copies it into Private_Dirty)
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Private_Dirty line in smaps_rollup")


class Probe(torch.utils.data.Dataset):
    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        self.ds[i]
        _ = self.ds.keys[i], self.ds.targets[i]
        return private_dirty_bytes() if i % 1000 == 999 else 0


ds = LMDBDataset(sys.argv[1], decode="bytes")
_ = ds.targets, ds.keys[0]  # index mapped in the parent before the fork
loader = DataLoader(Probe(ds), batch_size=None, num_workers=1, multiprocessing_context="fork")
print(" ".join(str(int(u)) for u in loader if u))
"""


def test_forked_worker_memory_stays_flat_over_an_epoch(tmp_path: Path) -> None:
    """Measured in a fresh process: in the test suite's own process, a forked worker of the long-lived parent
    once grew 1.0-1.2 MiB over this epoch whatever the dataset did (2 whole-suite runs; 20-140 KiB alone)."""
    src = tmp_path / "src"
    for c in range(3):
        (src / f"class{c}").mkdir(parents=True)
        for i in range(10_000):
            (src / f"class{c}/{i:05d}.txt").write_text(f"sample {c} {i}")
    convert(src, tmp_path / "t.lmdb", progress=False)
    run = subprocess.run(
        [sys.executable, "-c", _WORKER_MEMORY, str(tmp_path / "t.lmdb")], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    dirty = [int(u) for u in run.stdout.split()]
    assert len(dirty) == 30
    # A Python list of 30,000 keys touched by the worker would copy about 2.5 MiB of pages; the
    # allocator's own noise under load has reached 480 KiB, so the bound sits between the two.
    grew = dirty[-1] - dirty[0]
    assert grew < 1 << 20, f"worker private memory grew by {grew >> 10} KiB over the epoch"


def test_batched_reads_equal_single_reads(pack: Path) -> None:
    ds = LMDBDataset(pack, decode="bytes")
    order = [5, 0, -1, 17, 3, 3, len(ds) - 2, 8]  # 3 shards, runs of 1-3 records: read record by record
    assert ds.__getitems__(order) == [ds[i] for i in order]
    order = [*range(len(ds) - 1, -1, -1), 0, 0]  # runs of 8: a batch call per shard
    assert ds.__getitems__(order) == [ds[i] for i in order]
    assert ds.__getitems__([]) == []
    with pytest.raises(IndexError):
        ds.__getitems__([0, len(ds)])
    decoded = LMDBDataset(pack, transform=lambda im: im.size)
    assert decoded.__getitems__([2, 1]) == [decoded[2], decoded[1]]
    expected = [ds[i] for i in range(len(ds))]
    (pack / "shard-00001.lmdb" / "records.i64").unlink()  # that shard's records come through LMDB's lookup
    order = [9, 0, 16, 10, 1, 18, 8]  # runs of one record, shards with and without a table
    assert LMDBDataset(pack, decode="bytes").__getitems__(order) == [expected[i] for i in order]


@pytest.mark.parametrize("indices", [[1.5], [0, 2.0], np.array([1.0, 2.0])])
def test_a_batch_of_non_integer_indices_is_refused_as_a_single_read_refuses_it(pack: Path, indices: object) -> None:
    """ds[1.5] raised a TypeError deep in the read ('memoryview: invalid slice key') while ds.__getitems__([1.5])
    returned sample 1: numpy cut the float to an int. Both now refuse it alike; ints of numpy and torch and bools
    index as they do in a list."""
    ds = LMDBDataset(pack, decode="bytes")
    with pytest.raises(TypeError, match="cannot be interpreted as an integer"):
        ds[indices[-1]]
    with pytest.raises(TypeError, match="cannot be interpreted as an integer"):
        ds.__getitems__(indices)
    order = [np.int64(3), torch.tensor(-1), True, np.uint64(2)]
    assert ds.__getitems__(order) == [ds[i] for i in order] == [ds[3], ds[len(ds) - 1], ds[1], ds[2]]
    assert ds.__getitems__(np.array([4, 1], dtype=np.uint32)) == [ds[4], ds[1]]


def test_batched_reads_of_a_one_shard_pack_equal_single_reads(image_folder: Path, tmp_path: Path) -> None:
    convert(image_folder, tmp_path / "one.lmdb", progress=False)
    ds = LMDBDataset(tmp_path / "one.lmdb", decode="bytes")
    assert len(read_manifest(tmp_path / "one.lmdb").shards) == 1
    order = [5, 0, -1, 17, 3, 3, len(ds) - 2, 8]
    assert ds.__getitems__(order) == [ds[i] for i in order]
    with pytest.raises(IndexError, match=f"index {-len(ds) - 1} is out of range"):
        ds.__getitems__([0, -len(ds) - 1])


@pytest.mark.parametrize("shard_samples", [8, 1000])
def test_a_damaged_record_in_a_batch_is_named_as_a_single_read_would(
    image_folder: Path, tmp_path: Path, shard_samples: int
) -> None:
    pack = tmp_path / "out.lmdb"
    convert(image_folder, pack, shard_samples=shard_samples, progress=False)
    overwrite_lmdb_record(pack, b"XXXX" + b"\0" * 40)
    for batch in ([3, 0, 1], [*range(8), 9]):  # record by record, and a run per shard
        with pytest.raises(PackFormatError, match=r"shard-00000\.lmdb: record 0 is damaged.*packdata verify"):
            LMDBDataset(pack, decode="bytes").__getitems__(batch)


@pytest.mark.parametrize("workers", [0, 2])
def test_batched_reads_are_exactly_once_under_a_distributed_sampler(pack: Path, workers: int) -> None:
    ds = LMDBDataset(pack, decode="bytes")
    seen: list[bytes] = []
    for rank in range(2):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3, drop_last=True)
        loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=workers, collate_fn=list)
        seen += [data for batch in loader for data, _ in batch]
    everything = [ds[i][0] for i in range(len(ds))]
    assert len(set(everything)) == len(ds)  # distinct payloads: a duplicate or a loss shows
    assert len(seen) == 2 * (len(ds) // 2) and len(set(seen)) == len(seen) and set(seen) <= set(everything)


def test_map_slices_when_warm_and_pread_when_cold(pack: Path) -> None:
    """The reader asks the kernel: a resident shard is read through a map, others with pread; same bytes."""
    from packdata.formats.residency import PagedFile

    data = next(pack.glob("shard-*.lmdb")) / "data.mdb"
    fd = os.open(data, os.O_RDONLY)
    try:
        pages = PagedFile(fd, data.stat().st_size, recheck=0)
        data.read_bytes()  # warm
        assert pages.resident_share() > 0.95
        assert pages.read(100, 50) == data.read_bytes()[100:150] and pages.warm
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # evict (clean pages): the next check sees it cold
        if pages.resident_share() < 0.95:
            assert pages.read(100, 50) == data.read_bytes()[100:150] and not pages.warm
        pages.close()
    finally:
        os.close(fd)


def test_a_shard_that_warms_up_is_mapped_after_a_quarter_of_it_is_read(pack: Path) -> None:
    """The residency check also comes by bytes read: a shard of a few large records switches to the map.

    (By read count alone, 4,096 reads between checks, such a shard kept ``pread`` for epochs.)
    """
    from packdata.formats.residency import PagedFile

    data = next(pack.glob("shard-*.lmdb")) / "data.mdb"
    size = data.stat().st_size
    fd = os.open(data, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        pages = PagedFile(fd, size)
        if pages.resident_share() >= 0.95:
            pytest.skip("the kernel kept the pages (cannot make the file cold here)")
        chunk = size // 16 + 1  # four reads pass a quarter of the file, three do not
        assert pages.read(0, chunk) == data.read_bytes()[:chunk] and not pages.warm  # checked cold, then warmed
        for k in range(1, 4):  # three reads: by count, 4,093 reads short of the next check
            assert pages.read(k * chunk, chunk) == data.read_bytes()[k * chunk : (k + 1) * chunk]
        assert not pages.warm
        assert pages.read(4 * chunk, chunk) == data.read_bytes()[4 * chunk : 5 * chunk]  # past a quarter: checked
        assert pages.warm
        pages.close()
    finally:
        os.close(fd)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps (Linux)")
def test_shards_are_unmapped_once_no_dataset_reads_them(pack: Path) -> None:
    """Readers share one LMDB environment per shard file; the last to go closes it, so no map outlives them.

    (Kept open for the process's life, a replaced pack's old files stayed mapped and their disk space taken.)
    """
    import gc

    files = [str(shard / "data.mdb") for shard in sorted(pack.glob("shard-*.lmdb"))]

    def mapped() -> list[str]:
        maps = Path("/proc/self/maps").read_text()
        return [f for f in files if f in maps]

    first, second = LMDBDataset(pack), LMDBDataset(pack, decode="bytes")
    everything = [first[i] for i in range(len(first))]
    assert len(everything) == len(first) and mapped() == files
    del first, everything
    gc.collect()
    assert [second[i][1] for i in range(len(second))] == second.targets.tolist()  # the other still reads
    assert mapped() == files
    del second
    gc.collect()
    assert mapped() == []
    again = LMDBDataset(pack, decode="bytes")  # and a new dataset opens them afresh
    assert again[len(again) - 1][0] and mapped() == files[-1:]


def _mapped_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of ``path`` (from /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0]:
            inside = line.endswith(" " + str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc/self/smaps (Linux)")
def test_a_file_that_turns_warm_is_mapped_in_one_call(tmp_path: Path) -> None:
    """Slices then need no page fault each: the whole resident file is in this process's page table at once."""
    import mmap

    from packdata.formats.residency import PagedFile

    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(4 << 20))
    probe = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        probe.madvise(22)  # MADV_POPULATE_READ
    except OSError:
        pytest.skip("the kernel has no MADV_POPULATE_READ (before 5.14)")
    finally:
        probe.close()
    fd = os.open(data, os.O_RDONLY)
    try:
        pages = PagedFile(fd, 4 << 20, recheck=0)
        data.read_bytes()  # resident
        assert _mapped_kib(data) == 0
        assert pages.read(100, 10) == data.read_bytes()[100:110] and pages.warm
        assert _mapped_kib(data) >= 4096 * 0.95  # not just the page read and its neighbours
        pages.close()
    finally:
        os.close(fd)


def test_threads_opening_one_pack_at_once_all_read_it(pack: Path) -> None:
    """Datasets in several threads open their first readers together (LMDB opens a file once per process)."""
    import threading

    errors: list[BaseException] = []
    for _ in range(10):
        barrier = threading.Barrier(8)
        datasets = [LMDBDataset(pack, decode="bytes") for _ in range(8)]

        def read_all(ds: LMDBDataset, barrier: threading.Barrier) -> None:
            barrier.wait()
            try:
                assert [ds[i][1] for i in range(len(ds))] == ds.targets.tolist()
            except BaseException as exc:  # reported by the assertion below, from the main thread
                errors.append(exc)

        threads = [threading.Thread(target=read_all, args=(ds, barrier)) for ds in datasets]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        del datasets
    assert errors == []


def test_the_location_tables_crc32cs_are_the_reference_ones_and_batches_read_through_them(pack: Path) -> None:
    """Each shard's table holds the payload's CRC-32C as the ``crc32c`` package computes it (the RFC 3720 value).

    A wrong value would not fail a read: the reader would fall back to LMDB's lookup for every
    record, silently slower. So the batch read must also come whole from the table.
    """
    import crc32c

    from packdata.formats.lmdb_reader import LMDBShardReader
    from packdata.formats.lmdb_tables import record_locations

    ds = LMDBDataset(pack, decode="bytes")
    for info in read_manifest(pack).shards:
        reader = LMDBShardReader(pack / info.file, expected_sha256=info.sha256)
        try:
            indices = np.arange(info.num_samples)
            payloads = reader.payloads(indices)
            assert None not in payloads  # all through the table, length and CRC checked
            expected = [ds[info.first_index + i][0] for i in range(info.num_samples)]
            assert payloads == expected
            assert record_locations(pack / info.file)[1][:, 2].tolist() == [crc32c.crc32c(p) for p in payloads]
        finally:
            reader.close()


@pytest.mark.parametrize("table", ["kept", "removed"])
def test_a_shard_whose_record_count_is_not_the_manifests_is_refused_on_open(pack: Path, table: str) -> None:
    """One sample moved between two shards' counts (total and checksum kept) shifted every read after it.

    ds[7] returned sample 8's bytes under sample 7's key and label: only the
    shard's size and checksum were compared with the manifest.
    """
    from faults.hostile import rewrite_manifest

    def move_one(d: dict) -> None:
        d["shards"][0]["num_samples"] -= 1
        d["shards"][1]["first_index"] -= 1
        d["shards"][1]["num_samples"] += 1

    rewrite_manifest(pack, move_one)
    if table == "removed":
        for t in pack.glob("shard-*/records.i64"):
            t.unlink()
    ds = LMDBDataset(pack, decode="bytes")
    first = r"shard-00000\.lmdb/data\.mdb: shard holds 8 records, the manifest .*says 7.*packdata verify"
    second = r"shard-00001\.lmdb/data\.mdb: shard holds 8 records, the manifest .*says 9"
    with pytest.raises(PackFormatError, match=first):
        ds[0]
    with pytest.raises(PackFormatError, match=second):
        ds[7]
    with pytest.raises(PackFormatError, match=second):
        ds.__getitems__([8, 9])
    loader = DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="spawn")
    with pytest.raises(PackFormatError, match=first):  # every process checks on its own first open
        next(iter(loader))


@pytest.mark.parametrize("table", ["removed", "kept-but-a-payload-damaged"])
def test_a_node_pointer_past_the_end_of_data_mdb_is_an_error_not_a_sigbus(tmp_path: Path, table: str) -> None:
    """One damaged byte of a leaf page's node pointer sent LMDB's lookup past the end of data.mdb.

    In a map larger than the file (py-lmdb's default 10 MiB) the read killed
    the process with SIGBUS (returncode -7); the pages LMDB can reach are now
    checked before it walks them (``formats.lmdb_pages``). Read in a
    subprocess, so a crash fails this test instead of killing pytest.
    """
    import subprocess
    import sys

    from conftest import image_bytes

    src = tmp_path / "src" / "cat"
    src.mkdir(parents=True)
    for i in range(4):
        (src / f"{i}.png").write_bytes(image_bytes(i, size=(8, 8), fmt="PNG"))
    pack = tmp_path / "out.lmdb"
    convert(tmp_path / "src", pack, shard_samples=4, progress=False)
    data = pack / "shard-00000.lmdb" / "data.mdb"
    raw = bytearray(data.read_bytes())
    page = 4096
    leaf = next(p for p in range(2, len(raw) // page) if struct.unpack_from("<H", raw, p * page + 10)[0] & 0x02)
    pointer = leaf * page + 16 + 2 * 2  # record 2's node pointer (an offset inside its page)
    struct.pack_into("<H", raw, pointer, 0xB8A8)  # 47 KB into a page of a 12 KB file
    assert leaf * page + 0xB8A8 > len(raw)
    table_file = pack / "shard-00000.lmdb" / "records.i64"
    if table == "removed":
        table_file.unlink()
    else:  # the table read fails its CRC32C: the reader falls back to LMDB's lookup
        offset, length = np.fromfile(table_file, dtype="<i8").reshape(-1, 3)[2 + 2, :2]
        raw[int(offset) + int(length) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    code = "import sys, packdata; ds = packdata.LMDBDataset(sys.argv[1], decode='bytes'); [ds[i] for i in range(4)]"
    done = subprocess.run([sys.executable, "-c", code, str(pack)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, (done.returncode, done.stderr[-500:])
    assert re.search(r"PackFormatError: .*shard-00000\.lmdb.*packdata verify", done.stderr), done.stderr[-500:]


def test_verify_reads_no_more_of_a_records_table_than_a_table_of_its_shard_holds(pack: Path) -> None:
    """verify read a shard's whole records.i64 before comparing its size with a table of the shard's records:
    a sparse file of 1 GB (no disk used) took 1 GB of memory to be called 'fits no table'."""
    import tracemalloc

    table = pack / "shard-00000.lmdb" / "records.i64"
    os.truncate(table, 1 << 30)
    tracemalloc.start()
    try:
        with pytest.raises(PackFormatError, match=re.escape(str(table)) + r": records\.i64 is 1073741824 bytes, which"):
            verify_pack(pack, progress=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


def test_checking_labels_at_open_and_in_verify_takes_flat_memory(pack: Path) -> None:
    """An index claiming 2**23 samples (sparse files: a few KB on disk) is checked in chunks.

    The whole-array check allocated about 3 bytes per claimed sample at once
    (24 MiB here, 384 MiB for 2**27); the one label out of range, in the last
    chunk, is still found and counted. The manifest is read before tracing
    (reading one reserves a buffer of its own).
    """
    import tracemalloc

    from faults.hostile import rewrite_manifest

    from packdata import verify_pack
    from packdata.formats.verify import open_index
    from packdata.reading.pack_info import PackInfo

    n = 1 << 23
    index = pack / "index"
    for name, size in (("labels.i32", 4 * n), ("sizes.i64", 8 * n), ("key_offsets.i64", 8 * (n + 1)), ("keys.utf8", 0)):
        with open(index / name, "wb") as f:
            f.truncate(size)
    with open(index / "labels.i32", "r+b") as f:
        f.seek(4 * (n - 1))
        f.write(struct.pack("<i", 99))

    def claim(d: dict) -> None:
        d["shards"][-1]["num_samples"] += n - d["num_samples"]
        d["source"]["files_found"] += n - d["num_samples"]
        d["num_samples"] = n
        d["index"].pop("sha256")  # as packdata before the index digests wrote it: the range check alone

    rewrite_manifest(pack, claim)
    expected = rf"labels\.i32: sample {n - 1} has label 99, outside \[-1, 3\)"
    with pytest.raises(PackFormatError, match=rf"{expected} for 3 classes \(1 samples out of range\)"):
        LMDBDataset(pack)
    with pytest.raises(PackFormatError, match=expected):
        verify_pack(pack, progress=False)
    info, manifest = PackInfo(pack), read_manifest(pack)
    assert len(info.index.labels) == n  # mapped before tracing
    for check in (info.check_labels, lambda: open_index(manifest, pack, pack)):
        tracemalloc.start()
        try:
            with pytest.raises(PackFormatError, match=expected):
                check()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 << 20, peak


@pytest.mark.parametrize("damage", ["a key's letter", "a key boundary"])
def test_a_changed_key_is_named_at_the_first_key_read(pack: Path, damage: str) -> None:
    """A bit of ``keys.utf8`` flipped (still UTF-8), or a boundary in ``key_offsets.i64`` moved (still in order).

    Either reads as other keys (a sample's ``__key__``, ``ls``); the first key read in a process
    hashes both files and names the damaged one. A pack without index digests reads them as they are.
    """
    from faults.hostile import rewrite_manifest

    from packdata.formats.contents import list_samples

    keys_before = LMDBDataset(pack).keys[:]
    index = pack / json.loads((pack / "manifest.json").read_text(encoding="utf-8"))["index"]["dir"]
    if damage == "a key's letter":
        damaged = index / "keys.utf8"
        blob = bytearray(damaged.read_bytes())
        blob[0] ^= 1  # an ASCII letter stays ASCII
    else:
        damaged = index / "key_offsets.i64"
        offsets = np.fromfile(damaged, dtype="<i8")
        offsets[1] += 1  # key 0 takes key 1's first byte
        blob = bytearray(offsets.tobytes())
    damaged.write_bytes(bytes(blob))
    named = rf"{re.escape(str(damaged))}: sample index file {re.escape(damaged.name)} does not match its SHA-256"
    ds = LMDBDataset(pack)  # opening maps the keys, reads none
    with pytest.raises(PackFormatError, match=named):
        ds.keys[5]
    with pytest.raises(PackFormatError, match=named):
        ds.samples[0]
    with pytest.raises(PackFormatError, match=named):
        list(list_samples(pack))
    rewrite_manifest(pack, lambda d: d["index"].pop("sha256"))  # as packdata before the digests wrote it
    changed = LMDBDataset(pack).keys[:]
    assert changed[0] != keys_before[0] and changed[2:] == keys_before[2:]


def test_a_flipped_label_in_range_is_named_at_open_and_by_verify(pack: Path) -> None:
    """One bit of ``labels.i32`` flipped, the label still a class: a read would train on the wrong label.

    The fast read path takes the label from the index, not the record: the
    dataset refuses to open, naming the file and ``packdata verify``; verify
    names the file before it reads a record. A pack written before the
    manifest recorded index digests (none in its manifest) still opens.
    """
    from faults.hostile import rewrite_manifest

    from packdata import verify_pack

    assert_index_digests(pack)
    before = LMDBDataset(pack).targets.tolist()
    labels = flip_label(pack)
    damaged = rf"{re.escape(str(labels))}: sample index file labels\.i32 does not match its SHA-256 in the manifest"
    with pytest.raises(PackFormatError, match=rf"{damaged}\. .*Run `packdata verify`"):
        LMDBDataset(pack)
    with pytest.raises(PackFormatError, match=damaged):
        verify_pack(pack, progress=False)
    rewrite_manifest(pack, lambda d: d["index"].pop("sha256"))  # as packdata before the digests wrote it
    ds = LMDBDataset(pack)
    assert sum(a != b for a, b in zip(ds.targets.tolist(), before, strict=True)) == 1


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_a_transform_set_after_opening_applies_to_reads_as_stored(text_folder: Path, tmp_path: Path, fmt: str) -> None:
    """torchvision's habit, ``ds.transform = t`` after construction, holds on the as-stored fast path too."""
    convert(text_folder, tmp_path / "p", format=fmt, progress=False)
    opened = LMDBDataset if fmt == "lmdb" else TFRecordIndexedDataset
    ds = opened(tmp_path / "p", decode="bytes")
    stored = [ds[i] for i in range(len(ds))]
    ds.transform = len
    ds.target_transform = str
    expected = [(len(data), str(label)) for data, label in stored]
    assert [ds[i] for i in range(len(ds))] == expected
    assert ds.__getitems__(list(range(len(ds)))) == expected
