"""The KV-cache check of a rescaled config, with the model the config names (offline)."""

import copy
from pathlib import Path

import pytest

import nbgpu.plan
from nbgpu.errors import UserInputError

from .test_scale import A40, QWEN_3B, TWO_GPU

VAGEN = Path(__file__).parent / "configs" / "vagen_2gpu.sh"
NAMED = copy.deepcopy(TWO_GPU)
NAMED["actor_rollout_ref"]["model"] = {"path": "Qwen/Qwen2.5-VL-3B-Instruct"}


def test_the_model_the_config_names_is_read_from_the_built_in_table():
    named = nbgpu.plan.scale(NAMED, to_gpus=4, gpu_memory_bytes=A40, max_model_len=1800)
    given = nbgpu.plan.scale(
        TWO_GPU, to_gpus=4, model=QWEN_3B, gpu_memory_bytes=A40, max_model_len=1800
    )
    assert named.kv is not None
    assert given.kv is not None
    # The same per-token bytes as the published config.json gives.
    assert named.kv.bytes_per_token == given.kv.bytes_per_token == 2 * 36 * 1 * 128 * 2
    assert named.kv.model == "Qwen/Qwen2.5-VL-3B-Instruct, built-in shape"
    assert "KV cache per GPU (Qwen/Qwen2.5-VL-3B-Instruct, built-in shape)" in named.text()
    assert not [w for w in named.warnings if w.code == "kv_unchecked"]


def test_a_launch_script_names_its_model_through_a_variable():
    plan = nbgpu.plan.scale(VAGEN, to_gpus=4, gpu_memory_bytes=A40)
    assert plan.kv is not None
    assert plan.kv.model is not None
    assert plan.kv.model.startswith("Qwen/Qwen2.5-VL-3B-Instruct")
    assert plan.kv.max_model_len == 1024 + 776  # prompt + response from the overrides


def test_a_local_copy_is_found_by_its_folder_name():
    config = copy.deepcopy(NAMED)
    config["actor_rollout_ref"]["model"]["path"] = "/data/models/Qwen2.5-VL-3B-Instruct/"
    plan = nbgpu.plan.scale(config, to_gpus=4, gpu_memory_bytes=A40)
    assert plan.kv is not None


def test_an_unknown_model_name_says_why_the_kv_cache_was_not_checked():
    config = copy.deepcopy(NAMED)
    config["actor_rollout_ref"]["model"]["path"] = "my-org/house-model-2b"
    plan = nbgpu.plan.scale(config, to_gpus=4, gpu_memory_bytes=A40)
    assert plan.kv is None
    (warning,) = [w for w in plan.warnings if w.code == "kv_unchecked"]
    assert "'my-org/house-model-2b' is not among nbgpu's built-in model shapes" in warning.message


def test_model_by_name_as_an_argument_and_a_misspelling():
    plan = nbgpu.plan.scale(
        TWO_GPU, to_gpus=4, model="Qwen/Qwen2.5-VL-3B-Instruct", gpu_memory_bytes=A40
    )
    assert plan.kv is not None
    with pytest.raises(
        UserInputError, match=r"model 'Qwen/Qwen2\.5-VL-3B-Instrct' is not a built-in"
    ):
        nbgpu.plan.scale(TWO_GPU, to_gpus=4, model="Qwen/Qwen2.5-VL-3B-Instrct")
