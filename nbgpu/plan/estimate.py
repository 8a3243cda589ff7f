"""Per-GPU memory of a training or inference process, term by term, with formulas and sources.

``estimate()`` answers "how many bytes will each GPU need" before anything runs:

- **analytic** terms, always: model states from :mod:`nbgpu.plan.memory` (the ZeRO paper's
  formulas), activations after Korthikanti et al. (with and without checkpointing), logits
  and loss, the KV cache, and the per-process reserves the PyTorch allocator never sees
  (CUDA context, NCCL buffers, DDP gradient buckets) plus a fragmentation margin;
- **traced** terms, for a live ``torch.nn.Module``: one forward + backward + optimizer step
  under fake tensors (:mod:`nbgpu.plan.trace`), so the activations are your module's, not a
  formula's. When tracing fails the analytic answer stands, with the reason.

Activations, logits and the KV cache grow linearly with the micro batch and everything
else does not, so the largest micro batch that fits a budget is one division
(:func:`largest_micro_batch`): no out-of-memory trials.

Pure arithmetic: imports ``memory``, ``models``, ``_render`` and ``errors``; ``trace`` (and
with it torch) only when a module is given.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from nbgpu._render import Result, Table, fmt_bytes, wrap
from nbgpu.errors import UserInputError
from nbgpu.plan.memory import (
    PRECISIONS,
    STRATEGIES,
    ModelShape,
    model_shape,
    model_states,
    normalize_precision,
)
from nbgpu.plan.models import ModelConfig

__all__ = [
    "CUDA_CONTEXT_BYTES",
    "FRAGMENTATION",
    "NCCL_BYTES_PER_GROUP",
    "MemoryEstimate",
    "Term",
    "analytic_terms",
    "estimate",
    "estimate_memory",
    "largest_micro_batch",
    "parse_bytes",
]

GiB = 1024**3
#: CUDA context per process: 287 MB lazy vs 667 MB eager loading (PyTorch PR #86509);
#: "~400MB with lazy loading" (issue #109888). Mid-range of the 0.3-0.6 GB reported across drivers.
CUDA_CONTEXT_BYTES = GiB // 2
#: NCCL buffers per communicator: 544/688 MB measured on 4×A100 (NCCL issue #964);
#: budget 0.5-1 GiB per communicator. A planning heuristic, stated as such.
NCCL_BYTES_PER_GROUP = 3 * GiB // 4
#: Fragmentation margin on the allocator's share (reserved - allocated):
#: plan 5-10 %; Lightning's finder keeps 5 %, accelerate's 10 %.
FRAGMENTATION = 0.05

ROLES = ("train", "inference")

_SRC_ZERO = "Rajbhandari et al., ZeRO (SC'20, arXiv 1910.02054) §5a"
_SRC_ACT = "Korthikanti et al. (MLSys'23, arXiv 2205.05198) §4"
_SRC_KV = "2·L·kv_heads·head_dim·bytes per token (vLLM's KV page size)"
_SRC_LOGITS = (
    "logits b·s·V in 16 bit plus fp32 copies for the loss, and the fp32 "
    "logits gradient of the backward pass (traced)"
)
_SRC_CTX = "PyTorch PR #86509, issues #107667/#109888 (lazy vs eager module loading)"
_SRC_NCCL = "NCCL_BUFFSIZE docs, NCCL issues #964/#1685; heuristic"
_SRC_DDP = "DistributedDataParallel docs: bucket_cap_mb, gradient_as_bucket_view"
_SRC_FRAG = "allocator reserved - allocated; 5 % (Lightning's finder margin; accelerate keeps 10 %)"
_SRC_TRACE = "traced: {tool} on one fake forward+backward+optimizer step"

# Which terms scale with the micro batch (the rest is fixed per GPU).
PER_SAMPLE = frozenset({"activations", "logits/loss", "KV cache"})


@dataclass(frozen=True)
class Term:
    """One named part of per-GPU memory; ``bytes_per_gpu`` None: not computable here."""

    name: str
    bytes_per_gpu: int | None
    formula: str
    source: str
    kind: str  # "model states", "activations", "reserve", "margin"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "bytes_per_gpu": self.bytes_per_gpu,
            "formula": self.formula,
            "source": self.source,
            "kind": self.kind,
        }


@dataclass(frozen=True)
class MemoryEstimate(Result):
    """Per-GPU bytes, analytic and (for a module) traced, side by side."""

    model: str  # how the model was given: "7.5B parameters", "Qwen/Qwen2.5-7B-Instruct"
    parameters: int
    role: str
    precision: str
    optimizer: str
    strategy: str
    world_size: int
    data_parallel: int
    tensor_parallel: int
    pipeline_parallel: int
    micro_batch: int
    seq_len: int | None
    activation_checkpointing: bool
    terms: tuple[Term, ...]  # analytic
    traced_terms: tuple[Term, ...] = ()  # empty: not traced
    trace_note: str = ""  # which tool traced, or why tracing failed / was not tried
    budget_bytes: int | None = None
    max_micro_batch: int | None = None  # the largest micro batch within budget_bytes
    notes: tuple[str, ...] = ()
    FRAME_COLUMNS = ("term", "kind", "analytic_bytes", "traced_bytes", "formula", "source")

    # --------------------------------------------------------------- totals
    @staticmethod
    def _sum(terms: Sequence[Term]) -> int:
        return sum(t.bytes_per_gpu or 0 for t in terms)

    @property
    def analytic_bytes(self) -> int:
        return self._sum(self.terms)

    @property
    def traced_bytes(self) -> int | None:
        return self._sum(self.traced_terms) if self.traced_terms else None

    @property
    def total_bytes(self) -> int:
        """The answer: traced when a trace succeeded, else analytic."""
        traced = self.traced_bytes
        return traced if traced is not None else self.analytic_bytes

    @property
    def method(self) -> str:
        return "traced" if self.traced_terms else "analytic"

    @property
    def model_state_bytes(self) -> int:
        return self._sum([t for t in self.terms if t.kind == "model states"])

    @property
    def uncounted(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.terms if t.bytes_per_gpu is None)

    @property
    def fits(self) -> bool | None:
        return None if self.budget_bytes is None else self.total_bytes <= self.budget_bytes

    def term(self, name: str, traced: bool = False) -> Term | None:
        for t in self.traced_terms if traced else self.terms:
            if t.name == name:
                return t
        return None

    # --------------------------------------------------------------- views
    def _sources(self) -> dict[str, int]:
        """Each distinct source, numbered for the text view's ``[n]`` marks."""
        every = [t.source for t in (*self.terms, *self.traced_terms)]
        return {src: n for n, src in enumerate(dict.fromkeys(every), 1)}

    def _table(self, marks: bool = False) -> Table:
        traced = {t.name: t for t in self.traced_terms}
        numbers = self._sources()
        headers = ["term", "analytic"] + (["traced"] if traced else []) + ["formula"]
        table = Table(headers, flex=len(headers) - 1)
        for t in self.terms:
            name = f"{t.name} [{numbers[t.source]}]" if marks else t.name
            cells = [name, fmt_bytes(t.bytes_per_gpu) if t.bytes_per_gpu is not None else "?"]
            if traced:
                other = traced.get(t.name)
                cells.append("-" if other is None else fmt_bytes(other.bytes_per_gpu))
            cells.append(t.formula)
            table.add(*cells, level="warn" if t.bytes_per_gpu is None else "")
        for name, t in traced.items():  # traced-only terms (temporaries)
            if self.term(name) is None:
                label = f"{name} [{numbers[t.source]}]" if marks else name
                table.add(label, "-", fmt_bytes(t.bytes_per_gpu), t.formula)
        total = ["total per GPU", fmt_bytes(self.analytic_bytes)]
        if traced:
            total.append(fmt_bytes(self.traced_bytes))
        table.add(*total, "", level="bad" if self.fits is False else "")
        return table

    def _heading(self) -> str:
        par = f"{self.strategy}, " if self.role == "train" else ""
        par += f"world size {self.world_size}"
        if self.tensor_parallel > 1 or self.pipeline_parallel > 1:
            par += f" (dp {self.data_parallel} × tp {self.tensor_parallel} × pp "
            par += f"{self.pipeline_parallel})"
        seq = f" × seq {self.seq_len}" if self.seq_len else ""
        ckpt = ", activation checkpointing" if self.activation_checkpointing else ""
        return (
            f"memory estimate ({self.method}): {self.model} ({self.parameters:,} parameters), "
            f"{self.role}, {self.precision}"
            f"{' ' + self.optimizer if self.role == 'train' else ''}, {par}, micro batch "
            f"{self.micro_batch}{seq}{ckpt}"
        )

    def _footer(self) -> list[str]:
        lines = []
        if self.budget_bytes is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(
                f"budget {fmt_bytes(self.budget_bytes)} per GPU: {fmt_bytes(self.total_bytes)} "
                f"{verdict}"
            )
        if self.max_micro_batch is not None:
            lines.append(f"largest micro batch within the budget: {self.max_micro_batch}")
        if self.trace_note:
            lines.append(self.trace_note)
        if self.traced_terms:
            lines.append(
                "traced column: bytes per MemTracker category at the step's peak moment "
                "(memory that is free at that moment, e.g. gradients set to None, shows 0)"
            )
        if self.uncounted:
            lines.append(
                "analytic terms not computable without the model's shape or seq_len: "
                + ", ".join(self.uncounted)
                + " (pass a model name or an HF config.json, and seq_len)"
            )
        lines.extend(self.notes)
        return lines

    def text(self) -> str:
        out = [wrap(self._heading(), "")]
        out.append(self._table(marks=True).text(max_width=100))
        out.extend(wrap(line, "") for line in self._footer())
        out.append("sources:")
        out.extend(wrap(src, f"  [{n}] ", width=100) for src, n in self._sources().items())
        return "\n".join(out)

    def html_body(self) -> str:
        import html  # noqa: PLC0415  (stdlib, only for this view)

        table = self._table()
        # The HTML view has room for the source of every term.
        sources = {t.name: t.source for t in (*self.terms, *self.traced_terms)}
        head = [*list(table.headers), "source"]
        wide = Table(head)
        for row, level in zip(table.rows, table.row_levels, strict=True):
            wide.add(*row, sources.get(row[0], ""), level=level)
        foot = "".join(f"<li>{html.escape(line)}</li>" for line in self._footer())
        return f"<b>{html.escape(self._heading())}</b>{self._bar_html()}{wide.html()}" + (
            f"<ul>{foot}</ul>" if foot else ""
        )

    def _bar_html(self) -> str:
        """One stacked bar of the answer's terms against the budget (static HTML)."""
        import html  # noqa: PLC0415

        terms = [t for t in (self.traced_terms or self.terms) if t.bytes_per_gpu]
        scale = max(self.total_bytes, self.budget_bytes or 0) or 1
        colours = {"model states": "#4e79a7", "activations": "#f28e2b", "kv": "#59a14f"}
        colours |= {"reserve": "#9c755f", "margin": "#bab0ac"}
        parts = []
        for t in terms:
            width = 100 * (t.bytes_per_gpu or 0) / scale
            label = html.escape(f"{t.name}: {fmt_bytes(t.bytes_per_gpu)}")
            parts.append(
                f'<div title="{label}" style="display:inline-block;height:14px;'
                f'width:{width:.2f}%;background:{colours.get(t.kind, "#888")}"></div>'
            )
        marker = ""
        if self.budget_bytes:
            left = 100 * self.budget_bytes / scale
            marker = (
                f'<div title="budget {fmt_bytes(self.budget_bytes)}" style="position:absolute;'
                f'top:0;left:{left:.2f}%;height:14px;border-left:2px solid #c0392b"></div>'
            )
        legend = " ".join(
            f'<span style="color:{c}">&#9632;</span> {html.escape(k)}' for k, c in colours.items()
        )
        if self.budget_bytes:
            legend += ' <span style="color:#c0392b">|</span> budget'
        return (
            '<div style="position:relative;width:100%;max-width:640px;white-space:nowrap;'
            f'background:#eee;margin:4px 0;font-size:0">{"".join(parts)}{marker}</div>'
            f"<div>{legend}</div>"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "parameters": self.parameters,
            "role": self.role,
            "precision": self.precision,
            "optimizer": self.optimizer,
            "strategy": self.strategy,
            "world_size": self.world_size,
            "data_parallel": self.data_parallel,
            "tensor_parallel": self.tensor_parallel,
            "pipeline_parallel": self.pipeline_parallel,
            "micro_batch": self.micro_batch,
            "seq_len": self.seq_len,
            "activation_checkpointing": self.activation_checkpointing,
            "method": self.method,
            "analytic_bytes": self.analytic_bytes,
            "traced_bytes": self.traced_bytes,
            "total_bytes": self.total_bytes,
            "terms": [t.to_dict() for t in self.terms],
            "traced_terms": [t.to_dict() for t in self.traced_terms],
            "trace_note": self.trace_note,
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            "max_micro_batch": self.max_micro_batch,
            "notes": list(self.notes),
        }

    def records(self) -> list[dict[str, Any]]:
        traced = {t.name: t for t in self.traced_terms}
        rows = []
        for t in self.terms:
            other = traced.get(t.name)
            rows.append(
                {
                    "term": t.name,
                    "kind": t.kind,
                    "analytic_bytes": t.bytes_per_gpu,
                    "traced_bytes": None if other is None else other.bytes_per_gpu,
                    "formula": t.formula,
                    "source": t.source,
                }
            )
        for name, t in traced.items():
            if self.term(name) is None:
                rows.append(
                    {
                        "term": name,
                        "kind": t.kind,
                        "analytic_bytes": None,
                        "traced_bytes": t.bytes_per_gpu,
                        "formula": t.formula,
                        "source": t.source,
                    }
                )
        return rows


