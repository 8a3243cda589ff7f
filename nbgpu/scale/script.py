"""Launch scripts of Hydra overrides, read and rewritten in place.

verl and VAGEN users keep a run as a shell script::

    N_GPUS=${N_GPUS:-4}
    MODEL=Qwen/Qwen2.5-VL-3B-Instruct   # the policy
    CUDA_VISIBLE_DEVICES=0,1,2,3 python3 -m verl.trainer.main_ppo \\
        data.train_batch_size=128 \\
        actor_rollout_ref.model.path=$MODEL \\
        trainer.n_gpus_per_node=${N_GPUS} \\
        "$@"

:func:`read_script` finds the overrides (``key=value`` words after a Python, torchrun or accelerate
program word) and the variables the script sets, and resolves ``$VAR``, ``${VAR}`` and
``${VAR:-default}`` the way bash would with those variables unset in the environment; every value
keeps its spans, so :func:`~nbgpu.scale.files.rewrite_script` can change it where it is written.

The shell grammar read here is the part such scripts use: words, single and double quotes,
backslash escapes and line continuations, ``#`` comments, ``;``/``&&``/``||``/``|``/``&``
between commands, assignments before a command and ``export``. Nothing is executed.

Pure: text in, text out; never reads files (``files.py`` does).
"""

import re
from dataclasses import dataclass, field, replace
from typing import Any

from nbgpu.errors import UserInputError
from nbgpu.scale.values import arithmetic, parse_value

__all__ = ["NAME", "LaunchScript", "ScriptValue", "looks_like_script", "read_script"]

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=")
# Hydra override keys: a dotted path, optionally prefixed with + (add), ++ (force) or ~ (delete).
_OVERRIDE = re.compile(r"^(\+{1,2}|~)?([A-Za-z_][\w@/-]*(?:\.[\w@/-]+)*)=")
_PROGRAMS = re.compile(
    r"^(?:.*/)?(?:python[0-9.]*|torchrun|accelerate|deepspeed|ray|uv|.*\.py)$", re.IGNORECASE
)
_WRAPPERS = frozenset({"env", "nohup", "exec", "time", "nice", "stdbuf", "srun", "command"})
_SEPARATORS = ("\n", ";", "&&", "||", "|", "&")  # the ends of a command


@dataclass(frozen=True)
class _Part:
    kind: str  # "literal" | "var" | "arith" ($((...))) | "complex" ($(cmd), $@, ...)
    text: str  # the literal text / the variable name / the raw expression
    start: int  # span in the script of the editable text (literal) or the whole part
    end: int
    default: tuple[int, int, str] | None = None  # ${V:-default}: its span and its text
    quoted: bool = False  # inside double quotes: bash does not split what it expands to


@dataclass(frozen=True)
class ScriptValue:
    """A value (or a whole word) as written in the script: its span and its parts."""

    start: int  # the value's span in the script (after ``key=``)
    end: int
    parts: tuple[_Part, ...]
    line: int  # 1-based, for messages
    at: int  # where its word starts: variables are read as assigned before this point


@dataclass(frozen=True)
class _Assignment:
    name: str
    value: ScriptValue  # its ``at``: where the assignment is written


@dataclass
class LaunchScript:
    """A launch script: its text, its overrides and the variables it sets."""

    text: str
    overrides: dict[str, ScriptValue] = field(default_factory=dict)  # key as written → value
    assignments: list[_Assignment] = field(default_factory=list)
    command_at: int = 0  # where the (last) training command starts

    def variable(self, name: str, before: int) -> _Assignment | None:
        """The last assignment of *name* before *before* (bash reads top to bottom)."""
        earlier = (a for a in reversed(self.assignments) if a.name == name and a.value.at < before)
        return next(earlier, None)

    def resolve(self, value: ScriptValue, depth: int = 0, *, split: bool = True) -> str | None:
        """The text bash would pass (variables the script does not set: their default or None).
        ``split``: the value is a command's argument, where bash splits an unquoted expansion
        at spaces; an assignment's value is never split."""
        out = []
        for part in value.parts:
            if part.kind == "literal":
                out.append(part.text)
            elif part.kind == "var" and depth < 20:
                assigned = self.variable(part.text, value.at)
                text = None if part.default is None else part.default[2]
                if assigned is not None:
                    text = self.resolve(assigned.value, depth + 1, split=False)
                if text is None:
                    return None
                if split and not part.quoted and (text != text.strip() or len(text.split()) > 1):
                    # Unquoted, bash splits the expansion: this word ends at the first space.
                    fields = text.split()
                    if text[:1].isspace() and out:
                        return "".join(out)
                    return "".join(out) + (fields[0] if fields else "")
                out.append(text)
            elif part.kind == "arith" and depth < 20:
                number = arithmetic(part.text, lambda name: self._number(name, value, depth))
                if number is None:
                    return None
                out.append(str(number))
            else:
                return None
        return "".join(out)

    def _number(self, name: str, value: ScriptValue, depth: int) -> int | None:
        assigned = self.variable(name, value.at)
        text = None if assigned is None else self.resolve(assigned.value, depth + 1, split=False)
        try:
            return None if text is None else int(text)
        except ValueError:
            return None

    def value_of(self, key: str) -> ScriptValue | None:
        """A key's value: its override, or a variable as the training command sees it."""
        if key in self.overrides:
            return self.overrides[key]
        assigned = self.variable(key, self.command_at + 1)
        return None if assigned is None else assigned.value

    def config(self) -> dict[str, Any]:
        """Overrides (and CUDA_VISIBLE_DEVICES) as a flat ``key → value`` mapping, typed."""
        out: dict[str, Any] = {}
        for key in ("CUDA_VISIBLE_DEVICES", *self.overrides):
            value = self.value_of(key)
            if value is not None:
                text = self.resolve(value, split=key in self.overrides)
                written = self.text[value.start : value.end]
                out[key] = parse_value(text) if text is not None else written
        return out


