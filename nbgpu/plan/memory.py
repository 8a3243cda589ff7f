"""Memory formulas: bytes per GPU for model states, inference weights and the KV cache.

The byte accounting is stated, not hidden (``reference/memory.md`` §5a shows ±25 % between
tools for the same model). Per parameter, before sharding:

==========  =============  =============  ==========================================
precision   parameters     gradients      optimizer state
==========  =============  =============  ==========================================
bf16/fp16   2 B            2 B            AdamW 12 B (fp32 master 4 + m 4 + v 4);
                                          SGD 8 B (fp32 master 4 + momentum 4)
fp32        4 B            4 B            AdamW 8 B (m 4 + v 4); SGD 4 B (momentum)
==========  =============  =============  ==========================================

So mixed-precision AdamW is the ZeRO paper's 16 B/param (K = 12). Per GPU, with data-parallel
degree N, P/G/K the three columns and Ψ the parameters this GPU's model-parallel shard
holds (Ψ = params / (tensor × pipeline degree)):

- ``ddp``:             (P + G + K) Ψ           (everything replicated)
- ``zero1``:           (P + G) Ψ + K Ψ / N     (optimizer state sharded)
- ``zero2``:           P Ψ + (G + K) Ψ / N     (gradients too)
- ``zero3``/``fsdp``:  (P + G + K) Ψ / N       (parameters too; FSDP full shard)

Inference weights are P Ψ. KV cache per token (memory.md §5c) is
``2 · layers · ceil(kv_heads / tp) · head_dim · dtype_bytes`` bytes on each GPU.
Activations, logits, CUDA context, NCCL buffers and fragmentation are *not* in these
numbers: :mod:`nbgpu.plan.estimate` adds them as further terms of the same estimate.

Pure arithmetic: imports nothing of nbgpu but ``errors``; never torch (a module's
parameters are counted by duck typing).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from nbgpu.errors import UserInputError
from nbgpu.plan.hfconfig import read_hf_config, resolve_model_config
from nbgpu.plan.models import ModelConfig

__all__ = [
    "OPTIMIZERS",
    "PRECISIONS",
    "STRATEGIES",
    "ByteAccounting",
    "ModelShape",
    "ModelStates",
    "byte_accounting",
    "kv_bytes_per_token",
    "model_shape",
    "model_states",
    "normalize_precision",
    "shape_from_config",
    "weight_bytes",
]

#: Bytes of one value of each training/inference precision.
PRECISIONS: Mapping[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
#: Sharding strategies and what each shards, for messages.
STRATEGIES: Mapping[str, str] = {
    "ddp": "nothing sharded",
    "zero1": "optimizer state sharded",
    "zero2": "optimizer state and gradients sharded",
    "zero3": "parameters, gradients and optimizer state sharded",
    "fsdp": "full shard, counted as ZeRO-3",
}
OPTIMIZERS = ("adamw", "adam", "sgd")

_DTYPE_ALIASES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
}


@dataclass(frozen=True)
class ByteAccounting:
    """Bytes per parameter, before any sharding."""

    precision: str
    optimizer: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int

    @property
    def total(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def text(self) -> str:
        if self.precision == "fp32":
            states = "m 4 + v 4" if self.optimizer != "sgd" else "momentum 4"
        else:
            states = "fp32 master 4 + m 4 + v 4" if self.optimizer != "sgd" else "master 4 + mom. 4"
        name = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}[self.optimizer]
        return (
            f"{self.precision} params {self.param_bytes} B + grads {self.grad_bytes} B + "
            f"{name} {self.optimizer_bytes} B ({states}) = {self.total} B/param"
        )


def normalize_precision(precision: str) -> str:
    key = str(precision).strip().lower()
    key = _DTYPE_ALIASES.get(key.removeprefix("torch."), key)
    if key not in PRECISIONS:
        raise UserInputError(
            f"precision={precision!r}: expected one of {', '.join(PRECISIONS)} "
            "(or bfloat16, float16, float32)"
        )
    return key


def byte_accounting(precision: str = "bf16", optimizer: str = "adamw") -> ByteAccounting:
    """The per-parameter bytes nbgpu uses for *precision* and *optimizer* (see module doc)."""
    prec = normalize_precision(precision)
    opt = str(optimizer).strip().lower()
    if opt not in OPTIMIZERS:
        raise UserInputError(f"optimizer={optimizer!r}: expected one of {', '.join(OPTIMIZERS)}")
    value = PRECISIONS[prec]
    if prec == "fp32":
        states = 4 if opt == "sgd" else 8
    else:
        states = 8 if opt == "sgd" else 12  # fp32 master copy + fp32 moments
    return ByteAccounting(prec, opt, value, value, states)


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
            "ddp": f"({p}+{g}+{k})·{shard}",
            "zero1": f"({p}+{g})·{shard} + {k}·{shard}/{n}",
            "zero2": f"{p}·{shard} + ({g}+{k})·{shard}/{n}",
            "zero3": f"({p}+{g}+{k})·{shard}/{n}",
            "fsdp": f"({p}+{g}+{k})·{shard}/{n}",
        }[self.strategy]
        return f"{self.strategy}: {text}"


def _check_count(label: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserInputError(f"{label} {value!r}: expected a whole number >= 1")


def model_states(
    parameters: int,
    *,
    strategy: str = "ddp",
    precision: str = "bf16",
    optimizer: str = "adamw",
    data_parallel: int = 1,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
) -> ModelStates:
    """Per-GPU parameter, gradient and optimizer bytes (ZeRO paper formulas)."""
    _check_count("parameter count", parameters)
    for label, value in (
        ("data-parallel degree", data_parallel),
        ("tensor-parallel degree", tensor_parallel),
        ("pipeline-parallel degree", pipeline_parallel),
    ):
        _check_count(label, value)
    strat = str(strategy).strip().lower()
    if strat not in STRATEGIES:
        raise UserInputError(f"strategy={strategy!r}: expected one of {', '.join(STRATEGIES)}")
    acc = byte_accounting(precision, optimizer)
    shard = parameters / (tensor_parallel * pipeline_parallel)
    n = data_parallel
    p, g, k = acc.param_bytes * shard, acc.grad_bytes * shard, acc.optimizer_bytes * shard
    if strat in ("zero1", "zero2", "zero3", "fsdp"):
        k /= n
    if strat in ("zero2", "zero3", "fsdp"):
        g /= n
    if strat in ("zero3", "fsdp"):
        p /= n
    return ModelStates(
        parameters=parameters,
        strategy=strat,
        data_parallel=n,
        model_parallel=tensor_parallel * pipeline_parallel,
        accounting=acc,
        params_bytes=math.ceil(p),
        grads_bytes=math.ceil(g),
        optimizer_bytes=math.ceil(k),
    )


def weight_bytes(
    parameters: int, precision: str = "bf16", tensor_parallel: int = 1, pipeline_parallel: int = 1
) -> int:
    """Inference weights on one GPU: P·Ψ with Ψ split over tensor × pipeline."""
    _check_count("parameter count", parameters)
    size = PRECISIONS[normalize_precision(precision)]
    return math.ceil(size * parameters / (tensor_parallel * pipeline_parallel))


# ----------------------------------------------------------------------- model shape


@dataclass(frozen=True)
class ModelShape:
    """What the formulas need to know about a model; ``None``: not known from the input."""

    parameters: int
    source: str  # "7B", "parameter count", "HF config", "torch module"
    num_layers: int | None = None
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int | None = None
    dtype: str | None = None  # the config's torch_dtype, normalised (bf16/fp16/fp32)
    # The full architecture (MLP width, tied embeddings, experts) when the input named it:
    # a built-in model name or a config.json; the activation formulas need it.
    config: ModelConfig | None = None

    @property
    def has_kv_shape(self) -> bool:
        return None not in (self.num_layers, self.num_kv_heads, self.head_dim)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([kmbt]?)\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
_MODEL_FORMS = (
    "expected a parameter count (7_000_000_000 or '7B'), a built-in model name "
    "('Qwen/Qwen2.5-7B-Instruct'), an HF config.json (path or dict) or a torch module"
)


def shape_from_config(config: ModelConfig, source: str = "HF config") -> ModelShape:
    """The formulas' view of a :class:`~nbgpu.plan.models.ModelConfig`."""
    return ModelShape(
        parameters=config.parameters,
        source=source,
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        vocab_size=config.vocab_size,
        dtype=config.dtype,
        config=config,
    )


