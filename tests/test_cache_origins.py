"""A staged copy's origin (in its staged.json, which anyone who can write the cache can plant) is contacted only
in the store of the pack being staged."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import packdata
from packdata.pack.manifest import read_manifest
from packdata.staging.marker import STAGED_FILE


def test_eviction_never_contacts_an_origin_a_planted_staged_json_names_in_another_store(
    remote_pack, tmp_path: Path
) -> None:
    """Eviction looked for every copy's origin with fs.exists, the stage's storage_options and all: a folder
    planted in the cache whose staged.json named http://HOST/... had packdata send a request there."""
    import fsspec

    asked: list[str] = []

    class _Recorder(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            asked.append(f"{self.command} {self.path}")
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(b"{}")

        do_GET = do_HEAD = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _, local = remote_pack
    memory = fsspec.filesystem("memory")
    memory.put(str(local), "/h-cache/train", recursive=True)
    memory.put(str(local), "/h-cache/second", recursive=True)
    cache = tmp_path / "cache"
    try:
        first = packdata.stage("memory://h-cache/train", to=cache, progress=False).staged
        size = sum(p.stat().st_size for p in first.rglob("*") if p.is_file())
        marker = json.loads((first / STAGED_FILE).read_text())
        planted = f"http://127.0.0.1:{server.server_address[1]}/planted/train"
        (first / STAGED_FILE).write_text(json.dumps({**marker, "origin": planted}))
        error = None
        try:
            packdata.stage("memory://h-cache/second", to=cache, progress=False, cache_limit=int(1.5 * size))
        except packdata.CapacityError as exc:
            error = str(exc)
        assert asked == []
        assert error is not None and re.fullmatch(  # the planted copy is kept, not evicted, and said so
            rf"{re.escape(str(cache))}: the cache limit of [\d,]+ bytes cannot hold the pack \([\d,]+ bytes\) beside "
            r"the staged copies kept: 1 whose origin is in another store than the pack staged, or may be: staged with "
            r"storage_options for another endpoint \(never looked up\); "
            r"[\d,]+ bytes in all\. Raise cache_limit=SIZE, stop the readers of older copies, or unstage them",
            error,
        ), error
        assert (first / STAGED_FILE).is_file()
    finally:
        server.shutdown()
        server.server_close()
        memory.rm("/h-cache", recursive=True)


def test_the_cache_limit_error_says_why_each_copy_was_kept(remote_pack, tmp_path: Path) -> None:
    """The error said every copy kept was 'in use by live readers or other stages, of local packs, or whose origin
    is gone', also a copy whose origin is in another store (never looked up, so not known to be gone)."""
    import fsspec

    _, local = remote_pack
    memory = fsspec.filesystem("memory")
    for name in ("train", "other", "second"):
        memory.put(str(local), f"/h-kept/{name}", recursive=True)
    cache = tmp_path / "cache"
    try:
        first = packdata.stage("memory://h-kept/train", to=cache, progress=False).staged
        other = packdata.stage("memory://h-kept/other", to=cache, progress=False).staged
        marker = json.loads((other / STAGED_FILE).read_text())
        (other / STAGED_FILE).write_text(json.dumps({**marker, "origin": "s3://elsewhere/other"}))
        memory.rm("/h-kept/train", recursive=True)  # its origin gone: the staged copy is the last one
        size = sum(p.stat().st_size for p in first.rglob("*") if p.is_file())
        limit = int(1.5 * size)
        with pytest.raises(packdata.CapacityError) as caught:
            packdata.stage("memory://h-kept/second", to=cache, progress=False, cache_limit=limit)
        incoming = read_manifest(local).total_bytes
        total = incoming + size + sum(p.stat().st_size for p in other.rglob("*") if p.is_file())
        assert str(caught.value) == (
            f"{cache}: the cache limit of {limit:,} bytes cannot hold the pack ({incoming:,} bytes) beside the staged "
            "copies kept: 1 whose origin is gone (the last copy); 1 whose origin is in another store than the pack "
            "staged, or may be: staged with storage_options for another endpoint (never looked up); "
            f"{total:,} bytes in all. Raise cache_limit=SIZE, stop the readers of older copies, or unstage them"
        )
        assert first.is_dir() and other.is_dir()
    finally:
        memory.rm("/h-kept", recursive=True)


_SECOND_SERVER = """
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
server.start()
print("port", server.get_host_and_port()[1], flush=True)
sys.stdin.read()  # until the test closes it
server.stop()
"""


@contextlib.contextmanager
def _moto_in_another_process() -> Iterator[dict[str, Any]]:
    """A moto S3 server of its own process (one of this process shares its buckets with the fixtures' server):
    another endpoint, holding other objects; yields its storage options (credentials from the environment)."""
    pytest.importorskip("moto.server", reason="the tests' S3 server needs moto[server] (the dev extra)")
    server = subprocess.Popen(
        [sys.executable, "-c", _SECOND_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None and server.stdin is not None
        line = server.stdout.readline()  # 'port N' once the server listens (moto prints a line of its own first)
        while line and not line.startswith("port "):
            line = server.stdout.readline()
        port = int(line.split()[1])
        yield {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
    finally:
        if server.stdin is not None:
            server.stdin.close()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_eviction_never_looks_up_a_copy_staged_from_another_endpoint_in_this_one(
    s3, remote_pack, tmp_path: Path
) -> None:
    """Eviction looked every S3 copy's origin up with the storage_options of the stage under way: the last copy of
    s3://packs/train.lmdb staged from another endpoint (its origin there removed) was evicted, as this endpoint
    holds a pack at that path too."""
    import s3fs

    options, fs = s3
    url, local = remote_pack
    cache = tmp_path / "cache"
    with _moto_in_another_process() as elsewhere:
        other = s3fs.S3FileSystem(**elsewhere)
        other.mkdir("packs")
        other.put(str(local), "packs/train.lmdb", recursive=True)
        first = packdata.stage(url, to=cache, progress=False, storage_options=elsewhere).staged
        other.rm("packs/train.lmdb", recursive=True)  # gone there: the staged copy is its last one
    fs.put(str(local), "packs/h-second", recursive=True)  # this endpoint's s3://packs/train.lmdb is another pack's
    size = sum(p.stat().st_size for p in first.rglob("*") if p.is_file())
    try:
        with pytest.raises(packdata.CapacityError) as caught:
            packdata.stage(
                "s3://packs/h-second", to=cache, progress=False, storage_options=options, cache_limit=int(1.5 * size)
            )
        assert re.fullmatch(
            rf"{re.escape(str(cache))}: the cache limit of [\d,]+ bytes cannot hold the pack \([\d,]+ bytes\) beside "
            r"the staged copies kept: 1 whose origin is in another store than the pack staged, or may be: staged with "
            r"storage_options for another endpoint \(never looked up\); "
            r"[\d,]+ bytes in all\. Raise cache_limit=SIZE, stop the readers of older copies, or unstage them",
            str(caught.value),
        ), caught.value
        assert (first / STAGED_FILE).is_file() and read_manifest(first).total_bytes == read_manifest(local).total_bytes
    finally:
        fs.rm("packs/h-second", recursive=True)


def test_eviction_still_looks_up_a_copy_staged_with_other_credentials_of_the_same_endpoint(
    s3, remote_pack, tmp_path: Path
) -> None:
    """Where a copy came from is its endpoint, not who asked: a copy staged with keys since rotated is still looked
    up (its origin there: evicted), never kept as another store's."""
    options, fs = s3
    url, local = remote_pack
    cache = tmp_path / "cache"
    before = {**options, "key": "rotated-key-id", "secret": "rotated-secret"}
    first = packdata.stage(url, to=cache, progress=False, storage_options=before).staged
    fs.put(str(local), "packs/h-rotated", recursive=True)
    size = sum(p.stat().st_size for p in first.rglob("*") if p.is_file())
    now = {**options, "key": "new-key-id", "secret": "new-secret"}
    try:
        second = packdata.stage(
            "s3://packs/h-rotated", to=cache, progress=False, storage_options=now, cache_limit=int(1.5 * size)
        )
        assert not first.exists() and second.staged.is_dir()  # the older copy made room
    finally:
        fs.rm("packs/h-rotated", recursive=True)


def test_a_copy_staged_before_origin_store_is_recorded_when_a_stage_reuses_it_so_eviction_looks_it_up(
    s3, remote_pack, tmp_path: Path
) -> None:
    """A stage that reused a complete copy left its staged.json as it was: a copy staged by a packdata that wrote no
    origin_store stayed unrecorded however often it was reused, so eviction never looked its origin up and kept it
    for good ('staged with storage_options for another endpoint')."""
    options, fs = s3
    url, local = remote_pack
    cache = tmp_path / "cache"
    first = packdata.stage(url, to=cache, progress=False, storage_options=options).staged
    marker = json.loads((first / STAGED_FILE).read_text())
    del marker["origin_store"]  # as an older packdata wrote it
    (first / STAGED_FILE).write_text(json.dumps(marker))
    again = packdata.stage(url, to=cache, progress=False, storage_options=options)
    assert again.staged == first and not again.downloaded  # reused: its manifest is the store's
    fs.put(str(local), "packs/h-reused", recursive=True)
    size = sum(p.stat().st_size for p in first.rglob("*") if p.is_file())
    try:
        second = packdata.stage(
            "s3://packs/h-reused", to=cache, progress=False, storage_options=options, cache_limit=int(1.5 * size)
        )
        assert not first.exists() and second.staged.is_dir()  # the reused copy, looked up in its store, made room
    finally:
        fs.rm("packs/h-reused", recursive=True)
