"""A structural check of an LMDB ``data.mdb``, run before LMDB is let to open or walk it.

LMDB trusts its file: a damaged node offset or value size sends its C code
past its map (``SIGSEGV``/``SIGBUS``: the process dies, no error names the
file) or hands back other memory as a value, and ``lmdb.open`` maps as many
pages as a meta page says are in use, past the end of a shorter file. Every
number LMDB would follow is checked here first, against the file's size.

The layout, LMDB 0.9 on a 64-bit little-endian machine (``mdb.c``; packdata
reads no other), all integers little-endian. The file is an array of pages of
``psize`` bytes, page ``n`` at byte ``n * psize``; every page starts with a
16-byte header::

    0   u64  pgno      the page's own number
    8   u16  pad
    10  u16  flags     1 branch, 2 leaf, 4 overflow, 8 meta (0x20 LEAF2: dup-sort, refused)
    12  u16  lower     end of the node-offset array (16 + 2 * number of nodes)
    14  u16  upper     start of the node area   (overflow page: 12 u32 pages, the run's length)
    16  u16  ptrs[]    node offsets from the start of the page, in key order

Pages 0 and 1 are meta pages; after the header::

    16  u32  magic 0xBEEFC0DE          20  u32  version (1)
    24  u64  fixed map address (unused) 32  u64  map size (unused: readers pass their own)
    40  48-byte DB record: the free-page DB (its ``pad`` is the page size, its ``flags`` the environment's)
    88  48-byte DB record: the main DB
    136 u64  last page number in use   144 u64  transaction id

LMDB uses the meta page with the larger transaction id (page 0 on a tie),
reads page 1 at page 0's page size, and takes the chosen meta's page size for
every later address. A DB record::

    0   u32  pad (page size, in the free DB's record)   4  u16  flags   6  u16  depth
    8   u64  branch pages   16  u64  leaf pages   24  u64  overflow pages
    32  u64  entries        40  u64  root page (all ones: empty)

A node, at ``ptrs[i]`` inside its page::

    0   u16  lo   2  u16  hi   4  u16  flags   6  u16  ksize   8  key (ksize bytes), then data
    branch node: child page = lo | hi << 16 | flags << 32; no data
    leaf node:   value size = lo | hi << 16; flags 0: the value follows the key;
                 flags 1 (BIGDATA): a u64 page number follows the key, the first
                 page of an overflow run whose data starts 16 bytes into it;
                 2 (SUBDATA) and 4 (DUPDATA) are named and dup-sort DBs (refused)

packdata writes the unnamed main DB only (flags 0, 8-byte keys), so a named
DB or a dup-sort flag is refused as not a packdata shard.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from packdata.errors import PackFormatError, out_of_files_error, out_of_maps, out_of_maps_error, too_many_open_files
from packdata.pack.files import open_regular

__all__ = ["LMDBMeta", "ShardValues", "check_lmdb_tree", "read_lmdb_meta", "value_locations"]

_HEADER = 16  # page header bytes
_META = struct.Struct("<QHHHH II QQ IHHQQQQQ IHHQQQQQ QQ")  # header, meta up to the transaction id
_MAGIC = 0xBEEFC0DE
_VERSION = 1
_BRANCH, _LEAF, _OVERFLOW, _META_PAGE = 0x01, 0x02, 0x04, 0x08
_BIGDATA = 0x01
_NO_ROOT = (1 << 64) - 1
_MAX_DEPTH = 32  # LMDB's cursor stack
_PAGE_SIZES = frozenset(1 << n for n in range(9, 16))
_KEY_BYTES = 8  # packdata's keys: big-endian record numbers
_HINT = "The shard is damaged or not one packdata wrote: run `packdata verify`, then convert or stage the pack again"


@dataclass(frozen=True)
class LMDBMeta:
    """The meta page LMDB uses: page size, pages in the file, the main DB's root, depth, entries and flags."""

    page_size: int
    file_pages: int
    last_page: int
    txnid: int
    root: int
    depth: int
    entries: int
    flags: int


def _refuse(path: str, what: str) -> PackFormatError:
    return PackFormatError(what, path=path, hint=_HINT)