# ------------------------------------------------------------------------------ inputs


def _whole(label: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserInputError(f"{label}={value!r}: expected a whole number >= {minimum}")
    return value


_BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9}
_BYTE_UNITS |= {"gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20}
_BYTE_UNITS |= {"gib": 2**30, "tib": 2**40}


def parse_bytes(value: Any, label: str = "budget") -> int:
    """``80e9``, ``"80GB"``, ``"24 GiB"`` -> bytes; anything else is one clear line."""
    import re  # noqa: PLC0415  (only when a size string is parsed)

    if isinstance(value, int | float) and not isinstance(value, bool):
        if value > 0 and math.isfinite(value):
            return int(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _BYTE_UNITS and float(m.group(1)) > 0:
            return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()])
    raise UserInputError(
        f"{label}={value!r}: expected a positive size in bytes (80e9, '80GB', '24GiB')"
    )


# -------------------------------------------------------------------------- formulas


@dataclass(frozen=True)
class _Layout:
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


def _model_state_terms(shape: ModelShape, lay: _Layout) -> list[Term]:
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
    src = f"{_SRC_ZERO}; {acc.text}"
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


def _activation_bytes(cfg: ModelConfig, lay: _Layout, b: int, s: int) -> tuple[int, str]:
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


def _per_sample_terms(shape: ModelShape, lay: _Layout) -> list[Term]:
    cfg = shape.config
    b, s = lay.micro_batch, lay.seq_len
    terms: list[Term] = []
    if lay.role == "train":
        if cfg is None or s is None:
            why = "needs the model's shape" if cfg is None else "needs seq_len"
            terms.append(Term("activations", None, why, _SRC_ACT, "activations"))
            terms.append(Term("logits/loss", None, why, _SRC_LOGITS, "activations"))
            return terms
        act, formula = _activation_bytes(cfg, lay, b, s)
        terms.append(Term("activations", act, formula, _SRC_ACT, "activations"))
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
                _SRC_LOGITS,
                "activations",
            )
        )
        return terms
    # inference
    if not shape.has_kv_shape:
        terms.append(Term("KV cache", None, "needs layers, KV heads, head dim", _SRC_KV, "kv"))
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
    terms.append(Term("KV cache", per_token * tokens, formula, _SRC_KV, "kv"))
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


