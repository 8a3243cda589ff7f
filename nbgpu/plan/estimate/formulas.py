"""The analytic terms: model states by ZeRO stage, activations, per-sample buffers
(logits, KV cache) and the reserves (CUDA context, NCCL, DDP buckets, fragmentation).

Pure arithmetic on a model shape and a layout; never imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nbgpu._render import fmt_bytes
from nbgpu.plan.estimate.terms import (
    CUDA_CONTEXT_BYTES,
    NCCL_BYTES_PER_GROUP,
    SRC_ACT,
    SRC_CTX,
    SRC_DDP,
    SRC_FRAG,
    SRC_KV,
    SRC_LOGITS,
    SRC_NCCL,
    SRC_ZERO,
    Term,
)
from nbgpu.plan.memory import (
    PRECISIONS,
    ModelShape,
    model_states,
)
from nbgpu.plan.models import ModelConfig

__all__ = ["Layout", "analytic_terms"]


# -------------------------------------------------------------------------- formulas


@dataclass(frozen=True)
class Layout:
    role: str
    precision: str
    optimizer: str
    strategy: str
    world_size: int
    data_parallel: int
    tp: int
    pp: int
    micro_batch: int
    seq_len: int | None
    checkpointing: bool
    flash_attention: bool
    gradient_as_bucket_view: bool
    fragmentation: float
    kv_tokens: int | None  # KV-cache tokens per GPU (inference); None: micro × seq
    foreach: bool = True  # traced optimizer: PyTorch's CUDA default (False: its CPU default)


def _model_state_terms(shape: ModelShape, lay: Layout) -> list[Term]:
    if lay.role == "inference":
        size = PRECISIONS[lay.precision]
        shard = lay.tp * lay.pp
        return [
            Term(
                "weights",
                math.ceil(size * shape.parameters / shard),
                f"{size} B × Ψ" + (f" / (tp·pp = {shard})" if shard > 1 else ""),
                "weights at the serving precision",
                "model states",
            )
        ]
    states = model_states(
        shape.parameters,
        strategy=lay.strategy,
        precision=lay.precision,
        optimizer=lay.optimizer,
        data_parallel=lay.data_parallel,
        tensor_parallel=lay.tp,
        pipeline_parallel=lay.pp,
    )
    acc = states.accounting
    psi = "Ψ" if states.model_parallel == 1 else f"Ψ/{states.model_parallel}"
    n = lay.data_parallel
    p_sh = lay.strategy in ("zero3", "fsdp")
    g_sh = lay.strategy in ("zero2", "zero3", "fsdp")
    k_sh = lay.strategy != "ddp"
    src = f"{SRC_ZERO}; {acc.text}"
    return [
        Term(
            "weights",
            states.params_bytes,
            f"{acc.param_bytes} B × {psi}" + (f" / {n}" if p_sh else ""),
            src,
            "model states",
        ),
        Term(
            "gradients",
            states.grads_bytes,
            f"{acc.grad_bytes} B × {psi}" + (f" / {n}" if g_sh else ""),
            src,
            "model states",
        ),
        Term(
            "optimizer states",
            states.optimizer_bytes,
            f"{acc.optimizer_bytes} B × {psi}" + (f" / {n}" if k_sh else ""),
            src,
            "model states",
        ),
    ]


def _activation_bytes(cfg: ModelConfig, lay: Layout, b: int, s: int) -> tuple[int, str]:
    """Korthikanti et al.'s per-layer activation bytes, generalised to GQA and SwiGLU.

    The paper's 34·sbh splits into 10·sbh every tensor-parallel rank keeps (two norm inputs
    4, attention and MLP inputs 4, two dropout masks 2) and 24·sbh that TP divides: Q, K, V 6
    (K, V shrink by kv_heads/heads with GQA), the attention output 2, and the MLP 16 =
    4·I/h·... with I = 4h (GELU: 2 saved tensors of width I; SwiGLU: 4). Attention scores add
    5·a·s²·b (softmax 2, dropout mask 1, its output 2) unless flash/SDPA attention keeps only
    a fp32 logsumexp (4·a·s·b). Coefficients assume 16-bit activations; fp32 doubles them.
    """
    h, a, t = cfg.hidden_size, cfg.num_attention_heads, lay.tp
    kv_width = cfg.num_kv_heads * cfg.head_dim
    scale = PRECISIONS[lay.precision] / 2
    replicated = 10 * s * b * h
    qkv = 2 * s * b * h + 4 * s * b * kv_width  # Q, K, V saved for the attention product
    attn_out = 2 * s * b * h
    mlp = (8 if cfg.gated_mlp else 4) * s * b * cfg.intermediate_size
    if lay.flash_attention:
        scores = 4 * a * s * b  # fp32 logsumexp per head and token
        scores_text = "4·a·s·b (flash)"
    else:
        scores = 5 * a * s * s * b
        scores_text = "5·a·s²·b"
    per_layer = replicated + (qkv + attn_out + mlp + scores) / t
    layers = cfg.num_layers  # 1F1B: the first stage holds p micro batches × L/p layers
    mlp_text = f"{'8' if cfg.gated_mlp else '4'}·s·b·I"
    tp_text = f"/{t}" if t > 1 else ""
    if lay.checkpointing:
        # Full recompute: each layer keeps its 16-bit input; one layer's activations are
        # rebuilt at a time during the backward pass.
        total = layers * 2 * s * b * h / t + per_layer
        formula = (
            f"L·2·s·b·h{tp_text} + one layer [10·sbh + (2·sbh + 4·sb·kv·hd + 2·sbh + "
            f"{mlp_text} + {scores_text}){tp_text}] (full recompute)"
        )
    else:
        total = layers * per_layer
        formula = f"L·[10·sbh + (2·sbh + 4·sb·kv·hd + 2·sbh + {mlp_text} + {scores_text}){tp_text}]"
    return math.ceil(total * scale), formula


def _per_sample_terms(shape: ModelShape, lay: Layout) -> list[Term]:
    cfg = shape.config
    b, s = lay.micro_batch, lay.seq_len
    terms: list[Term] = []
    if lay.role == "train":
        if cfg is None or s is None:
            why = "needs the model's shape" if cfg is None else "needs seq_len"
            terms.append(Term("activations", None, why, SRC_ACT, "activations"))
            terms.append(Term("logits/loss", None, why, SRC_LOGITS, "activations"))
            return terms
        act, formula = _activation_bytes(cfg, lay, b, s)
        terms.append(Term("activations", act, formula, SRC_ACT, "activations"))
        # Live at once early in the backward pass: the logits (16-bit, plus their fp32
        # upcast for the loss), the fp32 log-softmax kept for backward, and the fp32
        # gradient of the logits being formed (the last seen in traces, bench §7.5).
        per = (PRECISIONS[lay.precision] + 12) if lay.precision != "fp32" else 12
        logits = math.ceil(b * s * cfg.vocab_size * per / lay.tp)
        terms.append(
            Term(
                "logits/loss",
                logits,
                f"b·s·V·{per} B" + (f" / {lay.tp}" if lay.tp > 1 else ""),
                SRC_LOGITS,
                "activations",
            )
        )
        return terms
    # inference
    if not shape.has_kv_shape:
        terms.append(Term("KV cache", None, "needs layers, KV heads, head dim", SRC_KV, "kv"))
        return terms
    assert shape.num_layers is not None  # noqa: S101  (has_kv_shape)
    assert shape.num_kv_heads is not None  # noqa: S101
    assert shape.head_dim is not None  # noqa: S101
    tokens = lay.kv_tokens if lay.kv_tokens is not None else b * (s or 0)
    heads = math.ceil(shape.num_kv_heads / lay.tp)
    layers = math.ceil(shape.num_layers / lay.pp)
    size = PRECISIONS[lay.precision]
    per_token = 2 * layers * heads * shape.head_dim * size
    formula = f"2·L·⌈kv/t⌉·hd·{size} B = {fmt_bytes(per_token)}/token × {tokens:,} tokens"
    terms.append(Term("KV cache", per_token * tokens, formula, SRC_KV, "kv"))
    if cfg is not None and s is not None:
        # Prefill of one micro batch: the largest transient is the MLP's intermediate.
        transient = b * s * (cfg.hidden_size * 4 + cfg.intermediate_size * 2 * 2) // lay.tp
        terms.append(
            Term(
                "activations",
                math.ceil(transient * size / 2),
                "b·s·(4·h + 4·I) per forward (one layer live at a time)",
                "prefill transient: one layer's hidden and MLP tensors (nbgpu heuristic)",
                "activations",
            )
        )
    return terms


def _reserve_terms(shape: ModelShape, lay: Layout, tensor_bytes: int) -> list[Term]:
    terms = [
        Term(
            "CUDA context",
            CUDA_CONTEXT_BYTES,
            "0.5 GiB per process (0.3-0.6 GiB with lazy loading)",
            SRC_CTX,
            "reserve",
        )
    ]
    groups = [
        name
        for name, degree in (("dp", lay.data_parallel), ("tp", lay.tp), ("pp", lay.pp))
        if degree > 1
    ]
    terms.append(
        Term(
            "NCCL buffers",
            NCCL_BYTES_PER_GROUP * len(groups),
            f"0.75 GiB × {len(groups)} communicator(s)"
            + (f" ({', '.join(groups)})" if groups else " (one process: none)"),
            SRC_NCCL,
            "reserve",
        )
    )
    if lay.role == "train" and lay.strategy == "ddp" and lay.data_parallel > 1:
        size = 0
        formula = "0 (gradient_as_bucket_view=True: buckets are the gradients)"
        if not lay.gradient_as_bucket_view:
            size = math.ceil(PRECISIONS[lay.precision] * shape.parameters / (lay.tp * lay.pp))
            formula = f"{PRECISIONS[lay.precision]} B × Ψ: a second gradient-sized copy"
        terms.append(Term("DDP gradient buckets", size, formula, SRC_DDP, "reserve"))
    if lay.role == "train" and lay.strategy in ("zero3", "fsdp") and shape.config is not None:
        cfg = shape.config
        layer_params = (shape.parameters - cfg.vocab_size * cfg.hidden_size) / cfg.num_layers
        size = math.ceil(2 * 2 * PRECISIONS[lay.precision] * layer_params / (lay.tp * lay.pp))
        terms.append(
            Term(
                "gathered layers",
                size,
                "2 layers (current + prefetched) × unsharded params and grads",
                "FSDP2 FSDPMemTracker categories",
                "reserve",
            )
        )
    terms.append(
        Term(
            "fragmentation",
            math.ceil(lay.fragmentation * tensor_bytes),
            f"{lay.fragmentation:.0%} of the allocator's tensors",
            SRC_FRAG,
            "margin",
        )
    )
    return terms


def analytic_terms(shape: ModelShape, lay: Layout) -> tuple[Term, ...]:
    states = _model_state_terms(shape, lay)
    samples = _per_sample_terms(shape, lay)
    tensors = sum(t.bytes_per_gpu or 0 for t in (*states, *samples))
    return (*states, *samples, *_reserve_terms(shape, lay, tensors))
