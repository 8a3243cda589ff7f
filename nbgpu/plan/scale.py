"""Scaling a training config from N GPUs to M: every change explained, combinations checked.

Moving a 2-GPU verl/VAGEN config to 4 GPUs by hand means editing a dozen coupled values;
:func:`scale_config` does it from rules. Each recognised key has a *rule* (keys are matched
by their last name anywhere in the config, so nested YAML, flat ``a.b.c`` keys and Hydra
overrides all work):

=================  ============================================  ===============================
rule               meaning                                       verl / VAGEN keys
=================  ============================================  ===============================
``global_batch``   scaled with the GPU count (``batch="scale"``,  ``train_batch_size``,
                   per-GPU work constant) or kept (``"keep"``);   ``ppo_mini_batch_size``,
                   then moved to the nearest valid value          ``ppo_micro_batch_size``,
                                                                  ``log_prob_micro_batch_size``
``per_gpu``        per GPU: unchanged                            ``*_micro_batch_size_per_gpu``
``tensor_parallel``  kept (default), scaled, or set              ``tensor_model_parallel_size``
``per_engine``     scaled with the sequences each inference      ``max_num_seqs``,
                   engine serves (batch ÷ engines)               ``max_num_batched_tokens``
``memory_fraction``  kept: a fraction of each GPU's memory,      ``gpu_memory_utilization``
                   whose size does not change; KV-checked
``gpu_count``      GPUs per node: target ÷ ``nnodes``            ``n_gpus_per_node``
``devices``        the target GPUs (list or "0,1,2,3")            ``CUDA_VISIBLE_DEVICES``
``keep``           left as is                                    (for your own keys)
=================  ============================================  ===============================

Valid means what verl checks at start: ``train_batch_size × rollout.n`` divisible by the
GPU count; ``ppo_mini_batch_size × n ÷ (GPUs ÷ ulysses_sp)`` ≥ 1 and divisible by the micro
batch per GPU; mini ≤ train batch; the rollout world divisible by the tensor-parallel size
(and the attention heads too, as vLLM requires); ``max_num_batched_tokens`` ≥
``max_num_seqs`` and ≥ the maximum model length. With a model and a GPU size, the KV cache
each GPU can hold is checked with ``reference/memory.md`` §5c's formula.

Pure: works on plain data; never reads files (``files.py`` does) nor imports the inventory,
sockets or processes. The rescaled text of a file in its own layout (YAML, JSON or launch
script) is ``configfile.py``'s.
"""

from __future__ import annotations

import copy
import difflib
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from html import escape
from typing import Any

from nbgpu._render import Result, Table, fmt_bytes, wrap
from nbgpu.errors import UserInputError
from nbgpu.plan.memory import (
    PRECISIONS,
    ModelShape,
    kv_bytes_per_token,
    model_shape,
    normalize_precision,
    weight_bytes,
)
from nbgpu.plan.models import find_model
from nbgpu.plan.result import Issue, notes_html, notes_text
from nbgpu.plan.yamldoc import dump_yaml

__all__ = [
    "KV_RESERVE_BYTES",
    "RULES",
    "KvCheck",
    "ScalePlan",
    "ScaleStep",
    "builtin_shape",
    "parse_overrides",
    "parse_value",
    "scale_config",
    "value_text",
]

GIB = 1024**3
#: Per-GPU bytes inside the engine's memory fraction that are neither weights nor KV cache:
#: the profile run's activations, CUDA graphs and non-torch allocations such as NCCL
#: (memory.md §5c/§5d). A planning heuristic, stated in every KV check.
KV_RESERVE_BYTES = 1 * GIB

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


@dataclass(frozen=True)
class ScaleStep:
    """One recognised key: its value before and after, the rule, and why."""

    key: str  # dotted path, e.g. "actor_rollout_ref.rollout.tensor_model_parallel_size"
    rule: str
    old: Any
    new: Any
    reason: str
    path: tuple[Any, ...] = field(default=(), compare=False, repr=False)  # keys into the config

    @property
    def changed(self) -> bool:
        return bool(self.old != self.new)


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


