"""An LMDB shard's environment: its file names and keys, and one read-only handle per shard file per process.

:func:`_shared_env` hands every reader in a process the same environment and
reopens it after a fork; :func:`_release_env` closes it with its last user.
The writer (:mod:`packdata.formats.lmdb_writer`) opens its own, writable one.
"""

from __future__ import annotations

import os
import struct
import threading
from dataclasses import dataclass

import lmdb

from packdata.errors import (
    ConfigError,
    PackdataError,
    PackFormatError,
    out_of_files_error,
    out_of_maps,
    out_of_maps_error,
    too_many_open_files,
)
from packdata.formats.lmdb_pages import read_lmdb_meta

__all__ = ["DATA_FILE", "MAX_READERS", "encode_key"]

DATA_FILE = "data.mdb"
MAX_READERS = 2048
_KEY = struct.Struct(">Q")


def encode_key(index: int) -> bytes:
    """The LMDB key of the record at ``index`` within its shard: 8 bytes, big-endian."""
    return _KEY.pack(index)


@dataclass
class _SharedEnv:
    pid: int
    env: lmdb.Environment
    users: int = 1


_open_envs: dict[tuple[int, int], _SharedEnv] = {}
"""Open read-only environments by ``data.mdb``'s (device, inode): pid, handle, readers using it."""
_open_envs_lock = threading.RLock()  # threads may open a shard's first reader at once; a reader's __del__ re-enters


def _new_lock_after_fork() -> None:
    global _open_envs_lock
    _open_envs_lock = threading.RLock()  # one held by another thread at the fork would never be let go in the child


os.register_at_fork(after_in_child=_new_lock_after_fork)


def _identity(path: str) -> tuple[int, int]:
    stat = os.stat(os.path.join(path, DATA_FILE))
    return stat.st_dev, stat.st_ino


def _shared_env(path: str, readahead: bool) -> tuple[tuple[int, int], lmdb.Environment]:
    """One read-only environment per shard file per process, reopened after a fork: its key and handle.

    py-lmdb refuses to open an environment twice in one process, and a forked
    child inherits that refusal along with the parent's handle. Sharing the
    handle between datasets in a process, and closing the inherited one in a
    child before reopening, makes both everyday patterns work: two datasets over
    one pack, and ``ds[0]`` in the parent before DataLoader workers fork. The
    handle is keyed by the ``data.mdb`` file too (device and inode), so a pack
    converted again at the same path is opened afresh, never read through the
    old generation's map. Each call is one more user; :func:`_release_env`
    closes the handle when the last is done, so a process that read a pack
    does not keep its files mapped (and a replaced pack's space taken) after.
    """
    identity = _identity(path)
    with _open_envs_lock:
        entry = _open_envs.get(identity)
        if entry is not None:
            if entry.pid == os.getpid():
                entry.users += 1
                return identity, entry.env  # this file, through this path or another (a merged pack's hard link)
            entry.env.close()  # the parent's handle, inherited through fork
        read_lmdb_meta(os.path.join(path, DATA_FILE))  # LMDB maps the pages its meta says are in use
        env = lmdb.open(
            path,
            map_size=_read_map_size(path),
            readonly=True,
            lock=False,
            readahead=readahead,
            meminit=False,
            max_readers=MAX_READERS,
            subdir=True,
            create=False,
        )
        _open_envs[identity] = _SharedEnv(os.getpid(), env)
        return identity, env


def _read_map_size(path: str) -> int:
    """The map of a read-only environment: ``data.mdb``'s size, not py-lmdb's default 10 MiB.

    In a map larger than the file, a read past its end is a ``SIGBUS`` that
    kills the process. LMDB widens a map to the pages its meta page says are
    in use: :func:`~packdata.formats.lmdb_pages.read_lmdb_meta` refuses a
    file shorter than that before it is opened, and
    :func:`~packdata.formats.lmdb_pages.check_lmdb_tree` every page number,
    node and value that would lead LMDB's lookups and cursors off a page or
    out of the file before they walk it.
    """
    return max(os.path.getsize(os.path.join(path, DATA_FILE)), 1)


def _release_env(identity: tuple[int, int]) -> None:
    """One user of a shared environment is done; the last one closes it (a parent's, after a fork, is left)."""
    with _open_envs_lock:
        entry = _open_envs.get(identity)
        if entry is None or entry.pid != os.getpid():
            return
        entry.users -= 1
        if entry.users <= 0:
            del _open_envs[identity]
            entry.env.close()


def _lmdb_error(path: str | os.PathLike, exc: lmdb.Error) -> PackdataError:
    """An LMDB error (a damaged header or page, a bad map) as one line naming the shard.

    Out of file descriptors or maps is a :class:`CapacityError`, and a shard
    some other code of this process opened with ``lmdb.open`` a
    :class:`ConfigError`: never called damage.
    """
    if too_many_open_files(exc):
        return out_of_files_error(path)
    if out_of_maps(exc):  # its map refused: the process may map no more
        return out_of_maps_error(path)
    if "already open in this process" in str(exc):  # py-lmdb's guard: this file has another handle here
        return ConfigError(
            "LMDB will not open the shard twice in one process, and it is already open through another "
            "lmdb.open() (py-lmdb allows one handle per file per process); the shard itself is fine",
            path=path,
            hint="close that environment (env.close()) first, or read the pack only through packdata's "
            "datasets, which share one handle",
        )
    return PackFormatError(
        f"LMDB cannot read the shard: {type(exc).__name__}: {exc}".rstrip(": "),
        path=path,
        hint="The shard is damaged: run `packdata verify`, then convert or stage the pack again",
    )
