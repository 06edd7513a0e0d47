"""One reader per shard, opened lazily in the process that reads: what keeps pack datasets fork- and spawn-safe."""

from __future__ import annotations

import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from packdata.errors import OUT_OF_FILES_HINT, CapacityError, PackdataError, PackFormatError, too_many_open_files
from packdata.host.descriptors import max_map_count, open_files_limit, raise_open_files_limit

__all__ = ["ShardReaders"]

_FILES_PER_READER = 4  # at most, once a shard is read: LMDB's own descriptor, the positioned reads', the maps'
_MAPS_PER_READER = 4  # LMDB's map of data.mdb, the positioned reads' map, records.i64, a TFRecord table

_lock = threading.Lock()  # opens and evictions of every ShardReaders in this process, one thread at a time
_opened: deque[tuple[weakref.ref[ShardReaders], int]] = deque()  # every dataset's readers here, first opened first
_budget = [0]  # readers this process keeps open at most, all datasets together (known at a first open)
_pid = [os.getpid()]  # this process's, set again in a forked child: a read checks it without a system call


def _new_lock() -> None:
    """A forked child's lock and budget: a lock another thread held at the fork would never be released there."""
    global _lock
    _lock = threading.Lock()
    _opened.clear()  # the parent's readers: each dataset lets go of them at its first read here
    _budget[0] = 0
    _pid[0] = os.getpid()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock)


class ShardReaders:
    """One reader per shard, opened on first use in the process that reads.

    After a fork, or once unpickled in a ``spawn``-ed worker, the list starts
    empty: a parent's file descriptors and maps are never used by a child.
    ``make`` must be picklable (a class or a ``functools.partial`` of one),
    called as ``make(path, **kwargs[shard])``. ``check``, when given, runs after
    each reader is made (it raises if the pack changed since the dataset opened it);
    then ``prepare``, when given, as ``prepare(shard, reader)`` (picklable too).

    A process keeps at most :meth:`most_open` readers (all its datasets together), half of what its limits
    on open files and memory maps allow (the soft file limit is raised to the
    hard one first); past that, the reader opened first is let go of: it
    closes once no caller holds it (a thread still reading it, a batch), never
    under a read. Opens and evictions hold a lock, so threads may share a dataset.
    """

    def __init__(
        self,
        paths: list[str],
        make: Callable[..., Any],
        kwargs: list[dict[str, Any]] | None = None,
        check: Callable[[], None] | None = None,
        prepare: Callable[[int, Any], None] | None = None,
    ) -> None:
        self.paths = paths
        self.make = make
        self.kwargs = kwargs or [{} for _ in paths]
        self.check = check
        self.prepare = prepare
        self._readers: list[Any] = []
        self._most = 0  # this process's budget once this object's first open here has checked the limits
        self._pid = -1

    def __getitem__(self, shard: int) -> Any:
        if self._pid == _pid[0]:
            reader = self._readers[shard]
            if reader is not None:
                return reader
        with _lock:  # one thread opens a shard, and the count of readers open stays true
            if self._pid != _pid[0]:
                self._readers = [None] * len(self.paths)
                self._most = 0
                self._pid = _pid[0]
            reader = self._readers[shard]
            if reader is not None:
                return reader
            self._make_room()
            try:
                reader = self._open(shard)
            except (OSError, PackdataError) as exc:
                if not too_many_open_files(exc):
                    raise
                if not raise_open_files_limit():
                    raise self._out_of_files(shard) from exc
                reader = None
            if reader is None:  # the soft limit is raised to the hard one: once more, outside the handler above,
                try:  # so an error of this open (a damaged shard) does not carry the first one's "too many files"
                    reader = self._open(shard)
                except (OSError, PackdataError) as again:
                    if too_many_open_files(again):
                        raise self._out_of_files(shard) from again
                    raise
            self._readers[shard] = reader
            _opened.append((weakref.ref(self), shard))
        return reader

    @staticmethod
    def most_open() -> int:
        """Readers a process keeps open: half what its soft file limit and ``vm.max_map_count`` allow at 4 each."""
        soft = open_files_limit()[0]
        files = soft if soft >= 0 else 1 << 30
        return max(8, min(files // _FILES_PER_READER, max_map_count() // _MAPS_PER_READER) // 2)

    def _make_room(self) -> None:
        """Raise the soft file limit (once, to the hard one) or let go of the readers opened first.

        The readers are any dataset's in this process. One let go of is not
        closed here: it closes (its ``__del__``) when the last caller holding
        it drops it, at once where none does, so before the next open needs its files.
        """
        if not self._most:
            if len(self.paths) > self.most_open():
                raise_open_files_limit()  # no privilege needed: up to the hard limit
            self._most = _budget[0] = self.most_open()
        while len(_opened) >= _budget[0]:
            owner, first = _opened.popleft()
            readers = owner()
            if readers is not None and readers._pid == _pid[0]:
                readers._readers[first] = None

    def _open(self, shard: int) -> Any:
        try:
            reader = self.make(self.paths[shard], **self.kwargs[shard])
            if hasattr(reader, "open"):
                reader.open()  # a reader that opens lazily opens now, before the check
        except PackFormatError as exc:
            if self.check is not None and not too_many_open_files(exc):
                self.check()  # a shard that fails its checks because the pack changed: say so
            raise
        try:
            if self.check is not None:
                self.check()  # after the open: the files opened are the generation checked
            if self.prepare is not None:
                self.prepare(shard, reader)
        except BaseException:
            reader.close()
            raise
        return reader

    def _out_of_files(self, shard: int) -> CapacityError:
        """Out of file descriptors at the hard limit, said as such (not as a damaged shard)."""
        soft, hard = open_files_limit()
        return CapacityError(
            f"too many open files opening shard {shard} of {len(self.paths):,}: this process holds "
            f"{len(_opened):,} shard readers (2-4 files each) and may open {soft:,} files (ulimit -n; hard limit "
            f"{'none' if hard < 0 else format(hard, ',')})",
            path=self.paths[shard],
            hint=OUT_OF_FILES_HINT,
        )

    def close(self) -> None:
        """Close this process's readers (a parent's inherited ones are left alone)."""
        if self._pid == _pid[0]:
            for reader in self._readers:
                if reader is not None:
                    reader.close()
            self._readers = [None] * len(self.paths)

    def __getstate__(self) -> dict[str, Any]:
        return {
            "paths": self.paths,
            "make": self.make,
            "kwargs": self.kwargs,
            "check": self.check,
            "prepare": self.prepare,
            "_readers": [],
            "_most": 0,
            "_pid": -1,
        }
