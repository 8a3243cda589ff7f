"""Memory formulas: bytes per GPU for model states, inference weights and the KV cache.

The byte accounting is stated, not hidden (``reference/memory.md`` §5a shows ±25 % between
tools for the same model). Per parameter, before sharding (:func:`byte_accounting`): bf16/fp16
params 2 B, grads 2 B, AdamW 12 B (fp32 master 4 + m 4 + v 4) or SGD 8 B (master 4 +
momentum 4); fp32 params 4 B, grads 4 B, AdamW 8 B (m 4 + v 4) or SGD 4 B (momentum).

So mixed-precision AdamW is the ZeRO paper's 16 B/param (K = 12); ``grad_dtype="fp32"``
makes G 4 B, Megatron-LM's bf16 default (18 B/param). Per GPU, with data-parallel degree
N, P/G/K the three columns and Ψ = params / (tensor × pipeline degree):

- ``ddp``:             (P + G + K) Ψ           (everything replicated)
- ``zero1``/``distopt``: (P + G) Ψ + K Ψ / N   (optimizer state; Megatron's distributed optimizer)
- ``zero2``:           P Ψ + (G + K) Ψ / N     (gradients too)
- ``zero3``/``fsdp``:  (P + G + K) Ψ / N       (parameters too; FSDP full shard)

``offload`` moves K (with fp32 grads and a 16-bit pinned buffer) and/or P to the host.

Inference weights are P Ψ. :func:`analytic_terms` adds activations (Korthikanti et al.),
logits and loss, the KV cache, and the reserves the allocator never sees (CUDA context, NCCL
buffers, DDP buckets, gathered FSDP layers, fragmentation). Never imports torch.
"""

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from nbgpu.errors import UserInputError
from nbgpu.estimate.result import CUDA_CONTEXT_BYTES, NCCL_BYTES_PER_GROUP, Layout, Term
from nbgpu.estimate.shapes import TORCH_DTYPES, ModelConfig, ModelShape
from nbgpu.sizes import fmt_bytes

__all__ = ["OPTIMIZERS", "PRECISIONS", "STRATEGIES", "ByteAccounting", "ModelStates",
           "analytic_terms", "byte_accounting", "check_count", "choose", "layout_states",
           "model_states", "normalize_precision", "parse_offload", "weight_bytes"]  # fmt: skip

