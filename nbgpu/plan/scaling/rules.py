"""The rules: which key follows which rule, and how a rule moves a value to the target.

A global batch scales with the GPU count and moves to the nearest valid value; a
tensor-parallel size is kept, scaled or set. Pure arithmetic; never reads files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from nbgpu.errors import UserInputError
from nbgpu.estimate.shapes import ModelShape
from nbgpu.plan.result import Issue
from nbgpu.plan.scaling.entries import Entry, find_entry, int_of

__all__ = [
    "RULES",
    "ScaleContext",
    "batch_divisor",
    "rules_for",
    "scale_global",
    "scale_tensor_parallel",
]


#: Rules a key can follow, and what each does (also the accepted values of ``rules=``).
RULES: Mapping[str, str] = {
    "global_batch": "a batch over all GPUs: scaled with the GPU count, kept divisible",
    "per_gpu": "per GPU: unchanged",
    "per_engine": "per inference engine: scaled with the sequences each engine serves",
    "tensor_parallel": "tensor-parallel size of the inference engine",
    "memory_fraction": "a fraction of each GPU's memory: unchanged, KV cache checked",
    "gpu_count": "GPUs per node",
    "devices": "the GPUs to use",
    "keep": "left as is",
}

# verl / VAGEN names (the last part of the key) and their rules.
_LEAVES: Mapping[str, str] = {
    "train_batch_size": "global_batch",
    "ppo_mini_batch_size": "global_batch",
    "ppo_micro_batch_size": "global_batch",
    "log_prob_micro_batch_size": "global_batch",
    "ppo_micro_batch_size_per_gpu": "per_gpu",
    "log_prob_micro_batch_size_per_gpu": "per_gpu",
    "micro_batch_size_per_gpu": "per_gpu",
    "tensor_model_parallel_size": "tensor_parallel",
    "gpu_memory_utilization": "memory_fraction",
    "max_num_seqs": "per_engine",
    "max_num_batched_tokens": "per_engine",
    "n_gpus_per_node": "gpu_count",
    "cuda_visible_devices": "devices",
}


# ------------------------------------------------------------------------ the rules


def rules_for(entries: Sequence[Entry], rules: Mapping[str, str]) -> dict[str, str]:
    """dotted key → rule, built-ins first, then the caller's rules (which must match)."""
    out = {e.dotted: _LEAVES[e.leaf.lower()] for e in entries if e.leaf.lower() in _LEAVES}
    for key, rule in rules.items():
        if rule not in RULES:
            raise UserInputError(
                f"rules: {key!r}: {rule!r} is not a rule; expected one of {', '.join(RULES)}"
            )
        matched = [e for e in entries if key in (e.dotted, e.leaf) or e.dotted.endswith("." + key)]
        if not matched:
            known = ", ".join(e.dotted for e in entries[:6])
            more = ", ..." if len(entries) > 6 else ""
            raise UserInputError(
                f"rules: unknown key {key!r}: the config has no such key (it has {known}{more}); "
                "name a key as written in the config, or its last part"
            )
        for e in matched:
            out[e.dotted] = rule
    return out


def _nearest_multiple(target: Fraction, step: int) -> int:
    low = max(step, math.floor(target / step) * step)
    high = max(step, math.ceil(target / step) * step)
    return low if abs(target - low) <= abs(high - target) else high


@dataclass
class ScaleContext:
    from_gpus: int
    to_gpus: int
    factor: Fraction
    batch: str
    n: int  # rollout.n: responses per prompt
    sp: int  # ulysses sequence parallel size
    nnodes: int
    model: ModelShape | None
    problems: list[Issue]
    warnings: list[Issue]
    model_name: str | None = None  # the model the config names, when model= was not given


def batch_divisor(entry: Entry, entries: Sequence[Entry], ctx: ScaleContext, world: int) -> int:
    """The step every valid value of this global-batch key is a multiple of (verl's rules)."""
    dp = max(1, world // ctx.sp)
    if entry.leaf == "ppo_mini_batch_size":
        micro = int_of(find_entry(entries, f"{entry.parent}.ppo_micro_batch_size_per_gpu"), 1)
        need = dp * micro
    elif entry.leaf == "train_batch_size":
        need = world
    else:
        need = dp
    # value × n must be a multiple of need.
    return need // math.gcd(need, ctx.n)


def scale_global(entry: Entry, entries: Sequence[Entry], ctx: ScaleContext) -> tuple[Any, str]:
    old = entry.value
    if not isinstance(old, int) or isinstance(old, bool):
        return old, "not a whole number: left as is"
    step = batch_divisor(entry, entries, ctx, ctx.to_gpus)
    if ctx.batch == "keep":
        if old % step == 0:
            return old, f"kept (batch='keep'): a multiple of {step}, valid on {ctx.to_gpus} GPUs"
        lower = max(step, old // step * step)
        upper = (old // step + 1) * step
        ctx.problems.append(
            Issue(
                "batch",
                f"{entry.dotted}={old} is not valid on {ctx.to_gpus} GPUs: it must be a multiple "
                f"of {step}" + (f" (× rollout.n={ctx.n})" if ctx.n > 1 else ""),
                tuple(f"{entry.leaf}={v}" for v in sorted({lower, upper})),
            )
        )
        return old, "kept (batch='keep')"
    target = old * ctx.factor
    new = _nearest_multiple(target, step)
    why = f"× {ctx.to_gpus}/{ctx.from_gpus} GPUs: the per-GPU share stays the same"
    if new != target:
        shown = float(target) if target.denominator != 1 else int(target)
        why = f"{old} × {ctx.to_gpus}/{ctx.from_gpus} = {shown} → {new}, the nearest multiple of {step}"
    return new, why


def scale_tensor_parallel(entry: Entry, ctx: ScaleContext, policy: str | int) -> tuple[Any, str]:
    old = entry.value
    if not isinstance(old, int) or isinstance(old, bool) or old < 1:
        return old, "not a whole number: left as is"
    world = ctx.to_gpus // max(1, ctx.nnodes)
    if isinstance(policy, int):
        return policy, f"set to {policy} (tensor_parallel={policy})"
    if policy == "keep":
        engines = ctx.to_gpus // old if ctx.to_gpus % old == 0 else None
        what = f"{engines} engines of {old} GPUs" if engines else "engines"
        return old, (
            f"kept: the model already fits on {old} GPUs; {ctx.to_gpus} GPUs run {what} "
            "(tensor_parallel='scale' makes one larger engine instead)"
        )
    target = old * ctx.factor
    heads = ctx.model.num_attention_heads if ctx.model is not None else None
    options = [
        t
        for t in range(1, world + 1)
        if world % t == 0 and t <= target and (heads is None or heads % t == 0)
    ]
    new = max(options) if options else old
    return (
        new,
        f"× {ctx.to_gpus}/{ctx.from_gpus} GPUs (tensor_parallel='scale'): one engine spans more GPUs",
    )
