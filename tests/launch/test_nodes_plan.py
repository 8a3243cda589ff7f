"""A plan across nodes as a launch reads it: what it sets, and what may not disagree."""

import json
import os
import subprocess
import sys
import time

import pytest

import nbgpu
from nbgpu.devices.inventory import take_inventory
from nbgpu.errors import UserInputError
from nbgpu.launch.config import SlurmOptions, is_nodes_plan, take_nodes_plan
from nbgpu.launch.slurm import request_args
from nbgpu.rank import slurm_node

CLUSTER = {"n1": "4xA40,busy=0", "n2": "4xA40,lost=2"}


@pytest.fixture(scope="module")
def plan():
    return nbgpu.plan.nodes(CLUSTER, nproc_per_node=2)


def take(plan, **overrides):
    given = {"nproc": None, "nnodes": 1, "slurm": None, "gpus": None, "role": None, "env": {}}
    notes = []
    return take_nodes_plan(plan, notes=notes, **{**given, **overrides}), notes


def test_the_plan_sets_nodes_ranks_nodelist_and_each_nodes_gpus(plan):
    assert is_nodes_plan(plan)
    assert not is_nodes_plan(nbgpu.plan(inventory="4xA40"))
    (nproc, nnodes, options, env), notes = take(plan, env={"A": "1"})
    assert (nproc, nnodes) == (2, 2)
    assert request_args(options) == ["--nodelist", "n1,n2"]
    assert json.loads(env["NBGPU_NODE_GPUS"]) == {"n1": "1,2", "n2": "0,1"}
    assert env["A"] == "1"
    assert notes == ["plan across nodes: n1: GPUs 1,2; n2: GPUs 0,1"]


def test_with_gpus_per_node_slurm_assigns_them(plan):
    (_, _, options, env), notes = take(plan, slurm=SlurmOptions(gpus_per_node=2))
    assert "NBGPU_NODE_GPUS" not in env
    assert request_args(options) == ["--gpus-per-node=2", "--nodelist", "n1,n2"]
    assert "SLURM assigns each node's GPUs" in notes[0]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"nnodes": 3}, r"--nodes 3: the plan is for 2 node\(s\) \(n1,n2\)"),
        ({"nproc": 4}, r"--nproc-per-node 4: the plan gives 2 rank\(s\) per node"),
        ({"gpus": "0,1"}, r"--plan and --gpus both choose GPUs"),
        ({"role": "train"}, r"--role 'train': a plan across nodes has one training role"),
        ({"slurm": SlurmOptions(extra=("-w", "n3"))}, r"--plan chose the nodes"),
    ],
)
def test_what_disagrees_with_the_plan_is_one_line(plan, overrides, message):
    with pytest.raises(UserInputError, match=message):
        take(plan, **overrides)


def test_a_plan_that_is_not_ready_is_not_launched():
    blocked = nbgpu.plan.nodes(CLUSTER, nodes=2, nproc_per_node=4)
    with pytest.raises(UserInputError, match=r"--plan: the plan is not ready: 2 node\(s\)"):
        take(blocked)


def test_an_inference_only_allocation_is_not_launched():
    servers = nbgpu.plan.nodes("4x(8)", allocation="sglang:d8t2")
    assert servers.ok
    with pytest.raises(UserInputError, match=r"--plan: the plan has no training role to launch"):
        take(servers)


def test_an_allocation_over_24_simulated_8_gpu_nodes_launches_its_trainer_there():
    start = time.perf_counter()
    p = nbgpu.plan.nodes("24x(8xH100)", allocation="sglang:d80m2p1+d4m2p4", global_batch=64)
    assert time.perf_counter() - start < 1.0  # measured about 5 ms once imported
    assert p.ok, p.text()
    loaded = nbgpu.plan.plan_from_json(p.to_json())  # what `nbgpu run --plan FILE` reads
    (nproc, nnodes, options, env), notes = take(loaded)
    assert (nproc, nnodes) == (8, 4)
    assert request_args(options) == ["--nodelist", "n21,n22,n23,n24"]
    trainer = {f"n{i}": "0,1,2,3,4,5,6,7" for i in range(21, 25)}
    assert json.loads(env["NBGPU_NODE_GPUS"]) == trainer
    assert notes == [
        f"plan across nodes: {'; '.join(f'{n}: GPUs {g}' for n, g in trainer.items())}"
    ]
    launch = [line for line in p.text().splitlines() if line.startswith("launch: ")]
    assert launch[0] == (
        "launch: role sglang: not started by --plan: start it on its nodes with their "
        "CUDA_VISIBLE_DEVICES"
    )
    assert launch[1].startswith("launch: role train: %%torchrun --plan p or nbgpu run --plan FILE")
    assert "srun --nodelist n21,n22,n23,n24;" in launch[1]


def test_each_node_takes_its_own_gpus(monkeypatch):
    monkeypatch.setenv("NBGPU_NODE_GPUS", json.dumps({"n1": "1,2", "n2": "0,1"}))
    # Set through monkeypatch first, so what the function writes is undone after the test.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "unset-by-the-test")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    slurm_node._take_planned_gpus("n2")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert "NBGPU_NODE_GPUS" not in os.environ  # not handed on to the ranks
    monkeypatch.setenv("NBGPU_NODE_GPUS", json.dumps({"n1": "1,2"}))
    with pytest.raises(SystemExit, match=r"the plan names no GPUs for node 'n9'"):
        slurm_node._take_planned_gpus("n9")


def _plan_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "nbgpu.cli", "plan", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=cwd,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nodes", "2"], "--nodes: which nodes? add --slurm"),
        (["--slurm", "--fleet", "4xA40", "--nodes", "2"], "--slurm asks the nodes themselves"),
        (["d4", "--nodes", "2", "--fleet", "4xA40"], "cluster file '4xA40' does not exist"),
        (["d4", "--nodes", "2", "--gpus", "2"], "--gpus plans one box; across nodes the plan"),
        (["--nodes", "2", "--gpus-per-node", "4", "--slurm"], "--slurm asks the nodes themselves"),
        (
            ["--nproc-per-node", "2", "--gpus-per-node", "4"],
            "--gpus-per-node G describes --nodes N",
        ),
        (["--partition", "debug", "--fleet", "4xA40"], "--partition goes with --slurm"),
    ],
)
def test_plan_face_mistakes_are_one_line(args, message):
    done = _plan_cli(*args)
    assert done.returncode == 2
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_cluster_file_given_as_fleet_plans_across_its_nodes(tmp_path):
    nodes = [
        {"node": n, **take_inventory({"NBGPU_SIMULATE": s}, scan_device_files=False).to_dict()}
        for n, s in CLUSTER.items()
    ]
    (tmp_path / "cluster.json").write_text(json.dumps({"source": "alloc 3", "nodes": nodes}))
    done = _plan_cli("--fleet", "cluster.json", "--batch", "6", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["node_gpus"] == {"n1": "1,2,3", "n2": "0,1,3"}
    assert data["ok"] is True


def test_the_plan_face_plans_an_allocation_over_described_nodes():
    done = _plan_cli("sglang:d80m2p1+d4m2p4", "--nodes", "24", "--gpus-per-node", "8", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["ok"] is True
    assert data["allocation"] == "sglang.d80t2p1+d4t2p4"
    assert data["node_gpus"] == {f"n{i}": "0,1,2,3,4,5,6,7" for i in range(21, 25)}
    assert [n["role"] for n in data["nodes"]] == ["sglang"] * 20 + ["train"] * 4
