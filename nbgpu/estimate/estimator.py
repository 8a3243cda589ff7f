"""Per-GPU memory before anything runs: **analytic** terms always, and for a live
``torch.nn.Module`` **traced** ones from one step under fake tensors (the activations are
the module's, not a formula's; when tracing fails the analytic answer stands, with the
reason). Activations, logits and the KV cache grow linearly with the micro batch and
nothing else does, so the largest micro batch within a budget is one division: no
out-of-memory trials. Never imports torch, except ``trace`` when a module is given.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from nbgpu.errors import UserInputError
from nbgpu.estimate.formulas import (
    OPTIMIZERS,
    STRATEGIES,
    analytic_terms,
    check_count,
    choose,
    normalize_precision,
)
from nbgpu.estimate.result import FRAGMENTATION, PER_SAMPLE, ROLES, Layout, MemoryEstimate, Term
from nbgpu.estimate.shapes import ModelShape, model_shape
from nbgpu.sizes import fmt_bytes, parse_size

__all__ = ["compare", "estimate_memory", "largest_micro_batch", "parse_bytes"]


def parse_bytes(value: Any, label: str = "budget") -> int:
    """A byte budget as written (``80e9``, ``"80GB"``, ``"24GiB"``; :mod:`nbgpu.sizes`)."""
    return parse_size(value, f"{label}=")


def _batch_size(example: Any) -> int | None:
    """Dim 0 of the first tensor-like leaf of an example batch (None: no batch given)."""
    if isinstance(example, Mapping):
        example = next(iter(example.values()), None)
    if isinstance(example, tuple | list):
        example = example[0] if example else None
    shape = getattr(example, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) else None


def _describe(model: Any, shape: ModelShape) -> str:
    if shape.config is not None and shape.source not in ("torch module", "HF config"):
        return shape.config.name
    if shape.source == "torch module":
        return f"{type(model).__name__} module"
    if shape.source == "parameter count":
        return f"{shape.parameters / 1e9:.3g}B parameters"
    return shape.source


def estimate_memory(
    model: Any,
    *,
    precision: str = "bf16",
    optimizer: str = "adamw",
    strategy: str = "ddp",
    world_size: int = 1,
    micro_batch: int | None = None,
    seq_len: int | None = None,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    activation_checkpointing: bool = False,
    role: str = "train",
    flash_attention: bool = True,
    gradient_as_bucket_view: bool = False,
    fragmentation: float = FRAGMENTATION,
    kv_tokens: int | None = None,
    budget: Any = None,
    example_input: Any = None,
    loss_fn: Any = None,
    trace: bool | None = None,
    foreach: bool = True,
) -> MemoryEstimate:
    """Per-GPU memory of *model* in named terms, each with its formula and source.

    *model*: a parameter count (``7.5e9``, ``"7B"``), a built-in name
    (``"Qwen/Qwen2.5-7B-Instruct"``), an HF ``config.json`` (path or dict) or a live
    ``torch.nn.Module`` (traced with fake tensors; pass ``example_input=``, a batch with the batch
    in dim 0, unless it is a token model and ``seq_len`` is given). ``precision`` (bf16, fp16,
    fp32), ``optimizer`` (adamw, adam, sgd), ``strategy`` (ddp, zero1, zero2, zero3, fsdp), ``role``
    ("train" or "inference"), ``kv_tokens`` (inference: KV-cache tokens per GPU), ``budget`` (bytes
    or "80GB": adds the largest micro batch within it).
    """
    if micro_batch is None:
        micro_batch = _batch_size(example_input) or 1
    role = choose("role", role, ROLES)
    strategy = choose("strategy", strategy, STRATEGIES)
    optimizer = choose("optimizer", optimizer, OPTIMIZERS)
    counts = {
        "world_size": world_size,
        "micro_batch": micro_batch,
        "seq_len": seq_len,
        "tensor_parallel": tensor_parallel,
        "pipeline_parallel": pipeline_parallel,
        "kv_tokens": kv_tokens,
    }
    for label, count in counts.items():
        if count is not None or label not in ("seq_len", "kv_tokens"):
            check_count(f"{label}=", count)
    model_parallel = tensor_parallel * pipeline_parallel
    if world_size % model_parallel:
        raise UserInputError(
            f"world_size={world_size} is not a multiple of tensor_parallel × pipeline_parallel "
            f"= {model_parallel}; expected world = dp × tp × pp"
        )
    if not 0 <= fragmentation < 1:
        raise UserInputError(f"fragmentation={fragmentation!r}: expected a fraction in [0, 1)")
    lay = Layout(
        role=role,
        precision=normalize_precision(precision),
        optimizer=optimizer,
        strategy=strategy,
        world_size=world_size,
        data_parallel=world_size // model_parallel,
        tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel,
        micro_batch=micro_batch,
        seq_len=seq_len,
        activation_checkpointing=bool(activation_checkpointing),
        flash_attention=bool(flash_attention),
        gradient_as_bucket_view=bool(gradient_as_bucket_view),
        fragmentation=float(fragmentation),
        kv_tokens=kv_tokens,
        foreach=bool(foreach),
    )
    shape = model_shape(model)
    budget_bytes = None if budget is None else parse_bytes(budget)
    terms = analytic_terms(shape, lay)
    traced: tuple[Term, ...] = ()
    note = ""
    module = all(callable(getattr(model, name, None)) for name in ("parameters", "forward"))
    trace = module if trace is None else trace
    if trace and not module:
        note = "traced: not tried (tracing needs a live torch.nn.Module; analytic used)"
    elif trace:
        from nbgpu.estimate.trace import trace_terms  # noqa: PLC0415  (imports torch)

        traced, note = trace_terms(
            model, analytic=terms, layout=lay, example_input=example_input, loss_fn=loss_fn
        )
    result = MemoryEstimate(
        model=_describe(model, shape),
        parameters=shape.parameters,
        layout=lay,
        terms=terms,
        traced_terms=traced,
        trace_note=note,
        budget_bytes=budget_bytes,
    )
    if budget_bytes is not None:
        # Bytes that scale with the micro batch, plus the margin's share of them.
        per_sample = sum(t.bytes_per_gpu or 0 for t in (traced or terms) if t.name in PER_SAMPLE)
        frag = result.term("fragmentation")
        kinds = ("model states", "activations", "kv")
        tensors = sum(t.bytes_per_gpu or 0 for t in terms if t.kind in kinds)
        if not traced and frag is not None and frag.bytes_per_gpu and tensors:
            per_sample += round(frag.bytes_per_gpu * per_sample / tensors)
        fixed = result.total_bytes - per_sample
        if fixed > budget_bytes:
            weights = result.term("weights")
            raise UserInputError(
                f"budget={fmt_bytes(budget_bytes)} per GPU is smaller than what "
                f"{'training' if lay.role == 'train' else 'serving'} needs before any sample "
                f"({fmt_bytes(fixed)}: weights "
                f"{fmt_bytes(weights.bytes_per_gpu if weights else None)}, optimizer and "
                "reserves); expected a budget above that, more GPUs or a sharded strategy"
            )
        # None: nothing we could compute scales with the batch.
        slope = per_sample / lay.micro_batch
        best = max(0, math.floor((budget_bytes - fixed) / slope)) if slope > 0 else None
        result = replace(result, max_micro_batch=best)
    return result


def largest_micro_batch(model: Any, budget: Any, **kwargs: Any) -> MemoryEstimate:
    """The estimate at the largest micro batch that fits *budget* (bytes, or per-GPU list).

    Of a list of per-GPU free bytes the smallest decides: data-parallel ranks run the same
    micro batch. Never tried on hardware: a traced module is traced at b and 2b for the
    slope, then checked with fake traces.
    """
    if isinstance(budget, list | tuple):
        if not budget:
            raise UserInputError("budget=[]: expected at least one GPU's free bytes")
        budget = min(parse_bytes(b, "budget") for b in budget)
    kwargs.setdefault("micro_batch", 1)
    evaluations: list[int | None] = []  # the micro batches estimated

    def at(micro: int | None) -> MemoryEstimate:
        evaluations.append(micro)
        return estimate_memory(model, budget=budget, **{**kwargs, "micro_batch": micro})

    first = at(kwargs["micro_batch"])
    best = first.max_micro_batch
    if first.traced_terms:
        b0 = first.layout.micro_batch
        slope = (at(2 * b0).total_bytes - first.total_bytes) / b0
        best = None
        if slope > 0:
            fixed = first.total_bytes - slope * b0
            best = max(0, math.floor(((first.budget_bytes or 0) - fixed) / slope))
    if best is None:
        raise UserInputError(
            "largest micro batch: nothing in this estimate grows with the batch; pass seq_len "
            "and a model with a shape (a name, an HF config.json or a module)"
        )
    if best < 1:
        raise UserInputError(
            f"budget={fmt_bytes(first.budget_bytes)} per GPU holds no sample: micro_batch="
            f"{first.layout.micro_batch} needs {fmt_bytes(first.total_bytes)}; expected a larger "
            "budget, activation checkpointing or a shorter seq_len"
        )
    final = at(best)
    # A trace is close to, not exactly, affine (the peak can move between the forward
    # pass and the optimizer step): halve the gap down to one that fits (a tiny model's
    # answer can be millions of samples), then step up while it still does.
    if final.fits is False:
        fitting = first if first.fits and first.layout.micro_batch < best else None
        low, high = (fitting.layout.micro_batch if fitting else 0), best
        while high - low > 1:
            middle = at((low + high) // 2)
            if middle.fits:
                low, fitting = middle.layout.micro_batch, middle
            else:
                high = middle.layout.micro_batch
        best, final = (low, fitting) if fitting else (1, at(1))
    if first.traced_terms:
        for _ in range(8):
            above = at(best + 1)
            if not above.fits:
                break
            best, final = best + 1, above
    how = "fake-tensor traces" if first.traced_terms else "analytic evaluations"
    note = f"largest micro batch found with {len(evaluations)} {how}, 0 real steps"
    return replace(final, max_micro_batch=best, notes=(*final.notes, note))


def compare(module: Any, batch: Any, **kwargs: Any) -> Any:
    """One real CPU step of *module* on *batch*: measured peak beside both estimates."""
    from nbgpu.estimate.trace import compare_step  # noqa: PLC0415  (imports torch)

    optimizer = kwargs.pop("optimizer", "adamw")
    loss_fn = kwargs.pop("loss_fn", None)
    # The analytic micro batch is the batch's dim 0.
    analytic = estimate_memory(
        module,
        optimizer=optimizer,
        trace=False,
        example_input=batch,
        precision=kwargs.pop("precision", "fp32"),
        **kwargs,
    )
    return compare_step(module, batch, optimizer=optimizer, loss_fn=loss_fn, estimate=analytic)
