"""Memory budgets: what ``device_budget=``, ``host_budget=`` and ``activation_reserve=`` accept.

A budget is ``None`` (no limit), a number of bytes, a size string such as ``"20GiB"``, ``"1.5 GB"`` or
``"512MiB"``, or ``"auto"`` (measured at enable, see ``memory.py``). Decimal units (kB, MB, GB, TB) are
powers of 1000 and binary units (KiB, MiB, GiB, TiB) powers of 1024, as the two spellings promise; a
bare ``K``/``M``/``G``/``T`` is binary, as ``nvidia-smi`` and most users mean it.
"""
from __future__ import annotations

import logging
import math
import numbers
import re
from fractions import Fraction
from typing import Literal, Union

from fastoffload_ext.errors import OffloadConfigError

logger = logging.getLogger(__name__)

AUTO = "auto"
BudgetSpec = Union[None, int, str]
Budget = Union[None, int, Literal["auto"]]

_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}
_SIZE = re.compile(r"\s*(-?[0-9]+(?:\.[0-9]*)?|-?\.[0-9]+)\s*([a-zA-Z]*)\s*")


def _shape_error(what: str, value: object, allow_auto: bool) -> OffloadConfigError:
    auto = ", or 'auto'" if allow_auto else ""
    return OffloadConfigError(f"fastoffload: {what} must be None, a number of bytes, or a size such as '20GiB' or "
                              f"'512MB'{auto}; got {value!r}")


def _negative_error(what: str, value: object) -> OffloadConfigError:
    return OffloadConfigError(f"fastoffload: {what} must not be negative, got {value!r}; pass a size such as "
                              "'20GiB', or None for no limit")


def parse_size(value: object, what: str, *, allow_auto: bool = True) -> Budget:
    """``value`` as bytes (an int), ``None``, or ``"auto"``; raises :class:`OffloadConfigError` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise _shape_error(what, value, allow_auto)
    if isinstance(value, numbers.Integral):  # numpy's integers too
        if value < 0:
            raise _negative_error(what, value)
        return int(value)
    if isinstance(value, numbers.Real):
        # A float is a size only when it is a whole, finite number of bytes: 2.5 bytes is a typo.
        value = float(value)
        if not math.isfinite(value) or value != int(value):
            raise _shape_error(what, value, allow_auto)
        if value < 0:
            raise _negative_error(what, value)
        return int(value)
    if not isinstance(value, str):
        raise _shape_error(what, value, allow_auto)
    if value.strip().lower() == AUTO:
        if not allow_auto:
            raise _shape_error(what, value, allow_auto)
        return AUTO
    match = _SIZE.fullmatch(value)
    if match is None or match.group(2).lower() not in _UNITS:
        raise _shape_error(what, value, allow_auto)
    # Exact: a float product rounds "8.2GB" to 8199999999 bytes and long digit strings to the nearest double.
    number = Fraction(match.group(1))
    if number < 0:
        raise _negative_error(what, value)
    size = number * _UNITS[match.group(2).lower()]
    if _UNITS[match.group(2).lower()] == 1 and size.denominator != 1:
        raise _shape_error(what, value, allow_auto)  # "2.5" bytes is refused as 2.5 is
    return int(size)  # a unit's fraction ("0.3GiB") rounds down to whole bytes


def format_bytes(value: int | float | None) -> str:
    """Bytes for messages: ``'3.38 GiB'``, ``'216.0 MiB'``, ``'512 B'``."""
    if value is None:
        return "no limit"
    value = float(value)
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(value) >= size:
            return f"{value / size:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{int(value)} B"


__all__ = ["AUTO", "Budget", "BudgetSpec", "format_bytes", "parse_size"]
