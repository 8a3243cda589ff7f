"""Frozen dataclasses to JSON-ready data and back, driven by their type hints.

Plans and fleets travel as JSON (``nbgpu plan --json > p.json``, ``nbgpu status --json >
pod.json``), so every field must come back exactly. A wrong document raises one line
naming the field path (``gpus[1].processes[0].pid``) and what is accepted there, a class's
own ``__post_init__`` ``ValueError`` (``"field = value; expected ..."``) included.
Derived values in a class's ``JSON_EXTRAS`` (a role's ``cuda_visible_devices``) are
written too, never read back. Standard library and ``nbgpu.errors`` only: every layer
may use it.
"""

import dataclasses
import functools
import json
import reprlib
import types
import typing
from collections.abc import Hashable
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

from nbgpu.errors import UserInputError

__all__ = ["from_data", "read_json_object", "to_data"]

T = TypeVar("T")


def to_data(value: Any) -> Any:
    """Dataclasses become dicts (plus their ``JSON_EXTRAS``), tuples and sets lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {f.name: to_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
        for extra in getattr(value, "JSON_EXTRAS", ()):
            out[extra] = to_data(getattr(value, extra))
        return out
    if isinstance(value, frozenset | set):
        return sorted(to_data(v) for v in value)
    if isinstance(value, tuple | list):
        return [to_data(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_data(v) for k, v in value.items()}
    return value


class _Reader:
    def __init__(self, prefix: str, error: type[UserInputError]) -> None:
        self.prefix = prefix
        self.error = error

    def fail(self, text: str) -> UserInputError:
        return self.error(f"{self.prefix}: {text}")

    def convert(self, tp: Any, data: Any, where: str) -> Any:
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
                    return self.convert(option, data, where)
                except UserInputError as exc:
                    errors.append(exc)
            raise errors[0] if errors else self.fail(f"{where} is null")
        if origin is Literal:
            words = typing.get_args(tp)
            if data in words and not isinstance(data, bool):
                return data
            raise self.fail(
                f"{where} = {reprlib.repr(data)}; expected one of {', '.join(map(str, words))}"
            )
        if origin in (tuple, frozenset):
            return self._sequence(tp, origin, data, where)
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            return self.build(tp, data, where)
        if tp is float and isinstance(data, int | float) and not isinstance(data, bool):
            return float(data)
        if tp is Any:
            return data
        if (
            isinstance(tp, type)
            and isinstance(data, tp)
            and not (tp is int and isinstance(data, bool))
        ):
            return data
        names = {int: "a whole number", str: "a string", float: "a number", bool: "true/false"}
        kind = names.get(tp, getattr(tp, "__name__", str(tp)))
        raise self.fail(f"{where} = {reprlib.repr(data)} is not {kind}")

    def _sequence(self, tp: Any, origin: Any, data: Any, where: str) -> Any:
        args = typing.get_args(tp)
        if not isinstance(data, list):
            raise self.fail(f"{where} = {reprlib.repr(data)} is not a list")
        if origin is frozenset or (len(args) == 2 and args[1] is Ellipsis):
            items = (self.convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(data))
            return frozenset(items) if origin is frozenset else tuple(items)
        if len(data) != len(args):
            raise self.fail(f"{where} has {len(data)} items; expected {len(args)}")
        return tuple(
            self.convert(a, v, f"{where}[{i}]")
            for i, (a, v) in enumerate(zip(args, data, strict=True))
        )

    def build(self, cls: type[T], data: Any, where: str) -> T:
        if not isinstance(data, dict):
            raise self.fail(f"{where} is not an object")
        hints = _type_hints(typing.cast(Hashable, cls))
        kwargs = {}
        for f in dataclasses.fields(typing.cast(Any, cls)):  # callers pass dataclass types
            path = f.name if where == "top level" else f"{where}.{f.name}"
            has_default = (
                f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            )
            value = data.get(f.name)
            # null for a field that cannot be null means "not given" when it has a default.
            if f.name not in data or (
                value is None and has_default and not _nullable(hints[f.name])
            ):
                if has_default:
                    continue
                raise self.fail(f"{where} has no {f.name!r}")
            kwargs[f.name] = self.convert(hints[f.name], value, path)
        try:
            return cls(**kwargs)
        except UserInputError:
            raise
        except ValueError as exc:  # the class's own check: "pid = -3; expected ..."
            at = "" if where == "top level" else f"{where}."
            raise self.fail(f"{at}{exc}") from None


@functools.cache
def _type_hints(cls: Hashable) -> dict[str, Any]:
    # Resolving string annotations is most of reading a fleet file (`nbgpu status` with a
    # simulated fleet: bench/RESULTS.md section 2); a class's hints never change.
    return typing.get_type_hints(cls)


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in *path*; empty when the file is missing, unreadable or not an object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _nullable(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType) and type(None) in typing.get_args(tp)


def from_data(
    cls: type[T],
    data: Any,
    *,
    where: str = "top level",
    prefix: str = "JSON",
    error: type[UserInputError] = UserInputError,
) -> T:
    """Build *cls* from :func:`to_data` output; unknown keys are ignored (newer writers).
    Every mistake raises *error* as one line starting with *prefix*."""
    return _Reader(prefix, error).build(cls, data, where)
