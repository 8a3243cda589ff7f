"""The rules (which key follows which rule, how a rule moves a value to the target) and
the checks verl and vLLM make at start, run on the scaled values before anything runs.

A global batch scales with the GPU count and moves to the nearest valid value; a
tensor-parallel size is kept, scaled or set. Then: batch divisibility by the GPU count
and the micro batch, mini <= train batch, the rollout world by the tensor-parallel size,
token budgets. Pure arithmetic; never reads files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from nbgpu.errors import UserInputError
from nbgpu.estimate.shapes import ModelShape
from nbgpu.problems import Problem
from nbgpu.scale.values import Entry, config_model_len, find_entry, int_of

__all__ = [
    "RULES",
    "ScaleContext",
    "batch_divisor",
    "check_start_up",
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
    problems: list[Problem]
    warnings: list[Problem]
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
            Problem(
                "bad",
                "batch",
                entry.dotted,
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


# ------------------------------------------------------------- start-up checks


def check_start_up(
    entries: Sequence[Entry], new: Mapping[str, Any], rules: Mapping[str, str], ctx: ScaleContext
) -> None:
    """verl's and vLLM's start-up checks on the new values."""
    world = ctx.to_gpus
    dp = max(1, world // ctx.sp)

    def value(e: Entry) -> Any:
        return new.get(e.dotted, e.value)

    ints = {e.dotted: value(e) for e in entries if isinstance(value(e), int)}
    train = next((e for e in entries if e.leaf == "train_batch_size"), None)
    train_value = ints.get(train.dotted) if train is not None else None
    if train_value is not None and (train_value * ctx.n) % world:
        ctx.problems.append(
            Problem(
                "bad",
                "batch",
                "train_batch_size",
                f"train_batch_size {train_value} × rollout.n {ctx.n} is not divisible by "
                f"{world} GPUs (verl: real_train_batch_size % n_gpus == 0)",
            )
        )
    for e in entries:
        if e.leaf != "ppo_mini_batch_size" or e.dotted not in ints:
            continue
        mini = ints[e.dotted]
        if train_value is not None and mini > train_value:
            ctx.problems.append(
                Problem(
                    "bad",
                    "batch",
                    e.dotted,
                    f"{e.dotted} {mini} is larger than train_batch_size {train_value} "
                    "(verl asserts train_batch_size >= ppo_mini_batch_size)",
                )
            )
        per_gpu = mini * ctx.n // dp
        micro_entry = find_entry(entries, f"{e.parent}.ppo_micro_batch_size_per_gpu")
        micro = ints.get(micro_entry.dotted) if micro_entry is not None else None
        if per_gpu < 1:
            ctx.problems.append(
                Problem(
                    "bad",
                    "batch",
                    e.dotted,
                    f"{e.dotted} {mini} × n {ctx.n} ÷ {dp} data-parallel GPUs = 0 per GPU "
                    "(verl: ppo_mini_batch_size must stay > 0 after normalisation)",
                )
            )
        elif micro and per_gpu % micro:
            ctx.problems.append(
                Problem(
                    "bad",
                    "batch",
                    e.dotted,
                    f"{e.dotted} gives {per_gpu} per GPU, not divisible by "
                    f"ppo_micro_batch_size_per_gpu {micro}",
                )
            )
    for e in entries:
        rule = rules.get(e.dotted)
        v = value(e)
        if rule == "tensor_parallel" and isinstance(v, int) and v >= 1:
            if world % v:
                ctx.problems.append(
                    Problem(
                        "bad",
                        "tensor_parallel",
                        e.dotted,
                        f"{e.dotted} {v} does not divide {world} GPUs: the rollout world size "
                        "must be a multiple of the tensor-parallel size",
                    )
                )
            heads = ctx.model.num_attention_heads if ctx.model is not None else None
            if heads is not None and heads % v:
                ctx.problems.append(
                    Problem(
                        "bad",
                        "tensor_parallel",
                        e.dotted,
                        f"{e.dotted} {v} does not divide the model's {heads} attention heads "
                        "(vLLM requires it)",
                    )
                )
        if rule == "memory_fraction" and isinstance(v, int | float) and not 0 < v <= 1:
            ctx.problems.append(
                Problem(
                    "bad",
                    "memory_fraction",
                    e.dotted,
                    f"{e.dotted} {v} is not a fraction in (0, 1]",
                )
            )
        if rule == "gpu_count" and isinstance(v, int) and v * ctx.nnodes != ctx.to_gpus:
            ctx.problems.append(
                Problem(
                    "bad",
                    "gpu_count",
                    e.dotted,
                    f"{e.dotted} {v} × nnodes {ctx.nnodes} ≠ {ctx.to_gpus} GPUs",
                )
            )
    for e in entries:
        if e.leaf != "max_num_batched_tokens" or not isinstance(value(e), int):
            continue
        tokens = value(e)
        seqs_entry = find_entry(entries, f"{e.parent}.max_num_seqs")
        seqs = value(seqs_entry) if seqs_entry is not None else None
        if isinstance(seqs, int) and tokens < seqs:
            ctx.problems.append(
                Problem(
                    "bad",
                    "engine",
                    e.dotted,
                    f"{e.dotted} {tokens} < max_num_seqs {seqs} (vLLM requires "
                    "max_num_batched_tokens >= max_num_seqs)",
                )
            )
        model_len = config_model_len(entries, value)
        if model_len is not None and tokens < model_len:
            ctx.problems.append(
                Problem(
                    "bad",
                    "engine",
                    e.dotted,
                    f"{e.dotted} {tokens} < the maximum model length {model_len} (prompt + "
                    "response): verl refuses it with chunked prefill, vLLM without",
                    (f"max_num_batched_tokens={model_len}",),
                )
            )
