"""Traced and measured memory of one training step of a live ``torch.nn.Module``.

**Traced** (:func:`trace_terms`): a structural copy of the module whose parameters and
buffers are *fake tensors* (``torch._subclasses.FakeTensorMode``: shapes, dtypes and
storages without bytes) runs one forward + backward + optimizer step under PyTorch's own
tracker, ``torch.distributed._tools.mem_tracker.MemTracker`` (parameters, buffers,
gradients, activations, temporaries, optimizer state at the peak). Nothing real is
allocated, so a 100M-parameter model traces in seconds on a laptop CPU.

Pitfalls handled (memory.md §3 and PyTorch issues):

- the copy is built with ``deepcopy(module, memo)`` where the memo maps every real parameter
  and buffer to its fake twin: ``deepcopy`` under fake mode would try to re-use real storage;
- dtype conversion happens *after* fakeifying (``fake.to(bf16)``), so no real bf16 copy is
  ever made;
- fake tensors stay on the CPU device: a CPU build has no fake CUDA backward for several
  ops, and device-dependent defaults would differ anyway;
- optimizers: ``foreach`` is chosen explicitly (PyTorch picks foreach on CUDA, the per-tensor
  loop on CPU): the foreach path holds whole-list temporaries at the step's peak.

**Measured**: the same step run for real on the CPU (``measure.py``).

Imports torch at module level: only :mod:`nbgpu.estimate.estimator` imports this, and only when
it is given a module. Never imports IPython, pynvml or the inventory, and never moves a
tensor to a GPU.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nbgpu._render import fmt_bytes
from nbgpu.errors import UserInputError
from nbgpu.estimate.result import Term

if TYPE_CHECKING:
    from nbgpu.estimate.formulas import Layout

__all__ = [
    "TracedPeak",
    "default_loss",
    "failure_reason",
    "make_optimizer",
    "run_step",
    "tensor_bytes",
    "tensors_in",
    "trace_step",
    "trace_terms",
]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOOL = "torch.distributed._tools.mem_tracker.MemTracker under FakeTensorMode"


# -------------------------------------------------------------------------- the step


def make_optimizer(name: str, params: Any, foreach: bool) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=foreach)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3, foreach=foreach)
    return torch.optim.AdamW(params, lr=1e-3, foreach=foreach)


def default_loss(output: Any, _batch: Any = None) -> torch.Tensor:
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


def _call(module: nn.Module, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return module(**batch)
    if isinstance(batch, tuple | list):
        return module(*batch)
    return module(batch)


def run_step(
    module: nn.Module,
    batch: Any,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., torch.Tensor] | None,
) -> None:
    """One training step; the optimizer's first step creates its state, as in real runs."""
    output = _call(module, batch)
    loss = (loss_fn or default_loss)(output, batch)
    # torch types Tensor.backward without annotations.
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------- the inputs


def _resize(value: Any, micro_batch: int | None, make: Callable[..., torch.Tensor]) -> Any:
    """The example batch with dim 0 set to *micro_batch*, made by *make* (fake or real)."""
    if isinstance(value, torch.Tensor):
        shape = list(value.shape)
        if micro_batch is not None and shape:
            shape[0] = micro_batch
        return make(shape, value.dtype)
    if isinstance(value, Mapping):
        return {k: _resize(v, micro_batch, make) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(_resize(v, micro_batch, make) for v in value)
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


def _fake_factory(mode: Any, dtype: torch.dtype | None) -> Callable[..., torch.Tensor]:
    def make(shape: Sequence[int], like: torch.dtype) -> torch.Tensor:
        with mode:
            if like.is_floating_point:
                return torch.empty(shape, dtype=dtype or like)
            return torch.zeros(shape, dtype=like)

    return make


# ----------------------------------------------------------------------------- trace


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
        return (
            self.parameters
            + self.buffers
            + self.gradients
            + self.activations
            + self.temporaries
            + self.optimizer
            + self.other
        )


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
    dtype = None if precision is None else _DTYPES[precision]
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fake_module = _fake_module(module, mode, dtype)
    batch = _resize(example_input, micro_batch, _fake_factory(mode, dtype))
    with mode:
        opt = make_optimizer(optimizer, fake_module.parameters(), foreach)
        # Step 1 creates the optimizer state; step 2, the steady state every later step
        # repeats (state live through the forward pass), is the one tracked.
        run_step(fake_module, batch, opt, loss_fn)
        tracker = MemTracker()
        tracker.track_external(fake_module, opt)
        with tracker:
            run_step(fake_module, batch, opt, loss_fn)
        snap = tracker.get_tracker_snapshot("peak")
    by_kind: dict[Any, int] = {}
    for per_device in snap.values():
        for key, value in per_device.items():
            by_kind[key] = by_kind.get(key, 0) + value
    inputs = sum(tensor_bytes(t) for t in tensors_in(batch))
    return TracedPeak(
        parameters=by_kind.get(_MemRefType.PARAM, 0),
        buffers=by_kind.get(_MemRefType.BUFFER, 0),
        gradients=by_kind.get(_MemRefType.GRAD, 0),
        activations=by_kind.get(_MemRefType.ACT, 0),
        temporaries=by_kind.get(_MemRefType.TEMP, 0),
        optimizer=by_kind.get(_MemRefType.OPT, 0),
        # The batch was made outside the tracker: it is live for the whole step.
        other=by_kind.get(_MemRefType.OTH, 0) + inputs,
        seconds=time.perf_counter() - start,
    )


def tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in tensors_in(v)]
    if isinstance(value, tuple | list):
        return [t for v in value for t in tensors_in(v)]
    return []


