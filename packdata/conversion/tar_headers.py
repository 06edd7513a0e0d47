"""How packdata reads a tar's member headers: tarfile's reading, but a damaged or hostile header named.

:class:`CheckedTarInfo` is the ``tarinfo`` class :mod:`packdata.conversion.tars`
opens tars with; :func:`check_end` checks what follows the end-of-archive marker,
:func:`data_problem` a member whose following bytes readers read otherwise;
:func:`check_tarfile` that this Python's tarfile still calls what :class:`CheckedTarInfo` overrides.
Each refusal is a :class:`tarfile.ReadError`, which the tar source reports as a
``"corrupt tar"`` skip (the samples before it kept).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import platform
import tarfile
from collections.abc import Callable
from typing import Any, Self, cast

from packdata.errors import SourceError

__all__ = ["MAX_HEADER_BYTES", "CheckedTarInfo", "check_end", "check_tarfile", "data_problem"]

MAX_HEADER_BYTES = 16 << 20
"""The bytes a tar's pax records (a member's, or all its global ones together) or a GNU long name may take:
tarfile reads them whole into memory (three times over), so a 400 KB tar.gz whose pax header claimed 400 MB of
zeros took 1.2 GB. A key holds at most 64 KiB, an extended attribute 64 KiB."""


class CheckedTarInfo(tarfile.TarInfo):
    """Member headers as tarfile reads them, but a damaged or missing one past the first is an error.

    tarfile's stream mode ends the archive, silently, at a header that is
    truncated, fails its checksum or is missing (a file cut at a member's
    end): the samples after it were lost without a word. A pax header whose
    sparse map is not numbers raised a bare ValueError, and thousands of pax
    headers in a row a RecursionError, which stopped the whole conversion as
    a failed request; they are damaged headers too.
    """

    @classmethod
    def fromtarfile(cls, tar: tarfile.TarFile) -> Self:
        try:
            return super().fromtarfile(tar)
        except tarfile.HeaderError as exc:
            kind = type(exc).__name__
            if tar.offset == 0 or kind == "EOFHeaderError":  # EOF: a zero block, the end-of-archive marker
                raise
            if kind == "EmptyHeaderError":
                raise tarfile.ReadError(
                    f"the tar ends at byte {tar.offset} without its end-of-archive blocks (cut short?)"
                ) from None
            raise tarfile.ReadError(f"damaged member header at byte {tar.offset}: {exc}") from None
        except ValueError as exc:  # a pax record tarfile parses with int() unguarded (GNU.sparse.map, a sparse map)
            raise tarfile.ReadError(f"damaged member header at byte {tar.offset}: {exc}") from None
        except RecursionError:  # tarfile reads each pax or long-name header by recursion: 400 in a row stopped the run
            raise tarfile.ReadError(
                f"damaged member header at byte {tar.offset}: more pax or long-name headers in a row than tarfile "
                "reads (one or two come before a member)"
            ) from None

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        """Read a member as tarfile does, but pax records or a long name past :data:`MAX_HEADER_BYTES` unread."""
        if self.type in _LONG_HEADERS:
            if self.size < 0:  # tarfile would read() a negative count: the rest of what it buffered
                raise tarfile.ReadError(f"damaged member header at byte {self.offset}: it claims {self.size:,} bytes")
            held = sum(len(k) + len(v) for k, v in tar.pax_headers.items()) if self.type == tarfile.XGLTYPE else 0
            if held + self.size > MAX_HEADER_BYTES:
                what = "a GNU long name" if self.type in _GNU_LONG else "pax records"
                also = f" (with the {held:,} bytes of global ones before)" if held else ""
                raise tarfile.ReadError(
                    f"the header at byte {self.offset} claims {self.size:,} bytes of {what}{also}, more than the "
                    f"{MAX_HEADER_BYTES:,} read of them: a damaged tar?"
                )
        return cast("tarfile.TarInfo", tarfile.TarInfo._proc_member(self, tar))  # type: ignore[attr-defined]

    def _proc_sparse(self, tar: tarfile.TarFile) -> Self:
        """An old GNU sparse member ('S'): tarfile's reading, its map summed (it is never read), not kept whole.

        The map's extension blocks were kept as a list of every chunk (100 MB of
        them, 350 KB gzipped, took 540 MB); more than :data:`MAX_HEADER_BYTES`
        of them, or a tar that ends among them (an IndexError), is a damaged tar.
        """
        assert tar.fileobj is not None
        structs, extended, size = self._sparse_structs  # type: ignore[attr-defined]
        del self._sparse_structs  # type: ignore[attr-defined]
        stored, read = sum(numbytes for _, numbytes in structs), 0
        while extended:
            read += tarfile.BLOCKSIZE
            if read > MAX_HEADER_BYTES:
                raise tarfile.ReadError(_long_map(self.offset))
            block = tar.fileobj.read(tarfile.BLOCKSIZE)
            if len(block) < tarfile.BLOCKSIZE:
                raise tarfile.ReadError(f"the tar ends in the sparse map of the member at byte {self.offset}")
            for pos in range(0, 21 * 24, 24):  # 21 (offset, size) pairs of 12 octal bytes each, as tarfile reads them
                try:
                    offset, numbytes = _number(block[pos : pos + 12]), _number(block[pos + 12 : pos + 24])
                except ValueError:
                    break
                stored += numbytes if offset and numbytes else 0
            extended = bool(block[504])
        self.sparse = cast("bytes", [(0, stored)])  # typeshed says bytes: it is a list of (offset, size)
        self.offset_data = tar.fileobj.tell()
        tar.offset = self.offset_data + -(-self.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
        self.size = size
        return self

    def _proc_gnusparse_10(self, member: tarfile.TarInfo, pax_headers: dict[str, str], tar: tarfile.TarFile) -> None:
        """A pax sparse member's map (GNU 1.0: a count, then offset and size lines), summed as tarfile reads it.

        tarfile kept every number, then every pair (40 MB of map, 39 KB
        gzipped, took 1.1 GB); more than :data:`MAX_HEADER_BYTES` of map is a damaged tar.
        """
        assert tar.fileobj is not None
        count, _, rest = tar.fileobj.read(tarfile.BLOCKSIZE).partition(b"\n")
        numbers, stored, read = int(count) * 2, 0, tarfile.BLOCKSIZE  # a ValueError: a damaged header
        for n in range(numbers):
            if b"\n" not in rest:
                read += tarfile.BLOCKSIZE
                if read > MAX_HEADER_BYTES:
                    raise tarfile.ReadError(_long_map(self.offset))
                rest += tar.fileobj.read(tarfile.BLOCKSIZE)
            number, rest = rest.split(b"\n", 1)  # a ValueError where the map ends unfinished
            value = int(number)  # offsets and sizes alike: a ValueError for one that is not a number
            stored += value if n % 2 else 0
        member.offset_data = tar.fileobj.tell()
        member.sparse = cast("bytes", [(0, stored)])


_OVERRIDDEN = {
    "_proc_member": ("self", "tarfile"),
    "_proc_sparse": ("self", "tarfile"),
    "_proc_gnusparse_10": ("self", "next", "pax_headers", "tarfile"),
}
"""tarfile's private readers :class:`CheckedTarInfo` overrides, with their parameters (Python 3.11 to 3.13)."""


