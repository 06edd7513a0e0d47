"""One reader per shard, opened lazily in the process that reads: what keeps pack datasets fork- and spawn-safe."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from packdata.errors import PackFormatError

__all__ = ["ShardReaders"]


class ShardReaders:
    """One reader per shard, opened on first use in the process that reads.

    After a fork, or once unpickled in a ``spawn``-ed worker, the list starts
    empty: a parent's file descriptors and maps are never used by a child.
    ``make`` must be picklable (a class or a ``functools.partial`` of one),
    called as ``make(path, **kwargs[shard])``. ``check``, when given, runs after
    each reader is made (it raises if the pack changed since the dataset opened it).
    """

    def __init__(
        self,
        paths: list[str],
        make: Callable[..., Any],
        kwargs: list[dict[str, Any]] | None = None,
        check: Callable[[], None] | None = None,
    ) -> None:
        self.paths = paths
        self.make = make
        self.kwargs = kwargs or [{} for _ in paths]
        self.check = check
        self._readers: list[Any] = []
        self._pid = -1

    def __getitem__(self, shard: int) -> Any:
        if self._pid != os.getpid():
            self._readers = [None] * len(self.paths)
            self._pid = os.getpid()
        reader = self._readers[shard]
        if reader is None:
            try:
                reader = self.make(self.paths[shard], **self.kwargs[shard])
                if hasattr(reader, "open"):
                    reader.open()  # a reader that opens lazily opens now, before the check
            except PackFormatError:
                if self.check is not None:
                    self.check()  # a shard that fails its checks because the pack changed: say so
                raise
            if self.check is not None:
                try:
                    self.check()  # after the open: the files opened are the generation checked
                except BaseException:
                    reader.close()
                    raise
            self._readers[shard] = reader
        return reader

    def close(self) -> None:
        """Close this process's readers (a parent's inherited ones are left alone)."""
        if self._pid == os.getpid():
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
            "_readers": [],
            "_pid": -1,
        }
