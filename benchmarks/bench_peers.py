"""packdata next to its peers: the same files packed and read back by WebDataset, Streaming, LitData, tfrecord, py-lmdb.

One run, side by side, on generated text files (4.6 KB mean) and JPEGs (about
90 KB mean), in the bench environment (``pip install -e '.[bench]'``, then
``pip uninstall -y torchvision``; see the README)::

    python benchmarks/bench_peers.py [--text 50000] [--images 12000] [--repeats 3] [--skip-cold] [--only lmdb,wds]
        [--batches 40] [--text-batches 300]

Writers, each timed to its ``os.sync()`` and given as a ratio to ``tar -cf`` +
sync of the same files (source page cache dropped first, unless --skip-cold):
packdata ``convert`` (LMDB and TFRecord), WebDataset ``ShardWriter``, Streaming
``MDSWriter``, LitData ``optimize``, the ``tfrecord`` package's
``TFRecordWriter`` (+ its index) and a naive py-lmdb writer; shards of 64 MiB.
Each writes in a fresh process; packdata's with ``keep_freed_memory()`` first,
as its CLI (``packdata convert``) runs.

Readers, each in a fresh process, each in its own shuffled training mode:
raw warm (``DataLoader``, batch 64, 0 workers, after one untimed epoch), raw
cold (page cache dropped, a full epoch; also split into the wait for its first
batch, start-up included, and the rate after it; its payload bytes/s read against
``dd`` of packdata's LMDB shards, cold, the disk's sequential rate), decoded with 2 workers (PIL decode +
random resized crop 224 + flip for images, UTF-8 decode to a byte tensor for
text) against the in-memory decode ceiling (the same decode on bytes already in
memory), and the peak PSS of the loader process and its workers during the
decoded run. Every reader's first epoch, with 0 and with 2 workers, is checked
to return every sample exactly once with the source's bytes (sorted content
digests compared); every timed epoch is checked by count and total bytes.

Repeats are interleaved; medians with min-max are printed as markdown tables.
A peer that fails to install or run shows as ``n/a (reason)``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb
import torch
from _common import NaiveLMDB, cpus_note, drop_caches, import_streaming, in_fresh_process, make_images, make_texts
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset, IterableDataset

import packdata
from packdata.formats.lmdb_env import encode_key
from packdata.host.allocator import keep_freed_memory
from packdata.host.cores import usable_cpus
from packdata.measure.memory import _MemorySampler
from packdata.reading.decode import decode_pil
from packdata.reading.transforms import standard_transform

SHARD = 64 << 20
BATCH = 64
DECODED_SPARE = 4
"""Batches of an epoch beyond the decoded run's timed ones: its 3 warm-up batches, and one lost to partial batches."""
TIMEOUT = 300  # seconds a worker may take for one batch before the reader counts as failed

WRITERS = {  # id -> what the table calls it
    "tar": "`tar -cf` (reference)",
    "lmdb": "packdata `convert` (LMDB)",
    "pd-tfrecord": "packdata `convert` (TFRecord)",
    "wds": "WebDataset `ShardWriter`",
    "mds": "Streaming `MDSWriter`",
    "litdata": "LitData `optimize`",
    "tfrecord": "`tfrecord` `TFRecordWriter` + index",
    "naive-lmdb": "naive py-lmdb (`txn.put`)",
}
READERS = {  # id -> (what the table calls it, the writer whose output it reads)
    "folder": ("folder (one file per sample)", None),
    "lmdb": ("packdata `LMDBDataset`", "lmdb"),
    "lmdb-block": ("packdata `LMDBDataset` + `BlockShuffleSampler`", "lmdb"),
    "lmdb-crop": ("packdata `LMDBDataset` + `DecodeCrop` (decoded only; images)", "lmdb"),
    "pd-tfrecord": ("packdata `TFRecordDataset`", "pd-tfrecord"),
    "wds": ("WebDataset `WebDataset`", "wds"),
    "mds": ("Streaming `StreamingDataset`", "mds"),
    "litdata": ("LitData `StreamingDataset`", "litdata"),
    "tfrecord": ("`tfrecord` `TFRecordDataset`", "tfrecord"),
    "naive-lmdb": ("naive py-lmdb (txn per sample)", "naive-lmdb"),
}
CEILING = "ceiling"


