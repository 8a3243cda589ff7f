"""What verl and vLLM check at start, checked on the scaled values before anything runs.

Batch divisibility by the GPU count and the micro batch, mini <= train batch, the
rollout world by the tensor-parallel size, token budgets. Pure; never reads files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nbgpu.plan.result import Issue
from nbgpu.plan.scaling.entries import Entry, find_entry
from nbgpu.plan.scaling.kv import config_model_len
from nbgpu.plan.scaling.rules import ScaleContext

__all__ = ["check_start_up"]


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
            Issue(
                "batch",
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
                Issue(
                    "batch",
                    f"{e.dotted} {mini} is larger than train_batch_size {train_value} "
                    "(verl asserts train_batch_size >= ppo_mini_batch_size)",
                )
            )
        per_gpu = mini * ctx.n // dp
        micro_entry = find_entry(entries, f"{e.parent}.ppo_micro_batch_size_per_gpu")
        micro = ints.get(micro_entry.dotted) if micro_entry is not None else None
        if per_gpu < 1:
            ctx.problems.append(
                Issue(
                    "batch",
                    f"{e.dotted} {mini} × n {ctx.n} ÷ {dp} data-parallel GPUs = 0 per GPU "
                    "(verl: ppo_mini_batch_size must stay > 0 after normalisation)",
                )
            )
        elif micro and per_gpu % micro:
            ctx.problems.append(
                Issue(
                    "batch",
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
                    Issue(
                        "tensor_parallel",
                        f"{e.dotted} {v} does not divide {world} GPUs: the rollout world size "
                        "must be a multiple of the tensor-parallel size",
                    )
                )
            heads = ctx.model.num_attention_heads if ctx.model is not None else None
            if heads is not None and heads % v:
                ctx.problems.append(
                    Issue(
                        "tensor_parallel",
                        f"{e.dotted} {v} does not divide the model's {heads} attention heads "
                        "(vLLM requires it)",
                    )
                )
        if rule == "memory_fraction" and isinstance(v, int | float) and not 0 < v <= 1:
            ctx.problems.append(
                Issue("memory_fraction", f"{e.dotted} {v} is not a fraction in (0, 1]")
            )
        if rule == "gpu_count" and isinstance(v, int) and v * ctx.nnodes != ctx.to_gpus:
            ctx.problems.append(
                Issue(
                    "gpu_count",
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
                Issue(
                    "engine",
                    f"{e.dotted} {tokens} < max_num_seqs {seqs} (vLLM requires "
                    "max_num_batched_tokens >= max_num_seqs)",
                )
            )
        model_len = config_model_len(entries, value)
        if model_len is not None and tokens < model_len:
            ctx.problems.append(
                Issue(
                    "engine",
                    f"{e.dotted} {tokens} < the maximum model length {model_len} (prompt + "
                    "response): verl refuses it with chunked prefill, vLLM without",
                    (f"max_num_batched_tokens={model_len}",),
                )
            )
