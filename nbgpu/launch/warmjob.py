"""Running more cells on a warm job: finding it, checking the request, a small handle.

``%%torchrun --on w`` and ``nbgpu.torchrun(code, on="w")`` come here: the job is looked
up by name, the request is checked (only what can change between cells may be given:
pushed and pulled values, the cell's arguments and time limit, quiet; the rank count
must be the job's), and the cell runs through ``execute.execute_cell``. A bad request
is one line naming the value; the job is left exactly as it was. :class:`WarmJob` is
what ``nbgpu.torchrun(code, n, keep=True)`` returns.

Never imports IPython.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nbgpu.errors import UserInputError
from nbgpu.launch.config import CellRequest, pickle_pushed
from nbgpu.launch.execute import Output, execute_cell
from nbgpu.launch.registry import RUNS
from nbgpu.launch.run import Run
from nbgpu.launch.warm import CellResult

__all__ = ["CELL_OPTIONS", "WarmJob", "prepare_cell", "start_only", "warm_run"]

#: What may differ from one cell of a warm job to the next (keyword -> its flag).
CELL_OPTIONS = {
    "push": "--push",
    "pull": "--pull",
    "pull_all_ranks": "--all-ranks",
    "script_args": "-- ARGS",
    "timeout_s": "--timeout",
    "quiet": "--quiet",
}


def start_only(flag: str, name: str) -> UserInputError:
    """The one-line refusal of a flag that only applies when a job starts."""
    return UserInputError(
        f"{flag} with --on {name}: {flag} only applies when a job starts, and '{name}' is "
        f"already running; with --on a cell accepts only "
        f"{', '.join(sorted(set(CELL_OPTIONS.values())))} (or start a new job)"
    )


def warm_run(name: str, flag: str = "--on") -> Run:
    """The warm job called *name*, ready for a cell; a one-line error otherwise."""
    run = RUNS.get(name)
    if run is None or run.warm is None:
        warm = [n for n, r in RUNS.items() if r.warm is not None and not r.done]
        known = ", ".join(warm) or "none (start one with %%torchrun N --keep --name NAME)"
        what = "no warm job" if run is None else "a cold run, not a warm job"
        raise UserInputError(f"{flag} {name}: {what} named {name!r} (warm jobs: {known})")
    run.warm.check_usable(flag)
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
            self.run.stop("stopped")
            self.run.end_warm()
        return self.run

    def __repr__(self) -> str:
        warm = self.run.warm
        detail = warm.describe() if warm is not None and self.state == "warm" else self.state
        return f"<WarmJob {self.name!r}: {self.run.config.nproc} ranks, {detail}>"
