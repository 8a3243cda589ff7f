"""Rescaling past one node: real public launch scripts (tests/scale/configs/public, each with its
source) moved onto 2 and 4 nodes, then run by bash with a stand-in ``python3`` that records the
arguments verl would get, and held to verl's own start-up checks, restated below from verl
v0.7.0 (verl/utils/config.py validate_config, the workers' normalisation in fsdp_workers.py and
megatron_workers.py): an independent reading, not nbgpu's.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import nbgpu.plan
from nbgpu.cli import main
from nbgpu.errors import UserInputError

PUBLIC = Path(__file__).parent / "configs" / "public"
FSDP = PUBLIC / "verl_run_qwen2-7b_math.sh"  # 1 node × 8, rollout TP 2
MEGATRON = PUBLIC / "verl_run_qwen2_5-7b_math_megatron_diff_tp.sh"  # TP 2 × PP 2, rollout TP 4
TRTLLM = PUBLIC / "verl_run_qwen2-7b_math_megatron_trtllm.sh"  # TP=${1:-4}, ACTOR_TP=${ACTOR_TP:-4}
MOE = PUBLIC / "verl_run_qwen3moe-30b_megatron.sh"  # 4 nodes × 8


def verl_arguments(script: Path, tmp_path: Path) -> dict[str, object]:
    """The key=value arguments bash passes to ``python3 -m verl.trainer.main_ppo``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    record = tmp_path / "argv.jsonl"
    stub = f"#!/bin/sh\nexec {sys.executable} -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\" >> {record}\n"
    for name in ("python", "python3"):
        (bin_dir / name).write_text(stub)
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": "/home/user"}  # the same for every run
    subprocess.run(["bash", str(script)], env=env, check=True, capture_output=True, timeout=30)
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    (argv,) = [c for c in calls if c[:2] == ["-m", "verl.trainer.main_ppo"]]
    pairs = (a.split("=", 1) for a in argv if "=" in a and not a.startswith("--"))
    return {k.lstrip("+"): int(v) if v.lstrip("-").isdigit() else v for k, v in pairs}


