"""nbgpu.plan(...) on simulated fleets: every named situation, and bad input."""

import pytest

import nbgpu.plan
from nbgpu.errors import UserInputError
from nbgpu.estimate import estimate

from .conftest import all_free

LLAMA_8B = "8B"


def plan(inv, allocation=None, **kwargs):
    return nbgpu.plan(allocation, inventory=inv, port_is_free=all_free, **kwargs)


def test_the_package_is_callable_and_has_sweep_and_scale():
    assert callable(nbgpu.plan)
    assert callable(nbgpu.plan.sweep)
    assert callable(nbgpu.plan.scale)
    assert nbgpu.plan.plan.__name__ == "plan"


def test_busy_gpu0_busy_gpu0_and_batch_8_on_3_trainers(inventory):
    p = plan(inventory("busy-gpu0"), "sglang.d1t1p1+d3t1p1", global_batch=8)
    assert not p.ok
    assert p.simulated
    assert [i.code for i in p.problems] == ["not_enough_gpus", "batch"]
    assert "3 of 4 are usable" in p.problems[0].message
    assert "global_batch=6" in p.problems[1].fixes[0]
    assert "global_batch=9" in p.problems[1].fixes[1]
    # GPU 0 is never given out silently: it is listed with its reason.
    assert [e.nvml_index for e in p.excluded] == [0]
    assert "busy or unavailable" in p.excluded[0].problems[0].message
    assert all(not r.gpus for r in p.roles)
    smaller, free_first = p.alternatives
    assert smaller.plan is not None
    assert smaller.plan.ok
    assert smaller.plan.allocation == "sglang.d1t1p1+d2t1p1"
    assert smaller.plan.role("sglang").nvml_indices == (1,)
    assert smaller.plan.role("train").nvml_indices == (2, 3)
    assert smaller.plan.batch.global_batch == 8  # valid on 2 trainers as it is
    assert free_first.plan is None
    assert "GPU 0" in free_first.title
    assert any("gpu-reset -i 0" in f for f in free_first.fixes)


def test_busy_gpu0_once_freed_gives_the_server_gpu0_and_a_valid_batch(inventory):
    p = plan(inventory("healthy"), "sglang.d1t1p1+d3t1p1", global_batch=6)
    assert p.ok
    sglang, train = p.roles
    assert sglang.cuda_visible_devices == "0"
    assert train.cuda_visible_devices == "1,2,3"
    assert train.nproc_per_node == 3
    assert (sglang.master_port, train.master_port) == (29500, 29501)
    assert p.cuda_visible_devices == "0,1,2,3"
    assert p.batch.summary.startswith("global batch 6 = 3 ranks × micro 2 × accum 1")
    assert train.env == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "1,2,3",
        "NPROC_PER_NODE": "3",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29501",
    }
    assert train.gpus[0].uuid.startswith("GPU-")
    assert train.uuids == tuple(g.uuid for g in train.gpus)


def test_the_role_owning_logical_device_0_gets_a_clean_gpu(inventory):
    # GPU 0 is held by a process in another container: usable, but not for the server.
    p = plan(inventory("4xA40,otherns=0"), "sglang.d1t1p1+d3t1p1")
    assert p.ok
    assert p.role("sglang").nvml_indices == (1,)
    assert p.role("train").nvml_indices == (2, 3, 0)
    assert any(w.code == "gpu_caveat" and "GPU 0" in w.message for w in p.warnings)


def test_busy_gpu0_hand_workaround_order_is_kept_but_the_busy_gpu_is_refused(inventory):
    # The hand workaround was CUDA_VISIBLE_DEVICES=3,2,1,0: the busy GPU 0 ended up in a trainer.
    p = plan(inventory("busy-gpu0"), "sglang.d1t1p1+d3t1p1", require="3,2,1,0")
    assert not p.ok
    assert [i.code for i in p.problems] == ["required_gpu_unusable", "not_enough_gpus"]
    assert all(0 not in r.nvml_indices for r in p.roles)
    smaller = p.alternatives[0].plan
    assert smaller.ok
    # The order asked for is kept for the GPUs that work: 3 serves, 2 and 1 train.
    assert smaller.role("sglang").nvml_indices == (3,)
    assert smaller.role("train").nvml_indices == (2, 1)


def test_a_required_busy_gpu_is_replaced_in_an_alternative(inventory):
    p = plan(inventory("busy-gpu0"), "sglang.d1t1p1+d2t1p1", require="0,1")
    assert [i.code for i in p.problems] == ["required_gpu_unusable"]
    (alt,) = [a for a in p.alternatives if a.plan is not None]
    assert "leave GPU 0 out of require" in alt.title
    assert alt.plan.ok
    assert alt.plan.role("sglang").nvml_indices == (1,)


