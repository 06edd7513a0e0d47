"""Hostile-pack builder: real small packs whose manifest or files a stranger rewrote.

Every case starts from a real pack converted from a tiny image folder, in a
``packs/`` folder that also holds a ``victim/`` folder beside the pack (a
secret file and an LMDB-looking folder with a ``data.mdb``). A case then
rewrites the manifest with one hostile value, or plants something inside the
pack. :func:`snapshot` records the whole tree around the pack so a test can
prove nothing outside (or inside) was touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb
from conftest import image_bytes

from packdata.conversion.convert import convert
from packdata.formats.lmdb_env import encode_key
from packdata.pack.manifest import manifest_checksum

__all__ = [
    "MALFORMED",
    "PATH_CASES",
    "PLANTED",
    "build_pack",
    "opens_of",
    "rewrite_manifest",
    "snapshot",
    "symlink_out_of_shard",
    "web_app_folder",
]

Entry = tuple[str, int, int, str]  # (type, mode, size, sha256 or link target)


def snapshot(root: Path) -> dict[str, Entry]:
    """Every path under ``root`` (itself included) -> type, permission bits, size, and content.

    Files give their SHA-256, symlinks their target (never followed), FIFOs
    and other special files only their type, so taking a snapshot opens no FIFO.
    """
    out: dict[str, Entry] = {}
    for directory, dirs, files in os.walk(root, followlinks=False):
        for name in [".", *dirs, *files]:
            path = os.path.normpath(os.path.join(directory, name))
            st = os.lstat(path)
            rel = os.path.relpath(path, root)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", 0, 0, os.readlink(path))
            elif stat.S_ISREG(st.st_mode):
                digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
                out[rel] = ("file", stat.S_IMODE(st.st_mode), st.st_size, digest)
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode), 0, "")
            else:
                out[rel] = ("special", stat.S_IFMT(st.st_mode), 0, "")
    return out


@contextlib.contextmanager
def opens_of(path: Path) -> Iterator[Callable[[], int]]:
    """Count the opens of ``path`` (any process, any file type) through inotify's ``IN_OPEN``, while in the block."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    if fd < 0 or libc.inotify_add_watch(fd, os.fsencode(path), 0x20) < 0:  # IN_OPEN
        raise OSError(ctypes.get_errno(), "inotify", os.fspath(path))
    seen = 0

    def count() -> int:
        nonlocal seen
        with contextlib.suppress(BlockingIOError):
            while events := os.read(fd, 4096):
                seen += len(events) // 16  # one 16-byte event each: no name on a watched file
        return seen

    try:
        yield count
    finally:
        os.close(fd)


def build_pack(tmp_path: Path, fmt: str) -> Path:
    """A real 2-class, 6-image pack at ``tmp_path/packs/train.<fmt>`` with a victim folder beside it."""
    src = tmp_path / "src"
    for c, cls in enumerate(("cat", "dog")):
        (src / cls).mkdir(parents=True)
        for i in range(3):
            (src / cls / f"{i}.jpg").write_bytes(image_bytes(10 * c + i))
    packs = tmp_path / "packs"
    victim = packs / "victim"
    (victim / "vict.lmdb").mkdir(parents=True)
    (victim / "secret.txt").write_text("do not touch")
    (victim / "vict.lmdb" / "data.mdb").write_bytes(b"\0" * 4096)
    pack = packs / f"train.{fmt}"
    options: dict[str, Any] = {"shard_samples": 3} if fmt == "tfrecord" else {}
    convert(src, pack, format=fmt, progress=False, **options)
    return pack


def rewrite_manifest(pack: Path, change: Callable[[dict[str, Any]], object] | str) -> None:
    """Rewrite ``pack``'s manifest: ``change`` edits the parsed JSON in place, or is the raw new text."""
    path = pack / "manifest.json"
    if isinstance(change, str):
        path.write_text(change, encoding="utf-8")
        return
    data = json.loads(path.read_text(encoding="utf-8"))
    change(data)
    data["checksum"] = manifest_checksum(data)  # a hostile author recomputes it
    path.write_text(json.dumps(data), encoding="utf-8")


def _victim(pack: Path, fmt: str) -> str:
    return "vict.lmdb" if fmt == "lmdb" else "secret.txt"


