"""Shared fixtures: small deterministic image and text folders."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import http.client
import http.server
import io
import json
import multiprocessing
import os
import signal
import struct
import subprocess
import sys
import tarfile
import tempfile
import threading
import urllib.request
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest
from PIL import Image

import packdata


def image_bytes(seed: int, size: tuple[int, int] = (64, 48), fmt: str = "JPEG") -> bytes:
    """A small natural-looking image (a seeded colour gradient) encoded as ``fmt``: the one test image maker."""
    rng = np.random.default_rng(seed)
    w, h = size
    x = np.linspace(0, 1, w)[None, :, None]
    y = np.linspace(0, 1, h)[:, None, None]
    colour = rng.uniform(0, 255, (1, 1, 3))
    pixels = (colour * x + (255 - colour) * y).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt, quality=85)
    return out.getvalue()


@pytest.fixture(autouse=True)
def _shut_down_leaked_loader_workers() -> Iterator[None]:
    """A DataLoader iterator that a failed read left alive is shut down in the test that made it.

    The exception's traceback holds the iterator in a reference cycle, so its
    workers would otherwise be shut down at some later garbage collection: a
    worker exiting then reaches torch's SIGCHLD handler, which raises inside
    whatever later test runs (seen once in CI: a spawned worker of a test of
    damaged shards failed a convert test that uses no DataLoader).
    """
    yield
    if multiprocessing.active_children():  # also reaps children that have exited
        with contextlib.suppress(RuntimeError):  # torch's SIGCHLD handler, for a worker of the loader shut down here
            gc.collect()


KILLED_AT_SECOND_CHECKPOINT = r"""
import os, signal, sys
import packdata

checkpoints = []

def hook(event, args):  # SIGKILL as the second checkpoint is written: the partial pack holds one to resume from
    if event in ("os.rename", "os.replace") and os.fspath(args[1]).endswith("progress.json"):
        checkpoints.append(args[1])
        if len(checkpoints) == 2:
            os.kill(os.getpid(), signal.SIGKILL)

sys.addaudithook(hook)
packdata.convert(sys.argv[1], sys.argv[2], shard_samples=1, workers=1, progress=False)
"""
"""``python -c`` it with SRC DST: a conversion into DST SIGKILLed as it writes its second checkpoint."""


_KILL_AT_FILES_DONE = r"""
import os as _os, signal as _signal
from packdata.conversion import checkpoint as _checkpoint
_save = _checkpoint._Checkpoint.save
def _save_then_kill(self, state=None):  # SIGKILL right after the first checkpoint counting FILES files done is saved
    _save(self, state)
    if (self.state() if state is None else state)["files_done"] >= FILES:
        _os.kill(_os.getpid(), _signal.SIGKILL)