def tensor_bytes(t: torch.Tensor) -> int:
    return int(t.numel() * t.element_size())


def failure_reason(exc: BaseException) -> str:
    name = type(exc).__name__
    first = (str(exc).strip().splitlines() or [""])[0]
    hints = {
        "DataDependentOutputException": "data-dependent control flow (a Python branch on a "
        "tensor's value)",
        "DynamicOutputShapeException": "an output whose shape depends on tensor values",
        "UnsupportedOperatorException": "an operator without a fake (meta) kernel, e.g. a "
        "custom CUDA op",
    }
    what = hints.get(name)
    if what is None and ("fake impl" in first or "meta kernel" in first.lower()):
        what = hints["UnsupportedOperatorException"]
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
        peak = trace_step(
            module,
            example,
            micro_batch=layout.micro_batch,
            optimizer=layout.optimizer,
            precision=layout.precision,
            loss_fn=loss_fn,
            # True: PyTorch's default on CUDA, which is what the estimate is for.
            foreach=layout.foreach,
        )
    except UserInputError:
        raise
    except Exception as exc:  # noqa: BLE001  (any failure of the user's code: say why)
        return (), f"traced: failed ({failure_reason(exc)}); the analytic estimate is the answer"
    n, mp = layout.data_parallel, layout.tp * layout.pp
    shard_p = n if layout.strategy in ("zero3", "fsdp") else 1
    shard_g = n if layout.strategy in ("zero2", "zero3", "fsdp") else 1
    shard_k = n if layout.strategy != "ddp" else 1
    loop = "foreach" if layout.foreach else "per-tensor"
    src = f"traced: {TOOL} (steady-state step, {loop} optimizer)"
    split = f" / {mp}" if mp > 1 else ""
    terms: list[Term] = [
        Term(
            "weights",
            math.ceil((peak.parameters + peak.buffers) / (mp * shard_p)),
            f"traced params + buffers{split}" + (f" / {n}" if shard_p > 1 else ""),
            src,
            "model states",
        ),
        Term(
            "gradients",
            math.ceil(peak.gradients / (mp * shard_g)),
            f"traced .grad at the peak{split}" + (f" / {n}" if shard_g > 1 else ""),
            src,
            "model states",
        ),
        Term(
            "optimizer states",
            math.ceil(peak.optimizer / (mp * shard_k)),
            f"traced {layout.optimizer} state{split}" + (f" / {n}" if shard_k > 1 else ""),
            src,
            "model states",
        ),
        Term(
            "activations",
            math.ceil((peak.activations + peak.other) / layout.tp),
            "traced saved tensors, logits/loss and the batch"
            + (f" / {layout.tp}" if layout.tp > 1 else ""),
            src,
            "activations",
        ),
        Term(
            "temporaries",
            math.ceil(peak.temporaries / layout.tp),
            "traced transient buffers live at the peak",
            src,
            "activations",
        ),
    ]
    tensors = sum(t.bytes_per_gpu or 0 for t in terms)
    for t in analytic:
        if t.kind == "reserve":
            terms.append(t)
        elif t.name == "fragmentation":
            terms.append(replace(t, bytes_per_gpu=math.ceil(layout.fragmentation * tensors)))
    note = (
        f"traced with {TOOL} in {peak.seconds:.2f} s (peak of one step: "
        f"{fmt_bytes(peak.total)} on one process before sharding); reserves are analytic"
    )
    return tuple(terms), note