def check_tarfile(where: str) -> None:
    """Refuse to read WebDataset tars (at ``where``, for the message) on a Python whose tarfile would bypass
    :class:`CheckedTarInfo`'s bounds: a tar would be read unbounded.

    Raises:
        SourceError: naming the Python version and the method that is missing, reshaped or no longer called.
    """
    problem = _tarfile_problem()
    if problem is not None:
        raise SourceError(
            f"this Python's tarfile ({platform.python_version()}) is not the one packdata bounds hostile tar headers "
            f"in ({problem}): its tars are not read, rather than read unbounded",
            path=where,
            hint="Convert with a Python whose tarfile packdata knows (3.11 to 3.13), or extract the tars with tar "
            "and convert the folder",
        )


@functools.cache
def _tarfile_problem() -> str | None:
    """What stops :class:`CheckedTarInfo`'s overrides from applying, in words; None when nothing does.

    Each must be on ``tarfile.TarInfo`` with the same parameters, and tarfile
    must call each reading a tar of one member of each kind, made here (once).
    """
    for name, params in _OVERRIDDEN.items():
        method = getattr(tarfile.TarInfo, name, None)
        try:
            found = tuple(inspect.signature(method).parameters) if callable(method) else None
        except (TypeError, ValueError):  # a callable whose signature is not told
            found = None
        if found != params:
            return f"tarfile.TarInfo has no {name}({', '.join(params)})"
    called = _calls()
    missing = next((name for name in _OVERRIDDEN if name not in called), None)
    return None if missing is None else f"tarfile no longer calls TarInfo.{missing} reading a member of its kind"


