"""The one way a job runs under every face, and this process's runs by name: ``%%torchrun``,
``nbgpu run`` and ``nbgpu.torchrun`` call :func:`execute`, and every cell of a warm job goes
through the same follow (:func:`execute_cell`), into the face's output (a terminal, a cell, a
widget panel, a display handle). The faces ask :data:`~nbgpu.launch.run.RUNS` through
``runs()``, ``runs_table()`` and ``stop_runs()``.
"""

import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nbgpu._render import Block, Line, Result, Table, rank_colour, span, to_text
from nbgpu.errors import UserInputError
from nbgpu.launch.config import (
    CELL_OPTIONS,
    HANG_AFTER_S,
    CellRequest,
    Prepared,
    parse_ranks,
    pickle_pushed,
    start_only,
)
from nbgpu.launch.procs import StopReport
from nbgpu.launch.run import RUNS, Run, RunFailed
from nbgpu.launch.streams import LineSink, ScreenWriter
from nbgpu.launch.warm import CellFailed, CellResult

__all__ = [
    "Output", "WarmJob", "execute", "execute_cell", "prepare_cell", "run_cell", "runs",
    "runs_table", "silent_ranks", "stop_runs", "to_screen",
]  # fmt: skip

SILENT_AFTER_S = 120.0  # a rank quiet this long is marked (a hang shows up as silence)
_LEVELS = {"failed": "bad", "timed_out": "bad", "hung": "bad", "running": ""}  # else "ok"


@dataclass(frozen=True)
class Output:
    """Where a run's lines go, and what to refresh on each tick of the follow loop."""

    sink: LineSink
    on_tick: Callable[[Run], None] | None = None


def to_screen(
    write: Callable[[str], object],
    *,
    quiet: bool = False,
    color: bool = False,
    live_status: bool = False,
) -> Callable[[Run], Output]:
    """A new ScreenWriter for each run or cell, through *write* (nothing when *quiet*)."""
    target = (lambda _text: None) if quiet else write
    colour = rank_colour if color else None
    return lambda _run: Output(ScreenWriter(target, colour=colour, live_status=live_status))


