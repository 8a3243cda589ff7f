"""Reading the files a plan starts from: a config to scale, a saved plan.

The one module of ``plan/`` that opens files, so everything else stays pure. JSON is read
with the standard library; YAML needs PyYAML, imported only when a YAML file is read (it
is not a dependency of nbgpu: without it, pass the config as a dict). Every failure is one
``UserInputError`` line naming the file and what was expected.

Imports only the standard library and ``nbgpu.errors`` (PyYAML lazily); never the
inventory, sockets or processes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from nbgpu.errors import UserInputError

__all__ = ["load_config", "read_text"]


def read_text(path: str | os.PathLike[str], what: str = "file") -> str:
    p = Path(path).expanduser()
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserInputError(f"{what} {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise UserInputError(f"{what} {str(path)!r} is a directory, not a file") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise UserInputError(f"{what} {str(path)!r} cannot be read: {reason}") from None


def load_config(path: str | os.PathLike[str]) -> Any:
    """A YAML or JSON config file as plain data (dicts, lists, scalars)."""
    text = read_text(path, "config")
    name = str(path)
    if name.endswith(".json"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserInputError(
                f"config {name!r} is not valid JSON (line {exc.lineno}: {exc.msg})"
            ) from None
    try:
        import yaml  # type: ignore[import-untyped]  # noqa: PLC0415  (optional; only for YAML)
    except ImportError:
        raise UserInputError(
            f"config {name!r}: reading YAML needs PyYAML (`pip install pyyaml`); or pass the "
            "config as a dict, or as a .json file"
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise UserInputError(f"config {name!r} is not valid YAML{where}") from None
