"""The rules (which key follows which rule, how a rule moves a value to the target) and the checks
verl and vLLM make at start (batch divisibility, the tensor-parallel size, token budgets, the KV
cache), run on the scaled values before anything runs. Pure arithmetic; never reads files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, ClassVar

from nbgpu._render import fmt_bytes
from nbgpu.errors import UserInputError
from nbgpu.estimate.formulas import PRECISIONS, normalize_precision, weight_bytes
from nbgpu.estimate.shapes import ModelShape, find_model, kv_bytes_per_token
from nbgpu.problems import Problem
from nbgpu.scale.values import Entry, config_model_len, find_entry, int_of

__all__ = ["KV_RESERVE_BYTES", "RULES", "KvCheck", "ScaleContext", "batch_divisor", "builtin_shape",
           "check_start_up", "kv_check", "named_model", "rules_for", "scale_global",
           "scale_tensor_parallel"]  # fmt: skip


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
    "max_num_seqs": "per_engine",
    "max_num_batched_tokens": "per_engine",
    "tensor_model_parallel_size": "tensor_parallel",
    "gpu_memory_utilization": "memory_fraction",
    "n_gpus_per_node": "gpu_count",
    "cuda_visible_devices": "devices",
}


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
        out.update((e.dotted, rule) for e in matched)
    return out


@dataclass
class ScaleContext:
    """One rescaling under way: what the rules read, set and found."""

    entries: Sequence[Entry]
    rules: Mapping[str, str]  # dotted key → rule
    from_gpus: int
    to_gpus: int
    factor: Fraction
    batch: str
    n: int  # rollout.n: responses per prompt
    sp: int  # ulysses sequence parallel size
    nnodes: int
    model: ModelShape | None
    problems: list[Problem]
    model_name: str | None = None  # the model the config names, when model= was not given
    new: dict[str, Any] = field(default_factory=dict)  # dotted key → its scaled value
    warnings: list[Problem] = field(default_factory=list)

    def now(self, e: Entry | None) -> Any:
        """The entry's value once scaled (None: no such entry)."""
        return None if e is None else self.new.get(e.dotted, e.value)

    def ruled(self, rule: str) -> Entry | None:
        return next((e for e in self.entries if self.rules.get(e.dotted) == rule), None)

    def bad(self, code: str, subject: str, message: str, *fixes: str) -> None:
        self.problems.append(Problem("bad", code, subject, message, fixes))

    def warn(self, code: str, subject: str, message: str, *fixes: str) -> None:
        self.warnings.append(Problem("warn", code, subject, message, fixes))


