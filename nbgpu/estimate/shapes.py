"""What the formulas know of a model: a count, ``"7B"``, a built-in name, an HF
``config.json`` (path or dict) or a torch module, read into one :class:`ModelShape`.

The built-in table, copied from each model's published ``config.json`` (named above each
family's rows), makes ``nbgpu.estimate("Qwen/Qwen2.5-7B-Instruct")`` and the engines' KV-cache
check work offline; parameter counts are computed from the shape and tested against the model
cards. A ``config.json`` names the same fields differently per architecture; one line names
what is missing. Reads the one file the user names; never downloads anything, never imports
torch (a module's parameters are counted by duck typing).
"""

import contextlib
import difflib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from nbgpu.errors import UserInputError, user_path

__all__ = ["BUILTIN_MODELS", "TORCH_DTYPES", "ModelConfig", "ModelShape", "find_model",
           "kv_bytes_per_token", "lookup_model", "model_shape", "read_hf_config",
           "resolve_model_config"]  # fmt: skip

#: torch's name of each precision (a config.json's ``torch_dtype``).
TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass(frozen=True)
class ModelConfig:
    """The architecture fields of a decoder-only transformer that memory depends on."""

    name: str  # HF repo id ("Qwen/Qwen2.5-7B-Instruct"), or where a config was read from
    family: str  # "llama", "qwen2", "mistral", "mixtral", or the config's model_type
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_context: int | None  # max_position_embeddings; None when the config omits it
    num_experts: int = 1  # MoE: experts per layer (each a full MLP)
    experts_per_token: int = 1  # MoE: experts each token is routed to
    attention_bias: bool = False  # Qwen2: q/k/v projections carry biases
    gated_mlp: bool = True  # SwiGLU (3 matrices) rather than a 2-matrix MLP
    dtype: str | None = None  # torch_dtype as published: bf16 / fp16 / fp32
    declared_parameters: int | None = None  # an explicit count in the config, if any

    @property
    def parameters(self) -> int:
        """Parameters of the shape: embeddings, attention, MLP (all experts), norms, head."""
        if self.declared_parameters is not None:
            return self.declared_parameters
        h, hd = self.hidden_size, self.head_dim
        q_out, kv_out = self.num_attention_heads * hd, self.num_kv_heads * hd
        attention = h * q_out + 2 * h * kv_out + q_out * h
        if self.attention_bias:
            attention += q_out + 2 * kv_out
        mlp = (3 if self.gated_mlp else 2) * h * self.intermediate_size * self.num_experts
        router = h * self.num_experts if self.num_experts > 1 else 0
        per_layer = attention + mlp + router + 2 * h  # two RMSNorm weights
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h  # + final norm

    @property
    def has_kv_cache(self) -> bool:
        """Decoder-only models cache K and V; encoders and encoder-decoders are not counted."""
        return not self.family.startswith(_NO_KV_CACHE)

    @property
    def active_parameters(self) -> int:
        """Parameters one token passes through (MoE: only its routed experts)."""
        unused = self.num_experts - self.experts_per_token
        mlp_one = (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size
        return self.parameters - self.num_layers * unused * mlp_one

    def kv_bytes_per_token(
        self, dtype_bytes: int = 2, tensor_parallel: int = 1, pipeline_parallel: int = 1
    ) -> int:
        """KV-cache bytes per token on one GPU (memory.md §5c): vLLM and SGLang split the KV
        heads over tensor-parallel ranks, and replicate them when tp > kv_heads; a pipeline
        stage holds its share of the layers."""
        heads = -(-self.num_kv_heads // max(1, tensor_parallel))
        layers = -(-self.num_layers // pipeline_parallel)
        return 2 * layers * heads * self.head_dim * dtype_bytes


# ------------------------------------------------------------------------- built-in table


def _shape(  # noqa: PLR0917 - one table row per call reads best positionally
    family: str,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    *,
    tied: bool,
    context: int | None,
    head_dim: int | None = None,
    experts: int = 1,
    top_k: int = 1,
    bias: bool = False,
    dtype: str = "bf16",
) -> ModelConfig:
    # In ModelConfig's field order: the dimensions, then tied, context, experts, top-k, bias.
    dims = (hidden, layers, heads, kv_heads, head_dim or hidden // heads, intermediate, vocab)
    return ModelConfig("", family, *dims, tied, context, experts, top_k, bias, dtype=dtype)


# Each row: repo names sharing one shape (base and instruct releases differ only in
# weights, and in a few cases in max_position_embeddings, which is then a row of its own).
# fmt: off
_ROWS: tuple[tuple[tuple[str, ...], ModelConfig], ...] = (
    # Llama 2 - huggingface.co/meta-llama/Llama-2-{7b,13b,70b}-hf/blob/main/config.json
    # (published as float16).
    (("meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-7b-chat-hf"),
     _shape("llama", 4096, 32, 32, 32, 11008, 32000, tied=False, context=4096, dtype="fp16")),
    (("meta-llama/Llama-2-13b-hf", "meta-llama/Llama-2-13b-chat-hf"),
     _shape("llama", 5120, 40, 40, 40, 13824, 32000, tied=False, context=4096, dtype="fp16")),
    (("meta-llama/Llama-2-70b-hf", "meta-llama/Llama-2-70b-chat-hf"),
     _shape("llama", 8192, 80, 64, 8, 28672, 32000, tied=False, context=4096, dtype="fp16")),
    # Llama 3 - huggingface.co/meta-llama/Meta-Llama-3-{8B,70B}/blob/main/config.json
    (("meta-llama/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-8B-Instruct"),
     _shape("llama", 4096, 32, 32, 8, 14336, 128256, tied=False, context=8192)),
    (("meta-llama/Meta-Llama-3-70B", "meta-llama/Meta-Llama-3-70B-Instruct"),
     _shape("llama", 8192, 80, 64, 8, 28672, 128256, tied=False, context=8192)),
    # Llama 3.1 / 3.3 - huggingface.co/meta-llama/Llama-3.1-{8B,70B,405B}/blob/main/config.json,
    # huggingface.co/meta-llama/Llama-3.3-70B-Instruct/blob/main/config.json
    (("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct",
      "meta-llama/Meta-Llama-3.1-8B", "meta-llama/Meta-Llama-3.1-8B-Instruct"),
     _shape("llama", 4096, 32, 32, 8, 14336, 128256, tied=False, context=131072)),
    (("meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-70B-Instruct",
      "meta-llama/Meta-Llama-3.1-70B", "meta-llama/Meta-Llama-3.1-70B-Instruct",
      "meta-llama/Llama-3.3-70B-Instruct"),
     _shape("llama", 8192, 80, 64, 8, 28672, 128256, tied=False, context=131072)),
    (("meta-llama/Llama-3.1-405B", "meta-llama/Llama-3.1-405B-Instruct",
      "meta-llama/Meta-Llama-3.1-405B", "meta-llama/Meta-Llama-3.1-405B-Instruct"),
     _shape("llama", 16384, 126, 128, 8, 53248, 128256, tied=False, context=131072)),
    # Llama 3.2 (text) - huggingface.co/meta-llama/Llama-3.2-{1B,3B}/blob/main/config.json
    (("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-1B-Instruct"),
     _shape("llama", 2048, 16, 32, 8, 8192, 128256, tied=True, context=131072, head_dim=64)),
    (("meta-llama/Llama-3.2-3B", "meta-llama/Llama-3.2-3B-Instruct"),
     _shape("llama", 3072, 28, 24, 8, 8192, 128256, tied=True, context=131072, head_dim=128)),
    # Qwen2 - huggingface.co/Qwen/Qwen2-{0.5B,1.5B,7B,72B}/blob/main/config.json (7B, 72B: below)
    (("Qwen/Qwen2-0.5B", "Qwen/Qwen2-0.5B-Instruct"),
     _shape("qwen2", 896, 24, 14, 2, 4864, 151936, tied=True, context=131072, bias=True)),
    (("Qwen/Qwen2-1.5B", "Qwen/Qwen2-1.5B-Instruct"),
     _shape("qwen2", 1536, 28, 12, 2, 8960, 151936, tied=True, context=131072, bias=True)),
    # Qwen2.5 - huggingface.co/Qwen/Qwen2.5-{0.5B..72B}[-Instruct]/blob/main/config.json
    (("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B-Instruct"),
     _shape("qwen2", 896, 24, 14, 2, 4864, 151936, tied=True, context=32768, bias=True)),
    (("Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-1.5B-Instruct"),
     _shape("qwen2", 1536, 28, 12, 2, 8960, 151936, tied=True, context=32768, bias=True)),
    (("Qwen/Qwen2.5-3B", "Qwen/Qwen2.5-3B-Instruct"),
     _shape("qwen2", 2048, 36, 16, 2, 11008, 151936, tied=True, context=32768, bias=True)),
    (("Qwen/Qwen2.5-7B", "Qwen/Qwen2-7B"),
     _shape("qwen2", 3584, 28, 28, 4, 18944, 152064, tied=False, context=131072, bias=True)),
    (("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2-7B-Instruct"),
     _shape("qwen2", 3584, 28, 28, 4, 18944, 152064, tied=False, context=32768, bias=True)),
    (("Qwen/Qwen2.5-14B",),
     _shape("qwen2", 5120, 48, 40, 8, 13824, 152064, tied=False, context=131072, bias=True)),
    (("Qwen/Qwen2.5-14B-Instruct",),
     _shape("qwen2", 5120, 48, 40, 8, 13824, 152064, tied=False, context=32768, bias=True)),
    (("Qwen/Qwen2.5-32B",),
     _shape("qwen2", 5120, 64, 40, 8, 27648, 152064, tied=False, context=131072, bias=True)),
    (("Qwen/Qwen2.5-32B-Instruct",),
     _shape("qwen2", 5120, 64, 40, 8, 27648, 152064, tied=False, context=32768, bias=True)),
    (("Qwen/Qwen2.5-72B", "Qwen/Qwen2-72B"),
     _shape("qwen2", 8192, 80, 64, 8, 29568, 152064, tied=False, context=131072, bias=True)),
    (("Qwen/Qwen2.5-72B-Instruct", "Qwen/Qwen2-72B-Instruct"),
     _shape("qwen2", 8192, 80, 64, 8, 29568, 152064, tied=False, context=32768, bias=True)),
    # Qwen2.5-VL, language model only (the vision tower is not counted) -
    # huggingface.co/Qwen/Qwen2.5-VL-{3B,7B,72B}-Instruct/blob/main/config.json
    (("Qwen/Qwen2.5-VL-3B-Instruct",),
     _shape("qwen2", 2048, 36, 16, 2, 11008, 151936, tied=True, context=128000, bias=True)),
    (("Qwen/Qwen2.5-VL-7B-Instruct",),
     _shape("qwen2", 3584, 28, 28, 4, 18944, 152064, tied=False, context=128000, bias=True)),
    (("Qwen/Qwen2.5-VL-72B-Instruct",),
     _shape("qwen2", 8192, 80, 64, 8, 29568, 152064, tied=False, context=128000, bias=True)),
    # Mistral - huggingface.co/mistralai/Mistral-7B-v0.1, Mistral-7B-Instruct-v0.2,
    # Mistral-7B-v0.3, Mistral-Nemo-Base-2407 /blob/main/config.json
    (("mistralai/Mistral-7B-v0.1", "mistralai/Mistral-7B-Instruct-v0.1",
      "mistralai/Mistral-7B-Instruct-v0.2"),
     _shape("mistral", 4096, 32, 32, 8, 14336, 32000, tied=False, context=32768)),
    (("mistralai/Mistral-7B-v0.3", "mistralai/Mistral-7B-Instruct-v0.3"),
     _shape("mistral", 4096, 32, 32, 8, 14336, 32768, tied=False, context=32768)),
    (("mistralai/Mistral-Nemo-Base-2407", "mistralai/Mistral-Nemo-Instruct-2407"),
     _shape("mistral", 5120, 40, 32, 8, 14336, 131072, tied=False, context=1024000, head_dim=128)),
    # Mixtral - huggingface.co/mistralai/Mixtral-8x7B-v0.1 and Mixtral-8x22B-v0.1
    # /blob/main/config.json (8 experts per layer, 2 per token)
    (("mistralai/Mixtral-8x7B-v0.1", "mistralai/Mixtral-8x7B-Instruct-v0.1"),
     _shape("mixtral", 4096, 32, 32, 8, 14336, 32000, tied=False, context=32768, experts=8, top_k=2)),
    (("mistralai/Mixtral-8x22B-v0.1", "mistralai/Mixtral-8x22B-Instruct-v0.1"),
     _shape("mixtral", 6144, 56, 48, 8, 16384, 32768, tied=False, context=65536, experts=8, top_k=2)),
)
# fmt: on


#: Every built-in shape, by canonical Hugging Face repo name.
BUILTIN_MODELS: Mapping[str, ModelConfig] = {
    name: replace(shape, name=name) for names, shape in _ROWS for name in names
}

# Lookup keys: the full id and the bare repo name, both lower case.
_BY_KEY: dict[str, ModelConfig] = {}
for _name, _cfg in BUILTIN_MODELS.items():
    _BY_KEY[_name.lower()] = _cfg
    _BY_KEY.setdefault(_name.split("/", 1)[1].lower(), _cfg)


def find_model(name: str) -> ModelConfig | None:
    """The built-in shape for a HF repo name (case-insensitive, ``org/`` optional), or None."""
    key = str(name).strip().lower()
    # A different org (a fine-tune re-upload) with a known repo name keeps the shape.
    return _BY_KEY.get(key) or _BY_KEY.get(key.rsplit("/", 1)[-1])


def lookup_model(name: str) -> ModelConfig:
    """Like :func:`find_model`, but an unknown name is a one-line ``UserInputError``."""
    if (hit := find_model(name)) is not None:
        return hit
    bare = sorted({n.split("/", 1)[1] for n in BUILTIN_MODELS})
    key = str(name).strip().rsplit("/", 1)[-1]
    close = difflib.get_close_matches(key, bare, n=3, cutoff=0.6)
    hint = f"close: {', '.join(close)}; " if close else ""
    raise UserInputError(
        f"model {name!r} is not a built-in shape ({hint}built in: Llama 2/3/3.1/3.2/3.3, "
        "Qwen2/2.5/2.5-VL, Mistral, Mixtral); pass the model's config.json path or dict"
    )


# (our field, the config keys that may hold it, in order of preference)
_REQUIRED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("hidden_size", ("hidden_size", "n_embd", "d_model")),
    ("num_hidden_layers", ("num_hidden_layers", "n_layer", "num_layers")),
    ("num_attention_heads", ("num_attention_heads", "n_head", "num_heads")),
    ("vocab_size", ("vocab_size",)),
)
_NO_KV_CACHE = ("bert", "roberta", "xlm-roberta", "deberta", "distilbert", "electra", "t5", "bart")
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
    path = user_path(source)
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
    if missing := [field for field, value in found.items() if value is None]:
        raise UserInputError(
            f"config {where} lacks {', '.join(missing)} (needed: hidden_size, "
            "num_hidden_layers, num_attention_heads, vocab_size; a HF config.json path or dict)"
        )
    hidden, layers, heads, vocab = (int(value or 0) for value in found.values())
    family = str(config.get("model_type") or "unknown").lower()
    act = str(config.get("hidden_act") or config.get("activation_function") or "").lower()
    experts = _int_field(config, ("num_local_experts", "num_experts", "n_routed_experts")) or 1
    dtype_text = str(config.get("torch_dtype") or config.get("dtype") or "").lower()
    dtype = {v: k for k, v in TORCH_DTYPES.items()}.get(dtype_text.removeprefix("torch."))
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
    if isinstance(model, Mapping):
        return read_hf_config(model)
    text = str(model)
    if isinstance(model, Path) or text.endswith(".json") or user_path(text).exists():
        return read_hf_config(model)
    return lookup_model(text)


@dataclass(frozen=True)
class ModelShape:
    """A parameter count, where it came from, and the architecture when the input has one
    (a built-in name, a config.json, a module's HF config): activations and KV cache need it."""

    parameters: int
    source: str  # "7B", "parameter count", "HF config", "torch module", the model's name
    config: ModelConfig | None = None

    @property
    def has_kv_shape(self) -> bool:
        return self.config is not None and self.config.has_kv_cache

    @property
    def num_attention_heads(self) -> int | None:
        return None if self.config is None else self.config.num_attention_heads

    @property
    def dtype(self) -> str | None:
        """The config's torch_dtype, normalised (bf16/fp16/fp32)."""
        return None if self.config is None else self.config.dtype


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([kmbt]?)\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
_MODEL_FORMS = (
    "expected a parameter count (7_000_000_000 or '7B'), a built-in model name "
    "('Qwen/Qwen2.5-7B-Instruct'), an HF config.json (path or dict) or a torch module"
)


def model_shape(model: Any) -> ModelShape:
    """Read a model: a count, ``"7B"``, a built-in name, a config.json path/dict or a module."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, ModelConfig):
        return ModelShape(model.parameters, model.name, model)
    if isinstance(model, str):
        m = _SIZE.match(model.replace("_", ""))
        if m is None and model.strip() and not model.strip()[0].isdigit():
            config = resolve_model_config(model)
            return ModelShape(config.parameters, config.name, config)
        count = float(m.group(1)) * _SCALE[m.group(2).lower()] if m else 0.0
        if 1 <= count < math.inf:  # '1e400' is no count
            return ModelShape(parameters=round(count), source=model.strip())
    if isinstance(model, bool | str):  # a size below one, or neither a size nor a name
        raise UserInputError(f"model {model!r}: {_MODEL_FORMS}")
    if isinstance(model, int):
        if model < 1:
            raise UserInputError(f"parameter count {model!r}: expected a whole number >= 1")
        return ModelShape(parameters=model, source="parameter count")
    if isinstance(model, float) and model.is_integer() and model >= 1:
        return ModelShape(parameters=int(model), source="parameter count")
    if isinstance(model, Mapping):
        config = read_hf_config(model)
        return ModelShape(config.parameters, "HF config", config)
    parameters_fn = getattr(model, "parameters", None)
    if callable(parameters_fn):
        # Tied weights appear once per module that shares them: count each tensor once.
        seen = {id(tensor): int(tensor.numel()) for tensor in parameters_fn()}
        if not seen:
            raise UserInputError(f"model {type(model).__name__} has no parameters")
        architecture: ModelConfig | None = None
        hf_config = getattr(model, "config", None)
        if hf_config is not None and hasattr(hf_config, "to_dict"):
            with contextlib.suppress(UserInputError):
                architecture = read_hf_config(hf_config.to_dict())
        return ModelShape(sum(seen.values()), "torch module", architecture)
    raise UserInputError(f"model of type {type(model).__name__}: {_MODEL_FORMS}")


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int, tensor_parallel: int = 1) -> int:
    """KV bytes per token on one GPU of a shape whose ``has_kv_shape`` the caller checked."""
    assert shape.config is not None  # noqa: S101  (callers check has_kv_shape)
    return shape.config.kv_bytes_per_token(dtype_bytes, tensor_parallel)
