"""Run directories: where a run's script, per-rank logs, error files and results live.

Default location: ``$NBGPU_RUNS_DIR`` or ``$XDG_CACHE_HOME/nbgpu/runs`` (usually
``~/.cache/nbgpu/runs``). Each run gets ``<name>-<YYYYmmdd-HHMMSS>-<4 hex>``, created
private (0700): logs can hold secrets and tokens. Runs are kept after they end so
their logs can be read and diagnosed. Standard library only.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import Mapping
from pathlib import Path

from nbgpu.errors import UserInputError

__all__ = [
    "RUNS_DIR_ENV",
    "agent_log",
    "error_file",
    "make_run_dir",
    "rank_log",
    "rank_node",
    "runs_root",
]

RUNS_DIR_ENV = "NBGPU_RUNS_DIR"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def runs_root(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    if env.get(RUNS_DIR_ENV):
        return Path(env[RUNS_DIR_ENV]).expanduser()
    cache = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "nbgpu" / "runs"


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise UserInputError(
            f"run name {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )
    return name


def make_run_dir(name: str, environ: Mapping[str, str] | None = None) -> Path:
    """Create a fresh private run directory and return its path."""
    root = runs_root(environ)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for _ in range(20):
        path = root / f"{check_name(name)}-{stamp}-{secrets.token_hex(2)}"
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            continue
        # mkdir's mode is masked by the umask; the directory must be private anyway.
        path.chmod(0o700)
        return path
    raise UserInputError(f"could not create a unique run directory under {root}")


def rank_log(run_dir: Path, rank: int) -> Path:
    return run_dir / f"rank{rank}.log"


def rank_node(run_dir: Path, rank: int) -> Path:
    """Where a rank of a run over several nodes writes its node's name."""
    return run_dir / f"rank{rank}.node"


def error_file(run_dir: Path, rank: int) -> Path:
    return run_dir / f"error-rank{rank}.json"


def agent_log(run_dir: Path) -> Path:
    return run_dir / "agent.log"
