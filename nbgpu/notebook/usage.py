"""``-h`` for every magic: print the usage text IPython's ``%magic?`` would page.

IPython's magic parser has no help flag of its own (``%magic?`` opens a pager that
nbval and terminals do not show), so each magic answers ``-h`` with this.
"""

from __future__ import annotations

import inspect
from typing import Any

from IPython.core.magic_arguments import parse_argstring

__all__ = ["parse_or_help", "print_help"]


def print_help(method: Any, title: str | None = None) -> None:
    """Print a magic's usage and options."""
    # magic_arguments prefixes the usage with a reST '::' marker; drop it.
    text = inspect.cleandoc(method.__doc__ or "").removeprefix("::").strip()
    if title is not None:
        # A cell magic's generated usage line says '%name'; say '%%name'.
        text = text.replace(f"%{title.lstrip('%')}", title, 1)
    print(text)


def parse_or_help(method: Any, line: str) -> Any:
    """Parsed arguments, or None after printing help for ``-h``/``--help``."""
    if any(token in ("-h", "--help") for token in line.split()):
        print_help(method)
        return None
    return parse_argstring(method, line)
