"""Sweeps: one box split into disjoint GPU sets with distinct ports, one plan per run.

Sweep runs started by hand tend to share GPUs and one MASTER_PORT (12345). Here every run
gets its own usable GPUs (identical and clean ones first) and free port: a complete
:class:`~nbgpu.plan.result.Plan` for a background ``%%torchrun --plan sweep.runs[i]``.

A run on GPUs other jobs use now would share their compute and memory (a 97 %-busy GPU gives
it a fraction of its speed, and its free memory, not its total): it is not ready unless
``share=True``; the sweep says how many runs fit on free GPUs now, and ``runs=None`` leaves
GPUs in use out. Pure: the port check is injected; never reads files or an inventory.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from nbgpu._render import Block, Line, Result, Table
from nbgpu._serial import to_data
from nbgpu.errors import UserInputError
from nbgpu.plan.allocation import Allocation, RoleSpec
from nbgpu.plan.job import Job, whole_number
from nbgpu.plan.placement import Candidate, PortChecker, assign, excluded_gpus, order_pool
from nbgpu.plan.planner import NO_GPU, build_plan, check_known, gpu_span
from nbgpu.plan.result import PLAN_FILE_FORMAT, ExcludedGpu, Plan, plan_title, problem_blocks
from nbgpu.problems import Problem

__all__ = ["SweepPlan", "build_sweep"]

IN_USE = "gpus_in_use"


@dataclass(frozen=True)
class SweepPlan(Result):
    """Disjoint runs on one box: ``runs[i]`` is a Plan with its own GPUs and port."""

    runs: tuple[Plan, ...]
    gpus_per_run: int
    allocation: str  # of each run
    excluded: tuple[ExcludedGpu, ...]
    problems: tuple[Problem, ...]
    warnings: tuple[Problem, ...]
    fleet: str
    simulated: bool
    share: bool = False  # runs may be placed on GPUs other jobs are using

    @property
    def ok(self) -> bool:
        return not self.problems and bool(self.runs) and all(r.ok for r in self.runs)

    @property
    def runs_ready(self) -> int:
        return sum(1 for r in self.runs if r.ok)

    def _table(self) -> Table:
        table = Table(["run", "GPUs (CUDA_VISIBLE_DEVICES)", "nproc", "port", "ready"])
        for run in self.runs:
            gpus = " | ".join(r.cuda_visible_devices for r in run.roles)
            nproc = "+".join(str(r.nproc_per_node) for r in run.roles)
            ports = ",".join(str(r.master_port) for r in run.roles)
            only_in_use = {p.code for p in run.problems} == {IN_USE}
            ready = "yes" if run.ok else ("NO: GPUs in use" if only_in_use else "NO")
            table.add(run.name, gpus, nproc, ports, ready, level="" if run.ok else "bad")
        return table

    def _problems(self) -> tuple[tuple[Problem, ...], tuple[Problem, ...]]:
        # Every run carries the same batch verdict: say it once.
        problems, warnings = list(self.problems), list(self.warnings)
        for run in self.runs:
            # The sweep says once which runs share GPUs in use; each run's copy is for launch.
            problems.extend(p for p in run.problems if p not in problems and p.code != IN_USE)
            in_use = any(p.code == IN_USE for p in run.problems)
            warnings.extend(
                w
                for w in run.warnings
                if w not in warnings and not (in_use and "is shared with" in w.message)
            )
        return tuple(problems), tuple(warnings)

    def content(self) -> list[Block]:
        what = f"{len(self.runs)} runs × {self.gpus_per_run} GPUs ({self.allocation})"
        title = plan_title("plan sweep", what, self.fleet, simulated=self.simulated, ok=self.ok)
        blocks: list[Block] = [title, self._table()]
        if self.excluded:
            left = "; ".join(f"GPU {e.nvml_index} ({e.health})" for e in self.excluded)
            blocks.append(Line(left, label="left out"))
        if self.runs:
            blocks.append(Line("each run is a Plan: sweep.runs[i] (env, ports and GPUs per role)"))
        return blocks + problem_blocks(*self._problems())

    def records(self) -> list[dict[str, Any]]:
        return [row for run in self.runs for row in run.records()]

    def simulated_fleet(self) -> str | None:
        return self.fleet if self.simulated else None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = to_data(self)
        data["runs"] = [run.to_dict() for run in self.runs]
        return {"nbgpu_sweep": PLAN_FILE_FORMAT, "ok": self.ok, **data}


def _in_use_text(cands: Sequence[Candidate]) -> str:
    """``GPUs 0-3: 1 process each, 97% busy``: GPUs alike are said together."""
    groups: dict[tuple[int, int | None], list[int]] = {}
    for c in cands:
        groups.setdefault((c.other_processes, c.utilization_pct), []).append(c.nvml_index)
    parts = []
    for (count, busy), indices in groups.items():
        each = " each" if len(indices) > 1 else ""
        what = f"{count} process{'es' if count > 1 else ''}{each}"
        what += f", {busy}% busy" if busy is not None else ""
        parts.append(f"GPU{'s' if len(indices) > 1 else ''} {gpu_span(indices)}: {what}")
    return "; ".join(parts)


def _mark_in_use(
    plans: list[Plan], by_index: dict[int, Candidate], requested: int | None
) -> list[Problem]:
    """Runs on GPUs other jobs use are not ready; one sweep-level problem says how many fit."""
    shared: list[tuple[int, list[Candidate]]] = []
    for n, plan in enumerate(plans):
        busy = [by_index[i] for r in plan.roles for i in r.nvml_indices if by_index[i].in_use]
        if busy:
            shared.append((n, busy))
            message = (
                f"{plan.name}: its GPUs run other jobs ({_in_use_text(busy)}); the run would "
                "share their compute and memory"
            )
            problem = Problem("bad", IN_USE, plan.name or f"run{n}", message, ("share=True",))
            plans[n] = replace(plan, problems=(*plan.problems, problem))
    if not shared:
        return []
    names = ", ".join(plans[n].name or f"run{n}" for n, _ in shared)
    busy_all = {c.nvml_index: c for _, cs in shared for c in cs}
    fit_now = sum(1 for p in plans if p.ok)
    fixes = (f"runs={fit_now}",) if fit_now else ()
    message = (
        f"{fit_now} of {requested or len(plans)} runs fit on free GPUs now; {names} would share "
        f"GPUs with other jobs ({_in_use_text([busy_all[i] for i in sorted(busy_all)])}), their "
        "compute and memory: wait for those jobs, or share"
    )
    return [Problem("bad", IN_USE, "sweep", message, (*fixes, "share=True"))]


def build_sweep(
    candidates: Sequence[Candidate],
    fleet: str,
    simulated: bool,
    job: Job,
    *,
    runs: int | None,
    gpus_per_run: int | None,
    pool: Sequence[int] = (),
    is_free: PortChecker,
    share: bool = False,
) -> SweepPlan:
    """Split the usable GPUs (of *pool*, if given) into disjoint runs of *job*."""
    whole_number("runs", runs)
    whole_number("gpus_per_run", gpus_per_run)
    if not candidates:
        raise UserInputError(NO_GPU.format(why="", example="8xH100"))
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
    check_known(by_index, (("gpus", pool), ("exclude", job.exclude)), hint=False)
    wanted = runs or 1
    if wanted * per_run > len(candidates):
        raise UserInputError(
            f"{wanted} runs × {per_run} GPUs need {wanted * per_run} GPUs but this box has "
            f"{len(candidates)} (GPUs {gpu_span(list(by_index))}); use "
            f"runs={max(1, len(candidates) // per_run)} or fewer GPUs per run"
        )
    scope = [c for c in candidates if (not pool or c.nvml_index in pool)]
    excluded = excluded_gpus(scope, job.exclude)
    ordered = order_pool([c for c in scope if c.nvml_index not in job.exclude])
    warnings: list[Problem] = []
    in_use = [c for c in ordered if c.in_use] if runs is None and not share else []
    if in_use:
        ordered = [c for c in ordered if not c.in_use]
        message = (
            f"left out, in use by other jobs: {_in_use_text(in_use)}; runs there would share "
            "their compute and memory"
        )
        warnings.append(Problem("warn", IN_USE, "sweep", message, ("share=True",)))
    fit = len(ordered) // per_run
    count = fit if runs is None else min(runs, fit)
    problems = []
    if count < wanted:
        left_out = "; ".join(f"GPU {e.nvml_index}: {e.health}" for e in excluded)
        fixes = [f"runs={fit}"] if fit else []
        if job.allocation is None and runs and len(ordered) // runs >= 1:
            fixes.append(f"gpus_per_run={len(ordered) // runs}")
        message = (
            f"{wanted} runs × {per_run} GPUs need {wanted * per_run} usable GPUs; "
            f"{len(ordered)} usable" + (f" ({left_out})" if left_out else "")
        )
        problems.append(Problem("bad", "not_enough_gpus", "sweep", message, tuple(fixes)))
    plans: list[Plan] = []
    taken: list[int] = []
    run_job = replace(job, allocation=allocation, num_gpus=None, require=(), exclude=())
    for n, group in enumerate(assign(ordered, [per_run] * count) or []):
        named = replace(run_job, name=f"run{n}")
        plan = build_plan(
            group, fleet, simulated, named, is_free=is_free, taken_ports=taken, alternatives=False
        )
        taken.extend(r.master_port for r in plan.roles if r.master_port is not None)
        plans.append(plan)
    if not share:
        problems.extend(_mark_in_use(plans, {c.nvml_index: c for c in ordered}, runs))
    return SweepPlan(
        tuple(plans),
        per_run,
        allocation.text,
        excluded,
        tuple(problems),
        tuple(warnings),
        fleet,
        simulated,
        share,
    )
