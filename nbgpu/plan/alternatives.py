"""What would work instead of a plan that cannot: fewer GPUs, a nearby valid batch.

A smaller allocation of the same shape on the usable GPUs, and the nearest global batch
the data-parallel size divides. Pure; never reads files nor the inventory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from nbgpu.plan.allocation import Allocation
from nbgpu.plan.batch import BatchCheck
from nbgpu.plan.job import Job
from nbgpu.plan.planresult import Alternative, Plan
from nbgpu.plan.result import (
    ExcludedGpu,
)

__all__ = ["alternatives_for", "nearest_batch", "smaller_allocation"]


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
    excluded: list[ExcludedGpu],
    required_bad: list[int],
    sub_plan: Callable[[Job], Plan],
    batch_of: Callable[[Allocation, Job], BatchCheck | None],
) -> tuple[Alternative, ...]:
    """Plans that would work: *sub_plan* plans a changed job (without alternatives of its
    own), *batch_of* checks a batch for an allocation (both are the planner's)."""
    out = []
    keep_require = tuple(i for i in job.require if i not in required_bad)

    smaller = smaller_allocation(allocation, usable) if allocation.gpu_count > usable else None
    if smaller is not None:
        alt_job = replace(job, allocation=smaller, num_gpus=None, require=keep_require)
        note = ""
        batch = batch_of(smaller, alt_job)
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
