"""The planner: from usable GPUs and a job to a :class:`~nbgpu.plan.result.Plan`.

It composes the one-idea modules: ``candidates`` (which GPUs may be used), ``assign``
(which ones each role gets), ``ports`` (distinct free ports), ``batch`` (divisibility and
splits) and ``estimate`` (every memory term per GPU, and the largest micro batch that
fits the smallest GPU of a role), and turns their findings into problems,
warnings and alternatives. An unusable GPU is never given a role: it is listed in
``excluded`` with its reason, and when the job cannot be placed without it the plan offers
a smaller allocation (with a valid batch) and the steps that free the GPU: the same shape
on fewer data-parallel replicas (biggest training role first, inference last), the
nearest global batch the new data-parallel size divides, or the recoverable GPUs freed.

Pure: the only outside call is the injected ``is_free`` port check. Never imports the
inventory module, sockets, files, psutil or IPython.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from nbgpu._render import fmt_bytes
from nbgpu.errors import UserInputError
from nbgpu.plan.allocation import Allocation, RoleSpec
from nbgpu.plan.batch import BatchCheck
from nbgpu.plan.job import Job, batch_problem, check_job_batch
from nbgpu.plan.memcheck import auto_max_micro, colocation_problems, memory_check, memory_problems
from nbgpu.plan.placement import (
    Candidate,
    PortChecker,
    assign,
    excluded_gpus,
    order_pool,
    own_gpus,
    pick_ports,
    planned_gpus,
    shared_groups,
)
from nbgpu.plan.result import (
    Alternative,
    ExcludedGpu,
    MemoryCheck,
    Plan,
    RolePlan,
)
from nbgpu.problems import Problem

__all__ = [
    "alternatives_for",
    "build_plan",
    "gpu_span",
    "nearest_batch",
    "resolve_allocation",
    "smaller_allocation",
]


def gpu_span(indices: Sequence[int]) -> str:
    """``[0, 1, 2, 3]`` → ``"0-3"``; other lists comma-joined."""
    ordered = sorted(indices)
    if ordered and ordered == list(range(ordered[0], ordered[-1] + 1)) and len(ordered) > 2:
        return f"{ordered[0]}-{ordered[-1]}"
    return ",".join(map(str, ordered))


def resolve_allocation(job: Job, usable: int) -> Allocation:
    """The job's allocation; without one, a single trainer on the GPUs the job names."""
    if job.allocation is not None:
        return job.allocation
    count = job.num_gpus or len(job.require) or max(1, usable)
    return Allocation((RoleSpec("train", "train", None, count),))


def _role_plans(
    allocation: Allocation, groups: list[list[Candidate]] | None, ports: Sequence[int]
) -> tuple[RolePlan, ...]:
    roles = []
    for n, spec in enumerate(allocation.roles):
        members = groups[n] if groups is not None else []
        gpus = planned_gpus(members)
        roles.append(
            RolePlan(
                name=spec.name,
                kind=spec.kind,
                backend=spec.backend,
                data_parallel=spec.data_parallel,
                tensor_parallel=spec.tensor_parallel,
                pipeline_parallel=spec.pipeline_parallel,
                gpus=gpus,
                master_port=ports[n] if gpus and n < len(ports) else None,
                context_parallel=spec.context_parallel,
                expert_parallel=spec.expert_parallel,
                colocated_with=spec.colocated_with,
            )
        )
    return tuple(roles)


def _batch(allocation: Allocation, job: Job, warnings: list[Problem]) -> BatchCheck | None:
    trainers = allocation.train_roles
    if all(v is None for v in (job.global_batch, job.micro_batch, job.grad_accum)):
        return None
    if not trainers:
        warnings.append(
            Problem(
                "warn", "batch_unchecked", "batch", "no training role: the batch was not checked"
            )
        )
        return None
    if len(trainers) > 1:
        warnings.append(
            Problem(
                "warn",
                "batch_first_trainer",
                "batch",
                f"the batch was checked for role {trainers[0].name} only "
                f"({len(trainers)} training roles)",
            )
        )
    return check_job_batch(job, trainers[0].data_parallel)


def _mixed_warning(role: RolePlan) -> Problem | None:
    sizes = {g.memory_total_bytes for g in role.gpus}
    if len(sizes) < 2:
        return None
    smallest = min(role.gpus, key=lambda g: g.memory_total_bytes or 0)
    listing = ", ".join(f"GPU {g.nvml_index}: {fmt_bytes(g.memory_total_bytes)}" for g in role.gpus)
    why = (
        "data-parallel ranks share one micro batch"
        if role.kind == "train"
        else "tensor-parallel shards are equal"
    )
    return Problem(
        "warn",
        "mixed_gpus",
        f"role {role.name}",
        f"role {role.name} mixes GPU sizes ({listing}): {why}, so the smallest "
        f"(GPU {smallest.nvml_index}) decides what fits; the memory check uses it",
    )


