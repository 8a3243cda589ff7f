"""A config's values: flat entries found by their last name, typed override text, bash arithmetic.

Nested YAML, flat ``a.b.c`` keys and Hydra overrides all become the same :class:`Entry` list, so the
rules match a key by its last name anywhere in the config. A launch script's ``$((...))`` is
evaluated over whole numbers by Python's ``ast``. Pure text; never reads files nor executes code.
"""

import ast
import functools
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nbgpu.errors import UserInputError

__all__ = ["Entry", "arithmetic", "config_model_len", "device_count", "entries_of", "find_entry",
           "int_of", "override_text", "parse_overrides", "parse_value", "set_value", "short_text",
           "value_text"]  # fmt: skip


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


def entries_of(config: Mapping[str, Any], path: tuple[Any, ...] = ()) -> list[Entry]:
    out: list[Entry] = []
    for key, value in config.items():
        here = (*path, key)
        if isinstance(value, Mapping) and value:
            out += entries_of(value, here)
        else:
            out.append(Entry(here, ".".join(str(k).lstrip("+~") for k in here), value))
    return out


def set_value(config: Any, path: tuple[Any, ...], value: Any) -> None:
    functools.reduce(operator.getitem, path[:-1], config)[path[-1]] = value


def find_entry(entries: Sequence[Entry], suffix: str) -> Entry | None:
    return next((e for e in entries if e.dotted == suffix or e.dotted.endswith("." + suffix)), None)


def int_of(entry: Entry | None, default: int) -> int:
    value = None if entry is None else entry.value
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return default


def device_count(value: Any) -> int | None:
    if isinstance(value, str):
        return len([v for v in value.split(",") if v.strip()]) or None
    if isinstance(value, list | tuple):
        return len(value) or None
    return 1 if isinstance(value, int) and not isinstance(value, bool) else None


def config_model_len(entries: Sequence[Entry], value: Any) -> int | None:
    # value: an entry's value once scaled, None for no entry (ScaleContext.now)
    explicit = value(find_entry(entries, "max_model_len"))
    if isinstance(explicit, int):
        return int(explicit)
    for prompt_key, response_key in (
        ("max_prompt_length", "max_response_length"),
        ("prompt_length", "response_length"),
    ):
        prompt, response = (value(find_entry(entries, k)) for k in (prompt_key, response_key))
        if isinstance(prompt, int) and isinstance(response, int):
            return prompt + response
    return None


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
    text = value_text(value)
    if isinstance(value, list | tuple):
        text = text.replace(",", ", ")
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


_ARITH_OPS: Mapping[type, Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    # bash divides whole numbers, truncating toward zero
    ast.Div: lambda a, b: int(a / b),
    ast.FloorDiv: lambda a, b: int(a / b),
    ast.Mod: lambda a, b: a - b * int(a / b),
}


def arithmetic(expression: str, lookup: Callable[[str], int | None]) -> int | None:
    """bash's ``$(( ))`` on whole numbers (+ - * / %, parentheses, variables), or None."""
    plain = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", r"\1", expression)
    try:
        tree = ast.parse(plain.strip(), mode="eval")
    except SyntaxError:
        return None

    def walk(node: ast.AST) -> int | None:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name):
            return lookup(node.id)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            inner = walk(node.operand)
            return None if inner is None else (-inner if isinstance(node.op, ast.USub) else inner)
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH_OPS:
            left, right = walk(node.left), walk(node.right)
            if left is None or right is None:
                return None
            if right == 0 and isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod):
                return None
            return _ARITH_OPS[type(node.op)](left, right)
        return None

    return walk(tree.body)
