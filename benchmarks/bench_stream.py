"""Streaming from object storage: ``TFRecordDataset("s3://...")`` next to WebDataset over S3, and both from local disk.

Side by side in one run against one local S3 server (moto in server mode on
loopback, in its own process, from ``bench_remote.py``; needs ``pip install
'moto[server]' s3fs webdataset``)::

    python benchmarks/bench_stream.py [--images 3000] [--shard-samples 500] [--workers 0,2] [--repeats 3]

The same JPEGs (50-90 KB, ``bench_tfrecord.make_images``) are packed twice in
the same order and shard size: a packdata TFRecord pack, and WebDataset tar
shards (``KEY.jpg`` + ``KEY.cls``). Both are uploaded to the server and read
raw (no decode, no shuffle) through a ``DataLoader`` (batch 64, a collate that
keeps the bytes): packdata with ``decode="bytes"``; WebDataset with
``.to_tuple("jpg", "cls")`` over ``pipe:aws s3 cp --endpoint-url ... s3://... -``
(the way WebDataset's documentation reads S3; skipped without the AWS CLI) and
over an fsspec (s3fs) ``gopen`` handler registered for ``s3://``. The same
reads from the local pack and tars (warm page cache) are measured in the same
run, and rows that tell the reader from the server: packdata again with
requests of ``--big-chunk-mb`` (``RemoteShardReader.CHUNK``), packdata with a GET
per 8 MiB chunk as before the span GETs (``--per-chunk``), packdata with
each worker's set-up as before (``--per-worker-setup``: each worker decoding
botocore's S3 models itself, no :func:`~packdata.pack.s3_models.share_models`,
and looking each of its shards up and reading the manifest again to pin it,
no listing), and the
server alone (s3fs ``cat_file`` of the pack's shards, whole and in 8 MiB
ranges: moto reads the whole object for every ranged GET, which real object
stores do not). Every pass yields every sample once (checked). Each
configuration has an untimed warm-up pass; repeats are interleaved; medians
with min-max are printed as a markdown table.
"""

from __future__ import annotations

import argparse
import io
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from _common import cpus_note
from bench_remote import s3_server
from bench_tfrecord import make_images
from torch.utils.data import DataLoader

import packdata
from packdata.formats import remote_reads
from packdata.formats.remote_reads import SpanRequest
from packdata.formats.tfrecord_remote import RemoteShardReader
from packdata.pack import urls as pack_urls

BATCH = 64
TARGET = 1.5  # the target: packdata at least 1.5x WebDataset over S3
_DEFAULT_CHUNK = RemoteShardReader.CHUNK
_SPANS = SpanRequest.possible  # one GET per shard's run on S3 (the ``--per-chunk`` row turns it off)
_SHARE_MODELS = pack_urls.share_models  # forked workers reuse the S3 models (``--per-worker-setup``: not)
_LISTED = remote_reads._LISTED_SHARDS  # shards pinned from one listing (``--per-worker-setup``: none)
_S3_OPTIONS: dict[str, Any] = {}  # for the fsspec gopen handler (set before the loaders fork their workers)


def _keep(batch: list[Any]) -> list[Any]:
    """Collate that keeps the samples as they are (bytes stay bytes)."""
    return batch


