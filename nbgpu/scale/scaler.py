"""``scale_config``: the rules applied to a config for a new GPU count, then checked; its
result, :class:`ScalePlan`. Pure; never reads files (``files.py`` does) nor loads
ruamel.yaml unless YAML is asked for.
"""

import copy
import difflib
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

from nbgpu._render import Blank, Block, Line, Problems, Result, Title
from nbgpu._serial import to_data
from nbgpu.errors import UserInputError
from nbgpu.estimate.formulas import check_count
from nbgpu.estimate.shapes import ModelShape
from nbgpu.problems import Problem
from nbgpu.scale.checks import KvCheck, check_start_up, kv_check
from nbgpu.scale.rules import (
    ScaleContext,
    batch_divisor,
    named_model,
    rules_for,
    scale_allocation,
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
    short_text,
)

__all__ = ["ASSUMED_NODE_GPUS", "ScalePlan", "ScaleStep", "node_layout", "scale_config"]

#: GPUs in a node when nothing says how many: 8-GPU boards (HGX, DGX) are the largest common
#: server. The plan says when it assumed this, and which flags name the real size.
ASSUMED_NODE_GPUS = 8


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
class ScalePlan(Result):
    """A config rescaled from ``from_gpus`` to ``to_gpus`` GPUs: ``config`` as data (a
    mapping, or ``key=value`` overrides), ``steps`` every recognised key, changed or not;
    ``problems`` block, ``warnings`` do not."""

    from_gpus: int
    to_gpus: int
    nodes: int
    steps: tuple[ScaleStep, ...]
    problems: tuple[Problem, ...]
    warnings: tuple[Problem, ...]
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
        from nbgpu.scale.yamldoc import dump_yaml  # noqa: PLC0415  (ruamel: only when asked)

        return dump_yaml(self.config)

    def to_text(self) -> str:
        """The new config in its own form and layout (YAML comments, a script's lines kept)."""
        return self.new_text if self.new_text is not None else self.to_yaml()

    def save(self, path: str | os.PathLike[str]) -> "ScalePlan":
        """Write :meth:`to_text` to *path*; the plan returned says where the file went."""
        from nbgpu.scale.files import write_text  # noqa: PLC0415  (YAML and scripts: heavy)

        write_text(path, self.to_text(), like=self.source)
        return replace(self, written_to=os.fspath(path))

    def to_overrides(self) -> list[str]:
        """The changed keys as Hydra-style ``key=value`` overrides."""
        return [f"{s.key}={override_text(s.new)}" for s in self.changes]

    def diff(self) -> str:
        """A unified diff of the old and the new config, as YAML (or overrides)."""
        if self.original_text is not None and self.new_text is not None:
            old = self.original_text
        else:
            old = replace(self, config=self.original, new_text=None).to_yaml()
        name = self.source or "config"
        lines = difflib.unified_diff(
            old.splitlines(),
            self.to_text().splitlines(),
            f"{name} ({self.from_gpus} GPUs)",
            f"{name} ({self.to_gpus} GPUs)",
            lineterm="",
        )
        return "\n".join(lines) + "\n"

    def content(self) -> list[Block]:
        verdict = "ready" if self.ok else "NOT READY"
        src = f" {self.source}" if self.source else ""
        over = f" ({self.nodes} nodes × {self.to_gpus // self.nodes})" if self.nodes > 1 else ""
        title = f"nbgpu plan scale{src}: {self.from_gpus} → {self.to_gpus} GPUs{over} · {verdict}"
        blocks: list[Block] = [Title(title)]
        for s in self.steps:
            change = f"{s.key}: {short_text(s.old)} → {short_text(s.new)}"
            mark, level = ("* ", "warn") if s.changed else ("  ", "")
            blocks += [Line(change, indent=mark, level=level), Line(s.reason, indent="      ")]
        if self.kv is not None:
            blocks.append(Line(self.kv.text))
        if self.written_to is not None:
            blocks.append(Line(f"new config written to {self.written_to}"))
        every = (*self.problems, *self.warnings)
        return blocks + ([Blank(), Problems(every)] if every else [])

    def records(self) -> list[dict[str, Any]]:
        keys = ("key", "rule", "old", "new", "changed", "reason")
        return [{k: getattr(s, k) for k in keys} for s in self.steps]

    def to_dict(self) -> dict[str, Any]:
        # The file's own text is what to_text() and diff() are for; steps say what changed.
        data: dict[str, Any] = {**to_data(self), "ok": self.ok, "steps": self.records()}
        for text in ("original", "original_text", "new_text"):
            del data[text]
        return data


