"""nbgpu.estimate: analytic terms, formulas and sources, largest micro batch, bad input."""

from __future__ import annotations

import json
from html import escape

import pytest

import nbgpu
import nbgpu.plan
from nbgpu.errors import UserInputError
from nbgpu.estimate import estimate, estimate_memory, largest_micro_batch, lookup_model
from tests.estimate.hf_configs import hf_dict

GB = 10**9


@pytest.mark.parametrize(
    ("strategy", "published_gb"),
    [("ddp", 120.0), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.9)],
)
def test_zero_paper_worked_example(strategy: str, published_gb: float) -> None:
    # Rajbhandari et al., "ZeRO" (https://arxiv.org/abs/1910.02054), Figure 1: a 7.5B
    # model, mixed-precision Adam (K = 12), N_d = 64: 120 GB baseline, 31.4 GB P_os,
    # 16.6 GB P_os+g, 1.9 GB P_os+g+p (decimal GB), compared at the figure's precision.
    est = estimate(7.5e9, precision="fp16", optimizer="adam", strategy=strategy, world_size=64)
    assert round(est.model_state_bytes / GB, 1) == published_gb


def test_nbgpu_estimate_is_the_public_callable() -> None:
    assert nbgpu.estimate is estimate
    assert callable(nbgpu.estimate.compare)
    assert estimate("7B").parameters == 7 * 10**9


def _gpt_like(h: int = 1024, a: int = 16, layers: int = 24) -> dict[str, object]:
    # A non-gated GELU MLP of width 4h with full multi-head attention: the paper's model.
    return {
        "model_type": "gpt2",
        "hidden_size": h,
        "num_hidden_layers": layers,
        "num_attention_heads": a,
        "intermediate_size": 4 * h,
        "vocab_size": 50257,
        "activation_function": "gelu_new",
    }


# Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
# (MLSys'23, https://arxiv.org/abs/2205.05198). Its models (s = 2048, 16-bit activations,
# a GELU MLP of 4h, attention scores kept): GPT-3 175B with h = 12288, a = 96, L = 96 and
# t = 8, MT-NLG 530B with h = 20480, a = 128, L = 105 (its Table 3). The figures below are
# the paper's, typed as it prints them, not derived here.
GPT3_175B = {"h": 12288, "a": 96, "layers": 96}
MT_NLG_530B = {"h": 20480, "a": 128, "layers": 105}


def _paper_model(model: dict[str, int], **kwargs: object):
    config = _gpt_like(model["h"], model["a"], model["layers"])
    return estimate(config, seq_len=2048, micro_batch=1, **kwargs).term("activations")


@pytest.mark.parametrize(
    ("tp", "per_layer_sbh"),
    # §4: sbh(34 + 5as/h) bytes a layer, sbh(10 + 24/t + 5as/(ht)) with tensor parallel t
    # (Table 2); §5: "for GPT-3, 5as/h = 80". The paper runs GPT-3 at t = 8.
    [(1, 34 + 80), (8, 10 + 24 / 8 + 80 / 8)],
)
def test_activations_reproduce_korthikanti(tp: int, per_layer_sbh: float) -> None:
    term = _paper_model(GPT3_175B, flash_attention=False, tensor_parallel=tp, world_size=tp)
    s, b, h, layers = 2048, 1, GPT3_175B["h"], GPT3_175B["layers"]
    assert term.bytes_per_gpu == layers * s * b * h * per_layer_sbh
    assert "Korthikanti" in term.source


@pytest.mark.parametrize(("model", "saved_percent"), [(GPT3_175B, 70), (MT_NLG_530B, 65)])
def test_without_attention_scores_the_activations_shrink_as_the_paper_says(
    model: dict[str, int], saved_percent: int
) -> None:
    # §5: recomputing the attention core (selective recomputation) saves 70 % of GPT-3's
    # activation memory and 65 % of MT-NLG's. Flash attention keeps no scores either, only
    # a logsumexp of 4·a·s·b bytes, too small to move the percentage.
    kept = _paper_model(model, flash_attention=True).bytes_per_gpu
    scores = _paper_model(model, flash_attention=False).bytes_per_gpu
    assert round(100 * (1 - kept / scores)) == saved_percent


