"""A built-in shape written back as the ``config.json`` Hugging Face publishes (test input)."""

from __future__ import annotations

from typing import Any

from nbgpu.estimate.shapes import TORCH_DTYPES, ModelConfig


def hf_dict(cfg: ModelConfig) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model_type": cfg.family,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "num_parameters": cfg.parameters,
    }
    if cfg.max_context is not None:
        out["max_position_embeddings"] = cfg.max_context
    if cfg.num_experts > 1:
        out["num_local_experts"] = cfg.num_experts
        out["num_experts_per_tok"] = cfg.experts_per_token
    if cfg.dtype is not None:
        out["torch_dtype"] = TORCH_DTYPES[cfg.dtype]
    return out