def node_layout(
    to_gpus: int, nodes: int | None, node_size: tuple[int, str] | None, was: tuple[int, Any]
) -> tuple[int, str]:
    """How many nodes *to_gpus* GPUs take, and why: *nodes* if given (refused when the node
    size is known and too small), else the fewest nodes that split them evenly. *node_size*:
    (GPUs per node, where that was read); *was*: the config's nodes and GPUs per node."""
    if nodes is not None:
        check_count("nodes=", nodes)
        per = to_gpus // nodes
        if to_gpus % nodes:
            raise UserInputError(
                f"nodes={nodes} (--nodes): {to_gpus} GPUs do not split evenly over {nodes} "
                f"nodes; give a multiple of {nodes} GPUs (to_gpus=, --to)"
            )
        if node_size is not None and per > node_size[0]:
            raise UserInputError(
                f"nodes={nodes} (--nodes): {per} GPUs per node, but a node has {node_size[0]} "
                f"({node_size[1]}); {-(-to_gpus // node_size[0])} nodes or more hold {to_gpus}"
            )
        return nodes, f"{nodes} node(s), as asked (nodes=, --nodes)"
    was_nodes, was_per_node = was
    per_node = was_per_node if isinstance(was_per_node, int) and was_per_node > 0 else 1
    if node_size is not None:
        size, where = node_size
    elif was_nodes > 1:
        size, where = per_node, f"as the config's {was_nodes} nodes"
    else:
        size = max(per_node, ASSUMED_NODE_GPUS)
        where = "assumed: --gpus-per-node, --fleet or --slurm name the real size"
    count = next(n for n in range(-(-to_gpus // size), to_gpus + 1) if to_gpus % n == 0)
    return count, f"nodes of {size} GPUs ({where})"


def _source_gpus(
    entries: Sequence[Entry], rule_of: Mapping[str, str], nnodes: int, from_gpus: int | None
) -> int:
    """How many GPUs the config was made for: given, or n_gpus_per_node × nnodes, or CVD."""
    if from_gpus is not None:
        check_count("from_gpus=", from_gpus)
        return from_gpus
    for e in entries:
        if rule_of.get(e.dotted) == "gpu_count" and isinstance(e.value, int) and e.value > 0:
            return e.value * nnodes
    for e in entries:
        count = device_count(e.value) if rule_of.get(e.dotted) == "devices" else None
        if count is not None:
            return count
    raise UserInputError(
        "config does not say how many GPUs it was made for (no n_gpus_per_node or "
        "CUDA_VISIBLE_DEVICES); pass from_gpus=N (--from N)"
    )


# OmegaConf resolves ``${trainer.n_gpus_per_node}`` from the key it names: a value that follows.
_INTERPOLATION = re.compile(r"\$\{[^{}]+\}")
_KEPT = {
    "memory_fraction": (
        "kept: a fraction of each GPU's memory, and each GPU is as big as before; "
        "the KV check says whether it holds the batch"
    ),
    "per_gpu": "per GPU: each GPU still processes this many per step",
    "keep": "kept (rule 'keep')",
}


def _apply_rules(
    ctx: ScaleContext, tensor_parallel: str | int, devices: Sequence[int] | None, why: str
) -> dict[str, str]:
    """Set ``ctx.new`` from the rules; the reason for each key."""
    reasons: dict[str, str] = {}
    by_key = {e.dotted: e for e in ctx.entries}
    layout = f"{ctx.nnodes} node(s): {why}"
    # In this order: the per-engine keys depend on tensor parallel and the global batches.
    moves: dict[str, Callable[[Entry], tuple[Any, str]]] = {
        "tensor_parallel": lambda e: scale_tensor_parallel(e, ctx, tensor_parallel),
        "global_batch": lambda e: scale_global(e, ctx),
        "per_engine": lambda e: _scale_engine(e, ctx),
        "allocation": lambda e: scale_allocation(e, ctx),
        "model_parallel": lambda e: (e.value, _model_split(ctx.group(e.parent), ctx.to_gpus)),
        "gpu_count": lambda _: (ctx.per_node, f"{ctx.to_gpus} GPUs over {layout}"),
        "node_count": lambda _: (ctx.nnodes, f"{ctx.to_gpus} GPUs over {layout}"),
        "devices": lambda e: _devices(e.value, ctx.per_node, devices),
    }
    order = list(moves)
    ranked = sorted(ctx.rules.items(), key=lambda kv: order.index(kv[1]) if kv[1] in order else 9)
    for key, rule in ranked:
        entry = by_key[key]
        if isinstance(entry.value, str) and _INTERPOLATION.fullmatch(entry.value):
            ctx.new[key], reasons[key] = entry.value, f"follows {entry.value}"
        else:
            kept = (entry.value, _KEPT.get(rule, ""))
            ctx.new[key], reasons[key] = moves[rule](entry) if rule in moves else kept
    if ctx.batch == "scale":
        _train_covers_minis(ctx, reasons)
    return reasons


def _train_covers_minis(ctx: ScaleContext, reasons: dict[str, str]) -> None:
    """Raise train_batch_size when a mini batch had to grow past it (verl: train >= mini)."""
    new = ctx.new
    train = find_entry(ctx.entries, "train_batch_size")
    if train is None or not isinstance(new.get(train.dotted), int):
        return
    minis = [
        new[e.dotted]
        for e in ctx.entries
        if e.leaf == "ppo_mini_batch_size" and isinstance(new.get(e.dotted), int)
    ]
    largest = max(minis, default=0)
    if largest <= new[train.dotted]:
        return
    step = batch_divisor(train, ctx)
    # A multiple of both: valid for the GPUs, and whole mini batches per step.
    value = new[train.dotted] = math.lcm(step, largest)
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
    nodes: int | None = None,
    node_size: tuple[int, str] | None = None,
) -> ScalePlan:
    """Rescale *config* (a mapping, or ``key=value`` overrides) to *to_gpus* GPUs, over
    *nodes* nodes or as many as :func:`node_layout` says (*node_size*: GPUs per node and where
    that was read)."""
    original: Any
    if isinstance(config, Mapping):
        original = copy.deepcopy(dict(config))
    elif not isinstance(config, str) and all(isinstance(c, str) for c in config):
        original = list(config)
    else:
        raise UserInputError(
            "config: expected a dict, a YAML/JSON file path, or a list of key=value overrides"
        )
    overrides = isinstance(original, list)
    data: dict[str, Any] = parse_overrides(original) if overrides else copy.deepcopy(original)
    check_count("to_gpus=", to_gpus)
    if batch not in ("scale", "keep"):
        raise UserInputError(f"batch={batch!r}: expected 'scale' or 'keep'")
    tp = tensor_parallel
    if tp not in ("keep", "scale") and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
        raise UserInputError(
            f"tensor_parallel={tp!r} (--tp): expected 'keep', 'scale' or a whole number >= 1"
        )
    entries = entries_of(data)
    if not entries:
        raise UserInputError("config is empty; expected a verl/VAGEN-style config")
    rule_of = rules_for(entries, rules or {})
    if not rule_of:
        raise UserInputError(
            "config has none of the keys nbgpu scales (train_batch_size, ppo_mini_batch_size, "
            "tensor_model_parallel_size, n_gpus_per_node, ...); name yours with rules= (--rule KEY=RULE)"
        )
    ruled = {rule: e for e in reversed(entries) if (rule := rule_of.get(e.dotted))}
    was_nodes = int_of(ruled.get("node_count"), 1)
    start = _source_gpus(entries, rule_of, was_nodes, from_gpus)
    per_node = ruled["gpu_count"].value if "gpu_count" in ruled else None
    nnodes, why = node_layout(to_gpus, nodes, node_size, (was_nodes, per_node))
    add_nodes = nnodes != was_nodes and "node_count" not in ruled
    if add_nodes and "gpu_count" in ruled:
        entries = _with_node_count(entries, rule_of, ruled["gpu_count"])
    model_name, model = named_model(entries) if model is None else (None, model)
    ctx = ScaleContext(
        entries=entries,
        rules=rule_of,
        from_gpus=start,
        to_gpus=to_gpus,
        factor=Fraction(to_gpus, start),
        batch=batch,
        n=int_of(find_entry(entries, "rollout.n"), 1),
        sp=int_of(find_entry(entries, "ulysses_sequence_parallel_size"), 1),
        nnodes=nnodes,
        model=model,
        model_name=model_name,
    )
    if add_nodes and "gpu_count" not in ruled:
        ctx.warn(
            "nodes",
            "nodes",
            f"the config names no node count: start it on {nnodes} nodes with your "
            "launcher (torchrun --nnodes, srun --nodes)",
        )
    reasons = _apply_rules(ctx, tensor_parallel, devices, why)
    check_start_up(ctx)
    kv = kv_check(
        ctx, gpu_memory_bytes=gpu_memory_bytes, max_model_len=max_model_len, precision=precision
    )
    new = ctx.new
    steps = tuple(
        ScaleStep(e.dotted, rule_of[e.dotted], e.value, new[e.dotted], reasons[e.dotted], e.path)
        for e in entries
        if e.dotted in rule_of
    )
    for step in steps:
        set_value(data, step.path, step.new)
    result: Any = [f"{k}={override_text(v)}" for k, v in data.items()] if overrides else data
    problems, warnings = tuple(ctx.problems), tuple(ctx.warnings)
    return ScalePlan(
        start, to_gpus, nnodes, steps, problems, warnings, kv, result, original, source=source
    )


def _with_node_count(entries: list[Entry], rule_of: dict[str, str], per_node: Entry) -> list[Entry]:
    """The entries with the node count the config leaves at its default (verl's 1), beside
    its GPUs-per-node key."""
    dotted = f"{per_node.parent}.nnodes".lstrip(".")
    flat = len(per_node.path) == 1  # overrides and scripts: one dotted key
    rule_of[dotted] = "node_count"
    return [*entries, Entry((dotted,) if flat else (*per_node.path[:-1], "nnodes"), dotted, 1)]


def _model_split(group: int, world: int) -> str:
    copies = f"{world // group} data-parallel copies" if world % group == 0 else "see below"
    return f"kept: Megatron splits the model over {group} GPUs (TP × PP × CP); {copies}"


def _engines(world: int, tp: Any) -> int:
    return max(1, world // tp) if isinstance(tp, int) and tp >= 1 else 1


def _scale_engine(entry: Entry, ctx: ScaleContext) -> tuple[Any, str]:
    old = entry.value
    if not isinstance(old, int) or isinstance(old, bool):
        return old, "not a whole number: left as is"
    # The engine's own tensor parallel (rollout.*), not another model's of the same name.
    tp = find_entry(ctx.entries, f"{entry.parent}.tensor_model_parallel_size")
    tp = tp if tp is not None and ctx.rules.get(tp.dotted) == "tensor_parallel" else None
    tp = tp or ctx.ruled("tensor_parallel")
    old_engines = _engines(ctx.from_gpus, tp.value if tp else 1)
    new_engines = _engines(ctx.to_gpus, ctx.new.get(tp.dotted) if tp else 1)
    train = find_entry(ctx.entries, "train_batch_size")
    if train is not None and isinstance(train.value, int) and train.value > 0:
        batch_factor = Fraction(int(ctx.now(train)), train.value)
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
    chosen = list(range(to_gpus)) if devices is None else list(devices[:to_gpus])
    why = f"GPUs 0-{to_gpus - 1}" if devices is None else "the first usable GPUs of the inventory"
    if isinstance(old, str):
        return ",".join(map(str, chosen)), why
    if isinstance(old, int) and not isinstance(old, bool) and len(chosen) == 1:
        return chosen[0], why
    return chosen, why
