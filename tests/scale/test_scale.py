"""nbgpu.plan.scale: a 2-GPU VAGEN/verl config rescaled to 4 GPUs, and what must be flagged."""

import copy
import json

import pytest

import nbgpu.plan
from nbgpu.errors import UserInputError
from nbgpu.scale import KV_RESERVE_BYTES

# A 2-GPU VAGEN run as it was hand-tuned, in verl's key layout.
TWO_GPU = {
    "CUDA_VISIBLE_DEVICES": "0,1",
    "data": {"train_batch_size": 2},
    "actor_rollout_ref": {
        "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 1},
        "rollout": {
            "tensor_model_parallel_size": 2,
            "gpu_memory_utilization": 0.34,
            "max_num_seqs": 4,
            "max_num_batched_tokens": 1800,
            "n": 1,
        },
    },
    "trainer": {"n_gpus_per_node": 2, "nnodes": 1},
    "rollout_manager": {"n_gpus_per_node": 2},
}
# Qwen2.5-VL-3B's language model (VAGEN's usual policy).
QWEN_3B = {
    "model_type": "qwen2_5_vl",
    "hidden_size": 2048,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "intermediate_size": 11008,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
A40 = 46068 * 2**20


def new_values(plan):
    return {s.key.rsplit(".", 1)[-1] if "n_gpus" not in s.key else s.key: s.new for s in plan.steps}


def test_rescale_2_to_4_default_keeps_tensor_parallel_and_scales_batches():
    plan = nbgpu.plan.scale(TWO_GPU, to_gpus=4)
    assert plan.ok
    assert (plan.from_gpus, plan.to_gpus) == (2, 4)
    values = new_values(plan)
    assert values["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert values["train_batch_size"] == 4
    assert values["ppo_mini_batch_size"] == 4
    assert values["ppo_micro_batch_size_per_gpu"] == 1
    assert values["tensor_model_parallel_size"] == 2  # two engines of 2 GPUs
    assert values["max_num_seqs"] == 4  # each engine serves as many sequences as before
    assert values["max_num_batched_tokens"] == 1800
    assert values["gpu_memory_utilization"] == 0.34
    assert values["trainer.n_gpus_per_node"] == values["rollout_manager.n_gpus_per_node"] == 4
    assert all(s.reason for s in plan.steps)  # every key explained, changed or not
    assert TWO_GPU["data"]["train_batch_size"] == 2  # the input is not modified


def test_rescale_2_to_4_scaled_tensor_parallel_reproduces_the_hand_edit():
    plan = nbgpu.plan.scale(TWO_GPU, to_gpus=4, tensor_parallel="scale")
    values = new_values(plan)
    # The hand-made 4-GPU version: tp 4, max_num_seqs 8, max_batched_tokens 3600.
    assert values["tensor_model_parallel_size"] == 4
    assert values["max_num_seqs"] == 8
    assert values["max_num_batched_tokens"] == 3600
    # The hand edit also lowered gpu_memory_utilization to 0.25 "to avoid OOM"; nbgpu keeps it
    # (a per-GPU fraction) and checks the KV cache instead.
    assert values["gpu_memory_utilization"] == 0.34
    assert any(w.code == "kv_unchecked" for w in plan.warnings)


def test_rescale_2_to_4_output_as_diff_yaml_and_overrides():
    plan = nbgpu.plan.scale(TWO_GPU, to_gpus=4)
    diff = plan.diff()
    assert "-  train_batch_size: 2\n+  train_batch_size: 4" in diff
    assert "+CUDA_VISIBLE_DEVICES: 0,1,2,3" in diff
    assert "tensor_model_parallel_size" not in diff.replace(" tensor_model_parallel_size", "")
    assert plan.to_yaml().startswith("CUDA_VISIBLE_DEVICES: 0,1,2,3\ndata:\n  train_batch_size: 4")
    assert "data.train_batch_size=4" in plan.to_overrides()
    assert plan.config["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] == 4
    assert max(len(line) for line in plan.text().splitlines()) <= 80
    assert json.loads(plan.to_json())["config"] == plan.config


def test_rescale_2_to_4_kv_cache_checked_on_the_target_fleet(sim_env):
    plan = nbgpu.plan.scale(
        TWO_GPU, inventory="rescale-2-to-4", model=QWEN_3B, max_model_len=1800, environ=sim_env
    )
    assert plan.ok
    assert plan.to_gpus == 4  # from the usable GPUs of the fleet
    kv = plan.kv
    assert kv.gpu_memory_bytes == A40
    assert kv.bytes_per_token == 2 * 36 * 1 * 128 * 2  # 2 KV heads over tp 2: one each
    expected = int(A40 * 0.34) - kv.weights_bytes - KV_RESERVE_BYTES
    assert kv.budget_bytes == expected
    assert kv.capacity_tokens == expected // kv.bytes_per_token
    assert "KV cache per GPU" in plan.text()


def test_kv_cache_too_small_is_flagged_with_the_fraction_that_works():
    plan = nbgpu.plan.scale(
        TWO_GPU, to_gpus=4, model=QWEN_3B, max_model_len=1800, gpu_memory_bytes=8 * 2**30
    )
    (problem,) = [p for p in plan.problems if p.code == "kv_cache"]
    assert "no KV cache" in problem.message
    fraction = float(problem.fixes[0].split("=")[1])
    fixed = nbgpu.plan.scale(
        {
            **TWO_GPU,
            "actor_rollout_ref": {
                **TWO_GPU["actor_rollout_ref"],
                "rollout": {
                    **TWO_GPU["actor_rollout_ref"]["rollout"],
                    "gpu_memory_utilization": fraction,
                },
            },
        },
        to_gpus=4,
        model=QWEN_3B,
        max_model_len=1800,
        gpu_memory_bytes=8 * 2**30,
    )
    assert not [p for p in fixed.problems if p.code == "kv_cache"]


def test_kv_cache_below_max_num_seqs_is_a_warning():
    plan = nbgpu.plan.scale(
        TWO_GPU, to_gpus=4, model=QWEN_3B, max_model_len=32768, gpu_memory_bytes=16 * 2**30
    )
    assert plan.ok
    (warning,) = [w for w in plan.warnings if w.code == "kv_cache"]
    assert "fewer than max_num_seqs 4" in warning.message


def test_batch_keep_flags_values_that_do_not_divide():
    config = copy.deepcopy(TWO_GPU)
    config["data"]["train_batch_size"] = 6
    config["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] = 6
    plan = nbgpu.plan.scale(config, to_gpus=4, batch="keep")
    assert not plan.ok
    messages = " ".join(p.message for p in plan.problems)
    assert "train_batch_size=6 is not valid on 4 GPUs" in messages
    assert plan.problems[0].fixes == ("train_batch_size=4", "train_batch_size=8")


def test_batch_keep_never_proposes_a_mini_batch_larger_than_the_train_batch():
    # verl refuses ppo_mini_batch_size > train_batch_size: 8 on 3 GPUs may become 6, not 9.
    config = copy.deepcopy(TWO_GPU)
    config["data"]["train_batch_size"] = 8
    config["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] = 8
    plan = nbgpu.plan.scale(config, to_gpus=3, batch="keep")
    fixes = {p.subject: p.fixes for p in plan.problems}
    assert fixes["data.train_batch_size"] == ("train_batch_size=6", "train_batch_size=9")
    assert fixes["actor_rollout_ref.actor.ppo_mini_batch_size"] == ("ppo_mini_batch_size=6",)


def test_uneven_scaling_moves_to_the_nearest_valid_value():
    config = copy.deepcopy(TWO_GPU)
    config["data"]["train_batch_size"] = 4
    config["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] = 4
    plan = nbgpu.plan.scale(config, to_gpus=3)
    values = new_values(plan)
    assert values["train_batch_size"] == 6  # 4 × 3/2 = 6, a multiple of 3
    assert values["ppo_mini_batch_size"] == 6
    # tp 2 does not divide 3 GPUs: flagged, not silently changed.
    assert [p.code for p in plan.problems] == ["tensor_parallel"]


def test_grpo_n_and_micro_batch_enter_the_divisors():
    config = copy.deepcopy(TWO_GPU)
    config["actor_rollout_ref"]["rollout"]["n"] = 5
    config["actor_rollout_ref"]["actor"]["ppo_micro_batch_size_per_gpu"] = 2
    plan = nbgpu.plan.scale(config, to_gpus=4)
    values = new_values(plan)
    # mini × n ÷ 4 GPUs must be a multiple of micro 2: mini 8 (10 per GPU); train >= mini.
    assert values["ppo_mini_batch_size"] == 8
    assert values["train_batch_size"] == 8
    assert "ppo_mini_batch_size 8" in plan.steps[1].reason
    assert plan.ok


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (("rollout", "max_num_batched_tokens", 2), "< max_num_seqs 4"),
        (("rollout", "gpu_memory_utilization", 1.5), "not a fraction"),
    ],
)
def test_invalid_combinations_are_flagged(edit, fragment):
    section, key, value = edit
    config = copy.deepcopy(TWO_GPU)
    config["actor_rollout_ref"][section][key] = value
    plan = nbgpu.plan.scale(config, to_gpus=4)
    assert any(fragment in p.message for p in plan.problems), plan.problems


def test_kept_batches_that_break_the_micro_batch_are_flagged():
    config = copy.deepcopy(TWO_GPU)
    config["data"]["train_batch_size"] = 8
    config["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] = 4
    config["actor_rollout_ref"]["actor"]["ppo_micro_batch_size_per_gpu"] = 3
    plan = nbgpu.plan.scale(config, to_gpus=4, batch="keep")
    messages = [p.message for p in plan.problems]
    assert any(
        "gives 1 per GPU, not divisible by ppo_micro_batch_size_per_gpu 3" in m for m in messages
    )
    assert any("ppo_mini_batch_size=4 is not valid on 4 GPUs" in m for m in messages)


def test_mini_batch_larger_than_train_batch_is_flagged_when_kept():
    config = copy.deepcopy(TWO_GPU)
    config["data"]["train_batch_size"] = 4
    config["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] = 8
    kept = nbgpu.plan.scale(config, to_gpus=4, batch="keep")
    assert any("8 is larger than train_batch_size 4" in p.message for p in kept.problems)
    scaled = nbgpu.plan.scale(config, to_gpus=4)  # scaling raises the train batch instead
    assert new_values(scaled)["train_batch_size"] == 16
    assert scaled.ok


@pytest.mark.parametrize(
    ("rollout", "level"),
    [
        ({}, "warn"),  # verl's default: vLLM with chunked prefill
        ({"enable_chunked_prefill": False}, "bad"),  # vLLM itself refuses it
        ({"name": "sglang"}, None),  # a vLLM limit: not SGLang's
    ],
)
def test_max_batched_tokens_below_the_model_length_is_judged_per_engine(rollout, level):
    config = copy.deepcopy(TWO_GPU)
    config["data"]["max_prompt_length"] = 1024
    config["data"]["max_response_length"] = 1024
    config["actor_rollout_ref"]["rollout"].update(rollout)
    plan = nbgpu.plan.scale(config, to_gpus=4)
    found = [p for p in (*plan.problems, *plan.warnings) if p.code == "engine"]
    assert [p.severity for p in found] == ([level] if level else [])
    for problem in found:
        assert "1800 < the maximum model length 2048" in problem.message
        assert problem.fixes == ("max_num_batched_tokens=2048",)
        # Each mirrored check names the framework version it was read from.
        assert ("f0de1a6" if level == "bad" else "verl v0.4.1-v0.6.1") in problem.message


def test_heads_not_divisible_by_scaled_tensor_parallel():
    model = {**QWEN_3B, "num_attention_heads": 12}
    plan = nbgpu.plan.scale(TWO_GPU, to_gpus=8, tensor_parallel=8, model=model)
    assert any("12 attention heads" in p.message for p in plan.problems)
    scaled = nbgpu.plan.scale(TWO_GPU, to_gpus=8, tensor_parallel="scale", model=model)
    assert new_values(scaled)["tensor_model_parallel_size"] == 4  # divides 8 GPUs and 12 heads


def test_generic_keys_by_rules_and_hydra_overrides():
    config = {"trainer": {"per_device_batch": 4, "global_batch": 32, "gpus": 2}}
    plan = nbgpu.plan.scale(
        config,
        to_gpus=4,
        rules={
            "per_device_batch": "per_gpu",
            "trainer.global_batch": "global_batch",
            "gpus": "gpu_count",
        },
    )
    assert new_values(plan) == {"per_device_batch": 4, "global_batch": 64, "gpus": 4}
    overrides = nbgpu.plan.scale(
        ["data.train_batch_size=2", "trainer.n_gpus_per_node=2", "+trainer.val=False"], to_gpus=4
    )
    assert overrides.config == [
        "data.train_batch_size=4",
        "trainer.n_gpus_per_node=4",
        "+trainer.val=false",
    ]
    assert "-data.train_batch_size=2" in overrides.diff()


def test_config_files(tmp_path):
    path = tmp_path / "ppo.json"
    path.write_text(json.dumps(TWO_GPU))
    plan = nbgpu.plan.scale(path, to_gpus=4)
    assert plan.source == str(path)
    assert str(path) in plan.diff()
    yaml_path = tmp_path / "ppo.yaml"
    yaml_path.write_text("data:\n  train_batch_size: 2\ntrainer:\n  n_gpus_per_node: 2\n")
    assert nbgpu.plan.scale(yaml_path, to_gpus=4).config["data"]["train_batch_size"] == 4


@pytest.mark.parametrize("to_gpus", [8, 16])
def test_an_interpolation_follows_the_key_it_names(tmp_path, to_gpus):
    # verl's agent-loop configs: the rollout manager takes the trainer's GPU count.
    path = tmp_path / "ppo.yaml"
    path.write_text(
        "data:\n  train_batch_size: 64\ntrainer:\n  nnodes: 1\n  n_gpus_per_node: 8\n"
        "rollout_manager:\n  n_gpus_per_node: ${trainer.n_gpus_per_node}\n"
    )
    plan = nbgpu.plan.scale(path, to_gpus=to_gpus, gpus_per_node=16)  # one node either way
    assert "  n_gpus_per_node: ${trainer.n_gpus_per_node}\n" in plan.to_yaml()
    assert plan.config["trainer"]["n_gpus_per_node"] == to_gpus
    assert [s.key for s in plan.changes] == (
        [] if to_gpus == 8 else ["data.train_batch_size", "trainer.n_gpus_per_node"]
    )


def test_fewer_usable_gpus_than_asked_is_a_problem(sim_env):
    plan = nbgpu.plan.scale(TWO_GPU, to_gpus=4, inventory="busy-gpu0", environ=sim_env)
    assert [p.code for p in plan.problems] == ["not_enough_gpus"]
    assert "GPU 0: BUSY: dead holder" in plan.problems[0].message
    assert new_values(plan)["CUDA_VISIBLE_DEVICES"] == "1,2,3"


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"rules": {"nope": "global_batch"}}, "unknown key 'nope'"),
        ({"rules": {"train_batch_size": "double"}}, "'double' is not a rule"),
        ({"to_gpus": 0}, "to_gpus=0"),
        ({"batch": "grow"}, "batch='grow'"),
        ({"tensor_parallel": "max"}, "tensor_parallel='max'"),
        ({"from_gpus": -1}, "from_gpus=-1"),
    ],
)
def test_bad_scale_input(kwargs, fragment):
    kwargs.setdefault("to_gpus", 4)
    with pytest.raises(UserInputError) as err:
        nbgpu.plan.scale(TWO_GPU, **kwargs)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_config_without_known_keys_or_gpu_count():
    with pytest.raises(UserInputError, match="none of the keys nbgpu scales"):
        nbgpu.plan.scale({"lr": 1e-6}, to_gpus=4)
    with pytest.raises(UserInputError, match="pass from_gpus=N"):
        nbgpu.plan.scale({"data": {"train_batch_size": 8}}, to_gpus=4)
    with pytest.raises(UserInputError, match="pass to_gpus=N"):
        nbgpu.plan.scale(TWO_GPU)
    with pytest.raises(UserInputError, match=r"config 'missing\.yaml' does not exist"):
        nbgpu.plan.scale("missing.yaml", to_gpus=4)
    with pytest.raises(UserInputError, match="expected key=value"):
        nbgpu.plan.scale(["data.train_batch_size"], to_gpus=4)
