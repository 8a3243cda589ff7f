"""Sweeps: one box split into disjoint GPU sets with distinct ports, one plan per run.

Seed 002's concurrent sweep runs shared GPUs and all used MASTER_PORT 12345. A
:class:`SweepPlan` gives every run its own GPUs (never shared, never unusable) and its own
free port, each run a complete :class:`~nbgpu.plan.result.Plan` that a background
``%%torchrun --plan sweep.runs[i]`` can launch. Runs are filled with identical GPUs where
the box allows it, and clean GPUs before ones with caveats.

Pure: builds on ``assign`` and ``planner``; the port check is injected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from html import escape
from typing import Any

from nbgpu._render import Result, Table
from nbgpu.errors import UserInputError
from nbgpu.plan.allocation import Allocation, RoleSpec
from nbgpu.plan.assign import assign, order_pool
from nbgpu.plan.candidates import Candidate
from nbgpu.plan.job import Job
from nbgpu.plan.planner import build_plan, gpu_span
from nbgpu.plan.ports import PortChecker
from nbgpu.plan.result import (
    ExcludedGpu,
    Issue,
    Plan,
    fit_title,
    notes_html,
    notes_text,
    plan_from_dict,
)
from nbgpu.plan.serial import from_data, to_data

__all__ = ["SWEEP_FORMAT", "SweepPlan", "build_sweep", "sweep_from_dict"]

SWEEP_FORMAT = 1


@dataclass(frozen=True)
class SweepPlan(Result):
    """Disjoint runs on one box: ``runs[i]`` is a Plan with its own GPUs and port."""

    runs: tuple[Plan, ...]
    requested_runs: int | None  # None: as many as fit
    gpus_per_run: int
    allocation: str  # of each run
    excluded: tuple[ExcludedGpu, ...]
    problems: tuple[Issue, ...]
    warnings: tuple[Issue, ...]
    fleet: str
    simulated: bool

    @property
    def ok(self) -> bool:
        return not self.problems and bool(self.runs) and all(r.ok for r in self.runs)

    def _title(self) -> str:
        source = f"SIMULATED fleet '{self.fleet}'" if self.simulated else f"host {self.fleet}"
        verdict = "ready" if self.ok else "NOT READY"
        return (
            f"nbgpu plan sweep — {len(self.runs)} runs × {self.gpus_per_run} GPUs "
            f"({self.allocation}) on {source} · {verdict}"
        )

    def _table(self) -> Table:
        table = Table(["run", "GPUs (CUDA_VISIBLE_DEVICES)", "nproc", "port", "ready"])
        for run in self.runs:
            table.add(
                run.name,
                " | ".join(r.cuda_visible_devices for r in run.roles),
                "+".join(str(r.nproc_per_node) for r in run.roles),
                ",".join(str(r.master_port) for r in run.roles),
                "yes" if run.ok else "NO",
                level="" if run.ok else "bad",
            )
        return table

    def _issues(self) -> tuple[tuple[Issue, ...], tuple[Issue, ...]]:
        # Every run carries the same batch verdict: say it once.
        problems = list(self.problems)
        warnings = list(self.warnings)
        for run in self.runs:
            problems.extend(p for p in run.problems if p not in problems)
            warnings.extend(w for w in run.warnings if w not in warnings)
        return tuple(problems), tuple(warnings)

    def text(self) -> str:
        lines = [fit_title(self._title()), self._table().text()]
        if self.excluded:
            lines.append(
                "left out: " + "; ".join(f"GPU {e.nvml_index} ({e.verdict})" for e in self.excluded)
            )
        if self.runs:
            lines.append("each run is a Plan: sweep.runs[i] (env, ports and GPUs per role)")
        notes = notes_text(*self._issues())
        if notes:
            lines.append("")
            lines.extend(notes)
        return "\n".join(lines)

    def html_body(self) -> str:
        title = escape(self._title())
        if self.simulated:
            title = title.replace("SIMULATED", '<span class="nbgpu-sim">SIMULATED</span>')
        parts = [f"<b>{title}</b>", self._table().html()]
        if self.excluded:
            left = "; ".join(f"GPU {e.nvml_index} ({e.verdict})" for e in self.excluded)
            parts.append(f"<div>left out: {escape(left)}</div>")
        parts.append(notes_html(*self._issues()))
        return "".join(parts)

    def records(self) -> list[dict[str, Any]]:
        return [row for run in self.runs for row in run.records()]

    def simulated_fleet(self) -> str | None:
        return self.fleet if self.simulated else None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = to_data(self)
        data["runs"] = [run.to_dict() for run in self.runs]
        return {"nbgpu_sweep": SWEEP_FORMAT, "ok": self.ok, **data}


def sweep_from_dict(data: Any) -> SweepPlan:
    """Rebuild a :class:`SweepPlan` from ``SweepPlan.to_dict()``."""
    if not isinstance(data, dict) or data.get("nbgpu_sweep") != SWEEP_FORMAT:
        raise UserInputError(f"sweep JSON: expected an object with nbgpu_sweep = {SWEEP_FORMAT}")
    runs = data.get("runs")
    if not isinstance(runs, list):
        raise UserInputError("sweep JSON: top level has no list 'runs'")
    rest = {k: v for k, v in data.items() if k != "runs"}
    skeleton = from_data(SweepPlan, {**rest, "runs": []}, prefix="sweep JSON")
    return replace(skeleton, runs=tuple(plan_from_dict(r) for r in runs))


def build_sweep(
    candidates: Sequence[Candidate],
    job: Job,
    *,
    runs: int | None,
    gpus_per_run: int | None,
    pool: Sequence[int] = (),
    fleet: str,
    simulated: bool,
    is_free: PortChecker,
) -> SweepPlan:
    """Split the usable GPUs (of *pool*, if given) into disjoint runs of *job*."""
    if runs is not None and (isinstance(runs, bool) or not isinstance(runs, int) or runs < 1):
        raise UserInputError(f"runs={runs!r}: expected a whole number >= 1")
    if gpus_per_run is not None and (
        isinstance(gpus_per_run, bool) or not isinstance(gpus_per_run, int) or gpus_per_run < 1
    ):
        raise UserInputError(f"gpus_per_run={gpus_per_run!r}: expected a whole number >= 1")
    if not candidates:
        raise UserInputError(
            "the inventory has no GPU to plan on; plan for another box with a fleet: "
            "inventory='pod.json' (from `nbgpu status --json`) or a spec such as '8xH100'"
        )
    allocation = job.allocation
    if allocation is None:
        allocation = Allocation((RoleSpec("train", "train", None, gpus_per_run or 1),))
    elif gpus_per_run is not None and gpus_per_run != allocation.gpu_count:
        raise UserInputError(
            f"allocation {allocation.text!r} uses {allocation.gpu_count} GPUs per run but "
            f"gpus_per_run={gpus_per_run}; the degrees must multiply to the GPU count"
        )
    per_run = allocation.gpu_count
    by_index = {c.nvml_index: c for c in candidates}
    span = gpu_span(list(by_index))
    for label, values in (("gpus", pool), ("exclude", job.exclude)):
        for i in values:
            if i not in by_index:
                raise UserInputError(f"{label}: GPU {i} does not exist; this box has GPUs {span}")
    wanted = runs or 1
    if wanted * per_run > len(candidates):
        raise UserInputError(
            f"{wanted} runs × {per_run} GPUs need {wanted * per_run} GPUs but this box has "
            f"{len(candidates)} (GPUs {span}); use runs={max(1, len(candidates) // per_run)} "
            f"or fewer GPUs per run"
        )
    scope = [c for c in candidates if (not pool or c.nvml_index in pool)]
    considered = [c for c in scope if c.nvml_index not in job.exclude]
    excluded = tuple(
        ExcludedGpu(c.nvml_index, c.uuid, "excluded", ("excluded by request",))
        if c.nvml_index in job.exclude
        else ExcludedGpu(c.nvml_index, c.uuid, c.verdict, c.reasons, c.fixes, c.recoverable)
        for c in scope
        if c.nvml_index in job.exclude or not c.usable
    )
    ordered = order_pool(considered)
    fit = len(ordered) // per_run
    count = fit if runs is None else min(runs, fit)
    problems = []
    if count < (runs or 1):
        left_out = "; ".join(f"GPU {e.nvml_index}: {e.verdict}" for e in excluded)
        fixes = [f"runs={fit}"] if fit else []
        if job.allocation is None and runs and len(ordered) // runs >= 1:
            fixes.append(f"gpus_per_run={len(ordered) // runs}")
        problems.append(
            Issue(
                "not_enough_gpus",
                f"{runs or 1} runs × {per_run} GPUs need {(runs or 1) * per_run} usable GPUs; "
                f"{len(ordered)} usable" + (f" ({left_out})" if left_out else ""),
                tuple(fixes),
            )
        )
    groups = assign(ordered, [per_run] * count) or []
    plans: list[Plan] = []
    taken: list[int] = []
    for n, group in enumerate(groups):
        run_job = replace(
            job, allocation=allocation, num_gpus=None, require=(), exclude=(), name=f"run{n}"
        )
        plan = build_plan(
            group,
            run_job,
            fleet=fleet,
            simulated=simulated,
            is_free=is_free,
            taken_ports=taken,
            alternatives=False,
        )
        taken.extend(r.master_port for r in plan.roles if r.master_port is not None)
        plans.append(plan)
    return SweepPlan(
        runs=tuple(plans),
        requested_runs=runs,
        gpus_per_run=per_run,
        allocation=allocation.text,
        excluded=excluded,
        problems=tuple(problems),
        warnings=(),
        fleet=fleet,
        simulated=simulated,
    )
