"""``%gpu_runs NAME``: the names a warm job's ranks hold after their last cell, as one
table (name, type, size, the ranks that hold it: ranks mostly agree, so equal rows are
one row), never their values. The ranks report them with every cell's answer
(``nbgpu.rank.held``).
"""

from dataclasses import dataclass
from typing import Any

from nbgpu._render import Block, Line, Result, Table, Title, fmt_bytes
from nbgpu.errors import UserInputError
from nbgpu.launch.config import ranks_text
from nbgpu.launch.run import RUNS

__all__ = ["HeldNames", "held_names", "size_text"]


def size_text(entry: dict[str, Any]) -> str:
    """``4x3 float32, 48 B`` for a tensor or array, ``6 params, 24 B`` for a model, ``len 3``
    for a container, else bytes."""
    if "shape" in entry:
        shape = "x".join(map(str, entry["shape"])) or "scalar"
        return f"{shape} {entry.get('dtype', '')}, {fmt_bytes(int(entry.get('bytes', 0)))}"
    if "params" in entry:
        return f"{entry['params']:,} params, {fmt_bytes(int(entry.get('bytes', 0)))}"
    if "len" in entry:
        return f"len {entry['len']}"
    return fmt_bytes(int(entry["bytes"])) if "bytes" in entry else "-"


@dataclass(frozen=True)
class HeldNames(Result):
    """What each rank of a warm job holds (``held``: rank -> its last report)."""

    run_name: str
    world_size: int  # every rank of the job, on every node ("all" in the ranks column)
    cells: int
    held: dict[int, dict[str, Any]]
    ended: str | None = None  # the job's final state: these were the last names it held

    def rows(self) -> list[tuple[str, str, str, tuple[int, ...]]]:
        """(name, type, size, ranks) with ranks that agree on a name in one row."""
        by_row: dict[tuple[str, str, str], list[int]] = {}
        for rank, report in sorted(self.held.items()):
            for entry in report.get("names", []):
                key = (str(entry["name"]), str(entry["type"]), size_text(entry))
                by_row.setdefault(key, []).append(rank)
        return sorted((*key, tuple(ranks)) for key, ranks in by_row.items())

    def content(self) -> list[Block]:
        if self.ended is None:
            head: list[Block] = [Title(f"Names held by '{self.run_name}' after cell {self.cells}")]
        else:
            head = [
                Title(f"Names '{self.run_name}' held after cell {self.cells}, its last"),
                Line(f"the job has ended ({self.ended}): its ranks and their names are gone"),
            ]
        return [*head, *self._listing()]

    def _listing(self) -> list[Block]:
        rows = self.rows()
        if not rows:
            return [Line("the ranks hold no names yet", wrap=False)]
        table = Table(["name", "type", "size", "ranks"])
        everyone = tuple(range(self.world_size))
        for name, kind, size, ranks in rows:
            table.add(name, kind, size, "all" if ranks == everyone else ranks_text(ranks))
        notes = [
            Line(f"rank {rank} holds {report['total']} names: the first {len(report['names'])}")
            for rank, report in sorted(self.held.items())
            if report.get("total", 0) > len(report.get("names", []))
        ]
        return [table, *notes]

    def records(self) -> list[dict[str, Any]]:
        return [
            {"name": name, "type": kind, "size": size, "ranks": list(ranks)}
            for name, kind, size, ranks in self.rows()
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run_name,
            "cells": self.cells,
            "ended": self.ended,
            "names": self.records(),
        }


def held_names(name: str) -> HeldNames:
    """The names warm job *name* holds; one line when there is no such warm job."""
    run = RUNS.get(name)
    if run is None or run.warm is None:
        warm = ", ".join(n for n, r in RUNS.items() if r.warm is not None) or "none"
        what = "a cold run: its ranks are gone" if run is not None else "no warm job by that name"
        raise UserInputError(f"%gpu_runs {name}: {what} (warm jobs: {warm}; %gpu_runs lists all)")
    run.warm.catch_up()
    ended = run.state if run.done else None
    return HeldNames(name, run.config.world_size, run.warm.cells, dict(run.warm.held), ended)
