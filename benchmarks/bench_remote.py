"""Staging from object storage: ``packdata stage s3://...`` next to ``s3fs``'s ``fs.get(recursive=True)``.

Side by side in one run against a local S3 server (moto in server mode on
loopback, in its own process; needs ``pip install 'moto[server]' s3fs``)::

    python benchmarks/bench_remote.py [--mb 300] [--repeats 3]

Both download the same pack into fresh folders; packdata also checks every
shard's SHA-256 against the manifest. Repeats are interleaved; medians with
min-max are printed, with the local-disk copy (``shutil.copytree``) as the floor.
The ceiling rows read the same objects from the same server with plain boto3
GETs in 16 threads, bytes discarded: one GET an object, and 16 MiB ranges. The
server (moto reads a whole object for every ranged GET) may be the limit:
packdata's and s3fs's ratios to the ceiling say how much is left to the client.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _common import cpus_note

import packdata


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(port: int, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"the S3 server did not start on port {port}")


@contextlib.contextmanager
def s3_server() -> Iterator[tuple[dict[str, Any], Any]]:
    """A moto S3 server on loopback in its own process, dummy credentials: yields (storage_options, s3fs filesystem).

    Its own process: the server's Python does not share the benchmark's GIL.
    ``storage_options["client_kwargs"]["endpoint_url"]`` is the server's URL.
    """
    import s3fs

    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    port = _port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for(port)
        options = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
        yield options, s3fs.S3FileSystem(**options)
    finally:
        server.terminate()
        server.wait()


def _ceiling(options: dict[str, Any], bucket: str, prefix: str, part: int | None) -> None:
    """Every object under ``prefix`` read with plain boto3 GETs in 16 threads, bytes discarded.

    ``part``: None reads each object in one GET; else in ranges of ``part`` bytes.
    """
    from concurrent.futures import ThreadPoolExecutor

    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3", endpoint_url=options["client_kwargs"]["endpoint_url"], config=Config(max_pool_connections=16)
    )
    objects = client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
    reads = [
        (o["Key"], None if part is None else f"bytes={start}-{min(start + part, o['Size']) - 1}")
        for o in objects
        for start in ([0] if part is None else range(0, o["Size"], part))
    ]

    def read(item: tuple[str, str | None]) -> int:
        key, byte_range = item
        body = client.get_object(Bucket=bucket, Key=key, **({"Range": byte_range} if byte_range else {}))["Body"]
        got = 0
        while chunk := body.read(1 << 20):
            got += len(chunk)
        return got

    with ThreadPoolExecutor(16) as pool:
        sum(pool.map(read, reads))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=300, help="pack size in MB (text samples of 1 MB)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    try:
        with s3_server() as (options, fs):
            _run(args, options, fs, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, options: dict[str, Any], fs: Any, work: Path) -> None:
    src = work / "src" / "texts"
    src.mkdir(parents=True)
    block = os.urandom(1 << 19).hex().encode()[: 1 << 20]
    for i in range(args.mb):
        (src / f"{i:05d}.txt").write_bytes(block[i:] + block[:i])
    packdata.convert(work / "src", work / "train.lmdb", shard_size=64 * 10**6, progress=False)
    fs.mkdir("bench")
    fs.put(str(work / "train.lmdb"), "bench/train.lmdb", recursive=True)
    times: dict[str, list[float]] = {
        "packdata stage": [],
        "s3fs fs.get(recursive)": [],
        "ceiling: GET an object": [],
        "ceiling: 16 MiB ranges": [],
        "local copytree": [],
    }
    for n in range(args.repeats):
        start = time.perf_counter()
        packdata.stage("s3://bench/train.lmdb", to=work / f"p{n}", storage_options=options, progress=False)
        times["packdata stage"].append(time.perf_counter() - start)
        start = time.perf_counter()
        fs.get("bench/train.lmdb", str(work / f"g{n}"), recursive=True)
        times["s3fs fs.get(recursive)"].append(time.perf_counter() - start)
        start = time.perf_counter()
        _ceiling(options, "bench", "train.lmdb/", None)
        times["ceiling: GET an object"].append(time.perf_counter() - start)
        start = time.perf_counter()
        _ceiling(options, "bench", "train.lmdb/", 16 << 20)
        times["ceiling: 16 MiB ranges"].append(time.perf_counter() - start)
        start = time.perf_counter()
        shutil.copytree(work / "train.lmdb", work / f"c{n}")
        times["local copytree"].append(time.perf_counter() - start)
        for prefix in ("p", "g", "c"):
            shutil.rmtree(work / f"{prefix}{n}")
    size = sum(p.stat().st_size for p in (work / "train.lmdb").rglob("*") if p.is_file())
    reference = statistics.median(times["s3fs fs.get(recursive)"])
    ceiling = statistics.median(times["ceiling: GET an object"])
    print(f"pack of {size / 1e6:.0f} MB from a local moto S3 server, {cpus_note()}, {args.repeats} repeats")
    for name, values in times.items():
        median = statistics.median(values)
        print(
            f"  {name:<26} {median:6.2f} s [{min(values):.2f} - {max(values):.2f}]  {size / 1e6 / median:7.1f} MB/s"
            f"  {reference / median:5.2f}x s3fs  {ceiling / median:5.2f}x ceiling"
        )


if __name__ == "__main__":
    main()
