"""YAML configs read and rewritten with ruamel.yaml's round trip: comments, order, quoting kept.

A user's verl/VAGEN config carries comments that explain its values, a key order that
follows the trainer's structure, and quotes where a value must stay a string
(``CUDA_VISIBLE_DEVICES: "0,1"``). :func:`rewrite_yaml` changes the values it is given and
nothing else: ruamel.yaml's round-trip loader keeps comments, order, quoting, flow or block
style of lists, and the file's indentation (read from the text, since ruamel.yaml cannot
guess it) is handed back to its dumper.

Pure: text in, text out; never reads or writes files (``files.py`` does).
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import MarkedYAMLError, YAMLError

from nbgpu.errors import UserInputError

__all__ = ["dump_yaml", "load_yaml", "rewrite_yaml", "to_plain"]

_KEY_LINE = re.compile(r"^( *)[^\s#-][^#]*:\s*(#.*)?$")
_ITEM_LINE = re.compile(r"^( *)- ")
_NESTED_KEY = re.compile(r"^( *)[^\s#-][^:#]*:")


def _round_trip(text: str = "") -> YAML:
    yaml = YAML(typ="rt")
    yaml.preserve_quotes = True
    yaml.width = 4096  # never re-wrap a long value onto two lines
    mapping, sequence, offset = _indentation(text)
    yaml.indent(mapping=mapping, sequence=sequence, offset=offset)
    yaml.explicit_start = text.lstrip().startswith("---")
    return yaml


def _indentation(text: str) -> tuple[int, int, int]:
    """The file's mapping indent, and its block-sequence indent and dash offset."""
    lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    mapping, sequence, offset = 2, 2, 0
    found_mapping = found_sequence = False
    for above, line in zip(lines, lines[1:], strict=False):
        parent = _KEY_LINE.match(above)
        if parent is None:
            continue
        depth = len(parent.group(1))
        item = _ITEM_LINE.match(line)
        if item is not None and not found_sequence:
            offset = max(0, len(item.group(1)) - depth)
            sequence = offset + 2
            found_sequence = True
            continue
        nested = _NESTED_KEY.match(line)
        if nested is not None and len(nested.group(1)) > depth and not found_mapping:
            mapping = len(nested.group(1)) - depth
            found_mapping = True
    return mapping, max(sequence, offset + 2), offset


def load_yaml(text: str, where: str = "config") -> Any:
    """The round-trip document (mappings keep their comments and style)."""
    try:
        return _round_trip(text).load(text)
    except YAMLError as exc:
        mark = exc.problem_mark if isinstance(exc, MarkedYAMLError) else None
        line = f" (line {mark.line + 1})" if mark is not None else ""
        raise UserInputError(f"{where} is not valid YAML{line}") from None


def to_plain(node: Any) -> Any:
    """The document as plain dicts, lists and scalars (``int``, ``float``, ``str``...)."""
    if isinstance(node, Mapping):
        return {to_plain(k): to_plain(v) for k, v in node.items()}
    if isinstance(node, list | tuple):
        return [to_plain(v) for v in node]
    if isinstance(node, bool) or node is None:
        return node
    for kind in (int, float, str):
        if isinstance(node, kind):
            return kind(node)
    return node


def _styled(old: Any, new: Any) -> Any:
    """*new* written the way *old* was: the same quotes for strings."""
    if isinstance(new, str) and isinstance(old, str) and type(old) is not str:
        return type(old)(new)  # DoubleQuotedScalarString, SingleQuotedScalarString, ...
    return new


def _set(doc: Any, path: Sequence[Any], new: Any) -> None:
    node = doc
    for key in path[:-1]:
        node = node[key]
    old = node[path[-1]]
    if isinstance(old, CommentedSeq) and isinstance(new, list | tuple):
        old.clear()  # in place: the list keeps its flow or block style and its comments
        old.extend(new)
        return
    node[path[-1]] = _styled(old, new)


def rewrite_yaml(text: str, changes: Mapping[tuple[Any, ...], Any], where: str = "config") -> str:
    """*text* with the values at *changes*' paths replaced; everything else as written."""
    doc = load_yaml(text, where)
    for path, value in changes.items():
        _set(doc, path, value)
    out = io.StringIO()
    _round_trip(text).dump(doc, out)
    return out.getvalue()


def dump_yaml(data: Any) -> str:
    """Plain data as block YAML (for configs given as a dict, with no text to keep)."""
    out = io.StringIO()
    yaml = _round_trip()
    if isinstance(data, Mapping):
        data = CommentedMap(data)
    yaml.dump(data, out)
    return out.getvalue()