def batch_divisor(entry: Entry, ctx: ScaleContext) -> int:
    """The step every valid value of this global-batch key is a multiple of (verl's rules)."""
    dp = max(1, ctx.to_gpus // ctx.sp)
    if entry.leaf == "ppo_mini_batch_size":
        micro = find_entry(ctx.entries, f"{entry.parent}.ppo_micro_batch_size_per_gpu")
        need = dp * int_of(micro, 1)
    else:
        need = ctx.to_gpus if entry.leaf == "train_batch_size" else dp
    # value × n must be a multiple of need.
    return need // math.gcd(need, ctx.n)


def scale_global(entry: Entry, ctx: ScaleContext) -> tuple[Any, str]:
    old = entry.value
    if not isinstance(old, int) or isinstance(old, bool):
        return old, "not a whole number: left as is"
    step = batch_divisor(entry, ctx)
    if ctx.batch == "keep":
        if old % step == 0:
            return old, f"kept (batch='keep'): a multiple of {step}, valid on {ctx.to_gpus} GPUs"
        lower, upper = max(step, old // step * step), (old // step + 1) * step
        n = f" (× rollout.n={ctx.n})" if ctx.n > 1 else ""
        message = f"{entry.dotted}={old} is not valid on {ctx.to_gpus} GPUs: it must be a "
        # verl refuses a mini batch larger than the train batch: never propose one.
        mini = entry.leaf == "ppo_mini_batch_size"
        cap = int_of(find_entry(ctx.entries, "train_batch_size"), upper) if mini else upper
        fixes = [f"{entry.leaf}={v}" for v in sorted({lower, upper}) if v <= cap]
        ctx.bad("batch", entry.dotted, f"{message}multiple of {step}{n}", *fixes)
        return old, "kept (batch='keep')"
    target = old * ctx.factor
    low = max(step, math.floor(target / step) * step)
    high = max(step, math.ceil(target / step) * step)
    new = low if abs(target - low) <= abs(high - target) else high
    if new == target:
        return new, f"× {ctx.to_gpus}/{ctx.from_gpus} GPUs: the per-GPU share stays the same"
    shown = float(target) if target.denominator != 1 else int(target)
    why = f"{old} × {ctx.to_gpus}/{ctx.from_gpus} = {shown} → {new}, the nearest multiple"
    return new, f"{why} of {step}"


def scale_tensor_parallel(entry: Entry, ctx: ScaleContext, policy: str | int) -> tuple[Any, str]:
    old = entry.value
    if not isinstance(old, int) or isinstance(old, bool) or old < 1:
        return old, "not a whole number: left as is"
    if isinstance(policy, int):
        return policy, f"set to {policy} (tensor_parallel={policy})"
    if policy == "keep":
        engines = ctx.to_gpus // old if ctx.to_gpus % old == 0 else None
        what = f"{engines} engines of {old} GPUs" if engines else "engines"
        return old, (
            f"kept: the model already fits on {old} GPUs; {ctx.to_gpus} GPUs run {what} "
            "(tensor_parallel='scale' makes one larger engine instead)"
        )
    world = ctx.to_gpus // max(1, ctx.nnodes)
    heads = ctx.model.num_attention_heads if ctx.model is not None else None
    options = [
        t
        for t in range(1, world + 1)
        if world % t == 0 and t <= old * ctx.factor and (heads is None or heads % t == 0)
    ]
    why = f"× {ctx.to_gpus}/{ctx.from_gpus} GPUs (tensor_parallel='scale'): one engine spans "
    return max(options) if options else old, why + "more GPUs"


def check_start_up(ctx: ScaleContext) -> None:
    """verl's and vLLM's start-up checks on the new values."""
    world, entries, value = ctx.to_gpus, ctx.entries, ctx.now
    dp = max(1, world // ctx.sp)
    ints = {e.dotted: value(e) for e in entries if isinstance(value(e), int)}
    train = next((e for e in entries if e.leaf == "train_batch_size"), None)
    train_value = ints.get(train.dotted) if train is not None else None
    if train_value is not None and (train_value * ctx.n) % world:
        ctx.bad(
            "batch",
            "train_batch_size",
            f"train_batch_size {train_value} × rollout.n {ctx.n} is not divisible by "
            f"{world} GPUs (verl: real_train_batch_size % n_gpus == 0)",
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
                "(verl asserts train_batch_size >= ppo_mini_batch_size)",
            )
        per_gpu = mini * ctx.n // dp
        micro_entry = find_entry(entries, f"{e.parent}.ppo_micro_batch_size_per_gpu")
        micro = ints.get(micro_entry.dotted) if micro_entry is not None else None
        if per_gpu < 1:
            ctx.bad(
                "batch",
                e.dotted,
                f"{e.dotted} {mini} × n {ctx.n} ÷ {dp} data-parallel GPUs = 0 per GPU "
                "(verl: ppo_mini_batch_size must stay > 0 after normalisation)",
            )
        elif micro and per_gpu % micro:
            ctx.bad(
                "batch",
                e.dotted,
                f"{e.dotted} gives {per_gpu} per GPU, not divisible by "
                f"ppo_micro_batch_size_per_gpu {micro}",
            )
    heads = ctx.model.num_attention_heads if ctx.model is not None else None
    for e in entries:
        rule, v = ctx.rules.get(e.dotted), value(e)
        if rule == "tensor_parallel" and isinstance(v, int) and v >= 1:
            if world % v:
                ctx.bad(
                    "tensor_parallel",
                    e.dotted,
                    f"{e.dotted} {v} does not divide {world} GPUs: the rollout world size "
                    "must be a multiple of the tensor-parallel size",
                )
            if heads is not None and heads % v:
                ctx.bad(
                    "tensor_parallel",
                    e.dotted,
                    f"{e.dotted} {v} does not divide the "
                    f"model's {heads} attention heads (vLLM requires it)",
                )
        if rule == "memory_fraction" and isinstance(v, int | float) and not 0 < v <= 1:
            ctx.bad("memory_fraction", e.dotted, f"{e.dotted} {v} is not a fraction in (0, 1]")
    model_len = config_model_len(entries, value)
    for e in entries:
        if e.leaf != "max_num_batched_tokens" or not isinstance(value(e), int):
            continue
        tokens = value(e)
        seqs = value(find_entry(entries, f"{e.parent}.max_num_seqs"))
        if isinstance(seqs, int) and tokens < seqs:
            ctx.bad(
                "engine",
                e.dotted,
                f"{e.dotted} {tokens} < max_num_seqs {seqs} (vLLM "
                "requires max_num_batched_tokens >= max_num_seqs)",
            )
        if model_len is not None and tokens < model_len:
            ctx.bad(
                "engine",
                e.dotted,
                f"{e.dotted} {tokens} < the maximum model length {model_len} (prompt + "
                "response): verl refuses it with chunked prefill, vLLM without",
                f"max_num_batched_tokens={model_len}",
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


# Keys that name the model a config trains and serves (verl, VAGEN, EasyR1, TRL).
_MODEL_KEYS = ("model.path", "model_path", "model_name_or_path", "pretrained_model_name_or_path")


def builtin_shape(name: str) -> ModelShape | None:
    """A model's shape from nbgpu's built-in table, by HF repo name or a local copy's folder."""
    found = find_model(name.strip()) or find_model(name.strip().rstrip("/").rsplit("/", 1)[-1])
    if found is None:
        return None
    return ModelShape(found.parameters, f"{found.name}, built-in shape", found)


def named_model(entries: Sequence[Entry]) -> tuple[str | None, ModelShape | None]:
    """The model the config names (``actor_rollout_ref.model.path``...), and its shape."""
    for e in entries:
        named = any(e.dotted == k or e.dotted.endswith("." + k) for k in _MODEL_KEYS)
        if named and isinstance(e.value, str) and e.value.strip():
            return e.value, builtin_shape(e.value)
    return None, None