@dataclass(frozen=True)
class Data:
    """One generated dataset: its source folder, where packs go, and what every reader must return."""

    kind: str  # "text" or "images"
    src: Path
    out: Path
    files: tuple[tuple[str, int], ...]  # (path relative to src, label), sorted
    digests: bytes  # sorted 8-byte BLAKE2b digests of every file's bytes
    total_bytes: int

    @property
    def ext(self) -> str:
        return "txt" if self.kind == "text" else "jpg"


def _digest(payload: Any) -> bytes:
    return hashlib.blake2b(payload, digest_size=8).digest()


def _sources(data: Data) -> Iterator[tuple[str, int, bytes]]:
    """Every sample as (key, label, bytes), read from the source files in sorted order (what each writer gets)."""
    for key, label in data.files:
        yield key, label, (data.src / key).read_bytes()


# ----------------------------------------------------------------------------- data


def _generate(kind: str, count: int, root: Path) -> Data:
    src = root / f"{kind}-{count}"
    if not (src / ".complete").exists():
        shutil.rmtree(src, ignore_errors=True)
        print(f"generating {count} {kind} files into {src} ...", file=sys.stderr)
        if kind == "text":
            make_texts(src, count, sizes=(1000, 8200), classes=10)  # 4.6 KB mean
        else:
            parts = usable_cpus()
            with ProcessPoolExecutor(parts) as pool:
                jobs = [pool.submit(make_images, src, count, sides=(320, 420), part=(k, parts)) for k in range(parts)]
                for job in jobs:
                    job.result()
        (src / ".complete").touch()
    classes = sorted(p.name for p in src.iterdir() if p.is_dir())
    files = tuple(
        (f"{c}/{p.name}", label) for label, c in enumerate(classes) for p in sorted((src / c).iterdir()) if p.is_file()
    )
    digests, total = [], 0
    for key, _ in files:
        blob = (src / key).read_bytes()
        digests.append(_digest(blob))
        total += len(blob)
    out = root / f"{kind}-{count}-packs"
    out.mkdir(exist_ok=True)
    return Data(kind, src, out, files, b"".join(sorted(digests)), total)


# ----------------------------------------------------------------------------- writers


def write_tar(data: Data, out: Path) -> None:
    subprocess.run(["tar", "-cf", str(out), "-C", str(data.src), "."], check=True)


def write_lmdb(data: Data, out: Path) -> None:
    keep_freed_memory()  # as `packdata convert` does (this process writes, then ends)
    packdata.convert(data.src, out, shard_size=SHARD, progress=False)


def write_pd_tfrecord(data: Data, out: Path) -> None:
    keep_freed_memory()
    packdata.convert(data.src, out, format="tfrecord", shard_size=SHARD, progress=False)


def write_wds(data: Data, out: Path) -> None:
    import webdataset as wds

    out.mkdir()
    with wds.ShardWriter(str(out / "data-%06d.tar"), maxsize=SHARD, maxcount=10**9, verbose=0) as sink:
        for key, label, blob in _sources(data):  # a key holds no dot: WebDataset splits the name at the first
            sink.write({"__key__": key.replace("/", "_").split(".")[0], data.ext: blob, "cls": label})


def write_mds(data: Data, out: Path) -> None:
    columns = {"key": "str", "data": "bytes", "label": "int"}
    with import_streaming().MDSWriter(out=str(out), columns=columns, size_limit=SHARD) as sink:
        for key, label, blob in _sources(data):
            sink.write({"key": key, "data": blob, "label": label})


def _litdata_sample(item: tuple[str, str, int]) -> dict[str, Any]:
    path, key, label = item
    with open(path, "rb") as f:
        return {"key": key, "data": f.read(), "label": label}


def write_litdata(data: Data, out: Path) -> None:
    import litdata

    inputs = [(str(data.src / key), key, label) for key, label in data.files]
    litdata.optimize(
        fn=_litdata_sample,
        inputs=inputs,
        output_dir=str(out),
        chunk_bytes=SHARD,
        num_workers=usable_cpus(),
        verbose=False,
    )


