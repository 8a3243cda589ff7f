"""The job a plan is made for, validated once with one-line errors, and its batch arithmetic.

Every user-facing value is checked here and becomes a frozen :class:`Job`; the planner never
sees raw input (values that need an inventory, such as a GPU index, it checks). **Batches**
follow llm-analysis (``reference/memory.md`` §6): ``global = micro × accum × dp``; the micro
batch is the largest divisor of ``global / dp`` allowed, the rest is accumulation.
``divisors`` divide the global batch (AReaL's GRPO ``group_size``), ``step_divisors`` divide
``dp × micro``, the samples of one step (TRL's GRPO ``num_generations``). An invalid batch
gets the reason and the nearest valid values below and above, with their splits: batch 8 on
3 trainers → 6 or 9. Pure: never imports the inventory, sockets or files.
"""

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from nbgpu.errors import UserInputError
from nbgpu.estimate.formulas import OPTIMIZERS, STRATEGIES, choose, normalize_precision
from nbgpu.estimate.shapes import ModelShape, model_shape
from nbgpu.plan.allocation import Allocation, parse_allocation

__all__ = ["DEFAULT_BASE_PORT", "MAX_PORT", "BatchCheck", "BatchOption", "Job", "JobRequest",
           "Split", "check_batch", "check_job_batch", "make_job", "nearest_batch", "parse_gpu_list",
           "splits_for", "whole_number"]  # fmt: skip

#: torchrun's own default MASTER_PORT; plans count up from it.
DEFAULT_BASE_PORT = 29500
MAX_PORT = 65535
# How many splits a result lists; more is noise (they are all divisors of global/dp).
MAX_SPLITS = 4

GpuList = Sequence[int] | str | int | None
Divisors = Mapping[str, int] | Sequence[int] | str | None


@dataclass(frozen=True)
class Job:
    """What the user asked for, validated; the planner's only input besides the GPUs."""

    allocation: Allocation | None  # None: one trainer on num_gpus / require / every usable GPU
    num_gpus: int | None = None
    require: tuple[int, ...] = ()
    exclude: tuple[int, ...] = ()
    global_batch: int | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    max_micro_batch: int | None = None
    divisors: tuple[tuple[str, int], ...] = ()
    step_divisors: tuple[tuple[str, int], ...] = ()
    model: ModelShape | None = None
    precision: str = "bf16"
    strategy: str = "ddp"
    optimizer: str = "adamw"
    base_port: int = DEFAULT_BASE_PORT
    name: str | None = None
    seq_len: int | None = None  # tokens per sample: activations, logits and KV cache
    activation_checkpointing: bool = False
    max_micro_auto: bool = False  # max_micro_batch="auto": the largest that fits, computed


def whole_number(label: str, value: Any, most: int | None = None) -> Any:
    """*value* if it is None or a whole number >= 1 (and <= *most*); else one line naming it."""
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= (most or value)
    ):
        upto = f" and <= {most}" if most else ""
        raise UserInputError(f"{label}={value!r}: expected a whole number >= 1{upto}")
    return value


def parse_gpu_list(value: GpuList, label: str) -> tuple[int, ...]:
    """``"1,2,3"`` or ``[1, 2, 3]`` → ``(1, 2, 3)``; order kept, repeats rejected."""
    if value is None:
        return ()
    form = f"expected GPU indices such as {label}=1,2,3"
    if isinstance(value, str):
        items: list[Any] = [v.strip() for v in value.split(",") if v.strip()]
        if not all(v.isdigit() for v in items):
            raise UserInputError(f"{label}={value!r}: {form}")
        items = [int(v) for v in items]
    else:  # a bool lands in [value] too and is refused below
        items = [value] if isinstance(value, int) else list(value)
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise UserInputError(f"{label}={value!r}: {item!r} is not a GPU index; {form}")
    if len(set(items)) != len(items):
        raise UserInputError(f"{label}={value!r} names a GPU twice; {form}")
    return tuple(items)


