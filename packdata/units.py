"""Byte sizes in text: the one parser (:func:`parse_size`) and formatter (:func:`format_size`)."""

from __future__ import annotations

import re
from decimal import Decimal

__all__ = ["format_size", "parse_size"]

_UNITS = {"": 1, "b": 1}
_UNITS.update({f"{p}{suffix}": 1024**i for i, p in enumerate("kmgtpe", 1) for suffix in ("", "ib")})
_UNITS.update({f"{p}b": 1000**i for i, p in enumerate("kmgtpe", 1)})
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Parse ``30G``, ``30GB``, ``30GiB``, ``512M``, ``1.5T`` or ``1000`` (bytes) into bytes.

    Case-insensitive. ``KB/MB/GB/TB`` are decimal, ``KiB/MiB/GiB/TiB`` binary, and bare
    ``K/M/G/T`` binary as in tmpfs's ``size=``. Fractions of a unit round down.

    Raises:
        ValueError: Not a non-negative number with a known unit, or a fraction of a byte.
    """
    match = _SIZE_RE.fullmatch(text) if isinstance(text, str) else None
    unit = match[2].lower() if match else ""
    value = Decimal(match[1]) * _UNITS[unit] if match and unit in _UNITS else None
    if value is None or (_UNITS[unit] == 1 and value != value.to_integral_value()):
        raise ValueError(f"invalid size {text!r}: expected a number with an optional unit such as 64MB, 1GiB or 30G")
    return int(value)


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
