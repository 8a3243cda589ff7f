"""Probe, plan, launch across nodes on a real SLURM cluster.

Each test node plays its own simulated GPUs (a cluster fleet file: n1's GPU 0 is held by
a dead process in exclusive mode, n2's GPU 2 is lost). The nodes report them through
srun, the plan keeps each node's bad GPU out, and the run gives each node's ranks that
node's GPUs.
"""

import json
import subprocess
import sys

import pytest

import nbgpu
from nbgpu.devices.inventory import take_inventory
from nbgpu.launch.config import SlurmOptions
from nbgpu.launch.launcher import torchrun
from nbgpu.launch.run import RunFailed
from nbgpu.launch.slurm import cluster_status
from tests.slurm.test_slurm_runs import Screen, nothing_left

pytestmark = pytest.mark.slow

# Each rank says which GPUs its node gave it and which physical GPU cuda:0 is there.
WHERE = (
    "import os, nbgpu.rank as R\n"
    "dev = R.device()\n"
    "print('rank', os.environ['RANK'], 'on', os.environ['NBGPU_NODE'], 'sees',\n"
    "      os.environ.get('CUDA_VISIBLE_DEVICES'), flush=True)\n"
)


def write_cluster_file(tmp_path):
    """n1's GPU 0 held by a dead process (exclusive mode), n2's GPU 2 lost."""
    nodes = []
    for node, spec in (("n1", "4xA40,busy=0"), ("n2", "4xA40,lost=2")):
        inventory = take_inventory({"NBGPU_SIMULATE": spec}, scan_device_files=False)
        nodes.append({"node": node, **inventory.to_dict()})
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"source": "test cluster", "nodes": nodes}))
    return path


@pytest.fixture
def env(env, tmp_path):
    """The cluster's environment, each node playing its own simulated GPUs."""
    return {**env, "NBGPU_SIMULATE": str(write_cluster_file(tmp_path))}


def test_each_node_reports_its_own_gpus_and_the_plan_avoids_their_bad_ones(env, slurm_cluster):
    cluster = cluster_status(nodes=2, options=SlurmOptions(), environ=env)
    health = {n.node: n.health for n in cluster.nodes}
    assert health["n1"][0].startswith("BUSY")
    assert health["n1"][1:] == ("ok",) * 3
    assert health["n2"][2] == "LOST"
    assert health["n2"][0] == "ok"

    p = nbgpu.plan.nodes(cluster, nproc_per_node=2, global_batch=8)
    assert p.ok, p.text()
    assert p.node_gpus == {"n1": "1,2", "n2": "0,1"}
    assert (p.job_nodes, p.world_size) == (2, 4)

    screen = Screen()
    run = torchrun(WHERE, environ=env, write=screen, plan=p)
    assert run.state == "succeeded", screen.text
    text = screen.text.replace("\x1b[0m", "")
    for rank in range(4):
        node = (run.dir / f"rank{rank}.node").read_text()
        assert f"rank {rank} on {node} sees {p.node_gpus[node]}" in text
    assert "plan across nodes: n1: GPUs 1,2; n2: GPUs 0,1" in text
    assert nothing_left(run, slurm_cluster)


def test_without_the_plan_the_busy_gpu_fails_the_run(env, slurm_cluster):
    # The contrast: rank 0 on n1 gets cuda:0 = GPU 0, which the dead holder keeps.
    with pytest.raises(RunFailed) as failure:
        torchrun(WHERE, 2, nnodes=2, slurm=SlurmOptions(), environ=env, write=Screen())
    run = failure.value.run
    assert "busy or unavailable" in "".join(
        (run.dir / f"rank{r}.log").read_text(errors="replace") for r in range(4)
    )
    assert nothing_left(run, slurm_cluster)


def test_plan_and_run_from_a_terminal(env, slurm_cluster, tmp_path):
    plan_file = tmp_path / "plan.json"
    done = subprocess.run(
        [sys.executable, "-m", "nbgpu.cli", "plan", "--slurm", "--nodes", "2",
         "--nproc-per-node", "2", "--json"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    plan_file.write_text(done.stdout)
    assert json.loads(done.stdout)["node_gpus"] == {"n1": "1,2", "n2": "0,1"}
    script = tmp_path / "where.py"
    script.write_text(WHERE)
    done = subprocess.run(
        [sys.executable, "-m", "nbgpu.cli", "run", "--plan", str(plan_file), str(script)],
        env=env, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sees 1,2" in done.stdout
    assert "sees 0,1" in done.stdout
    assert not slurm_cluster.squeue()


def test_a_plan_for_more_nodes_than_the_cluster_has_is_one_line(env, slurm_cluster):
    done = subprocess.run(
        [sys.executable, "-m", "nbgpu.cli", "plan", "--slurm", "--nodes", "3"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--nodes 3: the cluster has 2 node(s)" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not slurm_cluster.squeue()


def test_a_rescale_takes_its_node_size_from_the_partitions_nodes(env, slurm_cluster, tmp_path):
    # Each node has 4 GPUs, 3 of them usable: 8 GPUs would take 2 nodes of 4, which the
    # nodes cannot give; 6 take 2 nodes of 3.
    script = tmp_path / "run.sh"
    script.write_text(
        "python3 -m verl.trainer.main_ppo data.train_batch_size=12 trainer.n_gpus_per_node=3\n"
    )

    def scale(to, *more):
        argv = [sys.executable, "-m", "nbgpu.cli", "plan", "--scale", str(script), "--to", to]
        return subprocess.run(
            [*argv, "--slurm", *more],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    done = scale("6", "--overrides")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["data.train_batch_size=24", "trainer.nnodes=2"]
    text = " ".join(scale("8").stdout.split())  # as one line, however the terminal wraps
    assert "0 of the 2 nodes have 4 usable GPUs (n1: 3 usable (GPU 0: BUSY" in text, text
    assert "n2: 3 usable (GPU 2: LOST)) -> --to 6" in text
    assert not slurm_cluster.squeue()