def _parse_divisors(value: Divisors, label: str) -> tuple[tuple[str, int], ...]:
    """``{"num_generations": 8}``, ``[8]`` or ``"num_generations=8,4"`` → named pairs."""
    if value is None:
        return ()
    form = f"expected {label} such as {{'num_generations': 8}} or 'num_generations=8'"
    pairs: list[tuple[str, Any]] = []
    if isinstance(value, str):
        for n, item in enumerate(v.strip() for v in value.split(",") if v.strip()):
            name, sep, number = item.rpartition("=")
            pairs.append((name.strip() if sep else f"divisor{n + 1}", number.strip()))
        try:
            pairs = [(n, int(v)) for n, v in pairs]
        except ValueError:
            raise UserInputError(f"{label}={value!r}: {form}") from None
    elif isinstance(value, Mapping):
        pairs = [(str(k), v) for k, v in value.items()]
    else:
        pairs = [(f"divisor{n + 1}", v) for n, v in enumerate(value)]
    for name, number in pairs:
        if isinstance(number, bool) or not isinstance(number, int) or number < 1:
            raise UserInputError(f"{label}: {name}={number!r} is not a whole number >= 1; {form}")
    return tuple(pairs)


@dataclass(frozen=True)
class JobRequest:
    """The one declaration of the job keywords ``nbgpu.plan()``, ``.sweep()``, ``nbgpu plan``
    and ``%gpu_plan`` take, unchecked (:func:`make_job` checks them)."""

    allocation: str | None = None
    num_gpus: int | None = None
    require: GpuList = None
    exclude: GpuList = None
    global_batch: int | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    max_micro_batch: int | str | None = None
    divisors: Divisors = None
    step_divisors: Divisors = None
    model: Any = None
    precision: str = "bf16"
    strategy: str = "ddp"
    optimizer: str = "adamw"
    base_port: int = DEFAULT_BASE_PORT
    name: str | None = None
    seq_len: int | None = None
    activation_checkpointing: bool = False


def make_job(request: JobRequest) -> Job:
    r = request
    parsed = None if r.allocation is None else parse_allocation(r.allocation)
    num_gpus = whole_number("num_gpus", r.num_gpus)
    if parsed is not None and num_gpus is not None and parsed.gpu_count != num_gpus:
        raise UserInputError(
            f"allocation {r.allocation!r} uses {parsed.gpu_count} GPUs "
            f"({' + '.join(role.degrees for role in parsed.roles)}) but num_gpus={num_gpus}; "
            "the world sizes d × t × p × c of the parts must add up to the GPU count "
            "(colocated parts add none)"
        )
    required = parse_gpu_list(r.require, "require")
    excluded = parse_gpu_list(r.exclude, "exclude")
    both = sorted(set(required) & set(excluded))
    if both:
        raise UserInputError(
            f"GPU {','.join(map(str, both))} is both required and excluded; name it in one only"
        )
    total = parsed.gpu_count if parsed is not None else num_gpus
    if total is not None and len(required) > total:
        raise UserInputError(
            f"require={','.join(map(str, required))} lists {len(required)} GPUs but the job "
            f"uses {total}; the degrees must multiply to the GPU count"
        )
    max_micro = r.max_micro_batch
    auto = isinstance(max_micro, str) and max_micro.strip().lower() == "auto"
    if isinstance(max_micro, str) and not auto:
        if not max_micro.strip().isdigit():
            raise UserInputError(
                f"max_micro_batch={max_micro!r}: expected a whole number >= 1 or 'auto'"
            )
        max_micro = int(max_micro)
    if auto and (r.model is None or r.seq_len is None):
        raise UserInputError(
            "max_micro_batch='auto' (--max-micro auto) needs model= (--model: a name such as "
            "'Qwen/Qwen2.5-7B-Instruct' or an HF config.json) and seq_len= (--seq-len) to compute "
            "what fits"
        )
    for label in ("global_batch", "micro_batch", "grad_accum", "seq_len"):
        whole_number(label, getattr(r, label))
    max_micro = whole_number("max_micro_batch", None if auto else max_micro)
    if not 1 <= r.base_port <= MAX_PORT or isinstance(r.base_port, bool):
        raise UserInputError(f"base_port={r.base_port!r}: expected a TCP port 1..{MAX_PORT}")
    checked = {
        "allocation": parsed,
        "require": required,
        "exclude": excluded,
        "max_micro_batch": max_micro,
        "divisors": _parse_divisors(r.divisors, "divisors"),
        "step_divisors": _parse_divisors(r.step_divisors, "step_divisors"),
        "model": None if r.model is None else model_shape(r.model),
        "precision": normalize_precision(r.precision),
        "strategy": choose("strategy", r.strategy, STRATEGIES),
        "optimizer": choose("optimizer", r.optimizer, OPTIMIZERS),
        "activation_checkpointing": bool(r.activation_checkpointing),
    }
    # The other keywords (batch sizes, port, name, seq_len) are kept as given, checked.
    return Job(**{**vars(r), **checked}, max_micro_auto=auto)


