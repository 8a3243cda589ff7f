"""The checks verl and vLLM make at start (batch divisibility, model-parallel groups, engine
sizes, token budgets), the per-node checks of a job over several nodes, and the KV cache one GPU
holds, run on the scaled values before anything runs. Each check names the framework version it
was read from. Pure arithmetic; never reads files.
"""

import math
from dataclasses import dataclass
from typing import ClassVar

from nbgpu._render import fmt_bytes
from nbgpu.estimate.formulas import PRECISIONS, normalize_precision, weight_bytes
from nbgpu.estimate.shapes import kv_bytes_per_token
from nbgpu.scale.rules import ScaleContext
from nbgpu.scale.values import config_model_len, find_entry

__all__ = ["KV_RESERVE_BYTES", "KvCheck", "check_start_up", "kv_check"]

# Where each mirrored check was read; a framework that changes a check changes these.
_VERL = "verl v0.7.0 validate_config"
_VERL_ACTOR = "verl v0.7.0's ActorConfig"
_VERL_WORKERS = "verl v0.7.0's fsdp/megatron workers"
_VLLM = "vLLM's SchedulerConfig (vllm/config/scheduler.py at f0de1a6)"
_VLLM_MODEL = "vLLM's ModelConfig.verify_with_parallel_config"


def check_start_up(ctx: ScaleContext) -> None:
    """verl's and vLLM's start-up checks on the new values, each naming where it was read;
    and the per-node checks of a job over several nodes."""
    entries, value, dp = ctx.entries, ctx.now, ctx.dp
    ints = {e.dotted: value(e) for e in entries if isinstance(value(e), int)}
    train = next((e for e in entries if e.leaf == "train_batch_size"), None)
    train_value = ints.get(train.dotted) if train is not None else None
    minimal, what = ctx.minimal_batch
    if train_value is not None and (train_value * ctx.n) % minimal:
        ctx.bad(
            "batch",
            "train_batch_size",
            f"train_batch_size {train_value} × rollout.n {ctx.n} is not divisible by {minimal}"
            f" ({what}; {_VERL}: real_train_batch_size % minimal_bsz == 0)",
        )
    for e in entries:
        if e.leaf != "ppo_mini_batch_size" or e.dotted not in ints:
            continue
        mini = ints[e.dotted]
        if train_value is not None and mini > train_value:
            ctx.bad(
                "batch",
                e.dotted,
                f"{e.dotted} {mini} is larger than train_batch_size {train_value} "
                f"({_VERL_ACTOR} asserts train_batch_size >= ppo_mini_batch_size)",
            )
        per_gpu = mini * ctx.n // dp
        micro_entry = find_entry(entries, f"{e.parent}.ppo_micro_batch_size_per_gpu")
        micro = ints.get(micro_entry.dotted) if micro_entry is not None else None
        if per_gpu < 1:
            ctx.bad(
                "batch",
                e.dotted,
                f"{e.dotted} {mini} × n {ctx.n} ÷ {dp} data-parallel GPUs = 0 per GPU "
                f"({_VERL_WORKERS}: ppo_mini_batch_size must stay > 0 after normalisation)",
            )
        elif micro and per_gpu % micro:
            ctx.bad(
                "batch",
                e.dotted,
                f"{e.dotted} gives {per_gpu} per GPU, not divisible by "
                f"ppo_micro_batch_size_per_gpu {micro} ({_VERL_WORKERS})",
            )
    _check_parallel(ctx)
    _check_tokens(ctx)


