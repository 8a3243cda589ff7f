"""The job description a plan is made for, validated once, with one-line errors.

Every user-facing value (allocation, GPU lists, batch sizes, divisors, model, precision,
strategy, optimizer, ports) is checked here and becomes a frozen :class:`Job`; the planner
below it never sees raw input. Values that only make sense against an inventory (a GPU
index that does not exist, more GPUs than the box has) are checked by the planner.

Pure: imports ``allocation``, ``memory``, ``ports`` constants and ``nbgpu.errors``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from nbgpu.errors import UserInputError
from nbgpu.estimate.formulas import OPTIMIZERS, STRATEGIES, normalize_precision
from nbgpu.estimate.shapes import ModelShape, model_shape
from nbgpu.plan.allocation import Allocation, parse_allocation
from nbgpu.plan.batch import BatchCheck, check_batch
from nbgpu.plan.placement import DEFAULT_BASE_PORT, MAX_PORT
from nbgpu.problems import Problem

__all__ = [
    "Job",
    "JobRequest",
    "batch_problem",
    "check_job_batch",
    "make_job",
    "parse_divisors",
    "parse_gpu_list",
]

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
    elif isinstance(value, int):  # a bool lands here too and is refused below
        items = [value]
    else:
        items = list(value)
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise UserInputError(f"{label}={value!r}: {item!r} is not a GPU index; {form}")
    if len(set(items)) != len(items):
        raise UserInputError(f"{label}={value!r} names a GPU twice; {form}")
    return tuple(items)


def parse_divisors(value: Divisors, label: str) -> tuple[tuple[str, int], ...]:
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


def _positive(label: str, value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserInputError(f"{label}={value!r}: expected a whole number >= 1")
    return value


def _choice(label: str, value: str, choices: Sequence[str]) -> str:
    key = str(value).strip().lower()
    if key not in choices:
        raise UserInputError(f"{label}={value!r}: expected one of {', '.join(choices)}")
    return key


@dataclass(frozen=True)
class JobRequest:
    """A job as the user asks for it: the one declaration of the keywords ``nbgpu.plan()``,
    ``nbgpu.sweep()``, ``nbgpu plan`` and ``%gpu_plan`` take. :func:`make_job` checks it."""

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

    @classmethod
    def from_keywords(
        cls, where: str, keywords: Mapping[str, Any], *, but: Sequence[str] = ()
    ) -> JobRequest:
        """The request for *keywords*; an unknown one is a one-line error naming the rest."""
        known = [f.name for f in fields(cls) if f.name not in but]
        unknown = sorted(set(keywords) - set(known))
        if unknown:
            raise UserInputError(
                f"{where}: {unknown[0]}= is not a keyword it takes; its job keywords are "
                f"{', '.join(known)}"
            )
        return cls(**keywords)


def make_job(request: JobRequest) -> Job:
    """Validate everything the user gave; each mistake is one ``UserInputError`` line."""
    r = request
    max_micro_batch, num_gpus, base_port = r.max_micro_batch, r.num_gpus, r.base_port
    parsed = None if r.allocation is None else parse_allocation(r.allocation)
    _positive("num_gpus", num_gpus)
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
    auto = isinstance(max_micro_batch, str) and max_micro_batch.strip().lower() == "auto"
    if isinstance(max_micro_batch, str) and not auto:
        if not max_micro_batch.strip().isdigit():
            raise UserInputError(
                f"max_micro_batch={max_micro_batch!r}: expected a whole number >= 1 or 'auto'"
            )
        max_micro_batch = int(max_micro_batch)
    if auto and (r.model is None or r.seq_len is None):
        raise UserInputError(
            "max_micro_batch='auto' needs model= (a name such as 'Qwen/Qwen2.5-7B-Instruct' or "
            "an HF config.json) and seq_len= to compute what fits"
        )
    max_micro = None if auto or isinstance(max_micro_batch, str) else max_micro_batch
    for label in ("global_batch", "micro_batch", "grad_accum", "seq_len"):
        _positive(label, getattr(r, label))
    _positive("max_micro_batch", max_micro)
    if not 1 <= base_port <= MAX_PORT or isinstance(base_port, bool):
        raise UserInputError(f"base_port={base_port!r}: expected a TCP port 1..{MAX_PORT}")
    return Job(
        allocation=parsed,
        num_gpus=num_gpus,
        require=required,
        exclude=excluded,
        global_batch=r.global_batch,
        micro_batch=r.micro_batch,
        grad_accum=r.grad_accum,
        max_micro_batch=max_micro,
        divisors=parse_divisors(r.divisors, "divisors"),
        step_divisors=parse_divisors(r.step_divisors, "step_divisors"),
        model=None if r.model is None else model_shape(r.model),
        precision=normalize_precision(r.precision),
        strategy=_choice("strategy", r.strategy, tuple(STRATEGIES)),
        optimizer=_choice("optimizer", r.optimizer, OPTIMIZERS),
        base_port=base_port,
        name=r.name,
        seq_len=r.seq_len,
        activation_checkpointing=bool(r.activation_checkpointing),
        max_micro_auto=auto,
    )


def check_job_batch(job: Job, data_parallel: int) -> BatchCheck | None:
    """The job's batch keywords checked for *data_parallel* ranks (None: it gave none)."""
    if all(v is None for v in (job.global_batch, job.micro_batch, job.grad_accum)):
        return None
    return check_batch(
        data_parallel,
        global_batch=job.global_batch,
        micro_batch=job.micro_batch,
        grad_accum=job.grad_accum,
        max_micro_batch=job.max_micro_batch,
        divisors=job.divisors,
        step_divisors=job.step_divisors,
    )


def batch_problem(check: BatchCheck, subject: str) -> Problem:
    """A batch that does not work, as a problem whose fixes are the nearest valid batches."""
    fixes = tuple(
        f"global_batch={o.global_batch} ({', '.join(s.text for s in o.splits[:2])})"
        for o in check.nearest
    )
    return Problem("bad", "batch", subject, f"{subject}: {check.reason}", fixes)
