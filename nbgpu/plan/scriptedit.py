"""Rewriting a launch script: each changed value edited where bash reads it.

A literal is replaced in place; a value that comes from a variable is changed at the
variable's assignment when every reader of it moves together, else the key gets its own
literal (with a note). Pure text; never runs the script nor reads files.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from nbgpu.plan.launchscript import NAME, LaunchScript, ScriptValue, read_script

__all__ = ["rewrite_script"]


@dataclass(frozen=True)
class _Edit:
    start: int
    end: int
    text: str
    key: str


def _edit_for(script: LaunchScript, value: ScriptValue, new: str, depth: int = 0) -> _Edit | None:
    """Where to write *new* so that *value* becomes it, or None (an expression)."""
    parts = value.parts
    if not parts or (len(parts) == 1 and parts[0].kind == "literal"):
        start, end = (parts[0].start, parts[0].end) if parts else (value.start, value.end)
        return _Edit(start, end, new, "")
    if len(parts) == 1 and parts[0].kind == "var" and depth < 20:
        part = parts[0]
        assigned = script.variable(part.text, value.at)
        if assigned is not None:
            return _edit_for(script, assigned.value, new, depth + 1)
        if part.default is not None:
            start, end, _ = part.default
            return _Edit(start, end, new, "")
    return None


def _value_of_key(script: LaunchScript, key: str) -> ScriptValue | None:
    if key in script.overrides:
        return script.overrides[key]
    assigned = script.variable(key, script.command_at + 1)
    return None if assigned is None else assigned.value


def _variables_read(value: ScriptValue) -> set[str]:
    names = {p.text for p in value.parts if p.kind == "var"}
    for p in value.parts:
        if p.kind == "arith":
            names.update(NAME.findall(p.text))
    return names


def _variable_at(script: LaunchScript, position: int) -> str | None:
    """The variable whose assignment holds *position*, if any."""
    for a in script.assignments:
        if a.value.start <= position < max(a.value.end, a.value.start + 1):
            return a.name
    return None


def _apply(text: str, edits: list[_Edit]) -> str:
    for edit in sorted(edits, key=lambda e: e.start, reverse=True):
        text = text[: edit.start] + edit.text + text[edit.end :]
    return text


def rewrite_script(
    script: LaunchScript, changes: Mapping[str, str], unchanged: Mapping[str, str] | None = None
) -> tuple[str, list[str]]:
    """The script with *changes* (key → new value text); and notes about what else moved.

    Keys are overrides as read (or ``CUDA_VISIBLE_DEVICES``). A value is changed where it is
    written: its literal, the assignment of the variable it reads, the default of
    ``${VAR:-4}``. Then the new script is read again, and every key of *changes* and of
    *unchanged* (key → the value it must keep) that does not come out as intended (an
    expression, or a variable shared with a key that needs another value) gets its own
    literal in place of what it had, with a note.
    """
    targets = {**(unchanged or {}), **changes}
    edits: dict[tuple[int, int], _Edit] = {}
    for key, new in changes.items():
        value = _value_of_key(script, key)
        edit = None if value is None else _edit_for(script, value, new)
        if edit is None:
            continue
        if (edit.start, edit.end) in edits and edits[(edit.start, edit.end)].text != new:
            continue  # another key already moves this variable; pinned below
        edits[(edit.start, edit.end)] = _Edit(edit.start, edit.end, new, key)
    text = _apply(script.text, list(edits.values()))
    again = read_script(text)
    pins: list[_Edit] = []
    notes: list[str] = []
    for key, new in targets.items():
        value = _value_of_key(again, key)
        if value is None or again.resolve(value, split=key in again.overrides) == new:
            continue
        written = text[value.start : value.end]
        pins.append(_Edit(value.start, value.end, new, key))
        read = _variables_read(value)
        movers = [
            e.key for e in edits.values() if e.key != key and _variable_at(script, e.start) in read
        ]
        if key in changes and not movers:
            notes.append(
                f"{key} (line {value.line}): the expression {written} was replaced by the value "
                f"{new}"
            )
        else:
            notes.append(
                f"{key} (line {value.line}): {written} is shared with "
                f"{', '.join(movers) or 'other keys'}, which change it; {key} now has its own "
                f"value {new}"
            )
    return _apply(text, pins), notes
