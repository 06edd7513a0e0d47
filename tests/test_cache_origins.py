"""A staged copy's origin (in its staged.json, which anyone who can write the cache can plant) is contacted only
in the store of the pack being staged."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import packdata
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
        assert error is not None and "the cache limit of" in error  # the planted copy is kept, not evicted
        assert (first / STAGED_FILE).is_file()
    finally:
        server.shutdown()
        server.server_close()
        memory.rm("/h-cache", recursive=True)