def test_checkpointing_keeps_layer_inputs_and_one_layer() -> None:
    s, b, h, a, layers = 1024, 2, 1024, 16, 24
    full = estimate(_gpt_like(h, a, layers), seq_len=s, micro_batch=b, flash_attention=False)
    ckpt = estimate(
        _gpt_like(h, a, layers),
        seq_len=s,
        micro_batch=b,
        flash_attention=False,
        activation_checkpointing=True,
    )
    one_layer = s * b * h * (34 + 5 * a * s / h)
    assert ckpt.term("activations").bytes_per_gpu == pytest.approx(
        layers * 2 * s * b * h + one_layer
    )
    assert full.term("activations").bytes_per_gpu == pytest.approx(layers * one_layer)


def test_kv_cache_llama3_8b_is_1_gib_per_8192_tokens() -> None:
    est = estimate("meta-llama/Meta-Llama-3-8B", role="inference", micro_batch=1, seq_len=8192)
    assert est.term("KV cache").bytes_per_gpu == 2**30
    assert est.term("gradients") is None  # serving holds no gradients


def test_every_term_carries_formula_and_source_in_every_view() -> None:
    est = estimate(
        "Qwen/Qwen2.5-7B-Instruct", strategy="zero2", world_size=8, micro_batch=4, seq_len=4096
    )
    names = [t.name for t in est.terms]
    for expected in (
        "weights",
        "gradients",
        "optimizer states",
        "activations",
        "logits/loss",
        "CUDA context",
        "NCCL buffers",
        "fragmentation",
    ):
        assert expected in names
    data = json.loads(est.to_json())
    assert all(t["formula"] and t["source"] for t in data["terms"])
    assert data["total_bytes"] == sum(t["bytes_per_gpu"] for t in data["terms"])
    text, html = est.text(), est.html()
    for t in est.terms:
        assert t.formula[:20] in text
        assert escape(t.source.split(";")[0], quote=False) in html
    assert "Rajbhandari" in text
    assert "Korthikanti" in text
    assert 'title="activations: ' in html  # the stacked bar, static HTML
    frame = est.to_frame()
    assert list(frame.columns) == list(est.FRAME_COLUMNS)
    assert len(frame) == len(est.terms)


def test_ddp_buckets_follow_gradient_as_bucket_view() -> None:
    with_copy = estimate("1B", world_size=2)
    view = estimate("1B", world_size=2, gradient_as_bucket_view=True)
    assert with_copy.term("DDP gradient buckets").bytes_per_gpu == 2 * 10**9
    assert view.term("DDP gradient buckets").bytes_per_gpu == 0
    assert estimate("1B", world_size=1).term("NCCL buffers").bytes_per_gpu == 0


def test_a_parameter_count_says_what_it_cannot_compute() -> None:
    est = estimate("7B", seq_len=4096)
    assert est.term("activations").bytes_per_gpu is None
    assert est.term("activations").bytes_per_gpu is None
    assert "not computable without the model's shape" in _words(est)


def test_largest_micro_batch_is_computed_and_the_smallest_gpu_decides() -> None:
    kwargs = {"strategy": "zero3", "world_size": 8, "seq_len": 4096}
    kwargs["activation_checkpointing"] = True
    best = largest_micro_batch("meta-llama/Llama-3.1-8B", ["80GB", "40GB", "80GB"], **kwargs)
    n = best.max_micro_batch
    assert n is not None
    assert n >= 1
    assert best.layout.micro_batch == n
    assert best.fits
    over = estimate_memory("meta-llama/Llama-3.1-8B", micro_batch=n + 1, budget="40GB", **kwargs)
    assert over.fits is False
    bigger = largest_micro_batch("meta-llama/Llama-3.1-8B", "80GB", **kwargs)
    assert bigger.max_micro_batch > n


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"precision": "fp8"}, ["precision='fp8'", "bf16"]),
        ({"strategy": "zero4"}, ["strategy='zero4'", "zero3"]),
        ({"optimizer": "lion"}, ["optimizer='lion'", "adamw"]),
        ({"micro_batch": 0}, ["micro_batch=0", ">= 1"]),
        ({"world_size": -2}, ["world_size=-2", ">= 1"]),
        ({"seq_len": 0}, ["seq_len=0"]),
        ({"role": "serve"}, ["role='serve'", "inference"]),
        ({"budget": "lots"}, ["budget='lots'", "80GB"]),
        ({"world_size": 6, "tensor_parallel": 4}, ["world_size=6", "dp × tp × pp"]),
    ],
)
def test_bad_input_is_one_line_naming_the_value(kwargs: dict, words: list[str]) -> None:
    with pytest.raises(UserInputError) as info:
        estimate("7B", **kwargs)
    text = str(info.value)
    assert "\n" not in text
    for word in words:
        assert word in text