def _reserve_terms(shape: ModelShape, lay: _Layout, tensor_bytes: int) -> list[Term]:
    terms = [
        Term(
            "CUDA context",
            CUDA_CONTEXT_BYTES,
            "0.5 GiB per process (0.3-0.6 GiB with lazy loading)",
            _SRC_CTX,
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
            _SRC_NCCL,
            "reserve",
        )
    )
    if lay.role == "train" and lay.strategy == "ddp" and lay.data_parallel > 1:
        size = 0
        formula = "0 (gradient_as_bucket_view=True: buckets are the gradients)"
        if not lay.gradient_as_bucket_view:
            size = math.ceil(PRECISIONS[lay.precision] * shape.parameters / (lay.tp * lay.pp))
            formula = f"{PRECISIONS[lay.precision]} B × Ψ: a second gradient-sized copy"
        terms.append(Term("DDP gradient buckets", size, formula, _SRC_DDP, "reserve"))
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
            _SRC_FRAG,
            "margin",
        )
    )
    return terms


def analytic_terms(shape: ModelShape, lay: _Layout) -> tuple[Term, ...]:
    states = _model_state_terms(shape, lay)
    samples = _per_sample_terms(shape, lay)
    tensors = sum(t.bytes_per_gpu or 0 for t in (*states, *samples))
    return (*states, *samples, *_reserve_terms(shape, lay, tensors))


