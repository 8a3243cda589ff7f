"""What an estimate accepts: whole numbers and byte budgets (``80GB``, read by :mod:`nbgpu.sizes`), checked once.

One clear line naming the value and the accepted form for anything else. Pure; never
imports torch.
"""

from __future__ import annotations

from typing import Any

from nbgpu.errors import UserInputError
from nbgpu.sizes import parse_size

__all__ = ["parse_bytes", "whole_number"]


# ------------------------------------------------------------------------------ inputs


def whole_number(label: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserInputError(f"{label}={value!r}: expected a whole number >= {minimum}")
    return value


def parse_bytes(value: Any, label: str = "budget") -> int:
    """A byte budget as written (``80e9``, ``"80GB"``, ``"24GiB"``; :mod:`nbgpu.sizes`)."""
    return parse_size(value, f"{label}=")