@dataclass(frozen=True)
class ScalePlan(Result):
    """A config rescaled from ``from_gpus`` to ``to_gpus`` GPUs.

    ``config`` is the new config as data (a nested mapping, or a list of ``key=value``
    overrides); ``to_text()`` is the new file in its own form and layout (a YAML file keeps
    its comments, a launch script its lines), ``diff()`` compares it with the old one;
    ``steps`` explains every recognised key, changed or not; ``problems`` block, ``warnings``
    do not.
    """

    from_gpus: int
    to_gpus: int
    steps: tuple[ScaleStep, ...]
    problems: tuple[Issue, ...]
    warnings: tuple[Issue, ...]
    kv: KvCheck | None
    config: Any = field(compare=False)
    original: Any = field(compare=False)
    source: str | None = None  # the file it was read from
    form: str = "mapping"  # "mapping" | "overrides" | "yaml" | "json" | "script"
    original_text: str | None = field(default=None, compare=False, repr=False)
    new_text: str | None = field(default=None, compare=False, repr=False)
    written_to: str | None = None  # where save() wrote the new config

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def changes(self) -> tuple[ScaleStep, ...]:
        return tuple(s for s in self.steps if s.changed)

    def to_yaml(self) -> str:
        """The new config as YAML (for a list of overrides: one ``key=value`` per line)."""
        if self.form == "yaml" and self.new_text is not None:
            return self.new_text
        if isinstance(self.config, list):
            return "\n".join(self.config) + "\n"
        return dump_yaml(self.config)

    def to_text(self) -> str:
        """The new config in the form it came in: the file's own text, changed values only."""
        return self.new_text if self.new_text is not None else self.to_yaml()

    def save(self, path: str | os.PathLike[str]) -> ScalePlan:
        """Write :meth:`to_text` to *path* (e.g. ``run_8gpu.sh`` next to ``run.sh``).

        Returns the plan with ``written_to`` set, so its text says where the file went.
        """
        from nbgpu.plan.files import write_text  # noqa: PLC0415  (the one module doing I/O)

        write_text(path, self.to_text(), like=self.source)
        return replace(self, written_to=os.fspath(path))

    def to_overrides(self) -> list[str]:
        """The changed keys as Hydra-style ``key=value`` overrides."""
        return [f"{s.key}={_override_value(s.new)}" for s in self.changes]

    def diff(self) -> str:
        """A unified diff of the old and the new config, as YAML (or overrides)."""
        if self.original_text is not None and self.new_text is not None:
            old, new = self.original_text.splitlines(), self.new_text.splitlines()
        elif isinstance(self.config, list):
            old, new = self.original, self.config
        else:
            old = dump_yaml(self.original).splitlines()
            new = dump_yaml(self.config).splitlines()
        lines = difflib.unified_diff(
            old,
            new,
            fromfile=f"{self.source or 'config'} ({self.from_gpus} GPUs)",
            tofile=f"{self.source or 'config'} ({self.to_gpus} GPUs)",
            lineterm="",
        )
        return "\n".join(lines) + "\n"

    def _title(self) -> str:
        verdict = "ready" if self.ok else "NOT READY"
        src = f" {self.source}" if self.source else ""
        return f"nbgpu plan scale{src}: {self.from_gpus} → {self.to_gpus} GPUs · {verdict}"

    def _table(self) -> Table:
        table = Table(["key", "old", "new", "why"])
        for s in self.steps:
            table.add(
                s.key.rsplit(".", 1)[-1],
                _short(s.old),
                _short(s.new),
                s.reason,
                level="warn" if s.changed else "",
            )
        return table

    def text(self) -> str:
        lines = [self._title()]
        for s in self.steps:
            mark = "*" if s.changed else " "
            lines.append(wrap(f"{s.key}: {_short(s.old)} → {_short(s.new)}", f"{mark} "))
            lines.append(wrap(s.reason, "      "))
        if self.kv is not None:
            lines.append(wrap(self.kv.text, ""))
        if self.written_to is not None:
            lines.append(wrap(f"new config written to {self.written_to}", ""))
        notes = notes_text(self.problems, self.warnings)
        if notes:
            lines.append("")
            lines.extend(notes)
        return "\n".join(lines)

    def html_body(self) -> str:
        parts = [f"<b>{escape(self._title())}</b>", self._table().html()]
        if self.kv is not None:
            parts.append(f"<div>{escape(self.kv.text)}</div>")
        if self.written_to is not None:
            parts.append(f"<div>new config written to <code>{escape(self.written_to)}</code></div>")
        parts.append(notes_html(self.problems, self.warnings))
        parts.append(f"<pre>{escape(self.diff())}</pre>")
        return "".join(parts)

    def records(self) -> list[dict[str, Any]]:
        return [
            {
                "key": s.key,
                "rule": s.rule,
                "old": s.old,
                "new": s.new,
                "changed": s.changed,
                "reason": s.reason,
            }
            for s in self.steps
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "from_gpus": self.from_gpus,
            "to_gpus": self.to_gpus,
            "ok": self.ok,
            "source": self.source,
            "form": self.form,
            "written_to": self.written_to,
            "steps": self.records(),
            "problems": [p.__dict__ for p in self.problems],
            "warnings": [w.__dict__ for w in self.warnings],
            "kv": None
            if self.kv is None
            else {
                **self.kv.__dict__,
                "budget_bytes": self.kv.budget_bytes,
                "capacity_tokens": self.kv.capacity_tokens,
            },
            "config": self.config,
        }


