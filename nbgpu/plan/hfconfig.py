"""A model's shape from its Hugging Face ``config.json``: a path, a dict, or a built-in name.

Reads the fields every architecture names differently (layers, heads, KV heads, head
dimension, intermediate size, experts), with one clear line naming what is missing. Reads
the one file the user names; never downloads anything.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nbgpu.errors import UserInputError
from nbgpu.plan.files import read_text
from nbgpu.plan.models import ModelConfig, lookup_model

__all__ = ["read_hf_config", "resolve_model_config"]


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
    text = read_text(path, "config")  # files.py: the one module of plan/ that reads files
    try:
        data = json.loads(text)
    except ValueError as exc:
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