def verl_refusals(args: dict[str, object]) -> list[str]:
    """What verl v0.7.0 asserts at start, on the arguments (defaults: verl's own)."""

    def get(key: str, default: object = None) -> object:
        return args.get(key, default)

    n_gpus = get("trainer.n_gpus_per_node") * get("trainer.nnodes", 1)
    n = get("actor_rollout_ref.rollout.n", 1)
    train, mini = get("data.train_batch_size"), get("actor_rollout_ref.actor.ppo_mini_batch_size")
    micro = get("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
    megatron = "actor_rollout_ref.actor.megatron.tensor_model_parallel_size" in args
    out = []
    if megatron:
        group = math.prod(
            get(f"actor_rollout_ref.actor.megatron.{k}_parallel_size", 1)
            for k in ("tensor_model", "pipeline_model", "context")
        )
        if n_gpus % group:
            out.append(f"n_gpus {n_gpus} % model parallel {group}")
        dp = n_gpus // group
        minimal = dp * micro
    else:
        dp = n_gpus // get("actor_rollout_ref.actor.ulysses_sequence_parallel_size", 1)
        minimal = n_gpus
    if (train * n) % minimal:
        out.append(f"real_train_batch_size {train * n} % minimal_bsz {minimal}")
    if train < mini:
        out.append(f"train_batch_size {train} < ppo_mini_batch_size {mini}")
    normalized = mini * n // dp
    if normalized <= 0 or normalized % micro or normalized // micro <= 0:
        out.append(f"normalized ppo_mini_batch_size {normalized} vs micro {micro}")
    if n_gpus % get("actor_rollout_ref.rollout.tensor_model_parallel_size", 1):
        out.append("rollout world size % rollout tensor parallel")
    return out


def test_the_stand_in_checks_can_refuse(tmp_path):
    # The oracle itself: the published script passes; the same numbers on 12 GPUs do not.
    args = verl_arguments(FSDP, tmp_path)
    assert verl_refusals(args) == []
    assert verl_refusals({**args, "trainer.n_gpus_per_node": 12}) != []


@pytest.mark.parametrize("script", [FSDP, MEGATRON, TRTLLM, MOE], ids=lambda p: p.stem)
@pytest.mark.parametrize("nodes", [2, 4])
def test_public_scripts_rescale_onto_nodes_that_verl_accepts(tmp_path, script, nodes):
    plan = nbgpu.plan.scale(script, to_gpus=8 * nodes)
    assert plan.ok, plan.text()
    assert plan.nodes == nodes
    new = tmp_path / script.name
    plan.save(new)
    args = verl_arguments(new, tmp_path)
    assert (args["trainer.nnodes"], args["trainer.n_gpus_per_node"]) == (nodes, 8)
    assert verl_refusals(args) == []
    # Nothing else moved: every argument bash passes is as published, but the batches.
    (tmp_path / "before").mkdir()
    before = verl_arguments(script, tmp_path / "before")
    moved = {k for k in args if args[k] != before.get(k)}
    assert moved <= {
        "trainer.nnodes",
        "data.train_batch_size",
        "actor_rollout_ref.actor.ppo_mini_batch_size",
    }


def test_the_megatron_group_is_not_taken_for_rollout_engines():
    # The script: rollout TP ${1:-4} and actor TP ${ACTOR_TP:-4}; the rollout's
    # engine budgets follow the rollout's TP, and nothing warns of a shared variable.
    plan = nbgpu.plan.scale(TRTLLM, to_gpus=16)
    steps = {s.key: s for s in plan.steps}
    actor = steps["actor_rollout_ref.actor.megatron.tensor_model_parallel_size"]
    assert actor.rule == "model_parallel"
    assert "engines" not in actor.reason
    rollout = steps["actor_rollout_ref.rollout.tensor_model_parallel_size"]
    assert (rollout.rule, rollout.old, rollout.new) == ("tensor_parallel", 4, 4)
    assert (
        "4 engines now, 2 engines before" in steps["actor_rollout_ref.rollout.max_num_seqs"].reason
    )
    assert not [w for w in plan.warnings if w.code == "script"]


def test_a_yaml_config_gets_its_node_count_beside_the_gpus_per_node(tmp_path):
    path = tmp_path / "ppo.yaml"
    path.write_text(
        "data:\n  train_batch_size: 64  # prompts per step\n"
        "trainer:\n  n_gpus_per_node: 8\n  total_epochs: 15\n"
    )
    plan = nbgpu.plan.scale(path, to_gpus=32)
    assert plan.to_text() == (
        "data:\n  train_batch_size: 256 # prompts per step\n"  # the comment keeps its column
        "trainer:\n  n_gpus_per_node: 8\n  total_epochs: 15\n  nnodes: 4\n"
    )
    assert "assumed" in {s.key: s for s in plan.steps}["trainer.nnodes"].reason


def test_overrides_get_the_node_count_too():
    plan = nbgpu.plan.scale(
        ["trainer.n_gpus_per_node=4", "data.train_batch_size=32"], to_gpus=8, gpus_per_node=4
    )
    assert plan.config == [
        "trainer.n_gpus_per_node=4",
        "data.train_batch_size=64",
        "trainer.nnodes=2",
    ]


def test_the_node_size_comes_from_the_fleet_and_a_short_node_says_how_many_nodes_fit():
    plan = nbgpu.plan.scale(FSDP, to_gpus=16, inventory="8xH100")
    assert (plan.ok, plan.nodes) == (True, 2)
    busy = nbgpu.plan.scale(FSDP, to_gpus=16, inventory="8xH100,busy=0")
    (problem,) = busy.problems
    assert problem.message.startswith("2 node(s) × 8 GPUs, but the fleet has 7 usable (GPU 0: BUSY")
    assert problem.fixes == ("--nodes 4", "--to 14")  # 4 GPUs per node fit 7 usable
    four = nbgpu.plan.scale(FSDP, to_gpus=16, inventory="8xH100,busy=0", nodes=4)
    assert (four.ok, four.nodes) == (True, 4)


def test_a_cluster_sets_the_node_size_and_counts_the_nodes_that_fit():
    cluster = {"n1": "4xA40", "n2": "4xA40,busy=0", "n3": "4xA40"}
    plan = nbgpu.plan.scale(FSDP, to_gpus=8, cluster=cluster)
    assert (plan.ok, plan.nodes) == (True, 2)
    short = nbgpu.plan.scale(FSDP, to_gpus=12, cluster=cluster)
    (problem,) = short.problems
    assert problem.message.startswith("3 node(s) × 4 GPUs: 2 of the 3 nodes have 4 usable GPUs")
    assert problem.fixes == ("--to 9",)  # 4 nodes of 3 would fit, but there are 3 nodes


def test_per_node_checks_warn_of_groups_that_straddle_nodes():
    plan = nbgpu.plan.scale(MEGATRON, to_gpus=16, gpus_per_node=2)
    assert plan.nodes == 8
    warned = {w.subject for w in plan.warnings}
    assert "actor_rollout_ref.rollout.tensor_model_parallel_size" in warned  # TP 4 > 2 per node
    assert "actor_rollout_ref.actor.megatron" not in warned  # TP 2 fits; PP may cross nodes


def test_a_megatron_group_that_does_not_divide_the_world_is_refused():
    plan = nbgpu.plan.scale(MEGATRON, to_gpus=6, gpus_per_node=6)
    assert any(
        p.subject == "actor_rollout_ref.actor.megatron" and "TP × PP × CP = 4" in p.message
        for p in plan.problems
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"to_gpus": 16, "nodes": 3}, "nodes=3 (--nodes): 16 GPUs do not split evenly over 3"),
        ({"to_gpus": 16, "nodes": 1, "gpus_per_node": 8}, "16 GPUs per node, but a node has 8"),
        ({"to_gpus": 16, "nodes": 0}, "nodes="),
        ({"to_gpus": 16, "gpus_per_node": -2}, "gpus_per_node="),
        ({"nodes": 2}, "pass to_gpus=N (--to N)"),
    ],
)
def test_node_counts_that_cannot_hold_the_gpus_are_refused_in_one_line(kwargs, message):
    with pytest.raises(
        UserInputError, match=message.replace("(", r"\(").replace(")", r"\)")
    ) as err:
        nbgpu.plan.scale(FSDP, **kwargs)
    assert "\n" not in str(err.value)


