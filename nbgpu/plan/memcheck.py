"""Each role's per-GPU memory checked against its smallest GPU, term by term, the largest
micro batch that fits (``max_micro_batch='auto'``), and the problems that follow.

Colocated roles (``sglang:d4|fsdp:d4``: engine and trainer on the same GPUs, alternating
generate and train) hold every role's memory at once unless the engine releases its own while
the trainer steps (SGLang's and vLLM's sleep/offload modes): :func:`colocation_problems` says
so per group and checks the sum. Pure arithmetic; never reads files nor imports torch.
"""

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from nbgpu._render import fmt_bytes
from nbgpu.errors import UserInputError
from nbgpu.estimate.estimator import estimate_memory
from nbgpu.estimate.formulas import STRATEGIES, layout_states
from nbgpu.plan.job import BatchCheck, Job
from nbgpu.plan.result import MemoryCheck, MemoryLine, PlannedGpu, RolePlan
from nbgpu.problems import Problem

__all__ = ["auto_max_micro", "colocation_problems", "free_bytes", "memory_check", "memory_problems",
           "smallest_free"]  # fmt: skip


def _estimate(role: RolePlan, job: Job, micro_batch: int, budget: int | None = None) -> Any:
    assert job.model is not None  # noqa: S101  (callers check)
    train = role.kind == "train"
    same = ("precision", "optimizer", "seq_len", "activation_checkpointing")
    return estimate_memory(
        job.model,
        role="train" if train else "inference",
        strategy=job.strategy if train else "ddp",
        world_size=role.data_parallel * role.tensor_parallel * role.pipeline_parallel,
        micro_batch=micro_batch,
        tensor_parallel=role.tensor_parallel,
        pipeline_parallel=role.pipeline_parallel,
        budget=budget,
        **{k: getattr(job, k) for k in same},
    )


def free_bytes(gpu: PlannedGpu) -> int | None:
    return gpu.memory_free_bytes if gpu.memory_free_bytes is not None else gpu.memory_total_bytes


def smallest_free(gpus: Sequence[PlannedGpu]) -> PlannedGpu | None:
    """The GPU with the least free memory (its total when that is unknown); None: no sizes."""
    known = [g for g in gpus if free_bytes(g) is not None]
    return min(known, key=lambda g: free_bytes(g) or 0) if known else None


def _largest_micro(role: RolePlan, job: Job, budget: int) -> int | None:
    """The largest micro batch within *budget*, computed (memory is affine in it)."""
    try:
        est = _estimate(role, job, 1, budget=budget)
    except UserInputError:
        return 0  # the budget does not even hold the model states and reserves
    return est.max_micro_batch  # type: ignore[no-any-return]


def memory_check(role: RolePlan, job: Job, batch: BatchCheck | None = None) -> MemoryCheck:
    assert job.model is not None  # noqa: S101  (callers check)
    micro = job.micro_batch or 1
    if role.kind == "train" and batch is not None and batch.micro_batch is not None:
        micro = batch.micro_batch
    est = _estimate(role, job, micro)
    lines = tuple(
        MemoryLine(t.name, int(t.bytes_per_gpu), t.formula, t.source)
        for t in est.terms
        if t.bytes_per_gpu is not None
    )
    missing = tuple(f"{t.name} ({t.formula})" for t in est.terms if t.bytes_per_gpu is None)
    what = f"micro batch {micro}" + (f" × seq {job.seq_len}" if job.seq_len else "")
    params = f"Ψ = {job.model.parameters:,}"
    if role.kind == "train":
        states = layout_states(job.model.parameters, est.layout)
        accounting = f"{states.accounting.text}; {states.formula} with {params} parameters; {what}"
    else:
        accounting = f"{job.precision} weights with {params}; {what}"
    smallest = smallest_free(role.gpus)
    available = None if smallest is None else free_bytes(smallest)
    largest = None
    if role.kind == "train" and available is not None and job.seq_len is not None:
        largest = _largest_micro(role, job, available)
    return MemoryCheck(
        role=role.name,
        lines=lines,
        accounting=accounting,
        available_bytes=available,
        deciding_gpu=None if smallest is None else smallest.nvml_index,
        not_estimated=missing,
        gpu_free=tuple((g.nvml_index, free_bytes(g)) for g in role.gpus),
        micro_batch=micro,
        max_micro_batch=largest,
    )


