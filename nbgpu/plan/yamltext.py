"""A small, deterministic YAML writer for configs: mappings, lists and scalars.

``scale()`` must print "the new YAML" without requiring PyYAML (not a dependency of
nbgpu). Configs are trees of mappings, lists and scalars, so a writer for exactly that is
short. Strings are written plain only when YAML 1.1 (PyYAML) would read them back as the
same string; otherwise JSON-quoted, which YAML reads as a double-quoted scalar. Floats
always carry a dot (PyYAML reads ``1e-06`` as a string). Lists of scalars use flow style
(``[0, 1, 2, 3]``), like verl's configs. Comments of the input are not kept.

Pure: standard library only; never reads or writes files.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["dump_yaml", "format_scalar"]

_PLAIN = re.compile(r"^[A-Za-z_/][\w./-]*$")
# PyYAML (YAML 1.1) reads these plain words as booleans or null, so they are quoted.
# It does not resolve single-letter y/n, and verl's rollout key is literally ``n``.
_RESERVED = frozenset({"yes", "no", "on", "off", "true", "false", "null", "nan", "inf", "~"})
_NUMBERISH = re.compile(r"^[-+]?(\.?\d|\.inf|\.nan)", re.IGNORECASE)


def _float(value: float) -> str:
    if math.isnan(value):
        return ".nan"
    if math.isinf(value):
        return ".inf" if value > 0 else "-.inf"
    text = repr(value)
    if "e" in text:
        mantissa, exponent = text.split("e")
        if "." not in mantissa:
            mantissa += ".0"
        sign = "" if exponent[0] in "+-" else "+"
        return f"{mantissa}e{sign}{exponent}"
    return text


def format_scalar(value: Any) -> str:
    """One scalar as YAML text that reads back as the same value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _float(value)
    text = str(value)
    if _PLAIN.match(text) and text.lower() not in _RESERVED and not _NUMBERISH.match(text):
        return text
    return json.dumps(text, ensure_ascii=False)


def _is_scalar(value: Any) -> bool:
    return not isinstance(value, Mapping | list | tuple)


def _emit(value: Any, indent: int, lines: list[str]) -> None:
    pad = "  " * indent
    if isinstance(value, Mapping):
        for key, item in value.items():
            head = f"{pad}{format_scalar(key)}:"
            if (isinstance(item, Mapping) and item) or (
                isinstance(item, list | tuple) and item and not all(map(_is_scalar, item))
            ):
                lines.append(head)
                _emit(item, indent + 1, lines)
            else:
                lines.append(f"{head} {_inline(item)}")
        return
    for item in value:  # a list with at least one mapping or list inside
        if isinstance(item, Mapping) and item:
            inner: list[str] = []
            _emit(item, indent + 1, inner)
            lines.append(f"{pad}- {inner[0].lstrip()}")
            lines.extend(inner[1:])
        else:
            lines.append(f"{pad}- {_inline(item)}")


def _inline(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{format_scalar(k)}: {_inline(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_inline(v) for v in value) + "]"
    return format_scalar(value)


def dump_yaml(data: Any) -> str:
    """The YAML text of *data* (a mapping, usually), ending in a newline."""
    if not isinstance(data, Mapping | list | tuple) or not data:
        return _inline(data) + "\n"
    lines: list[str] = []
    _emit(data, 0, lines)
    return "\n".join(lines) + "\n"
