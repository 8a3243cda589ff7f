"""Batch arithmetic: which global batches a data-parallel job can use, and how to split them.

The rule is llm-analysis's (``reference/memory.md`` §6): ``global = micro × accum × dp``,
so the global batch must be divisible by the data-parallel size; the micro batch is the
largest divisor of ``global / dp`` that the caller allows, the rest is gradient
accumulation. On top of that the caller may add *extra divisors*:

- ``divisors`` divide the global batch (for example a group size that whole groups must
  fill: AReaL's GRPO ``group_size``);
- ``step_divisors`` divide ``dp × micro``, the samples one forward/backward step sees
  across all ranks (TRL's GRPO raises unless ``num_processes ×
  per_device_train_batch_size`` is divisible by ``num_generations``).

When a batch is invalid, :func:`check_batch` names why and offers the nearest valid values
below and above, each with its (micro, accumulation) splits: batch 8 on 3 trainers → 6 or 9.

Pure integer arithmetic: imports nothing of nbgpu but ``errors``; never the inventory,
sockets or files.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from nbgpu.errors import UserInputError

__all__ = ["BatchCheck", "BatchOption", "Split", "check_batch", "splits_for"]

# How many splits a result lists; more is noise (they are all divisors of global/dp).
MAX_SPLITS = 4


@dataclass(frozen=True)
class Split:
    """One way to reach the global batch: ``micro_batch`` per rank × ``grad_accum`` steps."""

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
        if self.ok:
            split = (
                f"{self.data_parallel} ranks × micro {self.micro_batch} × accum {self.grad_accum}"
            )
            others = [s for s in self.splits if s.micro_batch != self.micro_batch]
            more = (
                " (also " + ", ".join(f"{s.micro_batch}×{s.grad_accum}" for s in others) + ")"
                if others
                else ""
            )
            return f"global batch {self.global_batch} = {split}{more}"
        return f"{self.reason}; {self.advice}"

    @property
    def advice(self) -> str:
        if not self.nearest:
            return "no valid global batch found near it"
        options = []
        for option in self.nearest:
            ways = ", ".join(s.text for s in option.splits[:2])
            options.append(f"{option.global_batch} ({ways})")
        return "nearest valid: " + " or ".join(options)


def _named(divisors: Sequence[tuple[str, int]]) -> str:
    return ", ".join(f"{name}={value}" for name, value in divisors)


def splits_for(
    global_batch: int,
    data_parallel: int,
    *,
    micro_batch: int | None = None,
    grad_accum: int | None = None,
    max_micro_batch: int | None = None,
    step_divisors: Sequence[tuple[str, int]] = (),
) -> tuple[Split, ...]:
    """Every (micro, accum) that reaches *global_batch* under the constraints, micro first."""
    if global_batch % data_parallel:
        return ()
    per_rank = global_batch // data_parallel
    found = []
    for micro in _divisors_descending(per_rank):
        accum = per_rank // micro
        if micro_batch is not None and micro != micro_batch:
            continue
        if grad_accum is not None and accum != grad_accum:
            continue
        if max_micro_batch is not None and micro > max_micro_batch:
            continue
        if any((data_parallel * micro) % k for _, k in step_divisors):
            continue
        found.append(Split(micro, accum))
    return tuple(found)


def _divisors_descending(n: int) -> list[int]:
    small = [i for i in range(1, math.isqrt(n) + 1) if n % i == 0]
    return sorted({*small, *(n // i for i in small)}, reverse=True)


def _invalid_reason(
    global_batch: int,
    data_parallel: int,
    *,
    micro_batch: int | None,
    grad_accum: int | None,
    max_micro_batch: int | None,
    divisors: Sequence[tuple[str, int]],
    step_divisors: Sequence[tuple[str, int]],
) -> str | None:
    if global_batch % data_parallel:
        return (
            f"global batch {global_batch} is not divisible by {data_parallel} data-parallel ranks"
        )
    bad = [(n, k) for n, k in divisors if global_batch % k]
    if bad:
        return f"global batch {global_batch} is not divisible by {_named(bad)}"
    per_rank = global_batch // data_parallel
    if micro_batch is not None and grad_accum is not None:
        if micro_batch * grad_accum != per_rank:
            return (
                f"global batch {global_batch} ≠ {data_parallel} ranks × micro {micro_batch} × "
                f"accum {grad_accum} = {data_parallel * micro_batch * grad_accum}"
            )
    elif micro_batch is not None and per_rank % micro_batch:
        return (
            f"global batch {global_batch} gives {per_rank} per rank, not divisible by "
            f"micro batch {micro_batch}"
        )
    elif grad_accum is not None and per_rank % grad_accum:
        return (
            f"global batch {global_batch} gives {per_rank} per rank, not divisible by "
            f"{grad_accum} accumulation steps"
        )
    if not splits_for(
        global_batch,
        data_parallel,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        max_micro_batch=max_micro_batch,
    ):
        return (
            f"global batch {global_batch} needs a micro batch above the maximum "
            f"{max_micro_batch} with these settings"
        )
    if micro_batch is not None:
        bad = [(n, k) for n, k in step_divisors if (data_parallel * micro_batch) % k]
        if bad:
            return (
                f"{data_parallel} ranks × micro {micro_batch} = {data_parallel * micro_batch} "
                f"is not divisible by {_named(bad)}"
            )
    if not splits_for(
        global_batch,
        data_parallel,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        max_micro_batch=max_micro_batch,
        step_divisors=step_divisors,
    ):
        return (
            f"global batch {global_batch}: no micro batch makes {data_parallel} ranks × micro "
            f"divisible by {_named(step_divisors)}"
        )
    return None


def _search_span(
    data_parallel: int,
    micro_batch: int | None,
    grad_accum: int | None,
    divisors: Sequence[tuple[str, int]],
    step_divisors: Sequence[tuple[str, int]],
) -> int:
    # Valid batches repeat with this period (every multiple of it is valid when the micro
    # batch is free), so a valid value above any batch lies within one period of it.
    period = math.lcm(data_parallel, *(k for _, k in divisors))
    for _, k in step_divisors:
        period = math.lcm(period, data_parallel * k // math.gcd(data_parallel, k))
    return period * (micro_batch or 1) * (grad_accum or 1) + data_parallel


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
        ("data-parallel size", data_parallel),
        ("global batch", global_batch),
        ("micro batch", micro_batch),
        ("gradient accumulation", grad_accum),
        ("max micro batch", max_micro_batch),
        *((f"divisor {n}", k) for n, k in (*divisors, *step_divisors)),
    ):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise UserInputError(f"{label} {value!r}: expected a whole number >= 1")
        if value is not None and value < 1:
            raise UserInputError(f"{label} {value}: expected a whole number >= 1")
    if global_batch is None and micro_batch is not None and grad_accum is not None:
        global_batch = data_parallel * micro_batch * grad_accum
    base = BatchCheck(
        data_parallel=data_parallel,
        global_batch=global_batch,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        divisors=tuple(divisors),
        step_divisors=tuple(step_divisors),
        max_micro_batch=max_micro_batch,
    )

    def splits(candidate: int) -> tuple[Split, ...]:
        return splits_for(
            candidate,
            data_parallel,
            micro_batch=micro_batch,
            grad_accum=grad_accum,
            max_micro_batch=max_micro_batch,
            step_divisors=step_divisors,
        )

    if global_batch is None:
        # Only a micro batch (or nothing): the step divisors are all that can be checked.
        bad = [
            (n, k) for n, k in step_divisors if micro_batch and (data_parallel * micro_batch) % k
        ]
        if bad:
            why = f"{data_parallel} ranks × micro {micro_batch} is not divisible by {_named(bad)}"
            return replace(base, reason=why)
        return base
    reason = _invalid_reason(
        global_batch,
        data_parallel,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        max_micro_batch=max_micro_batch,
        divisors=divisors,
        step_divisors=step_divisors,
    )
    if reason is None:
        found = splits(global_batch)
        return replace(
            base,
            micro_batch=found[0].micro_batch,
            grad_accum=found[0].grad_accum,
            splits=found[:MAX_SPLITS],
        )

    def valid(candidate: int) -> tuple[Split, ...]:
        if any(candidate % k for _, k in divisors):
            return ()
        return splits(candidate)

    nearest = []
    span = _search_span(data_parallel, micro_batch, grad_accum, divisors, step_divisors)
    for candidate in range(global_batch - 1, max(0, global_batch - span - 1), -1):
        found = valid(candidate)
        if found:
            nearest.append(BatchOption(candidate, found[:MAX_SPLITS]))
            break
    for candidate in range(global_batch + 1, global_batch + span + 1):
        found = valid(candidate)
        if found:
            nearest.append(BatchOption(candidate, found[:MAX_SPLITS]))
            break
    return replace(base, reason=reason, nearest=tuple(nearest))
