"""Bash's integer arithmetic, ``$((...))``, for the values a launch script computes.

Parsed with Python's ``ast`` and evaluated over integers only (``+ - * / % **``, parentheses,
variables through a lookup); anything else is left unevaluated. Never executes code.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Mapping

__all__ = ["arithmetic"]

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
