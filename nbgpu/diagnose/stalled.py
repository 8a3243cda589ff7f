"""A stall as a diagnosis: nbgpu's ``stall.json``, or the flight-recorder dumps NCCL leaves.

A stalled job ends by a timeout, a stop or an interrupt, and its logs say only that (NCCL's
watchdog: "Watchdog caught collective operation timeout", on every rank alike). The stall's
own record names the rank that never came: nbgpu's follow loop writes it to ``stall.json``
when it finds one; a plain torchrun job on GPUs leaves each rank's flight record in
``nccl_trace_rank_N`` files when NCCL times out (``TORCH_NCCL_DUMP_ON_TIMEOUT``), read here
with :func:`nbgpu.diagnose.hang.find_stall`. Either becomes the root cause, ahead of the
timeouts it explains.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from nbgpu.diagnose.catalog import STALLED, cause
from nbgpu.diagnose.hang import find_stall, read_trace
from nbgpu.diagnose.report import Evidence, FoundCause
from nbgpu.diagnose.sources import Inputs

__all__ = ["stall_cause", "with_stall"]


def _recorded(inputs: Inputs) -> tuple[list[str], dict[str, Any]] | None:
    """What nbgpu said when it found the stall, and its record."""
    if inputs.stall is None:
        return None
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(inputs.stall.read_text(encoding="utf-8"))
        if isinstance(data, dict) and isinstance(data.get("lines"), list):
            return [str(line) for line in data["lines"]], data
    return None


def _read(path: Path, notes: list[str]) -> dict[str, Any] | None:
    try:
        return read_trace(path.read_bytes())
    except (OSError, ValueError) as exc:
        notes.append(f"{path.name}: not read as a flight record ({exc})")
        return None


def _from_dumps(inputs: Inputs) -> tuple[list[str], dict[str, Any]] | None:
    traces = {rank: _read(path, inputs.notes) for rank, path in sorted(inputs.flight.items())}
    stall = find_stall({r: t for r, t in traces.items() if t is not None}, now_ns=0)
    if stall is None:
        return None
    stall.waited_s = None  # a dump has no clock: how long it waited is not in it
    return stall.lines(), stall.to_dict()


def stall_cause(inputs: Inputs) -> FoundCause | None:
    """The stall the inputs record, as a found cause (its lines are the evidence)."""
    found = _recorded(inputs) or (_from_dumps(inputs) if inputs.flight else None)
    if found is None:
        return None
    lines, data = found
    source = inputs.stall.name if inputs.stall is not None else "flight recorder"
    culprits = sorted(
        int(r) for key in ("never_entered", "entered_other") for r in data.get(key) or {}
    )
    return FoundCause(
        cause=STALLED.id,
        title=STALLED.title,
        role="root",
        confidence=0.9,
        ranks=tuple(culprits),
        first_rank=culprits[0] if culprits else None,
        evidence=tuple(Evidence(source, None, line) for line in lines),
        explanation=STALLED.explanation,
        fixes=STALLED.fixes,
    )


def with_stall(causes: tuple[FoundCause, ...], stall: FoundCause) -> tuple[FoundCause, ...]:
    """The stall as the root; a root found in the logs stays the root when it is a primary
    failure (a crash explains a stall), and becomes its consequence when it is what the
    stall looks like from outside (a timeout, an NCCL error)."""
    root = next((c for c in causes if c.root), None)
    if root is not None and not cause(root.cause).secondary:
        return (*causes, replace(stall, role="also"))
    demoted = tuple(replace(c, role="consequence") if c.root else c for c in causes)
    return (stall, *demoted)
