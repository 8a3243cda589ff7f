"""The names a warm job's rank holds, described without their values: each user variable's
type and a size cheap to get (a tensor's or array's shape, dtype and bytes; a torch
module's parameters; a container's length; ``sys.getsizeof`` otherwise). Nothing is
imported to describe a value. Standard library only.
"""

from __future__ import annotations

import sys
import types
from typing import Any

__all__ = ["MAX_NAMES", "held_names"]

MAX_NAMES = 200  # a rank's answer stays small whatever the cell defined
_SIZED = (list, tuple, dict, set, frozenset, str, bytes, bytearray)
_ARRAY_LIBRARIES = ("torch", "numpy", "jax", "cupy")  # whose .shape/.dtype/.nbytes are cheap


def held_names(namespace: dict[str, Any]) -> dict[str, Any]:
    """``{"names": [{name, type, ...size}], "total": N}``: the first MAX_NAMES user names
    (no modules, no dunders), sorted; ``total`` counts them all."""
    names = sorted(
        name
        for name, value in namespace.items()
        if not name.startswith("__") and not isinstance(value, types.ModuleType)
    )
    shown = [describe(name, namespace[name]) for name in names[:MAX_NAMES]]
    return {"names": shown, "total": len(names)}


def describe(name: str, value: Any) -> dict[str, Any]:
    kind = type(value)
    entry: dict[str, Any] = {"name": name, "type": kind.__qualname__}
    try:
        if kind.__module__.split(".")[0] in _ARRAY_LIBRARIES and hasattr(value, "shape"):
            size = {
                "shape": [int(n) for n in value.shape],
                "dtype": str(value.dtype).removeprefix("torch."),
                "bytes": int(value.nbytes),
            }
        elif any(c.__module__ == "torch.nn.modules.module" for c in kind.__mro__):
            # A model's own object is small: its parameters are what it holds.
            params = list(value.parameters())
            size = {
                "params": sum(p.numel() for p in params),
                "bytes": sum(p.nbytes for p in params),
            }
        elif isinstance(value, _SIZED):
            size = {"len": len(value)}
        else:
            size = {"bytes": sys.getsizeof(value)}
    except Exception:  # noqa: BLE001  (an odd object is listed without a size, never fatal)
        size = {}
    return {**entry, **size}