# ------------------------------------------------------------------------ the estimate


def _layout(
    *,
    role: str,
    precision: str,
    optimizer: str,
    strategy: str,
    world_size: int,
    micro_batch: int,
    seq_len: int | None,
    tensor_parallel: int,
    pipeline_parallel: int,
    activation_checkpointing: bool,
    flash_attention: bool,
    gradient_as_bucket_view: bool,
    fragmentation: float,
    kv_tokens: int | None,
    foreach: bool = True,
) -> _Layout:
    role_key = str(role).strip().lower()
    if role_key not in ROLES:
        raise UserInputError(f"role={role!r}: expected one of {', '.join(ROLES)}")
    strat = str(strategy).strip().lower()
    if strat not in STRATEGIES:
        raise UserInputError(f"strategy={strategy!r}: expected one of {', '.join(STRATEGIES)}")
    opt = str(optimizer).strip().lower()
    if opt not in ("adamw", "adam", "sgd"):
        raise UserInputError(f"optimizer={optimizer!r}: expected one of adamw, adam, sgd")
    _whole("world_size", world_size)
    _whole("micro_batch", micro_batch)
    _whole("tensor_parallel", tensor_parallel)
    _whole("pipeline_parallel", pipeline_parallel)
    if seq_len is not None:
        _whole("seq_len", seq_len)
    if kv_tokens is not None:
        _whole("kv_tokens", kv_tokens)
    if world_size % (tensor_parallel * pipeline_parallel):
        raise UserInputError(
            f"world_size={world_size} is not a multiple of tensor_parallel × pipeline_parallel "
            f"= {tensor_parallel * pipeline_parallel}; expected world = dp × tp × pp"
        )
    if not 0 <= fragmentation < 1:
        raise UserInputError(f"fragmentation={fragmentation!r}: expected a fraction in [0, 1)")
    return _Layout(
        role=role_key,
        precision=normalize_precision(precision),
        optimizer=opt,
        strategy=strat,
        world_size=world_size,
        data_parallel=world_size // (tensor_parallel * pipeline_parallel),
        tp=tensor_parallel,
        pp=pipeline_parallel,
        micro_batch=micro_batch,
        seq_len=seq_len,
        checkpointing=bool(activation_checkpointing),
        flash_attention=bool(flash_attention),
        gradient_as_bucket_view=bool(gradient_as_bucket_view),
        fragmentation=float(fragmentation),
        kv_tokens=kv_tokens,
        foreach=bool(foreach),
    )


