"""Byte sizes in text: the one parser (:func:`parse_size`) and formatter (:func:`format_size`); names in a line
of output (:func:`shown`)."""

from __future__ import annotations

import re
from decimal import Decimal

__all__ = ["SIZE_RULE", "describe_size", "exact_size", "format_rate", "format_size", "parse_size", "shown"]

SIZE_RULE = "KB/MB/GB/TB are powers of 1000; K/M/G/T and KiB/MiB/GiB/TiB powers of 1024 (as tmpfs and ls -h)"
"""The one rule for size units, quoted in every ``--help`` that takes a size."""

_UNITS = {"": 1, "b": 1}  # "" is parsed, then refused: a size needs its unit
_UNITS.update({f"{p}{suffix}": 1024**i for i, p in enumerate("kmgtpe", 1) for suffix in ("", "ib")})
_UNITS.update({f"{p}b": 1000**i for i, p in enumerate("kmgtpe", 1)})
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(text: str, *, zero_ok: bool = False) -> int:
    """Parse ``30G``, ``30GB``, ``30GiB``, ``512M``, ``1.5T`` or ``4096B`` into bytes.

    Case-insensitive; the unit is required (``256`` alone could mean bytes or
    megabytes, so it is refused): ``B`` for bytes, ``KB/MB/GB/TB`` decimal,
    ``KiB/MiB/GiB/TiB`` and bare ``K/M/G/T`` binary as in tmpfs's ``size=``
    (:data:`SIZE_RULE`). Fractions of a unit round down. Zero (or less than a byte)
    is refused unless ``zero_ok`` (a tmpfs of ``size=0`` is unlimited, not empty).

    Raises:
        ValueError: not a number with a known unit, no unit, zero, a fraction of a byte, or 2**63 bytes or more.
    """
    match = _SIZE_RE.fullmatch(text) if isinstance(text, str) else None
    unit = match[2].lower() if match else ""
    value = Decimal(match[1]) * _UNITS[unit] if match and unit in _UNITS else None
    if value is None or (_UNITS[unit] == 1 and value != value.to_integral_value()):
        raise ValueError(f"invalid size {text!r}: expected a number with a unit such as 64MB, 1GiB or 30G")
    if not unit:
        raise ValueError(f"size {text!r} has no unit: write {text}B for bytes, or {text}MB, {text}G ... ({SIZE_RULE})")
    if int(value) == 0 and not zero_ok:  # 0.0001K rounds down to 0 bytes
        below = " once rounded down to whole bytes" if value else ""
        raise ValueError(f"size {text!r} is zero{below}, which cannot be meant here")
    if value >= 1 << 63:  # the kernel would take it modulo 2**64, or clamp it: a tmpfs of 8 EiB
        raise ValueError(f"size {text!r} is 8 EiB (2**63 bytes) or more: larger than any disk or memory")
    return int(value)


def describe_size(n: int) -> str:
    """A size as users check it: binary units and exact bytes, ``64.0 MiB (67,108,864 bytes)``."""
    return f"{format_size(n)} ({n:,} bytes)"


def format_size(n: int) -> str:
    """Bytes in binary units with one decimal: ``512 B``, ``1.5 GiB``."""
    if abs(n) < 1024:
        return f"{n} B"
    value, units = float(n), ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    for unit in units[:-1]:
        value /= 1024
        if abs(round(value, 1)) < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} {units[-1]}"


def exact_size(n: int) -> str:
    """``n`` bytes as one word that :func:`parse_size` reads back exactly: ``30G``, ``30GB``, ``4097B``.

    For a size pasted into a command line (``--tmpfs 30G``), where :func:`format_size`'s ``30.0 GiB`` would be two
    words, rounded.
    """
    for suffix, unit in (("E", 1 << 60), ("P", 1 << 50), ("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1024)):
        for word, base in ((suffix, unit), (f"{suffix}B", 1000 ** (unit.bit_length() // 10))):
            if n >= base and n % base == 0:
                return f"{n // base}{word}"
    return f"{n}B"


def format_rate(bytes_per_second: float) -> str:
    """A throughput in the units of :func:`format_size`: ``4.8 MiB/s``."""
    return f"{format_size(round(bytes_per_second))}/s"


def shown(text: str) -> str:
    """``text`` for one line of output: as it is, or quoted and escaped if it holds a newline, tab or control.

    A key or file name from a pack or a source may hold any of them: raw, one
    sample would print as two lines, or a terminal escape sequence would run.
    """
    return text if text.isprintable() else repr(text)
