"""The kernel's side of a warm job (a run started with ``keep``): its ranks between and
during cells (:class:`WarmState`, ``run.warm``), and one cell in flight (:class:`Cell`).
Neither knows the run: its follow loop drives the cell, its idle watchdog ends a job whose
ranks died or that sat idle too long.
"""

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbgpu._render import Block, Line, Result, fmt_bytes, span
from nbgpu.errors import NbgpuError
from nbgpu.launch.config import CellRequest, ranks_text
from nbgpu.launch.outcomes import Pulled, add_pulled
from nbgpu.launch.relay import CellServer, NodeChannel
from nbgpu.launch.rundirs import rank_log

__all__ = ["CELL_MARK", "INTERRUPT_WAIT_S", "Cell", "CellFailed", "CellResult", "WarmState", "span"]

WATCH_S = 0.5  # how often an idle job is checked (rank deaths, idle timeout)
INTERRUPT_WAIT_S = 5.0  # how long interrupted ranks get to answer before we say so
DEATH_WAIT_S = 10.0  # a rank hung up: time for torchrun to notice and end the job
#: How a rank's log marks where a warm cell begins: ``#### nbgpu cell 3 ####`` (the rank
#: prints the line the cell's message carries).
CELL_MARK = "#### nbgpu cell "


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
    idle: tuple[int, ...] = ()  # ranks left out of the cell (--ranks)

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

    @property
    def waiting(self) -> list[int]:
        """Ranks waiting in a collective for ranks that do not run the cell (--ranks)."""
        return [rank for rank, status in self.statuses.items() if status == "waiting"]

    def summary(self) -> str:
        head = f"cell {self.number} on '{self.run_name}'"
        idle = f"; rank {ranks_text(self.idle)} idle (--ranks)" if self.idle else ""
        if self.ok and self.idle:
            ran = ranks_text(list(self.statuses))
            return f"{head}: ok on rank {ran} in {self.duration_s:.2f} s{idle}"
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
        return f"{head}: " + "; ".join(parts) + idle

    def content(self) -> list[Block]:
        return [Line(self.summary(), level="" if self.ok else "bad", wrap=False)]

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
            "idle": list(self.idle),
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
        if self.result.waiting:
            ranks = ",".join(map(str, self.result.waiting))
            lines.append(
                f"[nbgpu] rank {ranks} waits in a collective that needs the idle ranks: it "
                f"returns when the group's timeout ends the wait, and the job is busy until "
                f"then; %gpu_stacks {name} shows where, %gpu_stop {name} ends the job"
            )
        elif self.result.unanswered:
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

    def __init__(
        self, server: CellServer | NodeChannel, world_size: int, idle_timeout_s: float | None
    ) -> None:
        self.server = server
        self.world_size = world_size  # every rank, on every node
        self.idle_timeout_s = idle_timeout_s
        self.cells = 0  # cells sent so far; the next one is cells + 1
        self.busy: dict[int, int] = {}  # rank -> the cell it has not answered yet
        self.started: set[int] = set()  # ranks that began the current cell
        self.idle_since = time.time()
        self.lock = threading.Lock()  # a cell, or the watchdog: never both at once
        self.ended_reason: str | None = None
        self.last: CellResult | None = None  # the latest cell's result (a panel records it)
        self.log_offsets: dict[int, int] = {}  # each rank log's size when the cell began
        self.held: dict[int, dict[str, Any]] = {}  # rank -> the names it reported last

    @property
    def idle_s(self) -> float | None:
        """Seconds since the last cell ended (None in a cell, or once the job is over)."""
        return None if self.busy or self.server.closed else time.time() - self.idle_since

    def pids(self) -> dict[int, int]:
        return dict(self.server.pids)

    def describe(self) -> str:
        """One phrase for ``%gpu_runs``: idle time, cells, the ranks' memory, idle timeout."""
        from nbgpu.profile.recorder import resident_bytes  # noqa: PLC0415

        if self.busy:
            return f"warm, cell {max(self.busy.values())} running"
        text = f"warm, idle {span(self.idle_s or 0.0)}, {self.cells} cells"
        sizes = map(resident_bytes, filter(None, self.pids().values()))
        known = [size for size in sizes if size is not None]
        if known:
            text += f", {fmt_bytes(sum(known))} RSS"
        if self.idle_timeout_s is not None:
            return text + f", stops after {span(self.idle_timeout_s)} idle"
        return text + ", no idle timeout"

    def catch_up(self) -> None:
        """Read answers that came after their cell was given up on (a rank left a
        collective at last): a rank that answered is free again."""
        if not self.busy or self.server.closed:
            return  # nothing owed, or nobody left to answer
        for rank, message in self.server.poll(0):
            if message.get("op") == "done":
                self.answered(rank, int(message.get("cell") or 0), message.get("names"))

    def begin_cell(self, run_dir: Path, ranks: list[int]) -> int:
        self.cells += 1
        self.started = set()
        self.last = None
        self.log_offsets = {rank: _size(rank_log(run_dir, rank)) for rank in range(self.world_size)}
        self.busy = dict.fromkeys(ranks, self.cells)
        return self.cells

    def answered(self, rank: int, cell: int, names: dict[str, Any] | None = None) -> None:
        if names is not None:
            self.held[rank] = names
        if self.busy.get(rank) == cell:
            del self.busy[rank]
        if not self.busy:
            self.idle_since = time.time()

    def interrupt(self, ranks: list[int]) -> None:
        """SIGINT to *ranks* (their user code gets KeyboardInterrupt; the rank stays)."""
        self.server.interrupt(ranks)  # on their node: through its relay across nodes

    def ask_to_stop(self) -> bool:
        """Ask idle ranks to leave their loop and exit normally; whether they were asked."""
        if self.busy:
            return False
        self.server.send(sorted(self.server.ranks), {"op": "stop"})
        return True