def _batch_size(example: Any) -> int | None:
    """Dim 0 of the first tensor-like leaf of an example batch (None: no batch given)."""
    if isinstance(example, Mapping):
        example = next(iter(example.values()), None)
    if isinstance(example, tuple | list):
        example = example[0] if example else None
    shape = getattr(example, "shape", None)
    if shape is None or len(shape) == 0:
        return None
    return int(shape[0])


def _is_module(model: Any) -> bool:
    return callable(getattr(model, "parameters", None)) and callable(
        getattr(model, "forward", None)
    )


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
    """Per-GPU memory for *model*; see :func:`nbgpu.estimate` for the arguments."""
    if micro_batch is None:
        micro_batch = _batch_size(example_input) or 1
    lay = _layout(
        role=role,
        precision=precision,
        optimizer=optimizer,
        strategy=strategy,
        world_size=world_size,
        micro_batch=micro_batch,
        seq_len=seq_len,
        tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel,
        activation_checkpointing=activation_checkpointing,
        flash_attention=flash_attention,
        gradient_as_bucket_view=gradient_as_bucket_view,
        fragmentation=fragmentation,
        kv_tokens=kv_tokens,
        foreach=foreach,
    )
    shape = model_shape(model)
    budget_bytes = None if budget is None else parse_bytes(budget)
    terms = analytic_terms(shape, lay)
    traced: tuple[Term, ...] = ()
    note = ""
    module = _is_module(model)
    if trace is None:
        trace = module
    if trace and not module:
        note = "traced: not tried (tracing needs a live torch.nn.Module; analytic used)"
    elif trace:
        from nbgpu.plan.trace import trace_terms  # noqa: PLC0415  (imports torch)

        traced, note = trace_terms(
            model,
            analytic=terms,
            layout=lay,
            example_input=example_input,
            loss_fn=loss_fn,
        )
    result = MemoryEstimate(
        model=_describe(model, shape),
        parameters=shape.parameters,
        role=lay.role,
        precision=lay.precision,
        optimizer=lay.optimizer,
        strategy=lay.strategy,
        world_size=lay.world_size,
        data_parallel=lay.data_parallel,
        tensor_parallel=lay.tp,
        pipeline_parallel=lay.pp,
        micro_batch=lay.micro_batch,
        seq_len=lay.seq_len,
        activation_checkpointing=lay.checkpointing,
        terms=terms,
        traced_terms=traced,
        trace_note=note,
        budget_bytes=budget_bytes,
    )
    if budget_bytes is not None:
        fixed = result.total_bytes - _per_sample_total(result)
        if fixed > budget_bytes:
            weights = result.term("weights")
            raise UserInputError(
                f"budget={fmt_bytes(budget_bytes)} per GPU is smaller than what "
                f"{'training' if lay.role == 'train' else 'serving'} needs before any sample "
                f"({fmt_bytes(fixed)}: weights "
                f"{fmt_bytes(weights.bytes_per_gpu if weights else None)}, optimizer and "
                "reserves); expected a budget above that, more GPUs or a sharded strategy"
            )
        result = replace(result, max_micro_batch=_solve_micro(result, budget_bytes, lay))
    return result


