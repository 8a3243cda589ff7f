"""Traced and measured memory of one training step of a live ``torch.nn.Module``.

**Traced** (:func:`trace_terms`): a copy of the module whose parameters and buffers are
*fake tensors* (``FakeTensorMode``: shapes and dtypes without bytes) runs one forward +
backward + optimizer step under PyTorch's own ``MemTracker``. Nothing real is allocated, so a
100M-parameter model traces in seconds on a laptop CPU. Pitfalls (memory.md §3): the copy is
``deepcopy(module, memo)`` with every real tensor mapped to its fake twin (``deepcopy`` under fake
mode would re-use real storage); dtypes change *after* fakeifying, so no real bf16 copy is made;
fake tensors stay on the CPU device (a CPU build lacks fake CUDA backward kernels); ``foreach`` is
chosen explicitly: PyTorch picks it on CUDA only, and it holds whole-list temporaries at the peak.

**Measured** (:func:`measure_step`, :func:`compare_step`): the same step run for real on
the CPU under ``torch.profiler`` with ``profile_memory=True``, whose memory timeline (the
c10 CPU allocator's own allocation and free events) gives the peak of live tensor bytes.

Imports torch at module level: the estimator imports this only when given a module. Never
imports IPython, pynvml or the inventory, and never moves a tensor to a GPU.
"""

import copy
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import astuple, dataclass, replace
from itertools import accumulate
from typing import Any

import torch
from torch import nn

from nbgpu.errors import UserInputError
from nbgpu.estimate.formulas import STRATEGIES
from nbgpu.estimate.result import Layout, MemoryEstimate, StepComparison, Term
from nbgpu.estimate.shapes import TORCH_DTYPES
from nbgpu.sizes import fmt_bytes

__all__ = ["StepComparison", "TracedPeak", "compare_step", "measure_step", "run_step", "trace_step",
           "trace_terms"]  # fmt: skip

TOOL = "torch.distributed._tools.mem_tracker.MemTracker under FakeTensorMode"


def _make_optimizer(name: str, params: Any, foreach: bool) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=foreach)
    adam = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    return adam(params, lr=1e-3, foreach=foreach)


def _default_loss(output: Any, _batch: Any = None) -> torch.Tensor:
    """The loss of a step whose output has no ``loss``: mean square in fp32."""
    if hasattr(output, "loss") and output.loss is not None:
        return output.loss  # type: ignore[no-any-return]
    if isinstance(output, Mapping):
        output = output.get("loss", output.get("logits", next(iter(output.values()))))
    if isinstance(output, tuple | list):
        output = output[0]
    if hasattr(output, "logits"):
        output = output.logits
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"cannot make a loss from a {type(output).__name__}; pass loss_fn=")
    return output.float().square().mean()