def read_lmdb_meta(data_file: str | os.PathLike) -> LMDBMeta:
    """Both meta pages of ``data_file`` checked, and the one LMDB would choose (safe before ``lmdb.open``).

    Raises:
        PackFormatError: the file cannot be read, a meta page is not one
            (flags, magic, version), the page sizes differ or are not a power
            of two in [512, 32768], the chosen meta's last page or root lies
            outside the file, or its main DB is not a plain one.
    """
    path = os.fspath(data_file)
    try:
        fd = open_regular(path)
        try:
            size = os.fstat(fd).st_size
            first = os.pread(fd, _META.size, 0)
            psize = _META.unpack(first)[9] if len(first) == _META.size else 0
            second = os.pread(fd, _META.size, psize) if psize in _PAGE_SIZES else b""
        finally:
            os.close(fd)
    except OSError as exc:
        if too_many_open_files(exc):
            raise out_of_files_error(path) from exc
        raise _refuse(path, f"cannot be read: {exc.strerror or exc}") from exc
    metas = []
    for number, raw in enumerate((first, second)):
        if number and psize not in _PAGE_SIZES:
            raise _refuse(path, f"meta page 0: page size {psize}, not a power of two in [512, 32768]")
        if len(raw) < _META.size:
            raise _refuse(path, f"{size} bytes: too short for LMDB's meta page {number}")
        fields = _META.unpack(raw)
        flags, magic, version = fields[2], fields[5], fields[6]
        if not flags & _META_PAGE or magic != _MAGIC:
            raise _refuse(path, f"page {number} is not an LMDB meta page (flags {flags:#x}, magic {magic:#x})")
        if version != _VERSION:
            raise _refuse(path, f"meta page {number}: LMDB data version {version}, expected {_VERSION}")
        if fields[9] != psize:
            raise _refuse(path, f"meta page {number}: page size {fields[9]}, meta page 0 says {psize}")
        metas.append(fields)
    number = int(metas[0][26] < metas[1][26])  # mdb_env_pick_meta: the larger transaction id, page 0 on a tie
    main_flags, depth, entries, root, last, txnid = metas[number][18:20] + metas[number][23:27]
    pages = size // psize
    if last >= pages:
        raise _refuse(
            path,
            f"is truncated: {size} bytes, but LMDB's meta page {number} says {(last + 1) * psize} are in use",
        )
    if main_flags:
        raise _refuse(path, f"meta page {number}: the main DB has flags {main_flags:#x}: not a packdata shard")
    if root == _NO_ROOT:
        if entries or depth:
            raise _refuse(path, f"meta page {number}: an empty main DB with {entries} entries and depth {depth}")
    elif not 2 <= root <= last:
        raise _refuse(path, f"meta page {number}: the main DB's root page {root} is outside pages 2-{last}")
    if not 1 <= depth <= _MAX_DEPTH and root != _NO_ROOT:
        raise _refuse(path, f"meta page {number}: the main DB's depth {depth} is not in 1-{_MAX_DEPTH}")
    return LMDBMeta(psize, pages, last, txnid, root, depth, entries, main_flags)


_checked: set[tuple[int, int, int, int]] = set()
"""``data.mdb`` files whose tree was found sound: (device, inode, size, mtime in ns). Added to without a lock: one
``set.add`` is atomic, and a lock held by another thread at a fork would never be released in the child."""


class ShardValues(NamedTuple):
    """A shard's values as :func:`value_locations` found them."""

    meta: LMDBMeta
    locations: np.ndarray
    """``(offset, length)`` of every record's value, by record number (int64)."""
    pages: np.ndarray
    """The file's pages in use, mapped read-only (uint8): the values lie in them."""


def value_locations(data_file: str | os.PathLike) -> ShardValues:
    """Where every record's value lies inside ``data_file``, by record number, from its own pages.

    The whole tree is checked as :func:`check_lmdb_tree` checks it, while the
    leaves are walked for their values (inline or in an overflow run): so
    records are found without LMDB's lookup or cursor, and without LMDB's
    handle or map in the process. A value is where LMDB would hand it back.

    Raises:
        PackFormatError: as :func:`check_lmdb_tree`, or the keys are not the record numbers 0 to entries - 1.
    """
    path = os.fspath(data_file)
    identity = _identity(path)  # before the read: a file changed since is not the one found sound
    meta = read_lmdb_meta(path)
    pages = _map_pages(path, meta)
    keys, offsets, lengths = _walk(path, pages, meta)
    gap = np.flatnonzero(keys != np.arange(len(keys), dtype=np.uint64))
    if len(gap):
        raise _refuse(path, f"record {int(gap[0])} is missing (the key in its place is {int(keys[gap[0]])})")
    _checked.add(identity)
    return ShardValues(meta, np.stack([offsets, lengths], axis=1), pages)


