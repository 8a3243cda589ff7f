"""``scale_config``: apply the rules to a config for a new GPU count, then check it.

Finds the GPUs the config was made for, moves every recognised value, raises the train
batch where a mini batch outgrew it, and runs the start-up and KV checks. Pure; never
reads files (``files.py`` does).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

from nbgpu.errors import UserInputError
from nbgpu.estimate.shapes import ModelShape
from nbgpu.problems import Problem
from nbgpu.scale.kv import kv_check, named_model
from nbgpu.scale.result import ScalePlan, ScaleStep
from nbgpu.scale.rules import (
    ScaleContext,
    batch_divisor,
    check_start_up,
    rules_for,
    scale_global,
    scale_tensor_parallel,
)
from nbgpu.scale.values import (
    Entry,
    device_count,
    entries_of,
    find_entry,
    int_of,
    override_text,
    parse_overrides,
    set_value,
)

__all__ = ["scale_config"]


def _check_options(to_gpus: int, batch: str, tensor_parallel: str | int) -> None:
    if isinstance(to_gpus, bool) or not isinstance(to_gpus, int) or to_gpus < 1:
        raise UserInputError(f"to_gpus={to_gpus!r}: expected a whole number >= 1")
    if batch not in ("scale", "keep"):
        raise UserInputError(f"batch={batch!r}: expected 'scale' or 'keep'")
    numeric = (
        isinstance(tensor_parallel, int)
        and not isinstance(tensor_parallel, bool)
        and tensor_parallel >= 1
    )
    if tensor_parallel not in ("keep", "scale") and not numeric:
        raise UserInputError(
            f"tensor_parallel={tensor_parallel!r}: expected 'keep', 'scale' or a whole number >= 1"
        )


def _source_gpus(
    entries: Sequence[Entry], rule_of: Mapping[str, str], nnodes: int, from_gpus: int | None
) -> int:
    """How many GPUs the config was made for: given, or n_gpus_per_node × nnodes, or CVD."""
    if from_gpus is not None:
        if isinstance(from_gpus, bool) or not isinstance(from_gpus, int) or from_gpus < 1:
            raise UserInputError(f"from_gpus={from_gpus!r}: expected a whole number >= 1")
        return from_gpus
    for e in entries:
        if rule_of.get(e.dotted) == "gpu_count" and isinstance(e.value, int) and e.value > 0:
            return e.value * nnodes
    for e in entries:
        if rule_of.get(e.dotted) == "devices":
            count = device_count(e.value)
            if count is not None:
                return count
    raise UserInputError(
        "config does not say how many GPUs it was made for (no n_gpus_per_node or "
        "CUDA_VISIBLE_DEVICES); pass from_gpus=N"
    )


_KEPT = {
    "memory_fraction": (
        "kept: a fraction of each GPU's memory, and each GPU is as big as before; "
        "the KV check says whether it holds the batch"
    ),
    "per_gpu": "per GPU: each GPU still processes this many per step",
    "keep": "kept (rule 'keep')",
}


def _apply_rules(
    entries: Sequence[Entry],
    rule_of: Mapping[str, str],
    ctx: ScaleContext,
    tensor_parallel: str | int,
    devices: Sequence[int] | None,
) -> tuple[dict[str, Any], dict[str, str]]:
    new: dict[str, Any] = {}
    reasons: dict[str, str] = {}
    by_key = {e.dotted: e for e in entries}
    # Tensor parallel and global batches first: the per-engine keys depend on both.
    order = ["tensor_parallel", "global_batch", "per_engine"]
    ranked = sorted(rule_of.items(), key=lambda kv: order.index(kv[1]) if kv[1] in order else 9)
    for key, rule in ranked:
        entry = by_key[key]
        if rule == "global_batch":
            new[key], reasons[key] = scale_global(entry, entries, ctx)
        elif rule == "tensor_parallel":
            new[key], reasons[key] = scale_tensor_parallel(entry, ctx, tensor_parallel)
        elif rule == "per_engine":
            new[key], reasons[key] = _scale_engine(entry, entries, new, rule_of, ctx)
        elif rule == "gpu_count":
            new[key] = ctx.to_gpus // ctx.nnodes
            reasons[key] = f"{ctx.to_gpus} GPUs over {ctx.nnodes} node(s)"
        elif rule == "devices":
            new[key], reasons[key] = _devices(entry.value, ctx.to_gpus, devices)
        else:
            new[key], reasons[key] = entry.value, _KEPT[rule]
    if ctx.batch == "scale":
        _train_covers_minis(entries, new, reasons, ctx)
    return new, reasons


def _train_covers_minis(
    entries: Sequence[Entry], new: dict[str, Any], reasons: dict[str, str], ctx: ScaleContext
) -> None:
    """Raise train_batch_size when a mini batch had to grow past it (verl: train >= mini)."""
    train = next((e for e in entries if e.leaf == "train_batch_size"), None)
    if train is None or not isinstance(new.get(train.dotted), int):
        return
    minis = [
        new[e.dotted]
        for e in entries
        if e.leaf == "ppo_mini_batch_size" and isinstance(new.get(e.dotted), int)
    ]
    largest = max(minis, default=0)
    if largest <= new[train.dotted]:
        return
    step = batch_divisor(train, entries, ctx, ctx.to_gpus)
    # A multiple of both: valid for the GPUs, and whole mini batches per step.
    value = math.lcm(step, largest)
    new[train.dotted] = value
    reasons[train.dotted] = (
        f"{value}: the smallest valid value >= ppo_mini_batch_size {largest} "
        f"(a multiple of {step} and of {largest})"
    )


def scale_config(
    config: Mapping[str, Any] | Sequence[str],
    *,
    to_gpus: int,
    from_gpus: int | None = None,
    batch: str = "scale",
    tensor_parallel: str | int = "keep",
    rules: Mapping[str, str] | None = None,
    model: ModelShape | None = None,
    max_model_len: int | None = None,
    precision: str | None = None,
    devices: Sequence[int] | None = None,
    gpu_memory_bytes: int | None = None,
    source: str | None = None,
    extra_problems: Sequence[Problem] = (),
    extra_warnings: Sequence[Problem] = (),
) -> ScalePlan:
    """Rescale *config* (a mapping, or ``key=value`` overrides) to *to_gpus* GPUs."""
    original: Any
    if isinstance(config, Mapping):
        overrides = False
        original = copy.deepcopy(dict(config))
    elif not isinstance(config, str) and all(isinstance(c, str) for c in config):
        overrides = True
        original = list(config)
    else:
        raise UserInputError(
            "config: expected a dict, a YAML/JSON file path, or a list of key=value overrides"
        )
    data: dict[str, Any] = parse_overrides(original) if overrides else copy.deepcopy(original)
    _check_options(to_gpus, batch, tensor_parallel)
    entries = entries_of(data)
    if not entries:
        raise UserInputError("config is empty; expected a verl/VAGEN-style config")
    rule_of = rules_for(entries, rules or {})
    if not rule_of:
        raise UserInputError(
            "config has none of the keys nbgpu scales (train_batch_size, ppo_mini_batch_size, "
            "tensor_model_parallel_size, n_gpus_per_node, ...); name yours with rules="
        )
    nnodes = int_of(find_entry(entries, "nnodes"), 1)
    if to_gpus % nnodes:
        raise UserInputError(f"to_gpus={to_gpus} cannot be split over nnodes={nnodes} nodes evenly")
    start = _source_gpus(entries, rule_of, nnodes, from_gpus)
    model_name = None
    if model is None:
        model_name, model = named_model(entries)
    ctx = ScaleContext(
        from_gpus=start,
        to_gpus=to_gpus,
        factor=Fraction(to_gpus, start),
        batch=batch,
        n=int_of(find_entry(entries, "rollout.n"), 1),
        sp=int_of(find_entry(entries, "ulysses_sequence_parallel_size"), 1),
        nnodes=nnodes,
        model=model,
        problems=list(extra_problems),
        warnings=list(extra_warnings),
        model_name=model_name,
    )
    new, reasons = _apply_rules(entries, rule_of, ctx, tensor_parallel, devices)
    check_start_up(entries, new, rule_of, ctx)
    kv = kv_check(
        entries,
        new,
        rule_of,
        ctx,
        gpu_memory_bytes=gpu_memory_bytes,
        max_model_len=max_model_len,
        precision=precision,
    )
    steps = tuple(
        ScaleStep(
            e.dotted, rule_of[e.dotted], e.value, new[e.dotted], reasons[e.dotted], path=e.path
        )
        for e in entries
        if e.dotted in rule_of
    )
    for e in entries:
        if e.dotted in new:
            set_value(data, e.path, new[e.dotted])
    result: Any = [f"{k}={override_text(v)}" for k, v in data.items()] if overrides else data
    return ScalePlan(
        from_gpus=start,
        to_gpus=to_gpus,
        steps=steps,
        problems=tuple(ctx.problems),
        warnings=tuple(ctx.warnings),
        kv=kv,
        config=result,
        original=original,
        source=source,
    )


def _engines(world: int, tp: Any) -> int:
    return max(1, world // tp) if isinstance(tp, int) and tp >= 1 else 1


def _scale_engine(
    entry: Entry,
    entries: Sequence[Entry],
    new: Mapping[str, Any],
    rules: Mapping[str, str],
    ctx: ScaleContext,
) -> tuple[Any, str]:
    old = entry.value
    if not isinstance(old, int) or isinstance(old, bool):
        return old, "not a whole number: left as is"
    tp = next((e for e in entries if rules.get(e.dotted) == "tensor_parallel"), None)
    old_engines = _engines(ctx.from_gpus, tp.value if tp else 1)
    new_engines = _engines(ctx.to_gpus, new.get(tp.dotted) if tp else 1)
    train = next((e for e in entries if e.leaf == "train_batch_size"), None)
    if train is not None and isinstance(train.value, int) and train.value > 0:
        batch_factor = Fraction(int(new.get(train.dotted, train.value)), train.value)
    else:
        batch_factor = ctx.factor if ctx.batch == "scale" else Fraction(1)
    factor = batch_factor * Fraction(old_engines, new_engines)
    value = max(1, math.ceil(old * factor))
    engines = f"{new_engines} engine{'s' if new_engines > 1 else ''}"
    before = f"{old_engines} engine{'s' if old_engines > 1 else ''} before"
    if value == old:
        return old, f"per engine: {engines} now, {before}; each serves as many sequences"
    return value, (
        f"per engine: batch × {batch_factor} on {engines} ({before}), so each engine serves "
        f"× {factor} the sequences"
    )


def _devices(old: Any, to_gpus: int, devices: Sequence[int] | None) -> tuple[Any, str]:
    chosen = list(devices[:to_gpus]) if devices is not None else list(range(to_gpus))
    why = (
        "the first usable GPUs of the inventory" if devices is not None else f"GPUs 0-{to_gpus - 1}"
    )
    if isinstance(old, str):
        return ",".join(map(str, chosen)), why
    if isinstance(old, int) and not isinstance(old, bool) and len(chosen) == 1:
        return chosen[0], why
    return chosen, why
