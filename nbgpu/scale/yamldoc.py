"""YAML configs read and rewritten with ruamel.yaml: comments, order, quoting kept.

:func:`rewrite_yaml` changes the values it is given and no other byte of a user's config (its
comments, key order, and quotes where a value must stay a string: ``CUDA_VISIBLE_DEVICES: "0,1"``):
ruamel.yaml's round-trip composer gives the exact span of every value, and each new value, written
by ruamel.yaml's emitter in the old one's style (quotes, flow list; a block list keeps its items'
lines and adds new ones like its last), replaces just that span. Dumping the whole round-trip
document would rewrite ``True`` as ``true`` and ``null`` as nothing, and drop comments above
``---``: only a value that changes shape (a scalar that becomes a list, a list that becomes empty)
goes through that dump, with the file's indentation read from its text (ruamel.yaml cannot guess).

Pure: text in, text out; never reads or writes files (``files.py`` does).
"""

import functools
import io
import itertools
import operator
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import MarkedYAMLError, YAMLError
from ruamel.yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from ruamel.yaml.scalarstring import DoubleQuotedScalarString, SingleQuotedScalarString

from nbgpu.errors import UserInputError

__all__ = ["dump_yaml", "load_yaml", "rewrite_yaml"]

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
    lines = [
        line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")
    ]
    # (a key line's indent, the line below it), for every key line
    below = [
        (len(key.group(1)), line)
        for above, line in itertools.pairwise(lines)
        if (key := _KEY_LINE.match(above))
    ]
    items = (len(m.group(1)) - depth for depth, line in below if (m := _ITEM_LINE.match(line)))
    offset = max(0, next(items, 0))
    nested = (len(m.group(1)) - depth for depth, line in below if (m := _NESTED_KEY.match(line)))
    mapping = next((n for n in nested if n > 0), 2)
    return mapping, offset + 2, offset


def load_yaml(text: str, where: str = "config", *, plain: bool = False) -> Any:
    """The round-trip document (mappings keep their comments and style); *plain*: plain
    dicts, lists and scalars, as ruamel.yaml's safe loader builds them."""
    try:
        return (YAML(typ="safe", pure=True) if plain else _round_trip(text)).load(text)
    except YAMLError as exc:
        mark = exc.problem_mark if isinstance(exc, MarkedYAMLError) else None
        line = f" (line {mark.line + 1})" if mark is not None else ""
        raise UserInputError(f"{where} is not valid YAML{line}") from None


def _styled(old: Any, new: Any) -> Any:
    """*new* written the way *old* was: the same quotes for strings."""
    if isinstance(new, str) and isinstance(old, str) and type(old) is not str:
        return type(old)(new)  # DoubleQuotedScalarString, SingleQuotedScalarString, ...
    return new


