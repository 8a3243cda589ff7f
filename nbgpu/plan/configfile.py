"""A config as its file holds it (YAML, JSON or a launch script), and the same file rescaled.

``scale.py`` works on data; the user works on a file with comments, a key order, quotes
and line continuations. :func:`read_config` keeps the file's text next to its data, and
:func:`rescaled_text` writes the new values back into that text and nowhere else, in the
file's own form: YAML through ruamel.yaml's round trip (``yamldoc.py``), a launch script
by editing the values where they are written (``launchscript.py``), JSON with the file's
indentation and key order.

Pure: text in, text out; never opens files (``files.py`` reads and writes them) nor imports
the inventory, sockets or processes.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nbgpu.errors import UserInputError
from nbgpu.plan.files import read_text
from nbgpu.plan.launchscript import LaunchScript, looks_like_script, read_script
from nbgpu.plan.scriptedit import rewrite_script
from nbgpu.plan.values import value_text
from nbgpu.plan.yamldoc import load_yaml, rewrite_yaml, to_plain

if TYPE_CHECKING:
    from nbgpu.plan.scaling import ScalePlan

__all__ = ["ConfigSource", "load_config", "read_config", "rescaled_text"]


@dataclass(frozen=True)
class ConfigSource:
    """A config file: its form, its text and its data."""

    form: str  # "yaml" | "json" | "script"
    name: str
    text: str
    data: Any
    script: LaunchScript | None = None


def read_config(text: str, name: str) -> ConfigSource:
    """Read a config's text by its form (a ``.json`` name, a shell script, else YAML)."""
    where = f"config {name!r}"
    if name.endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserInputError(
                f"{where} is not valid JSON (line {exc.lineno}: {exc.msg})"
            ) from None
        return ConfigSource("json", name, text, data)
    if looks_like_script(text, name):
        script = read_script(text, where)
        return ConfigSource("script", name, text, script.config(), script)
    return ConfigSource("yaml", name, text, to_plain(load_yaml(text, where)))


def _json_indent(text: str) -> int | None:
    m = re.search(r"\n([ \t]+)\"", text)
    return len(m.group(1).expandtabs()) if m else None


def rescaled_text(source: ConfigSource, plan: ScalePlan) -> tuple[str, list[str]]:
    """The file with the plan's new values; and notes on expressions a script had to lose."""

    if source.form == "yaml":
        changes: Mapping[tuple[Any, ...], Any] = {s.path: s.new for s in plan.changes}
        return rewrite_yaml(source.text, changes, f"config {source.name!r}"), []
    if source.form == "json":
        end = "\n" if source.text.endswith("\n") else ""
        return json.dumps(
            plan.config, indent=_json_indent(source.text), ensure_ascii=False
        ) + end, []
    if source.script is None:  # a script is always read with its LaunchScript
        raise TypeError(f"{source.name}: a script without its reading")
    changed = {str(s.path[0]): value_text(s.new) for s in plan.changes}
    kept = {str(s.path[0]): value_text(s.new) for s in plan.steps if not s.changed}
    return rewrite_script(source.script, changed, kept)


def load_config(path: str | os.PathLike[str]) -> Any:
    """A YAML or JSON config file as plain data (dicts, lists, scalars)."""
    return read_config(read_text(path, "config"), os.fspath(path)).data