def _role_checks(
    roles: Sequence[RolePlan],
    by_index: dict[int, Candidate],
    job: Job,
    problems: list[Problem],
    warnings: list[Problem],
    *,
    batch: BatchCheck | None = None,
) -> list[MemoryCheck]:
    """Caveats of the GPUs given out, mixed sizes, and memory per role."""
    memory = []
    for role in roles:
        if not role.gpus:
            continue
        for gpu in role.gpus:
            cand = by_index[gpu.nvml_index]
            if cand.grade > 0:
                warnings.extend(
                    Problem(
                        "warn", "gpu_caveat", f"role {role.name}", f"role {role.name}: {p.message}"
                    )
                    for p in cand.problems
                )
        mixed = _mixed_warning(role)
        if mixed is not None:
            warnings.append(mixed)
        if job.model is not None:
            check = memory_check(role, job, batch)
            memory.append(check)
            memory_problems(check, role, job, problems, warnings)
    return memory


def build_plan(
    candidates: Sequence[Candidate],
    job: Job,
    *,
    fleet: str,
    simulated: bool,
    is_free: PortChecker,
    taken_ports: Iterable[int] = (),
    alternatives: bool = True,
) -> Plan:
    """Place *job* on *candidates*; bad input (a GPU that does not exist) raises."""
    if not candidates:
        raise UserInputError(
            "the inventory has no GPU to plan on; plan for another box with a fleet: "
            "inventory='pod.json' (from `nbgpu status --json`) or a spec such as '4xA40'"
        )
    taken_ports = tuple(taken_ports)
    by_index = {c.nvml_index: c for c in candidates}
    span = gpu_span(list(by_index))
    for label, values in (("require", job.require), ("exclude", job.exclude)):
        for i in values:
            if i not in by_index:
                raise UserInputError(
                    f"{label}: GPU {i} does not exist; this box has GPUs {span} "
                    f"(write e.g. {label}={min(by_index)})"
                )
    considered = [c for c in candidates if c.nvml_index not in job.exclude]
    usable = [c for c in considered if c.usable]
    allocation = resolve_allocation(job, len(usable))
    if allocation.gpu_count > len(candidates):
        raise UserInputError(
            f"{'allocation ' + repr(allocation.text) if job.allocation else 'the job'} needs "
            f"{allocation.gpu_count} GPUs but this box has {len(candidates)} (GPUs {span}); "
            f"use at most {len(candidates)}"
        )
    problems: list[Problem] = []
    warnings: list[Problem] = []
    excluded = excluded_gpus(candidates, job.exclude)
    required_bad = [i for i in job.require if not by_index[i].usable]
    for i in required_bad:
        c = by_index[i]
        problems.append(
            Problem(
                "bad",
                "required_gpu_unusable",
                f"GPU {i}",
                f"GPU {i} is required but unusable ({c.health}): {c.problems[0].message}",
                tuple(fix for p in c.problems for fix in p.fixes)[:2],
            )
        )
    require_ok = [i for i in job.require if i not in required_bad]
    pool = order_pool(considered, require_ok)
    groups = shared_groups(
        allocation,
        assign(pool, [r.gpu_count for r in own_gpus(allocation)], keep_order=bool(require_ok)),
    )
    if groups is None:
        left_out = "; ".join(f"GPU {e.nvml_index}: {e.health}" for e in excluded)
        problems.append(
            Problem(
                "bad",
                "not_enough_gpus",
                allocation.text,
                f"{allocation.text} needs {allocation.gpu_count} GPUs but only {len(usable)} of "
                f"{len(candidates)} are usable" + (f" ({left_out})" if left_out else ""),
            )
        )
    ports: tuple[int, ...] = ()
    if groups is not None:
        ports = pick_ports(
            len(allocation.roles), base_port=job.base_port, taken=taken_ports, is_free=is_free
        )
        if len(ports) < len(allocation.roles):
            problems.append(
                Problem(
                    "bad",
                    "no_free_port",
                    "ports",
                    f"found {len(ports)} free ports from {job.base_port} for "
                    f"{len(allocation.roles)} roles",
                    ("pass another base_port=",),
                )
            )
    roles = _role_plans(allocation, groups, ports)
    job = auto_max_micro(roles, job, warnings)
    batch = _batch(allocation, job, warnings)
    if batch is not None and not batch.ok:
        problems.append(batch_problem(batch, f"role {allocation.train_roles[0].name}"))
    memory = _role_checks(roles, by_index, job, problems, warnings, batch=batch)
    colocation_problems(roles, memory, problems, warnings)
    plan = Plan(
        allocation=allocation.text,
        roles=roles,
        problems=tuple(problems),
        warnings=tuple(warnings),
        excluded=excluded,
        batch=batch,
        memory=tuple(memory),
        alternatives=(),
        fleet=fleet,
        simulated=simulated,
        name=job.name,
    )
    if alternatives and (groups is None or required_bad):
        alts = alternatives_for(
            job,
            allocation=allocation,
            usable=len(usable),
            excluded=excluded,
            required_bad=required_bad,
            sub_plan=lambda changed: build_plan(
                candidates, changed, fleet=fleet, simulated=simulated, is_free=is_free,
                taken_ports=taken_ports, alternatives=False,
            ),
        )  # fmt: skip
        plan = replace(plan, alternatives=alts)
    return plan