@pytest.mark.parametrize("model", ["-7B", "0", "seven", 0, -5])
def test_bad_model_sizes(model: object) -> None:
    with pytest.raises(UserInputError):
        estimate(model)


def test_hf_config_missing_fields_named() -> None:
    with pytest.raises(UserInputError, match="lacks num_hidden_layers, vocab_size"):
        estimate({"hidden_size": 64, "num_attention_heads": 4})


def test_builtin_config_equals_its_config_json(tmp_path) -> None:
    cfg = lookup_model("Qwen2.5-0.5B")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf_dict(cfg)))
    by_name = estimate("Qwen/Qwen2.5-0.5B", seq_len=512, micro_batch=2)
    by_file = estimate(str(path), seq_len=512, micro_batch=2)
    assert by_name.analytic_bytes == by_file.analytic_bytes


def test_a_budget_that_holds_no_sample_says_so_with_the_smallest_change() -> None:
    est = largest_micro_batch(
        "meta-llama/Llama-3.1-8B", "40GB", strategy="zero3", world_size=8, seq_len=4096
    )
    assert (est.max_micro_batch, est.fits) == (0, False)
    assert "smallest change that fits: activation_checkpointing=True" in _words(est)


ROLLOUT = {
    "CUDA_VISIBLE_DEVICES": "0,1",
    "actor_rollout_ref": {
        "rollout": {
            "tensor_model_parallel_size": 2,
            "gpu_memory_utilization": 0.34,
            "max_num_batched_tokens": 1800,
        },
    },
}


def test_scale_kv_check_takes_a_builtin_name_offline(sim_env) -> None:
    config = hf_dict(lookup_model("Qwen2.5-VL-3B-Instruct"))
    del config["num_parameters"]
    by_dict = nbgpu.plan.scale(
        ROLLOUT, inventory="4xA40", model=config, max_model_len=1800, environ=sim_env
    )
    by_name = nbgpu.plan.scale(
        ROLLOUT,
        inventory="4xA40",
        model="Qwen/Qwen2.5-VL-3B-Instruct",
        max_model_len=1800,
        environ=sim_env,
    )
    assert by_name.kv is not None
    assert by_name.kv.bytes_per_token == by_dict.kv.bytes_per_token
    assert by_name.kv.weights_bytes == pytest.approx(by_dict.kv.weights_bytes, rel=0.01)


def test_optimizer_offload_moves_states_to_the_host_per_rank_and_node() -> None:
    psi, n = 7_000_000_000, 8
    est = estimate(psi, strategy="zero2", world_size=n, offload="optimizer")
    on_gpu = {t.name: t.bytes_per_gpu for t in est.terms if t.kind == "model states"}
    assert on_gpu == {"weights": 2 * psi, "gradients": 0, "optimizer states": 0}
    # fp32 master + m + v (12) + fp32 grads (4) + the 16-bit pinned buffer (2), sharded.
    assert est.host_bytes == pytest.approx(18 * psi / n, abs=8)
    plain = estimate(psi, strategy="zero2", world_size=n)
    assert plain.total_bytes - est.total_bytes > 0.9 * (plain.model_state_bytes - 2 * psi)
    text = est.text()
    assert "host memory (not in the GPU total)" in text
    assert f"per node of {n} ranks" in text
    assert estimate(psi, strategy="zero2", world_size=n, offload="optimizer", gpus_per_node=4)
    assert est.to_dict()["host_bytes"] == est.host_bytes


