import pytest

from nbgpu.errors import UserInputError
from nbgpu.estimate.formulas import byte_accounting, model_states, weight_bytes
from nbgpu.estimate.shapes import kv_bytes_per_token, model_shape

GIB = 2**30
LLAMA3_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize(
    ("strategy", "gib"),
    # The project's reference notes (memory.md §5a): Ψ = 6.74B, N = 3, GiB, the row that
    # applies the ZeRO paper's formulas. Not printed in the paper: its own worked example
    # is the next test.
    [("ddp", 100.4), ("zero1", 50.2), ("zero2", 41.8), ("zero3", 33.5), ("fsdp", 33.5)],
)
def test_the_reference_notes_6_74b_example(strategy, gib):
    states = model_states(6_740_000_000, strategy=strategy, data_parallel=3)
    assert round(states.total_bytes / GIB, 1) == gib


def test_paper_example_7_5b_on_64_gpus():
    # The ZeRO paper's worked example (https://arxiv.org/abs/1910.02054, Figure 1):
    # 7.5B params, K = 12, N_d = 64: 120 GB -> 31.4 -> 16.6 -> 1.9 GB (decimal).
    totals = [
        model_states(7_500_000_000, strategy=s, data_parallel=64).total_bytes / 1e9
        for s in ("ddp", "zero1", "zero2", "zero3")
    ]
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]


def test_byte_accounting_is_stated():
    mixed = byte_accounting("bf16", "adamw")
    assert (mixed.param_bytes, mixed.grad_bytes, mixed.optimizer_bytes) == (2, 2, 12)
    assert "16 B/param" in mixed.text
    full = byte_accounting("fp32", "adam")
    assert full.total == 16
    assert byte_accounting("fp16", "sgd").optimizer_bytes == 8


def test_tensor_and_pipeline_parallel_split_before_sharding():
    plain = model_states(1_000_000_000, strategy="zero2", data_parallel=2)
    split = model_states(
        1_000_000_000, strategy="zero2", data_parallel=2, tensor_parallel=2, pipeline_parallel=2
    )
    assert split.total_bytes == pytest.approx(plain.total_bytes / 4, abs=4)
    assert "Ψ/4" in split.formula


def test_hf_config_parameter_count_and_kv_cache_of_llama3_8b():
    shape = model_shape(LLAMA3_8B)
    assert round(shape.parameters / 1e9, 2) == 8.03
    # memory.md §5c: 128 KiB per token, 1 GiB per 8192-token sequence.
    assert kv_bytes_per_token(shape, 2) == 128 * 1024
    assert kv_bytes_per_token(shape, 2) * 8192 == GIB
    assert kv_bytes_per_token(shape, 2, tensor_parallel=4) == 32 * 1024
    # More TP ranks than KV heads: each rank still holds one head.
    assert kv_bytes_per_token(shape, 2, tensor_parallel=16) == 16 * 1024


def test_model_forms():
    assert model_shape(7_000_000_000).parameters == 7_000_000_000
    assert model_shape("1.5B").parameters == 1_500_000_000
    assert model_shape("350m").parameters == 350_000_000
    assert model_shape({"text_config": LLAMA3_8B}).config.num_layers == 32
    assert weight_bytes(1_000, "bf16", tensor_parallel=2) == 1_000


class _Tensor:
    def __init__(self, n):
        self.n = n

    def numel(self):
        return self.n


class _Module:
    """Duck-typed like torch.nn.Module: tied weights appear twice."""

    def __init__(self):
        shared = _Tensor(100)
        self._params = [shared, _Tensor(20), shared]

    def parameters(self):
        return iter(self._params)


def test_a_module_is_counted_by_duck_typing_and_tied_weights_once():
    shape = model_shape(_Module())
    assert shape.parameters == 120
    assert shape.source == "torch module"


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: model_shape("seven billion"), "'seven billion'"),
        (lambda: model_shape({"hidden_size": 8}), "lacks num_hidden_layers"),
        (lambda: model_shape(object()), "object"),
        (lambda: model_states(10, strategy="zero4"), "'zero4'"),
        (lambda: byte_accounting("int8"), "'int8'"),
        (lambda: byte_accounting("bf16", "lion"), "'lion'"),
        (lambda: model_states(0), "parameter count 0"),
    ],
)
def test_bad_model_input_is_one_line(call, fragment):
    with pytest.raises(UserInputError) as err:
        call()
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("precision", "grad_dtype", "replicated", "distributed"),
    # Megatron-LM's distributed-optimizer table, bytes per parameter at DP size d = 8:
    # bf16 params with fp32 grads 18 / 6 + 12/d; fp32 params and grads 16 / 8 + 8/d.
    [("bf16", "fp32", 18, 6 + 12 / 8), ("fp32", "fp32", 16, 8 + 8 / 8)],
)
def test_grad_dtype_and_distributed_optimizer_match_megatron(
    precision, grad_dtype, replicated, distributed
):
    psi = 1_000_000_000
    kwargs = {"precision": precision, "grad_dtype": grad_dtype, "data_parallel": 8}
    assert model_states(psi, strategy="ddp", **kwargs).total_bytes == replicated * psi
    assert model_states(psi, strategy="distopt", **kwargs).total_bytes == distributed * psi
    assert "fp32 grads 4 B" in byte_accounting("bf16", grad_dtype="fp32").text


def test_grad_dtype_defaults_to_the_precision():
    assert byte_accounting("bf16").grad_bytes == 2
    with pytest.raises(UserInputError, match="grad_dtype='fp8': expected one of bf16"):
        byte_accounting("bf16", grad_dtype="fp8")