def _per_sample_total(est: MemoryEstimate) -> int:
    """Bytes that scale with the micro batch, plus the margin's share of them."""
    terms = est.traced_terms or est.terms
    per = sum(t.bytes_per_gpu or 0 for t in terms if t.name in PER_SAMPLE)
    if est.traced_terms:
        return per
    frag = est.term("fragmentation")
    tensors = sum(
        t.bytes_per_gpu or 0 for t in est.terms if t.kind in ("model states", "activations", "kv")
    )
    if frag is not None and frag.bytes_per_gpu and tensors:
        per += round(frag.bytes_per_gpu * per / tensors)
    return per


def _solve_micro(est: MemoryEstimate, budget: int, lay: _Layout) -> int | None:
    """Largest micro batch with total ≤ budget: memory is affine in the micro batch."""
    per_sample = _per_sample_total(est) / lay.micro_batch
    if per_sample <= 0:
        return None  # nothing scales with the batch in what we could compute
    fixed = est.total_bytes - per_sample * lay.micro_batch
    return max(0, math.floor((budget - fixed) / per_sample))


def largest_micro_batch(
    model: Any,
    budget: Any,
    **kwargs: Any,
) -> MemoryEstimate:
    """The estimate at the largest micro batch that fits *budget* (bytes, or per-GPU list).

    *budget* may be a list of per-GPU free bytes (heterogeneous GPUs): the smallest decides,
    since data-parallel ranks run the same micro batch. Computed, never tried on hardware:
    analytic memory is affine in the micro batch, so one estimate gives the answer; a traced
    module is traced at b and 2b for the slope, then checked (and nudged by one) with fake
    traces, still without a single real step.
    """
    if isinstance(budget, list | tuple):
        if not budget:
            raise UserInputError("budget=[]: expected at least one GPU's free bytes")
        budget = min(parse_bytes(b, "budget") for b in budget)
    kwargs.setdefault("micro_batch", 1)
    first = estimate_memory(model, budget=budget, **kwargs)
    evaluations = 1
    best: int | None
    if first.traced_terms:
        b0 = first.micro_batch
        second = estimate_memory(model, budget=budget, **{**kwargs, "micro_batch": 2 * b0})
        evaluations += 1
        slope = (second.total_bytes - first.total_bytes) / b0
        best = None
        if slope > 0:
            fixed = first.total_bytes - slope * b0
            best = max(0, math.floor(((first.budget_bytes or 0) - fixed) / slope))
    else:
        best = first.max_micro_batch
    if best is None:
        raise UserInputError(
            "largest micro batch: nothing in this estimate grows with the batch; pass seq_len "
            "and a model with a shape (a name, an HF config.json or a module)"
        )
    if best < 1:
        raise UserInputError(
            f"budget={fmt_bytes(first.budget_bytes)} per GPU holds no sample: micro_batch="
            f"{first.micro_batch} needs {fmt_bytes(first.total_bytes)}; expected a larger "
            "budget, activation checkpointing or a shorter seq_len"
        )

    def at(micro: int) -> MemoryEstimate:
        nonlocal evaluations
        evaluations += 1
        return estimate_memory(model, budget=budget, **{**kwargs, "micro_batch": micro})

    final = at(best)
    # A trace is close to, not exactly, affine (the peak can move between the forward
    # pass and the optimizer step): step down until it fits, then up while it still does.
    while final.fits is False and best > 1:
        best -= 1
        final = at(best)
    if first.traced_terms:
        for _ in range(8):
            above = at(best + 1)
            if not above.fits:
                break
            best, final = best + 1, above
    how = "fake-tensor traces" if first.traced_terms else "analytic evaluations"
    note = f"largest micro batch found with {evaluations} {how}, 0 real steps"
    return replace(final, max_micro_batch=best, notes=(*final.notes, note))