def test_nproc_mismatch_sizes_nproc_from_usable_gpus_and_rejects_seven(inventory):
    inv = inventory("nproc-mismatch")
    p = plan(inv)
    assert p.ok
    # Zombie-held GPUs 0-1 still work but go last, and logical device 0 is a clean one.
    assert p.roles[0].cuda_visible_devices == "2,3,0,1"
    assert p.roles[0].nproc_per_node == 4
    assert sum(w.code == "gpu_caveat" for w in p.warnings) == 2
    with pytest.raises(UserInputError, match=r"needs 7 GPUs but this box has 4 \(GPUs 0-3\)"):
        plan(inv, num_gpus=7)


def test_nproc_mismatch_memory_check_uses_what_the_zombies_left_free(inventory):
    p = plan(inventory("nproc-mismatch"), model="7B", strategy="ddp")
    assert not p.ok
    (problem,) = [i for i in p.problems if i.code == "memory"]
    assert "GPU 0" in problem.message  # a zombie-held GPU has the least free memory
    assert problem.fixes[0].startswith("strategy='zero1'")
    check = p.memory[0]
    assert check.deciding_gpu == 0
    assert check.fits is False
    assert "16 B/param" in check.accounting


def test_memory_fits_and_states_its_accounting(inventory):
    p = plan(inventory("healthy"), "d4t1p1", model="1B", strategy="zero3")
    assert p.ok
    (check,) = p.memory
    assert check.fits
    names = [line.component for line in check.lines]
    assert names[:3] == ["weights", "gradients", "optimizer states"]
    assert {"CUDA context", "NCCL buffers", "fragmentation"} <= set(names)
    states = sum(line.bytes_per_gpu for line in check.lines[:3])
    assert states == 4 * 10**9  # 16 B × 1e9 / 4
    # a bare parameter count has no shape: activations are named as not computable
    assert any(x.startswith("activations") for x in check.not_estimated)


def test_model_from_an_hf_config_file(tmp_path, inventory):
    path = tmp_path / "config.json"
    path.write_text(
        '{"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, '
        '"num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, '
        '"vocab_size": 128256, "tie_word_embeddings": false}'
    )
    p = plan(inventory("shared-sweeps"), "d8t1p1", model=str(path), strategy="zero3")
    assert "8,030,261,248 parameters" in p.memory[0].accounting
    assert p.ok


def test_heterogeneous_box_smallest_gpu_decides(mixed_path):
    p = plan(mixed_path, "d3t1p1", model="3B", strategy="zero3")
    (mixed,) = [w for w in p.warnings if w.code == "mixed_gpus"]
    assert "smallest (GPU 2)" in mixed.message
    assert p.memory[0].deciding_gpu == 2


def test_heterogeneous_box_keeps_roles_on_identical_gpus(mixed_path):
    p = plan(mixed_path, "sglang.d2t1p1+d2t1p1")
    assert p.ok
    assert p.role("sglang").nvml_indices == (0, 1)
    assert p.role("train").nvml_indices == (2, 3)
    assert not [w for w in p.warnings if w.code == "mixed_gpus"]


def test_exclude_and_extra_divisors(inventory):
    p = plan(
        inventory("shared-sweeps"),
        "d6t1p1",
        exclude=[0, 1],
        global_batch=24,
        step_divisors={"num_generations": 4},
    )
    assert p.ok
    # shared-sweeps' GPUs 2-3 run another sweep's ranks: free GPUs are handed out first.
    assert p.roles[0].nvml_indices == (4, 5, 6, 7, 2, 3)
    assert p.batch.micro_batch * 6 % 4 == 0
    assert {e.nvml_index for e in p.excluded} == {0, 1}


def test_no_free_port_is_a_problem(inventory):
    p = nbgpu.plan("d2", inventory=inventory("healthy"), port_is_free=lambda _p: False)
    assert [i.code for i in p.problems] == ["no_free_port"]


def test_inventory_accepts_a_spec_string(sim_env):
    p = nbgpu.plan("d2", inventory="4xA40,lost=0", port_is_free=all_free, environ=sim_env)
    assert p.fleet == "4xA40,lost=0"
    assert p.roles[0].nvml_indices == (1, 2)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"allocation": "sglang.d1x1"}, "'sglang.d1x1'"),
        ({"allocation": "d4t2p1", "num_gpus": 4}, "uses 8 GPUs (d4t2p1) but num_gpus=4"),
        ({"allocation": "d8t1p1"}, "needs 8 GPUs but this box has 4"),
        ({"global_batch": 0}, "global_batch=0"),
        ({"global_batch": -3}, "global_batch=-3"),
        ({"micro_batch": 0}, "micro_batch=0"),
        ({"require": "1,x"}, "require='1,x'"),
        ({"require": [7]}, "GPU 7 does not exist; this box has GPUs 0-3"),
        ({"exclude": [1], "require": [1]}, "both required and excluded"),
        ({"allocation": "d2", "require": [0, 1, 2]}, "lists 3 GPUs but the job uses 2"),
        ({"strategy": "zero4"}, "strategy='zero4'"),
        ({"precision": "int4"}, "precision='int4'"),
        ({"divisors": "num_generations=x"}, "divisors='num_generations=x'"),
        ({"model": "huge"}, "'huge'"),
        ({"base_port": 70000}, "base_port=70000"),
    ],
)
def test_bad_input_is_one_line_naming_the_value(inventory, kwargs, fragment):
    inv = inventory("healthy")
    allocation = kwargs.pop("allocation", None)
    with pytest.raises(UserInputError) as err:
        plan(inv, allocation, **kwargs)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_empty_inventory_is_bad_input(inventory):
    with pytest.raises(UserInputError, match="the inventory has no GPU"):
        plan(inventory("no-driver"), "d1")
    # The same line as an inventory without GPUs, with NVML's reason.
    with pytest.raises(UserInputError, match=r"no GPU to plan on \(NVML: .+\); plan for another"):
        plan(inventory("no-driver"), "d1")
    with pytest.raises(UserInputError, match="inventory=42"):
        nbgpu.plan("d1", inventory=42)


