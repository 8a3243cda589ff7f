"""Per-GPU memory before anything runs: **analytic** terms always, and for a live
``torch.nn.Module`` **traced** ones from one step under fake tensors (the activations are
the module's, not a formula's; when tracing fails the analytic answer stands, with the
reason). Activations, logits and the KV cache grow linearly with the micro batch and
nothing else does, so the largest micro batch within a budget is one division: no
out-of-memory trials. Never imports torch, except ``trace`` when a module is given.
"""

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
    parse_offload,
)
from nbgpu.estimate.result import FRAGMENTATION, PER_SAMPLE, ROLES, Layout, MemoryEstimate, Term
from nbgpu.estimate.shapes import ModelShape, model_shape
from nbgpu.sizes import fmt_bytes, parse_size

__all__ = ["compare", "estimate_memory", "largest_micro_batch", "parse_bytes"]

#: What an answer without a budget is held to: an H100's 80 GB (the usual training GPU),
#: then each larger one (NVIDIA's data sheets: H200 141 GB, HGX B200 1,440 GB for 8 GPUs,
#: B300 288 GB of HBM3e).
GPU_MEMORY = (("H100", 80 * 10**9), ("H200", 141 * 10**9), ("B200", 180 * 10**9),
              ("B300", 288 * 10**9))  # fmt: skip


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
    grad_dtype: str | None = None,
    offload: Any = None,
    gpus_per_node: int | None = None,
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
    fp32), ``grad_dtype`` (never below precision), ``optimizer`` (adamw, adam, sgd), ``strategy``
    (ddp, zero1, zero2, zero3, fsdp; distopt: Megatron-LM's distributed optimizer), ``offload``
    ("optimizer", "params" or both; host memory per rank and per node of ``gpus_per_node``),
    ``role`` ("train" or "inference"), ``kv_tokens`` (inference: KV-cache tokens per GPU),
    ``budget`` (bytes or "80GB": the largest micro batch within it, or the smallest change).
    """
    asked = {k: v for k, v in locals().items() if k not in ("model", "budget", "trace")}
    if micro_batch is None:
        micro_batch = _batch_size(example_input) or 1
    role = choose("role", role, ROLES)
    strategy = choose("strategy", strategy, STRATEGIES)
    optimizer = choose("optimizer", optimizer, OPTIMIZERS)
    moved = parse_offload(offload, role, strategy)
    optional = ("seq_len", "kv_tokens", "gpus_per_node")
    for label in ("world_size", "tensor_parallel", "pipeline_parallel", *optional):
        if asked[label] is not None or label not in optional:
            check_count(f"{label}=", asked[label])
    check_count("micro_batch=", micro_batch)
    model_parallel = tensor_parallel * pipeline_parallel
    if world_size % model_parallel:
        raise UserInputError(
            f"world_size={world_size} is not a multiple of tensor_parallel × pipeline_parallel "
            f"= {model_parallel}; expected world = dp × tp × pp"
        )
    if not 0 <= fragmentation < 1:
        raise UserInputError(f"fragmentation={fragmentation!r}: expected a fraction in [0, 1)")
    flags = ("activation_checkpointing", "flash_attention", "gradient_as_bucket_view", "foreach")
    lay = Layout(
        role=role,
        precision=normalize_precision(precision),
        optimizer=optimizer,
        strategy=strategy,
        data_parallel=world_size // model_parallel,
        micro_batch=micro_batch,
        fragmentation=float(fragmentation),
        grad_dtype=normalize_precision(grad_dtype or precision, "grad_dtype"),
        offload=moved,
        gpus_per_node=min(gpus_per_node or world_size, world_size),
        **{k: asked[k] for k in ("world_size", "tensor_parallel", "pipeline_parallel")},
        **{k: asked[k] for k in ("seq_len", "kv_tokens")},
        **{k: bool(asked[k]) for k in flags},
    )
    shape = model_shape(model)
    budget_bytes = None if budget is None else parse_bytes(budget)
    terms = analytic_terms(shape, lay)
    traced: tuple[Term, ...] = ()
    note = ""
    module = all(callable(getattr(model, name, None)) for name in ("parameters", "forward"))
    trace = module if trace is None else trace
    if trace and (moved or not module):
        why = "offload is analytic only" if moved else "tracing needs a live torch.nn.Module"
        note = f"traced: not tried ({why}; analytic used)"
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
        # None: nothing we could compute scales with the batch; 0: not even the fixed part fits.
        slope = per_sample / lay.micro_batch
        best = max(0, math.floor((budget_bytes - fixed) / slope)) if slope > 0 else None
        result = replace(result, max_micro_batch=0 if fixed > budget_bytes else best)
    return _held_to_memory(shape, result, budget_bytes)


def _held_to_memory(
    shape: ModelShape, result: MemoryEstimate, budget_bytes: int | None
) -> MemoryEstimate:
    """*result*, with a note when it does not fit *budget_bytes*: the smallest change that
    does. Without a budget it is held to an H100, and a change sought that fits one (or
    any GPU, if none holds it)."""
    if result.total_bytes <= (budget_bytes or GPU_MEMORY[0][1]):
        return result
    if budget_bytes:
        return replace(result, notes=(*result.notes, _smallest_change(shape, result, budget_bytes)))
    holds = [(name, size) for name, size in GPU_MEMORY if size >= result.total_bytes]
    name, size = holds[0] if holds else GPU_MEMORY[-1]
    target = GPU_MEMORY[0][1] if holds else size
    said = f"{fmt_bytes(result.total_bytes)} per GPU " + (
        f"is more than an H100's 80 GB (the {name}'s {size // 10**9} GB and larger GPUs hold it)"
        if holds
        else f"fits no GPU (the largest, {name}, has {size // 10**9} GB)"
    )
    change = _smallest_change(shape, result, target)
    return replace(result, notes=(*result.notes, f"{said}; {change}"))


def _smallest_change(shape: ModelShape, result: MemoryEstimate, limit: int) -> str:
    """The least disruptive single change whose analytic total fits *limit* bytes per GPU
    (the layout, re-summed)."""
    lay, best = result.layout, result.max_micro_batch
    train, shards = lay.role == "train", sum(STRATEGIES[lay.strategy])
    changes: list[dict[str, Any]] = [{"micro_batch": best}] if best else []
    if train:
        changes += [] if lay.activation_checkpointing else [{"activation_checkpointing": True}]
        stages, moves = ("zero1", "zero2", "zero3"), (("optimizer",), ("optimizer", "params"))
        changes += [{"strategy": z} for z in stages if sum(STRATEGIES[z]) > shards]
        changes += [{"strategy": "zero3", "offload": what} for what in moves]
    for k in (2, 4, 8, 16, 32, 64):  # more GPUs: ZeRO-3 for training, tensor parallel to serve
        more = {"strategy": "zero3"} if train else {"tensor_parallel": lay.tensor_parallel * k}
        changes.append({"world_size": lay.world_size * k, **more})
    for change in changes:
        new = replace(lay, **change)
        new = replace(new, data_parallel=new.world_size // new.model_parallel)
        total = replace(result, terms=analytic_terms(shape, new), traced_terms=()).total_bytes
        if total <= limit:
            pairs = change.items()
            said = [f"{k}={'+'.join(v) if isinstance(v, tuple) else v!r}" for k, v in pairs]
            fits = "" if result.budget_bytes else f" {limit // 10**9} GB"
            return f"smallest change that fits{fits}: " + ", ".join(said)
    return "no single change fits: combine them (checkpointing, ZeRO-3, offload, up to 64× GPUs)"


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
        left = (first.budget_bytes or 0) - first.total_bytes  # bytes to spare at b0
        best = b0 + math.floor(left / slope) if slope > 0 else None
    if best is None:
        raise UserInputError(
            "largest micro batch: nothing in this estimate grows with the batch; pass seq_len "
            "and a model with a shape (a name, an HF config.json or a module)"
        )
    if best < 1:  # not one sample: the first estimate says so, with the smallest change
        return replace(first, max_micro_batch=0)
    final = at(best)
    # A trace is close to, not exactly, affine (the peak can move between the forward
    # pass and the optimizer step): from the guess, step up in doubling steps while it
    # fits, or take the first estimate as the floor, then halve the gap to one that does
    # not fit (a tiny model's answer can be millions of samples).
    low, fitting, high = (best, final, None) if final.fits else (0, None, best)
    if not final.fits and first.fits and first.layout.micro_batch < best:
        low, fitting = first.layout.micro_batch, first
    step = 1
    while high is None and first.traced_terms:
        above = at(low + step)
        if not above.fits:
            high = low + step
        else:
            low, fitting, step = low + step, above, 2 * step
    while high is not None and high - low > 1:
        middle = at((low + high) // 2)
        if middle.fits:
            low, fitting = middle.layout.micro_batch, middle
        else:
            high = middle.layout.micro_batch
    best, final = (low, fitting) if fitting else (1, at(1))
    how = "fake-tensor traces" if first.traced_terms else "analytic evaluations"
    note = f"largest micro batch found with {len(evaluations)} {how}, 0 real steps"
    return replace(final, max_micro_batch=best, notes=(*final.notes, note))


def compare(
    module: Any, batch: Any, *, optimizer: str = "adamw", loss_fn: Any = None, **kwargs: Any
) -> Any:
    """One real CPU step of *module* on *batch*: measured peak beside both estimates."""
    from nbgpu.estimate.trace import compare_step  # noqa: PLC0415  (imports torch)

    # The analytic micro batch is the batch's dim 0; the precision, the module's fp32.
    kwargs.setdefault("precision", "fp32")
    analytic = estimate_memory(
        module, optimizer=optimizer, trace=False, example_input=batch, **kwargs
    )
    return compare_step(module, batch, optimizer=optimizer, loss_fn=loss_fn, estimate=analytic)
