"""How config values read and print: YAML typing of override text, Hydra's override
syntax, and a value as a config or a command line writes it.

Shared by the scaler and the launch-script and config-file rewriters. Pure text; never
reads files nor imports the inventory.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from nbgpu.errors import UserInputError

__all__ = ["override_text", "parse_overrides", "parse_value", "short_text", "value_text"]


def value_text(value: Any) -> str:
    """A value as written in a config or a command line: ``4``, ``0.34``, ``true``, ``[0,1]``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ",".join(value_text(v) for v in value) + "]"
    return str(value)


def short_text(value: Any) -> str:
    text = value_text(value).replace(",", ", ") if isinstance(value, list | tuple) else None
    text = text or value_text(value)
    return text if len(text) <= 24 else text[:23] + "…"


# Hydra reads a bare comma as a sweep (a=1,2) and these characters as its grammar.
_HYDRA_SPECIAL = re.compile(r"[,\s'\"\\()\[\]{}:=]")


def override_text(value: Any) -> str:
    if isinstance(value, str) and _HYDRA_SPECIAL.search(value):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return value_text(value)


def parse_value(text: str) -> Any:
    """An override or shell value typed as YAML would type it (``4`` → int, ``0.3`` → float)."""
    raw = text.strip()
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
        return raw[1:-1]
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("null", "none", "~"):
        return None
    if re.fullmatch(r"[-+]?\d+", raw):
        return int(raw)
    if re.fullmatch(r"[-+]?(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?", raw):
        return float(raw)
    if raw.startswith("[") and raw.endswith("]"):
        return [parse_value(v) for v in raw[1:-1].split(",") if v.strip()]
    return raw


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """Hydra-style ``key.path=value`` strings → a flat dict (values typed like YAML)."""
    out: dict[str, Any] = {}
    for item in overrides:
        key, sep, value = str(item).partition("=")
        if not sep or not key.strip():
            raise UserInputError(
                f"override {item!r}: expected key=value such as data.train_batch_size=4"
            )
        out[key.strip()] = parse_value(value)
    return out
