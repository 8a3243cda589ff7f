"""The planner: from usable GPUs and a job to a :class:`~nbgpu.plan.result.Plan`.

An unusable GPU is never given a role: it is listed in ``excluded`` with its reason, and when
the job cannot be placed without it the plan offers the same tensor/pipeline shape on fewer
data-parallel replicas (biggest training role first, inference last) with a batch they can
run, or the steps that free the GPU. Pure: the only outside call is the injected ``is_free``
port check; never imports the inventory module, sockets, files, psutil or IPython.
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from functools import partial

from nbgpu._render import fmt_bytes
from nbgpu.errors import UserInputError
from nbgpu.plan.allocation import Allocation, RoleSpec
from nbgpu.plan.job import BatchCheck, Job, check_job_batch, nearest_batch
from nbgpu.plan.memcheck import auto_max_micro, colocation_problems, memory_check, memory_problems
from nbgpu.plan.placement import (
    Candidate,
    PortChecker,
    assign,
    excluded_gpus,
    order_pool,
    pick_ports,
    planned_gpus,
    shared_groups,
)
from nbgpu.plan.result import Alternative, ExcludedGpu, MemoryCheck, Plan, RolePlan
from nbgpu.problems import Problem

__all__ = ["NO_GPU", "batch_problem", "build_plan", "caveats", "check_known", "gpu_span",
           "trainer_batch"]  # fmt: skip

#: No GPU to plan on (*why*: NVML's reason, or ""; *example*: a fleet spec to plan for instead).
NO_GPU = (
    "the inventory has no GPU to plan on{why}; plan for another box with a fleet: "
    "inventory='pod.json' (from `nbgpu status --json`) or a spec such as '{example}'"
)


def gpu_span(indices: Sequence[int]) -> str:
    """``[0, 1, 2, 3]`` → ``"0-3"``; other lists comma-joined."""
    ordered = sorted(indices)
    if ordered and ordered == list(range(ordered[0], ordered[-1] + 1)) and len(ordered) > 2:
        return f"{ordered[0]}-{ordered[-1]}"
    return ",".join(map(str, ordered))


def check_known(
    by_index: dict[int, Candidate], lists: Iterable[tuple[str, Sequence[int]]], *, hint: bool
) -> None:
    """Every GPU the user named exists on this box (*hint*: say how to write one that does)."""
    for label, values in lists:
        for i in values:
            if i not in by_index:
                example = f" (write e.g. {label}={min(by_index)})" if hint else ""
                raise UserInputError(
                    f"{label}: GPU {i} does not exist; this box has GPUs "
                    f"{gpu_span(list(by_index))}{example}"
                )


def caveats(subject: str, given: Iterable[Candidate]) -> list[Problem]:
    return [
        Problem("warn", "gpu_caveat", subject, f"{subject}: {p.message}")
        for c in given
        if c.grade > 0
        for p in c.problems
    ]


def batch_problem(check: BatchCheck, subject: str) -> Problem:
    fixes = tuple(f"global_batch={o.text}" for o in check.nearest)
    return Problem("bad", "batch", subject, f"{subject}: {check.reason}", fixes)


def trainer_batch(allocation: Allocation, job: Job, warnings: list[Problem]) -> BatchCheck | None:
    """The batch checked for the first training role (what the others do is said)."""
    trainers = allocation.train_roles
    if all(v is None for v in (job.global_batch, job.micro_batch, job.grad_accum)):
        return None
    if not trainers:
        message = "no training role: the batch was not checked"
        warnings.append(Problem("warn", "batch_unchecked", "batch", message))
        return None
    if len(trainers) > 1:
        message = (
            f"the batch was checked for role {trainers[0].name} only "
            f"({len(trainers)} training roles)"
        )
        warnings.append(Problem("warn", "batch_first_trainer", "batch", message))
    return check_job_batch(job, trainers[0].data_parallel)


def _mixed_warning(role: RolePlan) -> list[Problem]:
    if len({g.memory_total_bytes for g in role.gpus}) < 2:
        return []
    smallest = min(role.gpus, key=lambda g: g.memory_total_bytes or 0)
    listing = ", ".join(f"GPU {g.nvml_index}: {fmt_bytes(g.memory_total_bytes)}" for g in role.gpus)
    why = "tensor-parallel shards are equal"
    if role.kind == "train":
        why = "data-parallel ranks share one micro batch"
    message = (
        f"role {role.name} mixes GPU sizes ({listing}): {why}, so the smallest "
        f"(GPU {smallest.nvml_index}) decides what fits; the memory check uses it"
    )
    return [Problem("warn", "mixed_gpus", f"role {role.name}", message)]


def _role_checks(
    roles: Sequence[RolePlan],
    by_index: dict[int, Candidate],
    job: Job,
    batch: BatchCheck | None,
    *,
    problems: list[Problem],
    warnings: list[Problem],
) -> list[MemoryCheck]:
    memory: list[MemoryCheck] = []
    for role in (r for r in roles if r.gpus):
        warnings.extend(caveats(f"role {role.name}", (by_index[i] for i in role.nvml_indices)))
        warnings.extend(_mixed_warning(role))
        if job.model is not None:
            memory.append(memory_check(role, job, batch))
            memory_problems(memory[-1], role, job, problems, warnings)
    colocation_problems(roles, memory, problems, warnings)
    return memory


def build_plan(
    candidates: Sequence[Candidate],
    fleet: str,
    simulated: bool,
    job: Job,
    *,
    is_free: PortChecker,
    taken_ports: Iterable[int] = (),
    alternatives: bool = True,
) -> Plan:
    """Place *job* on *candidates* (of *fleet*); bad input (a GPU that does not exist) raises."""
    if not candidates:
        raise UserInputError(NO_GPU.format(why="", example="4xA40"))
    taken_ports = tuple(taken_ports)
    by_index = {c.nvml_index: c for c in candidates}
    check_known(by_index, (("require", job.require), ("exclude", job.exclude)), hint=True)
    considered = [c for c in candidates if c.nvml_index not in job.exclude]
    usable = [c for c in considered if c.usable]
    # Without an allocation: one trainer on the GPUs the job names.
    count = job.num_gpus or len(job.require) or max(1, len(usable))
    allocation = job.allocation or Allocation((RoleSpec("train", "train", None, count),))
    if allocation.gpu_count > len(candidates):
        raise UserInputError(
            f"{'allocation ' + repr(allocation.text) if job.allocation else 'the job'} needs "
            f"{allocation.gpu_count} GPUs but this box has {len(candidates)} (GPUs "
            f"{gpu_span(list(by_index))}); use at most {len(candidates)}"
        )
    problems: list[Problem] = []
    warnings: list[Problem] = []
    excluded = excluded_gpus(candidates, job.exclude)
    required_bad = [i for i in job.require if not by_index[i].usable]
    for i in required_bad:
        c = by_index[i]
        message = f"GPU {i} is required but unusable ({c.health}): {c.problems[0].message}"
        fixes = tuple(fix for p in c.problems for fix in p.fixes)[:2]
        problems.append(Problem("bad", "required_gpu_unusable", f"GPU {i}", message, fixes))
    require_ok = [i for i in job.require if i not in required_bad]
    pool = order_pool(considered, require_ok)
    counts = [r.gpu_count for r in allocation.roles if r.colocated_with is None]
    groups = shared_groups(allocation, assign(pool, counts, keep_order=bool(require_ok)))
    ports: tuple[int, ...] = ()
    if groups is None:
        left_out = "; ".join(f"GPU {e.nvml_index}: {e.health}" for e in excluded)
        message = (
            f"{allocation.text} needs {allocation.gpu_count} GPUs but only {len(usable)} of "
            f"{len(candidates)} are usable" + (f" ({left_out})" if left_out else "")
        )
        problems.append(Problem("bad", "not_enough_gpus", allocation.text, message))
    else:
        roles_count = len(allocation.roles)
        ports = pick_ports(roles_count, base_port=job.base_port, taken=taken_ports, is_free=is_free)
        if len(ports) < roles_count:
            message = f"found {len(ports)} free ports from {job.base_port} for {roles_count} roles"
            fix = "pass another base_port="
            problems.append(Problem("bad", "no_free_port", "ports", message, (fix,)))
    roles = []
    for n, spec in enumerate(allocation.roles):
        gpus = planned_gpus(groups[n] if groups is not None else [])
        port = ports[n] if gpus and n < len(ports) else None
        roles.append(RolePlan(**vars(spec), gpus=gpus, master_port=port))
    job = auto_max_micro(roles, job, warnings)
    batch = trainer_batch(allocation, job, warnings)
    if batch is not None and not batch.ok:
        problems.append(batch_problem(batch, f"role {allocation.train_roles[0].name}"))
    memory = _role_checks(roles, by_index, job, batch, problems=problems, warnings=warnings)
    alts: tuple[Alternative, ...] = ()
    if alternatives and (groups is None or required_bad):
        same_gpus = partial(build_plan, candidates, fleet, simulated, is_free=is_free)
        alts = _alternatives(
            job,
            allocation=allocation,
            usable=len(usable),
            excluded=excluded,
            required_bad=required_bad,
            sub_plan=partial(same_gpus, taken_ports=taken_ports, alternatives=False),
        )
    return Plan(
        allocation.text,
        tuple(roles),
        tuple(problems),
        tuple(warnings),
        excluded,
        batch,
        tuple(memory),
        alts,
        fleet,
        simulated,
        job.name,
    )


def _smaller_allocation(allocation: Allocation, usable: int) -> Allocation | None:
    if allocation.colocated:
        return None  # colocated roles shrink together; the user picks the new shape
    alloc = allocation
    for spec in sorted(allocation.roles, key=lambda r: (r.kind != "train", -r.gpu_count)):
        current = next(r for r in alloc.roles if r.name == spec.name)
        room = usable - (alloc.gpu_count - current.gpu_count)
        degree = min(current.data_parallel, room // current.instance_gpus)
        if degree >= 1:
            alloc = alloc.with_data_parallel(spec.name, degree)
        if alloc.gpu_count <= usable:
            return alloc
    return None


def _alternatives(
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
    smaller = _smaller_allocation(allocation, usable) if allocation.gpu_count > usable else None
    if smaller is not None:
        trainers = smaller.train_roles
        alt_job, note = nearest_batch(
            replace(job, allocation=smaller, num_gpus=None, require=keep_require),
            trainers[0].data_parallel if trainers else None,
        )
        alt = sub_plan(alt_job)
        gpus = " | ".join(r.cuda_visible_devices for r in alt.roles if r.gpus)
        reason = f"fits the {usable} usable GPUs with the same per-role shape"
        out.append(Alternative(f"{smaller.text} on GPUs {gpus}{note}", reason, plan=alt))
    elif required_bad and allocation.gpu_count <= usable:
        alt = sub_plan(replace(job, require=keep_require))
        title = f"leave GPU {','.join(map(str, required_bad))} out of require"
        out.append(Alternative(title, "the other usable GPUs can take its place", plan=alt))
    recoverable = [e for e in excluded if e.recoverable]
    if recoverable:
        fixes = dict.fromkeys(f for e in recoverable for f in e.fixes[:2])
        ids = ",".join(str(e.nvml_index) for e in recoverable)
        reason = "; ".join(f"GPU {e.nvml_index}: {e.health}" for e in recoverable)
        out.append(Alternative(f"free GPU {ids} first, then plan again", reason, tuple(fixes)))
    return tuple(out)