def write_tfrecord(data: Data, out: Path) -> None:
    from tfrecord import TFRecordWriter
    from tfrecord.tools.tfrecord2idx import create_index

    out.mkdir()
    writer = TFRecordWriter(str(out / "data.tfrecord"))
    for key, label, blob in _sources(data):
        writer.write({"key": (key.encode(), "byte"), "data": (blob, "byte"), "label": (label, "int")})
    writer.close()
    create_index(str(out / "data.tfrecord"), str(out / "data.index"))


def write_naive_lmdb(data: Data, out: Path) -> None:
    env = lmdb.open(str(out), map_size=2 * data.total_bytes + (64 << 20))
    txn = env.begin(write=True)
    for i, (_, _, blob) in enumerate(_sources(data)):
        txn.put(encode_key(i), blob)
        if i % 1000 == 999:
            txn.commit()
            txn = env.begin(write=True)
    txn.commit()
    env.close()


def _import_writer(writer: str) -> None:
    """Import what ``writer`` needs, so that the timed write does not count the imports."""
    if writer in ("lmdb", "pd-tfrecord"):
        import packdata.conversion.convert
        import packdata.conversion.local  # noqa: F401
    elif writer == "wds":
        import webdataset  # noqa: F401
    elif writer == "mds":
        import_streaming()
    elif writer == "litdata":
        import litdata  # noqa: F401
    elif writer == "tfrecord":
        import tfrecord.tools.tfrecord2idx  # noqa: F401


WRITE = {
    "tar": write_tar,
    "lmdb": write_lmdb,
    "pd-tfrecord": write_pd_tfrecord,
    "wds": write_wds,
    "mds": write_mds,
    "litdata": write_litdata,
    "tfrecord": write_tfrecord,
    "naive-lmdb": write_naive_lmdb,
}


def _out(data: Data, writer: str) -> Path:
    return data.out / (f"{writer}.tar" if writer == "tar" else writer)


def timed_write(data: Data, writer: str, cold: bool) -> float:
    """Seconds ``writer`` takes to pack ``data`` and sync, from a cold source when ``cold``."""
    _import_writer(writer)
    out = _out(data, writer)
    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()
    if cold:
        drop_caches()
    else:
        os.sync()
    start = time.perf_counter()
    WRITE[writer](data, out)
    os.sync()
    return time.perf_counter() - start


# ----------------------------------------------------------------------------- readers


class FolderBytes(Dataset):
    """The folder as most training code reads it: one ``open`` + ``read`` per sample, ``(bytes, label)``."""

    def __init__(self, root: Path, files: tuple[tuple[str, int], ...]) -> None:
        self.paths = [os.path.join(root, key) for key, _ in files]
        self.labels = [label for _, label in files]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[bytes, int]:
        with open(self.paths[i], "rb") as f:
            return f.read(), self.labels[i]


class MemoryBytes(Dataset):
    """The decode ceiling's source: up to 1,024 samples held in memory, ``ds[i]`` is blob ``i % 1024``.

    A list of every blob would make forked workers copy pages on access and measure that instead.
    """

    def __init__(self, data: Data) -> None:
        self.blobs = [blob for _, (_, _, blob) in zip(range(1024), _sources(data), strict=False)]
        self.n = len(data.files)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> bytes:
        return self.blobs[i % len(self.blobs)]


class MapDataset(Dataset):
    """``fn`` applied to each item of a map-style dataset (in the worker)."""

    def __init__(self, inner: Any, fn: Callable[[Any], Any]) -> None:
        self.inner, self.fn = inner, fn

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> Any:
        return self.fn(self.inner[i])


class MapIterable(IterableDataset):
    """``fn`` applied to each item of an iterable dataset (in the worker)."""

    def __init__(self, inner: Any, fn: Callable[[Any], Any]) -> None:
        self.inner, self.fn = inner, fn

    def __iter__(self) -> Iterator[Any]:
        return map(self.fn, iter(self.inner))


def _first(item: Any) -> Any:
    return item[0]


