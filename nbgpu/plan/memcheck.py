"""Each role's per-GPU memory checked against its smallest GPU, term by term.

The estimate (:mod:`nbgpu.estimate`) at the role's micro batch, what is free on each GPU,
the largest micro batch that fits when asked for ``auto``, and the problems and warnings
that follow. Colocated roles (AReaL's ``|``: ``sglang:d4|fsdp:d4`` starts the engine and
the trainer on the same four GPUs, alternating generate and train) hold every role's
memory at once unless the engine releases its memory while the trainer steps (SGLang's
and vLLM's sleep/offload modes), so the engine's memory fraction (SGLang
``mem_fraction_static``, vLLM ``gpu_memory_utilization``) must leave room for the
trainer: :func:`colocation_problems` says so for every group and checks the sum.

Pure arithmetic; never reads files nor imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from nbgpu._render import fmt_bytes
from nbgpu.errors import UserInputError
from nbgpu.estimate.estimator import estimate_memory
from nbgpu.estimate.formulas import STRATEGIES, model_states
from nbgpu.plan.batch import BatchCheck
from nbgpu.plan.job import Job
from nbgpu.plan.result import (
    MemoryCheck,
    MemoryLine,
    PlannedGpu,
    RolePlan,
)
from nbgpu.problems import Problem

__all__ = [
    "auto_max_micro",
    "colocation_problems",
    "estimate_role",
    "free_bytes",
    "largest_micro",
    "memory_check",
    "memory_problems",
    "micro_batch_of",
]


def estimate_role(role: RolePlan, job: Job, micro_batch: int, budget: int | None = None) -> Any:
    assert job.model is not None  # noqa: S101  (callers check)
    return estimate_memory(
        job.model,
        role="train" if role.kind == "train" else "inference",
        precision=job.precision,
        optimizer=job.optimizer,
        strategy=job.strategy if role.kind == "train" else "ddp",
        world_size=role.data_parallel * role.tensor_parallel * role.pipeline_parallel,
        micro_batch=micro_batch,
        seq_len=job.seq_len,
        tensor_parallel=role.tensor_parallel,
        pipeline_parallel=role.pipeline_parallel,
        activation_checkpointing=job.activation_checkpointing,
        budget=budget,
    )


def micro_batch_of(job: Job, batch: BatchCheck | None) -> int:
    if batch is not None and batch.micro_batch is not None:
        return batch.micro_batch
    return job.micro_batch or 1


def memory_check(role: RolePlan, job: Job, batch: BatchCheck | None = None) -> MemoryCheck:
    assert job.model is not None  # noqa: S101  (callers check)
    micro = micro_batch_of(job, batch) if role.kind == "train" else (job.micro_batch or 1)
    est = estimate_role(role, job, micro)
    lines = tuple(
        MemoryLine(t.name, int(t.bytes_per_gpu or 0), t.formula, t.source)
        for t in est.terms
        if t.bytes_per_gpu is not None
    )
    missing = tuple(f"{t.name} ({t.formula})" for t in est.terms if t.bytes_per_gpu is None)
    what = f"micro batch {micro}" + (f" × seq {job.seq_len}" if job.seq_len else "")
    if role.kind == "train":
        states = model_states(
            job.model.parameters,
            strategy=job.strategy,
            precision=job.precision,
            optimizer=job.optimizer,
            data_parallel=role.data_parallel,
            tensor_parallel=role.tensor_parallel,
            pipeline_parallel=role.pipeline_parallel,
        )
        accounting = (
            f"{states.accounting.text}; {states.formula} with Ψ = {job.model.parameters:,} "
            f"parameters; {what}"
        )
    else:
        accounting = f"{job.precision} weights with Ψ = {job.model.parameters:,}; {what}"
    known = [g for g in role.gpus if free_bytes(g) is not None]
    smallest = min(known, key=lambda g: free_bytes(g) or 0) if known else None
    largest = None
    if role.kind == "train" and smallest is not None and job.seq_len is not None:
        largest = largest_micro(role, job, free_bytes(smallest) or 0)
    return MemoryCheck(
        role=role.name,
        lines=lines,
        accounting=accounting,
        available_bytes=None if smallest is None else free_bytes(smallest),
        deciding_gpu=None if smallest is None else smallest.nvml_index,
        not_estimated=missing,
        gpu_free=tuple((g.nvml_index, free_bytes(g)) for g in role.gpus),
        micro_batch=micro,
        max_micro_batch=largest,
    )


def largest_micro(role: RolePlan, job: Job, budget: int) -> int | None:
    """The largest micro batch within *budget*, computed (memory is affine in it)."""
    try:
        est = estimate_role(role, job, 1, budget=budget)
    except UserInputError:
        return 0  # the budget does not even hold the model states and reserves
    return est.max_micro_batch  # type: ignore[no-any-return]


def free_bytes(gpu: PlannedGpu) -> int | None:
    return gpu.memory_free_bytes if gpu.memory_free_bytes is not None else gpu.memory_total_bytes


def memory_problems(
    check: MemoryCheck, role: RolePlan, job: Job, problems: list[Problem], warnings: list[Problem]
) -> None:
    need, have = fmt_bytes(check.needed_bytes), fmt_bytes(check.available_bytes)
    gpu = check.deciding_gpu
    if check.fits is False:
        what = "training" if role.kind == "train" else "serving"
        fixes = []
        if role.kind == "train" and job.model is not None:
            names = list(STRATEGIES)
            for strategy in names[names.index(job.strategy) + 1 :]:
                other = estimate_role(
                    role, replace(job, strategy=strategy), check.micro_batch or 1
                ).total_bytes
                if other <= (check.available_bytes or 0):
                    fixes.append(f"strategy='{strategy}' needs {fmt_bytes(other)} per GPU")
                    break
        if check.max_micro_batch:
            fixes.append(f"micro_batch={check.max_micro_batch} fits (computed, not tried)")
        elif role.kind == "train" and job.seq_len is not None:
            fixes.append("activation_checkpointing=True keeps one layer's activations")
        fixes.append("more GPUs for this role shrink every sharded part")
        problems.append(
            Problem(
                "bad",
                "memory",
                f"role {role.name}",
                f"role {role.name}: {what} needs {need} per GPU but GPU {gpu} has {have} free",
                tuple(fixes),
            )
        )
    elif check.tight:
        warnings.append(
            Problem(
                "warn",
                "memory_tight",
                f"role {role.name}",
                f"role {role.name}: {need} of GPU {gpu}'s {have} free are needed; little room "
                "is left for what the estimate cannot see",
            )
        )


def auto_max_micro(roles: Sequence[RolePlan], job: Job, warnings: list[Problem]) -> Job:
    """``max_micro_batch='auto'``: the largest micro batch the first trainer's GPUs hold."""
    if not job.max_micro_auto or job.model is None:
        return job
    trainer = next((r for r in roles if r.kind == "train" and r.gpus), None)
    known = [] if trainer is None else [g for g in trainer.gpus if free_bytes(g) is not None]
    if trainer is None or not known:
        warnings.append(
            Problem(
                "warn",
                "max_micro",
                "max_micro_batch",
                "max_micro_batch='auto': no GPU sizes to fit into",
            )
        )
        return job
    smallest = min(known, key=lambda g: free_bytes(g) or 0)
    largest = largest_micro(trainer, job, free_bytes(smallest) or 0)
    if not largest:
        # The memory check reports what does not fit; the batch check gets no limit.
        return job
    warnings.append(
        Problem(
            "warn",
            "max_micro",
            f"role {trainer.name}",
            f"role {trainer.name}: max_micro_batch={largest} is the largest that fits GPU "
            f"{smallest.nvml_index}'s {fmt_bytes(free_bytes(smallest))} free (computed from the "
            "memory estimate, no trial runs)",
        )
    )
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
        gpus = anchor.cuda_visible_devices
        engines = [r.name for r in group if r.kind == "inference"]
        fraction = (
            f"; {', '.join(engines)}'s memory fraction (SGLang mem_fraction_static, vLLM "
            "gpu_memory_utilization) must leave room for the trainer, or the engine must "
            "release its memory while training steps"
            if engines
            else ""
        )
        warnings.append(
            Problem(
                "warn",
                "colocated",
                names,
                f"{names} share GPUs {gpus} (colocated): each GPU holds the memory of every "
                f"role at once{fraction}",
            )
        )
        known = [checks[r.name] for r in group if r.name in checks]
        if len(known) < len(group):
            continue
        need = sum(c.needed_bytes for c in known)
        have = min(
            (c.available_bytes for c in known if c.available_bytes is not None), default=None
        )
        if have is not None and need > have:
            parts = " + ".join(f"{c.role} {fmt_bytes(c.needed_bytes)}" for c in known)
            problems.append(
                Problem(
                    "bad",
                    "memory",
                    f"colocated {names}",
                    f"colocated {names} need {parts} = {fmt_bytes(need)} per GPU together, but "
                    f"GPU {known[0].deciding_gpu} has {fmt_bytes(have)} free",
                    ("'+' instead of '|' gives each role GPUs of its own",),
                )
            )