# ------------------------------------------------------------------ alternatives


def smaller_allocation(allocation: Allocation, usable: int) -> Allocation | None:
    # Shrink the data-parallel degree, biggest training role first, inference last: the
    # job keeps its shape (tensor/pipeline degrees) and only runs on fewer replicas.
    if allocation.colocated:
        return None  # colocated roles shrink together; the user picks the new shape
    order = sorted(allocation.roles, key=lambda r: (r.kind != "train", -r.gpu_count))
    alloc = allocation
    for spec in order:
        current = next(r for r in alloc.roles if r.name == spec.name)
        room = usable - (alloc.gpu_count - current.gpu_count)
        per_replica = current.world_size // current.data_parallel
        degree = min(current.data_parallel, room // per_replica)
        if degree >= 1:
            alloc = alloc.with_data_parallel(spec.name, degree)
        if alloc.gpu_count <= usable:
            return alloc
    return None


def nearest_batch(check: BatchCheck) -> int | None:
    if check.global_batch is None or not check.nearest:
        return None
    wanted = check.global_batch
    return min((abs(o.global_batch - wanted), o.global_batch) for o in check.nearest)[1]


def alternatives_for(
    job: Job,
    *,
    allocation: Allocation,
    usable: int,
    excluded: Sequence[ExcludedGpu],
    required_bad: list[int],
    sub_plan: Callable[[Job], Plan],
) -> tuple[Alternative, ...]:
    """Plans that would work: *sub_plan* plans a changed job (without alternatives of its own)."""
    out = []
    keep_require = tuple(i for i in job.require if i not in required_bad)

    smaller = smaller_allocation(allocation, usable) if allocation.gpu_count > usable else None
    if smaller is not None:
        alt_job = replace(job, allocation=smaller, num_gpus=None, require=keep_require)
        note = ""
        batch = _batch(smaller, alt_job, [])
        if batch is not None and not batch.ok:
            new_batch = nearest_batch(batch)
            if new_batch is not None:
                alt_job = replace(alt_job, global_batch=new_batch)
                note = f", global batch {new_batch} instead of {job.global_batch}"
        alt = sub_plan(alt_job)
        gpus = " | ".join(r.cuda_visible_devices for r in alt.roles if r.gpus)
        out.append(
            Alternative(
                title=f"{smaller.text} on GPUs {gpus}{note}",
                reason=f"fits the {usable} usable GPUs with the same per-role shape",
                plan=alt,
            )
        )
    elif required_bad and allocation.gpu_count <= usable:
        alt = sub_plan(replace(job, require=keep_require))
        out.append(
            Alternative(
                title=f"leave GPU {','.join(map(str, required_bad))} out of require",
                reason="the other usable GPUs can take its place",
                plan=alt,
            )
        )
    recoverable = [e for e in excluded if e.recoverable]
    if recoverable:
        fixes: list[str] = []
        for e in recoverable:
            fixes.extend(f for f in e.fixes[:2] if f not in fixes)
        ids = ",".join(str(e.nvml_index) for e in recoverable)
        out.append(
            Alternative(
                title=f"free GPU {ids} first, then plan again",
                reason="; ".join(f"GPU {e.nvml_index}: {e.health}" for e in recoverable),
                fixes=tuple(fixes),
            )
        )
    return tuple(out)
