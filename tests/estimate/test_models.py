"""Built-in model shapes and the HF config.json reader (nbgpu/estimate/builtin_models.py, shapes.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nbgpu.errors import UserInputError
from nbgpu.estimate.shapes import (
    BUILTIN_MODELS,
    find_model,
    lookup_model,
    read_hf_config,
    resolve_model_config,
)
from tests.estimate.hf_configs import hf_dict

# Parameter counts as the model cards / papers publish them (billions, rounded as published).
PUBLISHED = {
    "meta-llama/Llama-2-7b-hf": 6.74,
    "meta-llama/Llama-2-13b-hf": 13.0,
    "meta-llama/Llama-2-70b-hf": 69.0,
    "meta-llama/Meta-Llama-3-8B": 8.03,
    "meta-llama/Meta-Llama-3-70B": 70.6,
    "meta-llama/Llama-3.1-405B": 405.9,
    "meta-llama/Llama-3.2-1B": 1.24,
    "meta-llama/Llama-3.2-3B": 3.21,
    "Qwen/Qwen2.5-0.5B": 0.49,
    "Qwen/Qwen2.5-1.5B": 1.54,
    "Qwen/Qwen2.5-3B": 3.09,
    "Qwen/Qwen2.5-7B-Instruct": 7.61,
    "Qwen/Qwen2.5-14B": 14.7,
    "Qwen/Qwen2.5-72B": 72.7,
    "mistralai/Mistral-7B-v0.1": 7.24,
    "mistralai/Mistral-Nemo-Base-2407": 12.2,
    "mistralai/Mixtral-8x7B-v0.1": 46.7,
    "mistralai/Mixtral-8x22B-v0.1": 141.0,
}


@pytest.mark.parametrize(("name", "billions"), sorted(PUBLISHED.items()))
def test_parameter_count_matches_the_published_figure(name: str, billions: float) -> None:
    assert lookup_model(name).parameters / 1e9 == pytest.approx(billions, rel=0.01)


def test_mixtral_active_parameters_are_the_published_12_9b() -> None:
    assert lookup_model("Mixtral-8x7B-v0.1").active_parameters / 1e9 == pytest.approx(
        12.9, rel=0.01
    )


def test_lookup_is_case_insensitive_and_org_optional() -> None:
    full = lookup_model("Qwen/Qwen2.5-7B-Instruct")
    assert lookup_model("qwen2.5-7b-instruct") is full
    assert lookup_model("  QWEN/QWEN2.5-7B-INSTRUCT ") is full
    # a re-upload under another org keeps the shape of the known repo name
    assert find_model("someone/Qwen2.5-7B-Instruct") is full
    assert full.name == "Qwen/Qwen2.5-7B-Instruct"
    assert (full.hidden_size, full.num_layers, full.num_kv_heads, full.head_dim) == (
        3584,
        28,
        4,
        128,
    )


def test_llama3_8b_kv_cache_is_128_kib_per_token() -> None:
    # memory.md §5c: 32 layers, 8 KV heads, 128 head dim, bf16 -> 128 KiB/token
    assert lookup_model("Meta-Llama-3-8B").kv_bytes_per_token(2) == 128 * 1024
    # TP 16 > 8 KV heads: each GPU still holds one head per layer
    assert lookup_model("Meta-Llama-3-8B").kv_bytes_per_token(2, 16) == 16 * 1024


def test_unknown_name_is_one_line_with_close_matches() -> None:
    with pytest.raises(UserInputError) as info:
        lookup_model("Qwen/Qwen2.5-8B-Instruct")
    text = str(info.value)
    assert "\n" not in text
    assert "'Qwen/Qwen2.5-8B-Instruct'" in text
    assert "Qwen2.5-7B-Instruct" in text
    assert find_model("no-such-model") is None


def test_every_row_is_a_consistent_shape() -> None:
    for name, cfg in BUILTIN_MODELS.items():
        assert cfg.name == name
        assert cfg.num_attention_heads % cfg.num_kv_heads == 0, name
        assert cfg.max_context is not None, name
        assert cfg.max_context >= 4096, name


def test_reader_round_trips_a_builtin_config(tmp_path: Path) -> None:
    cfg = lookup_model("Llama-3.2-1B")
    path = tmp_path / "config.json"
    body = hf_dict(cfg)
    del body["num_parameters"]
    path.write_text(json.dumps(body))
    for source in (path, str(path), tmp_path):
        read = read_hf_config(source)
        assert read.parameters == cfg.parameters
        assert read.kv_bytes_per_token() == cfg.kv_bytes_per_token()
        assert read.tie_word_embeddings
        assert read.max_context == 131072
        assert read.dtype == "bf16"
    assert resolve_model_config(str(path)).parameters == cfg.parameters
    assert resolve_model_config("llama-3.2-1b") is cfg


def test_reader_takes_the_language_model_of_a_vision_config() -> None:
    vl = {
        "model_type": "qwen2_5_vl",
        "torch_dtype": "bfloat16",
        "vision_config": {"hidden_size": 1280},
        "text_config": hf_dict(lookup_model("Qwen2.5-VL-7B-Instruct")),
    }
    assert read_hf_config(vl).hidden_size == 3584


def test_missing_fields_are_named_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(UserInputError) as info:
        read_hf_config({"hidden_size": 64, "num_attention_heads": 4})
    text = str(info.value)
    assert "\n" not in text
    assert "num_hidden_layers, vocab_size" in text
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(UserInputError, match="not readable JSON"):
        read_hf_config(bad)
    with pytest.raises(UserInputError, match="does not exist"):
        read_hf_config(tmp_path / "missing.json")
