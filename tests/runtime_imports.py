"""What a module imports when it runs: every import statement, lazy ones included, but
not those under ``if TYPE_CHECKING:`` (they exist for mypy only)."""

from __future__ import annotations

import ast
from pathlib import Path

__all__ = ["runtime_imports"]


def runtime_imports(path: Path) -> set[str]:
    """Imported names: ``import a.b`` gives ``a.b``; ``from a import b`` gives ``a`` and ``a.b``."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body
        for node in ast.walk(stmt)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found
