"""Measured memory of one real training step on the CPU, beside both estimates.

The step runs under ``torch.profiler`` with ``profile_memory=True``; the profiler's memory
timeline (the c10 CPU allocator's own allocation and free events) gives the peak of live
tensor bytes. Imports torch at module level: only ``nbgpu.estimate.compare`` and the
benchmarks import it. Never moves a tensor to a GPU.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from nbgpu._render import Block, Line, Result, Table, Title, fmt_bytes
from nbgpu.errors import UserInputError
from nbgpu.estimate.trace import (
    TOOL,
    failure_reason,
    make_optimizer,
    run_step,
    tensor_bytes,
    tensors_in,
    trace_step,
)

if TYPE_CHECKING:
    from nbgpu.estimate.result import MemoryEstimate


__all__ = ["StepComparison", "compare_step", "measure_step"]


def measure_step(
    module: nn.Module,
    batch: Any,
    *,
    optimizer: str = "adamw",
    loss_fn: Callable[..., torch.Tensor] | None = None,
    foreach: bool = False,
) -> int:
    """Peak live tensor bytes of one real CPU training step (the allocator's own events).

    Like :func:`trace_step`, the second step is measured (the first creates the optimizer
    state); parameters, optimizer state and the batch exist before it and count. Runs on a
    deep copy, so *module* is not trained.
    """
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415
    from torch.profiler._memory_profiler import Action  # noqa: PLC0415

    work = copy.deepcopy(module)
    opt = make_optimizer(optimizer, work.parameters(), foreach)
    run_step(work, batch, opt, loss_fn)  # creates the optimizer state, as in trace_step
    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        run_step(work, batch, opt, loss_fn)
    current = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action in (Action.PREEXISTING, Action.CREATE):
            current += size
        elif action == Action.DESTROY:
            current -= size
        peak = max(peak, current)
    # Tensors the step never touched (frozen parameters, unused buffers) are still live.
    touched = {id(p) for p in work.parameters() if p.requires_grad}
    idle = sum(tensor_bytes(p) for p in work.parameters() if id(p) not in touched)
    return peak + idle


@dataclass(frozen=True)
class StepComparison(Result):
    """Measured peak tensor bytes of one real CPU step beside the traced and analytic ones."""

    model: str
    batch_shape: str
    measured_bytes: int
    traced_bytes: int | None
    analytic_bytes: int | None  # model states + activations formulas (None: no shape)
    trace_note: str
    measure_seconds: float
    JSON_EXTRAS: ClassVar[tuple[str, ...]] = ("methods",)
    FRAME_COLUMNS = ("method", "bytes", "error_vs_measured")

    def _error(self, value: int | None) -> float | None:
        if value is None or not self.measured_bytes:
            return None
        return (value - self.measured_bytes) / self.measured_bytes

    def records(self) -> list[dict[str, Any]]:
        return [
            {"method": m, "bytes": v, "error_vs_measured": self._error(v)}
            for m, v in (
                ("measured (CPU step, profiler)", self.measured_bytes),
                ("traced (fake tensors)", self.traced_bytes),
                ("analytic (formulas)", self.analytic_bytes),
            )
        ]

    def _table(self) -> Table:
        table = Table(["method", "peak tensor bytes", "vs measured"])
        for r in self.records():
            err = r["error_vs_measured"]
            table.add(
                r["method"],
                fmt_bytes(r["bytes"]) if r["bytes"] is not None else "-",
                "-" if err is None else f"{err:+.1%}",
            )
        return table

    @property
    def methods(self) -> list[dict[str, Any]]:
        return self.records()

    def content(self) -> list[Block]:
        head = f"one training step of {self.model}, batch {self.batch_shape}"
        return [Title(head), self._table(), Line(self.trace_note)]


def _shape_text(batch: Any) -> str:
    shapes = [tuple(t.shape) for t in tensors_in(batch)]
    return ", ".join(str(list(s)) for s in shapes) or "-"


def compare_step(
    module: nn.Module,
    batch: Any,
    *,
    optimizer: str = "adamw",
    loss_fn: Callable[..., torch.Tensor] | None = None,
    estimate: MemoryEstimate | None = None,
) -> StepComparison:
    """Run one real CPU step of *module* on *batch*; measured beside traced and analytic."""
    if not isinstance(module, nn.Module):
        raise UserInputError(
            f"compare needs a torch.nn.Module, got {type(module).__name__}; "
            "nbgpu.estimate(...) takes counts, names and configs"
        )
    tensors = tensors_in(batch)
    if not tensors:
        raise UserInputError("batch: expected a tensor, or a tuple/dict of tensors")
    note = ""
    traced: int | None = None
    try:
        # Same step as measured: CPU defaults (per-tensor optimizer loop), module dtype.
        peak = trace_step(module, batch, optimizer=optimizer, loss_fn=loss_fn, foreach=False)
        traced = peak.total
        note = f"traced with {TOOL} in {peak.seconds:.2f} s"
    except Exception as exc:  # noqa: BLE001
        note = f"traced: failed ({failure_reason(exc)})"
    start = time.perf_counter()
    measured = measure_step(module, batch, optimizer=optimizer, loss_fn=loss_fn)
    seconds = time.perf_counter() - start
    analytic = None
    if estimate is not None:
        analytic = sum(
            t.bytes_per_gpu or 0
            for t in estimate.terms
            if t.kind in ("model states", "activations") and t.bytes_per_gpu is not None
        )
    note += f"; measured with torch.profiler (profile_memory) in {seconds:.2f} s"
    return StepComparison(
        model=f"{type(module).__name__} ({sum(p.numel() for p in module.parameters()):,} "
        "parameters)",
        batch_shape=_shape_text(batch),
        measured_bytes=measured,
        traced_bytes=traced,
        analytic_bytes=analytic,
        trace_note=note,
        measure_seconds=seconds,
    )
