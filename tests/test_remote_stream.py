"""Reading a pack at a URL in place: streams, read-ahead, retries, and a pack uploaded again mid-epoch."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path, PurePosixPath

import pytest
from click.testing import CliRunner
from conftest import SECRET, image_bytes
from faults.hostile import rewrite_manifest
from remote_helpers import _HOLDER, _cli, _convert_to_s3, _samples
from torch.utils.data import DataLoader

import packdata
from packdata.cli import main
from packdata.errors import ConfigError, PackFormatError

pytest.importorskip("moto.server", reason="the tests' S3 server needs moto[server] (the dev extra)")
pytest.importorskip("s3fs", reason="s3:// needs s3fs (pip install 'packdata[s3]')")


def test_tfrecord_streams_from_s3_exactly_once_through_workers(s3, tmp_path: Path) -> None:
    options, fs = s3
    src = tmp_path / "src"
    for c in ("a", "b"):
        (src / c).mkdir(parents=True)
        for i in range(10):
            (src / c / f"{i}.jpg").write_bytes(image_bytes(i + (20 if c == "b" else 0), (30, 20)))
    local = tmp_path / "train"
    packdata.convert(src, local, format="tfrecord", shard_samples=6, progress=False)
    fs.put(str(local), "packs/stream", recursive=True)
    expected = sorted(data for data, _ in packdata.TFRecordIndexedDataset(local, decode="bytes"))
    url = "s3://packs/stream"
    for workers in (0, 2):
        ds = packdata.TFRecordDataset(
            url, decode="bytes", shuffle=True, storage_options=options, cache_dir=tmp_path / "cache"
        )
        loader = DataLoader(ds, batch_size=None, num_workers=workers)
        assert sorted(data for data, _ in loader) == expected
    with pytest.raises(packdata.ConfigError, match="random access reads local shards"):
        packdata.TFRecordIndexedDataset(url)
    ds = packdata.TFRecordDataset(url, decode="bytes", storage_options=options, cache_dir=tmp_path / "cache")
    held = list(ds._records(ds.reader_segments(0, 1)))  # what a shuffle buffer holds: copies, not chunk views
    assert len(held) == 20 and all(type(data) is bytes for data, _, _ in held)


def test_forked_workers_make_their_s3_clients_from_the_models_the_main_process_decoded(
    s3, remote_tfrecord, tmp_path: Path, monkeypatch
) -> None:
    """Every forked worker of every epoch decoded botocore's JSON service models again (0.3-0.4 s of CPU) first."""
    from botocore.loaders import JSONFileLoader

    options, _ = s3
    url, local = remote_tfrecord
    log = tmp_path / "model-loads"
    real = JSONFileLoader.load_file

    def load_file(self, file_path):  # the real loader, each file it decodes noted with the process that did
        with open(log, "a") as out:
            out.write(f"{os.getpid()} {file_path}\n")
        return real(self, file_path)

    monkeypatch.setattr(JSONFileLoader, "load_file", load_file)
    expected = sorted(data for data, _ in packdata.TFRecordIndexedDataset(local, decode="bytes"))
    ds = packdata.TFRecordDataset(url, decode="bytes", storage_options=options, cache_dir=tmp_path / "cache")
    for epoch in range(2):  # workers forked afresh each epoch
        ds.set_epoch(epoch)
        loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
        assert sorted(data for data, _ in loader) == expected
    loads = log.read_text().splitlines() if log.exists() else []
    assert [line for line in loads if int(line.split()[0]) != os.getpid()] == []