def test_nodes_and_gpus_per_node_give_the_target(capsys):
    assert (
        main(["plan", "--scale", str(FSDP), "--nodes", "2", "--gpus-per-node", "8", "--overrides"])
        == 0
    )
    assert capsys.readouterr().out.split() == [
        "data.train_batch_size=2048",
        "actor_rollout_ref.actor.ppo_mini_batch_size=512",
        "trainer.nnodes=2",
    ]


def test_a_script_that_leaves_nnodes_at_its_default_gets_it_beside_the_gpus(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(
        "python3 -m verl.trainer.main_ppo \\\n"
        "    data.train_batch_size=64 \\\n"
        "    trainer.n_gpus_per_node=8 \\\n"
        "    trainer.logger=\"['console']\" $@\n"
    )
    plan = nbgpu.plan.scale(script, to_gpus=16)
    assert "    trainer.n_gpus_per_node=8 trainer.nnodes=2 \\\n" in plan.to_text()
    plan.save(script)
    args = verl_arguments(script, tmp_path)
    assert (args["trainer.nnodes"], args["data.train_batch_size"]) == (2, 128)


def test_an_areal_config_scales_its_nodes_and_its_allocation(tmp_path):
    # AReaL's keys: cluster.n_nodes, cluster.n_gpus_per_node, and an allocation whose parts'
    # data-parallel degrees use the GPUs (its docs' Archon example: 3 nodes x 8).
    path = tmp_path / "archon.yaml"
    path.write_text(
        "cluster:\n  n_nodes: 3\n  n_gpus_per_node: 8\n"
        "allocation_mode: sglang:d4t2+archon:d4p2t2  # 8 + 16 GPUs\n"
    )
    plan = nbgpu.plan.scale(path, to_gpus=48)
    assert (plan.ok, plan.from_gpus, plan.nodes) == (True, 24, 6)
    assert plan.to_text() == (
        "cluster:\n  n_nodes: 6\n  n_gpus_per_node: 8\n"
        "allocation_mode: sglang:d8t2+archon:d8p2t2  # 8 + 16 GPUs\n"
    )
    uneven = nbgpu.plan.scale(path, to_gpus=40)
    (problem,) = uneven.problems
    assert "d4, d4 × 40/24 GPUs is not a whole number of replicas" in problem.message
