"""What an object store answered to a ranged read, checked against the bytes asked for.

A store, or a proxy in front of it, that ignores ``Range`` answers HTTP 200
with the whole object: its first bytes would pass for the bytes asked for, and
the framing or checksum checks that catch it would then blame the pack. A
reply is therefore taken only when it says it holds the range asked for
(:func:`check_range_reply`, S3's status, ``Content-Range`` and
``Content-Length``), or, where the client shows no headers, when it is no
longer than asked (:func:`check_range_length`); otherwise the read is refused
with an error that names the store as the cause (:func:`range_ignored` tells
it apart: no retry helps).
"""

from __future__ import annotations

import re
from typing import Any

from packdata.errors import SourceError

__all__ = ["check_range_length", "check_range_reply", "range_ignored"]

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")

_HINT = (
    "The endpoint, or a proxy in front of it, does not honour Range requests: read through one that does "
    "(the pack itself was not found damaged)"
)


class _RangeIgnored(SourceError):
    """A store answered a ranged read with other bytes than those asked for."""


def range_ignored(exc: BaseException) -> bool:
    """Whether ``exc`` is the refusal of a reply that was not the byte range asked for (no retry helps)."""
    return isinstance(exc, _RangeIgnored)


def _refused(where: str, start: int, end: int | None, answered: str) -> SourceError:
    asked = f"bytes {start}-{'' if end is None else end - 1}"
    return _RangeIgnored(
        f"asked for {asked}, the store answered {answered}: it ignored or changed the byte range",
        path=where,
        hint=_HINT,
    )


def check_range_reply(response: dict[str, Any], where: str, start: int, end: int | None) -> None:
    """Raise unless the S3 ``GetObject`` reply ``response`` holds bytes ``[start, end)`` of the object named ``where``.

    ``end`` None: to the object's end. A 206 must say ``Content-Range: bytes
    start-last/total`` with ``last`` the asked range's last byte (or the object's,
    when it ends first) and a matching ``Content-Length``; a 200 (no range) is
    taken only for a range from byte 0 that covers the whole object.

    Raises:
        SourceError: the reply is another range, or the whole object (the message says which).
    """
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    length = response.get("ContentLength")
    found = _CONTENT_RANGE.fullmatch(str(response.get("ContentRange") or "").strip())
    if found is None:
        if start == 0 and length is not None and (end is None or length <= end) and status != 206:
            return  # the whole object, which is all that was asked for
        raise _refused(where, start, end, f"HTTP {status} with {length} bytes and no byte range")
    first, last, total = int(found[1]), int(found[2]), found[3]
    ends = int(total) if total != "*" else None
    if end is not None:
        ends = end if ends is None else min(end, ends)
    if first == start and (ends is None or last == ends - 1) and length == last - first + 1:
        return
    raise _refused(where, start, end, f"bytes {first}-{last}/{total} ({length} bytes)")


def check_range_length(size: int, where: str, start: int, end: int | None) -> None:
    """Raise if a reply of ``size`` bytes to a read of bytes ``[start, end)`` is longer than asked for.

    For a client that shows no headers (fsspec's ``cat_file``): a shorter reply is the caller's to explain.
    Only the length is seen, so a store that ignores ``Range`` (answering the whole object: Python's
    ``http.server`` through fsspec's HTTP filesystem, for one) is caught only where the object is longer
    than the range asked for. Not caught: ``start`` > 0 with ``end`` past the object's end by ``start``
    bytes or more (bytes 100-1199 of a 1,000-byte object: its 1,000 bytes are taken), and ``end`` None
    (nothing to compare with). packdata's callers never ask either: every range lies inside an object whose
    size is known (a tar's hard-link target within the tar; a reader's records within its shard, a reply
    shorter than asked then named by its length check), and a stage's last range asks one byte past the
    manifest's size, so a whole-object reply to any range after its first is longer than asked.

    Raises:
        SourceError: it is longer.
    """
    if end is not None and size > end - start:
        raise _refused(where, start, end, f"{size} bytes")
