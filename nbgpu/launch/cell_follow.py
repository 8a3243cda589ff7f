"""Follow one cell of a warm job: send it, stream its output, collect every rank's answer.

The loop waits on the job's channel (a rank's answer wakes it at once: a trivial cell
costs a round trip, not a polling interval) and streams each rank's new log lines to
the cell's output, as a cold run does. The notebook's interrupt, or ``--timeout``,
interrupts the cell on every rank and waits a bounded time for their answers: a rank
stuck in a collective is reported, never waited for. A second interrupt during that
wait ends the job. A rank that dies ends the job like a failed run.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nbgpu.launch.channel import CELL_MARK
from nbgpu.launch.config import CellRequest
from nbgpu.launch.follow import tick
from nbgpu.launch.outcomes import Pulled, add_pulled
from nbgpu.launch.streams import LineSink
from nbgpu.launch.warm import CellResult

if TYPE_CHECKING:
    from nbgpu.launch.run import Run
    from nbgpu.launch.warm import WarmState

__all__ = ["INTERRUPT_WAIT_S", "follow_cell"]

INTERRUPT_WAIT_S = 5.0  # how long interrupted ranks get to answer before we say so
_DEATH_WAIT_S = 10.0  # a rank hung up: time for torchrun to notice and end the job


class _Cell:
    """One cell in flight: the answers so far, and whether (since when) it was interrupted."""

    def __init__(self, run: Run, warm: WarmState, request: CellRequest) -> None:
        self.run, self.warm, self.request = run, warm, request
        self.number = 0
        self.sent = False
        self.answers: dict[int, dict[str, Any]] = {}
        self.interrupted_at: float | None = None
        self.gone_at: float | None = None
        self.started = time.time()

    def send(self) -> None:
        self.number = self.warm.begin_cell()
        path = self.run.dir / f"cell{self.number}.py"  # tracebacks show the cell's lines
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
            "serial_imports": self.run.config.serial_imports,
        }
        self.warm.server.send(list(range(self.run.config.nproc)), message)
        self.sent = True

    def hear(self, rank: int, message: dict[str, Any]) -> None:
        cell = message.get("cell")
        if message.get("op") == "started" and cell == self.number:
            self.warm.started.add(rank)
            if self.interrupted_at is not None:
                self.warm.interrupt([rank])  # it began after the interrupt went out
        elif message.get("op") == "done":
            self.warm.answered(rank, int(cell or 0))
            if cell == self.number:
                self.answers[rank] = message

    def interrupt(self) -> None:
        if self.interrupted_at is None:
            self.interrupted_at = time.monotonic()
            self.warm.interrupt(sorted(self.warm.started - set(self.answers)))

    @property
    def all_answered(self) -> bool:
        return self.sent and len(self.answers) == self.run.config.nproc

    def waited_enough(self) -> bool:
        return (
            self.interrupted_at is not None
            and time.monotonic() - self.interrupted_at > INTERRUPT_WAIT_S
        )


def follow_cell(
    run: Run,
    request: CellRequest,
    writer: LineSink,
    *,
    on_tick: Callable[[Run], None] | None = None,
    flush_s: float = 0.1,
) -> CellResult | None:
    """Run *request* on every rank of warm *run*; its result, or None if the job ended."""
    warm = run.warm
    assert warm is not None  # noqa: S101  (callers check run.warm)
    run.writer = writer
    cell = _Cell(run, warm, request)
    with warm.lock:
        try:
            _loop(run, cell, writer, on_tick, flush_s)
        except KeyboardInterrupt:
            # A second interrupt while waiting for the ranks: end the job, now.
            run.stop("interrupted", first_signal=signal.SIGINT)
        for label, lines in run.poll_lines(every=True):
            writer.add(label, _without_marks(lines))
        if run.agent_done or run.stop_reason is not None:
            run.end_warm()
            writer.finish(str(run.dir))
            return None
        result = _result(run, cell)
        warm.last = result  # before finish(): a widget panel records this cell's outcome
        writer.finish(str(run.dir))
        return result


def _loop(
    run: Run,
    cell: _Cell,
    writer: LineSink,
    on_tick: Callable[[Run], None] | None,
    flush_s: float,
) -> None:
    warm = cell.warm
    last_flush = 0.0
    timeout = cell.request.timeout_s
    while True:
        try:
            if not cell.sent and len(warm.server.ranks) == run.config.nproc:
                cell.send()
            for rank, message in warm.server.poll(0.05):
                cell.hear(rank, message)
            for label, lines in run.poll_lines():
                writer.add(label, _without_marks(lines))
            now = time.monotonic()
            if now - last_flush >= flush_s or cell.all_answered:
                tick(run, writer, on_tick)
                last_flush = now
            if cell.all_answered or run.agent_done or cell.waited_enough():
                return
            if warm.server.gone and cell.gone_at is None:
                cell.gone_at = now  # a rank hung up: torchrun is about to end the job
            if cell.gone_at is not None and now - cell.gone_at > _DEATH_WAIT_S:
                run.stop("failed")
                return
            if timeout is not None and time.time() - cell.started > timeout:
                cell.interrupt()
        except KeyboardInterrupt:  # noqa: PERF203  (the notebook's stop button, any time)
            if not cell.sent:
                run.stop("interrupted", first_signal=signal.SIGINT)  # nothing to keep yet
                return
            if cell.interrupted_at is not None:
                raise  # the second one: the caller ends the job
            cell.interrupt()


def _without_marks(lines: list[str]) -> list[str]:
    return [line for line in lines if not line.startswith(CELL_MARK)]


def _result(run: Run, cell: _Cell) -> CellResult:
    statuses: dict[int, str] = {}
    errors: dict[int, str] = {}
    pulled = Pulled()
    for rank in range(run.config.nproc):
        answer = cell.answers.get(rank)
        if answer is None:
            statuses[rank] = "no answer"
            continue
        statuses[rank] = str(answer.get("status"))
        if answer.get("error"):
            errors[rank] = str(answer["error"])
        if answer.get("pulled") is not None:
            add_pulled(pulled, rank, answer["pulled"])
    return CellResult(
        run_name=run.name,
        number=cell.number,
        statuses=statuses,
        errors=errors,
        duration_s=time.time() - cell.started,
        pulled=pulled.values,
        pulled_all=pulled.every_rank,
        pull_problems=pulled.problems,
    )
