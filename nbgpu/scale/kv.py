"""The KV cache check: does each inference engine's memory fraction hold the model and
the cache its sequences need (``reference/memory.md`` §5c)?

The model comes from the config's named model (built-in shapes) or is given. Pure
arithmetic; never reads files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from nbgpu._render import fmt_bytes
from nbgpu.estimate.builtin_models import find_model
from nbgpu.estimate.formulas import PRECISIONS, normalize_precision, weight_bytes
from nbgpu.estimate.shapes import ModelShape, kv_bytes_per_token, model_shape
from nbgpu.problems import Problem
from nbgpu.scale.rules import ScaleContext
from nbgpu.scale.values import Entry, config_model_len, find_entry

__all__ = [
    "KV_RESERVE_BYTES",
    "KvCheck",
    "builtin_shape",
    "kv_check",
    "named_model",
]


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
    entries: Sequence[Entry],
    new: Mapping[str, Any],
    rules: Mapping[str, str],
    ctx: ScaleContext,
    *,
    gpu_memory_bytes: int | None,
    max_model_len: int | None,
    precision: str | None,
) -> KvCheck | None:
    def value(e: Entry) -> Any:
        return new.get(e.dotted, e.value)

    fraction_entry = next((e for e in entries if rules.get(e.dotted) == "memory_fraction"), None)
    if fraction_entry is not None and ctx.model is None and ctx.model_name is not None:
        ctx.warnings.append(
            Problem(
                "warn",
                "kv_unchecked",
                "KV cache",
                f"KV cache not checked: the config's model {ctx.model_name!r} is not among "
                "nbgpu's built-in model shapes; pass model= its config.json (path or dict)",
            )
        )
        return None
    if fraction_entry is None or ctx.model is None or not ctx.model.has_kv_shape:
        if fraction_entry is not None:
            ctx.warnings.append(
                Problem(
                    "warn",
                    "kv_unchecked",
                    "KV cache",
                    "KV cache not checked: pass model= as an HF config dict (layers, KV heads, "
                    "head_dim) and a GPU size (inventory= or gpu_memory_bytes=)",
                )
            )
        return None
    if gpu_memory_bytes is None:
        ctx.warnings.append(
            Problem(
                "warn",
                "kv_unchecked",
                "KV cache",
                "KV cache not checked: pass inventory= or gpu_memory_bytes= for the GPU size",
            )
        )
        return None
    fraction = value(fraction_entry)
    if not isinstance(fraction, int | float) or not 0 < fraction <= 1:
        return None
    tp_entry = next((e for e in entries if rules.get(e.dotted) == "tensor_parallel"), None)
    tp = value(tp_entry) if tp_entry is not None and isinstance(value(tp_entry), int) else 1
    seqs_entry = find_entry(entries, "max_num_seqs")
    seqs = value(seqs_entry) if seqs_entry is not None else None
    model_len = max_model_len or config_model_len(entries, value)
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
    key = fraction_entry.dotted
    if check.budget_bytes <= 0:
        need = check.fraction_for(model_len or 1)
        ctx.problems.append(
            Problem(
                "bad",
                "kv_cache",
                key,
                f"{key} {fraction} of {fmt_bytes(gpu_memory_bytes)} holds the weights "
                f"({fmt_bytes(check.weights_bytes)}) and the reserve but no KV cache",
                (f"{key.rsplit('.', 1)[-1]}={need}",),
            )
        )
    elif model_len is not None and check.capacity_tokens < model_len:
        ctx.problems.append(
            Problem(
                "bad",
                "kv_cache",
                key,
                f"the KV cache holds {check.capacity_tokens:,} tokens per GPU, less than one "
                f"sequence of {model_len:,}: the engine refuses to start",
                (f"{key.rsplit('.', 1)[-1]}={check.fraction_for(model_len)}",),
            )
        )
    elif check.needed_tokens is not None and check.capacity_tokens < check.needed_tokens:
        full = check.capacity_tokens // (model_len or 1)
        ctx.warnings.append(
            Problem(
                "warn",
                "kv_cache",
                key,
                f"the KV cache holds {check.capacity_tokens:,} tokens = {full} full-length "
                f"sequences, fewer than max_num_seqs {check.max_num_seqs}: the engine will "
                "queue or preempt sequences",
                (f"{key.rsplit('.', 1)[-1]}={check.fraction_for(check.needed_tokens)}",),
            )
        )
    return check


# Keys that name the model a config trains and serves (verl, VAGEN, EasyR1, TRL).
_MODEL_KEYS = ("model.path", "model_path", "model_name_or_path", "pretrained_model_name_or_path")


def builtin_shape(name: str) -> ModelShape | None:
    """A model's shape from nbgpu's built-in table, by HF repo name or a local copy's folder."""
    found = find_model(name.strip()) or find_model(name.strip().rstrip("/").rsplit("/", 1)[-1])
    if found is None:
        return None
    return replace(model_shape(found.to_hf_dict()), source=f"{found.name}, built-in shape")


def named_model(entries: Sequence[Entry]) -> tuple[str | None, ModelShape | None]:
    """The model the config names (``actor_rollout_ref.model.path``...), and its shape."""
    for e in entries:
        named = any(e.dotted == k or e.dotted.endswith("." + k) for k in _MODEL_KEYS)
        if named and isinstance(e.value, str) and e.value.strip():
            return e.value, builtin_shape(e.value)
    return None, None
