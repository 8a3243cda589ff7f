"""Numbers in the evidence, turned into concrete advice.

The catalog's fixes are generic; the log usually says more: the batch size and world
size that do not divide (so the nearest valid sizes can be named), the collective and
its timeout, the allocation that failed, the port that was taken, the ranks that found
no GPU (so the number of visible GPUs can be inferred). :func:`specifics` returns these
as sentences for a found cause's ``details``. No inventory here (``enrich.py`` adds the
machine's facts). Pure functions; imports only the standard library.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["nearest_multiples", "specifics"]

_NUM = r"\(?(\d+)\)?"
_BATCH_WORLD = re.compile(
    rf"batch[ _]?size\s*{_NUM}\s*(?:must|should) be divisible by\s*[\w ]*?{_NUM}", re.IGNORECASE
)
_DEEPSPEED = re.compile(r"world_size\s*(\d+)\s*!=\s*(\d+)\s*\*\s*(\d+)\s*\*\s*(\d+)")
_CHUNK = re.compile(r"size of DataProto (\d+) and chunk (\d+)")
_MEGATRON = re.compile(
    rf"global batch size\s*{_NUM}\s*is not divisible by micro batch size\s*{_NUM}\s*times data "
    rf"parallel size\s*{_NUM}",
    re.IGNORECASE,
)
_GENERIC_DIV = re.compile(r"(\d+)\s*(?:is not|must be|should be) (?:evenly )?divisible by\s*(\d+)")
_OP = re.compile(r"OpType=(\w+)")
_TIMEOUT = re.compile(r"Timeout\(ms\)=(\d+)\) ran for (\d+) milliseconds")
_ALLOC = re.compile(r"Tried to allocate ([\d.]+ ?[KMGT]?i?B)")
_GPU_TOTAL = re.compile(r"GPU (\d+)?\s*(?:has a total capac\w* of|;)\s*([\d.]+ ?[KMGT]i?B)")
_FREE = re.compile(r"of which ([\d.]+ ?[KMGT]?i?B) is free|([\d.]+ ?[KMGT]?i?B) free")
_PORT = re.compile(r"(?:\[::\]|0\.0\.0\.0|port)\s*:?\s*(\d{2,5})\b")
_ENDPOINT = re.compile(r"connect to \(?([\w.\-]+)[, :]+(\d{2,5})\)?")
_ASSERTION = re.compile(r"Assertion `(.+?)` failed")
_DRIVER_VERSION = re.compile(r"found version (\d+)")


def nearest_multiples(value: int, divisor: int) -> tuple[int, ...]:
    """The multiples of ``divisor`` just below and above ``value`` (positive only)."""
    if divisor <= 0:
        return ()
    low = (value // divisor) * divisor
    return tuple(v for v in (low, low + divisor) if v > 0 and v != value)


def _sizes(values: Sequence[int]) -> str:
    return " or ".join(str(v) for v in values)


def _batch(text: str, world_size: int | None) -> list[str]:
    m = _DEEPSPEED.search(text)
    if m:
        train, micro, gas, world = (int(g) for g in m.groups())
        sentences = [
            (
                f"DeepSpeed needs train_batch_size = micro_batch_per_gpu x gradient_accumulation x "
                f"world_size = {micro} x {gas} x {world} = {micro * gas * world}, but it is {train}"
            )
        ]
        if world_size and world == 1 < world_size:
            sentences.append(
                f"DeepSpeed counted world_size 1 while {world_size} ranks ran: the ranks did "
                "not join one process group (launch through torchrun/deepspeed, not python)"
            )
        step = micro * world
        if train % step == 0:
            sentences.append(f"keep {train} with gradient_accumulation_steps = {train // step}")
        else:
            near = nearest_multiples(train, step)
            options = ", ".join(f"{n} (gradient accumulation {n // step})" for n in near)
            sentences.append(f"valid train_batch_size values near {train}: {options}")
        return sentences
    m = _MEGATRON.search(text)
    if m:
        batch, micro, dp = (int(g) for g in m.groups())
        near = nearest_multiples(batch, micro * dp)
        return [
            (
                f"global batch {batch} must be a multiple of micro batch x data-parallel size "
                f"= {micro} x {dp}; nearest valid: {_sizes(near)}"
            )
        ]
    m = _CHUNK.search(text)
    if m:
        batch, parts = int(m.group(1)), int(m.group(2))
        near = nearest_multiples(batch, parts) or (parts,)
        return [
            (
                f"a batch of {batch} cannot be split into {parts} equal parts (one per rank); "
                f"use a multiple of {parts}: {_sizes(near)}"
            )
        ]
    m = _BATCH_WORLD.search(text)
    if m:
        batch, world = int(m.group(1)), int(m.group(2))
        near = nearest_multiples(batch, world)
        return [
            (
                f"batch size {batch} is not divisible by world size {world}; nearest valid "
                f"batch sizes: {_sizes(near)}, or use a number of ranks that divides {batch}"
            )
        ]
    m = _GENERIC_DIV.search(text)
    if m:
        value, divisor = int(m.group(1)), int(m.group(2))
        near = nearest_multiples(value, divisor)
        return [f"{value} is not divisible by {divisor}; nearest multiples: {_sizes(near)}"]
    if world_size:
        return [
            (
                f"the job ran with world size {world_size}: sizes split across ranks must be "
                f"multiples of {world_size}"
            )
        ]
    return []


def _failing_ranks(ranks: Sequence[int], world_size: int | None) -> list[str]:
    if not ranks:
        return []
    first = min(ranks)
    if first > 0 and (world_size is None or max(ranks) == world_size - 1):
        return [
            (
                f"ranks {first} and up found no GPU while ranks below {first} did: the job sees "
                f"{first} GPU{'s' if first != 1 else ''}, so start {first} rank"
                f"{'s' if first != 1 else ''} per node (`%%torchrun {first}`)"
            )
        ]
    return []


def specifics(
    cause_id: str,
    texts: Sequence[str],
    ranks: Sequence[int],
    world_size: int | None,
) -> tuple[str, ...]:
    """Sentences with the numbers the evidence gives for ``cause_id``."""
    joined = " ".join(texts)
    out: list[str] = []
    if cause_id == "batch_divisibility":
        out.extend(_batch(joined, world_size))
    elif cause_id == "nccl_timeout":
        op, t = _OP.search(joined), _TIMEOUT.search(joined)
        if op or t:
            what = op.group(1) if op else "a collective"
            if t:
                out.append(
                    f"{what} waited {int(t.group(2)) / 1000:.0f} s (timeout "
                    f"{int(t.group(1)) / 1000:.0f} s) for a rank that never joined it"
                )
            else:
                out.append(f"{what} timed out waiting for a rank that never joined it")
    elif cause_id == "cuda_oom":
        alloc, total, free = _ALLOC.search(joined), _GPU_TOTAL.search(joined), _FREE.search(joined)
        if alloc:
            sentence = f"tried to allocate {alloc.group(1)}"
            if total:
                gpu = f"GPU {total.group(1)} " if total.group(1) else "a GPU "
                sentence += f" on {gpu}of {total.group(2)}"
            if free:
                sentence += f" with {free.group(1) or free.group(2)} free"
            out.append(sentence)
    elif cause_id == "port_in_use":
        m = _PORT.search(joined)
        if m:
            port = int(m.group(1))
            if port < 1024:
                out.append(f"port {port} is privileged (< 1024): use a port above 1024")
            else:
                out.append(
                    f"port {port} was already taken"
                    + (
                        " (torchrun's default, shared by every job that keeps it)"
                        if port == 29500
                        else ""
                    )
                )
    elif cause_id == "rendezvous":
        m = _ENDPOINT.search(joined)
        if m:
            out.append(f"could not reach the rendezvous store at {m.group(1)}:{m.group(2)}")
    elif cause_id == "invalid_ordinal":
        out.extend(_failing_ranks(ranks, world_size))
    elif cause_id == "device_assert":
        m = _ASSERTION.search(joined)
        if m:
            out.append(f"the failed kernel assertion: {m.group(1)}")
    elif cause_id == "driver":
        m = _DRIVER_VERSION.search(joined)
        if m:
            v = int(m.group(1))
            out.append(
                f"the driver supports CUDA up to {v // 1000}.{(v % 1000) // 10} (found "
                f"version {v}); the installed torch needs a newer one"
            )
    return tuple(out)