@dataclass(frozen=True)
class Split:
    micro_batch: int
    grad_accum: int

    @property
    def text(self) -> str:
        return f"micro {self.micro_batch} × accum {self.grad_accum}"


@dataclass(frozen=True)
class BatchOption:
    """A valid global batch and how it can be split (best first: largest micro batch)."""

    global_batch: int
    splits: tuple[Split, ...]

    @property
    def text(self) -> str:
        return f"{self.global_batch} ({', '.join(s.text for s in self.splits[:2])})"


@dataclass(frozen=True)
class BatchCheck:
    """What a batch configuration gives for ``data_parallel`` ranks (and whether it works)."""

    data_parallel: int
    global_batch: int | None  # as given, or derived from micro × accum × dp
    micro_batch: int | None  # as given, or the best split's when the batch is valid
    grad_accum: int | None
    divisors: tuple[tuple[str, int], ...] = ()
    step_divisors: tuple[tuple[str, int], ...] = ()
    max_micro_batch: int | None = None
    reason: str | None = None  # why the batch is invalid; None when valid
    splits: tuple[Split, ...] = ()  # for global_batch, when valid
    nearest: tuple[BatchOption, ...] = ()  # nearest valid batches below/above, when invalid

    @property
    def ok(self) -> bool:
        return self.reason is None

    @property
    def summary(self) -> str:
        """One line for a plan: what runs, or why not and what to use instead."""
        if self.global_batch is None:
            return f"micro batch {self.micro_batch} per rank on {self.data_parallel} ranks"
        if not self.ok:
            return f"{self.reason}; {self.advice}"
        split = f"{self.data_parallel} ranks × micro {self.micro_batch} × accum {self.grad_accum}"
        others = [f"{s.micro_batch}×{s.grad_accum}" for s in self.splits[1:]]  # [0]: the one used
        more = f" (also {', '.join(others)})" if others else ""
        return f"global batch {self.global_batch} = {split}{more}"

    @property
    def advice(self) -> str:
        if not self.nearest:
            return "no valid global batch found near it"
        return "nearest valid: " + " or ".join(o.text for o in self.nearest)


def _named(divisors: Sequence[tuple[str, int]]) -> str:
    return ", ".join(f"{name}={value}" for name, value in divisors)