_checkpoint._Checkpoint.save = _save_then_kill
"""


def killed_at_files_done(script: str, args: list[str], files: int, timeout: float = 600) -> None:
    """Run the conversion ``python -c script *args``, SIGKILLed by itself right after it saves the first checkpoint
    counting ``files`` files done or more: at that instant whatever the machine's load.

    Fails the test with the output's tail if the run ended otherwise (finished before, failed) or ran ``timeout``
    seconds (a hang guard, never a kill instant).
    """
    code = _KILL_AT_FILES_DONE.replace("FILES", str(int(files))) + script
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the conversion to kill at {files} files done hung for {timeout}s: {str(exc.stderr)[-4000:]}")
    assert done.returncode == -signal.SIGKILL, (
        f"not killed at {files} files done: {done.returncode}\n{done.stderr[-4000:]}"
    )


def interrupted_convert(src: Path, dst: Path, monkeypatch: pytest.MonkeyPatch, after: int = 5, **options) -> None:
    """A conversion stopped (as by Ctrl-C) after ``after`` samples, checkpointed every 2 (``options``: convert's)."""
    from packdata import convert
    from packdata.conversion import local
    from packdata.conversion.destination import partial_path

    monkeypatch.setattr(local, "_COMMIT_SAMPLES", 2)
    real_add = local._Packer._add

    def add(self, *args, **kwargs):
        if self.cp.samples_done >= after:
            raise KeyboardInterrupt
        return real_add(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(local._Packer, "_add", add)
        with pytest.raises(KeyboardInterrupt):
            convert(src, dst, progress=False, workers=1, **options)
    assert (partial_path(dst) / "progress.json").is_file()


def tar_with_a_hard_link(folder: Path, tar_path: Path) -> None:
    """A tar of a.json, a.txt, b.json, b.txt made by tarfile.add, b.txt a hard link to a.txt (one file, two names)."""
    folder.mkdir()
    (folder / "a.txt").write_text("one caption", encoding="utf-8")
    os.link(folder / "a.txt", folder / "b.txt")
    (folder / "a.json").write_text("[1]", encoding="utf-8")
    (folder / "b.json").write_text("[2]", encoding="utf-8")
    with tarfile.open(tar_path, "w") as tar:
        for name in ("a.json", "a.txt", "b.json", "b.txt"):
            tar.add(folder / name, arcname=name)  # b.txt: a link member (its inode was added as a.txt)


def help_text(*command: str) -> str:
    """``packdata COMMAND --help`` through CliRunner, its words joined by single spaces (click rewraps to the width)."""
    from click.testing import CliRunner

    from packdata.cli import main

    out = CliRunner().invoke(main, [*command, "--help"])
    assert out.exit_code == 0, out.output
    return " ".join(out.output.split())


def tree_digest(root: Path) -> dict[str, str]:
    """Every file's relative path -> SHA-256 (to prove a folder was not touched)."""
    return {
        os.path.relpath(os.path.join(d, f), root): hashlib.sha256(Path(d, f).read_bytes()).hexdigest()
        for d, _, files in os.walk(root)
        for f in files
    }


INDEX_FILES = ("labels.i32", "sizes.i64", "keys.utf8", "key_offsets.i64")
FIELD_INDEX_FILES = ("field_sizes.i64", "field_offsets.i64")


def assert_index_digests(pack: Path) -> dict[str, str]:
    """Assert the manifest's ``index.sha256`` names every index file of ``pack`` with its SHA-256; return it.

    Read from the raw JSON and hashed here, independently of packdata.
    """
    data = json.loads((pack / "manifest.json").read_text(encoding="utf-8"))
    folder = pack / data["index"]["dir"]
    names = INDEX_FILES + (FIELD_INDEX_FILES if data["kind"] == "fields" else ())
    assert data["index"].get("sha256") == {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in names}
    return data["index"]["sha256"]


def flip_label(pack: Path) -> Path:
    """Flip the low bit of the first label 0 or 1 in ``pack``'s ``labels.i32`` (still in range); return the file."""
    folder = json.loads((pack / "manifest.json").read_text(encoding="utf-8"))["index"]["dir"]
    path = pack / folder / "labels.i32"
    labels = np.fromfile(path, dtype="<i4")
    i = int(np.flatnonzero((labels == 0) | (labels == 1))[0])
    with open(path, "r+b") as f:
        f.seek(4 * i)
        f.write(struct.pack("<i", int(labels[i]) ^ 1))
    return path


@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    """ImageFolder tree: 3 classes x 6 images, odd names, one unlabelled image at the root."""
    root = tmp_path / "images"
    names = ["a.jpg", "b.JPEG", "c d.png", "ünïcode.jpg", "e.Jpg", "f.webp"]
    for c, cls in enumerate(["cat", "dog", "zebra"]):
        (root / cls).mkdir(parents=True)
        for i, name in enumerate(names):
            fmt = {".png": "PNG", ".webp": "WEBP"}.get(Path(name).suffix.lower(), "JPEG")
            (root / cls / name).write_bytes(image_bytes(10 * c + i, fmt=fmt))
    (root / "root.jpg").write_bytes(image_bytes(99))
    return root


@pytest.fixture
def bad_files(image_folder: Path) -> Path:
    """The image folder plus a corrupt, an empty, a hidden and a non-image file."""
    (image_folder / "cat" / "corrupt.jpg").write_bytes(b"this is not a jpeg")
    (image_folder / "dog" / "empty.jpg").write_bytes(b"")
    (image_folder / "dog" / ".hidden.jpg").write_bytes(image_bytes(5))
    (image_folder / "zebra" / "notes.txt").write_text("not an image")
    return image_folder


@pytest.fixture
def text_folder(tmp_path: Path) -> Path:
    root = tmp_path / "texts"
    for _c, cls in enumerate(["neg", "pos"]):
        (root / cls).mkdir(parents=True)
        for i in range(10):
            (root / cls / f"doc{i:02d}.txt").write_text(f"class {cls} document {i} café " * (i + 1), encoding="utf-8")
    return root


def expected_samples(root: Path, extensions: set[str]) -> dict[str, tuple[bytes, int]]:
    """key -> (bytes, label) by ImageFolder rules, computed independently of packdata."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    out = {}
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix()
        if not path.is_file() or any(part.startswith(".") for part in rel.split("/")):
            continue
        if path.suffix.lower() not in extensions or path.stat().st_size == 0:
            continue
        label = classes.index(rel.split("/")[0]) if "/" in rel else -1
        out[rel] = (path.read_bytes(), label)
    return out


def pack_contents(pack: Path) -> dict[str, tuple[bytes, int]]:
    """An LMDB pack's samples, key -> (bytes, label), as packdata reads them back."""
    from packdata import LMDBDataset

    ds = LMDBDataset(pack, decode="bytes")
    return {ds.keys[i]: ds[i] for i in range(len(ds))}


def classes_folder(root: Path, classes: dict[str, list[str]]) -> Path:
    """A folder of class folders ``{class: [file names]}``, each file a small JPEG, the same bytes in every run.

    Each image is seeded by a CRC-32 of its path: ``hash()`` of a string changes with ``PYTHONHASHSEED``.
    """
    for name, files in classes.items():
        (root / name).mkdir(parents=True)
        for i, file in enumerate(files):
            (root / name / file).write_bytes(image_bytes(zlib.crc32(f"{name}/{file}".encode()) % 1000 + i))
    return root


def pack_samples(pack: Path) -> list[tuple[str, bytes, str]]:
    """(key, stored bytes, class name) of every sample, in pack order."""
    from packdata.pack.manifest import read_manifest

    lmdb_pack = read_manifest(pack).format == "lmdb"
    ds = (packdata.LMDBDataset if lmdb_pack else packdata.TFRecordIndexedDataset)(pack, decode="bytes")
    return [(ds.keys[i], data, ds.classes[label]) for i, (data, label) in enumerate(ds)]


def pack_tree(pack: Path) -> dict[str, str]:
    """Every file of a pack -> SHA-256 (LMDB's lock files aside: readers make them)."""
    return {name: digest for name, digest in tree_digest(pack).items() if not name.endswith("lock.mdb")}


IMAGE_EXTS = {".jpg", ".jpeg", ".png", ".webp"}


def run_torchrun(script: Path, args: list[str], *, nproc: int = 2, timeout: float = 240) -> str:
    """Run ``script`` under ``torchrun --standalone --nproc_per_node nproc`` (CPU, gloo).

    Fails the test with the output's tail on a non-zero exit or a hang (the whole
    process group is killed after ``timeout`` seconds). Returns the output. The
    run's temporary files (torchelastic's folders) go to a folder removed after it.
    """
    with tempfile.TemporaryDirectory(prefix="torchrun-") as scratch:
        return _run_torchrun(script, args, nproc, timeout, scratch)


def _run_torchrun(script: Path, args: list[str], nproc: int, timeout: float, scratch: str) -> str:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
        "--nproc_per_node", str(nproc), str(script), *args,
    ]  # fmt: skip
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TMPDIR": scratch,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"torchrun {' '.join(args)} hung for {timeout}s:\n{output[-4000:]}")
    assert proc.returncode == 0, output[-4000:]
    return output


@pytest.fixture
def tmpfs(tmp_path: Path, request: pytest.FixtureRequest):
    """Factory: mount a real tmpfs of ``size`` (and mount ``options``) under tmp_path; unmounted afterwards.

    Skips the test without root.
    """
    mounted: list[Path] = []

    def make(size: str, name: str = "ram", options: str = "") -> Path:
        if os.geteuid() != 0:
            pytest.skip("needs root to mount tmpfs")
        point = tmp_path / name
        point.mkdir()
        spec = f"size={size}" + (f",{options}" if options else "")
        subprocess.run(["mount", "-t", "tmpfs", "-o", spec, "tmpfs", os.fspath(point)], check=True)
        mounted.append(point)
        return point

    def cleanup() -> None:
        for point in mounted:
            subprocess.run(["umount", "-l", os.fspath(point)], check=False)

    request.addfinalizer(cleanup)
    return make


@pytest.fixture
def cgroup(request: pytest.FixtureRequest):
    """Factory: a new cgroup with ``limits`` ({v2 file: value}: ``cpu.max``, ``memory.max``; v1 files derived);
    returns the folders a process joins by writing its pid to their ``cgroup.procs``. Removed afterwards (its
    processes must have ended). Skips without root or where no such cgroup can be made."""
    made: list[Path] = []

    def make(**limits: str) -> list[Path]:
        if os.geteuid() != 0:
            pytest.skip("needs root to create a cgroup")
        v1_files = {"cpu.max": ("cpu", "cpu.cfs_quota_us"), "memory.max": ("memory", "memory.limit_in_bytes")}
        root, name = Path("/sys/fs/cgroup"), f"packdata-test-{os.getpid()}-{len(made)}"
        v2 = (root / "cgroup.controllers").is_file()
        if v2:
            enabled = (root / "cgroup.subtree_control").read_text().split()
            if any(key.partition(".")[0] not in enabled for key in limits):
                pytest.skip("the cgroup v2 controllers these limits need are not enabled at /sys/fs/cgroup")
            files = {root / name / key: value for key, value in limits.items()}
        else:
            files = {root / v1_files[k][0] / name / v1_files[k][1]: v.split()[0] for k, v in limits.items()}
        groups = {f.parent for f in files}
        if not v2 and "cpu.max" in limits:
            groups.add(root / "cpuacct" / name)  # where cpuacct is mounted apart, the usage is there
        try:
            for group in sorted(groups):
                group.mkdir()
                made.append(group)
            for file, value in files.items():
                file.write_text(value)
        except OSError as exc:
            pytest.skip(f"cannot create a cgroup with {limits} here: {exc}")
        return sorted(groups)

    def cleanup() -> None:
        for group in made:
            group.rmdir()

    request.addfinalizer(cleanup)
    return make


def killed_at_staged_json_delete(imports: str, call: str) -> str:
    """A child script: ``imports``, then ``call`` with os.unlink made to SIGKILL the process as it comes to a
    ``staged.json`` (no clean-up runs), as a kill at the last step of a copy's delete leaves it."""
    return f"""import os, signal, sys
{imports}
unlink = os.unlink
def dying(path, *args, **kwargs):  # killed as the delete comes to staged.json: no clean-up runs
    if os.path.basename(path) == "staged.json":
        os.kill(os.getpid(), signal.SIGKILL)
    unlink(path, *args, **kwargs)
os.unlink = dying
{call}
"""


_LOCK_HOLDER = """
import sys
from packdata.pack.lock import hold_lock
with hold_lock(sys.argv[1], what="another stage", target=sys.argv[1]):
    print("held", flush=True)
    sys.stdin.readline()
"""


@contextlib.contextmanager
def lock_held_elsewhere(lock: Path) -> Iterator[subprocess.Popen]:
    """Another process holding ``lock`` (packdata's own lock, taken as another stage takes it) for the block.

    Yields that process once it holds the lock; afterwards it lets the lock go (its stdin closed) and is reaped.
    """
    holder = subprocess.Popen(
        [sys.executable, "-c", _LOCK_HOLDER, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        try:
            holder.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.communicate()
            raise


@contextlib.contextmanager
def moto_s3(credentials: dict[str, str]) -> Iterator[tuple[dict[str, Any], Any]]:
    """A moto S3 server on loopback with a ``packs`` bucket; yields (storage_options, s3fs filesystem).

    ``credentials`` go into the storage options (``{"key": ..., "secret": ...}``),
    or are empty when the caller sets them in the environment first.
    """
    moto_server = pytest.importorskip("moto.server", reason="the tests' S3 server needs moto[server] (the dev extra)")
    s3fs = pytest.importorskip("s3fs", reason="s3:// needs s3fs (pip install 'packdata[s3]')")
    # port 0: the server binds a free port itself. A port found free by a probe socket and bound later could be
    # taken in between (any process's connection gets one), and the server's thread then died unseen: start() hung
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    port = server.get_host_and_port()[1]
    # moto keeps its buckets in this process, not in the server: one an earlier server of this process made
    # (another test module's) would still be there, so each server starts from none
    reset = urllib.request.Request(f"http://127.0.0.1:{port}/moto-api/reset", method="POST")
    urllib.request.urlopen(reset, timeout=30).close()
    try:
        options = {**credentials, "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
        # the bucket made here, with a long timeout: moto loads its S3 code on the first S3 request, which took
        # up to 7 s under load, half of s3fs's 15 s read timeout
        urllib.request.urlopen(
            urllib.request.Request(f"http://127.0.0.1:{port}/packs", method="PUT"), timeout=60
        ).close()
        fs = s3fs.S3FileSystem(**options)
        yield options, fs
    finally:
        server.stop()
        # s3fs keeps a filesystem per options, its listings with it: a later server given this port (the kernel
        # hands a freed port out again) got this server's filesystem back, listing 'packs' and what it held (its
        # mkdir('packs') raised FileExistsError, a read saw objects that are gone). A server's filesystems go with it
        s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="module")
def s3_store() -> Iterator[tuple[dict[str, Any], Any]]:
    """A moto S3 server for a test module (see :func:`moto_s3`), its credentials in the storage options."""
    with moto_s3({"key": "testing-key-id", "secret": "testing-secret"}) as found:
        yield found


# The S3 server and packs of the tests of packs in object storage (tests/test_remote_*.py): one of each per test module.
SECRET = "never-print-this-secret-9f3c"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory):
    """A moto S3 server on loopback with dummy credentials in the environment; yields (storage_options, filesystem)."""
    env = {"AWS_ACCESS_KEY_ID": "testing-key-id", "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with moto_s3({}) as (options, fs):
            yield options, fs
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _uploaded_pack(
    fs: Any, root: Path, name: str, first: dict[str, int], count: int, size: tuple[int, int], **options: Any
) -> tuple[str, Path]:
    """A pack converted locally from ``count`` JPEGs a class (class ``c``'s ``i``-th from seed ``first[c] + i``, of
    ``size``; plus what ``root/src`` already holds) into ``root/name`` and uploaded to s3://packs/NAME."""
    src = root / "src"
    for c, seed in first.items():
        (src / c).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            (src / c / f"{i}.jpg").write_bytes(image_bytes(seed + i, size))
    local = root / name
    packdata.convert(src, local, progress=False, **options)
    fs.put(str(local), f"packs/{name}", recursive=True)
    return f"s3://packs/{name}", local


@pytest.fixture(scope="module")
def remote_pack(s3, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A 3-shard LMDB pack converted locally and uploaded to s3://packs/train.lmdb."""
    root = tmp_path_factory.mktemp("remote")
    return _uploaded_pack(s3[1], root, "train.lmdb", {"cat": 30, "dog": 30}, 9, (40, 30), shard_samples=6)


@pytest.fixture(scope="module")
def remote_tfrecord(s3, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A 4-shard TFRecord pack converted locally and uploaded to s3://packs/verify-tf."""
    root = tmp_path_factory.mktemp("remote-tf")
    (root / "src" / "a").mkdir(parents=True)
    (root / "src" / "a" / "broken.jpg").write_bytes(b"\xff\xd8\xff not a jpeg")  # a skip: the report is checked too
    url, local = _uploaded_pack(
        s3[1], root, "verify-tf", {"a": 0, "b": 30}, 7, (36, 24), format="tfrecord", shard_samples=4
    )
    assert (local / "skipped.jsonl").stat().st_size
    return url, local


_S3_ERRORS = {403: "AccessDenied", 501: "NotImplemented", 503: "ServiceUnavailable"}


class _FaultyRelay(http.server.BaseHTTPRequestHandler):
    """Relays a request to the moto server, or answers it with an error while its rule says so (see faulty_s3)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _body(self) -> bytes:
        if "chunked" not in self.headers.get("Transfer-Encoding", ""):
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))
        chunks = []
        while size := int(self.rfile.readline().split(b";")[0], 16):
            chunks.append(self.rfile.read(size))
            self.rfile.readline()
        self.rfile.readline()
        return b"".join(chunks)

    def _relay(self) -> None:
        body, path = self._body(), urlsplit(self.path).path
        self.server.hits[self.command, path] += 1
        rule = self.server.rules.get((self.command, path))
        sent = {k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"}
        if rule and rule[0] == "no-range":  # a store or proxy that ignores Range: the whole object answers
            sent = {k: v for k, v in sent.items() if k.lower() != "range"}
        if rule and rule[0] != "no-range" and rule[1] > 0:
            rule[1] -= 1
            status, data = rule[0], f"<Error><Code>{_S3_ERRORS[rule[0]]}</Code><Message>test</Message></Error>".encode()
            headers = {"Content-Type": "application/xml"}
        else:
            upstream = http.client.HTTPConnection(*self.server.upstream, timeout=60)
            upstream.request(self.command, self.path, body=body, headers={**sent, "Content-Length": str(len(body))})
            response = upstream.getresponse()
            status, data = response.status, response.read()
            headers = {k: v for k, v in response.getheaders() if k.lower() not in ("transfer-encoding", "connection")}
            upstream.close()
        if self.command != "HEAD":
            headers["Content-Length"] = str(len(data))
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay


@contextlib.contextmanager
def faulty_s3(options: dict):
    """A relay on loopback in front of the moto server of ``options``; yields (its storage options, rules, hits).

    ``rules[(method, path)] = [status, times]`` answers the next ``times``
    requests for that object with that HTTP error (``["no-range", 0]``: every
    request for it is relayed without its ``Range`` header, as a store or proxy
    that ignores ranges would answer it: the whole object); ``hits`` counts every
    request by (method, path). botocore's own retries are off in the options,
    so what reaches packdata is what a client sees once the library gave up.
    """
    upstream = urlsplit(options["client_kwargs"]["endpoint_url"])
    relay = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FaultyRelay)
    relay.daemon_threads = True
    relay.upstream, relay.rules, relay.hits = (upstream.hostname, upstream.port), {}, Counter()
    thread = threading.Thread(target=relay.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{relay.server_address[1]}"
        faulty = {
            **options,
            "client_kwargs": {"endpoint_url": endpoint},
            "config_kwargs": {"retries": {"total_max_attempts": 1}},
        }
        yield faulty, relay.rules, relay.hits
    finally:
        relay.shutdown()
        relay.server_close()


# The packs of the stage tests (tests/test_stage_*.py): incompressible JPEGs, so a budget or a tmpfs fills as planned.


def _noise_jpeg(seed: int, side: int = 160) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=95)
    return out.getvalue()


@pytest.fixture
def noise_folder(tmp_path: Path) -> Path:
    """36 incompressible JPEGs (about 1.5 MB in all) in 3 classes."""
    root = tmp_path / "noise"
    for c, cls in enumerate(["a", "b", "c"]):
        (root / cls).mkdir(parents=True)
        for i in range(12):
            (root / cls / f"{i:02d}.jpg").write_bytes(_noise_jpeg(100 * c + i))
    return root


@pytest.fixture
def lmdb_pack(noise_folder: Path, tmp_path: Path) -> Path:
    return packdata.convert(noise_folder, tmp_path / "train.lmdb", shard_samples=6, progress=False).pack


@pytest.fixture
def tfrecord_pack(noise_folder: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "train"
    packdata.convert(noise_folder, dst, format="tfrecord", shard_samples=6, progress=False)
    return dst


def packdata_as_nobody(*args: str) -> subprocess.CompletedProcess[str]:
    """``packdata ARGS`` run by root as the user nobody (setpriv), who may not search root's mode-700 folders.

    Callers mark their test ``root`` and skip it unless ``os.geteuid() == 0`` and ``setpriv`` is on PATH.
    """
    as_nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
    return subprocess.run(
        [*as_nobody, sys.executable, "-m", "packdata.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        timeout=120,
    )