def _set_shard(value: Callable[[Path, str], str]) -> Callable[[Path, str], None]:
    def apply(pack: Path, fmt: str) -> None:
        rewrite_manifest(pack, lambda d: d["shards"][0].__setitem__("file", value(pack, fmt)))

    return apply


def _staged_forgery(pack: Path, fmt: str) -> None:
    target = os.fspath(pack.parent / "victim" / _victim(pack, fmt))

    def change(d: dict[str, Any]) -> None:
        d["staged_from"] = os.fspath(pack.parent / "victim")
        d["shards"][0]["file"] = target

    rewrite_manifest(pack, change)


def _symlinked_shard(pack: Path, fmt: str) -> None:
    """The manifest's name is plain, but the shard on disk is a symlink leading out of the pack."""
    shard = pack / json.loads((pack / "manifest.json").read_text())["shards"][0]["file"]
    victim = pack.parent / "victim" / _victim(pack, fmt)
    moved = pack.parent / "moved-shard"
    shard.rename(moved)  # outside the pack, so a snapshot shows any write to it
    shard.symlink_to(os.path.relpath(victim, pack))


def _symlinked_index(pack: Path, fmt: str) -> None:
    index = pack / "index"
    index.rename(pack.parent / "moved-index")
    index.symlink_to(os.path.relpath(pack.parent / "victim", pack))


def symlink_out_of_shard(pack: Path, fmt: str) -> Path:
    """A symlink leading out of the pack where a shard's own file is expected (TFRecord: its ``.tfindex``)."""
    shard = pack / json.loads((pack / "manifest.json").read_text())["shards"][0]["file"]
    if fmt == "lmdb":
        link = shard / "planted"
        link.symlink_to(os.path.relpath(pack.parent / "victim" / "secret.txt", shard))
    else:
        link = shard.with_suffix(".tfindex")
        link.unlink()
        link.symlink_to(os.path.relpath(pack.parent / "victim" / "secret.txt", pack))
    return link


PATH_CASES: dict[str, Callable[[Path, str], None]] = {
    "dotdot": _set_shard(lambda p, f: f"../victim/{_victim(p, f)}"),
    # the same victim seen from the pack and from a staging area beside the pack's folder: the old stage deleted it
    "climb": _set_shard(lambda p, f: f"../../{p.parent.name}/victim/{_victim(p, f)}"),
    "absolute": _set_shard(lambda p, f: os.fspath(p.parent / "victim" / _victim(p, f))),
    "nul": _set_shard(lambda p, f: "shard\x00.x"),
    "separator": _set_shard(lambda p, f: f"sub/{_victim(p, f)}"),
    "dot": _set_shard(lambda p, f: "."),
    "staged-forgery": _staged_forgery,
    "index-dotdot": lambda p, f: rewrite_manifest(p, lambda d: d["index"].__setitem__("dir", "../victim")),
    "report-dotdot": lambda p, f: rewrite_manifest(
        p, lambda d: d["skipped"].__setitem__("report", "../victim/secret.txt")
    ),
    "symlinked-shard": _symlinked_shard,
    "symlinked-index": _symlinked_index,
    # the folder an append replaced, which the next append deletes: never a shard, the index or the manifest
    "previous-shard": lambda p, f: rewrite_manifest(
        p, lambda d: d["index"].__setitem__("previous", d["shards"][0]["file"])
    ),
    "previous-index": lambda p, f: rewrite_manifest(p, lambda d: d["index"].__setitem__("previous", "index")),
    "previous-manifest": lambda p, f: rewrite_manifest(
        p, lambda d: d["index"].__setitem__("previous", "manifest.json")
    ),
    "index-shard": lambda p, f: rewrite_manifest(p, lambda d: d["index"].__setitem__("dir", d["shards"][0]["file"])),
}
"""Each hostile path case: ``apply(pack, fmt)``; every command and reader must refuse the pack."""


def _nested(depth: int) -> str:
    return '{"format": "lmdb", "x": ' + "[" * depth + "]" * depth + "}"


def _edit(change: Callable[[dict[str, Any]], object]) -> Callable[[Path, str], None]:
    return lambda pack, fmt: rewrite_manifest(pack, change)


def _raw(text: Callable[[str], str]) -> Callable[[Path, str], None]:
    def apply(pack: Path, fmt: str) -> None:
        rewrite_manifest(pack, text((pack / "manifest.json").read_text(encoding="utf-8")))

    return apply


