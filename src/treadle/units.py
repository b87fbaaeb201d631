"""Units: the byte constants, reading a size a person typed, and the one set of display formatters.

Inside treadle every quantity is in seconds, bytes or FLOPs (names carry the unit: ``_s``, ``_bytes``,
``_flops``); a unit is picked only to display a number, here and nowhere else.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from .errors import TreadleError

KiB = 2**10
MiB = 2**20
GiB = 2**30
TiB = 2**40

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB}


class UnitError(TreadleError, ValueError):
    """A size or duration that cannot be read."""


def parse_bytes(text: str) -> float:
    """'80GB' -> 80e9, '80GiB' -> 80 * 2**30, '1e9' -> 1e9 (case and spaces ignored).
    Raises UnitError naming the text and the forms that work."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise UnitError(f"cannot read memory size {text!r}; write e.g. 80GiB, 80GB or 8.5e10 (bytes)")
    try:
        value = float(m.group(1))
    except ValueError:
        raise UnitError(f"cannot read memory size {text!r}; write e.g. 80GiB, 80GB or 8.5e10 (bytes)") from None
    return value * _SIZE_UNITS[m.group(2).lower()]


def bytes_unit(values: Iterable[float]) -> tuple[str, float]:
    """('GiB', 2**30) when any value reaches 0.1 GiB, else ('MiB', 2**20): one unit for a column or an axis."""
    return ("GiB", GiB) if max(values, default=0.0) >= GiB / 10 else ("MiB", MiB)


def fmt_bytes(n: float) -> str:
    """The largest binary unit the size reaches, two decimals: '1.50 GiB', '12.00 KiB', '512 B'."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_bytes_exact(x: float | None) -> str:
    """A size for an error or a report that someone may act on: '1.500 GiB (1610612736 B)'; None is
    'unlimited', infinity 'inf'."""
    if x is None:
        return "unlimited"
    if x == math.inf:
        return "inf"
    if abs(x) >= GiB / 10:
        return f"{x / GiB:.3f} GiB ({int(x)} B)"
    return f"{x / MiB:.3f} MiB ({int(x)} B)"


def fmt_flops(n: float) -> str:
    """'3.20 TFLOP', '12 FLOP'."""
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} FLOP"


def fmt_time(s: float) -> str:
    """'1.250 s', '3.10 ms', '12.0 us'."""
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def fmt_ms(s: float) -> str:
    """Seconds as milliseconds with three decimals (or seconds from 10 s): the unit of step-time columns."""
    return f"{s:.2f} s" if s >= 10 else f"{s * 1e3:.3f} ms"


def fmt_count(n: int) -> str:
    """'1.20B', '3.40M', '12.00K', '7'."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)
