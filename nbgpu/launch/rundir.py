"""Run directories: where a run's script, per-rank logs, error files and results live.

Default location: ``$NBGPU_RUNS_DIR`` or ``$XDG_CACHE_HOME/nbgpu/runs`` (usually
``~/.cache/nbgpu/runs``). Each run gets ``<name>-<YYYYmmdd-HHMMSS>-<4 hex>``, created
private (0700): logs can hold secrets and tokens. Runs are kept after they end so
their logs can be read and diagnosed. What a run starts from (``bootstrap.json``, the
cell, pushed values) and what it says of itself (``run.json``) are written here.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nbgpu.errors import UserInputError
from nbgpu.launch.config import LaunchConfig

__all__ = [
    "RUNS_DIR_ENV",
    "agent_log",
    "error_file",
    "make_run_dir",
    "rank_log",
    "rank_node",
    "runs_root",
    "write_bootstrap",
    "write_meta",
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


def write_bootstrap(run_dir: Path, config: LaunchConfig, channel: tuple[str, str] | None) -> None:
    """What every rank reads before the user's code (``nbgpu.rank.worker``).

    *channel* (a warm job's socket path and token): the ranks take every cell, the
    first one too, from the channel; otherwise the cell or script, and pushed values.
    """
    spec: dict[str, Any] = {
        "serial_imports": config.serial_imports,
        "mem_limit_bytes": config.mem_limit_bytes,
        "mem_sample_s": config.mem_sample_s,
        "pull": list(config.pull),
        "pull_all_ranks": config.pull_all_ranks,
        "script_args": list(config.script_args),
    }
    if channel is not None:
        spec.update(keep=True, channel=channel[0], token=channel[1])
    elif config.code is not None:
        cell = run_dir / "cell.py"
        cell.write_text(config.code, encoding="utf-8")
        spec["cell"] = str(cell)
    elif config.script is not None:
        spec["script"] = str(config.script.resolve())
    (run_dir / "bootstrap.json").write_text(json.dumps(spec, indent=2), encoding="utf-8")
    if config.push and channel is None:
        (run_dir / "push.pkl").write_bytes(pickle.dumps(dict(config.push)))


def write_meta(run_dir: Path, meta: dict[str, Any]) -> None:
    """``run.json``: what the run says of itself (retention, stacks and diagnose read it)."""
    try:
        (run_dir / "run.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
    except OSError as exc:
        # A full disk must not turn a finished run into a crash of the launcher.
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