def splits_for(
    global_batch: int,
    data_parallel: int,
    micro_batch: int | None = None,
    grad_accum: int | None = None,
    max_micro_batch: int | None = None,
    *,
    step_divisors: Sequence[tuple[str, int]] = (),
) -> tuple[Split, ...]:
    """Every (micro, accum) that reaches *global_batch* under the constraints, micro first."""
    if global_batch % data_parallel:
        return ()
    per_rank = global_batch // data_parallel
    small = [i for i in range(1, math.isqrt(per_rank) + 1) if per_rank % i == 0]
    micros = sorted({*small, *(per_rank // i for i in small)}, reverse=True)
    return tuple(
        Split(micro, per_rank // micro)
        for micro in micros
        if micro_batch in (None, micro)
        and grad_accum in (None, per_rank // micro)
        and (max_micro_batch is None or micro <= max_micro_batch)
        and not any((data_parallel * micro) % k for _, k in step_divisors)
    )


def _invalid_reason(check: BatchCheck, splits: Callable[..., tuple[Split, ...]]) -> str | None:
    """Why *check*'s global batch does not work (``splits(g)``: its splits), or None."""
    g, dp = check.global_batch or 0, check.data_parallel
    micro, accum = check.micro_batch, check.grad_accum
    if g % dp:
        return f"global batch {g} is not divisible by {dp} data-parallel ranks"
    bad = [(n, k) for n, k in check.divisors if g % k]
    if bad:
        return f"global batch {g} is not divisible by {_named(bad)}"
    per_rank = g // dp
    if micro is not None and accum is not None and micro * accum != per_rank:
        return (
            f"global batch {g} ≠ {dp} ranks × micro {micro} × accum {accum} = {dp * micro * accum}"
        )
    elif micro is not None and per_rank % micro:
        return f"global batch {g} gives {per_rank} per rank, not divisible by micro batch {micro}"
    elif accum is not None and per_rank % accum:
        return (
            f"global batch {g} gives {per_rank} per rank, not divisible by {accum} accumulation "
            "steps"
        )
    if not splits(g, ()):
        return (
            f"global batch {g} needs a micro batch above the maximum {check.max_micro_batch} "
            "with these settings"
        )
    if micro is not None:
        bad = [(n, k) for n, k in check.step_divisors if (dp * micro) % k]
        if bad:
            return f"{dp} ranks × micro {micro} = {dp * micro} is not divisible by {_named(bad)}"
    if not splits(g):
        return (
            f"global batch {g}: no micro batch makes {dp} ranks × micro divisible by "
            f"{_named(check.step_divisors)}"
        )
    return None


def check_batch(
    data_parallel: int,
    *,
    global_batch: int | None = None,
    micro_batch: int | None = None,
    grad_accum: int | None = None,
    max_micro_batch: int | None = None,
    divisors: Sequence[tuple[str, int]] = (),
    step_divisors: Sequence[tuple[str, int]] = (),
) -> BatchCheck:
    """Validate a batch configuration; raises ``UserInputError`` for values ≤ 0."""
    for label, value in (
        ("data_parallel", data_parallel),
        ("global_batch", global_batch),
        ("micro_batch", micro_batch),
        ("grad_accum", grad_accum),
        ("max_micro_batch", max_micro_batch),
        *((f"divisor {n}", k) for n, k in (*divisors, *step_divisors)),
    ):
        whole_number(label, value)
    if global_batch is None and micro_batch is not None and grad_accum is not None:
        global_batch = data_parallel * micro_batch * grad_accum
    base = BatchCheck(
        data_parallel,
        global_batch,
        micro_batch,
        grad_accum,
        tuple(divisors),
        tuple(step_divisors),
        max_micro_batch,
    )

    def splits(candidate: int, steps: Sequence[tuple[str, int]] = step_divisors) -> Any:
        return splits_for(
            candidate, data_parallel, micro_batch, grad_accum, max_micro_batch, step_divisors=steps
        )

    if global_batch is None:
        # Only a micro batch (or nothing): the step divisors are all that can be checked.
        bad = [(n, k) for n, k in step_divisors if micro_batch and data_parallel * micro_batch % k]
        if bad:
            why = f"{data_parallel} ranks × micro {micro_batch} is not divisible by {_named(bad)}"
            return replace(base, reason=why)
        return base
    reason = _invalid_reason(base, splits)
    if reason is None:
        found = splits(global_batch)
        return replace(
            base,
            micro_batch=found[0].micro_batch,
            grad_accum=found[0].grad_accum,
            splits=found[:MAX_SPLITS],
        )
    # Valid batches repeat with this period (every multiple of it is valid when the micro
    # batch is free), so a valid value above any batch lies within one period of it. A step
    # divisor k asks dp × micro to divide by k: lcm(dp, k), which dp already divides.
    period = math.lcm(data_parallel, *(k for _, k in (*divisors, *step_divisors)))
    span = period * (micro_batch or 1) * (grad_accum or 1) + data_parallel
    nearest = []
    below = range(global_batch - 1, max(0, global_batch - span - 1), -1)
    for candidates in (below, range(global_batch + 1, global_batch + span + 1)):
        for candidate in candidates:
            found = () if any(candidate % k for _, k in divisors) else splits(candidate)
            if found:
                nearest.append(BatchOption(candidate, found[:MAX_SPLITS]))
                break
    return replace(base, reason=reason, nearest=tuple(nearest))


def check_job_batch(job: Job, data_parallel: int) -> BatchCheck | None:
    if all(v is None for v in (job.global_batch, job.micro_batch, job.grad_accum)):
        return None
    keywords = ("global_batch", "micro_batch", "grad_accum", "max_micro_batch", "divisors")
    return check_batch(
        data_parallel, step_divisors=job.step_divisors, **{k: getattr(job, k) for k in keywords}
    )


def nearest_batch(job: Job, data_parallel: int | None) -> tuple[Job, str]:
    """*job* at the nearest global batch *data_parallel* ranks run, and a note ("": unchanged)."""
    check = None if data_parallel is None else check_job_batch(job, data_parallel)
    if check is None or check.ok or check.global_batch is None or not check.nearest:
        return job, ""
    wanted = check.global_batch
    new = min((abs(o.global_batch - wanted), o.global_batch) for o in check.nearest)[1]
    return replace(job, global_batch=new), f", global batch {new} instead of {job.global_batch}"