def model_shape(model: Any) -> ModelShape:
    """Read a model: a count, ``"7B"``, a built-in name, a config.json path/dict or a module."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, ModelConfig):
        return shape_from_config(model, model.name)
    if isinstance(model, bool):
        raise UserInputError(f"model {model!r}: {_MODEL_FORMS}")
    if isinstance(model, int):
        _check_count("parameter count", model)
        return ModelShape(parameters=model, source="parameter count")
    if isinstance(model, float) and model.is_integer() and model >= 1:
        return ModelShape(parameters=int(model), source="parameter count")
    if isinstance(model, str):
        m = _SIZE.match(model.replace("_", ""))
        if m is None:
            if not model.strip() or model.strip()[0].isdigit():
                raise UserInputError(f"model {model!r}: {_MODEL_FORMS}")
            config = resolve_model_config(model)
            return shape_from_config(config, config.name)
        count = round(float(m.group(1)) * _SCALE[m.group(2).lower()])
        if count < 1:
            raise UserInputError(f"model {model!r}: {_MODEL_FORMS}")
        return ModelShape(parameters=count, source=model.strip())
    if isinstance(model, Mapping):
        return shape_from_config(read_hf_config(model))
    parameters_fn = getattr(model, "parameters", None)
    if callable(parameters_fn):
        # Tied weights appear once per module that shares them: count each tensor once.
        seen: dict[int, int] = {}
        for tensor in parameters_fn():
            seen[id(tensor)] = int(tensor.numel())
        if not seen:
            raise UserInputError(f"model {type(model).__name__} has no parameters")
        shape: ModelShape | None = None
        hf_config = getattr(model, "config", None)
        if hf_config is not None and hasattr(hf_config, "to_dict"):
            try:
                shape = shape_from_config(read_hf_config(hf_config.to_dict()), "torch module")
            except UserInputError:
                shape = None
        total = sum(seen.values())
        if shape is not None:
            return replace(shape, parameters=total)
        return ModelShape(parameters=total, source="torch module")
    raise UserInputError(f"model of type {type(model).__name__}: {_MODEL_FORMS}")


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int, tensor_parallel: int = 1) -> int:
    """KV-cache bytes one token takes on each GPU of a tensor-parallel group."""
    if not shape.has_kv_shape:
        raise UserInputError(
            "the KV cache needs num_hidden_layers, num_key_value_heads and head_dim: pass the "
            "model as an HF config dict"
        )
    # has_kv_shape checked them; the asserts narrow the types for mypy.
    assert shape.num_layers is not None  # noqa: S101
    assert shape.num_kv_heads is not None  # noqa: S101
    assert shape.head_dim is not None  # noqa: S101
    # vLLM/SGLang split KV heads over TP ranks and replicate them when tp > kv_heads.
    heads_per_gpu = math.ceil(shape.num_kv_heads / tensor_parallel)
    return 2 * shape.num_layers * heads_per_gpu * shape.head_dim * dtype_bytes