def _gopen_s3(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> Any:
    """WebDataset's ``gopen`` handler for ``s3://`` through fsspec (s3fs), as a WebDataset user registers one."""
    import fsspec

    return fsspec.open(url, mode, **_S3_OPTIONS).open()


def write_tars(src: Path, out: Path, shard_samples: int) -> list[Path]:
    """WebDataset tar shards of the class folders under ``src``: sorted keys, ``shard_samples`` a shard."""
    classes = sorted(p.name for p in src.iterdir() if p.is_dir())
    files = [(f"{c}/{f.stem}", f, label) for label, c in enumerate(classes) for f in sorted((src / c).iterdir())]
    files.sort()
    out.mkdir(parents=True)
    tars = []
    for n, first in enumerate(range(0, len(files), shard_samples)):
        path = out / f"data-{n:06d}.tar"
        with tarfile.open(path, "w") as tar:
            for key, file, label in files[first : first + shard_samples]:
                for suffix, data in ((".jpg", file.read_bytes()), (".cls", str(label).encode())):
                    info = tarfile.TarInfo(key + suffix)
                    info.size, info.mtime = len(data), 0
                    tar.addfile(info, io.BytesIO(data))
        tars.append(path)
    return tars


def _one_pass(make: Callable[[], Iterable[list[Any]]], expected: int) -> tuple[float, int]:
    """Seconds and bytes of one full pass; every sample must come exactly once (counted)."""
    start = time.perf_counter()
    count = nbytes = 0
    for batch in make():
        for data, _ in batch:
            count += 1
            nbytes += len(data)
    elapsed = time.perf_counter() - start
    if count != expected:
        raise RuntimeError(f"a pass yielded {count} samples, expected {expected}")
    return elapsed, nbytes


def _loaders(
    args: argparse.Namespace, options: dict[str, Any], pack: Path, tars: list[Path], work: Path
) -> dict[tuple[str, str, int], Callable[[], Iterable[list[Any]]]]:
    """(source, reader, workers) -> a function making that pass's DataLoader."""
    import webdataset as wds

    wds.gopen_schemes["s3"] = _gopen_s3
    _S3_OPTIONS.update(options)
    endpoint = options["client_kwargs"]["endpoint_url"]

    def streamed(chunk: int, spans: bool = True, shared: bool = True) -> Callable[[], Any]:
        def make() -> Any:
            RemoteShardReader.CHUNK = chunk  # before the loader forks its workers
            SpanRequest.possible = staticmethod(_SPANS if spans else lambda fs: False)  # type: ignore[method-assign]
            pack_urls.share_models = _SHARE_MODELS if shared else lambda fs: None
            remote_reads._LISTED_SHARDS = _LISTED if shared else 0
            return packdata.TFRecordDataset(
                "s3://bench/pack", decode="bytes", shuffle=False, storage_options=options, cache_dir=work / "cache"
            )

        return make

    sources: dict[tuple[str, str], Callable[[], Any]] = {("S3", "packdata TFRecordDataset"): streamed(_DEFAULT_CHUNK)}
    if args.per_chunk:
        sources["S3", "packdata, a GET per 8 MiB chunk"] = streamed(_DEFAULT_CHUNK, spans=False)
    if args.per_worker_setup:
        sources["S3", "packdata, per-worker set-up as before"] = streamed(_DEFAULT_CHUNK, shared=False)
    if args.big_chunk_mb:
        sources["S3", f"packdata, {args.big_chunk_mb} MiB requests"] = streamed(args.big_chunk_mb << 20)
    if shutil.which("aws"):
        piped = [f"pipe:aws s3 cp --quiet --endpoint-url {endpoint} s3://bench/wds/{t.name} -" for t in tars]
        sources["S3", "WebDataset, pipe:aws s3 cp"] = lambda: wds.WebDataset(piped, shardshuffle=False).to_tuple(
            "jpg", "cls"
        )
    else:
        print("no `aws` on PATH: WebDataset's pipe:aws s3 cp is not measured", file=sys.stderr)
    urls = [f"s3://bench/wds/{t.name}" for t in tars]
    sources["S3", "WebDataset, fsspec gopen"] = lambda: wds.WebDataset(urls, shardshuffle=False).to_tuple("jpg", "cls")
    sources["local disk", "packdata TFRecordDataset"] = lambda: packdata.TFRecordDataset(
        pack, decode="bytes", shuffle=False
    )
    paths = [str(t) for t in tars]
    sources["local disk", "WebDataset, file paths"] = lambda: wds.WebDataset(paths, shardshuffle=False).to_tuple(
        "jpg", "cls"
    )

    def loader(dataset: Callable[[], Any], workers: int) -> Callable[[], Iterable[list[Any]]]:
        return lambda: DataLoader(dataset(), batch_size=BATCH, num_workers=workers, collate_fn=_keep)

    return {(src, name, w): loader(make, w) for (src, name), make in sources.items() for w in args.workers}


def _server_ceiling(fs: Any, shards: list[str], chunk: int) -> float:
    """Seconds to GET every shard one after another, whole objects (``chunk=0``) or in ``chunk``-byte ranges."""
    start = time.perf_counter()
    for path in shards:
        size = fs.info(path)["size"]
        steps = range(0, size, chunk) if chunk else [0]
        for first in steps:
            fs.cat_file(path, start=first, end=min(first + chunk, size) if chunk else None)
    return time.perf_counter() - start


def _cell(rates: list[float], mb: list[float]) -> str:
    return f"{statistics.median(rates):,.0f}/s [{min(rates):,.0f}-{max(rates):,.0f}], {statistics.median(mb):.0f} MB/s"


def _table(results: dict[tuple[str, str, int], list[tuple[float, int]]], images: int, workers: list[int]) -> str:
    rates = {k: [images / t for t, _ in v] for k, v in results.items()}
    mbs = {k: [b / t / 1e6 for t, b in v] for k, v in results.items()}
    lines = [
        "| reads from | reader | " + " | ".join(f"{w} workers" for w in workers) + " |",
        "|---|---|" + "---|" * len(workers),
    ]
    for source in ("S3", "local disk"):
        names = list(dict.fromkeys(name for s, name, _ in results if s == source))
        for name in names:
            cells = [_cell(rates[source, name, w], mbs[source, name, w]) for w in workers]
            lines.append(f"| {source} | {name} | " + " | ".join(cells) + " |")
        ratios = []
        for w in workers:
            ours = statistics.median(rates[source, "packdata TFRecordDataset", w])
            theirs = max(statistics.median(rates[source, n, w]) for n in names if n.startswith("WebDataset"))
            ratio = ours / theirs
            verdict = f" (>= {TARGET}x: {'met' if ratio >= TARGET else '**missed**'})" if source == "S3" else ""
            ratios.append(f"**{ratio:.2f}x**{verdict}")
        lines.append(f"| {source} | packdata / fastest WebDataset | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=3000, help="JPEGs of 50-90 KB")
    parser.add_argument("--shard-samples", type=int, default=500, help="samples per shard (pack and tars alike)")
    parser.add_argument("--workers", type=lambda s: [int(w) for w in s.split(",")], default=[0, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--big-chunk-mb", type=int, default=64, help="also stream with requests this large (0: not)")
    parser.add_argument(
        "--per-chunk", action="store_true", help="also stream with a GET per chunk, no span GET (packdata before)"
    )
    parser.add_argument(
        "--per-worker-setup",
        action="store_true",
        help="also stream with each worker decoding the S3 models and pinning shard by shard (packdata before)",
    )
    parser.add_argument("--data", type=Path, help="keep the generated images here (reused when present)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    images = args.data / "images" if args.data else work / "images"
    try:
        if not images.is_dir():
            make_images(images, args.images)
        count = sum(1 for _ in images.rglob("*.jpg"))
        pack = work / "pack"
        packdata.convert(images, pack, format="tfrecord", shard_samples=args.shard_samples, progress=False)
        tars = write_tars(images, work / "wds", args.shard_samples)
        with s3_server() as (options, fs):
            fs.mkdir("bench")
            fs.put(str(pack), "bench/pack", recursive=True)
            fs.put(str(work / "wds"), "bench/wds", recursive=True)
            configs = _loaders(args, options, pack, tars, work)
            for make in configs.values():  # warm-up: page cache, the server's first reads, the pack's local copy
                _one_pass(make, count)
            results: dict[tuple[str, str, int], list[tuple[float, int]]] = {k: [] for k in configs}
            shards = [f"bench/pack/{p.name}" for p in sorted(pack.glob("*.tfrecord"))]
            ceiling: dict[int, list[float]] = {0: [], _DEFAULT_CHUNK: []}
            for _ in range(args.repeats):
                for key, make in configs.items():
                    results[key].append(_one_pass(make, count))
                for chunk in ceiling:
                    ceiling[chunk].append(_server_ceiling(fs, shards, chunk))
        size = sum(p.stat().st_size for p in pack.glob("*.tfrecord"))
        print(
            f"{count} JPEGs ({size / 1e6:.0f} MB) in {len(tars)} shards, a local moto S3 server in its own process, "
            f"{cpus_note()}, batch {BATCH}, raw bytes, no shuffle, {args.repeats} interleaved repeats "
            "(median [min-max] samples/s):\n"
        )
        print(_table(results, count, args.workers))
        whole, ranged = (size / 1e6 / statistics.median(ceiling[c]) for c in (0, _DEFAULT_CHUNK))
        print(
            f"\nThe server alone, one connection (s3fs cat_file of the pack's shards one after another): "
            f"whole objects {whole:.0f} MB/s, {_DEFAULT_CHUNK >> 20} MiB ranges {ranged:.0f} MB/s."
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