def looks_like_script(text: str, name: str = "") -> bool:
    """A shell script rather than YAML/JSON: by its name, its shebang or its commands."""
    if name.endswith((".sh", ".bash")) or text.startswith("#!"):
        return True
    return bool(re.search(r"^\s*(?:\S+=\S*\s+)*python[0-9.]*\s+.*\\$", text, re.MULTILINE))


class _Lexer:
    """Splits a script into commands of words, keeping every span."""

    def __init__(self, text: str, where: str) -> None:
        self.text = text
        self.where = where
        self.i = 0

    def line_of(self, pos: int) -> int:
        return self.text.count("\n", 0, pos) + 1

    def commands(self) -> list[list[ScriptValue]]:
        commands: list[list[ScriptValue]] = [[]]
        text = self.text
        while self.i < len(text):
            c = text[self.i]
            if c == "\\" and text.startswith("\n", self.i + 1):
                self.i += 2  # a line continuation: the command goes on
            elif c in " \t\r":
                self.i += 1
            elif c == "#":
                end = text.find("\n", self.i)
                self.i = len(text) if end < 0 else end
            elif text.startswith(_SEPARATORS, self.i):
                self.i += len(next(s for s in _SEPARATORS if text.startswith(s, self.i)))
                commands.append([])
            else:
                commands[-1].append(self.word())
        return [command for command in commands if command]

    def word(self) -> ScriptValue:
        text = self.text
        start = self.i
        parts: list[_Part] = []
        quoted = False  # inside double quotes
        while self.i < len(text) or quoted:
            if self.i >= len(text):
                self._unclosed('"', start)
            c, nxt = text[self.i], text[self.i + 1 : self.i + 2]
            if c == '"':
                quoted = not quoted
                self.i += 1
            elif c == "$":
                parts.append(replace(self._dollar(), quoted=quoted))
            elif c == "\\" and nxt == "\n" and not quoted:
                self.i += 2  # a continuation inside a word: bash joins the two halves
            elif c == "\\" and (not quoted or (nxt and nxt in '"\\$`')):
                parts.append(_Part("literal", nxt, self.i, self.i + 2))
                self.i += 2
            elif c == "'" and not quoted:
                end = text.find("'", self.i + 1)
                if end < 0:
                    self._unclosed("'", start)
                parts.append(_Part("literal", text[self.i + 1 : end], self.i + 1, end))
                self.i = end + 1
            elif c in " \t\r\n;|&" and not quoted:
                break
            else:  # a run of plain text (in double quotes, only " $ and \ are special)
                stops = '"$\\' if quoted else " \t\r\n;|&\\'\"$"
                begin = self.i
                self.i += 1
                while self.i < len(text) and text[self.i] not in stops:
                    self.i += 1
                parts.append(_Part("literal", text[begin : self.i], begin, self.i))
        return ScriptValue(start, self.i, _merge(parts), self.line_of(start), start)

    def _dollar(self) -> _Part:
        text, start = self.text, self.i
        nxt = text[start + 1 : start + 2]
        end = start
        if nxt in ("{", "("):
            end = _matching(text, start + 1, nxt, "}" if nxt == "{" else ")")
            if end < 0:
                self._unclosed("$" + nxt, start)
            self.i = end + 1
        if nxt == "{":
            # ${VAR} or ${VAR:-default}, also of a positional parameter (${1:-4}: the script run
            # without arguments); a default that expands or quotes is not followed.
            pattern = r"([A-Za-z_][A-Za-z0-9_]*|[0-9]+)(?:(:?[-=])([^$'\"]*))?"
            m = re.fullmatch(pattern, text[start + 2 : end], re.DOTALL)
            if m is not None:
                default = m.group(3)  # None: no default
                span = None if default is None else (end - len(default), end, default)
                return _Part("var", m.group(1), start, self.i, span)
        elif nxt == "(":
            if text.startswith("$((", start) and text[end - 1] == ")":
                return _Part("arith", text[start + 3 : end - 1], start, self.i)
        elif (m := NAME.match(text, start + 1)) is not None:
            self.i = m.end()
            return _Part("var", m.group(0), start, self.i)
        else:
            # $@, $1, $$ ...: positional and special parameters, resolved at run time only.
            self.i += 2 if nxt else 1
        return _Part("complex", text[start : self.i], start, self.i)

    def _unclosed(self, what: str, start: int) -> None:
        raise UserInputError(
            f"{self.where}: line {self.line_of(start)}: {what} is not closed; expected a shell "
            "script such as `python3 -m verl.trainer.main_ppo key=value \\` lines"
        )


