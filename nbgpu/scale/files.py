"""A config as its file holds it (YAML, JSON or a launch script), and the same file rescaled.

``scaler.py`` works on data; the user works on a file with comments, a key order, quotes and line
continuations. :func:`rescaled_text` writes the new values back into the file's text and nowhere
else, in its own form: YAML through ruamel.yaml's round trip (``yamldoc.py``), a launch script where
bash reads each value (:func:`rewrite_script`), JSON with the file's indentation and key order.

:func:`read_text` and :func:`write_text` are the one place planning opens files (a config,
a plan file, a cluster file): every failure is one ``UserInputError`` line naming the file.
Never imports the inventory, sockets or processes.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from nbgpu.errors import UserInputError, user_path
from nbgpu.scale.values import value_text

# The shell lexer and ruamel.yaml load when a config is read, not with this module or read_text.
if TYPE_CHECKING:
    from nbgpu.scale.script import LaunchScript, ScriptValue

__all__ = ["ConfigSource", "Rescaled", "load_config", "parse_json", "read_config", "read_text",
           "rescaled_text", "rewrite_script", "write_text"]  # fmt: skip


def read_text(path: str | os.PathLike[str], what: str = "file") -> str:
    p = user_path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserInputError(f"{what} {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise UserInputError(f"{what} {str(path)!r} is a directory, not a file") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise UserInputError(f"{what} {str(path)!r} cannot be read: {reason}") from None


def write_text(path: str | os.PathLike[str], text: str, *, like: str | None = None) -> None:
    """Write *text* to *path*; a script keeps the permissions of the one it came from."""
    p = user_path(path)
    try:
        p.write_text(text, encoding="utf-8")
        if like is not None and Path(like).exists():
            p.chmod(Path(like).stat().st_mode & 0o777)
    except OSError as exc:
        raise UserInputError(f"cannot write {str(path)!r}: {exc.strerror}") from None


def parse_json(text: str, where: str) -> Any:
    """*text* as JSON, or one line naming *where* and the place the JSON breaks."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        place = f"line {exc.lineno}, column {exc.colno}"
        raise UserInputError(f"{where} is not valid JSON ({place}: {exc.msg})") from None


@dataclass(frozen=True)
class ConfigSource:
    form: str  # "yaml" | "json" | "script"
    name: str
    text: str
    data: Any
    script: LaunchScript | None = None


def read_config(text: str, name: str) -> ConfigSource:
    """Read a config's text by its form (a ``.json`` name, a shell script, else YAML)."""
    from nbgpu.scale.script import looks_like_script, read_script  # noqa: PLC0415
    from nbgpu.scale.yamldoc import load_yaml  # noqa: PLC0415

    where = f"config {name!r}"
    if name.endswith(".json"):
        return ConfigSource("json", name, text, parse_json(text, where))
    if looks_like_script(text, name):
        script = read_script(text, where)
        return ConfigSource("script", name, text, script.config(), script)
    return ConfigSource("yaml", name, text, load_yaml(text, where, plain=True))


class Rescaled(Protocol):
    """What rewriting needs of a scale plan (the plan's module saves through this one)."""

    @property
    def config(self) -> Any: ...
    @property
    def steps(self) -> tuple[Any, ...]: ...
    @property
    def changes(self) -> tuple[Any, ...]: ...


def rescaled_text(source: ConfigSource, plan: Rescaled) -> tuple[str, list[str]]:
    """The file with the plan's new values; and notes on expressions a script had to lose."""
    if source.form == "yaml":
        from nbgpu.scale.yamldoc import rewrite_yaml  # noqa: PLC0415

        changes: Mapping[tuple[Any, ...], Any] = {s.path: s.new for s in plan.changes}
        return rewrite_yaml(source.text, changes, f"config {source.name!r}"), []
    if source.form == "json":
        end = "\n" if source.text.endswith("\n") else ""
        m = re.search(r"\n([ \t]+)\"", source.text)  # the file's own indentation
        indent = len(m.group(1).expandtabs()) if m else None
        return json.dumps(plan.config, indent=indent, ensure_ascii=False) + end, []
    assert source.script is not None  # noqa: S101  (a script is read with its LaunchScript)
    changed = {str(s.path[0]): value_text(s.new) for s in plan.changes}
    kept = {str(s.path[0]): value_text(s.new) for s in plan.steps if not s.changed}
    return rewrite_script(source.script, changed, kept)