def _field(item: dict[str, Any]) -> Any:
    return item["data"]


def _same(item: Any) -> Any:
    return item


def _then(extract: Callable[[Any], Any], fn: Callable[[Any], Any], item: Any) -> Any:
    return fn(extract(item))


_TRANSFORM = standard_transform(224)
_CROP = packdata.DecodeCrop(224, output="tensor")  # the crop drawn from the header, only its region decoded
_FLIP = standard_transform(224, crop=False)


def decode_image(payload: Any) -> torch.Tensor:
    """PIL decode + random resized crop 224 + flip, as a CHW uint8 tensor."""
    return _TRANSFORM(decode_pil(payload if isinstance(payload, bytes) else bytes(payload)))


def decode_crop(payload: Any) -> torch.Tensor:
    """``DecodeCrop(224)`` (the same boxes as the random resized crop) + flip, as a CHW uint8 tensor."""
    return _FLIP(_CROP(payload))


def decode_text(payload: Any) -> torch.Tensor:
    """UTF-8 decode, then the text's bytes as a uint8 tensor (byte-level tokens)."""
    return torch.frombuffer(bytearray(bytes(payload).decode("utf-8").encode("utf-8")), dtype=torch.uint8)


def _stack(batch: list[Any]) -> torch.Tensor:
    return torch.stack([x[0] if isinstance(x, tuple) else x for x in batch])


def _pad(batch: list[Any]) -> torch.Tensor:
    return pad_sequence([x[0] if isinstance(x, tuple) else x for x in batch], batch_first=True)


def _loader(reader: str, data: Data, workers: int, decode: Callable[[Any], Any] | None) -> tuple[Any, Callable]:
    """A DataLoader over ``reader``'s own output, and the function that finds the payload in a raw item.

    With ``decode``, items are decoded in the workers (each library's own hook where it has one).
    """
    out = data.out / (READERS.get(reader, ("", None))[1] or "")
    kwargs: dict[str, Any] = {"batch_size": BATCH, "num_workers": workers}
    if workers:  # fork, Linux's default: this process was spawned, and spawn would be its default
        kwargs.update(timeout=TIMEOUT, multiprocessing_context="fork")
    if decode is None:
        kwargs["collate_fn"] = list
    else:
        kwargs["collate_fn"] = _stack if data.kind == "images" else _pad
    if reader in ("folder", "naive-lmdb", CEILING):
        if reader == "folder":
            ds: Any = FolderBytes(data.src, data.files)
            extract: Callable = _first
        elif reader == "naive-lmdb":
            ds, extract = NaiveLMDB(str(out), len(data.files)), _same
        else:
            ds, extract = MemoryBytes(data), _same
        if decode is not None:
            ds = MapDataset(ds, functools.partial(_then, extract, decode))
        return DataLoader(ds, shuffle=True, **kwargs), extract
    if reader in ("lmdb", "lmdb-block", "lmdb-crop"):
        ds = packdata.LMDBDataset(out, decode=decode or "bytes")
        if reader != "lmdb-block":
            return DataLoader(ds, shuffle=True, **kwargs), _first
        return DataLoader(ds, sampler=packdata.BlockShuffleSampler(ds, seed=0), **kwargs), _first
    if reader == "pd-tfrecord":
        return DataLoader(packdata.TFRecordDataset(out, decode=decode or "bytes", shuffle=True), **kwargs), _first
    if reader == "wds":
        import webdataset as wds

        urls = sorted(str(p) for p in out.glob("*.tar"))
        ds = wds.WebDataset(urls, shardshuffle=100, empty_check=False, seed=0).shuffle(1000).to_tuple(data.ext, "cls")
        if decode is not None:
            ds = ds.map_tuple(decode, None)
        return DataLoader(ds, **kwargs), _first
    if reader == "mds":
        ds = import_streaming().StreamingDataset(local=str(out), shuffle=True, batch_size=BATCH)
        if decode is not None:
            ds = MapIterable(ds, functools.partial(_then, _field, decode))
        return DataLoader(ds, **kwargs), _field
    if reader == "litdata":
        import litdata

        # its bytes come as memoryviews, which cannot travel from a worker: copied there
        transform = functools.partial(_then, _field, decode or bytes) if decode or workers else None
        ds = litdata.StreamingDataset(str(out), shuffle=True, transform=transform)
        return litdata.StreamingDataLoader(ds, **kwargs), (_same if transform else _field)
    if reader == "tfrecord":
        from tfrecord.torch.dataset import TFRecordDataset

        transform = functools.partial(_then, _field, decode) if decode else None
        ds = TFRecordDataset(
            str(out / "data.tfrecord"),
            str(out / "data.index"),
            description={"data": "byte", "label": "int"},
            shuffle_queue_size=1024,
            transform=transform,
        )
        return DataLoader(ds, **kwargs), (_same if transform else _field)
    raise ValueError(f"unknown reader {reader!r}")


