"""Frozen dataclasses to JSON-ready data and back, driven by their type hints.

Plans travel as JSON (``nbgpu plan --json > p.json``, ``nbgpu run --plan p.json``), so
every field must come back exactly. Instead of a hand-written loader per class, the field
annotations say what to build: ``int``, ``str``, ``float``, ``bool``, ``X | None``,
``tuple[X, ...]``, fixed tuples and nested dataclasses. A wrong document raises one
``UserInputError`` line naming the field path (``roles[1].gpus[0].uuid``).

Derived values a reader may want (a role's ``cuda_visible_devices``) are written too,
listed in a class's ``JSON_EXTRAS``; they are recomputed, never read back.

Pure: standard library and ``nbgpu.errors`` only.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar, Union

from nbgpu.errors import UserInputError

__all__ = ["from_data", "to_data"]

T = TypeVar("T")


def to_data(value: Any) -> Any:
    """Dataclasses become dicts (plus their ``JSON_EXTRAS``), tuples become lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {f.name: to_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
        for extra in getattr(value, "JSON_EXTRAS", ()):
            out[extra] = to_data(getattr(value, extra))
        return out
    if isinstance(value, tuple | list):
        return [to_data(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_data(v) for k, v in value.items()}
    return value


def _kind(tp: Any) -> str:
    names = {int: "a whole number", str: "a string", float: "a number", bool: "true/false"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def _convert(tp: Any, data: Any, where: str, prefix: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if data is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, data, where, prefix)
            except UserInputError as exc:
                errors.append(str(exc))
        raise UserInputError(errors[0] if errors else f"{prefix}: {where} is null")
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(data, list):
            raise UserInputError(f"{prefix}: {where} = {data!r} is not a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{where}[{i}]", prefix) for i, v in enumerate(data))
        if len(data) != len(args):
            raise UserInputError(f"{prefix}: {where} has {len(data)} items; expected {len(args)}")
        return tuple(
            _convert(a, v, f"{where}[{i}]", prefix)
            for i, (a, v) in enumerate(zip(args, data, strict=True))
        )
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return from_data(tp, data, where=where, prefix=prefix)
    if tp is float and isinstance(data, int | float) and not isinstance(data, bool):
        return float(data)
    if tp is Any:
        return data
    if isinstance(tp, type) and isinstance(data, tp) and not (tp is int and isinstance(data, bool)):
        return data
    raise UserInputError(f"{prefix}: {where} = {data!r} is not {_kind(tp)}")


def from_data(cls: type[T], data: Any, *, where: str = "top level", prefix: str = "JSON") -> T:
    """Build *cls* from :func:`to_data` output; unknown keys are ignored (newer writers)."""
    if not isinstance(data, dict):
        raise UserInputError(f"{prefix}: {where} is not an object")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(typing.cast(Any, cls)):  # callers pass dataclass types
        path = f.name if where == "top level" else f"{where}.{f.name}"
        if f.name not in data:
            has_default = (
                f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            )
            if has_default:
                continue
            raise UserInputError(f"{prefix}: {where} has no {f.name!r}")
        kwargs[f.name] = _convert(hints[f.name], data[f.name], path, prefix)
    return cls(**kwargs)