class _Estimate:
    """``nbgpu.estimate(...)``, ``nbgpu.estimate.compare(...)``, ``.largest_micro_batch``."""

    def __call__(self, model: Any, **kwargs: Any) -> MemoryEstimate:
        """Per-GPU memory of *model* in named terms, each with its formula and source.

        *model*: a parameter count (``7.5e9``, ``"7B"``), a built-in name
        (``"Qwen/Qwen2.5-7B-Instruct"``), an HF ``config.json`` (path or dict) or a live
        ``torch.nn.Module`` (traced with fake tensors; pass ``example_input=``, a batch with
        the batch in dim 0, unless it is a token model and ``seq_len`` is given).
        Keywords: ``precision`` (bf16, fp16, fp32), ``optimizer`` (adamw, adam, sgd),
        ``strategy`` (ddp, zero1, zero2, zero3, fsdp), ``world_size``, ``micro_batch``,
        ``seq_len``, ``tensor_parallel``, ``pipeline_parallel``,
        ``activation_checkpointing``, ``role`` ("train" or "inference"),
        ``flash_attention`` (default True), ``gradient_as_bucket_view``, ``fragmentation``,
        ``kv_tokens`` (inference: KV-cache tokens per GPU), ``budget`` (bytes or "80GB":
        adds the largest micro batch within it), ``loss_fn``, ``trace``.
        """
        return estimate_memory(model, **kwargs)

    @staticmethod
    def compare(module: Any, batch: Any, **kwargs: Any) -> Any:
        """One real CPU step of *module* on *batch*: measured peak beside both estimates."""
        from nbgpu.plan.trace import compare_step  # noqa: PLC0415  (imports torch)

        optimizer = kwargs.pop("optimizer", "adamw")
        loss_fn = kwargs.pop("loss_fn", None)
        analytic = estimate_memory(
            module,
            optimizer=optimizer,
            precision=kwargs.pop("precision", "fp32"),
            trace=False,
            example_input=batch,  # the analytic micro batch is the batch's dim 0
            **kwargs,
        )
        return compare_step(module, batch, optimizer=optimizer, loss_fn=loss_fn, estimate=analytic)

    @staticmethod
    def largest_micro_batch(model: Any, budget: Any, **kwargs: Any) -> MemoryEstimate:
        """See :func:`largest_micro_batch`."""
        return largest_micro_batch(model, budget, **kwargs)

    def __repr__(self) -> str:
        return "<nbgpu.estimate: per-GPU memory estimates (call it; .compare(module, batch))>"


#: The public ``nbgpu.estimate``.
estimate = _Estimate()
