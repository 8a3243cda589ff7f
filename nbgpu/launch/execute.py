"""The one way a job runs, under every face: a prepared job, or one more warm cell.

``%%torchrun``, ``nbgpu run`` and ``nbgpu.torchrun`` all call :func:`execute`: announce
the launcher's notes, start the run, follow it into the face's output (a terminal, a
cell, a widget panel, a display handle) until it ends or in a background thread,
raise :class:`~nbgpu.launch.run.RunFailed` when asked, and hand the finished run to the
face (``on_done``: pulled values into a notebook). The faces only parse their input
and choose where output goes.

A warm job (``keep``) is the same run followed with a cell: its first cell, and every
later one (``%%torchrun --on w``, ``nbgpu.torchrun(code, on="w")``, a
:class:`WarmJob`), go through the same follow; :func:`prepare_cell` finds the job by
name and checks the request (only what may change between cells, ``CELL_OPTIONS``). A
cell that raises is :class:`~nbgpu.launch.warm.CellFailed` (the ranks stay), a job
that ended is :class:`RunFailed`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nbgpu.errors import UserInputError
from nbgpu.launch.config import CELL_OPTIONS, CellRequest, Prepared, pickle_pushed, start_only
from nbgpu.launch.run import RUNS, Run, RunFailed
from nbgpu.launch.streams import LineSink, ScreenWriter
from nbgpu.launch.warm import CellFailed, CellResult

__all__ = ["Output", "WarmJob", "execute", "execute_cell", "prepare_cell", "to_screen"]


@dataclass(frozen=True)
class Output:
    """Where a run's lines go, and what to refresh on each tick of the follow loop."""

    sink: LineSink
    on_tick: Callable[[Run], None] | None = None


def _discard(_text: str) -> None:
    return None


def to_screen(
    write: Callable[[str], object],
    *,
    quiet: bool = False,
    color: bool = False,
    live_status: bool = False,
) -> Callable[[Run], Output]:
    """Prefixed text through *write* within the screen budget (nothing when *quiet*)."""

    def make(_run: Run) -> Output:
        return Output(ScreenWriter(_discard if quiet else write, color=color,
                                   live_status=live_status))  # fmt: skip

    return make


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
    """Start *prepared* and follow it into ``output(run)``; the run, finished unless
    *background* (or warm: then its first cell has run).

    ``announce`` gets each of the launcher's notes as one line. In the foreground a
    failed run raises :class:`RunFailed` when *check* is set (before ``on_done``, which
    then sees successful runs only); in the background ``on_done`` sees every run.
    """
    for note in prepared.notes:
        announce(f"[nbgpu] {note}")
    run = Run(prepared.config, environ=environ).start()
    first = CellRequest.first_of(prepared.config) if prepared.config.keep else None
    _follow(run, first, output, check=check, on_done=on_done, background=background)
    return run


def execute_cell(
    run: Run,
    request: CellRequest,
    output: Callable[[Run], Output],
    *,
    check: bool = True,
    on_done: Callable[[Run | CellResult], None] | None = None,
) -> CellResult | None:
    """Run one cell on every rank of warm *run*, following it into ``output(run)``.

    With *check*, a cell that raised or was interrupted on some rank raises
    :class:`CellFailed` (the job stays up) and a job that ended raises
    :class:`RunFailed`; ``on_done`` sees the cells that succeeded. Without *check* the
    result (None when the job ended) is returned either way.
    """
    return _follow(run, request, output, check=check, on_done=on_done)


def _follow(
    run: Run,
    cell: CellRequest | None,
    output: Callable[[Run], Output],
    *,
    check: bool,
    on_done: Callable[[Run | CellResult], None] | None,
    background: bool = False,
) -> CellResult | None:
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


# -- more cells on a warm job -------------------------------------------------------------


def warm_run(name: str, flag: str = "--on") -> Run:
    """The warm job called *name*, ready for a cell; a one-line error otherwise."""
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
            f"did not answer the interrupt): wait for it, see %gpu_stacks {name}, or end the "
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
    pull_all_ranks: bool = False,
    script_args: Sequence[str] = (),
    timeout_s: float | None = None,
    quiet: bool = False,
) -> tuple[Run, CellRequest]:
    """The warm job and the checked cell for it; nothing is sent on a bad value."""
    run = warm_run(name)
    if nproc is not None and nproc != run.config.nproc:
        raise UserInputError(
            f"nproc {nproc} with --on {name}: the job has {run.config.nproc} ranks (give "
            f"{run.config.nproc} or no count; a different count needs a new job)"
        )
    request = CellRequest(
        code=code,
        push=pickle_pushed(list(push), push) if push else {},
        pull=tuple(pull),
        pull_all_ranks=pull_all_ranks,
        script_args=tuple(script_args),
        timeout_s=timeout_s,
        quiet=quiet,
    )
    return run, request


class WarmJob:
    """A warm job from Python: ``job("code")`` runs a cell on its ranks; ``job.stop()``."""

    def __init__(self, run: Run, screen: Callable[[Run], Output]) -> None:
        self.run = run
        self._screen = screen

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
        unknown = sorted(set(cell) - set(CELL_OPTIONS))
        if unknown:
            raise start_only(f"{unknown[0]}=", self.name)
        run, request = prepare_cell(self.name, code, **cell)
        return execute_cell(run, request, self._screen, check=check)

    def stop(self) -> Run:
        """End the job: the ranks leave their loop and exit normally; the finished run."""
        if not self.run.done:
            self.run.end("stopped")
        return self.run

    def __repr__(self) -> str:
        warm = self.run.warm
        detail = warm.describe() if warm is not None and self.state == "warm" else self.state
        return f"<WarmJob {self.name!r}: {self.run.config.nproc} ranks, {detail}>"
