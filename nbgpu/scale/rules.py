"""The rules: which key follows which rule (told by its full path where a last name means two
things), and how a rule moves a value to the target; the context a rescaling shares with its
checks (``checks.py``). Pure arithmetic; never reads files.
"""

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from nbgpu.errors import UserInputError
from nbgpu.estimate.shapes import ModelShape, find_model
from nbgpu.problems import Problem
from nbgpu.scale.values import Entry, find_entry, int_of

__all__ = ["RULES", "ScaleContext", "batch_divisor", "builtin_shape", "named_model", "rules_for",
           "scale_allocation", "scale_global", "scale_tensor_parallel"]  # fmt: skip


#: Rules a key can follow, and what each does (also the accepted values of ``rules=``).
RULES: Mapping[str, str] = {
    "global_batch": "a batch over all GPUs: scaled with the GPU count, kept divisible",
    "per_gpu": "per GPU: unchanged",
    "per_engine": "per inference engine: scaled with the sequences each engine serves",
    "tensor_parallel": "tensor-parallel size of the inference engine",
    "model_parallel": "a training model-parallel size (Megatron TP, PP, CP): kept, checked",
    "memory_fraction": "a fraction of each GPU's memory: unchanged, KV cache checked",
    "gpu_count": "GPUs per node",
    "node_count": "nodes",
    "allocation": "an AReaL allocation: each part's data parallel scaled, TP/PP/CP kept",
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
    "tensor_model_parallel_size": "tensor_parallel",  # under .megatron.: model_parallel
    "pipeline_model_parallel_size": "model_parallel",
    "context_parallel_size": "model_parallel",
    "gpu_memory_utilization": "memory_fraction",
    "n_gpus_per_node": "gpu_count",
    "nnodes": "node_count",  # verl's trainer.nnodes
    "n_nodes": "node_count",  # AReaL's cluster.n_nodes
    "allocation_mode": "allocation",  # AReaL's sglang:d4t2+fsdp:d8
    "cuda_visible_devices": "devices",
}