def _epoch(reader: str, data: Data, workers: int, check: bool) -> tuple[float, float, float]:
    """One raw epoch: samples/s, seconds to the first batch, samples/s after it.

    Raises unless every sample came once (``check``: by content, else by count and bytes).
    """
    loader, extract = _loader(reader, data, workers, None)
    digests: list[bytes] = []
    count = nbytes = 0
    start = time.perf_counter()
    first = 0.0
    for batch in loader:
        if not first:
            first, first_count = time.perf_counter() - start, len(batch)
        for item in batch:
            payload = extract(item)
            count += 1
            nbytes += len(payload)
            if check:
                digests.append(_digest(payload))
    elapsed = time.perf_counter() - start
    if count != len(data.files) or nbytes != data.total_bytes:
        raise RuntimeError(
            f"{reader} returned {count} samples of {nbytes} bytes, expected {len(data.files)} of {data.total_bytes}"
        )
    if check and b"".join(sorted(digests)) != data.digests:
        raise RuntimeError(f"{reader} did not return every sample's bytes exactly once (workers={workers})")
    return count / elapsed, first, (count - first_count) / (elapsed - first)


def _decoded(reader: str, data: Data, batches: int) -> tuple[float, int]:
    """Decoded samples/s with 2 workers over ``batches`` batches after 3 warm-up batches, and the peak PSS."""
    decode = decode_text if data.kind == "text" else decode_crop if reader == "lmdb-crop" else decode_image
    loader, _ = _loader(reader, data, 2, decode)
    with _MemorySampler(interval=0.1) as sampler:
        it = iter(loader)
        for _ in range(3):
            next(it)
        start = time.perf_counter()
        count = sum(len(next(it)) for _ in range(batches))
        elapsed = time.perf_counter() - start
        sampler.sample()
    del it
    if count != batches * BATCH:
        raise RuntimeError(f"{reader}: {count} decoded samples in {batches} batches of {BATCH}")
    return count / elapsed, sampler.summary()["total"]["pss_peak"]


def _failure(exc: BaseException) -> str:
    line = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return line[:90]


def run_warm(reader: str, data: Data, check: bool, batches: int) -> dict[str, Any]:
    """In a fresh process: raw warm reads after one untimed epoch (checked by content when ``check``), then decoded."""
    result: dict[str, Any] = {}
    try:
        if reader not in (CEILING, "lmdb-crop"):  # lmdb-crop's raw reads are lmdb's
            _epoch(reader, data, 0, check)  # warms the page cache too
            if check:
                _epoch(reader, data, 2, True)
            result["warm"] = _epoch(reader, data, 0, False)[0]
        result["decoded"], result["pss"] = _decoded(reader, data, batches)
    except Exception as exc:
        traceback.print_exc()
        result["error"] = _failure(exc)
    return result


def run_cold(reader: str, data: Data) -> dict[str, Any]:
    """In a fresh process, page cache dropped: one raw epoch, 0 workers.

    A ``DataLoader`` runs first over a few ints, so the code it runs on every reader's first batch
    (torch's first tensor ops: 30-40 ms when their pages are read from disk) is mapped and stays
    when the cache is dropped, as in a training job, whose first epoch does not load torch cold.
    """
    try:
        for _ in DataLoader(range(2 * BATCH), batch_size=BATCH):
            pass
        drop_caches()
        rate, first, after = _epoch(reader, data, 0, False)
        return {"cold": rate, "cold_first_ms": 1e3 * first, "cold_after": after}
    except Exception as exc:
        traceback.print_exc()
        return {"error": _failure(exc)}


