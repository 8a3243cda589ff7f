"""The kernel's side of a warm job: its ranks between cells, and how it ends.

A warm job is a :class:`~nbgpu.launch.run.Run` started with ``keep``: torchrun starts
the ranks as for any run, and they wait on the job's private channel for cells
(``warm_rank.py``). :class:`WarmState` (``run.warm``) knows which cell each rank is
in, interrupts a cell on every rank, ends the job gracefully (the ranks leave their
loop and exit normally, finalizers included), and watches it between cells: a rank
that dies while the job is idle, or an idle timeout, ends the job as a failed or
stopped run, never leaving a process behind.

Never imports IPython; the faces render :class:`CellResult`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbgpu._render import Result, fmt_bytes
from nbgpu.errors import NbgpuError, UserInputError
from nbgpu.launch.channel import CellServer

if TYPE_CHECKING:
    from nbgpu.launch.run import Run

__all__ = ["CellFailed", "CellResult", "WarmState"]

WATCH_S = 0.5  # how often an idle job is checked (rank deaths, idle timeout)


@dataclass(frozen=True)
class CellResult(Result):
    """How one cell of a warm job ended on each rank, and what it pulled."""

    run_name: str
    number: int
    statuses: dict[int, str]  # rank -> ok | error | interrupted | no answer
    errors: dict[int, str] = field(default_factory=dict)
    duration_s: float = 0.0
    pulled: dict[str, Any] = field(default_factory=dict)
    pulled_all: list[dict[str, Any]] = field(default_factory=list)
    pull_problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(status == "ok" for status in self.statuses.values())

    @property
    def interrupted(self) -> bool:
        return any(s in ("interrupted", "no answer") for s in self.statuses.values())

    @property
    def unanswered(self) -> list[int]:
        """Ranks still inside the cell (an interrupt did not reach them in time)."""
        return [rank for rank, status in self.statuses.items() if status == "no answer"]

    def summary(self) -> str:
        head = f"cell {self.number} on '{self.run_name}'"
        if self.ok:
            return f"{head}: ok on {len(self.statuses)} ranks in {self.duration_s:.2f} s"
        by_status: dict[str, list[int]] = {}
        for rank, status in sorted(self.statuses.items()):
            by_status.setdefault(status, []).append(rank)
        parts = []
        for status, ranks in by_status.items():
            which = "rank " + ",".join(map(str, ranks))
            first_error = next((self.errors[r] for r in ranks if self.errors.get(r)), None)
            detail = f" ({first_error.splitlines()[0][:200]})" if first_error else ""
            parts.append(f"{which} {status}{detail}")
        return f"{head}: " + "; ".join(parts)

    def text(self) -> str:
        return self.summary()

    def html_body(self) -> str:
        return f"<p>{escape(self.summary())}</p>"

    def records(self) -> list[dict[str, Any]]:
        return [
            {"rank": rank, "status": status, "error": self.errors.get(rank)}
            for rank, status in sorted(self.statuses.items())
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run_name,
            "cell": self.number,
            "ok": self.ok,
            "statuses": {str(r): s for r, s in self.statuses.items()},
            "errors": {str(r): e for r, e in self.errors.items()},
            "duration_s": self.duration_s,
            "pulled": sorted(self.pulled),
            "pull_problems": list(self.pull_problems),
        }


class CellFailed(NbgpuError):
    """A warm cell raised (or was interrupted) on some rank; the job and its state stay."""

    def __init__(self, result: CellResult) -> None:
        super().__init__(result.summary())
        self.result = result

    def _render_traceback_(self) -> list[str]:
        # The tracebacks are already in the cell's streamed output: one line, then what next.
        name = self.result.run_name
        lines = [f"[nbgpu] {self.result.summary()}"]
        if self.result.unanswered:
            ranks = ",".join(map(str, self.result.unanswered))
            lines.append(
                f"[nbgpu] rank {ranks} did not answer the interrupt (probably waiting in a "
                f"collective for a rank that left it): the job is kept but busy until it does; "
                f"%gpu_stacks {name} shows where, %gpu_stop {name} ends the job"
            )
        else:
            lines.append(
                f"[nbgpu] the ranks and their state are kept: %%torchrun --on {name} runs the "
                f"next cell, %gpu_stop {name} ends the job"
            )
        return lines


class WarmState:
    """The ranks of a warm job between and during cells (``run.warm``)."""

    def __init__(self, run: Run, server: CellServer, idle_timeout_s: float | None) -> None:
        self.run = run
        self.server = server
        self.idle_timeout_s = idle_timeout_s
        self.cells = 0  # cells sent so far; the next one is cells + 1
        self.busy: dict[int, int] = {}  # rank -> the cell it has not answered yet
        self.started: set[int] = set()  # ranks that began the current cell
        self.idle_since = time.time()
        self.lock = threading.Lock()  # a cell, or the watchdog: never both at once
        self.ended_reason: str | None = None
        self.last: CellResult | None = None  # the latest cell's result (a panel records it)
        self.log_offsets: dict[int, int] = {}  # each rank log's size when the cell began
        self._watchdog = threading.Thread(
            target=self._watch, name=f"nbgpu-warm-{run.name}", daemon=True
        )
        self._watchdog.start()

    # -- what the faces ask ------------------------------------------------------------

    @property
    def in_cell(self) -> bool:
        return bool(self.busy)

    @property
    def idle_s(self) -> float | None:
        return None if self.busy or self.run.done else time.time() - self.idle_since

    def pids(self) -> dict[int, int]:
        return self.server.pids()

    def resident_bytes(self) -> int | None:
        """The ranks' resident memory now, summed (None when none could be read)."""
        from nbgpu.profile.recorder import resident_bytes  # noqa: PLC0415

        sizes = [resident_bytes(pid) for pid in self.pids().values() if pid]
        known = [s for s in sizes if s is not None]
        return sum(known) if known else None

    def describe(self) -> str:
        """One phrase for ``%gpu_runs``: idle time, cells, memory, idle timeout."""
        if self.busy:
            cell = max(self.busy.values())
            return f"warm, cell {cell} running"
        idle = self.idle_s or 0.0
        text = f"warm, idle {_span(idle)}, {self.cells} cells"
        rss = self.resident_bytes()
        if rss is not None:
            text += f", {fmt_bytes(rss)} RSS"
        if self.idle_timeout_s is not None:
            text += f", stops after {_span(self.idle_timeout_s)} idle"
        else:
            text += ", no idle timeout"
        return text

    def check_usable(self, flag: str) -> None:
        """Refuse a new cell on a job that has ended or is still in one (one line)."""
        name = self.run.name
        self.catch_up()
        if self.run.done or self.run.agent_done:
            why = self.run.state.replace("_", " ")
            if self.run.state == "failed":
                # Died between cells: say how, since no cell was there to show it.
                why = self.run.failure_summary().removeprefix(f"run '{name}' ")
                why += f"; %gpu_diagnose {name}"
            elif self.ended_reason:
                why += f": {self.ended_reason}"
            raise UserInputError(
                f"{flag} {name}: the job has ended ({why}); start a new one with "
                f"%%torchrun N --keep --name {name}"
            )
        if self.busy:
            ranks = ",".join(str(r) for r in sorted(self.busy))
            cell = max(self.busy.values())
            raise UserInputError(
                f"{flag} {name}: rank {ranks} is still in cell {cell} (it did not answer the "
                f"interrupt): wait for it, see %gpu_stacks {name}, or end the job with "
                f"%gpu_stop {name}"
            )

    # -- a cell's bookkeeping ---------------------------------------------------------

    def catch_up(self) -> None:
        """Read answers that came after their cell was given up on (a rank left a
        collective at last): a rank that answered is free again."""
        if not self.busy or self.run.done or self.run.agent_done:
            return  # nothing owed, or nobody left to answer (the channel is closed)
        for rank, message in self.server.poll(0):
            if message.get("op") == "done":
                self.answered(rank, int(message.get("cell") or 0))

    def begin_cell(self) -> int:
        self.cells += 1
        self.started = set()
        self.last = None
        self.log_offsets = {
            rank: _size(self.run.logs[f"rank{rank}"]) for rank in range(self.run.config.nproc)
        }
        self.busy = dict.fromkeys(range(self.run.config.nproc), self.cells)
        return self.cells

    def answered(self, rank: int, cell: int) -> None:
        if self.busy.get(rank) == cell:
            del self.busy[rank]
        if not self.busy:
            self.idle_since = time.time()

    def interrupt(self, ranks: list[int]) -> None:
        """SIGINT to *ranks* (their user code gets KeyboardInterrupt; the rank stays)."""
        pids = self.pids()
        for rank in ranks:
            pid = pids.get(rank)
            if pid:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGINT)

    # -- the end -------------------------------------------------------------------------

    def stop_gracefully(self, grace_s: float) -> bool:
        """Ask idle ranks to leave their loop and exit; whether the agent exited in time."""
        if self.busy or self.run.agent is None:
            return False
        self.server.send(sorted(self.server.ranks), {"op": "stop"})
        with contextlib.suppress(Exception):
            self.run.agent.wait(timeout=grace_s)
        return self.run.agent_done

    def close(self) -> None:
        self.server.close()

    def _watch(self) -> None:
        """Between cells: a job whose ranks died, or that sat idle too long, ends."""
        run = self.run
        while not run.done:
            time.sleep(WATCH_S)
            if run.agent is None or not self.lock.acquire(blocking=False):
                continue  # not started yet, or a cell is running (its follower watches)
            try:
                if run.agent_done:
                    self.ended_reason = "a rank died while the job was idle"
                    run.end_warm()
                    return
                idle = self.idle_s
                if (
                    self.idle_timeout_s is not None
                    and idle is not None
                    and idle >= self.idle_timeout_s
                ):
                    self.ended_reason = f"idle for {_span(idle)} (--idle-timeout)"
                    run.stop("idle_timeout")
                    run.end_warm()
                    return
            finally:
                self.lock.release()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _span(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