def test_each_worker_pins_a_small_packs_shards_from_one_listing_and_one_manifest_read(
    s3, remote_shards, tmp_path: Path, monkeypatch
) -> None:
    """Every forked worker of every epoch looked each of its shards up (HEAD) and read the manifest again for each."""
    import s3fs

    options, _ = s3
    url, local, shards = remote_shards
    log = tmp_path / "requests"
    real = s3fs.S3FileSystem._call_s3

    async def call_s3(self, method, *args, **kwargs):  # every request of every process, noted with its process
        with open(log, "a") as out:
            out.write(f"{os.getpid()} {method} {kwargs.get('Key', '')}\n")
        return await real(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", call_s3)
    expected = sorted(data for data, _ in packdata.TFRecordIndexedDataset(local, decode="bytes"))
    ds = packdata.TFRecordDataset(url, decode="bytes", storage_options=options, cache_dir=tmp_path / "cache")
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    assert sorted(data for data, _ in loader) == expected
    workers: dict[str, list[tuple[str, str]]] = {}
    for line in log.read_text().splitlines():
        pid, method, key = line.split(" ", 2)
        if int(pid) != os.getpid():
            workers.setdefault(pid, []).append((method, key.rsplit("/", 1)[-1]))
    assert len(workers) == 2
    names = {name for name, _ in shards}
    for requests in workers.values():
        read = [key for method, key in requests if method == "get_object" and key in names]
        assert len(read) == len(set(read)) >= 3  # one GET a shard it reads (7 shards, 2 workers)
        assert [method for method, key in requests if key in names and method != "get_object"] == []  # no HEAD
        assert [key for method, key in requests if key == "manifest.json"] == ["manifest.json"]
        assert [method for method, _ in requests].count("list_objects_v2") == 1


@pytest.mark.timeout(300)  # 1,000 objects put to moto: minutes on a loaded machine
def test_a_small_pack_beside_many_objects_is_pinned_from_one_listing_page_not_the_roots_whole_listing(
    s3, remote_shards, tmp_path: Path, monkeypatch
) -> None:
    """The one-listing pin listed the pack's root to its end (s3fs pages through all of it) in every process: a pack
    at a root holding 1,000 other objects cost 2 LISTs, a root of a million 1,000, per worker per epoch."""
    import s3fs

    options, fs = s3
    _, local, _ = remote_shards
    fs.put(str(local), "packs/crowded", recursive=True)
    fs.pipe({f"packs/crowded/zz-{i:04d}.txt": b"a stranger's" for i in range(1000)})  # listed after the pack's
    requests: list[tuple[str, str]] = []
    real = s3fs.S3FileSystem._call_s3

    async def call_s3(self, method, *args, **kwargs):  # every request, as s3fs makes it
        requests.append((method, kwargs.get("Key", "")))
        return await real(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", call_s3)
    expected = sorted(data for data, _ in packdata.TFRecordIndexedDataset(local, decode="bytes"))
    ds = packdata.TFRecordDataset(
        "s3://packs/crowded", decode="bytes", storage_options=options, cache_dir=tmp_path / "cache"
    )
    assert sorted(data for data, _ in ds) == expected
    assert [method for method, _ in requests].count("list_objects_v2") == 1
    assert [key for method, key in requests if method == "head_object" and key.endswith(".tfrecord")] == []


def test_a_url_never_reads_a_local_folder_named_like_it(s3, remote_pack, remote_tfrecord, tmp_path, monkeypatch):
    """LMDBDataset('s3://packs/train.lmdb') (and open_dataset) read ./s3:/packs/train.lmdb, another pack, silently."""
    from packdata.reading.open import open_dataset

    options, _ = s3
    (lmdb_url, _), (tf_url, tf_local) = remote_pack, remote_tfrecord
    monkeypatch.chdir(tmp_path)
    (tmp_path / "src" / "c").mkdir(parents=True)
    (tmp_path / "src" / "c" / "0.txt").write_text("another pack")
    packdata.convert(tmp_path / "src", "s3:/packs/train.lmdb", progress=False)  # as a tool that mangled the URL
    with pytest.raises(ConfigError, match=r"^s3://packs/train\.lmdb: an LMDB pack is read through local files"):
        packdata.LMDBDataset(lmdb_url)
    for url, streaming, hint in ((lmdb_url, True, "Stage it first"), (tf_url, False, "Pass streaming=True")):
        with pytest.raises(ConfigError, match=rf"^{url}: a map-style dataset reads local files only\. {hint}"):
            open_dataset(url, streaming=streaming, storage_options=options)
    ds = open_dataset(tf_url, streaming=True, decode="bytes", storage_options=options, cache_dir=tmp_path / "cache")
    assert isinstance(ds, packdata.TFRecordDataset)
    assert sorted(ds) == sorted(packdata.TFRecordIndexedDataset(tf_local, decode="bytes"))


def test_a_missing_object_is_reported_without_retries(s3) -> None:
    """A shard object deleted (or listed, then 404 on GET) was named as 'bytes 0-10 could not be read after 1 tries
    (FileNotFoundError). The epoch stops here rather than skip records: check the network', in verify too."""
    from packdata.formats.remote_reads import fetch_range

    _, fs = s3
    calls = []

    class Counting:
        def cat_file(self, path, start=None, end=None):
            calls.append(path)
            return fs.cat_file(path, start=start, end=end)

    with pytest.raises(PackFormatError, match=r"^s3://packs/no-such-object: is missing \(removed, or its pack is"):
        fetch_range(Counting(), "packs/no-such-object", "s3://packs/no-such-object", 0, 10, backoff=5)
    assert len(calls) == 1


@pytest.mark.parametrize("start", [100, 700])  # 700: past the object's end, which S3 answers with an error (416)
def test_an_object_shorter_than_the_pack_says_is_named_without_retries(s3, start: int) -> None:
    """A short read was retried as a network fault, and the error pointed at the network (a range past the end:
    four tries, then 'could not be read after 4 tries (OSError)')."""
    from packdata.formats.remote_reads import fetch_range

    _, fs = s3
    fs.pipe("packs/short-object", b"x" * 675)
    calls = []

    class Counting:
        def cat_file(self, path, start=None, end=None):
            calls.append(path)
            return fs.cat_file(path, start=start, end=end)

        def info(self, path):
            return fs.info(path)

    with pytest.raises(
        PackFormatError, match=rf"the object is 675 bytes, but the pack's tables place bytes {start}-775"
    ):
        fetch_range(Counting(), "packs/short-object", "s3://packs/short-object", start, 775, backoff=0.01)
    assert len(calls) == 1


def test_remote_stream_retries_then_names_the_shard(s3, tmp_path: Path, monkeypatch) -> None:
    options, fs = s3
    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    for i in range(6):
        (src / f"{i}.jpg").write_bytes(image_bytes(i, (30, 20)))
    packdata.convert(tmp_path / "src", tmp_path / "p", format="tfrecord", progress=False)
    fs.put(str(tmp_path / "p"), "packs/flaky", recursive=True)
    failures = {"left": 2}

    def flaky(name: str, start: int) -> bool:
        if failures["left"] > 0:
            failures["left"] -= 1
            return True
        return False

    _logged(monkeypatch, fs, flaky)
    import packdata.formats.tfrecord_remote as remote

    monkeypatch.setattr(remote.RemoteShardReader, "BACKOFF", 0.01)
    ds = packdata.TFRecordDataset("s3://packs/flaky", decode="bytes", shuffle=False, storage_options=options,
                                  cache_dir=tmp_path / "cache")  # fmt: skip
    assert len(list(ds)) == 6 and failures["left"] == 0  # two dropped requests, retried: nothing lost
    failures["left"] = 100
    with pytest.raises(PackFormatError, match=r"s3://packs/flaky/p-00000-of-00001\.tfrecord: bytes 0-\d+ could not"):
        list(ds)


@pytest.fixture(scope="module")
def remote_shards(s3, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, list[tuple[str, int]]]:
    """A 7-shard TFRecord pack (40 samples, 6 a shard) uploaded to s3://packs/ahead; its (file, samples) per shard."""
    _, fs = s3
    root = tmp_path_factory.mktemp("ahead")
    for c in ("a", "b"):
        (root / "src" / c).mkdir(parents=True)
        for i in range(20):
            (root / "src" / c / f"{i:02d}.jpg").write_bytes(image_bytes(i + (40 if c == "b" else 0), (30, 20)))
    local = root / "ahead"
    packdata.convert(root / "src", local, format="tfrecord", shard_samples=6, progress=False)
    fs.put(str(local), "packs/ahead", recursive=True)
    shards = json.loads((local / "manifest.json").read_text())["shards"]
    return "s3://packs/ahead", local, [(s["file"], s["num_samples"]) for s in shards]


@pytest.fixture
def small_chunks(monkeypatch) -> None:
    """Ranged requests of about 1.5 KB (two or three records), so every shard is several chunks; fast retries."""
    import packdata.formats.tfrecord_remote as remote

    monkeypatch.setattr(remote.RemoteShardReader, "CHUNK", 1500)
    monkeypatch.setattr(remote.RemoteShardReader, "BACKOFF", 0.01)


class _Requests(list):
    """The ranged GETs of shards made so far, as (file name, first byte); :meth:`wait_for` one of them."""

    def __init__(self) -> None:
        super().__init__()
        self._grown = threading.Condition()

    def add(self, request: tuple[str, int]) -> None:
        with self._grown:
            self.append(request)
            self._grown.notify_all()

    def wait_for(self, request: tuple[str, int], times: int = 1) -> bool:
        """Whether ``request`` was made ``times`` times: waits until it is, however loaded the machine (60 s: never)."""
        with self._grown:
            return self._grown.wait_for(lambda: self.count(request) >= times, timeout=60)


def _logged(monkeypatch, fs, fail=lambda name, start: False, calls: list[tuple[str, dict]] | None = None) -> _Requests:
    """Log every ranged GET of a shard as (file name, first byte); ``fail(name, start)`` drops one.

    ``calls``, when given, gets every S3 request as (operation, arguments).
    """
    real = fs._call_s3  # fsspec caches filesystems: the dataset gets this very instance
    log = _Requests()

    async def call_s3(method, *args, **kwargs):
        if calls is not None:
            calls.append((method, kwargs))
        if method == "get_object" and kwargs["Key"].endswith(".tfrecord"):
            name, start = kwargs["Key"].rsplit("/", 1)[-1], int(kwargs["Range"].split("=")[1].split("-")[0])
            log.add((name, start))
            if fail(name, start):
                raise ConnectionResetError("reset by peer")
        return await real(method, *args, **kwargs)

    monkeypatch.setattr(fs, "_call_s3", call_s3)
    return log


@pytest.mark.parametrize("shuffle", [False, True])
def test_remote_stream_reads_ahead_without_changing_the_order(s3, remote_shards, small_chunks, tmp_path, shuffle):
    """2 ranks x 2 workers: every sample exactly once, each rank in the very order of the same pack on disk."""
    options, _ = s3
    url, local, _ = remote_shards
    expected = sorted(data for data, _ in packdata.TFRecordIndexedDataset(local, decode="bytes"))
    streamed: list[bytes] = []
    for rank in (0, 1):
        options_ = {"decode": "bytes", "shuffle": shuffle, "seed": 3, "rank": rank, "world_size": 2}
        remote = packdata.TFRecordDataset(url, storage_options=options, cache_dir=tmp_path / "c", **options_)
        here = packdata.TFRecordDataset(local, **options_)
        for ds in (remote, here):
            ds.set_epoch(1)
        got = [data for data, _ in DataLoader(remote, batch_size=None, num_workers=2)]
        assert got == [data for data, _ in DataLoader(here, batch_size=None, num_workers=2)]
        streamed += got
    assert sorted(streamed) == expected


def test_a_remote_stream_resumes_where_the_same_pack_on_disk_would(s3, remote_shards, small_chunks, tmp_path):
    options, _ = s3
    url, local, _ = remote_shards
    here = packdata.TFRecordDataset(local, decode="bytes", seed=5, shuffle_buffer=8)
    it = iter(here)
    first = [next(it)[0] for _ in range(13)]
    state, rest = here.state_dict(), [data for data, _ in it]
    remote = packdata.TFRecordDataset(
        url, decode="bytes", seed=5, shuffle_buffer=8, storage_options=options, cache_dir=tmp_path
    )
    remote.load_state_dict(state)
    got = [data for data, _ in remote]
    assert got == rest and len(first) + len(got) == 40


def test_the_next_shard_is_requested_before_the_current_one_ends(
    s3, remote_shards, small_chunks, monkeypatch, tmp_path
):
    options, fs = s3
    url, _, shards = remote_shards
    log = _logged(monkeypatch, fs)
    ds = packdata.TFRecordDataset(url, decode="bytes", shuffle=False, storage_options=options, cache_dir=tmp_path)
    it = iter(ds)
    for k, ((name, count), (following, _)) in enumerate(itertools.pairwise(shards)):
        for _ in range(count):
            next(it)  # the shard's last record is now in our hands; the reader is not asked for more
        assert log.wait_for((following, 0)), f"shard {k + 1}'s first range was not requested before shard {k} ended"
        assert log.index((following, 0)) > log.index((name, 0))
    assert len(list(it)) == shards[-1][1]
    assert len(log) == len(set(log))  # every range requested once


def test_a_transient_failure_at_a_shard_boundary_loses_and_repeats_nothing(
    s3, remote_shards, small_chunks, monkeypatch, tmp_path
):
    options, fs = s3
    url, local, shards = remote_shards
    expected = [data for data, _ in packdata.TFRecordDataset(local, decode="bytes", shuffle=False)]
    drops = {shards[1][0]: 2, shards[4][0]: 1}  # the first range of shards 1 and 4 fails 2 and 1 times

    def fail(name: str, start: int) -> bool:
        if start == 0 and drops.get(name, 0) > 0:
            drops[name] -= 1
            return True
        return False

    log = _logged(monkeypatch, fs, fail)
    ds = packdata.TFRecordDataset(url, decode="bytes", shuffle=False, storage_options=options, cache_dir=tmp_path)
    assert [data for data, _ in ds] == expected
    assert drops == {shards[1][0]: 0, shards[4][0]: 0} and log.count((shards[1][0], 0)) == 3


class _Dropping:
    """A GET's body whose connection drops once ``limit`` bytes were read.

    ``limit`` None: the size of the first piece asked for (a chunk of a span's GET); a body read whole at once
    (a request a chunk) is never dropped.
    """

    def __init__(self, body, limit: int | None) -> None:
        self.body, self.limit, self.read_so_far = body, limit, 0

    async def read(self, n: int = -1) -> bytes:
        if self.limit is None:
            self.limit = n if n >= 0 else 1 << 62
        if self.read_so_far >= self.limit:
            raise ConnectionResetError("reset by peer")
        data = await self.body.read(self.limit - self.read_so_far if n < 0 else min(n, self.limit - self.read_so_far))
        self.read_so_far += len(data)
        return data

    def close(self) -> None:
        self.body.close()


def _drop_gets(monkeypatch, fs, log: _Requests, shard: str, limit: int | None, every=False) -> list[_Dropping]:
    """Drop the body of ``shard``'s first GET (``every``: of each) after ``limit`` bytes (see :class:`_Dropping`).

    Returns the bodies wrapped, in the order of their GETs.
    """
    logged, dropped = fs._call_s3, []

    async def call_s3(method, *args, **kwargs):
        response = await logged(method, *args, **kwargs)
        first = kwargs.get("Range", "").startswith("bytes=0-") and log.count((shard, 0)) == 1
        if method == "get_object" and kwargs["Key"].endswith(shard) and (every or first):
            response["Body"] = _Dropping(response["Body"], limit)
            dropped.append(response["Body"])
        return response

    monkeypatch.setattr(fs, "_call_s3", call_s3)
    return dropped


def test_a_shards_get_dropped_mid_body_reads_the_rest_by_chunks_losing_and_repeating_nothing(
    s3, remote_shards, small_chunks, monkeypatch, tmp_path
):
    """On S3 a shard is one GET read a chunk at a time: a connection dropped before that GET gave a whole chunk
    has the rest of the shard read a ranged request a chunk (retried, explained), every record still once and in
    order."""
    options, fs = s3
    url, local, shards = remote_shards
    expected = [data for data, _ in packdata.TFRecordDataset(local, decode="bytes", shuffle=False)]
    dropped = shards[2][0]
    log = _logged(monkeypatch, fs)
    bodies = _drop_gets(monkeypatch, fs, log, dropped, limit=100)  # part of the first record only
    ds = packdata.TFRecordDataset(url, decode="bytes", shuffle=False, storage_options=options, cache_dir=tmp_path)
    assert [data for data, _ in ds] == expected
    assert len(bodies) == 1 and bodies[0].read_so_far == 100
    assert [start for name, start in log if name != dropped] == [0] * (len(shards) - 1)  # one GET a shard
    starts = [start for name, start in log if name == dropped]
    assert starts[:2] == [0, 0] and len(starts) > 2  # the GET, then a request a chunk from the first
    assert starts[1:] == sorted(set(starts[1:]))  # each chunk asked once, in order


def test_a_shards_get_dropped_after_a_chunk_is_made_again_from_the_next_unread_byte(
    s3, remote_shards, small_chunks, monkeypatch, tmp_path
):
    """A connection dropped after its GET gave the first chunk is one more GET of the span, from the first byte
    not read (the first chunk's end), not a request a chunk: every record once and in order."""
    options, fs = s3
    url, local, shards = remote_shards
    expected = [data for data, _ in packdata.TFRecordDataset(local, decode="bytes", shuffle=False)]
    dropped = shards[2][0]
    log = _logged(monkeypatch, fs)
    bodies = _drop_gets(monkeypatch, fs, log, dropped, limit=None)  # after the first chunk
    ds = packdata.TFRecordDataset(url, decode="bytes", shuffle=False, storage_options=options, cache_dir=tmp_path)
    assert [data for data, _ in ds] == expected
    assert [start for name, start in log if name != dropped] == [0] * (len(shards) - 1)  # one GET a shard
    assert len(bodies) == 1 and 0 < bodies[0].read_so_far < (local / dropped).stat().st_size
    assert [start for name, start in log if name == dropped] == [0, bodies[0].read_so_far]  # two GETs in all


def test_a_span_whose_every_get_drops_after_a_chunk_is_made_again_three_times_then_read_by_chunks(
    s3, remote_shards, small_chunks, monkeypatch, tmp_path
):
    """A flapping store does not loop: a run's span is opened 1 + 3 times, each GET from the first byte the one
    before did not give, then the rest is a request a chunk; every byte asked once, every record once in order."""
    options, fs = s3
    url, local, shards = remote_shards
    expected = [data for data, _ in packdata.TFRecordDataset(local, decode="bytes", shuffle=False)]
    dropped = shards[2][0]
    log = _logged(monkeypatch, fs)
    bodies = _drop_gets(monkeypatch, fs, log, dropped, limit=None, every=True)
    ds = packdata.TFRecordDataset(url, decode="bytes", shuffle=False, storage_options=options, cache_dir=tmp_path)
    assert [data for data, _ in ds] == expected
    assert [start for name, start in log if name != dropped] == [0] * (len(shards) - 1)  # one GET a shard
    starts = [start for name, start in log if name == dropped]
    spans = [body for body in bodies if body.limit < 1 << 62]  # read in pieces: the span's GETs
    assert len(spans) == 4 and len(starts) > 5  # the GET and 3 more, then at least 2 requests a chunk
    assert all(starts[i + 1] == starts[i] + spans[i].read_so_far for i in range(4))  # each from the next byte
    assert starts == sorted(set(starts))  # nothing asked twice


def test_a_next_shard_that_keeps_failing_ends_the_epoch_after_the_current_one(
    s3, remote_shards, small_chunks, monkeypatch, tmp_path
):
    options, fs = s3
    url, local, shards = remote_shards
    expected = [data for data, _ in packdata.TFRecordDataset(local, decode="bytes", shuffle=False)]
    _logged(monkeypatch, fs, lambda name, start: name == shards[2][0])
    ds = packdata.TFRecordDataset(url, decode="bytes", shuffle=False, storage_options=options, cache_dir=tmp_path)
    got = []
    with pytest.raises(
        PackFormatError, match=rf"s3://packs/ahead/{shards[2][0]}: bytes 0-\d+ could not be read after 4"
    ):
        for data, _ in ds:
            got.append(data)
    assert got == expected[: shards[0][1] + shards[1][1]]  # every record before the failing range, none after


def _readahead_threads(besides: set[threading.Thread] = frozenset()) -> set[threading.Thread]:
    """The read-ahead threads alive now, but those in ``besides`` (another test's reader not yet collected)."""
    return {t for t in threading.enumerate() if t.name.startswith("packdata-readahead")} - besides


def _wait_gone(threads: set[threading.Thread]) -> bool:
    """Whether ``threads`` end: each is joined, however loaded the machine (60 s: it does not end)."""
    for t in threads:
        t.join(60)
    return not any(t.is_alive() for t in threads)


def test_an_abandoned_remote_reader_leaves_no_thread_behind(s3, remote_shards, small_chunks, monkeypatch, tmp_path):
    import packdata.formats.tfrecord_remote as remote

    options, fs = s3
    url, _, shards = remote_shards
    monkeypatch.setattr(remote.RemoteShardReader, "BACKOFF", 30.0)  # a retry waiting far longer than the test
    log = _logged(monkeypatch, fs, lambda name, start: name == shards[1][0])
    ds = packdata.TFRecordDataset(url, decode="bytes", shuffle=False, storage_options=options, cache_dir=tmp_path)
    others = _readahead_threads()
    it = iter(ds)
    for _ in range(shards[0][1]):
        next(it)
    # the shard's one GET failed, then its first chunk's own request: the read-ahead is in its backoff
    assert log.wait_for((shards[1][0], 0), times=2)
    ours = _readahead_threads(others)
    assert len(ours) == 1
    it.close()  # what a DataLoader shutting down or a training loop breaking out does
    del it
    assert _wait_gone(ours), "the read-ahead thread outlived its reader"
    assert log.count((shards[1][0], 0)) == 2  # the retry was not made


def test_a_reader_stopped_by_an_error_leaves_no_thread_behind(s3, remote_shards, small_chunks, monkeypatch, tmp_path):
    """The error's traceback (held here, as a caller logging it would) must not keep the read-ahead running."""
    import packdata.formats.tfrecord_remote as remote

    options, fs = s3
    url, _, shards = remote_shards
    monkeypatch.setattr(remote.RemoteShardReader, "BACKOFF", 0.01)
    _logged(monkeypatch, fs, lambda name, start: name in (shards[1][0], shards[2][0]))  # failing with more ahead
    ds = packdata.TFRecordDataset(url, decode="bytes", shuffle=False, storage_options=options, cache_dir=tmp_path)
    others = _readahead_threads()
    it = iter(ds)
    next(it)  # the read-ahead has started
    ours = _readahead_threads(others)
    assert len(ours) == 1
    with pytest.raises(PackFormatError, match=shards[1][0]) as raised:
        for _ in it:
            pass
    assert raised.value.__traceback__ is not None
    assert _wait_gone(ours), "the read-ahead thread outlived the error that ended its reader"


def test_a_downloader_killed_with_sigkill_does_not_hang_the_other_ranks(s3, remote_pack, tmp_path: Path) -> None:
    """Ported from the storage helper's tests: the kernel drops a dead holder's flock, a waiting rank takes over."""
    import signal
    import threading

    options, _ = s3
    url, local = remote_pack
    cache = tmp_path / "cache"
    cache.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(cache / ".train.lmdb.lock")], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    results: list[object] = []
    waiter = threading.Thread(
        target=lambda: results.append(packdata.stage(url, to=cache, storage_options=options, progress=False))
    )
    waiter.start()
    waiter.join(0.7)
    assert waiter.is_alive()  # waiting on the live holder
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    waiter.join(30)
    assert not waiter.is_alive() and results
    assert _samples(cache / "train.lmdb") == _samples(local)


def test_a_wait_past_its_limit_names_the_holder(s3, remote_pack, tmp_path: Path) -> None:
    from packdata.errors import LockedError
    from packdata.pack.lock import hold_lock
    from packdata.staging.remote import stage_remote

    options, _ = s3
    url, _ = remote_pack
    cache = tmp_path / "cache"
    cache.mkdir()
    lock = cache / ".train.lmdb.lock"
    with hold_lock(lock, what="another rank", target=lock), pytest.raises(LockedError, match=f"pid {os.getpid()}"):
        stage_remote(url, to=cache, storage_options=options, progress=False, wait_seconds=0.3)


def test_an_unreachable_server_is_one_clean_line_and_a_rerun_completes(s3, remote_pack, tmp_path: Path) -> None:
    options, _ = s3
    url, _ = remote_pack
    down = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}, "config_kwargs": {"retries": {"max_attempts": 1}}}
    with pytest.raises(
        packdata.SourceError, match=r"s3://packs/train\.lmdb: cannot read manifest\.json \(\w+Error\)"
    ) as info:
        packdata.stage(url, to=tmp_path / "cache", storage_options=down, progress=False)
    assert SECRET not in str(info.value)
    out = CliRunner().invoke(main, ["info", url, "--storage-options", json.dumps(down)])
    assert out.exit_code == 1 and out.output.startswith("Error: s3://packs/train.lmdb: cannot read")
    assert packdata.stage(url, to=tmp_path / "cache", storage_options=options, progress=False).downloaded
    with pytest.raises(packdata.ConfigError, match="staged whole"):
        packdata.stage(url, to=tmp_path / "c2", budget=1000, storage_options=options, progress=False)