def value_text(value: Any) -> str:
    """A value as written in a config or a command line: ``4``, ``0.34``, ``true``, ``[0,1]``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ",".join(value_text(v) for v in value) + "]"
    return str(value)


def _short(value: Any) -> str:
    text = value_text(value).replace(",", ", ") if isinstance(value, list | tuple) else None
    text = text or value_text(value)
    return text if len(text) <= 24 else text[:23] + "…"


# Hydra reads a bare comma as a sweep (a=1,2) and these characters as its grammar.
_HYDRA_SPECIAL = re.compile(r"[,\s'\"\\()\[\]{}:=]")


def _override_value(value: Any) -> str:
    if isinstance(value, str) and _HYDRA_SPECIAL.search(value):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return value_text(value)


# ---------------------------------------------------------------------- config access


@dataclass(frozen=True)
class _Entry:
    path: tuple[Any, ...]  # keys into the nested structure
    dotted: str  # "a.b.c" without Hydra's +/~ prefixes
    value: Any

    @property
    def leaf(self) -> str:
        return self.dotted.rsplit(".", 1)[-1]

    @property
    def parent(self) -> str:
        return self.dotted.rpartition(".")[0]


def _entries(config: Mapping[str, Any]) -> list[_Entry]:
    out: list[_Entry] = []

    def walk(node: Mapping[str, Any], path: tuple[Any, ...]) -> None:
        for key, value in node.items():
            here = (*path, key)
            if isinstance(value, Mapping) and value:
                walk(value, here)
            else:
                dotted = ".".join(str(k).lstrip("+~") for k in here)
                out.append(_Entry(here, dotted, value))

    walk(config, ())
    return out


def _set(config: Any, path: tuple[Any, ...], value: Any) -> None:
    node = config
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def parse_value(text: str) -> Any:
    """An override or shell value typed as YAML would type it (``4`` → int, ``0.3`` → float)."""
    raw = text.strip()
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
        return raw[1:-1]
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("null", "none", "~"):
        return None
    if re.fullmatch(r"[-+]?\d+", raw):
        return int(raw)
    if re.fullmatch(r"[-+]?(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?", raw):
        return float(raw)
    if raw.startswith("[") and raw.endswith("]"):
        return [parse_value(v) for v in raw[1:-1].split(",") if v.strip()]
    return raw


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """Hydra-style ``key.path=value`` strings → a flat dict (values typed like YAML)."""
    out: dict[str, Any] = {}
    for item in overrides:
        key, sep, value = str(item).partition("=")
        if not sep or not key.strip():
            raise UserInputError(
                f"override {item!r}: expected key=value such as data.train_batch_size=4"
            )
        out[key.strip()] = parse_value(value)
    return out


def _find(entries: Sequence[_Entry], suffix: str) -> _Entry | None:
    for e in entries:
        if e.dotted == suffix or e.dotted.endswith("." + suffix):
            return e
    return None


def _int_of(entry: _Entry | None, default: int) -> int:
    if entry is None:
        return default
    value = entry.value
    return (
        value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default
    )


def _device_count(value: Any) -> int | None:
    if isinstance(value, str):
        return len([v for v in value.split(",") if v.strip()]) or None
    if isinstance(value, list | tuple):
        return len(value) or None
    if isinstance(value, int) and not isinstance(value, bool):
        return 1
    return None


# ------------------------------------------------------------------------ the rules


def _rules_for(entries: Sequence[_Entry], rules: Mapping[str, str]) -> dict[str, str]:
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
class _Context:
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


def _batch_divisor(entry: _Entry, entries: Sequence[_Entry], ctx: _Context, world: int) -> int:
    """The step every valid value of this global-batch key is a multiple of (verl's rules)."""
    dp = max(1, world // ctx.sp)
    if entry.leaf == "ppo_mini_batch_size":
        micro = _int_of(_find(entries, f"{entry.parent}.ppo_micro_batch_size_per_gpu"), 1)
        need = dp * micro
    elif entry.leaf == "train_batch_size":
        need = world
    else:
        need = dp
    # value × n must be a multiple of need.
    return need // math.gcd(need, ctx.n)


def _scale_global(entry: _Entry, entries: Sequence[_Entry], ctx: _Context) -> tuple[Any, str]:
    old = entry.value
    if not isinstance(old, int) or isinstance(old, bool):
        return old, "not a whole number: left as is"
    step = _batch_divisor(entry, entries, ctx, ctx.to_gpus)
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


def _scale_tp(entry: _Entry, ctx: _Context, policy: str | int) -> tuple[Any, str]:
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


def _check(
    entries: Sequence[_Entry], new: Mapping[str, Any], rules: Mapping[str, str], ctx: _Context
) -> None:
    """verl's and vLLM's start-up checks on the new values."""
    world = ctx.to_gpus
    dp = max(1, world // ctx.sp)

    def value(e: _Entry) -> Any:
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
        micro_entry = _find(entries, f"{e.parent}.ppo_micro_batch_size_per_gpu")
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
        seqs_entry = _find(entries, f"{e.parent}.max_num_seqs")
        seqs = value(seqs_entry) if seqs_entry is not None else None
        if isinstance(seqs, int) and tokens < seqs:
            ctx.problems.append(
                Issue(
                    "engine",
                    f"{e.dotted} {tokens} < max_num_seqs {seqs} (vLLM requires "
                    "max_num_batched_tokens >= max_num_seqs)",
                )
            )
        model_len = _model_len(entries, value)
        if model_len is not None and tokens < model_len:
            ctx.problems.append(
                Issue(
                    "engine",
                    f"{e.dotted} {tokens} < the maximum model length {model_len} (prompt + "
                    "response): verl refuses it with chunked prefill, vLLM without",
                    (f"max_num_batched_tokens={model_len}",),
                )
            )


def _model_len(entries: Sequence[_Entry], value: Any) -> int | None:
    explicit = _find(entries, "max_model_len")
    if explicit is not None and isinstance(value(explicit), int):
        return int(value(explicit))
    for prompt_key, response_key in (
        ("max_prompt_length", "max_response_length"),
        ("prompt_length", "response_length"),
    ):
        p, r = _find(entries, prompt_key), _find(entries, response_key)
        if p is not None and r is not None:
            pv, rv = value(p), value(r)
            if isinstance(pv, int) and isinstance(rv, int):
                return pv + rv
    return None


def _kv_check(
    entries: Sequence[_Entry],
    new: Mapping[str, Any],
    rules: Mapping[str, str],
    ctx: _Context,
    *,
    gpu_memory_bytes: int | None,
    max_model_len: int | None,
    precision: str | None,
) -> KvCheck | None:
    def value(e: _Entry) -> Any:
        return new.get(e.dotted, e.value)

    fraction_entry = next((e for e in entries if rules.get(e.dotted) == "memory_fraction"), None)
    if fraction_entry is not None and ctx.model is None and ctx.model_name is not None:
        ctx.warnings.append(
            Issue(
                "kv_unchecked",
                f"KV cache not checked: the config's model {ctx.model_name!r} is not among "
                "nbgpu's built-in model shapes; pass model= its config.json (path or dict)",
            )
        )
        return None
    if fraction_entry is None or ctx.model is None or not ctx.model.has_kv_shape:
        if fraction_entry is not None:
            ctx.warnings.append(
                Issue(
                    "kv_unchecked",
                    "KV cache not checked: pass model= as an HF config dict (layers, KV heads, "
                    "head_dim) and a GPU size (inventory= or gpu_memory_bytes=)",
                )
            )
        return None
    if gpu_memory_bytes is None:
        ctx.warnings.append(
            Issue(
                "kv_unchecked",
                "KV cache not checked: pass inventory= or gpu_memory_bytes= for the GPU size",
            )
        )
        return None
    fraction = value(fraction_entry)
    if not isinstance(fraction, int | float) or not 0 < fraction <= 1:
        return None
    tp_entry = next((e for e in entries if rules.get(e.dotted) == "tensor_parallel"), None)
    tp = value(tp_entry) if tp_entry is not None and isinstance(value(tp_entry), int) else 1
    seqs_entry = _find(entries, "max_num_seqs")
    seqs = value(seqs_entry) if seqs_entry is not None else None
    model_len = max_model_len or _model_len(entries, value)
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
            Issue(
                "kv_cache",
                f"{key} {fraction} of {fmt_bytes(gpu_memory_bytes)} holds the weights "
                f"({fmt_bytes(check.weights_bytes)}) and the reserve but no KV cache",
                (f"{key.rsplit('.', 1)[-1]}={need}",),
            )
        )
    elif model_len is not None and check.capacity_tokens < model_len:
        ctx.problems.append(
            Issue(
                "kv_cache",
                f"the KV cache holds {check.capacity_tokens:,} tokens per GPU, less than one "
                f"sequence of {model_len:,}: the engine refuses to start",
                (f"{key.rsplit('.', 1)[-1]}={check.fraction_for(model_len)}",),
            )
        )
    elif check.needed_tokens is not None and check.capacity_tokens < check.needed_tokens:
        full = check.capacity_tokens // (model_len or 1)
        ctx.warnings.append(
            Issue(
                "kv_cache",
                f"the KV cache holds {check.capacity_tokens:,} tokens = {full} full-length "
                f"sequences, fewer than max_num_seqs {check.max_num_seqs}: the engine will "
                "queue or preempt sequences",
                (f"{key.rsplit('.', 1)[-1]}={check.fraction_for(check.needed_tokens)}",),
            )
        )
    return check


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
    entries: Sequence[_Entry], rule_of: Mapping[str, str], nnodes: int, from_gpus: int | None
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
            count = _device_count(e.value)
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
    entries: Sequence[_Entry],
    rule_of: Mapping[str, str],
    ctx: _Context,
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
            new[key], reasons[key] = _scale_global(entry, entries, ctx)
        elif rule == "tensor_parallel":
            new[key], reasons[key] = _scale_tp(entry, ctx, tensor_parallel)
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
    entries: Sequence[_Entry], new: dict[str, Any], reasons: dict[str, str], ctx: _Context
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
    step = _batch_divisor(train, entries, ctx, ctx.to_gpus)
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
    extra_problems: Sequence[Issue] = (),
    extra_warnings: Sequence[Issue] = (),
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
    entries = _entries(data)
    if not entries:
        raise UserInputError("config is empty; expected a verl/VAGEN-style config")
    rule_of = _rules_for(entries, rules or {})
    if not rule_of:
        raise UserInputError(
            "config has none of the keys nbgpu scales (train_batch_size, ppo_mini_batch_size, "
            "tensor_model_parallel_size, n_gpus_per_node, ...); name yours with rules="
        )
    nnodes = _int_of(_find(entries, "nnodes"), 1)
    if to_gpus % nnodes:
        raise UserInputError(f"to_gpus={to_gpus} cannot be split over nnodes={nnodes} nodes evenly")
    start = _source_gpus(entries, rule_of, nnodes, from_gpus)
    model_name = None
    if model is None:
        model_name, model = _named_model(entries)
    ctx = _Context(
        from_gpus=start,
        to_gpus=to_gpus,
        factor=Fraction(to_gpus, start),
        batch=batch,
        n=_int_of(_find(entries, "rollout.n"), 1),
        sp=_int_of(_find(entries, "ulysses_sequence_parallel_size"), 1),
        nnodes=nnodes,
        model=model,
        problems=list(extra_problems),
        warnings=list(extra_warnings),
        model_name=model_name,
    )
    new, reasons = _apply_rules(entries, rule_of, ctx, tensor_parallel, devices)
    _check(entries, new, rule_of, ctx)
    kv = _kv_check(
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
            _set(data, e.path, new[e.dotted])
    result: Any = [f"{k}={_override_value(v)}" for k, v in data.items()] if overrides else data
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


# Keys that name the model a config trains and serves (verl, VAGEN, EasyR1, TRL).
_MODEL_KEYS = ("model.path", "model_path", "model_name_or_path", "pretrained_model_name_or_path")


def builtin_shape(name: str) -> ModelShape | None:
    """A model's shape from nbgpu's built-in table, by HF repo name or a local copy's folder."""
    found = find_model(name.strip()) or find_model(name.strip().rstrip("/").rsplit("/", 1)[-1])
    if found is None:
        return None
    return replace(model_shape(found.to_hf_dict()), source=f"{found.name}, built-in shape")


def _named_model(entries: Sequence[_Entry]) -> tuple[str | None, ModelShape | None]:
    """The model the config names (``actor_rollout_ref.model.path``...), and its shape."""
    for e in entries:
        named = any(e.dotted == k or e.dotted.endswith("." + k) for k in _MODEL_KEYS)
        if named and isinstance(e.value, str) and e.value.strip():
            return e.value, builtin_shape(e.value)
    return None, None


def _engines(world: int, tp: Any) -> int:
    return max(1, world // tp) if isinstance(tp, int) and tp >= 1 else 1


def _scale_engine(
    entry: _Entry,
    entries: Sequence[_Entry],
    new: Mapping[str, Any],
    rules: Mapping[str, str],
    ctx: _Context,
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