def rules_for(entries: Sequence[Entry], rules: Mapping[str, str]) -> dict[str, str]:
    """dotted key → rule, built-ins first, then the caller's rules (which must match).

    A key is told by its full path where its last name means two things: a Megatron
    ``tensor_model_parallel_size`` splits the trained model, a rollout's sets its engines."""
    out = {e.dotted: _LEAVES[e.leaf.lower()] for e in entries if e.leaf.lower() in _LEAVES}
    for key, rule in out.items():
        if rule == "tensor_parallel" and ".megatron." in f".{key}":
            out[key] = "model_parallel"
    for key, rule in rules.items():
        if rule not in RULES:
            raise UserInputError(
                f"rules (--rule): {key!r}: {rule!r} is not a rule; expected one of {', '.join(RULES)}"
            )
        matched = [e for e in entries if key in (e.dotted, e.leaf) or e.dotted.endswith("." + key)]
        if not matched:
            known = ", ".join(e.dotted for e in entries[:6])
            more = ", ..." if len(entries) > 6 else ""
            raise UserInputError(
                f"rules (--rule): unknown key {key!r}: the config has no such key (it has {known}{more}); "
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
    problems: list[Problem] = field(default_factory=list)
    model_name: str | None = None  # the model the config names, when model= was not given
    new: dict[str, Any] = field(default_factory=dict)  # dotted key → its scaled value
    warnings: list[Problem] = field(default_factory=list)

    @property
    def per_node(self) -> int:
        return self.to_gpus // self.nnodes

    def group(self, parent: str) -> int:
        """TP × PP × CP of the Megatron model-parallel group configured under *parent*."""
        sizes = [
            self.now(e)
            for e in self.entries
            if e.parent == parent and self.rules.get(e.dotted) == "model_parallel"
        ]
        return math.prod(v for v in sizes if isinstance(v, int) and v > 0)

    @property
    def megatron_actor(self) -> str | None:
        """Where the trained actor's Megatron sizes are (``actor_rollout_ref.actor.megatron``)."""
        groups = (e.parent for e in self.entries if self.rules.get(e.dotted) == "model_parallel")
        return next((g for g in groups if ".actor." in f".{g}."), None)

    @property
    def dp(self) -> int:
        """The actor's data-parallel ranks: the world over its Megatron group, or over Ulysses
        sequence parallel under FSDP (verl v0.7.0, validate_config and the workers)."""
        actor = self.megatron_actor
        return max(1, self.to_gpus // (self.group(actor) if actor else self.sp))

    @property
    def minimal_batch(self) -> tuple[int, str]:
        """verl's smallest train batch × n, and what it is (v0.7.0 validate_config)."""
        if self.megatron_actor is None:
            return self.to_gpus, f"{self.to_gpus} GPUs"
        micro = int_of(find_entry(self.entries, "actor.ppo_micro_batch_size_per_gpu"), 1)
        return self.dp * micro, f"{self.dp} data-parallel ranks × micro batch {micro}"

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
    if entry.leaf == "ppo_mini_batch_size":
        micro = find_entry(ctx.entries, f"{entry.parent}.ppo_micro_batch_size_per_gpu")
        need = ctx.dp * int_of(micro, 1)
    else:
        need = ctx.minimal_batch[0] if entry.leaf == "train_batch_size" else ctx.dp
    # value × n must be a multiple of need.
    return need // math.gcd(need, ctx.n)


_KEPT_BATCH = "kept (batch='keep', --keep-batch)"


def scale_global(entry: Entry, ctx: ScaleContext) -> tuple[Any, str]:
    old = entry.value
    if not isinstance(old, int) or isinstance(old, bool):
        return old, "not a whole number: left as is"
    step = batch_divisor(entry, ctx)
    if ctx.batch == "keep":
        if old % step == 0:
            return old, f"{_KEPT_BATCH}: a multiple of {step}, valid on {ctx.to_gpus} GPUs"
        lower, upper = max(step, old // step * step), (old // step + 1) * step
        n = f" (× rollout.n={ctx.n})" if ctx.n > 1 else ""
        message = f"{entry.dotted}={old} is not valid on {ctx.to_gpus} GPUs: it must be a "
        # verl refuses a mini batch larger than the train batch: never propose one.
        mini = entry.leaf == "ppo_mini_batch_size"
        cap = int_of(find_entry(ctx.entries, "train_batch_size"), upper) if mini else upper
        fixes = [f"{entry.leaf}={v}" for v in sorted({lower, upper}) if v <= cap]
        ctx.bad("batch", entry.dotted, f"{message}multiple of {step}{n}", *fixes)
        return old, _KEPT_BATCH
    target = old * ctx.factor
    low = max(step, math.floor(target / step) * step)
    high = max(step, math.ceil(target / step) * step)
    new = low if abs(target - low) <= abs(high - target) else high
    if new == target:
        return new, f"× {ctx.to_gpus}/{ctx.from_gpus} GPUs: the per-GPU share stays the same"
    shown = float(target) if target.denominator != 1 else int(target)
    why = f"{old} × {ctx.to_gpus}/{ctx.from_gpus} = {shown} → {new}, the nearest multiple"
    return new, f"{why} of {step}"


# A data-parallel degree in AReaL's grammar: `d4` at the start of a part (`sglang:d4t2`,
# `sglang.d1t1p1+d3t1p1`, `fsdp:d4|sglang:d4`).
_DEGREE = re.compile(r"(^|[:.+|])d(\d+)")


def scale_allocation(entry: Entry, ctx: ScaleContext) -> tuple[Any, str]:
    """Each part of an allocation serves as many GPUs' worth of work per replica as before:
    its data-parallel degree grows with the GPUs; its model split (t, p, c) stays."""
    old, uneven = entry.value, []
    if not isinstance(old, str) or not _DEGREE.search(old):
        return old, "not an allocation: left as is"

    def grow(m: re.Match[str]) -> str:
        degree = int(m.group(2)) * ctx.factor
        uneven.extend([m.group(0).lstrip(":.+|")] if degree.denominator != 1 else [])
        return f"{m.group(1)}d{degree}" if degree.denominator == 1 else m.group(0)

    new = _DEGREE.sub(grow, old)
    if uneven:
        ctx.bad(
            "allocation",
            entry.dotted,
            f"{entry.dotted} {old}: {', '.join(uneven)} × {ctx.to_gpus}/{ctx.from_gpus} GPUs is "
            "not a whole number of replicas; choose a GPU count that keeps each one whole",
        )
        return old, "kept: its parts do not scale to whole replicas"
    return new, f"each part's data parallel × {ctx.to_gpus}/{ctx.from_gpus}; TP, PP, CP kept"


def scale_tensor_parallel(entry: Entry, ctx: ScaleContext, policy: str | int) -> tuple[Any, str]:
    old = entry.value
    if not isinstance(old, int) or isinstance(old, bool) or old < 1:
        return old, "not a whole number: left as is"
    if isinstance(policy, int):
        return policy, f"set to {policy} (tensor_parallel={policy}, --tp {policy})"
    if policy == "keep":
        engines = ctx.to_gpus // old if ctx.to_gpus % old == 0 else None
        what = f"{engines} engines of {old} GPUs" if engines else "engines"
        return old, (
            f"kept: the model already fits on {old} GPUs; {ctx.to_gpus} GPUs run {what} "
            "(tensor_parallel='scale', --tp scale, makes one larger engine instead)"
        )
    world = ctx.to_gpus // max(1, ctx.nnodes)
    heads = ctx.model.num_attention_heads if ctx.model is not None else None
    options = [
        t
        for t in range(1, world + 1)
        if world % t == 0 and t <= old * ctx.factor and (heads is None or heads % t == 0)
    ]
    why = f"× {ctx.to_gpus}/{ctx.from_gpus} GPUs (tensor_parallel='scale', --tp scale): one engine spans "
    return max(options) if options else old, why + "more GPUs"


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
