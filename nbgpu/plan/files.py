"""Reading the files a plan starts from (a config to scale, a saved plan), writing a new config.

The one module of ``plan/`` that opens files, so everything else stays pure. JSON is read
with the standard library, YAML with ruamel.yaml (``yamldoc.py``), launch scripts by
``launchscript.py``. Every failure is one ``UserInputError`` line naming the file and what
was expected.

Imports only the standard library, ``nbgpu.errors`` and ``plan``'s text modules; never the
inventory, sockets or processes.
"""

from __future__ import annotations

import os
from pathlib import Path

from nbgpu.errors import UserInputError

__all__ = ["read_text", "write_text"]


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


def write_text(path: str | os.PathLike[str], text: str, *, like: str | None = None) -> None:
    """Write *text* to *path*; a script keeps the permissions of the one it came from."""
    p = Path(path).expanduser()
    try:
        p.write_text(text, encoding="utf-8")
        if like is not None and Path(like).exists():
            p.chmod(Path(like).stat().st_mode & 0o777)
    except OSError as exc:
        raise UserInputError(f"cannot write {str(path)!r}: {exc.strerror}") from None