def _check_parallel(ctx: ScaleContext) -> None:
    world, per_node, value = ctx.to_gpus, ctx.per_node, ctx.now
    across = f" (a node has {per_node} of the {world} GPUs)" if ctx.nnodes > 1 else ""
    heads = ctx.model.num_attention_heads if ctx.model is not None else None
    groups = {e.parent for e in ctx.entries if ctx.rules.get(e.dotted) == "model_parallel"}
    for parent in sorted(groups):
        size = ctx.group(parent)
        tp = value(find_entry(ctx.entries, f"{parent}.tensor_model_parallel_size"))
        if world % size:
            ctx.bad(
                "model_parallel",
                parent,
                f"{parent}: TP × PP × CP = {size} does not divide {world} GPUs "
                f"(Megatron's initialize_model_parallel refuses it; {_VERL} for the actor)",
            )
        if isinstance(tp, int) and tp >= 1 and per_node % tp:
            ctx.warn(
                "model_parallel",
                parent,
                f"{parent}: tensor parallel {tp} does not fit whole in a node{across}: "
                "every layer's all-reduce crosses the network",
            )
    for e in ctx.entries:
        rule, v = ctx.rules.get(e.dotted), value(e)
        if rule == "tensor_parallel" and isinstance(v, int) and v >= 1:
            if world % v:
                ctx.bad(
                    "tensor_parallel",
                    e.dotted,
                    f"{e.dotted} {v} does not divide {world} GPUs: the rollout world size "
                    f"must be a multiple of the tensor-parallel size ({_VERL_WORKERS}' mesh)",
                )
            elif per_node % v:
                ctx.warn(
                    "tensor_parallel",
                    e.dotted,
                    f"{e.dotted} {v}: some engines span two nodes{across}, and their "
                    "all-reduces cross the network",
                )
            if heads is not None and heads % v:
                ctx.bad(
                    "tensor_parallel",
                    e.dotted,
                    f"{e.dotted} {v} does not divide the "
                    f"model's {heads} attention heads ({_VLLM_MODEL} requires it)",
                )
        if rule == "memory_fraction" and isinstance(v, int | float) and not 0 < v <= 1:
            ctx.bad("memory_fraction", e.dotted, f"{e.dotted} {v} is not a fraction in (0, 1]")


def _check_tokens(ctx: ScaleContext) -> None:
    """vLLM's token budget against its batch and the model length (vLLM rollouts only)."""
    entries, value = ctx.entries, ctx.now
    model_len = config_model_len(entries, value)
    for e in entries:
        if e.leaf != "max_num_batched_tokens" or not isinstance(value(e), int):
            continue
        if value(find_entry(entries, f"{e.parent}.name")) not in (None, "vllm"):
            continue  # vLLM's limits (verl's default rollout); SGLang has its own
        tokens = value(e)
        seqs = value(find_entry(entries, f"{e.parent}.max_num_seqs"))
        if isinstance(seqs, int) and tokens < seqs:
            ctx.bad(
                "engine",
                e.dotted,
                f"{e.dotted} {tokens} < max_num_seqs {seqs} ({_VLLM} refuses it)",
                f"max_num_batched_tokens={seqs}",
            )
        if model_len is None or tokens >= model_len:
            continue
        fix, short = f"max_num_batched_tokens={model_len}", f"{e.dotted} {tokens} < the maximum"
        short += f" model length {model_len} (prompt + response)"
        if value(find_entry(entries, f"{e.parent}.enable_chunked_prefill")) is False:
            ctx.bad("engine", e.dotted, f"{short}: {_VLLM} refuses it without chunked prefill", fix)
        else:
            ctx.warn(
                "engine",
                e.dotted,
                f"{short}: verl v0.4.1-v0.6.1 refuse it with chunked prefill (vllm_rollout_spmd"
                ".py); from v0.7.0 verl leaves it to vLLM, which takes it with chunked prefill",
                fix,
            )


#: Per-GPU bytes inside the engine's memory fraction that are neither weights nor KV cache:
#: the profile run's activations, CUDA graphs and non-torch allocations such as NCCL
#: (memory.md §5c/§5d). A planning heuristic, stated in every KV check.
KV_RESERVE_BYTES = 2**30


@dataclass(frozen=True)
class KvCheck:
    """The KV cache one GPU of the inference engine can hold (memory.md §5c)."""

    gpu_memory_bytes: int  # total memory of the smallest target GPU
    memory_fraction: float  # gpu_memory_utilization
    weights_bytes: int  # per GPU: params × dtype ÷ tensor-parallel size
    reserve_bytes: int  # KV_RESERVE_BYTES
    bytes_per_token: int  # 2 · layers · ceil(kv_heads / tp) · head_dim · dtype
    tensor_parallel: int
    max_model_len: int | None
    max_num_seqs: int | None
    model: str | None = None  # where the model's shape came from, e.g. a built-in name

    JSON_EXTRAS: ClassVar[tuple[str, ...]] = ("budget_bytes", "capacity_tokens")

    @property
    def budget_bytes(self) -> int:
        """total × fraction - weights - reserve: what is left for the KV cache."""
        requested = math.floor(self.gpu_memory_bytes * self.memory_fraction)
        return requested - self.weights_bytes - self.reserve_bytes

    @property
    def capacity_tokens(self) -> int:
        return max(0, self.budget_bytes) // self.bytes_per_token

    @property
    def needed_tokens(self) -> int | None:
        if self.max_model_len is None or self.max_num_seqs is None:
            return None
        return self.max_model_len * self.max_num_seqs

    def fraction_for(self, tokens: int) -> float:
        """The smallest memory fraction (2 decimals, rounded up) that holds *tokens*."""
        need = self.weights_bytes + self.reserve_bytes + tokens * self.bytes_per_token
        return math.ceil(100 * need / self.gpu_memory_bytes) / 100

    @property
    def text(self) -> str:
        model = f" ({self.model})" if self.model else ""
        return (
            f"KV cache per GPU{model}: {fmt_bytes(self.gpu_memory_bytes)} × {self.memory_fraction} - "
            f"weights {fmt_bytes(self.weights_bytes)} - reserve {fmt_bytes(self.reserve_bytes)}"
            f" = {fmt_bytes(self.budget_bytes)} at {fmt_bytes(self.bytes_per_token)}/token "
            f"(tp {self.tensor_parallel}) = {self.capacity_tokens:,} tokens"
        )