MALFORMED: dict[str, tuple[Callable[[Path, str], None], str]] = {
    "deep-nesting": (_raw(lambda t: _nested(100_000)), "nested too deeply"),
    "nan": (_raw(lambda t: t.replace('"num_samples": 6', '"num_samples": NaN', 1)), "NaN"),
    "infinity": (_raw(lambda t: t.replace('"num_samples": 6', '"num_samples": Infinity', 1)), "Infinity"),
    "1e999": (_raw(lambda t: t.replace('"num_samples": 6', '"num_samples": 1e999', 1)), "1e999"),
    "top-level-list": (_raw(lambda t: f"[{t}]"), "JSON object"),
    "duplicate-key": (  # json.loads kept the last: another reader of the file may take the first
        _raw(lambda t: t.replace('"num_samples": 6', '"num_samples": 6, "num_samples": 6', 1)),
        "key 'num_samples' twice in one object",
    ),
    "not-json": (_raw(lambda t: t[: len(t) // 2]), "not valid JSON"),
    "not-utf8": (lambda p, f: (p / "manifest.json").write_bytes(b'{"format": "\xff"}'), "not valid JSON"),
    "classes-string": (_edit(lambda d: d.__setitem__("classes", "cat")), "'classes'"),
    "classes-ints": (_edit(lambda d: d.__setitem__("classes", [1, 2])), "'classes'"),
    "classes-duplicate": (  # was read: class_to_idx gave 'cat' label 1 while samples of label 0 were 'cat' too
        _edit(lambda d: d.__setitem__("classes", ["cat", "cat"])),
        "'classes' should name each class once ('cat' is there twice), but got",
    ),
    "index-list": (_edit(lambda d: d.__setitem__("index", ["index"])), "'index'"),
    "index-sha256-list": (_edit(lambda d: d["index"].__setitem__("sha256", ["x"])), "'index.sha256'"),
    "index-sha256-unknown-file": (
        _edit(lambda d: d["index"]["sha256"].__setitem__("../manifest.json", "0" * 64)),
        "'index.sha256' should be an object naming each index file once",
    ),
    "index-sha256-file-of-another-kind": (  # field sizes belong to multi-field packs only
        _edit(lambda d: d["index"]["sha256"].__setitem__("field_sizes.i64", "0" * 64)),
        "'index.sha256' should be an object naming each index file once",
    ),
    "index-sha256-lacks-labels": (_edit(lambda d: d["index"]["sha256"].pop("labels.i32")), "'index.sha256'"),
    "index-sha256-upper-hex": (
        _edit(lambda d: d["index"]["sha256"].__setitem__("labels.i32", "A" * 64)),
        "'index.sha256.labels.i32' should be 64 lowercase hex digits",
    ),
    "index-sha256-short": (
        _edit(lambda d: d["index"]["sha256"].__setitem__("sizes.i64", "ab")),
        "'index.sha256.sizes.i64'",
    ),
    "index-sha256-number": (
        _edit(lambda d: d["index"]["sha256"].__setitem__("keys.utf8", 7)),
        "'index.sha256.keys.utf8'",
    ),
    "shards-object": (_edit(lambda d: d.__setitem__("shards", {"a": 1})), "'shards'"),
    "shards-empty": (_edit(lambda d: d.__setitem__("shards", [])), "'shards'"),
    "shard-not-object": (_edit(lambda d: d["shards"].__setitem__(0, "x")), "'shards[0]'"),
    "shard-missing-key": (_edit(lambda d: d["shards"][0].pop("sha256")), "'shards[0]'"),
    "num-samples-string": (_edit(lambda d: d.__setitem__("num_samples", "6")), "'num_samples'"),
    "num-samples-bool": (_edit(lambda d: d.__setitem__("num_samples", True)), "'num_samples'"),
    "num-samples-float": (_edit(lambda d: d.__setitem__("num_samples", 6.0)), "'num_samples'"),
    "negative-count": (_edit(lambda d: d["shards"][0].__setitem__("num_samples", -1)), "'shards[0].num_samples'"),
    "huge-count": (_edit(lambda d: d.__setitem__("num_samples", 2**70)), "'num_samples'"),
    "huge-bytes": (_edit(lambda d: d["shards"][0].__setitem__("bytes", 2**64)), "'shards[0].bytes'"),
    "sum-mismatch": (_edit(lambda d: d.__setitem__("num_samples", 7)), "num_samples=7"),
    "first-index-gap": (_edit(lambda d: d["shards"][-1].__setitem__("first_index", 99)), "first_index'"),
    "duplicate-shard": (_edit(lambda d: d["shards"].append(dict(d["shards"][0]))), "each shard once"),
    "bad-sha": (_edit(lambda d: d["shards"][0].__setitem__("sha256", "zz")), "'shards[0].sha256'"),
    "unknown-field": (_edit(lambda d: d.__setitem__("evil", 1)), "'evil'"),
    "format-version-string": (_edit(lambda d: d.__setitem__("format_version", "1")), "'format_version'"),
    "skipped-by-reason-list": (
        _edit(lambda d: d["skipped"].update(count=1, by_reason=["x"])),
        "'skipped.by_reason' should be an object",
    ),
    "skipped-reason-count": (
        _edit(lambda d: d["skipped"].update(count=1, by_reason={"corrupt": "1"})),
        "'skipped.by_reason' should be an object of reason -> count",
    ),
    "skipped-count-negative": (_edit(lambda d: d["skipped"].update(count=-1)), "'skipped.count'"),
    "reencode-count-string": (  # info formatted it as a number: a traceback
        _edit(lambda d: d.__setitem__("reencode", {"max_side": 256, "quality": 90, "count": "12"})),
        "'reencode.count' should be an integer",
    ),
    "skipped-reasons-miscounted": (
        _edit(lambda d: d["skipped"].update(count=1, by_reason={"corrupt": 1, "unreadable": 4})),
        "'skipped.by_reason' should add up to skipped.count (1)",
    ),
}
"""Each malformed manifest: ``(apply(pack, fmt), text the one-line error must hold)``."""


def _fifo_in_shard(pack: Path, fmt: str) -> Path:
    shard = pack / json.loads((pack / "manifest.json").read_text())["shards"][0]["file"]
    target = shard / "planted.fifo" if fmt == "lmdb" else pack / "planted.fifo"
    os.mkfifo(target)
    return target


def _extra_file_in_shard(pack: Path, fmt: str) -> Path:
    shard = pack / json.loads((pack / "manifest.json").read_text())["shards"][0]["file"]
    target = shard / "planted.txt" if fmt == "lmdb" else pack / "index" / "planted.txt"
    target.write_text("not part of the pack")
    return target


def _inner_symlink_in_shard(pack: Path, fmt: str) -> Path:
    shard = pack / json.loads((pack / "manifest.json").read_text())["shards"][0]["file"]
    target = shard / "alias.mdb" if fmt == "lmdb" else pack / "index" / "alias"
    target.symlink_to("data.mdb" if fmt == "lmdb" else "labels.i32")
    return target


PLANTED: dict[str, Callable[[Path, str], Path]] = {
    "fifo": _fifo_in_shard,
    "extra-file": _extra_file_in_shard,
    "inner-symlink": _inner_symlink_in_shard,
}
"""Things planted inside a pack that staging must not copy: ``apply(pack, fmt) -> the planted path``."""


def web_app_folder(root: Path) -> Path:
    """A web app's folder that happens to hold a ``manifest.json`` (a PWA manifest)."""
    app = root / "webapp"
    app.mkdir(parents=True)
    (app / "manifest.json").write_text(json.dumps({"name": "App", "start_url": "/", "icons": []}))
    (app / "index.html").write_text("<html></html>")
    return app


def overwrite_lmdb_record(pack: Path, value: bytes) -> None:
    """Rewrite record 0 and the manifest's size and checksum to match, as a hostile pack's author would."""
    env = lmdb.open(str(pack / "shard-00000.lmdb"), map_size=1 << 26)
    with env.begin(write=True) as txn:
        txn.put(encode_key(0), value)
    env.close()
    data = pack / "shard-00000.lmdb" / "data.mdb"
    manifest = json.loads((pack / "manifest.json").read_text())
    manifest["shards"][0]["bytes"] = data.stat().st_size
    manifest["shards"][0]["sha256"] = hashlib.sha256(data.read_bytes()).hexdigest()
    manifest["checksum"] = manifest_checksum(manifest)
    (pack / "manifest.json").write_text(json.dumps(manifest))
