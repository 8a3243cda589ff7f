"""Every rank's Python stack at once, without ptrace: for runs that hang.

Each rank registers ``faulthandler`` on ``STACKS_SIGNAL`` before any user code
(``nbgpu.rank.worker``), dumping into ``stacks-rank{N}.txt``, and announces its pid in
``stacks-rank{N}.pid``. :func:`rank_stacks` signals each rank whose pid still carries the
run's id and reads the dumps; a rank blocked in C code (a collective) still answers, one
stopped with SIGSTOP is named as such. Native frames come from py-spy when it can attach.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from nbgpu._render import Block, Line, Pre, Result, Title
from nbgpu._serial import to_data
from nbgpu.errors import UserInputError
from nbgpu.launch.procs import carries_run_id
from nbgpu.launch.rundirs import runs_root

__all__ = ["STACKS_SIGNAL", "RankStack", "RunStacks", "find_run_dir", "rank_stacks"]

# A real-time signal: nothing in Python, torch or common launchers uses it, unlike
# SIGUSR1 (Lightning, Slurm preemption) and SIGUSR2.
STACKS_SIGNAL = signal.SIGRTMIN + 3  # type: ignore[attr-defined,unused-ignore]
_SETTLE_S = 0.2  # a dump is complete when its file stops growing this long


@dataclass(frozen=True)
class RankStack:
    rank: int
    pid: int | None
    state: str  # "dumped", "stopped (SIGSTOP)", "exited", "no answer", "not started"
    python: str  # faulthandler's dump ("" if none)
    native: str  # py-spy's dump, or why there is none


@dataclass(frozen=True)
class RunStacks(Result):
    run_dir: Path
    ranks: tuple[RankStack, ...]
    native_note: str

    @property
    def complete(self) -> bool:
        return bool(self.ranks) and all(r.state == "dumped" for r in self.ranks)

    def content(self) -> list[Block]:
        blocks: list[Block] = [Title(f"stacks of {self.run_dir.name} ({len(self.ranks)} ranks)")]
        for r in self.ranks:
            blocks.append(
                Line(
                    f"── rank {r.rank} (pid {r.pid or '-'}): {r.state}",
                    level="" if r.state == "dumped" else "warn",
                    wrap=False,
                )
            )
            dump = [*r.python.rstrip().splitlines(), *r.native.rstrip().splitlines()]
            if dump:
                blocks.append(Pre("\n".join("   " + line for line in dump)))
        if self.native_note:
            blocks.append(Line(self.native_note, wrap=False))
        return blocks

    def records(self) -> list[dict[str, Any]]:
        return [to_data(r) for r in self.ranks]

    def to_dict(self) -> dict[str, Any]:
        return {"run_dir": str(self.run_dir), "ranks": self.records(), "native": self.native_note}


def find_run_dir(name_or_path: str | Path) -> Path:
    """A run directory given as a path, or the newest one whose name starts with it."""
    path = Path(name_or_path).expanduser()
    if (path / "run.json").is_file():
        return path
    root = runs_root()
    matches = sorted(
        (p for p in root.glob(f"{name_or_path}-*") if (p / "run.json").is_file()),
        key=lambda p: p.stat().st_mtime,
    )
    if not matches:
        raise UserInputError(
            f"{str(name_or_path)!r}: not a run directory, nor a run name under {root}"
        )
    return matches[-1]


_STOPPED = "stopped (SIGSTOP): it answers only after SIGCONT"


def _stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


def _wait_for_dump(path: Path, start: int, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    last_size, last_change = start, time.monotonic()
    while time.monotonic() < deadline:
        size = path.stat().st_size if path.exists() else 0
        now = time.monotonic()
        if size != last_size:
            last_size, last_change = size, now
        elif size > start and now - last_change >= _SETTLE_S:
            break
        time.sleep(0.02)
    if last_size <= start:
        return ""
    with path.open("rb") as f:
        f.seek(start)
        return f.read().decode("utf-8", errors="replace")


def _py_spy(pid: int) -> str:
    exe = shutil.which("py-spy")
    if exe is None:
        return ""
    try:
        done = subprocess.run(
            [exe, "dump", "--native", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"py-spy: {exc}"
    if done.returncode != 0:
        first = (done.stderr.strip().splitlines() or ["failed"])[0]
        return f"py-spy could not attach: {first}"
    return done.stdout


def rank_stacks(run_dir: Path, *, timeout_s: float = 5.0, native: bool = False) -> RunStacks:
    """Ask every live rank of the run for its Python stack, all at once."""
    meta: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        meta = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    nproc = int(meta.get("nproc") or 0)
    run_id = meta.get("run_id")
    asked: dict[int, tuple[int, int]] = {}  # rank -> (pid, offset before the signal)
    states: dict[int, tuple[int | None, str]] = {}
    for rank in range(nproc):
        try:
            pid = int((run_dir / f"stacks-rank{rank}.pid").read_text().strip())
        except (OSError, ValueError):
            states[rank] = (None, "not started (or started before stacks were registered)")
            continue
        if not carries_run_id(pid, run_id):
            states[rank] = (pid, "exited")
            continue
        if _stopped(pid):
            states[rank] = (pid, _STOPPED)
            continue
        path = run_dir / f"stacks-rank{rank}.txt"
        offset = path.stat().st_size if path.exists() else 0
        try:
            os.kill(pid, STACKS_SIGNAL)
        except OSError as exc:
            states[rank] = (pid, f"could not signal: {exc.strerror}")
            continue
        asked[rank] = (pid, offset)
    deadline = time.monotonic() + timeout_s
    dumps: dict[int, str] = {}
    for rank, (_pid, offset) in asked.items():
        left = max(0.5, deadline - time.monotonic())
        dumps[rank] = _wait_for_dump(run_dir / f"stacks-rank{rank}.txt", offset, left)
    note = ""
    if native and shutil.which("py-spy") is None:
        note = "native frames: py-spy is not installed (pip install py-spy); Python stacks only"
    elif not native:
        note = "native frames: add --native (needs py-spy and permission to ptrace)"
    out = []
    for rank in range(nproc):
        if rank in asked:
            pid = asked[rank][0]
            text = dumps.get(rank, "")
            state = "dumped" if text else f"no answer within {timeout_s:g} s"
            if not text and _stopped(pid):
                state = _STOPPED
            spy = _py_spy(pid) if native else ""
            out.append(RankStack(rank, pid, state, text, spy))
        else:
            pid_or_none, state = states[rank]
            out.append(RankStack(rank, pid_or_none, state, "", ""))
    return RunStacks(run_dir, tuple(out), note)
