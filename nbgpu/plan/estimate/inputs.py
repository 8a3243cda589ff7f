"""What an estimate accepts: whole numbers and byte budgets (``80GB``), checked once.

One clear line naming the value and the accepted form for anything else. Pure; never
imports torch.
"""

from __future__ import annotations

import math
from typing import Any

from nbgpu.errors import UserInputError

__all__ = ["parse_bytes", "whole_number"]


# ------------------------------------------------------------------------------ inputs


def whole_number(label: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserInputError(f"{label}={value!r}: expected a whole number >= {minimum}")
    return value


_BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9}
_BYTE_UNITS |= {"gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20}
_BYTE_UNITS |= {"gib": 2**30, "tib": 2**40}


def parse_bytes(value: Any, label: str = "budget") -> int:
    """``80e9``, ``"80GB"``, ``"24 GiB"`` -> bytes; anything else is one clear line."""
    import re  # noqa: PLC0415  (only when a size string is parsed)

    if isinstance(value, int | float) and not isinstance(value, bool):
        if value > 0 and math.isfinite(value):
            return int(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _BYTE_UNITS and float(m.group(1)) > 0:
            return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()])
    raise UserInputError(
        f"{label}={value!r}: expected a positive size in bytes (80e9, '80GB', '24GiB')"
    )
