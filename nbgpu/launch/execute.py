"""The one way a prepared job runs, under every face.

``%%torchrun``, ``nbgpu run`` and ``nbgpu.torchrun`` all call :func:`execute`: announce
the launcher's notes, start the run, follow it into the face's output (a terminal, a
cell, a widget panel, a display handle) until it ends or in a background thread,
raise :class:`~nbgpu.launch.run.RunFailed` when asked, and hand the finished
run to the face (``on_done``: pulled values into a notebook). The faces only parse
their input and choose where output goes.

A warm job (``keep``) runs its first cell, and every later one, through
:func:`execute_cell`: the same outputs, the same announcements; a cell that raises
is :class:`~nbgpu.launch.warm.CellFailed` (the ranks stay), a rank that dies ends the
job as :class:`RunFailed`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from nbgpu.launch.config import CellRequest, Prepared
from nbgpu.launch.follow import follow
from nbgpu.launch.run import Run, RunFailed
from nbgpu.launch.streams import LineSink, ScreenWriter
from nbgpu.launch.warm import CellFailed, CellResult

__all__ = ["Output", "execute", "execute_cell", "to_screen"]


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
    """Start *prepared* and follow it into ``output(run)``; the run, finished unless *background*.

    ``announce`` gets each of the launcher's notes as one line. In the foreground a
    failed run raises :class:`RunFailed` when *check* is set (before ``on_done``, which
    then sees successful runs only); in the background ``on_done`` sees every run.
    """
    for note in prepared.notes:
        announce(f"[nbgpu] {note}")
    run = Run(prepared.config, environ=environ).start()
    if prepared.config.keep:
        first = CellRequest.first_of(prepared.config)
        execute_cell(run, first, output, check=check, on_done=on_done)
        return run
    out = output(run)
    if background:

        def work() -> None:
            follow(run, out.sink, on_tick=out.on_tick)
            if on_done is not None:
                on_done(run)

        run.thread = threading.Thread(target=work, name=f"nbgpu-{run.name}", daemon=True)
        run.thread.start()
        return run
    follow(run, out.sink, on_tick=out.on_tick)
    if check and run.state != "succeeded":
        raise RunFailed(run, output_shown=not prepared.config.quiet)
    if on_done is not None:
        on_done(run)
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
    from nbgpu.launch.cell_follow import follow_cell  # noqa: PLC0415  (warm jobs only)

    out = output(run)
    result = follow_cell(run, request, out.sink, on_tick=out.on_tick)
    if out.on_tick is not None:
        out.on_tick(run)
    if result is None:
        if check:
            raise RunFailed(run, output_shown=not request.quiet)
        return None
    if check and not result.ok:
        raise CellFailed(result)
    if on_done is not None and result.ok:
        on_done(result)
    return result
