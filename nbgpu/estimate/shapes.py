"""What the formulas know of a model: a count, ``"7B"``, a built-in name, an HF
``config.json`` (path or dict) or a torch module, read into one :class:`ModelShape`.

A ``config.json`` names the same fields differently per architecture (layers, heads, KV
heads, head dimension, intermediate size, experts); one clear line names what is missing.
Reads the one file the user names; never downloads anything, never imports torch (a
module's parameters are counted by duck typing).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from nbgpu.errors import UserInputError
from nbgpu.estimate.builtin_models import ModelConfig, lookup_model

__all__ = [
    "ModelShape",
    "kv_bytes_per_token",
    "model_shape",
    "read_hf_config",
    "resolve_model_config",
    "shape_from_config",
]


# (our field, the config keys that may hold it, in order of preference)
_REQUIRED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("hidden_size", ("hidden_size", "n_embd", "d_model")),
    ("num_hidden_layers", ("num_hidden_layers", "n_layer", "num_layers")),
    ("num_attention_heads", ("num_attention_heads", "n_head", "num_heads")),
    ("vocab_size", ("vocab_size",)),
)
_GATED_FAMILIES = ("llama", "mistral", "mixtral", "qwen", "gemma", "phi3", "olmo", "granite")


def _int_field(config: Mapping[str, Any], keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _load(source: str | Path | Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    if isinstance(source, Mapping):
        return source, str(source.get("_name_or_path") or "config dict")
    path = Path(source).expanduser()
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserInputError(f"config {str(path)!r} does not exist") from None
    except OSError as exc:
        raise UserInputError(f"config {str(path)!r} cannot be read: {exc.strerror}") from None
    except ValueError as exc:  # not UTF-8, or not JSON
        raise UserInputError(f"config {str(source)!r}: not readable JSON ({exc})") from None
    if not isinstance(data, Mapping):
        raise UserInputError(f"config {str(source)!r}: expected a JSON object")
    return data, str(path)


def read_hf_config(source: str | Path | Mapping[str, Any]) -> ModelConfig:
    """A HF ``config.json`` (path, directory holding one, or the parsed dict) as a shape."""
    config, where = _load(source)
    # Vision-language configs keep the language model under text_config (newer
    # transformers) or at the top level (Qwen2.5-VL as published): prefer the top level.
    for nested in ("text_config", "llm_config", "language_config"):
        inner = config.get(nested)
        if isinstance(inner, Mapping) and "num_hidden_layers" not in config:
            config = {**inner, "torch_dtype": config.get("torch_dtype", inner.get("torch_dtype"))}
            break
    found = {field: _int_field(config, keys) for field, keys in _REQUIRED}
    missing = [field for field, value in found.items() if value is None]
    if missing:
        raise UserInputError(
            f"config {where} lacks {', '.join(missing)} (needed: hidden_size, "
            "num_hidden_layers, num_attention_heads, vocab_size; a HF config.json path or dict)"
        )
    hidden, layers, heads, vocab = (
        int(found["hidden_size"] or 0),
        int(found["num_hidden_layers"] or 0),
        int(found["num_attention_heads"] or 0),
        int(found["vocab_size"] or 0),
    )
    family = str(config.get("model_type") or "unknown").lower()
    act = str(config.get("hidden_act") or config.get("activation_function") or "").lower()
    experts = _int_field(config, ("num_local_experts", "num_experts", "n_routed_experts")) or 1
    dtype_text = str(config.get("torch_dtype") or config.get("dtype") or "").lower()
    dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(
        dtype_text.removeprefix("torch.")
    )
    return ModelConfig(
        name=where,
        family=family,
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=_int_field(config, ("num_key_value_heads", "num_kv_heads")) or heads,
        head_dim=_int_field(config, ("head_dim",)) or hidden // heads,
        intermediate_size=_int_field(config, ("intermediate_size", "n_inner", "ffn_dim"))
        or 4 * hidden,
        vocab_size=vocab,
        # transformers' PretrainedConfig default is tied.
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        max_context=_int_field(config, ("max_position_embeddings", "n_positions", "seq_length")),
        num_experts=experts,
        experts_per_token=_int_field(config, ("num_experts_per_tok", "moe_topk")) or 1,
        attention_bias=bool(config.get("attention_bias", family.startswith("qwen2"))),
        gated_mlp=family.startswith(_GATED_FAMILIES) or act in ("silu", "swish", "swiglu"),
        dtype=dtype,
        declared_parameters=_int_field(config, ("num_parameters", "n_params", "num_params")),
    )


def resolve_model_config(model: str | Path | Mapping[str, Any]) -> ModelConfig:
    """A built-in name, a ``config.json`` path (or its directory) or a config dict."""
    if isinstance(model, Mapping):
        return read_hf_config(model)
    text = str(model)
    if isinstance(model, Path) or text.endswith(".json") or Path(text).expanduser().exists():
        return read_hf_config(model)
    return lookup_model(text)


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
    """The formulas' view of a :class:`~nbgpu.estimate.builtin_models.ModelConfig`."""
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
        if model < 1:
            raise UserInputError(f"parameter count {model!r}: expected a whole number >= 1")
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