class Cell:
    """One cell in flight: sent to every rank, their answers so far, an interrupt."""

    def __init__(
        self, warm: WarmState, request: CellRequest, run_dir: Path, *, serial_imports: bool
    ) -> None:
        self.warm, self.request, self.run_dir = warm, request, run_dir
        self.serial_imports = serial_imports
        self.number = 0
        self.sent = False
        self.ranks = list(range(warm.world_size) if request.ranks is None else request.ranks)
        self.waiting: dict[int, str] = {}  # rank -> where it waits for idle ranks (--ranks)
        self.answers: dict[int, dict[str, Any]] = {}
        self.interrupted_at: float | None = None
        self.gone_at: float | None = None  # when a rank hung up
        self.started = time.time()
        self.on_debug: Callable[[int, dict[str, Any]], None] | None = None  # breakpoint()

    def step(self, wait_s: float) -> None:
        """Send the cell once every rank has connected; hear answers (waiting up to
        *wait_s*: an answer wakes the follow loop at once)."""
        if not self.sent and len(self.warm.server.ranks) == self.warm.world_size:
            self._send()
        interrupted = None
        for rank, message in self.warm.server.poll(wait_s):
            try:
                self._hear(rank, message)
            except KeyboardInterrupt as exc:  # noqa: PERF203  (hear the rest: lose no answer)
                interrupted = exc
        if interrupted is not None:
            raise interrupted
        if self.warm.server.gone and self.gone_at is None:
            self.gone_at = time.monotonic()  # torchrun is about to end the job

    def _send(self) -> None:
        self.number = self.warm.begin_cell(self.run_dir, self.ranks)
        path = self.run_dir / f"cell{self.number}.py"  # tracebacks show the cell's lines
        path.write_text(self.request.code, encoding="utf-8")
        message = {
            "op": "cell",
            "cell": self.number,
            "mark": f"{CELL_MARK}{self.number} ####",
            "source": self.request.code,
            "filename": str(path),
            "push": dict(self.request.push),
            "pull": list(self.request.pull),
            "pull_all_ranks": self.request.pull_all_ranks,
            "script_args": list(self.request.script_args),
            "serial_imports": self.serial_imports,
            "ranks": None if self.request.ranks is None else self.ranks,
            "collective_wait_s": INTERRUPT_WAIT_S,
        }
        self.warm.server.send(self.ranks, message)
        self.sent = True

    def _hear(self, rank: int, message: dict[str, Any]) -> None:
        cell = message.get("cell")
        if message.get("op") == "started" and cell == self.number:
            self.warm.started.add(rank)
            if self.interrupted_at is not None:
                self.warm.interrupt([rank])  # it began after the interrupt went out
        elif message.get("op") == "done":
            self.warm.answered(rank, int(cell or 0), message.get("names"))
            if cell == self.number:
                self.answers[rank] = message
        elif message.get("op") == "waiting" and cell == self.number:
            self.waiting[rank] = str(message.get("where"))
        elif self.on_debug is not None and str(message.get("op")).startswith("debug-"):
            self.on_debug(rank, message)  # a rank stopped at breakpoint(): its pdb speaks

    def interrupt(self) -> None:
        if self.interrupted_at is None:
            self.interrupted_at = time.monotonic()
            self.warm.interrupt(sorted(self.warm.started - set(self.answers)))

    @property
    def all_answered(self) -> bool:
        return self.sent and len(self.answers) == len(self.ranks)

    def over(self) -> bool:
        """Every rank answered, or the interrupted ranks had their time to (or the ranks
        left wait in a collective for ranks that do not run the cell: --ranks)."""
        if self.waiting and set(self.ranks) - set(self.answers) <= set(self.waiting):
            return True
        return self.all_answered or (
            self.interrupted_at is not None
            and time.monotonic() - self.interrupted_at > INTERRUPT_WAIT_S
        )

    def ranks_died(self) -> bool:
        """A rank hung up long ago, and torchrun has not ended the job by itself."""
        return self.gone_at is not None and time.monotonic() - self.gone_at > DEATH_WAIT_S

    def result(self, run_name: str) -> CellResult:
        statuses: dict[int, str] = {}
        errors: dict[int, str] = {}
        pulled = Pulled()
        for rank in self.ranks:
            answer = self.answers.get(rank, {"status": "no answer"})
            if rank in self.waiting and rank not in self.answers:
                answer = {"status": "waiting", "error": self.waiting[rank]}
            statuses[rank] = str(answer.get("status"))
            if answer.get("error"):
                errors[rank] = str(answer["error"])
            if answer.get("pulled") is not None:
                add_pulled(pulled, rank, answer["pulled"])
                if rank == self.ranks[0] and rank != 0:  # --ranks without 0: the first's
                    pulled.values = pulled.every_rank[-1]
        return CellResult(
            run_name=run_name,
            number=self.number,
            statuses=statuses,
            errors=errors,
            duration_s=time.time() - self.started,
            pulled=pulled.values,
            pulled_all=pulled.every_rank,
            pull_problems=pulled.problems,
            idle=tuple(sorted(set(range(self.warm.world_size)) - set(self.ranks))),
        )


def _size(path: Path) -> int:
    with contextlib.suppress(OSError):
        return path.stat().st_size
    return 0