def kv_check(
    ctx: ScaleContext,
    *,
    gpu_memory_bytes: int | None,
    max_model_len: int | None,
    precision: str | None,
) -> KvCheck | None:
    fraction_entry = ctx.ruled("memory_fraction")
    if fraction_entry is None:
        return None
    if ctx.model is None or not ctx.model.has_kv_shape or gpu_memory_bytes is None:
        if ctx.model is None and ctx.model_name is not None:
            why = (
                f"the config's model {ctx.model_name!r} is not among nbgpu's built-in model "
                "shapes; pass model= (--model) its config.json (path or dict)"
            )
        elif ctx.model is None or not ctx.model.has_kv_shape:
            why = (
                "pass model= (--model) as an HF config (layers, KV heads, head_dim) and a GPU "
                "size (inventory= or gpu_memory_bytes=; --fleet or --gpu-memory)"
            )
        else:
            why = "pass inventory= or gpu_memory_bytes= (--fleet or --gpu-memory) for the GPU size"
        ctx.warn("kv_unchecked", "KV cache", f"KV cache not checked: {why}")
        return None
    fraction = ctx.now(fraction_entry)
    if not isinstance(fraction, int | float) or not 0 < fraction <= 1:
        return None
    tp = ctx.now(ctx.ruled("tensor_parallel"))
    tp = tp if isinstance(tp, int) else 1
    seqs = ctx.now(find_entry(ctx.entries, "max_num_seqs"))
    model_len = max_model_len or config_model_len(ctx.entries, ctx.now)
    dtype = normalize_precision(precision or ctx.model.dtype or "bf16")
    check = KvCheck(
        gpu_memory_bytes=gpu_memory_bytes,
        memory_fraction=float(fraction),
        weights_bytes=weight_bytes(ctx.model.parameters, dtype, tp),
        reserve_bytes=KV_RESERVE_BYTES,
        bytes_per_token=kv_bytes_per_token(ctx.model, PRECISIONS[dtype], tp),
        tensor_parallel=tp,
        max_model_len=model_len,
        max_num_seqs=seqs if isinstance(seqs, int) else None,
        model=ctx.model.source if ctx.model_name is not None else None,
    )
    key, leaf = fraction_entry.dotted, fraction_entry.leaf
    if check.budget_bytes <= 0:
        ctx.bad(
            "kv_cache",
            key,
            f"{key} {fraction} of {fmt_bytes(gpu_memory_bytes)} holds the "
            f"weights ({fmt_bytes(check.weights_bytes)}) and the reserve but no KV cache",
            f"{leaf}={check.fraction_for(model_len or 1)}",
        )
    elif model_len is not None and check.capacity_tokens < model_len:
        ctx.bad(
            "kv_cache",
            key,
            f"the KV cache holds {check.capacity_tokens:,} tokens per GPU, "
            f"less than one sequence of {model_len:,}: the engine refuses to start",
            f"{leaf}={check.fraction_for(model_len)}",
        )
    elif check.needed_tokens is not None and check.capacity_tokens < check.needed_tokens:
        ctx.warn(
            "kv_cache",
            key,
            f"the KV cache holds {check.capacity_tokens:,} tokens = "
            f"{check.capacity_tokens // (model_len or 1)} full-length sequences, fewer than "
            f"max_num_seqs {check.max_num_seqs}: the engine will queue or preempt sequences",
            f"{leaf}={check.fraction_for(check.needed_tokens)}",
        )
    return check
