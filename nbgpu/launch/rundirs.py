"""Run directories: where a run's cell, logs, error files and results live, and how many are
kept. ``$NBGPU_RUNS_DIR`` or ``$XDG_CACHE_HOME/nbgpu/runs``; each run's is private (0700): logs
can hold secrets. Runs keep their full logs, so by default only the last ``DEFAULT_KEEP`` runs
and at most ``DEFAULT_BUDGET`` bytes stay (``0``: no limit), pruned before each new run and on
request (``%gpu_runs --prune``). A directory in use stays: a live process carries its run id,
its ``run.json`` says it is not over and changed recently, or it holds a ``KEEP`` file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import re
import secrets
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbgpu._render import Block, Line, Result, Table, fmt_bytes, to_text
from nbgpu._serial import read_json_object
from nbgpu.errors import UserInputError, user_path
from nbgpu.launch.config import LaunchConfig
from nbgpu.launch.procs import live_run_ids
from nbgpu.sizes import parse_size

__all__ = [
    "DEFAULT_BUDGET", "DEFAULT_KEEP", "FINAL_STATES", "PruneReport", "RetentionPolicy",
    "find_run_dir", "list_run_dirs", "make_run_dir", "policy_from_options", "prune", "run_dirs",
    "runs_root",
]  # fmt: skip

RUNS_DIR_ENV = "NBGPU_RUNS_DIR"
KEEP_ENV = "NBGPU_KEEP_RUNS"
BUDGET_ENV = "NBGPU_RUNS_BUDGET"
DEFAULT_KEEP = 20
DEFAULT_BUDGET = 5 * 1024**3
KEEP_MARKER = "KEEP"
# A run whose run.json is not final but which nothing runs any more (its launcher was
# SIGKILLed) is removable once it has been quiet this long.
STALE_AFTER_S = 600.0
#: The states a run ends in (``run.json``'s ``state``); any other means "not over".
FINAL_STATES = ("succeeded", "failed", "stopped", "timed_out", "interrupted", "hung")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_RETENTION_ANNOUNCED: list[bool] = []  # the policy is told once per process


def runs_root(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    if env.get(RUNS_DIR_ENV):
        return user_path(env[RUNS_DIR_ENV])
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


def error_file(run_dir: Path, rank: int) -> Path:
    return run_dir / f"error-rank{rank}.json"


def write_bootstrap(run_dir: Path, config: LaunchConfig, channel: tuple[str, str] | None) -> None:
    """What every rank reads before the user's code: a warm job's ranks take every cell
    from the *channel* (socket path, token); otherwise the cell or script, pushed values."""
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
    try:
        (run_dir / "run.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
    except OSError as exc:
        # A full disk must not turn a finished run into a crash of the launcher.
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise


@dataclass(frozen=True)
class RetentionPolicy:
    keep_runs: int  # 0: no limit on the count
    budget_bytes: int  # 0: no limit on the size

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RetentionPolicy:
        env = os.environ if environ is None else environ
        return cls(_count(env.get(KEEP_ENV), f"{KEEP_ENV}="), _budget(env.get(BUDGET_ENV)))

    def describe(self) -> str:
        count = f"the last {self.keep_runs} runs" if self.keep_runs else "every run"
        size = f"at most {fmt_bytes(self.budget_bytes)}" if self.budget_bytes else "no size limit"
        return f"{count}, {size} ({KEEP_ENV}, {BUDGET_ENV})"


def _count(value: str | int | None, label: str) -> int:
    if value is None or str(value).strip() == "":
        return DEFAULT_KEEP
    count = -1
    with contextlib.suppress(ValueError):
        count = int(value)
    if count < 0:
        raise UserInputError(
            f"{label}{value!r}: expected a whole number of runs >= 0 (0: no limit)"
        )
    return count


def _budget(value: str | None, label: str = f"{BUDGET_ENV}=") -> int:
    if value is None or value.strip() == "":
        return DEFAULT_BUDGET
    if value == "0":
        return 0
    try:
        return parse_size(value)
    except UserInputError:
        raise UserInputError(
            f"{label}{value!r}: expected a size such as 5G, 500M or 0 (no limit)"
        ) from None


@dataclass(frozen=True)
class RunDir:
    path: Path
    run_id: str | None
    state: str  # from run.json; "unknown" without one
    started_at: float  # run.json's start, else the directory's mtime
    size_bytes: int
    kept_marker: bool


def _tree_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += (Path(root) / name).lstat().st_size
    return total


def _read(path: Path) -> RunDir:
    meta = read_json_object(path / "run.json")
    started = meta.get("started_at")
    if not isinstance(started, int | float):
        started = path.stat().st_mtime
    return RunDir(
        path=path,
        run_id=meta.get("run_id") if isinstance(meta.get("run_id"), str) else None,
        state=str(meta.get("state") or "unknown"),
        started_at=float(started),
        size_bytes=_tree_size(path),
        kept_marker=(path / KEEP_MARKER).exists(),
    )


def run_dirs(environ: Mapping[str, str] | None = None) -> list[RunDir]:
    """Every run directory under the runs root, newest first."""
    root = runs_root(environ)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        if child.is_dir() and not child.is_symlink():
            with contextlib.suppress(OSError):
                found.append(_read(child))
    return sorted(found, key=lambda d: d.started_at, reverse=True)


@dataclass(frozen=True)
class RunDirsTable(Result):
    """The run directories on disk (every process's, not only this kernel's)."""

    root: Path
    entries: tuple[RunDir, ...]

    def content(self) -> list[Block]:
        total = sum(e.size_bytes for e in self.entries)
        head = f"{len(self.entries)} run directories in {self.root} ({fmt_bytes(total)})"
        table = Table(["run directory", "state", "started", "size"])
        for e in self.entries:
            started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.started_at))
            table.add(e.path.name, e.state, started, fmt_bytes(e.size_bytes))
        return [Line(head, wrap=False), *([table] if self.entries else [])]

    def text(self) -> str:
        return to_text(self.content(), width=120)  # paths and dates: wider than 80 columns

    def records(self) -> list[dict[str, Any]]:
        return [
            {
                "run_dir": str(e.path),
                "state": e.state,
                "started_at": e.started_at,
                "size_bytes": e.size_bytes,
                "kept": e.kept_marker,
            }
            for e in self.entries
        ]

    def to_dict(self) -> dict[str, Any]:
        return {"root": str(self.root), "runs": self.records()}


def list_run_dirs(environ: Mapping[str, str] | None = None) -> RunDirsTable:
    return RunDirsTable(runs_root(environ), tuple(run_dirs(environ)))


def policy_from_options(
    keep: int | str | None, budget: str | None, environ: Mapping[str, str] | None = None
) -> RetentionPolicy:
    """The environment's policy with the limits given on the command line."""
    base = RetentionPolicy.from_env(environ)
    return RetentionPolicy(
        keep_runs=base.keep_runs if keep is None else _count(keep, "--keep "),
        budget_bytes=base.budget_bytes if budget is None else _budget(budget, "--budget "),
    )


