"""Colocated roles (AReaL's ``|``): roles that run on the same GPUs, one after the other.

``sglang:d4|fsdp:d4`` starts the inference engine and the trainer on the same four GPUs
(AReaL alternates them: generate, then train). GPUs are handed out to the first role of
each colocated group only; the others get the same GPUs in the same order. Memory is the
price: each GPU holds both roles at once unless the engine releases its memory while the
trainer steps (SGLang's and vLLM's sleep/offload modes), so the engine's memory fraction
(SGLang ``mem_fraction_static``, vLLM ``gpu_memory_utilization``) must leave room for the
trainer's model states, activations and buffers. :func:`colocation_issues` says this for
every group, and with a model it adds the roles' per-GPU needs and checks the sum.

Pure: plain data in, issues out; never imports the inventory, sockets or files.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from nbgpu._render import fmt_bytes
from nbgpu.plan.allocation import Allocation, RoleSpec
from nbgpu.plan.result import Issue, MemoryCheck, RolePlan

__all__ = ["colocation_issues", "own_gpus", "shared_groups"]

T = TypeVar("T")


def own_gpus(allocation: Allocation) -> list[RoleSpec]:
    """The roles that get GPUs of their own (all but the colocated ones)."""
    return [r for r in allocation.roles if r.colocated_with is None]


def shared_groups(allocation: Allocation, groups: list[list[T]] | None) -> list[list[T]] | None:
    """One GPU list per role: a colocated role gets the list of the role it shares with."""
    if groups is None:
        return None
    by_name: dict[str, list[T]] = {}
    out: list[list[T]] = []
    own = iter(groups)
    for role in allocation.roles:
        members = by_name[role.colocated_with] if role.colocated_with else next(own)
        by_name[role.name] = members
        out.append(list(members))
    return out


def colocation_issues(
    roles: Sequence[RolePlan],
    memory: Sequence[MemoryCheck],
    problems: list[Issue],
    warnings: list[Issue],
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
            Issue(
                "colocated",
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
                Issue(
                    "memory",
                    f"colocated {names} need {parts} = {fmt_bytes(need)} per GPU together, but "
                    f"GPU {known[0].deciding_gpu} has {fmt_bytes(have)} free",
                    ("'+' instead of '|' gives each role GPUs of its own",),
                )
            )