def _identity(path: str) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _map_pages(path: str, meta: LMDBMeta) -> np.ndarray:
    """The pages of ``path`` LMDB's meta says are in use, mapped read-only, as bytes."""
    fd = open_regular(path)
    try:
        buffer = mmap.mmap(fd, meta.file_pages * meta.page_size, access=mmap.ACCESS_READ)
    except OSError as exc:
        if out_of_maps(exc):
            raise out_of_maps_error(path) from exc
        raise _refuse(path, f"cannot be mapped: {exc.strerror or exc}") from exc
    except ValueError as exc:  # "mmap length is greater than file size": it shrank since its meta page was read
        raise _refuse(path, f"shrank below the {meta.file_pages * meta.page_size} bytes in use while read") from exc
    finally:
        os.close(fd)
    return np.frombuffer(buffer, dtype=np.uint8)


def check_lmdb_tree(data_file: str | os.PathLike) -> LMDBMeta:
    """Check every page LMDB can reach from the main DB's root, once per file per process; the meta used.

    Every branch child and overflow page number lies in ``[2, last page]``,
    every page's header names itself, has the expected type and sane
    ``lower``/``upper``, every node (header, key and inline value) lies inside
    its page, every overflow run inside the file and long enough for its
    value, no page is reached twice, the tree is at most 32 deep, and the
    leaves hold the meta's entry count. A file already found sound (same
    device, inode, size and modification time) is not read again. The pages
    are read through a map: about 15 ms for a 60 MB shard of 15,000 records
    in the page cache, 70-150 ms from disk (one overflow page header a record).

    Raises:
        PackFormatError: naming ``data_file``, the page and what is wrong.
    """
    path = os.fspath(data_file)
    identity = _identity(path)
    meta = read_lmdb_meta(path)
    if identity in _checked:
        return meta
    _walk(path, _map_pages(path, meta), meta)
    _checked.add(identity)
    return meta


