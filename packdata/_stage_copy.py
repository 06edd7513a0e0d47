"""The copying half of :mod:`packdata.stage`: shard files, verified parallel copies, markers.

A shard is copied as :class:`ShardFiles`: its files (``data.mdb`` and
``records.i64`` for LMDB, the ``.tfrecord``, its ``.tfindex`` and ``.tfpayload`` for TFRecord),
each to a hidden ``.NAME.partial`` name first, hashed as written, renamed into
place only once the checksummed file matches the manifest. Internal: the API
and its documentation live in :mod:`packdata.stage`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from packdata.errors import CapacityError, ConfigError, PackdataError, PackFormatError
from packdata.index import INDEX_DIR
from packdata.manifest import Manifest, ShardInfo
from packdata.units import format_size

__all__ = [
    "STAGED_FILE",
    "Cancelled",
    "ShardFiles",
    "check_destination",
    "copy_all",
    "copy_file",
    "copy_index",
    "dir_bytes",
    "is_staged",
    "locked",
    "remove_leftovers",
    "resolve_order",
    "same_tree",
    "sha256_of",
    "shard_files",
    "staged_manifest",
    "write_marker",
]

STAGED_FILE = "staged.json"
"""Written in every staged pack: where it came from, which shards are staged and which were left."""

PARTIAL = ".partial"
LOCK = ".stage.lock"
CHUNK = 8 << 20
EXTRA_FILES = ("skipped.jsonl",)


class Cancelled(Exception):
    """Another copy failed or the user interrupted: stop this one and clean up."""


@dataclass
class ShardFiles:
    """One shard as files on disk: where it is, where it goes, its temporary names."""

    number: int
    info: ShardInfo
    name: str  # the shard's name in the staged pack
    files: list[tuple[Path, Path, Path, bool]]  # (source, destination, temporary, is the checksummed file)
    dest_root: Path  # what "staged" means on disk: a directory (LMDB) or the shard file (TFRecord)
    temp_root: Path
    directory: bool

    @property
    def size(self) -> int:
        return sum(src.stat().st_size for src, _, _, _ in self.files)

    def dest_bytes(self) -> int:
        return sum(dst.stat().st_size for _, dst, _, _ in self.files if dst.is_file())

    def remove(self) -> None:
        if self.directory:
            shutil.rmtree(self.dest_root, ignore_errors=True)
        else:
            for _, dst, _, _ in self.files:
                dst.unlink(missing_ok=True)

    def remove_temp(self) -> None:
        if self.directory:
            shutil.rmtree(self.temp_root, ignore_errors=True)
        else:
            for _, _, tmp, _ in self.files:
                tmp.unlink(missing_ok=True)


def shard_files(manifest: Manifest, source: Path, dest: Path) -> list[ShardFiles]:
    units = []
    for number, info in enumerate(manifest.shards):
        src = info.path(source)
        name = Path(info.file).name if Path(info.file).is_absolute() else info.file
        if manifest.format == "lmdb":
            from packdata.formats.lmdb import DATA_FILE

            if not (src / DATA_FILE).is_file():
                raise PackFormatError(
                    f"shard {number} is missing its {DATA_FILE}", path=src, hint="Convert the pack again"
                )
            root, temp = dest / name, dest / f".{name}{PARTIAL}"
            names = sorted(p.name for p in src.iterdir() if p.is_file() and p.name != "lock.mdb")
            files = [(src / f, root / f, temp / f, f == DATA_FILE) for f in names]
            units.append(ShardFiles(number, info, name, files, root, temp, True))
        else:
            from packdata.formats.tfrecord import index_path, payload_path

            if not src.is_file():
                raise PackFormatError(f"shard {number} is missing", path=src, hint="Convert the pack again")
            files = [(src, dest / name, dest / f".{name}{PARTIAL}", True)]
            for side in (payload_path(src), index_path(src)):
                if side.is_file():
                    files.insert(0, (side, dest / side.name, dest / f".{side.name}{PARTIAL}", False))
            units.append(ShardFiles(number, info, name, files, dest / name, dest / f".{name}{PARTIAL}", False))
    return units


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def is_staged(unit: ShardFiles) -> bool:
    """Every file of the staged copy has the source's size and the expected checksum."""
    try:
        for src, dst, _, primary in unit.files:
            if not dst.is_file() or dst.stat().st_size != src.stat().st_size:
                return False
            expected = unit.info.sha256 if primary else sha256_of(src)
            if sha256_of(dst) != expected:
                return False
    except OSError:
        return False
    return True


