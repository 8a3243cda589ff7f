"""A warm job's cell, read like a finished run, so the saved record can show it.

The record a widget panel leaves in the notebook (``run_record.record_bundle``) reads a
run: its headline, a badge per rank, a summary. A warm cell ends while its job goes
on, so the record is of the *cell*: which cell, how it ended on each rank, how long it
took, and that the ranks are kept. :class:`CellView` answers those questions from the
cell's result and the job's configuration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from nbgpu._render import Block, Line

if TYPE_CHECKING:
    from nbgpu.launch.run import Run
    from nbgpu.launch.warm import CellResult

__all__ = ["CellView"]


@dataclass(frozen=True)
class _CellRank:
    rank: int
    status: str  # ok | error | interrupted | no answer


class CellView:
    """What the record functions read of a run, answered for one warm cell."""

    def __init__(self, run: Run, result: CellResult) -> None:
        self._run = run
        self.result = result
        self.name = run.name
        self.config = run.config
        self.dir = run.dir
        self.done = True
        self.root_cause = None
        if result.ok:
            self.state, self.stop_reason = "succeeded", None
        elif result.interrupted:
            self.state, self.stop_reason = "interrupted", "interrupted"
        else:
            self.state, self.stop_reason = "failed", None
        self.ranks = tuple(_CellRank(r, s) for r, s in sorted(result.statuses.items()))

    def _rank_state(self, r: _CellRank) -> str:
        return r.status

    def rank_gpu(self, rank: int) -> str | None:
        return self._run.rank_gpu(rank)

    def _headline(self) -> str:
        words = {"succeeded": "ok", "failed": "failed", "interrupted": "interrupted"}
        parts = [
            f"run '{self.name}'",
            f"cell {self.result.number}",
            words[self.state],
            f"{self.config.nproc} ranks",
        ]
        if self.config.cuda_visible_devices:
            parts.append(self._run.gpu_assignment())
        parts.append(f"{self.result.duration_s:.2f} s")
        return " · ".join(parts)

    def _kept(self) -> str:
        return (
            f"the ranks and their state are kept: %%torchrun --on {self.name} runs the next "
            f"cell, %gpu_stop {self.name} ends the job"
        )

    def summary_blocks(self) -> list[Block]:
        """What the record shows below its headline: how the cell ended, what is kept."""
        return [*self.result.content(), Line(self._kept(), wrap=False)]