def _in_use(entry: RunDir, live: set[str], now: float) -> str | None:
    if entry.kept_marker:
        return f"kept ({KEEP_MARKER} file)"
    if entry.run_id is not None and entry.run_id in live:
        return "running"
    if entry.state not in FINAL_STATES:
        with contextlib.suppress(OSError):
            if now - entry.path.stat().st_mtime < STALE_AFTER_S:
                return "being written"
    return None


@dataclass(frozen=True)
class PruneReport(Result):
    root: Path
    policy: RetentionPolicy
    removed: tuple[tuple[str, int], ...]  # directory name, bytes freed
    protected: tuple[tuple[str, str], ...]  # directory name, why it stays
    kept_runs: int
    kept_bytes: int

    @property
    def freed_bytes(self) -> int:
        return sum(size for _name, size in self.removed)

    def content(self) -> list[Block]:
        head = (
            f"runs in {self.root}: removed {len(self.removed)} "
            f"({fmt_bytes(self.freed_bytes)}), kept {self.kept_runs} "
            f"({fmt_bytes(self.kept_bytes)}); policy: {self.policy.describe()}"
        )
        if not self.removed and not self.protected:
            return [Line(head, wrap=False)]
        table = Table(["run directory", "action", "size / reason"])
        for name, size in self.removed:
            table.add(name, "removed", fmt_bytes(size))
        for name, why in self.protected:
            table.add(name, "left alone", why, level="warn")
        return [Line(head, wrap=False), table]

    def records(self) -> list[dict[str, Any]]:
        return [{"run_dir": n, "action": "removed", "bytes": s} for n, s in self.removed] + [
            {"run_dir": n, "action": "left alone", "reason": w} for n, w in self.protected
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "root": str(self.root),
            "keep_runs": self.policy.keep_runs,
            "budget_bytes": self.policy.budget_bytes,
            "removed": [{"run_dir": n, "bytes": s} for n, s in self.removed],
            "protected": [{"run_dir": n, "reason": w} for n, w in self.protected],
            "kept_runs": self.kept_runs,
            "kept_bytes": self.kept_bytes,
            "freed_bytes": self.freed_bytes,
        }