def run_dd(data: Data) -> float:
    """The disk's cold sequential rate, bytes/s: ``dd`` (1 MiB blocks) of packdata's LMDB shards, page cache dropped.

    The ceiling of a cold epoch: a reader's cold rate times the mean sample size is read against it.
    """
    files = sorted((data.out / "lmdb").glob("shard-*/data.mdb"))
    drop_caches()
    start = time.perf_counter()
    for file in files:
        subprocess.run(["dd", f"if={file}", "of=/dev/null", "bs=1M", "status=none"], check=True)
    return sum(f.stat().st_size for f in files) / (time.perf_counter() - start)


# ----------------------------------------------------------------------------- table


def _cell(values: list[float], fmt: str = "{:,.0f}") -> str:
    if not values:
        return ""
    median = statistics.median(values)
    if len(values) == 1:
        return fmt.format(median)
    return f"{fmt.format(median)} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def _ratio(values: list[float], reference: list[float]) -> str:
    if not values or not reference:
        return ""
    return f"{statistics.median(values) / statistics.median(reference):.2f}x"


def table(
    data: Data,
    writes: dict[str, list[float]],
    reads: dict[str, dict[str, list[float]]],
    errors: dict[str, str],
    dd: list[float],
) -> str:
    mib = data.total_bytes / len(data.files) / 1024
    mean = data.total_bytes / len(data.files)
    lines = [
        f"{data.kind}: {len(data.files):,} files of {mib:,.1f} KiB mean ({data.total_bytes / 2**20:,.0f} MiB)",
        "",
        "| reader (writer) | convert + sync, s | vs tar | raw warm, /s | raw cold, /s | cold vs `dd` "
        "| cold: first batch, ms | cold: after it, /s | decoded, 2 workers, /s | vs ceiling | peak PSS, MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    tar = writes.get("tar", [])
    ceiling = reads.get(CEILING, {}).get("decoded", [])
    for reader, (name, writer) in [*READERS.items(), (CEILING, ("in-memory decode ceiling", None))]:
        if reader not in reads and reader not in errors:
            continue
        r = reads.get(reader, {})
        convert = ratio = ""
        if writer is not None and reader not in ("lmdb-block", "lmdb-crop"):
            convert = errors.get(f"write {writer}") or _cell(writes.get(writer, []), "{:.1f}")
            ratio = _ratio(writes.get(writer, []), tar)
        elif reader in ("lmdb-block", "lmdb-crop"):
            convert = "(same pack)"
        error = errors.get(reader)
        if error:
            lines.append(f"| {name} | {convert} | {ratio} | n/a ({error}) | | | | | | | |")
            continue
        pss = [v / 2**20 for v in r.get("pss", [])]
        cold = r.get("cold", [])
        lines.append(
            f"| {name} | {convert} | {ratio} | {_cell(r.get('warm', []))} | {_cell(cold)} "
            f"| {_ratio([v * mean for v in cold], dd)} | {_cell(r.get('cold_first_ms', []))} "
            f"| {_cell(r.get('cold_after', []))} "
            f"| {_cell(r.get('decoded', []))} | {_ratio(r.get('decoded', []), ceiling)} | {_cell(pss)} |"
        )
    if tar:
        lines.append(f"| {WRITERS['tar']} | {_cell(tar, '{:.1f}')} | 1.00x | | | | | | | | |")
    if dd:
        rate = _cell([v / 1e6 for v in dd], "{:,.0f} MB/s")
        lines.append(f"| `dd` of packdata's LMDB shards, cold (reference) | | | | {rate} | 1.00x | | | | | |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def bench(data: Data, readers: list[str], args: argparse.Namespace, cold: bool) -> str:
    writers = ["tar", *dict.fromkeys(w for r in readers if (w := READERS[r][1]) is not None)]
    writes: dict[str, list[float]] = {w: [] for w in writers}
    reads: dict[str, dict[str, list[float]]] = {r: {} for r in [*readers, CEILING]}
    errors: dict[str, str] = {}
    dd: list[float] = []
    for repeat in range(args.repeats):
        for writer in writers:
            if f"write {writer}" in errors:
                continue
            try:
                writes[writer].append(in_fresh_process(timed_write, data, writer, cold))
                print(f"{data.kind} #{repeat}: {writer} wrote in {writes[writer][-1]:.1f} s", file=sys.stderr)
            except Exception as exc:
                traceback.print_exc()
                errors[f"write {writer}"] = f"n/a ({_failure(exc)})"
                for reader in readers:
                    if READERS[reader][1] == writer:
                        errors.setdefault(reader, f"its writer failed: {_failure(exc)}")
        if cold and "lmdb" in writers and "write lmdb" not in errors:
            dd.append(run_dd(data))
        for reader in [*readers, CEILING]:
            if reader in errors:
                continue
            results = {}
            if cold and reader not in (CEILING, "lmdb-crop"):
                results.update(in_fresh_process(run_cold, reader, data))
            if "error" not in results:
                batches = args.batches if data.kind == "images" else args.text_batches
                results.update(in_fresh_process(run_warm, reader, data, repeat == 0, batches))
            if "error" in results:
                errors[reader] = results["error"]
                continue
            for key, value in results.items():
                reads[reader].setdefault(key, []).append(value)
            shown = ", ".join(f"{k} {v:,.0f}" for k, v in results.items() if k != "pss")
            print(f"{data.kind} #{repeat}: {reader}: {shown}", file=sys.stderr)
    return table(data, writes, reads, errors, dd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", type=int, default=50_000, help="text files (0: none)")
    parser.add_argument("--images", type=int, default=12_000, help="JPEG files (0: none)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, default=40, help="decoded image batches timed per reader")
    parser.add_argument(
        "--text-batches", type=int, default=300, help="decoded text batches timed per reader (a text batch is ~2 ms)"
    )
    parser.add_argument("--skip-cold", action="store_true", help="no cold reads, warm source for converts")
    parser.add_argument("--only", default="", help=f"readers, comma-separated, from {','.join(READERS)}")
    parser.add_argument("--data", type=Path, default=Path("/tmp/peers-data"))
    args = parser.parse_args()
    readers = [r.strip() for r in args.only.split(",") if r.strip()] or list(READERS)
    unknown = sorted(set(readers) - set(READERS))
    if unknown:
        parser.error(f"--only: unknown reader(s) {', '.join(unknown)}; choose from {', '.join(READERS)}")
    for name, count, batches in (("text", args.text, args.text_batches), ("images", args.images, args.batches)):
        need = (batches + DECODED_SPARE) * BATCH  # one epoch must hold the warm-up and the timed batches
        if 0 < count < need:
            flag = "--text-batches" if name == "text" else "--batches"
            parser.error(
                f"--{name} {count}: the decoded run needs {need} ({batches} timed batches of {BATCH} "
                f"and {DECODED_SPARE} more); give more, or lower {flag}"
            )
    cold = not args.skip_cold and drop_caches()
    if not args.skip_cold and not cold:
        print("cannot drop the page cache (not root?): no cold reads, converts read a warm source", file=sys.stderr)
    args.data.mkdir(parents=True, exist_ok=True)
    cpus = cpus_note()
    command = " ".join(["python benchmarks/bench_peers.py", *sys.argv[1:]])
    tables = []
    for kind, count in (("text", args.text), ("images", args.images)):
        if count:
            data = _generate(kind, count, args.data)
            kept = [r for r in readers if kind == "images" or r != "lmdb-crop"]  # DecodeCrop decodes images
            tables.append(bench(data, kept, args, cold))
            print(tables[-1] + "\n", file=sys.stderr)
    print(f"`{command}`: {cpus}, {args.repeats} interleaved repeats, medians [min-max]")
    print(f"cold: {'page cache dropped' if cold else 'skipped'}; batch {BATCH}; shards of {SHARD >> 20} MiB\n")
    print("\n\n".join(tables))


if __name__ == "__main__":
    main()