def _matching(text: str, i: int, opening: str, closing: str) -> int:
    depth = 0
    for j in range(i, len(text)):
        if text[j] == opening:
            depth += 1
        elif text[j] == closing:
            depth -= 1
            if depth == 0:
                return j
    return -1


def _merge(parts: list[_Part]) -> tuple[_Part, ...]:
    """Join adjacent literals written contiguously (one span to edit)."""
    out: list[_Part] = []
    for p in parts:
        last = out[-1] if out else None
        if last is not None and last.kind == p.kind == "literal" and last.end == p.start:
            out[-1] = _Part("literal", last.text + p.text, last.start, p.end)
        else:
            out.append(p)
    return tuple(out)


def _equals(word: ScriptValue) -> tuple[str, int] | None:
    """The ``key=`` text a word starts with (quotes removed) and where its ``=`` is written."""
    first = word.parts[0] if word.parts else None
    if first is None or first.kind != "literal" or "=" not in first.text:
        return None
    if first.end - first.start != len(first.text):
        return None  # an escaped character before "=": not a key anyone writes
    cut = first.text.index("=")
    return first.text[: cut + 1], first.start + cut


def _value_of(text: str, word: ScriptValue, eq: int) -> ScriptValue:
    """The value of ``key=value`` (*eq*: the position of ``=``)."""
    parts: list[_Part] = []
    for part in word.parts:
        if part.end <= eq:
            continue
        if part.kind == "literal" and part.start <= eq < part.end:
            # The literal holding "=" has no escapes (see _equals): offsets map one to one.
            rest = part.text[eq + 1 - part.start :]
            if rest:
                parts.append(_Part("literal", rest, eq + 1, part.end))
            continue
        parts.append(part)
    end = word.end
    # 'key=value' quoted as a whole: the value ends inside the closing quote.
    if text[word.start] in "'\"" and text[word.end - 1] == text[word.start]:
        end -= 1
    return ScriptValue(eq + 1, end, tuple(parts), word.line, word.start)


def read_script(text: str, where: str = "script") -> LaunchScript:
    """Find the overrides and assignments of a launch script."""
    script = LaunchScript(text)
    for command in _Lexer(text, where).commands():
        exported = command[0].parts and command[0].parts[0].text in ("export", "declare", "local")
        i = 1 if exported and len(command[0].parts) == 1 else 0
        while i < len(command):
            word = command[i]
            m = _ASSIGNMENT.match(text[word.start : word.end])
            if m is None or not word.parts or word.parts[0].kind != "literal":
                break
            value = _value_of(text, word, word.start + m.end() - 1)
            script.assignments.append(_Assignment(m.group(1), value))
            i += 1
        if exported:
            continue
        while i < len(command) and text[command[i].start : command[i].end] in _WRAPPERS:
            i += 1
        if i >= len(command) or not _PROGRAMS.match(text[command[i].start : command[i].end]):
            continue
        for word in command[i + 1 :]:
            equals = _equals(word)
            m = _OVERRIDE.match(equals[0]) if equals is not None else None
            if m is None or equals is None:
                continue
            key = (m.group(1) or "") + m.group(2)
            script.overrides.pop(key, None)  # the last one wins, as in Hydra
            script.overrides[key] = _value_of(text, word, equals[1])
            script.command_at = command[0].start
    if not script.overrides:
        raise UserInputError(
            f"{where}: no Hydra overrides found; expected a command such as "
            "`python3 -m verl.trainer.main_ppo data.train_batch_size=128 ...`"
        )
    return script