def prune(
    environ: Mapping[str, str] | None = None,
    *,
    policy: RetentionPolicy | None = None,
    keep_newest_extra: int = 0,
) -> PruneReport:
    """Remove the oldest run directories beyond the policy, never one in use nor the newest
    (even alone over budget: its logs are the ones the user is about to read);
    ``keep_newest_extra`` makes room for a run about to start."""
    policy = policy or RetentionPolicy.from_env(environ)
    entries = run_dirs(environ)
    now = time.time()
    live: set[str] | None = None  # the /proc scan only when something may be removed
    removed: list[tuple[str, int]] = []
    protected: list[tuple[str, str]] = []
    kept = kept_bytes = 0
    limit = max(0, policy.keep_runs - keep_newest_extra) if policy.keep_runs else 0
    for entry in entries:  # newest first
        over_count = bool(policy.keep_runs) and kept >= max(limit, 1)
        over_budget = (
            bool(policy.budget_bytes)
            and kept > 0
            and kept_bytes + entry.size_bytes > policy.budget_bytes
        )
        if over_count or over_budget:
            if live is None:
                live = live_run_ids()
            why = _in_use(entry, live, now)
            if why is None:
                shutil.rmtree(entry.path, ignore_errors=True)
                if not entry.path.exists():
                    removed.append((entry.path.name, entry.size_bytes))
                    continue
                why = "could not be removed"
            protected.append((entry.path.name, why))
        kept += 1
        kept_bytes += entry.size_bytes
    return PruneReport(
        runs_root(environ), policy, tuple(removed), tuple(protected), kept, kept_bytes
    )


def prune_before_run(environ: Mapping[str, str]) -> str | None:
    """Prune before a new run; the notice to show, if any. Never blocks a launch."""
    try:
        report = prune(environ, keep_newest_extra=1)
    except (UserInputError, OSError) as exc:
        return f"old runs not pruned: {exc}"
    if not report.removed or _RETENTION_ANNOUNCED:
        return None
    _RETENTION_ANNOUNCED.append(True)
    return (
        f"removed {len(report.removed)} old run directories "
        f"({report.freed_bytes / 1e6:.0f} MB) from {report.root}: keeping "
        f"{report.policy.describe()}; %gpu_runs --prune / nbgpu runs --prune"
    )


def find_run_dir(name_or_path: str | Path) -> Path:
    """A run directory given as a path, or the newest one whose name starts with it."""
    path = user_path(name_or_path)
    if (path / "run.json").is_file():
        return path
    root = runs_root()
    named = (p for p in root.glob("*") if p.name.startswith(f"{name_or_path}-"))  # no pattern
    matches = sorted(
        (p for p in named if (p / "run.json").is_file()), key=lambda p: p.stat().st_mtime
    )
    if not matches:
        raise UserInputError(
            f"{str(name_or_path)!r}: not a run directory, nor a run name under {root}"
        )
    return matches[-1]