def execute(
    prepared: Prepared,
    output: Callable[[Run], Output],
    *,
    announce: Callable[[str], object],
    background: bool = False,
    check: bool = True,
    on_done: Callable[[Run | CellResult], None] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Run:
    """Start *prepared* and follow it into ``output(run)``; the run, finished unless *background*
    (a warm job: its first cell has run). In the foreground a failed run raises :class:`RunFailed`
    with *check* and ``on_done`` sees successes only; in the background it sees every run."""
    for note in prepared.notes:
        announce(f"[nbgpu] {note}")
    config = prepared.config
    run = Run(config, environ=environ).start()
    first = None  # a warm job starts with the cell that asked for it
    if config.keep:
        fields = {k: getattr(config, k) for k in CELL_OPTIONS if hasattr(config, k)}
        first = CellRequest(config.code or "", **fields)
    execute_cell(run, first, output, check=check, on_done=on_done, background=background)
    return run


def execute_cell(
    run: Run,
    cell: CellRequest | None,
    output: Callable[[Run], Output],
    *,
    check: bool = True,
    on_done: Callable[[Run | CellResult], None] | None = None,
    background: bool = False,
) -> CellResult | None:
    """Follow *run* into ``output(run)``; with *cell*, run it on every rank of the warm job
    and return its result (None when the job ended). With *check*, a failed cell raises
    :class:`CellFailed` (the job stays up), a run or job that ended :class:`RunFailed`."""
    out = output(run)

    def follow() -> CellResult | None:
        result = run.follow(out.sink, cell=cell, on_tick=out.on_tick)
        ended = run.state != "succeeded" if cell is None else result is None
        if check and ended and not background:
            quiet = run.config.quiet if cell is None else cell.quiet
            raise RunFailed(run, output_shown=not quiet)
        if check and result is not None and not result.ok:
            raise CellFailed(result)
        if on_done is not None and (cell is None or (result is not None and result.ok)):
            on_done(run if result is None else result)
        return result

    if background and cell is None:
        run.thread = threading.Thread(target=follow, name=f"nbgpu-{run.name}", daemon=True)
        run.thread.start()
        return None
    return follow()


def warm_run(name: str, flag: str = "--on") -> Run:
    run = RUNS.get(name)
    if run is None or run.warm is None:
        warm = [n for n, r in RUNS.items() if r.warm is not None and not r.done]
        known = ", ".join(warm) or "none (start one with %%torchrun N --keep --name NAME)"
        what = "no warm job" if run is None else "a cold run, not a warm job"
        raise UserInputError(f"{flag} {name}: {what} named {name!r} (warm jobs: {known})")
    run.warm.catch_up()
    if run.done or run.agent_done:
        why = run.state.replace("_", " ")
        if run.state == "failed":
            # Died between cells: say how, since no cell was there to show it.
            why = run.failure_summary().removeprefix(f"run '{name}' ") + f"; %gpu_diagnose {name}"
        elif run.warm.ended_reason:
            why += f": {run.warm.ended_reason}"
        raise UserInputError(
            f"{flag} {name}: the job has ended ({why}); start a new one with "
            f"%%torchrun N --keep --name {name}"
        )
    if run.warm.busy:
        ranks = ",".join(str(r) for r in sorted(run.warm.busy))
        raise UserInputError(
            f"{flag} {name}: rank {ranks} is still in cell {max(run.warm.busy.values())} (it "
            f"has not answered yet): wait for it, see %gpu_stacks {name}, or end the "
            f"job with %gpu_stop {name}"
        )
    return run


def prepare_cell(
    name: str,
    code: str,
    *,
    nproc: int | None = None,
    push: Mapping[str, Any] | None = None,
    pull: Sequence[str] = (),
    script_args: Sequence[str] = (),
    ranks: object = None,
    **fields: Any,
) -> tuple[Run, CellRequest]:
    """The warm job and the checked cell for it (only ``CELL_OPTIONS`` may change; the
    others, ``timeout_s``, ``quiet`` and ``pull_all_ranks``, are the request's as given).
    *ranks* (``"0,2"``, ``"1-3"``, ``[0, 2]``): only those ranks run it."""
    run = warm_run(name)
    if nproc is not None and nproc != run.config.nproc:
        raise UserInputError(
            f"nproc {nproc} with --on {name}: the job has {run.config.nproc} ranks (give "
            f"{run.config.nproc} or no count; a different count needs a new job)"
        )
    return run, CellRequest(
        code=code,
        push=pickle_pushed(list(push), push) if push else {},
        pull=tuple(pull),
        script_args=tuple(script_args),
        ranks=None if ranks is None else parse_ranks(ranks, run.config.world_size),
        **fields,
    )


def run_cell(
    name: str, code: str, write: Callable[[str], object], *, check: bool = True, **cell: Any
) -> CellResult | None:
    """One more cell on the warm job *name*, from Python, its lines through *write*."""
    unknown = sorted(set(cell) - {*CELL_OPTIONS, "nproc"})
    if unknown:
        raise start_only(f"{unknown[0]}=", name)
    run, request = prepare_cell(name, code, **cell)
    return execute_cell(run, request, to_screen(write, quiet=request.quiet), check=check)


class WarmJob:
    """A warm job from Python: ``job("code")`` runs a cell on its ranks; ``job.stop()``."""

    def __init__(self, run: Run, write: Callable[[str], object]) -> None:
        self.run = run
        self._write = write

    @property
    def name(self) -> str:
        return self.run.name

    @property
    def state(self) -> str:
        """``warm`` while the ranks are up, then the run's final state."""
        return "warm" if not self.run.done and not self.run.agent_done else self.run.state

    @property
    def idle_s(self) -> float | None:
        return None if self.run.warm is None else self.run.warm.idle_s

    @property
    def cells(self) -> int:
        return 0 if self.run.warm is None else self.run.warm.cells

    def __call__(self, code: str, *, check: bool = True, **cell: Any) -> CellResult | None:
        """Run *code* on every rank (``push``, ``pull``, ``pull_all_ranks``, ``timeout_s``...)."""
        return run_cell(self.name, code, self._write, check=check, **cell)

    def stop(self) -> Run:
        """End the job: the ranks leave their loop and exit normally; the finished run."""
        if not self.run.done:
            self.run.end("stopped")
        return self.run

    def __repr__(self) -> str:
        warm = self.run.warm
        detail = warm.describe() if warm is not None and self.state == "warm" else self.state
        return f"<WarmJob {self.name!r}: {self.run.config.nproc} ranks, {detail}>"


def runs() -> dict[str, Run]:
    return dict(RUNS)


def silent_ranks(run: Run, after_s: float | None = None) -> list[tuple[int, float]]:
    """Ranks of a running run that have written nothing for *after_s* (default
    ``NBGPU_SILENT_AFTER``, else the run's ``--hang-after``, else 120 s): (rank, seconds)."""
    if run.state != "running" or run.started_at is None:
        return []
    if run.warm is not None and not run.warm.busy:
        return []  # between cells a warm job's ranks are quiet by design
    if after_s is None:
        after_s = SILENT_AFTER_S
        with contextlib.suppress(ValueError):
            after_s = float(
                os.environ.get("NBGPU_SILENT_AFTER") or run.config.hang_after_s or SILENT_AFTER_S
            )
    now = time.time()
    out = []
    logs = run.logs  # one dict: the property builds every rank's path
    for rank in range(run.config.world_size):
        last = run.started_at
        with contextlib.suppress(OSError):
            last = max(logs[f"rank{rank}"].stat().st_mtime, run.started_at)
        if now - last >= after_s:
            out.append((rank, now - last))
    return out


@dataclass(frozen=True)
class RunsTable(Result):
    entries: tuple[Run, ...]

    def simulated_fleet(self) -> str | None:
        fleets = {run.simulated_fleet() for run in self.entries} - {None}
        return ", ".join(sorted(f for f in fleets if f)) or None

    def content(self) -> list[Block]:
        if not self.entries:
            return [Line("No runs in this kernel yet (start one with %%torchrun N).", wrap=False)]
        table = Table(["name", "state", "ranks", "GPUs", "port", "age", "quiet", "log dir"])
        hints = []
        for run in self.entries:
            silent = silent_ranks(run)
            quiet = "-"
            if run.stall_lines and run.stalls is not None and run.stalls.reported_at:
                quiet = "STALLED"
                hints.append(Line(f"{run.name}: " + "; ".join(run.stall_lines), level="bad"))
                silent = []  # said once, by the stall
            elif silent:
                ranks = ",".join(str(r) for r, _s in silent)
                quiet = f"rank {ranks} silent {span(max(s for _r, s in silent))}"
                hint = f"{run.name}: ranks silent for a while (a hang?): %gpu_stacks {run.name}"
                hints.append(Line(hint + " shows every rank's stack", level="warn", wrap=False))
            after = run.config.hang_after_s
            if after != HANG_AFTER_S:  # a run's own --hang-after (the default is said once)
                quiet += " (no stall look)" if not after else f" (stall after {span(after)})"
            gpus = run.config.cuda_visible_devices
            level = _LEVELS.get(run.state, "ok")
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
                "-" if run.started_at is None else span(time.time() - run.started_at),
                quiet,
                str(run.dir),
                level="warn" if silent or quiet.startswith("STALLED") else level,
            )
        stall = Line(
            f"a run quiet for {span(HANG_AFTER_S)} with a collective pending is stalled: nbgpu "
            "names the rank and the line (--hang-after S for another time, 0: never)",
            wrap=False,
        )
        return [table, *hints, stall]

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
        report = StopReport(0, 0, ()) if run.done else run.end("stopped")
        out.append(Stopped(run.name, report.signalled, report.escalated_to_kill, report.survivors))
    return StopSummary(tuple(out))