_READ_ACROSS_A_CHANGE = """
import json, sys
import packdata
from packdata.errors import PackFormatError
from packdata.formats import tfrecord_remote
tfrecord_remote.RemoteShardReader.CHUNK = 100  # a record or two per request: most of the shard is fetched later
ds = packdata.TFRecordDataset(
    sys.argv[1], decode="bytes", shuffle=False, storage_options=json.loads(sys.argv[2]), cache_dir=sys.argv[3]
)
it = iter(ds)
print(json.dumps([next(it)[0].decode() for _ in range(2)]), flush=True)
sys.stdin.readline()  # meanwhile the pack is uploaded again and another process opens it, replacing the cache copy
read, error = [], ""
try:
    read += [data.decode() for data, _ in it]
except PackFormatError as exc:
    error = str(exc)
print(json.dumps({"read": read, "error": error}), flush=True)
"""


def _text_pack(root: Path, tag: str) -> Path:
    """A one-shard TFRecord pack ``root/changing`` of 12 text samples whose bytes start with ``tag``."""
    for c in ("x", "y"):
        (root / "src" / c).mkdir(parents=True)
        for i in range(6):
            (root / "src" / c / f"{i}.txt").write_text(f"{tag}{c}{i}" * 10)
    packdata.convert(root / "src", root / "changing", format="tfrecord", shard_samples=12, progress=False)
    return root / "changing"


