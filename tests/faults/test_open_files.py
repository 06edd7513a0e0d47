"""A pack of more shards than the open-file limit allows readers to hold: the soft limit is raised, or one line says so.

And a reader that may map no more (``vm.max_map_count``, or address space) says that, not that the shard is damaged.

Each shard a dataset has read keeps two or three files open in that process;
with a soft limit of 1,024 (many systems' default) a few hundred shards were
enough to stop every worker with "cannot be read: Too many open files. The
shard is damaged ... convert or stage the pack again", about an intact pack.
"""

from __future__ import annotations

import resource
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import packdata
from packdata.pack.manifest import read_manifest

SHARDS = 40  # 80-120 files held once all are read: past a soft limit of 64
SOFT = 64


def _note_packs(root: Path, notes: int, repeat: int, **shards: int) -> dict[str, Path]:
    """``notes`` texts (note ``i`` ``repeat`` times) in an LMDB and a TFRecord pack, cut into shards by ``shards``."""
    src = root / "src" / "notes"
    src.mkdir(parents=True)
    for i in range(notes):
        (src / f"{i:03d}.txt").write_text(f"note {i} " * repeat)
    packs = {}
    for fmt in ("lmdb", "tfrecord"):
        packs[fmt] = root / f"p.{fmt}"
        packdata.convert(src.parent, packs[fmt], format=fmt, progress=False, **shards)
    return packs


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same 120 texts in an LMDB and a TFRecord pack of about 40 shards each."""
    packs = _note_packs(tmp_path_factory.mktemp("open-files"), 120, 100, shard_size=2800)
    assert all(len(read_manifest(pack).shards) >= SHARDS for pack in packs.values())
    return packs


_READ_ALL = textwrap.dedent(
    """
    import random, resource, sys
    import packdata
    from torch.utils.data import DataLoader

    fmt, path, workers, hold = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    cls = packdata.LMDBDataset if fmt == "lmdb" else packdata.TFRecordIndexedDataset
    ds = cls(path, decode="bytes")
    held = [open(sys.executable, "rb") for _ in range(hold)]  # the training script's own files
    try:
        if workers:
            loader = DataLoader(ds, batch_size=7, num_workers=workers, collate_fn=list, multiprocessing_context="spawn")
            texts = [text for batch in loader for text, _ in batch]
        else:
            order = random.Random(0).sample(range(len(ds)), len(ds))  # shards closed are opened again
            texts = [ds[i][0] for i in order] + [batch[0] for batch in ds.__getitems__(order)]
    except packdata.PackdataError as exc:
        print(type(exc).__name__, exc)
        sys.exit(3)
    expected = sorted(f"note {i} ".encode() * 100 for i in range(120))
    assert sorted(texts) == (expected if workers else sorted(expected * 2)), "samples differ"
    print("read", len(texts), "soft limit", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    """
)


def _run_limited(
    script: str, args: list[str], soft: int, hard: int, timeout: int = 300
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` with ``args`` in a fresh Python whose open-file limit is ``soft`` (hard limit ``hard``)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return subprocess.run(
        [sys.executable, "-c", script, *args], preexec_fn=limit, capture_output=True, text=True, timeout=timeout
    )


def _read_all(fmt: str, pack: Path, workers: int, hard: int, hold: int = 0) -> subprocess.CompletedProcess[str]:
    """Read every sample under a soft limit of :data:`SOFT` open files, holding ``hold`` more files open meanwhile."""
    return _run_limited(_READ_ALL, [fmt, str(pack), str(workers), str(hold)], SOFT, hard)


def _hard_limit() -> int:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_reader_out_of_descriptors_raises_the_soft_limit_and_reads_on(many_shards, fmt: str, workers: int) -> None:
    hard = _hard_limit()
    if hard < 4 * SHARDS + 64:
        pytest.skip(f"the hard limit on open files here ({hard}) leaves no room to raise the soft one")
    done = _read_all(fmt, many_shards[fmt], workers, hard)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"read {120 if workers else 240}" in done.stdout
    if not workers:  # the workers raised their own limits; this process read nothing
        assert f"soft limit {hard}" in done.stdout


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_a_reader_at_the_hard_limit_keeps_few_shards_open_and_reads_on(many_shards, fmt: str) -> None:
    """At a hard limit of 64 files, 40 shards were past it; readers now close the first opened to open more."""
    done = _read_all(fmt, many_shards[fmt], 0, SOFT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "read 240" in done.stdout and f"soft limit {SOFT}" in done.stdout


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_a_reader_out_of_descriptors_at_the_hard_limit_says_so_in_one_line(many_shards, fmt: str) -> None:
    """Where the process's own files leave readers too little room, one line says so (never 'damaged')."""
    done = _read_all(fmt, many_shards[fmt], 0, SOFT, hold=SOFT - 16)
    assert done.returncode == 3, done.stdout + done.stderr
    line = done.stdout.strip()
    assert line.startswith("CapacityError ") and "\n" not in line
    assert (
        "too many open files opening shard" in line and f"may open {SOFT} files (ulimit -n; hard limit {SOFT})" in line
    )
    assert "Raise the hard limit" in line and "larger shard_size (`packdata convert --shard-size`)" in line
    assert "damaged" not in line and "again" not in line


_READ_UNDER_AN_ADDRESS_LIMIT = textwrap.dedent(
    """
    import resource, sys
    import packdata

    ds = packdata.LMDBDataset(sys.argv[1], decode="bytes")
    ds[0]  # the first shard mapped; then no room for another shard's map
    size = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 20), resource.RLIM_INFINITY))
    try:
        for i in range(len(ds)):
            ds[i]  # each sample dropped at once: only the maps need room
    except packdata.PackdataError as exc:
        print(type(exc).__name__, exc)
        sys.exit(3)
    print("read all")
    """
)


def test_a_reader_that_may_map_no_more_says_so_not_damage(tmp_path: Path) -> None:
    """ENOMEM from LMDB's map of a shard read as 'LMDB cannot read the shard ... The shard is damaged'.

    Shards read through their records.i64 tables need no map (LMDB is never opened; reads fall back to
    ``pread``): they are read. Without the tables, LMDB's lookups map each shard: one line says it cannot.
    """
    import random

    src = tmp_path / "src" / "notes"
    src.mkdir(parents=True)
    rng = random.Random(0)
    for i in range(300):
        (src / f"{i:03d}.txt").write_text("".join(rng.choices("0123456789abcdef", k=20_000)))
    pack = tmp_path / "p.lmdb"
    packdata.convert(src.parent, pack, shard_size=3 << 20, progress=False)
    shards = read_manifest(pack).shards
    assert len(shards) >= 2  # shards of 2-3 MB: a map needs more than the 1 MB left

    def read_all() -> subprocess.CompletedProcess[str]:
        args = [sys.executable, "-c", _READ_UNDER_AN_ADDRESS_LIMIT, str(pack)]
        return subprocess.run(args, capture_output=True, text=True, timeout=120)

    done = read_all()
    assert done.returncode == 0 and done.stdout.strip() == "read all", done.stdout + done.stderr
    for shard in shards:
        (pack / shard.file / "records.i64").unlink()  # LMDB's lookups: a map of each shard
    done = read_all()
    line = done.stdout.strip()
    assert done.returncode == 3, done.stdout + done.stderr
    assert line.startswith("CapacityError ") and "\n" not in line, line
    assert "cannot map the file: out of memory maps (" in line and "vm.max_map_count" in line
    assert "damaged" not in line


_READ_IN_THREADS = textwrap.dedent(
    """
    import random, sys
    from concurrent.futures import ThreadPoolExecutor
    import packdata

    fmt, path, check_crc = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    cls = packdata.LMDBDataset if fmt == "lmdb" else packdata.TFRecordIndexedDataset
    ds = cls(path, decode="bytes", check_crc=check_crc)

    def read(i):
        try:
            return "ok" if ds[i][0] == f"note {i} ".encode() * 100 else f"sample {i}: other bytes"
        except Exception as exc:
            return f"sample {i}: {type(exc).__name__} {exc}"

    order = random.Random(0).sample(range(len(ds)), len(ds)) * 10  # every shard closed and opened again, often
    with ThreadPoolExecutor(4) as pool:  # as write_pack's threads fetch dataset[i]
        wrong = [got for got in pool.map(read, order) if got != "ok"]
    print("\\n".join(wrong[:5]) or f"read {len(order)}")
    """
)


@pytest.mark.parametrize("check_crc", [True, False])
@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_threads_sharing_a_dataset_past_its_budget_of_readers_read_every_sample_as_written(
    many_shards, fmt: str, check_crc: bool
) -> None:
    """A reader one thread let go of (to open another shard) was closed under another thread's read of it.

    Its file descriptor, reused by the next shard opened, gave that shard's
    bytes (returned as the sample's with check_crc=False, 'record ... is
    damaged' with it), and LMDB's aborted transaction 'The shard is damaged'.
    """

    args = [fmt, str(many_shards[fmt]), "1" if check_crc else "0"]
    done = _run_limited(_READ_IN_THREADS, args, 2 * SOFT, 2 * SOFT)  # 16 readers of 40 shards, room for 4 more
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "read 1200", done.stdout


_READ_TWO_PACKS = textwrap.dedent(
    """
    import random, shutil, sys
    import packdata

    path, copy = sys.argv[1], sys.argv[2]
    shutil.copytree(path, copy)  # another pack: its own files
    train, val = packdata.LMDBDataset(path, decode="bytes"), packdata.LMDBDataset(copy, decode="bytes")
    order = random.Random(0).sample(range(len(train)), len(train))
    try:
        same = all(train[i][0] == val[i][0] == f"note {i} ".encode() * 100 for i in order)
    except packdata.PackdataError as exc:
        print(type(exc).__name__, exc)
        sys.exit(3)
    print("read", len(order), "same" if same else "differ")
    """
)


def test_two_datasets_in_one_process_share_its_budget_of_readers(many_shards, tmp_path: Path) -> None:
    """Each dataset kept half of what the limits allow, so two (train and validation) in one process took all of it.

    At a hard limit of 64 files, reading two 40-shard packs in turn raised 'too many open files opening shard'.
    """

    done = _run_limited(_READ_TWO_PACKS, [str(many_shards["lmdb"]), str(tmp_path / "copy.lmdb")], SOFT, SOFT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "read 120 same", done.stdout


_READ_DAMAGED_OUT_OF_FILES = textwrap.dedent(
    """
    import os, sys
    import packdata

    ds = packdata.LMDBDataset(sys.argv[1], decode="bytes")
    held = []
    try:
        while True:  # the soft limit reached: the first open of the shard runs out of files
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    try:
        ds[0]
    except packdata.PackdataError as exc:
        print(type(exc).__name__, exc)
        sys.exit(3)
    print("read")
    """
)


def test_a_damaged_shard_opened_again_past_the_soft_limit_is_called_damaged(tmp_path: Path) -> None:
    """The open retried once the soft limit was raised ran inside the handler of the first one's 'Too many open
    files', so the damage it found carried that error as its context and was reported as out of files."""
    hard = _hard_limit()
    if hard < 4 * SOFT:
        pytest.skip(f"the hard limit on open files here ({hard}) leaves no room to raise the soft one")
    src = tmp_path / "src" / "notes"
    src.mkdir(parents=True)
    for i in range(4):
        (src / f"{i}.txt").write_text(f"note {i}")
    pack = tmp_path / "p.lmdb"
    packdata.convert(src.parent, pack, progress=False)  # one shard: no limit raised before its first open
    with open(pack / "shard-00000.lmdb" / "data.mdb", "r+b") as f:
        f.seek(16)  # meta page 0's magic
        f.write(b"\0\0\0\0")

    done = _run_limited(_READ_DAMAGED_OUT_OF_FILES, [str(pack)], SOFT, hard, timeout=120)
    line = done.stdout.strip()
    assert done.returncode == 3, done.stdout + done.stderr
    assert line.startswith("PackFormatError ") and "is not an LMDB meta page" in line, line
    assert "too many open files" not in line


_READ_AT_THE_LIMIT = textwrap.dedent(
    """
    import os, sys
    import packdata  # nothing here has asked the limits yet

    ds = packdata.LMDBDataset(sys.argv[1], decode="bytes")
    held = []
    try:
        while True:  # the training script's own files: none left for the first shard
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    try:
        ds[0]
    except packdata.PackdataError as exc:
        print(type(exc).__name__, exc)
    """
)


def test_a_process_out_of_files_at_its_first_shard_gets_the_one_line_error(many_shards) -> None:
    """The readers imported ``resource`` when they first asked the limits, that is when out of files: the
    import itself failed ('cannot open shared object file: Too many open files'), a raw ImportError."""

    done = _run_limited(_READ_AT_THE_LIMIT, [str(many_shards["lmdb"])], SOFT, SOFT, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("CapacityError ") and "too many open files opening shard 0" in done.stdout


_READ_AFTER_HINTS = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import numpy as np
    import packdata
    from packdata.pack.manifest import read_manifest
    from packdata.reading.readahead import ReadAhead

    ReadAhead.IDLE, ReadAhead.RECHECK = 0.001, 0.0  # the thread ends and starts again between almost every hint
    ds = packdata.TFRecordIndexedDataset(sys.argv[1], decode="bytes", check_crc=False)
    hints = ReadAhead(Path(sys.argv[1]), read_manifest(sys.argv[1]))
    rng, wrong = np.random.default_rng(0), []
    for _ in range(1500):
        window = rng.integers(0, len(ds), 8).tolist()
        hints.advise(window)
        for i in window:
            try:
                if ds[i][0] != f"note {i} ".encode() * 40:
                    wrong.append(f"sample {i}: other bytes")
            except Exception as exc:
                wrong.append(f"sample {i}: {type(exc).__name__} {exc}")
    hints.close()
    print("\\n".join(wrong[:5]) or "read as written")
    """
)


@pytest.fixture(scope="module")
def sixty_shards(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """300 short texts in an LMDB and a TFRecord pack of 60 shards each."""
    packs = _note_packs(tmp_path_factory.mktemp("sixty-shards"), 300, 40, shard_samples=5)
    assert all(len(read_manifest(pack).shards) == 60 for pack in packs.values())
    return packs


def test_reads_between_read_ahead_threads_get_their_own_bytes(sixty_shards) -> None:
    """A read-ahead thread ending on idle closed its files after letting the next one start: the new thread's
    files, or a shard reader's that had reused their numbers, were closed under them ('Bad file descriptor', an
    intact shard called damaged, or with check_crc=False another shard's bytes)."""
    done = _run_limited(_READ_AFTER_HINTS, [str(sixty_shards["tfrecord"])], 2 * SOFT, 2 * SOFT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "read as written", done.stdout


_READ_WITH_NO_FILE_TO_SPARE = textwrap.dedent(
    """
    import os, sys
    import packdata
    from packdata.pack.manifest import read_manifest

    fmt, path = sys.argv[1], sys.argv[2]
    cls = packdata.LMDBDataset if fmt == "lmdb" else packdata.TFRecordIndexedDataset
    ds = cls(path, decode="bytes")
    budget = read_manifest(path).shards[8].first_index  # 8 readers: the most a 64-file limit allows
    texts = [ds[i][0] for i in range(budget)]
    held = []
    try:
        while True:  # every other descriptor taken: the next reader can only have an evicted one's files
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    try:
        texts += [ds[i][0] for i in range(budget, len(ds))]
    except packdata.PackdataError as exc:
        print(type(exc).__name__, exc)
        sys.exit(3)
    print("read as written" if texts == [f"note {i} ".encode() * 100 for i in range(len(ds))] else "other bytes")
    """
)


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_a_reader_let_go_of_closes_before_the_next_one_opens(many_shards, fmt: str) -> None:
    """The readers evicted to make room stayed open until the new one had opened: every open past the budget
    needed one reader's files more than the budget allows ('too many open files opening shard 8')."""
    done = _run_limited(_READ_WITH_NO_FILE_TO_SPARE, [fmt, str(many_shards[fmt])], SOFT, SOFT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "read as written", done.stdout


_READ_IN_A_FORKED_WORKER = textwrap.dedent(
    """
    import os, sys
    import packdata
    from packdata.pack.manifest import read_manifest
    from torch.utils.data import DataLoader, Dataset

    class ShardFilesSeen(Dataset):
        def __init__(self, ds):
            self.ds = ds

        def __len__(self):
            return len(self.ds)

        def __getitem__(self, i):
            sample = self.ds[i][0]
            return sample, sum(is_shard(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd"))

    def is_shard(fd_link):
        try:
            return os.readlink(fd_link).endswith(".tfrecord")
        except FileNotFoundError:  # the listing's own descriptor, closed since
            return False

    ds = packdata.TFRecordIndexedDataset(sys.argv[1], decode="bytes")
    budget = read_manifest(sys.argv[1]).shards[8].first_index  # 8 readers: the most a 64-file limit allows
    [ds[i] for i in range(budget)]  # the parent holds 8 shard files when the worker forks
    loader = DataLoader(ShardFilesSeen(ds), batch_size=None, num_workers=1, multiprocessing_context="fork")
    texts, seen = zip(*loader)
    assert list(texts) == [f"note {i} ".encode() * 100 for i in range(len(ds))], "other bytes"
    print("shard files held at most", max(seen))
    """
)


def test_a_forked_worker_closes_the_tfrecord_files_it_inherited(many_shards) -> None:
    """A parent's TFRecord readers, dropped in a forked worker, kept the worker's copies of their descriptors
    open (LMDB's closed them): the worker held the parent's shard files beside its own budget of them."""
    done = _run_limited(_READ_IN_A_FORKED_WORKER, [str(many_shards["tfrecord"])], SOFT, SOFT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "shard files held at most 8", done.stdout


_FORK_WHILE_THREADS_OPEN_SHARDS = textwrap.dedent(
    """
    import random, sys, threading, time
    import packdata
    from torch.utils.data import DataLoader

    path = sys.argv[1]
    ds = packdata.LMDBDataset(path, decode="bytes")
    stop = threading.Event()
    errors = []

    def spin(seed):
        rng = random.Random(seed)
        while not stop.is_set():
            i = rng.randrange(len(ds))
            try:
                if ds[i][0] != f"note {i} ".encode() * 100:
                    errors.append(f"thread: sample {i} other bytes")
            except Exception as exc:
                errors.append(f"thread: {type(exc).__name__} {exc}")

    threads = [threading.Thread(target=spin, args=(s,), daemon=True) for s in range(6)]  # opening, evicting shards
    for t in threads:
        t.start()
    deadline = time.monotonic() + float(sys.argv[2])
    rounds = 0
    while time.monotonic() < deadline and not errors:  # forks land inside the threads' opens and closes
        rounds += 1
        loader = DataLoader(ds, batch_size=10, num_workers=2, multiprocessing_context="fork", collate_fn=list)
        try:
            got = [s for batch in loader for s, _ in batch]
            if sorted(got) != sorted(f"note {i} ".encode() * 100 for i in range(len(ds))):
                errors.append("loader: samples differ")
        except Exception as exc:
            errors.append(f"loader: {type(exc).__name__} {str(exc)[-300:]}")
    stop.set()
    for t in threads:
        t.join()
    print("\\n".join(errors[:3]) or f"read as written ({rounds} loaders)")
    """
)


@pytest.mark.parametrize("tables", ["records.i64", "none"])
def test_workers_forked_while_threads_open_shards_read_every_sample(many_shards, tmp_path: Path, tables: str) -> None:
    """A DataLoader forked while another thread was inside lmdb.open (or an environment's close) gave its workers
    a handle py-lmdb counted open and nothing else named: their reads of that intact shard were refused as
    'already open through another lmdb.open', or a worker closing the inherited handle waited forever on the
    calls in flight at the fork. A reader never opens LMDB now: shards with their records.i64 tables, and
    shards without (an older pack's), whose values it locates by walking their pages itself."""
    pack = many_shards["lmdb"]
    if tables == "none":
        pack = Path(shutil.copytree(pack, tmp_path / "no-tables.lmdb"))
        for table in pack.glob("*/records.i64"):
            table.unlink()
    done = _run_limited(_FORK_WHILE_THREADS_OPEN_SHARDS, [str(pack), "8"], 4 * SOFT, 4 * SOFT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().startswith("read as written"), done.stdout


_READ_IN_SAMPLER_ORDER = textwrap.dedent(
    """
    import sys
    import packdata
    from torch.utils.data import DataLoader

    fmt, path = sys.argv[1], sys.argv[2]
    cls = packdata.LMDBDataset if fmt == "lmdb" else packdata.TFRecordIndexedDataset
    ds = cls(path, decode="bytes")
    sampler = packdata.BlockShuffleSampler(ds, block_size=2, window=8, seed=1)  # windows spanning many shards
    try:
        got = [s for batch in DataLoader(ds, batch_size=4, sampler=sampler, collate_fn=list) for s, _ in batch]
    except packdata.PackdataError as exc:
        print(type(exc).__name__, exc)
        sys.exit(3)
    expected = sorted(f"note {i} ".encode() * 40 for i in range(len(ds)))
    print("read as written" if sorted(got) == expected else "other bytes")
    """
)


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_the_samplers_read_ahead_leaves_the_readers_their_files(sixty_shards, fmt: str) -> None:
    """The read-ahead kept up to 64 shards' files open whatever the limit, beside the half of it the shard readers
    may keep: at a hard limit of 80 files the readers ran out ('too many open files opening shard ...')."""
    done = _run_limited(_READ_IN_SAMPLER_ORDER, [fmt, str(sixty_shards[fmt])], 80, 80)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "read as written", done.stdout
