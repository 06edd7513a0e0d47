"""Positioned reads that ask the kernel whether a file is in memory: a map slice when warm, ``pread`` when cold.

Copying a record out of a memory map costs no system call, so on a warm page
cache it is about twice as fast as ``os.pread`` for records of a few KB; on a
cold cache each first touch of a page is a synchronous 4 KB fault, where one
``pread`` is one I/O request the kernel can read ahead for. :class:`PagedFile`
asks the kernel (``mincore`` over its map, one call for the whole file) what
share of the file is resident, and slices the map only while nearly all of it
is; it asks again every ``recheck`` reads or after reading a quarter of the
file's size, whichever comes first, so a pack that warms up (or is evicted)
switches path on its own, also a shard of a few hundred large records. When
it turns warm it maps the file's pages in one call (``MADV_POPULATE_READ``),
so the slices that follow do not take a page fault each. Where ``mincore`` or ``mmap`` is not
available it always uses ``pread``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import sys

__all__ = ["WARM_SHARE", "PagedFile", "buffer_address"]

WARM_SHARE = 0.95
"""Share of a file's pages in the page cache at or above which it counts as warm (map slices, no read-ahead)."""
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_mincore = getattr(_libc, "mincore", None)
if _mincore is not None:
    _mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
    _mincore.restype = ctypes.c_int
_PAGE = mmap.PAGESIZE
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform.startswith("linux") else None)


class _PyBuffer(ctypes.Structure):
    _fields_ = [
        ("buf", ctypes.c_void_p), ("obj", ctypes.py_object), ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p),
    ]  # fmt: skip


def buffer_address(view: memoryview) -> int:
    """The memory address of a (read-only) buffer."""
    buffer = _PyBuffer()
    ctypes.pythonapi.PyObject_GetBuffer(ctypes.py_object(view), ctypes.byref(buffer), 0)
    try:
        return int(buffer.buf)
    finally:
        ctypes.pythonapi.PyBuffer_Release(ctypes.byref(buffer))


class PagedFile:
    """Reads of byte ranges of one open file: map slices while the file is resident, ``pread`` otherwise.

    Args:
        fd: an open, readable file descriptor (not closed here).
        size: the file's size; reads past it are the caller's to refuse.
        recheck: reads between two residency checks (at most; a quarter of
            ``size`` read in bytes also brings the next check).
    """

    def __init__(self, fd: int, size: int, *, recheck: int = 4096) -> None:
        self._fd, self._size, self._recheck = fd, size, recheck
        self._map: mmap.mmap | None = None
        self._address = 0
        self._countdown = 0
        self._bytes_left = 0  # bytes to read before the next check
        self.warm = False
        if _mincore is not None and size > 0:
            try:
                self._map = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
                self._address = buffer_address(memoryview(self._map))
            except (OSError, ValueError, TypeError):
                self._map = None

    def resident_share(self) -> float:
        """The share of the file's pages in the page cache now (0.0 when it cannot be told)."""
        if self._map is None or _mincore is None:
            return 0.0
        pages = (self._size + _PAGE - 1) // _PAGE
        vec = (ctypes.c_ubyte * pages)()
        if _mincore(self._address, self._size, vec) != 0:
            return 0.0
        resident = bytes(vec)
        return (pages - resident.count(0)) / pages if not resident.strip(b"\x00\x01") else resident.count(1) / pages

    def warm_map(self, reads: int = 1, nbytes: int = 0) -> mmap.mmap | None:
        """The map while the file is resident (slice it for ``reads`` reads of ``nbytes`` in all), else None.

        None: use ``pread``.
        """
        if self._map is None:
            return None
        self._countdown -= reads
        self._bytes_left -= nbytes
        if self._countdown < 0 or self._bytes_left < 0:
            warm = self.resident_share() >= WARM_SHARE
            if warm and not self.warm:
                self._populate()
            self.warm = warm
            self._countdown, self._bytes_left = self._recheck, self._size // 4
        return self._map if self.warm else None

    def _populate(self) -> None:
        """Map the file's pages into the page table in one call, so the slices that follow do not fault one by one.

        (A first slice of each 64 KiB would otherwise take a page fault: on large
        records, the first epoch through the map ran slower than ``pread``.)
        """
        if self._map is not None and _POPULATE_READ is not None:
            with contextlib.suppress(OSError, ValueError):  # a kernel before 5.14: the slices fault instead
                self._map.madvise(_POPULATE_READ)

    def read(self, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` (fewer at the end of the file, as ``pread`` gives)."""
        mapped = self.warm_map(1, length)
        if mapped is not None:
            return mapped[offset : offset + length]
        return os.pread(self._fd, length, offset)

    def close(self) -> None:
        """Unmap (the descriptor stays open: it is the caller's)."""
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view of the map is still alive: the GC unmaps it later
                self._map.close()
            self._map = None
