"""Choosing physical GPUs for roles (or sweep runs): disjoint sets, best GPUs first.

The rules, in order of importance:

1. Only usable candidates are ever given out; the caller has already left out the rest.
2. GPUs the user requires come first, in the order given (a hand workaround such as ``3,2,1,0``).
3. Otherwise clean GPUs before ones with caveats, then by NVML index: the first role (the
   one that owns logical device 0, an inference server's first GPU) gets the best GPU.
4. A role gets GPUs of one model and memory size when the box allows it: data-parallel
   ranks share one micro batch, so on a mixed set the smallest GPU decides.

Pure: works on ``Candidate`` tuples; never the inventory, sockets or files.
"""

from __future__ import annotations

from collections.abc import Sequence

from nbgpu.plan.candidates import Candidate

__all__ = ["assign", "order_pool"]


def order_pool(candidates: Sequence[Candidate], require: Sequence[int] = ()) -> list[Candidate]:
    """Usable candidates in the order they should be handed out."""
    usable = {c.nvml_index: c for c in candidates if c.usable}
    first = [usable[i] for i in require if i in usable]
    rest = sorted(
        (c for c in usable.values() if c.nvml_index not in require),
        key=lambda c: (c.grade, c.nvml_index),
    )
    return first + rest


def _memory_class(c: Candidate) -> tuple[int, str]:
    return (c.memory_total_bytes or 0, c.name or "")


def _pick(remaining: list[Candidate], count: int) -> list[Candidate]:
    groups: dict[tuple[int, str], list[Candidate]] = {}
    for c in remaining:
        groups.setdefault(_memory_class(c), []).append(c)
    # Among classes that can hold the whole role, take the one whose best GPU comes first.
    whole = [members[:count] for members in groups.values() if len(members) >= count]
    if whole:
        return min(whole, key=lambda g: (g[0].grade, remaining.index(g[0])))
    return remaining[:count]


def assign(
    pool: Sequence[Candidate], counts: Sequence[int], *, keep_order: bool = False
) -> list[list[Candidate]] | None:
    """Disjoint GPU lists, one per count, or None if the pool is too small.

    ``keep_order`` hands GPUs out strictly in pool order (required GPUs given by the
    user); otherwise each role prefers a set of identical GPUs.
    """
    if sum(counts) > len(pool):
        return None
    remaining = list(pool)
    out = []
    for count in counts:
        chosen = remaining[:count] if keep_order else _pick(remaining, count)
        out.append(chosen)
        taken = {c.nvml_index for c in chosen}
        remaining = [c for c in remaining if c.nvml_index not in taken]
    return out