def test_errors_of_a_pack_at_a_url_name_the_url_never_only_the_cache(s3, tmp_path: Path) -> None:
    """A dataset opened at a URL named its local cache folder in its errors: a path the user never gave."""
    options, fs = s3
    url, cache = "s3://packs/named-by-url", tmp_path / "cache"
    fs.put(str(_text_pack(tmp_path / "p", "A")), "packs/named-by-url", recursive=True)

    def opened(**options_: object) -> packdata.TFRecordDataset:
        return packdata.TFRecordDataset(url, shuffle=False, storage_options=options, cache_dir=cache, **options_)

    with pytest.raises(
        ConfigError, match=rf"^{url}: fields, transforms, missing and per-field decode are for multi-field"
    ):
        opened(fields=("txt",))
    with pytest.raises(PackFormatError, match=rf"^{url}: sample 'x/0\.txt' \(index 0\): "):
        next(iter(opened(decode="pil")))
    with pytest.raises(ConfigError, match=rf"^{url}: the reader state was saved with seed=5"):
        opened().load_state_dict({**opened().state_dict(), "seed": 5})
    ds = opened()
    for table in [*cache.rglob("*.tfpayload"), *cache.rglob("*.tfindex")]:
        table.unlink()  # a clean-up of the cache while the dataset is open
    with pytest.raises(PackFormatError, match=rf"^{url}/changing-00000-of-00001\.tfindex: ") as raised:
        list(ds)
    assert str(cache) not in str(raised.value)
    older = _text_pack(tmp_path / "older", "A")  # a pack whose manifest records no index digests, its index cut
    rewrite_manifest(older, lambda d: d["index"].pop("sha256"))
    os.truncate(older / "index" / "sizes.i64", 8)
    fs.put(str(older), "packs/older", recursive=True)
    with pytest.raises(PackFormatError, match=r"^s3://packs/older/index: sample index is missing or damaged"):
        packdata.TFRecordDataset("s3://packs/older", storage_options=options, cache_dir=cache)
    out = _cli("ls", "s3://packs/older", options=options)
    assert out.exit_code == 1 and out.output.startswith("Error: s3://packs/older/index: sample index is"), out.output
    damaged = _text_pack(tmp_path / "damaged", "A")  # its offsets index cut: cat reads a record through it
    (tfindex,) = damaged.glob("*.tfindex")
    os.truncate(tfindex, tfindex.stat().st_size - 8)
    fs.put(str(damaged), "packs/damaged", recursive=True)
    out = _cli("cat", "s3://packs/damaged", "x/0.txt", options=options)
    assert out.exit_code == 1 and out.output.startswith(f"Error: s3://packs/damaged/{tfindex.name}: "), out.output