def copy_file(src: Path, tmp: Path, stop: threading.Event, bar: tqdm) -> tuple[int, str]:
    """Copy ``src`` to ``tmp``, hashing what is written; fsync before returning."""
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    size = 0
    with open(src, "rb") as fin, open(tmp, "wb") as fout:
        with contextlib.suppress(OSError):
            os.posix_fadvise(fin.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while True:
            if stop.is_set():
                raise Cancelled
            n = fin.readinto(buffer)
            if not n:
                break
            digest.update(view[:n])
            fout.write(view[:n])
            size += n
            bar.update(n)
        fout.flush()
        os.fsync(fout.fileno())
    return size, digest.hexdigest()


def copy_unit(unit: ShardFiles, stop: threading.Event, bar: tqdm) -> None:
    """Copy one shard to its temporary names, verify it, and rename it into place."""
    unit.remove_temp()
    try:
        if unit.directory:
            unit.temp_root.mkdir()
        for src, _, tmp, primary in unit.files:
            try:
                size, sha = copy_file(src, tmp, stop, bar)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise CapacityError(
                        f"no space left while staging shard {unit.number} ({unit.name}, {format_size(unit.size)})",
                        path=unit.dest_root.parent,
                        hint="The partial copy was removed and the source is untouched. Stage fewer shards "
                        "with --budget, free space, or use a larger --tmpfs",
                    ) from exc
                raise
            if primary and (sha != unit.info.sha256 or size != unit.info.bytes):
                raise PackFormatError(
                    f"shard {unit.number} does not match the manifest: {size} bytes with SHA-256 {sha[:16]}..., "
                    f"expected {unit.info.bytes} bytes with {unit.info.sha256[:16]}...",
                    path=src,
                    hint="The source pack is damaged: run `packdata verify` on it and convert it again",
                )
        if unit.directory:
            os.rename(unit.temp_root, unit.dest_root)
        else:
            # the checksummed file last: until it has its name the shard is not staged
            for _, dst, tmp, _ in sorted(unit.files, key=lambda f: f[3]):
                os.replace(tmp, dst)
    except BaseException:
        unit.remove_temp()
        raise


# --------------------------------------------------------------------------- helpers


def dir_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def same_tree(src: Path, dst: Path) -> bool:
    if not dst.is_dir():
        return False
    for f in src.iterdir():
        if not f.is_file():
            continue
        other = dst / f.name
        if not other.is_file() or other.stat().st_size != f.stat().st_size or sha256_of(other) != sha256_of(f):
            return False
    return True


def copy_index(source: Path, dest: Path, manifest: Manifest) -> None:
    """Copy the sample index (and small extras) unless the destination already holds the same files."""
    name = manifest.index.get("dir", INDEX_DIR)
    src = source / name
    if src.is_dir() and not same_tree(src, dest / name):
        temp = dest / f".{name}{PARTIAL}"
        shutil.rmtree(temp, ignore_errors=True)
        shutil.copytree(src, temp)
        old = dest / f".{name}.old{PARTIAL}"
        if (dest / name).exists():
            os.rename(dest / name, old)
        os.rename(temp, dest / name)
        shutil.rmtree(old, ignore_errors=True)
    for extra in EXTRA_FILES:
        if (source / extra).is_file():
            shutil.copyfile(source / extra, dest / f".{extra}{PARTIAL}")
            os.replace(dest / f".{extra}{PARTIAL}", dest / extra)


def remove_leftovers(dest: Path) -> None:
    """Delete ``.partial`` files and folders an interrupted run left."""
    for entry in dest.iterdir():
        if entry.name.startswith(".") and entry.name.endswith(PARTIAL):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


@contextlib.contextmanager
def locked(dest: Path) -> Iterator[None]:
    with open(dest / LOCK, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                "another `packdata stage` is writing into this staged pack", path=dest, hint="Wait for it to finish"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}{PARTIAL}")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def staged_manifest(manifest: Manifest, source: Path, units: list[ShardFiles], staged: set[int]) -> Manifest:
    shards = [
        dataclasses.replace(u.info, file=u.name if u.number in staged else os.fspath(u.info.path(source)))
        for u in units
    ]
    return dataclasses.replace(manifest, shards=shards)


def resolve_order(manifest: Manifest, shards: Sequence[int | str] | None) -> list[int]:
    n = len(manifest.shards)
    if shards is None:
        return list(range(n))
    names = {Path(s.file).name: i for i, s in enumerate(manifest.shards)}
    order: list[int] = []
    for item in shards:
        if isinstance(item, int) or (isinstance(item, str) and item.strip().isdigit()):
            number = int(item)
            if not 0 <= number < n:
                raise ConfigError(f"shards should be numbers from 0 to {n - 1} or shard names, but got {item!r}")
        elif item in names:
            number = names[item]
        else:
            raise ConfigError(
                f"shards should be numbers from 0 to {n - 1} or shard names, but got {item!r}",
                hint=f"The pack's shards are {', '.join(list(names)[:3])}{', ...' if n > 3 else ''}",
            )
        if number not in order:
            order.append(number)
    return order


def check_destination(source: Path, dest: Path) -> None:
    if dest.resolve() == source.resolve():
        raise ConfigError("the staging destination is the pack itself", path=dest, hint="Give another --to DIR")
    if dest.exists():
        marker = dest / STAGED_FILE
        if not marker.is_file():
            if dest.is_dir() and not any(dest.iterdir()):
                return
            raise ConfigError(
                "exists and is not a staged pack",
                path=dest,
                hint="Choose another --to DIR or --name; packdata only writes into packs it staged",
            )
        try:
            origin = json.loads(marker.read_text(encoding="utf-8")).get("origin")
        except (OSError, ValueError):
            origin = None
        if origin and Path(origin) != source.resolve():
            raise ConfigError(
                f"holds a staged copy of another pack ({origin})",
                path=dest,
                hint=f"Unstage it first (packdata unstage {dest}) or choose another --name",
            )


# --------------------------------------------------------------------------- tmpfs


def copy_all(units: list[ShardFiles], total: int, workers: int | None, progress: bool) -> None:
    if not units:
        return
    stop = threading.Event()
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1000,
        desc=f"stage {len(units)} shard{'s' * (len(units) != 1)}",
        file=sys.stderr,
        disable=progress is False,
        dynamic_ncols=True,
    )
    pool = ThreadPoolExecutor(max_workers=workers or min(4, len(units)), thread_name_prefix="packdata-stage")
    futures = [pool.submit(copy_unit, u, stop, bar) for u in units]
    try:
        wait(futures, return_when=FIRST_EXCEPTION)
        if any(f.done() and f.exception() is not None for f in futures):
            stop.set()  # one failed: cancel the others at their next chunk
        wait(futures)
        errors = [e for e in (f.exception() for f in futures) if e is not None and not isinstance(e, Cancelled)]
        if errors:
            raise next((e for e in errors if isinstance(e, PackdataError)), errors[0])
    except BaseException:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        for unit in units:
            unit.remove_temp()
        raise
    finally:
        bar.close()
    pool.shutdown(wait=True)


def write_marker(
    dest: Path,
    source: Path,
    manifest: Manifest,
    units: list[ShardFiles],
    staged: set[int],
    sizes: dict[int, int],
    *,
    complete: bool,
) -> None:
    from packdata import __version__

    write_json(
        dest / STAGED_FILE,
        {
            "origin": os.fspath(source),
            "format": manifest.format,
            "staged": [u.name for u in units if u.number in staged],
            "left": [u.name for u in units if u.number not in staged],
            "bytes_staged": sum(sizes[n] for n in staged),
            "bytes_left": sum(sizes[u.number] for u in units if u.number not in staged),
            "complete": complete,
            "staged_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "packdata_version": __version__,
        },
    )


# --------------------------------------------------------------------------- status and unstage