def run_step(
    module: nn.Module,
    batch: Any,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., torch.Tensor] | None,
) -> None:
    """One training step; the optimizer's first step creates its state, as in real runs."""
    if isinstance(batch, Mapping):
        output = module(**batch)
    else:
        output = module(*batch) if isinstance(batch, tuple | list) else module(batch)
    loss = (loss_fn or _default_loss)(output, batch)
    loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _fake_batch(value: Any, micro_batch: int | None, mode: Any, dtype: torch.dtype | None) -> Any:
    """The example batch as fake tensors, dim 0 set to *micro_batch*, floats in *dtype*."""
    if isinstance(value, torch.Tensor):
        shape = list(value.shape)
        if micro_batch is not None and shape:
            shape[0] = micro_batch
        with mode:
            if value.dtype.is_floating_point:
                return torch.empty(shape, dtype=dtype or value.dtype)
            return torch.zeros(shape, dtype=value.dtype)
    if isinstance(value, Mapping):
        return {k: _fake_batch(v, micro_batch, mode, dtype) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(_fake_batch(v, micro_batch, mode, dtype) for v in value)
    return value


def _example(module: nn.Module, example_input: Any, micro_batch: int, seq_len: int | None) -> Any:
    if example_input is not None:
        return example_input
    config = getattr(module, "config", None)
    vocab = getattr(config, "vocab_size", None) or getattr(module, "vocab_size", None)
    if isinstance(vocab, int) and seq_len is not None:
        return torch.zeros((micro_batch, seq_len), dtype=torch.long, device="meta")
    raise UserInputError(
        f"tracing {type(module).__name__} needs example_input= (a tensor, tuple or dict with "
        "the batch in dim 0), or seq_len= for a token model with config.vocab_size"
    )


@dataclass(frozen=True)
class TracedPeak:
    """Bytes per category at the traced step's peak (``MemTracker``'s categories)."""

    parameters: int
    buffers: int
    gradients: int
    activations: int
    temporaries: int
    optimizer: int
    other: int  # inputs and tensors the tracker could not attribute
    seconds: float

    @property
    def total(self) -> int:
        return int(sum(astuple(self)[:-1]))  # every category (seconds is the last field)


def _fake_twin(tensor: torch.Tensor, mode: Any, dtype: torch.dtype | None) -> torch.Tensor:
    if tensor.device.type == "meta":
        # A module built under ``torch.device("meta")`` has no data at all: its fake twin
        # is a CPU-device fake tensor of the same shape (nothing real either way).
        with mode:
            fake = torch.empty(tensor.shape, dtype=tensor.dtype)
    else:
        fake = mode.from_tensor(tensor.detach())
    if dtype is not None and tensor.is_floating_point():
        with mode:
            fake = fake.to(dtype)  # after fakeifying: no real copy is made
    return fake


def _fake_module(module: nn.Module, mode: Any, dtype: torch.dtype | None) -> nn.Module:
    memo: dict[int, Any] = {}
    with torch.no_grad():
        for p in module.parameters():
            memo[id(p)] = nn.Parameter(_fake_twin(p, mode, dtype), requires_grad=p.requires_grad)
        for b in module.buffers():
            memo[id(b)] = _fake_twin(b, mode, dtype)
    return copy.deepcopy(module, memo)


def trace_step(
    module: nn.Module,
    example_input: Any,
    *,
    micro_batch: int | None = None,
    optimizer: str = "adamw",
    precision: str | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    foreach: bool = False,
) -> TracedPeak:
    """Peak bytes of one fake training step of *module* (see the module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType  # noqa: PLC0415

    start = time.perf_counter()
    dtype = None if precision is None else getattr(torch, TORCH_DTYPES[precision])
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fake_module = _fake_module(module, mode, dtype)
    batch = _fake_batch(example_input, micro_batch, mode, dtype)
    with mode:
        opt = _make_optimizer(optimizer, fake_module.parameters(), foreach)
        # Step 1 creates the optimizer state; step 2, the steady state every later step
        # repeats (state live through the forward pass), is the one tracked.
        run_step(fake_module, batch, opt, loss_fn)
        tracker = MemTracker()
        tracker.track_external(fake_module, opt)
        with tracker:
            run_step(fake_module, batch, opt, loss_fn)
        snap = tracker.get_tracker_snapshot("peak")
    by_kind: Counter[Any] = sum(map(Counter, snap.values()), Counter())
    # The batch was made outside the tracker: it is live for the whole step.
    inputs = sum(t.nbytes for t in _tensors_in(batch))
    ref = _MemRefType
    return TracedPeak(
        parameters=by_kind[ref.PARAM],
        buffers=by_kind[ref.BUFFER],
        gradients=by_kind[ref.GRAD],
        activations=by_kind[ref.ACT],
        temporaries=by_kind[ref.TEMP],
        optimizer=by_kind[ref.OPT],
        other=by_kind[ref.OTH] + inputs,
        seconds=time.perf_counter() - start,
    )


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, tuple | list):
        return [t for v in value for t in _tensors_in(v)]
    return [value] if isinstance(value, torch.Tensor) else []


def _failure_reason(exc: BaseException) -> str:
    name = type(exc).__name__
    first = (str(exc).strip().splitlines() or [""])[0]
    unsupported = "an operator without a fake (meta) kernel, e.g. a custom CUDA op"
    what = {
        "DataDependentOutputException": "data-dependent control flow (a Python branch on a "
        "tensor's value)",
        "DynamicOutputShapeException": "an output whose shape depends on tensor values",
        "UnsupportedOperatorException": unsupported,
    }.get(name)
    if what is None and ("fake impl" in first or "meta kernel" in first.lower()):
        what = unsupported
    return f"{what}: {name}" if what else f"{name}: {first[:160]}"


def trace_terms(
    module: nn.Module,
    *,
    analytic: Sequence[Term],
    layout: Layout,
    example_input: Any,
    loss_fn: Callable[..., torch.Tensor] | None,
) -> tuple[tuple[Term, ...], str]:
    """Traced per-GPU terms for :func:`nbgpu.estimate.estimate_memory`, and a note."""
    if layout.role != "train":
        return (), "traced: not tried (the traced step is a training step; analytic used)"
    try:
        example = _example(module, example_input, layout.micro_batch, layout.seq_len)
        # foreach=True is PyTorch's default on CUDA, which is what the estimate is for.
        peak = trace_step(
            module,
            example,
            micro_batch=layout.micro_batch,
            optimizer=layout.optimizer,
            precision=layout.precision,
            loss_fn=loss_fn,
            foreach=layout.foreach,
        )
    except UserInputError:
        raise
    except Exception as exc:  # noqa: BLE001  (any failure of the user's code: say why)
        return (), f"traced: failed ({_failure_reason(exc)}); the analytic estimate is the answer"
    n, mp, tp = layout.data_parallel, layout.model_parallel, layout.tensor_parallel
    loop = "foreach" if layout.foreach else "per-tensor"
    src = f"traced: {TOOL} (steady-state step, {loop} optimizer)"
    split = f" / {mp}" if mp > 1 else ""
    states = (
        ("weights", peak.parameters + peak.buffers, "traced params + buffers"),
        ("gradients", peak.gradients, "traced .grad at the peak"),
        ("optimizer states", peak.optimizer, f"traced {layout.optimizer} state"),
    )
    terms = [
        Term(
            name,
            math.ceil(size / (mp * (n if sharded else 1))),
            f"{what}{split}" + (f" / {n}" if sharded and n > 1 else ""),
            src,
            "model states",
        )
        for (name, size, what), sharded in zip(states, STRATEGIES[layout.strategy], strict=True)
    ]
    saved = "traced saved tensors, logits/loss and the batch" + (f" / {tp}" if tp > 1 else "")
    per_sample = (
        ("activations", peak.activations + peak.other, saved),
        ("temporaries", peak.temporaries, "traced transient buffers live at the peak"),
    )
    terms += [
        Term(name, math.ceil(size / tp), what, src, "activations")
        for name, size, what in per_sample
    ]
    tensors = sum(t.bytes_per_gpu or 0 for t in terms)
    for t in analytic:
        if t.kind == "reserve":
            terms.append(t)
        elif t.name == "fragmentation":
            terms.append(replace(t, bytes_per_gpu=math.ceil(layout.fragmentation * tensors)))
    # The sources name the tool (once); the note says what this trace found.
    note = (
        f"traced in {peak.seconds:.2f} s (peak of one step: {fmt_bytes(peak.total)} on one "
        "process before sharding); reserves are analytic"
    )
    return tuple(terms), note


def measure_step(
    module: nn.Module,
    batch: Any,
    *,
    optimizer: str = "adamw",
    loss_fn: Callable[..., torch.Tensor] | None = None,
    foreach: bool = False,
) -> int:
    """Peak live tensor bytes of one real CPU training step: the second, as in :func:`trace_step`
    (parameters, optimizer state and batch count), on a deep copy, so *module* is not trained."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415
    from torch.profiler._memory_profiler import Action  # noqa: PLC0415

    work = copy.deepcopy(module)
    opt = _make_optimizer(optimizer, work.parameters(), foreach)
    run_step(work, batch, opt, loss_fn)  # creates the optimizer state, as in trace_step
    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        run_step(work, batch, opt, loss_fn)
    sign = {Action.PREEXISTING: 1, Action.CREATE: 1, Action.DESTROY: -1}
    steps = (sign.get(action, 0) * size for _, action, _, size in prof._memory_profile().timeline)
    peak: int = max(accumulate(steps, initial=0))
    # Tensors the step never touched (frozen parameters, unused buffers) are still live.
    idle = sum(p.nbytes for p in work.parameters() if not p.requires_grad)
    return peak + idle


def compare_step(
    module: nn.Module,
    batch: Any,
    *,
    optimizer: str = "adamw",
    loss_fn: Callable[..., torch.Tensor] | None = None,
    estimate: MemoryEstimate | None = None,
) -> StepComparison:
    if not isinstance(module, nn.Module):
        raise UserInputError(
            f"compare needs a torch.nn.Module, got {type(module).__name__}; "
            "nbgpu.estimate(...) takes counts, names and configs"
        )
    tensors = _tensors_in(batch)
    if not tensors:
        raise UserInputError("batch: expected a tensor, or a tuple/dict of tensors")
    traced: int | None = None
    try:
        # Same step as measured: CPU defaults (per-tensor optimizer loop), module dtype.
        peak = trace_step(module, batch, optimizer=optimizer, loss_fn=loss_fn, foreach=False)
        traced = peak.total
        note = f"traced with {TOOL} in {peak.seconds:.2f} s"
    except Exception as exc:  # noqa: BLE001
        note = f"traced: failed ({_failure_reason(exc)})"
    start = time.perf_counter()
    measured = measure_step(module, batch, optimizer=optimizer, loss_fn=loss_fn)
    seconds = time.perf_counter() - start
    analytic = None
    if estimate is not None:
        kinds = ("model states", "activations")
        analytic = sum(t.bytes_per_gpu or 0 for t in estimate.terms if t.kind in kinds)
    note += f"; measured with torch.profiler (profile_memory) in {seconds:.2f} s"
    parameters = sum(p.numel() for p in module.parameters())
    return StepComparison(
        model=f"{type(module).__name__} ({parameters:,} parameters)",
        batch_shape=", ".join(str(list(t.shape)) for t in tensors) or "-",
        measured_bytes=measured,
        traced_bytes=traced,
        analytic_bytes=analytic,
        trace_note=note,
        measure_seconds=seconds,
    )
