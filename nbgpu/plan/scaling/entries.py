"""A config as a flat list of entries (dotted key, last name, value), found by suffix.

Nested YAML, flat ``a.b.c`` keys and Hydra overrides all become the same entries, so the
rules can match a key by its last name anywhere in the config. Pure; never reads files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Entry", "device_count", "entries_of", "find_entry", "int_of", "set_value"]


# ---------------------------------------------------------------------- config access


@dataclass(frozen=True)
class Entry:
    path: tuple[Any, ...]  # keys into the nested structure
    dotted: str  # "a.b.c" without Hydra's +/~ prefixes
    value: Any

    @property
    def leaf(self) -> str:
        return self.dotted.rsplit(".", 1)[-1]

    @property
    def parent(self) -> str:
        return self.dotted.rpartition(".")[0]


def entries_of(config: Mapping[str, Any]) -> list[Entry]:
    out: list[Entry] = []

    def walk(node: Mapping[str, Any], path: tuple[Any, ...]) -> None:
        for key, value in node.items():
            here = (*path, key)
            if isinstance(value, Mapping) and value:
                walk(value, here)
            else:
                dotted = ".".join(str(k).lstrip("+~") for k in here)
                out.append(Entry(here, dotted, value))

    walk(config, ())
    return out


def set_value(config: Any, path: tuple[Any, ...], value: Any) -> None:
    node = config
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def find_entry(entries: Sequence[Entry], suffix: str) -> Entry | None:
    for e in entries:
        if e.dotted == suffix or e.dotted.endswith("." + suffix):
            return e
    return None


def int_of(entry: Entry | None, default: int) -> int:
    if entry is None:
        return default
    value = entry.value
    return (
        value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default
    )


def device_count(value: Any) -> int | None:
    if isinstance(value, str):
        return len([v for v in value.split(",") if v.strip()]) or None
    if isinstance(value, list | tuple):
        return len(value) or None
    if isinstance(value, int) and not isinstance(value, bool):
        return 1
    return None