def _node_at(root: Node, path: Sequence[Any]) -> Node | None:
    node: Node | None = root
    for key in path:
        if isinstance(node, MappingNode):
            node = next((v for k, v in node.value if k.value == str(key)), None)
        elif isinstance(node, SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
        else:
            return None
    return node


def _scalar_text(value: Any, style: str | None) -> str | None:
    """*value* as ruamel.yaml writes it on one line, in *style* (quotes) when it is a string."""
    if isinstance(value, str) and style in ("'", '"'):
        value = (SingleQuotedScalarString if style == "'" else DoubleQuotedScalarString)(value)
    out = io.StringIO()
    yaml = _round_trip()
    if isinstance(value, list):
        yaml.default_flow_style = True  # [0, 1, 2]; a scalar alone stays in block context
    yaml.dump({"k": value}, out)
    text = out.getvalue()
    if text.startswith("{k: ") and text.endswith("}\n"):
        text = text[4:-2]
    elif text.startswith("k: "):
        text = text[3:].rstrip("\n")
    else:
        return None
    return None if "\n" in text else text


def _splice(text: str, node: Node | None, new: Any) -> str | None:
    """*text* with *node*'s value replaced in place, or None when it cannot be."""
    if isinstance(node, ScalarNode) and not isinstance(new, Mapping | list | tuple):
        if node.style in ("|", ">"):
            return None
        new_text = _scalar_text(new, node.style)
    elif isinstance(node, SequenceNode) and node.flow_style and isinstance(new, list | tuple):
        new_text = _scalar_text(list(new), None)
    elif isinstance(node, SequenceNode) and isinstance(new, list | tuple):
        return _splice_block_list(text, node, list(new))
    else:
        return None
    if new_text is None:
        return None
    return _apply(text, [(node.start_mark.index, node.end_mark.index, new_text)])


def _splice_block_list(text: str, node: SequenceNode, new: list[Any]) -> str | None:
    """A block list of scalars: items edited in place, new ones added like the last one."""
    items = node.value
    scalars = all(isinstance(i, ScalarNode) and i.style not in ("|", ">") for i in items)
    nested = any(isinstance(v, Mapping | list | tuple) for v in new)
    if not items or not new or not scalars or nested:
        return None
    last = items[-1]
    line_start = text.rfind("\n", 0, last.start_mark.index) + 1
    dash = text[line_start : last.start_mark.index]  # "    - " as the file writes it
    if dash.strip() != "-":
        return None
    edits: list[tuple[int, int, str]] = []
    for item, value in zip(items, new, strict=False):
        item_text = _scalar_text(value, item.style)
        if item_text is None:
            return None
        edits.append((item.start_mark.index, item.end_mark.index, item_text))
    line_end = text.find("\n", last.end_mark.index)
    line_end = len(text) if line_end < 0 else line_end
    if len(new) > len(items):
        added = [_scalar_text(v, last.style) for v in new[len(items) :]]
        if None in added:
            return None
        edits.append((line_end, line_end, "".join(f"\n{dash}{a}" for a in added)))
    elif len(new) < len(items):
        first_gone = items[len(new)]
        cut = text.rfind("\n", 0, first_gone.start_mark.index)
        edits.append((cut, line_end, ""))
    return _apply(text, edits)


def _apply(text: str, edits: list[tuple[int, int, str]]) -> str:
    """*text* with each span replaced, from the end backwards; a line that grew keeps its
    end-of-line comment in its column where spaces allow."""
    for start, end, piece in sorted(edits, reverse=True):
        rest, grown = text[end:], len(piece) - (end - start)
        spaces = len(rest) - len(rest.lstrip(" "))
        if grown > 0 and rest[spaces:].startswith("#") and spaces > 1:
            rest = rest[min(grown, spaces - 1) :]
        text = text[:start] + piece + rest
    return text


def rewrite_yaml(text: str, changes: Mapping[tuple[Any, ...], Any], where: str = "config") -> str:
    """*text* with the values at *changes*' paths replaced; every other byte as written."""
    load_yaml(text, where)  # one clear line for a broken file
    out = text
    pending: dict[tuple[Any, ...], Any] = {}
    # From the end of the file backwards, so earlier spans stay where they were.
    root = _round_trip(text).compose(text)
    located = [(p, v, _node_at(root, p)) for p, v in changes.items()]
    for path, value, node in sorted(
        located, key=lambda item: -(item[2].start_mark.index if item[2] is not None else -1)
    ):
        spliced = _splice(out, node, value)
        if spliced is None:
            pending[path] = value
        else:
            out = spliced
    if not pending:
        return out
    doc = load_yaml(out, where)
    for path, value in pending.items():
        node = functools.reduce(operator.getitem, path[:-1], doc)
        # None: a key the file does not have yet (trainer.nnodes), added at its mapping's end.
        old = node.get(path[-1]) if isinstance(node, dict) else node[path[-1]]
        if isinstance(old, CommentedSeq) and isinstance(value, list | tuple):
            # Item by item, in place: the list keeps its style and each item its comment.
            for i, item in enumerate(value):
                if i < len(old):
                    old[i] = _styled(old[i], item)
                else:
                    old.append(item)
            del old[len(value) :]
        else:
            node[path[-1]] = _styled(old, value)
    stream = io.StringIO()
    _round_trip(out).dump(doc, stream)
    return stream.getvalue()


def dump_yaml(data: Any) -> str:
    """Plain data as block YAML (for configs given as a dict, with no text to keep)."""
    out = io.StringIO()
    _round_trip().dump(CommentedMap(data) if isinstance(data, Mapping) else data, out)
    return out.getvalue()