def test_param_offload_needs_sharded_parameters() -> None:
    both = estimate("meta-llama/Llama-3.1-8B", strategy="zero3", world_size=8, seq_len=2048,
                    offload="optimizer+params")  # fmt: skip
    assert both.term("weights").bytes_per_gpu == 0
    assert both.term("host parameters").bytes_per_gpu > 0
    assert both.term("gathered layers").bytes_per_gpu > 0  # the working set stays on the GPU
    for kwargs, words in (
        ({"strategy": "zero2", "offload": "params"}, ["offload='params'", "zero3 or fsdp"]),
        ({"strategy": "ddp", "offload": "optimizer"}, ["offload='optimizer'", "ZeRO"]),
        ({"strategy": "zero3", "offload": "gpu"}, ["offload='gpu'", "optimizer, params"]),
    ):
        with pytest.raises(UserInputError) as info:
            estimate("7B", **kwargs)
        assert all(word in str(info.value) for word in words)


def test_encoders_show_no_kv_cache() -> None:
    bert = {"model_type": "bert", "hidden_size": 1024, "num_hidden_layers": 24,
            "num_attention_heads": 16, "intermediate_size": 4096, "vocab_size": 30522}  # fmt: skip
    est = estimate(bert, role="inference", micro_batch=8, seq_len=512)
    assert est.term("KV cache") is None
    assert est.term("activations") is not None
    t5 = estimate({**bert, "model_type": "t5"}, role="inference", seq_len=512)
    assert t5.term("KV cache") is None
    llama = estimate("meta-llama/Llama-3.1-8B", role="inference", seq_len=512)
    assert llama.term("KV cache").bytes_per_gpu > 0


def _words(est: object) -> str:
    return " ".join(est.text().split())  # the title wraps


def test_every_answer_names_seq_len_and_attention() -> None:
    assert "seq_len not given), flash attention" in _words(estimate("7B"))
    est = estimate("meta-llama/Llama-3.1-8B", seq_len=1024, flash_attention=False)
    assert "seq 1024, attention scores materialised" in _words(est)


def test_a_budget_too_small_says_so_with_the_smallest_change_that_fits() -> None:
    est = estimate("7B", budget="10GB")
    assert est.fits is False
    assert est.max_micro_batch == 0
    assert "smallest change that fits: strategy='zero3', offload='optimizer+params'" in _words(est)
    changed = estimate("7B", budget="10GB", strategy="zero3", offload="optimizer+params")
    assert changed.fits
    # Issue 23: 135 GiB per GPU fits only the largest GPUs, and the answer says so.
    mid = estimate("Qwen/Qwen2.5-7B-Instruct", seq_len=2048)
    said = "135.4 GiB per GPU is more than an H100's 80 GB (the B200's 180 GB and larger GPUs"
    assert said in _words(mid)
    assert "smallest change that fits 80 GB: strategy='zero3', offload='optimizer'" in _words(mid)
    assert estimate("1B", seq_len=512).notes == ()  # 80 GB or less: nothing to add
    huge = estimate("meta-llama/Llama-3.1-70B", seq_len=4096)
    assert "fits no GPU" in _words(huge)
    assert "strategy='zero3', offload='optimizer'" in _words(huge)
    serve = estimate("meta-llama/Llama-3.1-405B", role="inference", kv_tokens=100_000)
    assert "world_size=4, tensor_parallel=4" in _words(serve)
    batch = estimate("meta-llama/Llama-3.1-8B", seq_len=4096, micro_batch=8, budget="80GB",
                     strategy="zero3", world_size=8)  # fmt: skip
    assert "smallest change that fits: micro_batch=" in _words(batch)


def test_a_model_no_single_change_fits_says_so_at_once() -> None:
    # Each candidate change is summed, not estimated again: no estimate of an estimate.
    est = estimate("meta-llama/Llama-3.1-405B", seq_len=8192, micro_batch=8)
    assert "fits no GPU" in _words(est)
    assert "no single change fits: combine them" in _words(est)