def test_context_parallel_part_plans_its_whole_world(inventory):
    p = plan(inventory("healthy"), "d1c4")
    assert p.ok
    (role,) = p.roles
    assert (role.nproc_per_node, role.cuda_visible_devices, role.degrees) == (
        4,
        "0,1,2,3",
        "d1t1p1c4",
    )


def test_colocated_roles_share_gpus_and_are_told_what_that_means_for_memory(inventory):
    p = plan(inventory("healthy"), "sglang:d2|fsdp:d2", model="1B")
    assert p.ok
    engine, trainer = p.roles
    assert engine.cuda_visible_devices == trainer.cuda_visible_devices == "0,1"
    assert trainer.colocated_with == "sglang"
    assert engine.master_port != trainer.master_port
    assert p.cuda_visible_devices == "0,1"
    (warning,) = [w for w in p.warnings if w.code == "colocated"]
    assert (
        "sglang and train share GPUs 0,1 (colocated): each GPU holds the memory" in warning.message
    )
    assert "mem_fraction_static" in warning.message
    # Each role alone fits a 48 GB A40, together they do not: a problem, with the way out.
    big = plan(inventory("healthy"), "sglang:d2|fsdp:d2", model="2.3B", strategy="ddp")
    assert all(m.fits for m in big.memory)
    (problem,) = big.problems
    assert problem.message.startswith("colocated sglang and train need sglang 5.7 GiB + train")
    assert problem.fixes == ("'+' instead of '|' gives each role GPUs of its own",)
    assert nbgpu.plan.plan_from_json(big.to_json()) == big
    assert plan(inventory("healthy"), "sglang:d2+fsdp:d2", model="2.3B").ok


def test_memory_table_has_every_term_for_a_named_model(mixed_path):
    p = plan(
        mixed_path,
        "d3t1p1",
        model="Qwen/Qwen2.5-1.5B-Instruct",
        strategy="zero2",
        seq_len=2048,
        micro_batch=2,
    )
    (check,) = p.memory
    names = [line.component for line in check.lines]
    for term in ("weights", "activations", "logits/loss", "CUDA context", "NCCL buffers"):
        assert term in names
    assert check.not_estimated == ()
    assert all(line.formula and line.source for line in check.lines)
    assert len(check.gpu_free) == 3
    # the 40 GB A100 decides, and the text names every GPU's free memory
    assert check.deciding_gpu == 2
    text = p.text()
    assert "logits/loss" in text
    assert "free memory train: GPU 0" in text
    assert "GPU 2 39.5 GiB" in text
    assert "not counted" not in text


def test_max_micro_auto_is_computed_from_the_smallest_gpu(mixed_path):
    p = plan(
        mixed_path,
        "d3t1p1",
        model="Qwen/Qwen2.5-1.5B-Instruct",
        strategy="zero2",
        seq_len=2048,
        global_batch=48,
        max_micro_batch="auto",
    )
    (check,) = p.memory
    largest = check.max_micro_batch
    assert largest is not None
    assert largest >= 1
    assert p.batch.max_micro_batch == largest
    assert p.batch.micro_batch <= largest
    assert any(w.code == "max_micro" for w in p.warnings)
    # one more sample than the computed largest does not fit the 40 GB GPU
    over = estimate(
        "Qwen/Qwen2.5-1.5B-Instruct",
        strategy="zero2",
        world_size=3,
        seq_len=2048,
        micro_batch=largest + 1,
        budget=check.available_bytes,
    )
    assert over.fits is False


def test_max_micro_auto_needs_a_model_and_a_sequence_length(mixed_path):
    with pytest.raises(UserInputError, match="needs model="):
        plan(mixed_path, "d2", model="7B", max_micro_batch="auto")
    with pytest.raises(UserInputError, match="'many'"):
        plan(mixed_path, "d2", max_micro_batch="many")