def load_config(path: str | os.PathLike[str]) -> Any:
    """A YAML or JSON config file as plain data (dicts, lists, scalars)."""
    return read_config(read_text(path, "config"), os.fspath(path)).data


@dataclass(frozen=True)
class _Edit:
    start: int
    end: int
    text: str
    key: str


def _edit_for(
    script: LaunchScript, value: ScriptValue, new: str, key: str, depth: int = 0
) -> _Edit | None:
    """Where to write *new* so that *value* (of *key*) becomes it, or None (an expression)."""
    parts = value.parts
    if not parts or (len(parts) == 1 and parts[0].kind == "literal"):
        start, end = (parts[0].start, parts[0].end) if parts else (value.start, value.end)
        return _Edit(start, end, new, key)
    if len(parts) == 1 and parts[0].kind == "var" and depth < 20:
        part = parts[0]
        assigned = script.variable(part.text, value.at)
        if assigned is not None:
            return _edit_for(script, assigned.value, new, key, depth + 1)
        if part.default is not None:
            return _Edit(part.default[0], part.default[1], new, key)
    return None


def _added(script: LaunchScript, key: str, new: str) -> _Edit | None:
    """A new override written after the word of its GPUs per node (``trainer.nnodes`` after
    ``trainer.n_gpus_per_node``), else after the last; only after an unquoted word, where a
    space starts the next argument."""
    words = {k: v for k, v in script.overrides.items() if script.text[v.end : v.end + 1].isspace()}
    near = words.get(f"{key.rpartition('.')[0]}.n_gpus_per_node".lstrip("."))
    near = near or next(reversed(words.values()), None)
    return None if near is None else _Edit(near.end, near.end, f" {key}={new}", key)


def _variable_at(script: LaunchScript, position: int) -> str | None:
    holds = (
        a.name
        for a in script.assignments
        if a.value.start <= position < max(a.value.end, a.value.start + 1)
    )
    return next(holds, None)


def _apply(text: str, edits: list[_Edit]) -> str:
    for edit in sorted(edits, key=lambda e: e.start, reverse=True):
        text = text[: edit.start] + edit.text + text[edit.end :]
    return text


def rewrite_script(
    script: LaunchScript, changes: Mapping[str, str], unchanged: Mapping[str, str] | None = None
) -> tuple[str, list[str]]:
    """The script with *changes* (key → new value text); and notes about what else moved.

    A value is changed where it is written: its literal, its variable's assignment, the default
    of ``${VAR:-4}``. Any key of *changes* or *unchanged* (key → the value it must keep) that the
    new script does not resolve as intended (an expression, a variable shared with a key that
    needs another value) gets its own literal, with a note.
    """
    from nbgpu.scale.script import NAME, read_script  # noqa: PLC0415

    targets = {**(unchanged or {}), **changes}
    edits: dict[tuple[int, int], _Edit] = {}
    for key, new in changes.items():
        value = script.value_of(key)
        if value is None:  # a key the script leaves at its default (trainer.nnodes)
            edit = _added(script, key, new)
        else:
            edit = _edit_for(script, value, new, key)
        if edit is None:
            continue
        if (edit.start, edit.end) in edits and edits[(edit.start, edit.end)].text != new:
            continue  # another key already moves this variable; pinned below
        edits[(edit.start, edit.end)] = edit
    text = _apply(script.text, list(edits.values()))
    again = read_script(text)
    pins: list[_Edit] = []
    notes: list[str] = []
    for key, new in targets.items():
        value = again.value_of(key)
        if value is None or again.resolve(value, split=key in again.overrides) == new:
            continue
        written = text[value.start : value.end]
        pins.append(_Edit(value.start, value.end, new, key))
        # The variables it reads: by name, or inside $((...)).
        read = {n for p in value.parts if p.kind in ("var", "arith") for n in NAME.findall(p.text)}
        movers = [
            e.key for e in edits.values() if e.key != key and _variable_at(script, e.start) in read
        ]
        where = f"{key} (line {value.line})"
        if key in changes and not movers:
            notes.append(f"{where}: the expression {written} was replaced by the value {new}")
        else:
            notes.append(
                f"{where}: {written} is shared with {', '.join(movers) or 'other keys'}, "
                f"which change it; {key} now has its own value {new}"
            )
    return _apply(text, pins), notes