#: Bytes of one value of each training/inference precision.
PRECISIONS: Mapping[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
#: Sharding strategies and what each shards over the data-parallel ranks: (parameters,
#: gradients, optimizer state). FSDP's full shard is counted as ZeRO-3.
STRATEGIES: Mapping[str, tuple[bool, bool, bool]] = {
    "ddp": (False, False, False),
    "zero1": (False, False, True),
    "distopt": (False, False, True),  # Megatron-LM --use-distributed-optimizer
    "zero2": (False, True, True),
    "zero3": (True, True, True),
    "fsdp": (True, True, True),
}
OPTIMIZERS = ("adamw", "adam", "sgd")
OFFLOADS = ("optimizer", "params")

SRC_ZERO = "Rajbhandari et al., ZeRO (SC'20, arXiv 1910.02054) §5a"
SRC_ACT = "Korthikanti et al. (MLSys'23, arXiv 2205.05198) §4"
SRC_KV = "2·L·kv_heads·head_dim·bytes per token (vLLM's KV page size)"
SRC_LOGITS = (
    "logits b·s·V in 16 bit plus fp32 copies for the loss, and the fp32 "
    "logits gradient of the backward pass (traced)"
)
SRC_CTX = "PyTorch PR #86509, issues #107667/#109888 (lazy vs eager module loading)"
SRC_NCCL = "NCCL_BUFFSIZE docs, NCCL issues #964/#1685; heuristic"
SRC_DDP = "DistributedDataParallel docs: bucket_cap_mb, gradient_as_bucket_view"
SRC_SERVING = "weights at the serving precision"
SRC_PREFILL = "prefill transient: one layer's hidden and MLP tensors (nbgpu heuristic)"
SRC_FSDP = "FSDP2 FSDPMemTracker categories"
SRC_FRAG = "allocator reserved - allocated; 5 % (Lightning's finder margin; accelerate keeps 10 %)"
SRC_HOST = "ZeRO-Offload (Ren et al., arXiv 2101.06840); DeepSpeed PR #7309 (16-bit H2D buffer)"

_DTYPE_ALIASES = {name: key for key, name in TORCH_DTYPES.items()} | {
    "half": "fp16",
    "float": "fp32",
}


@dataclass(frozen=True)
class ByteAccounting:
    """Bytes per parameter, before any sharding."""

    precision: str
    optimizer: str
    param_bytes: int
    grad_bytes: int  # PRECISIONS[grad_dtype]: fp32 gradients under bf16 are 4
    optimizer_bytes: int

    @property
    def total(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def text(self) -> str:
        master = "" if self.precision == "fp32" else "fp32 master 4 + "
        states = master + ("momentum 4" if self.optimizer == "sgd" else "m 4 + v 4")
        name = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}[self.optimizer]
        grads = "fp32 grads" if self.grad_bytes > self.param_bytes else "grads"
        return (
            f"{self.precision} params {self.param_bytes} B + {grads} {self.grad_bytes} B + "
            f"{name} {self.optimizer_bytes} B ({states}) = {self.total} B/param"
        )


def normalize_precision(precision: str, label: str = "precision") -> str:
    key = str(precision).strip().lower()
    key = _DTYPE_ALIASES.get(key.removeprefix("torch."), key)
    if key not in PRECISIONS:
        raise UserInputError(
            f"{label}={precision!r}: expected one of {', '.join(PRECISIONS)} "
            "(or bfloat16, float16, float32)"
        )
    return key


def choose(label: str, value: Any, words: Collection[str]) -> str:
    """*value* as one of *words*, whatever its case and spaces; else one line naming them."""
    word = str(value).strip().lower()
    if word not in words:
        raise UserInputError(f"{label}={value!r}: expected one of {', '.join(words)}")
    return word


def parse_offload(offload: Any, role: str, strategy: str) -> tuple[str, ...]:
    """``"optimizer"``, ``"params"`` or both (``"optimizer+params"``) as a sorted tuple."""
    words = str(offload or "").replace("+", ",").split(",")
    moved = tuple(sorted({choose("offload", w, OFFLOADS) for w in words if w.strip()}))
    params_unsharded = "params" in moved and not STRATEGIES[strategy][0]
    if moved and (role != "train" or strategy == "ddp" or params_unsharded):
        raise UserInputError(
            f"offload={offload!r} with {strategy} ({role}): expected training with ZeRO "
            "(optimizer: zero1/zero2/zero3/fsdp; params: zero3 or fsdp)"
        )
    return moved


def check_count(prefix: str, value: Any) -> None:
    """A whole number >= 1, or one line: *prefix* (``"world_size="``) and the value."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserInputError(f"{prefix}{value!r}: expected a whole number >= 1")


def byte_accounting(
    precision: str = "bf16", optimizer: str = "adamw", grad_dtype: str | None = None
) -> ByteAccounting:
    """The per-parameter bytes nbgpu uses for *precision* and *optimizer* (see module doc)."""
    prec = normalize_precision(precision)
    opt = choose("optimizer", optimizer, OPTIMIZERS)
    grads = PRECISIONS[normalize_precision(grad_dtype or prec, "grad_dtype")]
    # fp32 momentum, or Adam's m and v; mixed precision adds an fp32 master copy.
    states = (4 if opt == "sgd" else 8) + (0 if prec == "fp32" else 4)
    return ByteAccounting(prec, opt, PRECISIONS[prec], max(grads, PRECISIONS[prec]), states)


@dataclass(frozen=True)
class ModelStates:
    """Model-state bytes on one GPU of a training role."""

    parameters: int
    strategy: str
    data_parallel: int
    model_parallel: int  # tensor × pipeline degree: Ψ is divided by it first
    accounting: ByteAccounting
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def formula(self) -> str:
        a = self.accounting
        p, g, k = a.param_bytes, a.grad_bytes, a.optimizer_bytes
        n = self.data_parallel
        shard = "Ψ" if self.model_parallel == 1 else f"Ψ/{self.model_parallel}"
        text = {
            (False, False, False): f"({p}+{g}+{k})·{shard}",
            (False, False, True): f"({p}+{g})·{shard} + {k}·{shard}/{n}",
            (False, True, True): f"{p}·{shard} + ({g}+{k})·{shard}/{n}",
            (True, True, True): f"({p}+{g}+{k})·{shard}/{n}",
        }[STRATEGIES[self.strategy]]
        return f"{self.strategy}: {text}"


def model_states(
    parameters: int,
    *,
    strategy: str = "ddp",
    precision: str = "bf16",
    optimizer: str = "adamw",
    data_parallel: int = 1,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    grad_dtype: str | None = None,
) -> ModelStates:
    """Per-GPU parameter, gradient and optimizer bytes (ZeRO paper formulas)."""
    check_count("parameter count ", parameters)
    degrees = {"data": data_parallel, "tensor": tensor_parallel, "pipeline": pipeline_parallel}
    for kind, degree in degrees.items():
        check_count(f"{kind}-parallel degree ", degree)
    strat = choose("strategy", strategy, STRATEGIES)
    acc = byte_accounting(precision, optimizer, grad_dtype)
    shard = parameters / (tensor_parallel * pipeline_parallel)
    per_param = (acc.param_bytes, acc.grad_bytes, acc.optimizer_bytes)
    p, g, k = (
        math.ceil(per * shard / (data_parallel if sharded else 1))
        for per, sharded in zip(per_param, STRATEGIES[strat], strict=True)
    )
    return ModelStates(
        parameters, strat, data_parallel, tensor_parallel * pipeline_parallel, acc, p, g, k
    )


def layout_states(parameters: int, lay: Layout) -> ModelStates:
    words = ("strategy", "precision", "optimizer", "grad_dtype")
    degrees = ("data_parallel", "tensor_parallel", "pipeline_parallel")
    return model_states(parameters, **{k: getattr(lay, k) for k in (*words, *degrees)})


def weight_bytes(
    parameters: int, precision: str = "bf16", tensor_parallel: int = 1, pipeline_parallel: int = 1
) -> int:
    """Inference weights on one GPU: P·Ψ with Ψ split over tensor × pipeline."""
    check_count("parameter count ", parameters)
    size = PRECISIONS[normalize_precision(precision)]
    return math.ceil(size * parameters / (tensor_parallel * pipeline_parallel))


def _model_state_terms(shape: ModelShape, lay: Layout) -> list[Term]:
    if lay.role == "inference":
        size, shard = PRECISIONS[lay.precision], lay.model_parallel
        formula = f"{size} B × Ψ" + (f" / (tp·pp = {shard})" if shard > 1 else "")
        weights = math.ceil(size * shape.parameters / shard)
        return [Term("weights", weights, formula, SRC_SERVING, "model states")]
    states = layout_states(shape.parameters, lay)
    acc, n, mp = states.accounting, lay.data_parallel, states.model_parallel
    psi, src = ("Ψ" if mp == 1 else f"Ψ/{mp}"), f"{SRC_ZERO}; {acc.text}"
    parts = (  # name, bytes on the GPU, bytes per parameter, what offloading moves it
        ("weights", states.params_bytes, acc.param_bytes, "params"),
        ("gradients", states.grads_bytes, acc.grad_bytes, "optimizer"),
        ("optimizer states", states.optimizer_bytes, acc.optimizer_bytes, "optimizer"),
    )
    terms = []
    for (name, size, per, what), sharded in zip(parts, STRATEGIES[lay.strategy], strict=True):
        away = what in lay.offload
        formula = f"{per} B × {psi}" + (f" / {n}" if sharded else "") + " on the host" * away
        terms.append(Term(name, 0 if away else size, formula, src, "model states"))
    # On the host (per rank): what left the GPU, in the precision the CPU step needs, and
    # DeepSpeed's 16-bit pinned buffer for copying the updated parameters back.
    host = (
        ("host parameters", acc.param_bytes, "params"),
        ("host optimizer states", acc.optimizer_bytes, "optimizer"),
        ("host fp32 gradients", 4, "optimizer"),
        ("host pinned buffer", 2, "optimizer"),
    )
    for name, per, what in host:
        if what in lay.offload:
            size = math.ceil(per * shape.parameters / (mp * n))
            terms.append(Term(name, size, f"{per} B × {psi} / {n}", SRC_HOST, "host"))
    return terms


def _activation_bytes(cfg: ModelConfig, lay: Layout, b: int, s: int) -> tuple[int, str]:
    """Korthikanti et al.'s per-layer activation bytes, generalised to GQA and SwiGLU.

    The paper's 34·sbh splits into 10·sbh every tensor-parallel rank keeps (two norm inputs
    4, attention and MLP inputs 4, two dropout masks 2) and 24·sbh that TP divides: Q, K, V 6
    (K, V shrink by kv_heads/heads with GQA), the attention output 2, and the MLP 16 =
    4·I/h·... with I = 4h (GELU: 2 saved tensors of width I; SwiGLU: 4). Attention scores add
    5·a·s²·b (softmax 2, dropout mask 1, its output 2) unless flash/SDPA attention keeps only
    a fp32 logsumexp (4·a·s·b). Coefficients assume 16-bit activations; fp32 doubles them.
    """
    h, a, t = cfg.hidden_size, cfg.num_attention_heads, lay.tensor_parallel
    kv_width = cfg.num_kv_heads * cfg.head_dim
    scale = PRECISIONS[lay.precision] / 2
    replicated = 10 * s * b * h
    qkv = 2 * s * b * h + 4 * s * b * kv_width  # Q, K, V saved for the attention product
    attn_out = 2 * s * b * h
    mlp = (8 if cfg.gated_mlp else 4) * s * b * cfg.intermediate_size
    flash = (4 * a * s * b, "4·a·s·b (flash)")
    scores, scores_text = flash if lay.flash_attention else (5 * a * s * s * b, "5·a·s²·b")
    per_layer = replicated + (qkv + attn_out + mlp + scores) / t
    layers = cfg.num_layers  # 1F1B: the first stage holds p micro batches × L/p layers
    mlp_text = f"{'8' if cfg.gated_mlp else '4'}·s·b·I"
    tp_text = f"/{t}" if t > 1 else ""
    layer = f"[10·sbh + (2·sbh + 4·sb·kv·hd + 2·sbh + {mlp_text} + {scores_text}){tp_text}]"
    if lay.activation_checkpointing:
        # Full recompute: each layer keeps its 16-bit input; one layer's activations are
        # rebuilt at a time during the backward pass.
        total = layers * 2 * s * b * h / t + per_layer
        formula = f"L·2·s·b·h{tp_text} + one layer {layer} (full recompute)"
    else:
        total, formula = layers * per_layer, f"L·{layer}"
    return math.ceil(total * scale), formula


def _per_sample_terms(shape: ModelShape, lay: Layout) -> list[Term]:
    cfg = shape.config
    b, s, tp = lay.micro_batch, lay.seq_len, lay.tensor_parallel
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
        logits = math.ceil(b * s * cfg.vocab_size * per / tp)
        formula = f"b·s·V·{per} B" + (f" / {tp}" if tp > 1 else "")
        return [*terms, Term("logits/loss", logits, formula, SRC_LOGITS, "activations")]
    if cfg is None:
        return [Term("KV cache", None, "needs layers, KV heads, head dim", SRC_KV, "kv")]
    tokens = lay.kv_tokens if lay.kv_tokens is not None else b * (s or 0)
    size = PRECISIONS[lay.precision]
    per_token = cfg.kv_bytes_per_token(size, tp, lay.pipeline_parallel)
    formula = f"2·L·⌈kv/t⌉·hd·{size} B = {fmt_bytes(per_token)}/token × {tokens:,} tokens"
    if cfg.has_kv_cache:  # encoders (BERT) and T5-style encoder-decoders: none shown
        terms.append(Term("KV cache", per_token * tokens, formula, SRC_KV, "kv"))
    if s is not None:
        # Prefill of one micro batch: the largest transient is the MLP's intermediate.
        transient = b * s * (cfg.hidden_size * 4 + cfg.intermediate_size * 2 * 2) // tp
        formula = "b·s·(4·h + 4·I) per forward (one layer live at a time)"
        act = math.ceil(transient * size / 2)
        terms.append(Term("activations", act, formula, SRC_PREFILL, "activations"))
    return terms


def _reserve_terms(shape: ModelShape, lay: Layout, tensor_bytes: int) -> list[Term]:
    degrees = {"dp": lay.data_parallel, "tp": lay.tensor_parallel, "pp": lay.pipeline_parallel}
    groups = [name for name, degree in degrees.items() if degree > 1]
    nccl = f"0.75 GiB × {len(groups)} communicator(s)" + (
        f" ({', '.join(groups)})" if groups else " (one process: none)"
    )
    context = "0.5 GiB per process (0.3-0.6 GiB with lazy loading)"
    terms = [
        Term("CUDA context", CUDA_CONTEXT_BYTES, context, SRC_CTX, "reserve"),
        Term("NCCL buffers", NCCL_BYTES_PER_GROUP * len(groups), nccl, SRC_NCCL, "reserve"),
    ]
    if lay.role == "train" and lay.strategy == "ddp" and lay.data_parallel > 1:
        size = 0
        formula = "0 (gradient_as_bucket_view=True: buckets are the gradients)"
        if not lay.gradient_as_bucket_view:
            size = math.ceil(PRECISIONS[lay.precision] * shape.parameters / lay.model_parallel)
            formula = f"{PRECISIONS[lay.precision]} B × Ψ: a second gradient-sized copy"
        terms.append(Term("DDP gradient buckets", size, formula, SRC_DDP, "reserve"))
    if lay.role == "train" and lay.strategy in ("zero3", "fsdp") and shape.config is not None:
        cfg = shape.config
        layer_params = (shape.parameters - cfg.vocab_size * cfg.hidden_size) / cfg.num_layers
        size = math.ceil(2 * 2 * PRECISIONS[lay.precision] * layer_params / lay.model_parallel)
        gathered = "2 layers (current + prefetched) × unsharded params and grads"
        terms.append(Term("gathered layers", size, gathered, SRC_FSDP, "reserve"))
    margin = f"{lay.fragmentation:.0%} of the allocator's tensors"
    fragmentation = math.ceil(lay.fragmentation * tensor_bytes)
    return [*terms, Term("fragmentation", fragmentation, margin, SRC_FRAG, "margin")]


def analytic_terms(shape: ModelShape, lay: Layout) -> tuple[Term, ...]:
    states = _model_state_terms(shape, lay)
    samples = _per_sample_terms(shape, lay)
    tensors = sum(t.bytes_per_gpu or 0 for t in (*states, *samples) if t.kind != "host")
    return (*states, *samples, *_reserve_terms(shape, lay, tensors))