def test_a_reader_whose_cache_copy_another_process_replaced_stops_with_one_clear_error(s3, tmp_path: Path) -> None:
    """The pack uploaded again, its records of the same lengths: nothing read after the replacement is the new one's."""
    options, fs = s3
    url, cache = "s3://packs/changing", tmp_path / "cache"
    first, second = _text_pack(tmp_path / "v1", "A"), _text_pack(tmp_path / "v2", "B")
    fs.put(str(first), "packs/changing", recursive=True)
    reader = subprocess.Popen(
        [sys.executable, "-c", _READ_ACROSS_A_CHANGE, url, json.dumps(options), str(cache)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert reader.stdin is not None and reader.stdout is not None
        assert json.loads(reader.stdout.readline()) == ["Ax0" * 10, "Ax1" * 10]
        fs.rm("packs/changing", recursive=True)
        fs.put(str(second), "packs/changing", recursive=True)
        fs.invalidate_cache()
        other = packdata.TFRecordDataset(url, decode="bytes", storage_options=options, cache_dir=cache)
        assert sorted(data[:1] for data, _ in other) == [b"B"] * 12  # this process reads the new pack
        reader.stdin.write("\n")
        reader.stdin.flush()
        outcome = json.loads(reader.stdout.readline())
    finally:
        reader.kill()
        reader.wait()
    assert all(data.startswith("A") for data in outcome["read"]), outcome["read"]  # never the new pack's records
    assert re.fullmatch(
        rf"{url}/manifest\.json: pack changed since the dataset was opened .* \(cached copy: "
        rf"{re.escape(str(cache))}/\w+/changing/manifest\.json\)\. Recreate the dataset .*",
        outcome["error"],
    ), outcome["error"]


@pytest.mark.parametrize("fmt", ["tfrecord", "lmdb"])
def test_cat_never_prints_a_record_of_a_pack_uploaded_again_after_it_read_the_index(
    s3, tmp_path: Path, monkeypatch, fmt: str
) -> None:
    """The pack converted over itself between cat's index download and its ranged read: same lengths, keys, labels."""
    import packdata.formats.contents as contents

    options, _ = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    url = f"s3://packs/cat-{fmt}"
    _convert_to_s3(tmp_path / "v1", "A", url, options, fmt)
    assert _cli("cat", url, "x/0.txt", options=options).stdout_bytes == b"Ax0" * 100
    fetch = contents.fetch_pack_skeleton

    def then_uploaded_again(*args: object) -> object:
        opened = fetch(*args)
        _convert_to_s3(tmp_path / "v2", "B", url, options, fmt)
        return opened

    monkeypatch.setattr(contents, "fetch_pack_skeleton", then_uploaded_again)
    out = _cli("cat", url, "x/0.txt", options=options)
    assert out.exit_code == 1 and out.stdout_bytes == b"", out.output
    assert re.match(rf"Error: {url}/.*: was replaced \(re-uploaded\?\) while this reader ran", out.output), out.output
    monkeypatch.setattr(contents, "fetch_pack_skeleton", fetch)
    assert _cli("cat", url, "x/0.txt", options=options).stdout_bytes == b"Bx0" * 100  # a new cat reads the new pack


@pytest.mark.parametrize("if_match", [True, False])
def test_a_shard_uploaded_again_mid_epoch_stops_the_reader_before_any_new_record(
    s3, tmp_path: Path, monkeypatch, if_match: bool
) -> None:
    """The pack converted over itself while read, records of the same lengths: the epoch once mixed both packs."""
    import packdata.formats.remote_pack as remote_pack
    import packdata.formats.remote_reads as remote_reads
    import packdata.formats.tfrecord_remote as remote
    import packdata.pack.urls as urls

    options, _ = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    monkeypatch.setattr(remote.RemoteShardReader, "CHUNK", 400)  # one record a request: most are fetched later
    if not if_match:  # a store without If-Match: the version is looked up after each read
        for module in (urls, remote_pack, remote_reads):
            monkeypatch.setattr(module, "conditional_reads", lambda fs: False)
    url = f"s3://packs/mid-epoch-{if_match}"
    # 2 shards: on S3 a shard is one GET from its pinned version, so the change is seen at the next shard
    _convert_to_s3(tmp_path / "v1", "A", url, options, shard_samples=6)
    ds = packdata.TFRecordDataset(url, decode="bytes", shuffle=False, storage_options=options, cache_dir=tmp_path)
    it = iter(ds)
    read = [next(it)[0]]
    _convert_to_s3(tmp_path / "v2", "B", url, options, shard_samples=6)
    with pytest.raises(
        PackFormatError,
        match=rf"^s3://packs/mid-epoch-{if_match}/mid-epoch-{if_match}-0000{int(if_match)}-of-00002\.tfrecord: was "
        r"replaced "
        r"\(re-uploaded\?\) while this reader ran\. Rebuild the dataset",
    ):
        for data, _ in it:
            read.append(data)
    assert all(data.startswith(b"A") for data in read), read  # never the new pack's bytes
    # on S3 the first shard whole, from its one GET at the old version; elsewhere the version is looked up each chunk
    assert len(read) == 6 if if_match else 1 <= len(read) < 6, read
    fresh = packdata.TFRecordDataset(url, decode="bytes", shuffle=False, storage_options=options, cache_dir=tmp_path)
    assert [data[:1] for data, _ in fresh] == [b"B"] * 12  # a dataset built again reads the new pack


def test_a_shard_replaced_mid_epoch_in_a_store_without_etags_stops_the_reader(tmp_path: Path, monkeypatch) -> None:
    """fsspec's memory store gives no ETag or modification time, only a creation time: a shard replaced there by
    another pack's of the same layout while a reader read it was streamed on, the epoch mixing both packs."""
    import fsspec

    import packdata.formats.tfrecord_remote as remote

    monkeypatch.setattr(remote.RemoteShardReader, "CHUNK", 400)  # one record a request: most are fetched later
    memory = fsspec.filesystem("memory")
    first, second = _text_pack(tmp_path / "v1", "A"), _text_pack(tmp_path / "v2", "B")
    memory.put(str(first), "/replaced/changing", recursive=True)
    try:
        ds = packdata.TFRecordDataset("memory://replaced/changing", decode="bytes", shuffle=False, cache_dir=tmp_path)
        it = iter(ds)
        read = [next(it)[0]]
        (shard,) = memory.glob("/replaced/changing/*.tfrecord")
        memory.pipe_file(shard, (second / PurePosixPath(shard).name).read_bytes())
        with pytest.raises(PackFormatError, match=r"^memory://.*\.tfrecord: was replaced \(re-uploaded\?\) while"):
            for data, _ in it:
                read.append(data)
        assert all(data.startswith(b"A") for data in read), read  # never the other pack's records
    finally:
        memory.rm("/replaced", recursive=True)


def test_a_reader_state_never_resumes_on_a_pack_uploaded_again_since(s3, tmp_path: Path, monkeypatch) -> None:
    """The pack converted over itself between a checkpoint and the restart (same counts, keys, labels): the resumed
    epoch took the new pack's records at the old pack's unread positions, mixing two packs, silently."""
    options, _ = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    url = "s3://packs/resumed"
    _convert_to_s3(tmp_path / "v1", "A", url, options)

    def opened() -> packdata.TFRecordDataset:
        return packdata.TFRecordDataset(url, decode="bytes", seed=3, storage_options=options, cache_dir=tmp_path)

    ds = opened()
    it = iter(ds)
    read = [next(it)[0] for _ in range(5)]
    state = json.loads(json.dumps(ds.state_dict()))  # as a checkpoint keeps it
    same = opened()
    same.load_state_dict(state)
    assert sorted(read + [data for data, _ in same]) == sorted(data for data, _ in opened())  # the same pack resumes
    _convert_to_s3(tmp_path / "v2", "B", url, options)
    with pytest.raises(ConfigError, match=r"the reader state was saved with pack='[0-9a-f]{16}', but this dataset"):
        opened().load_state_dict(state)
    del state["pack"]  # a state saved by packdata before it named its pack
    older = opened()
    older.load_state_dict(state)
    assert len(list(older)) == 12 - 5


def test_a_record_that_differs_from_the_index_is_named_by_its_url(s3, tmp_path: Path, monkeypatch) -> None:
    """A shard object overwritten by another pack's (same layout, other keys) before the first read: the error named
    the shard by the path it would have in the local cache copy, a file that does not exist."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    _convert_to_s3(tmp_path / "named", "A", "s3://packs/named", options)
    for c in ("u", "v"):  # keys of the same lengths as x/0.txt...
        (tmp_path / "other" / c).mkdir(parents=True)
        for i in range(6):
            (tmp_path / "other" / c / f"{i}.txt").write_text(f"B{c}{i}" * 100)
    packdata.convert(tmp_path / "other", "s3://packs/other", format="tfrecord", shard_samples=12,
                     storage_options=options, progress=False)  # fmt: skip
    (shard,) = fs.glob("packs/named/*.tfrecord")
    (table,) = fs.glob("packs/named/*.tfpayload")
    fs.rm_file(table)  # records are parsed, their keys matched with the index
    fs.pipe_file(shard, fs.cat_file(fs.glob("packs/other/*.tfrecord")[0]))
    ds = packdata.TFRecordDataset("s3://packs/named", decode="bytes", storage_options=options, cache_dir=tmp_path)
    with pytest.raises(PackFormatError) as raised:
        list(ds)
    assert str(raised.value).startswith(f"s3://{shard}: record 0 at byte offset 0 is damaged: it holds key"), raised


def test_a_pack_uploaded_again_after_the_dataset_opened_is_refused_at_its_first_read(
    s3, tmp_path: Path, monkeypatch
) -> None:
    options, _ = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    url = "s3://packs/before-read"
    _convert_to_s3(tmp_path / "v1", "A", url, options)
    ds = packdata.TFRecordDataset(url, decode="bytes", shuffle=False, storage_options=options, cache_dir=tmp_path)
    _convert_to_s3(tmp_path / "v2", "B", url, options)  # the manifest deleted, the shard replaced, a new manifest
    read = []
    with pytest.raises(PackFormatError, match=r"before-read-00000-of-00001\.tfrecord: was replaced \(re-uploaded"):
        for data, _ in ds:
            read.append(data)
    assert read == []
    table = ds._load_records(0, payloads=False)
    with pytest.raises(PackFormatError, match=r"tfrecord: was replaced"):  # a single read too
        ds._shard_reader(0).read(int(table.offsets[0]), int(table.lengths[0]))


def test_an_unchanged_remote_pack_costs_one_listing_and_no_request_per_chunk(
    s3, remote_shards, small_chunks, monkeypatch, tmp_path: Path
) -> None:
    options, fs = s3
    _, local, shards = remote_shards
    fs.put(str(local), "packs/pinned", recursive=True)  # a pack no other test has read in this process
    expected = [data for data, _ in packdata.TFRecordDataset(local, decode="bytes", shuffle=False)]
    calls: list[tuple[str, dict]] = []
    log = _logged(monkeypatch, fs, calls=calls)
    ds = packdata.TFRecordDataset(
        "s3://packs/pinned", decode="bytes", shuffle=False, storage_options=options, cache_dir=tmp_path
    )
    calls.clear()  # what opening the dataset asked for
    for epoch in (0, 1):
        log.clear()
        assert [data for data, _ in ds] == expected  # every record once, in order
        assert sorted(log) == [(name, 0) for name, _ in shards]  # one GET a shard, whatever its chunks
        heads = sorted(kwargs["Key"] for method, kwargs in calls if method == "head_object")
        manifests = [kwargs for method, kwargs in calls if method == "get_object" and kwargs["Key"].endswith(".json")]
        if epoch == 0:  # every shard pinned at the first read: their versions from one listing, the manifest again
            assert [key for key in heads if key.endswith(".tfrecord")] == []
            assert len(manifests) == 1 and [method for method, _ in calls].count("list_objects_v2") == 1
        else:  # pinned already: nothing but the chunks
            assert heads == [] and manifests == [] and "list_objects_v2" not in {method for method, _ in calls}
        gets = [kwargs for method, kwargs in calls if method == "get_object" and kwargs["Key"].endswith(".tfrecord")]
        assert len(gets) == len(log) and all(kwargs["IfMatch"] for kwargs in gets)  # every read from the version
        assert {method for method, _ in calls} <= {"head_object", "get_object", "list_objects_v2"}
        calls.clear()