def _calls() -> set[str]:
    """The overridden methods tarfile calls reading an old GNU sparse member and a pax (GNU 1.0) sparse one."""
    called: set[str] = set()

    class Recording(CheckedTarInfo):
        def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
            called.add("_proc_member")
            return super()._proc_member(tar)

        def _proc_sparse(self, tar: tarfile.TarFile) -> Self:
            called.add("_proc_sparse")
            return super()._proc_sparse(tar)

        def _proc_gnusparse_10(self, member: tarfile.TarInfo, pax_headers: dict[str, str], tar: Any) -> None:
            called.add("_proc_gnusparse_10")
            super()._proc_gnusparse_10(member, pax_headers, tar)

    old = tarfile.TarInfo("old")
    old.type = tarfile.GNUTYPE_SPARSE  # a map of no chunks, no extension block
    pax = tarfile.TarInfo("GNUSparseFile.0/new")
    pax.size, pax.pax_headers = 512, {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": "new"}
    made = old.tobuf(format=tarfile.GNU_FORMAT) + pax.tobuf(format=tarfile.PAX_FORMAT)
    made += b"0\n".ljust(tarfile.BLOCKSIZE, b"\0") + bytes(2 * tarfile.BLOCKSIZE)  # a map of no chunks; the end
    with (
        contextlib.suppress(Exception),  # a tarfile that reads it otherwise: what it called is what counts
        tarfile.open(fileobj=io.BytesIO(made), mode="r|", tarinfo=Recording) as tar,
    ):
        for _ in tar:
            pass
    return called


def _long_map(offset: int) -> str:
    return f"the sparse member at byte {offset} has a map of more than {MAX_HEADER_BYTES:,} bytes: a damaged tar?"


_number = cast("Callable[[bytes], int]", tarfile.nti)  # type: ignore[attr-defined]  # tarfile's header numbers
_GNU_LONG = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)
_LONG_HEADERS = (*_GNU_LONG, tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE)


_NO_DATA = {
    tarfile.DIRTYPE: "folder",
    tarfile.LNKTYPE: "hard link",
    tarfile.SYMTYPE: "symlink",
    tarfile.CHRTYPE: "character device",
    tarfile.BLKTYPE: "block device",
    tarfile.FIFOTYPE: "FIFO",
}


def data_problem(member: tarfile.TarInfo) -> str | None:
    """Why readers disagree on the tar from ``member`` on, in words: a folder, link, device or FIFO whose header (or
    pax ``size`` record) claims bytes of data; None for any other member.

    tarfile (and WebDataset, which reads with it) skips no data after those
    headers: it reads the claimed bytes as the next members. GNU tar 1.34's
    ``-t`` skips them after a symlink, device or FIFO (its ``-x`` does not), so
    one tar gave other samples in packdata than in the tool a user checks it
    with. Call before the next member is read: that read would parse the bytes.

    A member of any type whose header (a base-256 number, or a pax ``size``
    record) claims fewer than 0 bytes is named too: tarfile took it, a size
    above -512 as an empty member (where GNU tar refuses the header), a lower
    one sending the next header's read back into the tar.
    """
    if member.size < 0:
        said = f"the member {member.name!r} at byte {member.offset} claims {member.size:,} bytes"
        return f"{said}: a damaged or crafted tar?"
    kind = _NO_DATA.get(member.type)
    if kind is None or member.size == 0:
        return None
    return (
        f"the {kind} {member.name!r} at byte {member.offset} claims {member.size:,} bytes of data, which a {kind} "
        "never holds: tarfile reads them as the next members, tar -t may skip them (a damaged or crafted tar?)"
    )


def check_end(tar: tarfile.TarFile) -> None:
    """Raise unless only zero bytes follow the end-of-archive marker (reading on to the end checks a gzip's CRC)."""
    assert tar.fileobj is not None
    while chunk := tar.fileobj.read(1 << 16):
        if chunk.strip(b"\0"):
            raise tarfile.ReadError(f"data follows a zero block at byte {tar.offset}: a damaged member header?")
