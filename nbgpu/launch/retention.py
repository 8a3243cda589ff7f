"""Keep the runs directory bounded: the last N runs and at most a size budget.

Every run keeps its full logs (``NCCL_DEBUG=INFO`` alone writes hundreds of MB), so
without a policy an afternoon of trying things fills the disk. Defaults: the last
``DEFAULT_KEEP`` runs and at most ``DEFAULT_BUDGET`` bytes, changed with
``NBGPU_KEEP_RUNS`` and ``NBGPU_RUNS_BUDGET`` (``0`` turns a limit off). nbgpu applies
the policy before each new run (and says so once per process) and on request
(``%gpu_runs --prune``, ``nbgpu runs --prune``).

A run directory is never removed while it is in use: a live process carries its
run id (``NBGPU_RUN_ID`` in its environment, orphans included), or its ``run.json``
says it is not over and it changed recently, or it holds a ``KEEP`` file (how a
warm or kept job marks itself; users may create one by hand too). Standard library
and psutil only.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from nbgpu._render import Block, Line, Result, Table, fmt_bytes, to_text
from nbgpu.errors import UserInputError
from nbgpu.launch.procs import RUN_ID_ENV
from nbgpu.launch.rundir import runs_root
from nbgpu.sizes import parse_size

__all__ = [
    "BUDGET_ENV",
    "DEFAULT_BUDGET",
    "DEFAULT_KEEP",
    "KEEP_ENV",
    "KEEP_MARKER",
    "PruneReport",
    "RetentionPolicy",
    "RunDirsTable",
    "list_run_dirs",
    "policy_from_options",
    "prune",
    "run_dirs",
]

KEEP_ENV = "NBGPU_KEEP_RUNS"
BUDGET_ENV = "NBGPU_RUNS_BUDGET"
DEFAULT_KEEP = 20
DEFAULT_BUDGET = 5 * 1024**3
KEEP_MARKER = "KEEP"
# A run whose run.json is not final but which nothing runs any more (its launcher was
# SIGKILLed) is removable once it has been quiet this long.
STALE_AFTER_S = 600.0
_FINAL = ("succeeded", "failed", "stopped", "timed_out", "interrupted")


@dataclass(frozen=True)
class RetentionPolicy:
    keep_runs: int  # 0: no limit on the count
    budget_bytes: int  # 0: no limit on the size

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RetentionPolicy:
        env = os.environ if environ is None else environ
        return cls(
            keep_runs=_count(env.get(KEEP_ENV), KEEP_ENV),
            budget_bytes=_budget(env.get(BUDGET_ENV), BUDGET_ENV),
        )

    def describe(self) -> str:
        count = f"the last {self.keep_runs} runs" if self.keep_runs else "every run"
        size = f"at most {fmt_bytes(self.budget_bytes)}" if self.budget_bytes else "no size limit"
        return f"{count}, {size} ({KEEP_ENV}, {BUDGET_ENV})"


def _count(text: str | None, name: str) -> int:
    if text is None or text.strip() == "":
        return DEFAULT_KEEP
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise UserInputError(f"{name}={text!r}: expected a whole number of runs >= 0 (0: no limit)")
    return value


def _budget(text: str | int | None, name: str) -> int:
    if text is None or (isinstance(text, str) and text.strip() == ""):
        return DEFAULT_BUDGET
    if text in ("0", 0):
        return 0
    try:
        return parse_size(text)
    except UserInputError:
        sep = " " if name.startswith("--") else "="
        raise UserInputError(
            f"{name}{sep}{text!r}: expected a size such as 5G, 500M or 0 (no limit)"
        ) from None


@dataclass(frozen=True)
class RunDir:
    path: Path
    run_id: str | None
    state: str  # from run.json; "unknown" without one
    started_at: float  # run.json's start, else the directory's mtime
    size_bytes: int
    kept_marker: bool


def _size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += (Path(root) / name).lstat().st_size
    return total


def _read(path: Path) -> RunDir:
    meta: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        loaded = json.loads((path / "run.json").read_text(encoding="utf-8"))
        if isinstance(loaded, dict):
            meta = loaded
    started = meta.get("started_at")
    if not isinstance(started, int | float):
        started = path.stat().st_mtime
    return RunDir(
        path=path,
        run_id=meta.get("run_id") if isinstance(meta.get("run_id"), str) else None,
        state=str(meta.get("state") or "unknown"),
        started_at=float(started),
        size_bytes=_size(path),
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

    def _table(self) -> Table:
        table = Table(["run directory", "state", "started", "size"])
        for e in self.entries:
            started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.started_at))
            table.add(e.path.name, e.state, started, fmt_bytes(e.size_bytes))
        return table

    def content(self) -> list[Block]:
        total = sum(e.size_bytes for e in self.entries)
        head = f"{len(self.entries)} run directories in {self.root} ({fmt_bytes(total)})"
        return [Line(head, wrap=False), *([self._table()] if self.entries else [])]

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
    keep: int | None, budget: str | None, environ: Mapping[str, str] | None = None
) -> RetentionPolicy:
    """The environment's policy with the limits given on the command line."""
    base = RetentionPolicy.from_env(environ)
    if keep is not None and keep < 0:
        raise UserInputError(f"--keep {keep}: expected a whole number of runs >= 0 (0: no limit)")
    return RetentionPolicy(
        keep_runs=base.keep_runs if keep is None else keep,
        budget_bytes=base.budget_bytes if budget is None else _budget(budget, "--budget"),
    )


def _live_run_ids() -> set[str]:
    """Run ids carried by any live process of this user (every process, not a tree)."""
    prefix = f"{RUN_ID_ENV}=".encode()
    ids: set[str] = set()
    uid = os.getuid()
    for proc in psutil.process_iter(["uids"]):
        try:
            if proc.info["uids"].real != uid:
                continue
            data = Path(f"/proc/{proc.pid}/environ").read_bytes()
        except (psutil.Error, OSError, AttributeError, TypeError):
            continue
        for item in data.split(b"\0"):
            if item.startswith(prefix):
                ids.add(item[len(prefix) :].decode(errors="replace"))
    return ids


def _in_use(entry: RunDir, live: set[str], now: float) -> str | None:
    if entry.kept_marker:
        return f"kept ({KEEP_MARKER} file)"
    if entry.run_id is not None and entry.run_id in live:
        return "running"
    if entry.state not in _FINAL:
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
    """Remove the oldest run directories beyond the policy; never one in use.

    ``keep_newest_extra`` reserves room (count) for a run about to start. The newest
    finished run is always kept, even alone over budget: its logs are the ones the
    user is about to read.
    """
    policy = policy or RetentionPolicy.from_env(environ)
    entries = run_dirs(environ)
    now = time.time()
    live: set[str] | None = None  # the /proc scan only when something may be removed
    removed: list[tuple[str, int]] = []
    protected: list[tuple[str, str]] = []
    kept = 0
    kept_bytes = 0
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
                live = _live_run_ids()
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
        root=runs_root(environ),
        policy=policy,
        removed=tuple(removed),
        protected=tuple(protected),
        kept_runs=kept,
        kept_bytes=kept_bytes,
    )