def memory_problems(
    check: MemoryCheck, role: RolePlan, job: Job, problems: list[Problem], warnings: list[Problem]
) -> None:
    need, have = fmt_bytes(check.needed_bytes), fmt_bytes(check.available_bytes)
    subject, gpu = f"role {role.name}", check.deciding_gpu
    if check.fits is False:
        fixes = []
        if role.kind == "train" and job.model is not None:
            names = list(STRATEGIES)
            for strategy in names[names.index(job.strategy) + 1 :]:
                changed = replace(job, strategy=strategy)
                other = _estimate(role, changed, check.micro_batch or 1).total_bytes
                if other <= (check.available_bytes or 0):
                    fixes.append(f"strategy='{strategy}' needs {fmt_bytes(other)} per GPU")
                    break
        if check.max_micro_batch:
            fixes.append(f"micro_batch={check.max_micro_batch} fits (computed, not tried)")
        elif role.kind == "train" and job.seq_len is not None:
            fixes.append("activation_checkpointing=True keeps one layer's activations")
        fixes.append("more GPUs for this role shrink every sharded part")
        what = "training" if role.kind == "train" else "serving"
        message = f"{subject}: {what} needs {need} per GPU but GPU {gpu} has {have} free"
        problems.append(Problem("bad", "memory", subject, message, tuple(fixes)))
    elif check.tight:
        message = (
            f"{subject}: {need} of GPU {gpu}'s {have} free are needed; little room is left for "
            "what the estimate cannot see"
        )
        warnings.append(Problem("warn", "memory_tight", subject, message))


def auto_max_micro(roles: Sequence[RolePlan], job: Job, warnings: list[Problem]) -> Job:
    """``max_micro_batch='auto'``: the largest micro batch the first trainer's GPUs hold."""
    if not job.max_micro_auto or job.model is None:
        return job
    trainer = next((r for r in roles if r.kind == "train" and r.gpus), None)
    smallest = None if trainer is None else smallest_free(trainer.gpus)
    if trainer is None or smallest is None:
        message = "max_micro_batch='auto': no GPU sizes to fit into"
        warnings.append(Problem("warn", "max_micro", "max_micro_batch", message))
        return job
    largest = _largest_micro(trainer, job, free_bytes(smallest) or 0)
    if not largest:
        # The memory check reports what does not fit; the batch check gets no limit.
        return job
    message = (
        f"role {trainer.name}: max_micro_batch={largest} is the largest that fits GPU "
        f"{smallest.nvml_index}'s {fmt_bytes(free_bytes(smallest))} free (computed from the "
        "memory estimate, no trial runs)"
    )
    warnings.append(Problem("warn", "max_micro", f"role {trainer.name}", message))
    return replace(job, max_micro_batch=largest)


def colocation_problems(
    roles: Sequence[RolePlan],
    memory: Sequence[MemoryCheck],
    problems: list[Problem],
    warnings: list[Problem],
) -> None:
    """What sharing GPUs means for memory, per colocated group; a problem if the sum won't fit."""
    checks = {m.role: m for m in memory}
    for anchor in roles:
        group = [anchor, *(r for r in roles if r.colocated_with == anchor.name)]
        if len(group) < 2 or not anchor.gpus:
            continue
        names = " and ".join(r.name for r in group)
        engines = ", ".join(r.name for r in group if r.kind == "inference")
        message = (
            f"{names} share GPUs {anchor.cuda_visible_devices} (colocated): each GPU holds the "
            "memory of every role at once"
        )
        if engines:
            message += (
                f"; {engines}'s memory fraction (SGLang mem_fraction_static, vLLM "
                "gpu_memory_utilization) must leave room for the trainer, or the engine must "
                "release its memory while training steps"
            )
        warnings.append(Problem("warn", "colocated", names, message))
        known = [checks[r.name] for r in group if r.name in checks]
        have = min(
            (c.available_bytes for c in known if c.available_bytes is not None), default=None
        )
        need = sum(c.needed_bytes for c in known)
        if len(known) < len(group) or have is None or need <= have:
            continue
        parts = " + ".join(f"{c.role} {fmt_bytes(c.needed_bytes)}" for c in known)
        message = (
            f"colocated {names} need {parts} = {fmt_bytes(need)} per GPU together, but "
            f"GPU {known[0].deciding_gpu} has {fmt_bytes(have)} free"
        )
        fix = "'+' instead of '|' gives each role GPUs of its own"
        problems.append(Problem("bad", "memory", f"colocated {names}", message, (fix,)))