def _walk(path: str, data: np.ndarray, meta: LMDBMeta) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Walk the main DB from its root depth first (see :func:`check_lmdb_tree`): keys, value offsets and lengths.

    In key order (uint64, int64, int64 arrays), each value's offset a byte of ``data``.
    """
    if meta.root == _NO_ROOT:
        empty = np.empty(0, dtype=np.int64)
        return empty.astype(np.uint64), empty, empty
    psize, last = meta.page_size, meta.last_page
    tree = np.zeros(last + 1, dtype=bool)
    runs: list[np.ndarray] = []  # per leaf page: (overflow page, value size, node's page) of its BIGDATA nodes
    leaves: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # per leaf page: keys, value offsets, sizes
    entries = 0
    todo = [(meta.root, 1, -1)]
    while todo:
        number, depth, parent = todo.pop()
        where = f"page {number}" + (f" (a child of page {parent})" if parent >= 0 else " (the root)")
        if depth > _MAX_DEPTH:
            raise _refuse(path, f"{where}: the tree is deeper than LMDB's {_MAX_DEPTH} levels")
        if tree[number]:
            raise _refuse(path, f"{where} is reached twice (a cycle or a shared page)")
        tree[number] = True
        page = data[number * psize : (number + 1) * psize]
        own, flags, lower, upper = struct.unpack("<Q2xHHH", page[:_HEADER].tobytes())
        if own != number:
            raise _refuse(path, f"{where}: its header says page {own}")
        if flags not in (_BRANCH, _LEAF):
            raise _refuse(path, f"{where}: flags {flags:#x}, expected a branch (0x1) or leaf (0x2) page")
        least = 2 if flags == _BRANCH else 1
        if not (_HEADER + 2 * least <= lower <= upper <= psize and lower % 2 == 0):
            raise _refuse(path, f"{where}: lower {lower} and upper {upper} do not fit a page of {psize} bytes")
        ptrs = page[_HEADER:lower].view("<u2").astype(np.int64)
        if ptrs.min() < upper or ptrs.max() > psize - 8:
            i = int(np.flatnonzero((ptrs < upper) | (ptrs > psize - 8))[0])
            raise _refuse(path, f"{where}: node {i}'s offset {int(ptrs[i])} is outside its area {upper}-{psize}")
        heads = page[ptrs[:, None] + np.arange(8)].view("<u2").astype(np.int64)  # lo, hi, flags, ksize
        lo, hi, node_flags, ksize = heads.T
        if flags == _BRANCH:
            ends = ptrs + 8 + ksize
            children = lo | hi << 16 | node_flags << 32
            _inside_page(path, where, ends, psize)
            bad = np.flatnonzero((children < 2) | (children > last))
            if len(bad):
                raise _refuse(path, f"{where}: node {bad[0]} points at page {children[bad[0]]}, outside 2-{last}")
            todo.extend((int(child), depth + 1, number) for child in children[::-1])
            continue
        if depth != meta.depth:
            raise _refuse(path, f"{where}: a leaf at depth {depth}, LMDB's meta says the tree is {meta.depth} deep")
        odd = np.flatnonzero((node_flags & ~_BIGDATA) | (ksize != _KEY_BYTES))
        if len(odd):
            i = odd[0]
            raise _refuse(
                path,
                f"{where}: node {i} has flags {node_flags[i]:#x} and a {ksize[i]}-byte key: not a packdata shard "
                f"(plain values under {_KEY_BYTES}-byte keys)",
            )
        sizes = lo | hi << 16
        big = node_flags == _BIGDATA
        _inside_page(path, where, ptrs + 8 + ksize + np.where(big, 8, sizes), psize)
        values = number * psize + ptrs + 8 + _KEY_BYTES  # inline: after the key
        if big.any():
            at = ptrs[big] + 8 + _KEY_BYTES
            first = page[at[:, None] + np.arange(8)].view("<u8").ravel()
            bad = np.flatnonzero((first < 2) | (first > last))
            if len(bad):
                node = np.flatnonzero(big)[bad[0]]
                raise _refuse(path, f"{where}: node {node}'s value is on page {first[bad[0]]}, outside 2-{last}")
            runs.append(np.stack([first.astype(np.int64), sizes[big], np.full(len(at), number)], axis=1))
            values[big] = first.astype(np.int64) * psize + _HEADER  # an overflow run: after its page header
        keys = page[(ptrs + 8)[:, None] + np.arange(_KEY_BYTES)].view(">u8").ravel()
        leaves.append((keys, values, sizes))
        entries += len(ptrs)
    if entries != meta.entries:
        raise _refuse(path, f"the leaves hold {entries} entries, LMDB's meta says {meta.entries}")
    _check_runs(path, data, meta, tree, np.concatenate(runs) if runs else np.empty((0, 3), dtype=np.int64))
    keys, values, sizes = (np.concatenate(column) for column in zip(*leaves, strict=True))
    return keys.astype(np.uint64), values, sizes


def _inside_page(path: str, where: str, ends: np.ndarray, psize: int) -> None:
    """Every node ends inside its page."""
    bad = np.flatnonzero(ends > psize)
    if len(bad):
        raise _refuse(path, f"{where}: node {bad[0]} runs to byte {ends[bad[0]]}, past its {psize}-byte page")


def _check_runs(path: str, data: np.ndarray, meta: LMDBMeta, tree: np.ndarray, runs: np.ndarray) -> None:
    """Every overflow run names itself, is one, fits its value and the file, and shares no page."""
    if not len(runs):
        return
    psize, last = meta.page_size, meta.last_page
    first, sizes, parents = runs.T
    heads = data[(first * psize)[:, None] + np.arange(_HEADER)]
    own = heads[:, :8].copy().view("<u8").ravel()
    flags = heads[:, 10:12].copy().view("<u2").ravel()
    pages = heads[:, 12:16].copy().view("<u4").ravel().astype(np.int64)
    problems = (
        (own != first, "its header says page {own}"),
        (flags != _OVERFLOW, "flags {flags:#x}, expected an overflow page (0x4)"),
        (pages < 1, "a run of {pages} pages"),
        (first + pages > last + 1, "a run of {pages} pages runs past the last page {last}"),
        (sizes > pages * psize - _HEADER, "a run of {pages} pages is too short for its {size}-byte value"),
    )
    for mask, text in problems:
        bad = np.flatnonzero(mask)
        if len(bad):
            i = bad[0]
            what = text.format(own=own[i], flags=flags[i], pages=pages[i], last=last, size=sizes[i])
            raise _refuse(path, f"overflow page {first[i]} (a value of leaf page {parents[i]}): {what}")
    cover = tree[: last + 1].astype(np.int64)
    cover += np.cumsum(np.bincount(first, minlength=last + 2) - np.bincount(first + pages, minlength=last + 2))[:-1]
    shared = np.flatnonzero(cover > 1)
    if len(shared):
        raise _refuse(path, f"page {shared[0]} belongs to two pages or overflow runs (a shared page)")
