"""This process's runs as the faces ask for them: ``nbgpu.runs()``, a table
(``%gpu_runs``: silent ranks marked), stopping by name (``%gpu_stop``).

Each run enters itself in :data:`~nbgpu.launch.run.RUNS` when it starts. Never imports
IPython.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from nbgpu._render import Block, Line, Result, Table, to_text
from nbgpu.errors import UserInputError
from nbgpu.launch.run import RUNS, Run
from nbgpu.launch.warm import span

__all__ = [
    "RunsTable",
    "StopSummary",
    "Stopped",
    "runs",
    "runs_table",
    "silent_ranks",
    "stop_runs",
]

SILENT_ENV = "NBGPU_SILENT_AFTER"
SILENT_AFTER_S = 120.0  # a rank quiet this long is marked (a hang shows up as silence)


def runs() -> dict[str, Run]:
    """The runs started by this process (this kernel), by name."""
    return dict(RUNS)


def _age(run: Run) -> str:
    return "-" if run.started_at is None else span(time.time() - run.started_at)


def _silent_after_s() -> float:
    try:
        return float(os.environ.get(SILENT_ENV) or SILENT_AFTER_S)
    except ValueError:
        return SILENT_AFTER_S


def silent_ranks(run: Run, after_s: float | None = None) -> list[tuple[int, float]]:
    """Ranks of a running run that have written nothing for *after_s*: (rank, seconds)."""
    if run.state != "running" or run.started_at is None:
        return []
    if run.warm is not None and not run.warm.in_cell:
        return []  # between cells a warm job's ranks are quiet by design
    limit = _silent_after_s() if after_s is None else after_s
    now = time.time()
    out = []
    for rank, log in enumerate(run.logs[f"rank{r}"] for r in range(run.config.world_size)):
        try:
            last = max(log.stat().st_mtime, run.started_at)
        except OSError:
            last = run.started_at
        if now - last >= limit:
            out.append((rank, now - last))
    return out


def _quiet_cell(run: Run) -> str:
    quiet = silent_ranks(run)
    if not quiet:
        return "-"
    ranks = ",".join(str(r) for r, _s in quiet)
    longest = max(s for _r, s in quiet)
    return f"rank {ranks} silent {span(longest)}"


@dataclass(frozen=True)
class RunsTable(Result):
    entries: tuple[Run, ...]

    def simulated_fleet(self) -> str | None:
        fleets = {run.simulated_fleet() for run in self.entries} - {None}
        return ", ".join(sorted(f for f in fleets if f)) or None

    def _table(self) -> Table:
        table = Table(["name", "state", "ranks", "GPUs", "port", "age", "quiet", "log dir"])
        for run in self.entries:
            quiet = _quiet_cell(run)
            gpus = run.config.cuda_visible_devices
            level = {"failed": "bad", "timed_out": "bad", "running": ""}.get(run.state, "ok")
            state = run.state.replace("_", " ")
            if run.warm is not None and not run.done:
                state = run.warm.describe()
            elif run.stop_reason == "idle_timeout":
                state = "stopped (idle timeout)"
            table.add(
                run.name,
                state,
                run.config.world_size,
                "-" if gpus is None else gpus or "none",
                run.port or "-",
                _age(run),
                quiet,
                str(run.dir),
                level="warn" if quiet != "-" else level,
            )
        return table

    def content(self) -> list[Block]:
        if not self.entries:
            return [Line("No runs in this kernel yet (start one with %%torchrun N).", wrap=False)]
        hints = [
            Line(
                f"{run.name}: ranks silent for a while (a hang?): %gpu_stacks {run.name} "
                "shows every rank's stack",
                level="warn",
                wrap=False,
            )
            for run in self.entries
            if silent_ranks(run)
        ]
        return [self._table(), *hints]

    def text(self) -> str:
        return to_text(self.content(), width=120)  # a row per run: wider than 80 columns

    def records(self) -> list[dict[str, Any]]:
        return [
            {**run.to_dict(), "silent_ranks": [r for r, _s in silent_ranks(run)]}
            for run in self.entries
        ]

    def to_dict(self) -> dict[str, Any]:
        return {"runs": self.records()}


def runs_table() -> RunsTable:
    return RunsTable(tuple(RUNS.values()))


@dataclass(frozen=True)
class Stopped:
    """One run that was stopped: how many processes took a signal, SIGKILL, or survived."""

    name: str
    signalled: int
    killed: int
    survivors: tuple[int, ...]

    def sentence(self) -> str:
        if self.signalled or self.killed or self.survivors:
            line = f"stopped '{self.name}': {self.signalled} processes signalled"
        else:
            line = f"stopped '{self.name}': every process exited when asked"
        if self.killed:
            line += f", {self.killed} needed SIGKILL"
        if self.survivors:
            line += f"; STILL ALIVE: {', '.join(map(str, self.survivors))}"
        return line


@dataclass(frozen=True)
class StopSummary(Result):
    stopped: tuple[Stopped, ...]

    def content(self) -> list[Block]:
        if not self.stopped:
            return [Line("Nothing was running.", wrap=False)]
        return [
            Line(s.sentence(), level="bad" if s.survivors else "", wrap=False) for s in self.stopped
        ]

    def records(self) -> list[dict[str, Any]]:
        return list(self.to_dict()["stopped"])


def stop_runs(name: str | None) -> StopSummary:
    """Stop one run by name, or every running one with ``name=None``."""
    if name is not None and name not in RUNS:
        known = ", ".join(RUNS) or "none yet"
        raise UserInputError(f"no run named {name!r} (runs: {known})")
    targets = [RUNS[name]] if name is not None else [r for r in RUNS.values() if not r.done]
    out: list[Stopped] = []
    for run in targets:
        if run.done:
            out.append(Stopped(run.name, 0, 0, ()))
            continue
        report = run.end("stopped")
        out.append(Stopped(run.name, report.signalled, report.escalated_to_kill, report.survivors))
    return StopSummary(tuple(out))
