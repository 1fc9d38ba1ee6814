"""Parsing and printing byte sizes (``8GiB``, ``512MB``, ``1073741824``)."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}


def parse_bytes(text: str | int | float) -> int:
    """``"8GiB"`` -> 8589934592.  Decimal units (GB) are powers of 1000, binary (GiB) of 1024."""
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"cannot read {text!r} as a size; write e.g. 8GiB, 512MiB, 16GB or a number of bytes "
                f"(units: {', '.join(u for u in _UNITS if u)})"
            )
        value, unit = float(m.group(1)), m.group(2).lower()
    n = int(value * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return n


def format_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'."""
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
