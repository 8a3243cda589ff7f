"""``nbgpu status --slurm``: each node reports its own GPUs through srun, merged."""

import json
import subprocess
import sys

import pytest

from nbgpu.errors import UserInputError
from nbgpu.launch.config import SlurmOptions
from nbgpu.launch.slurm import cluster_status

pytestmark = pytest.mark.slow


def test_every_node_reports_its_gpus(slurm_cluster):
    env = {**slurm_cluster.env, "NBGPU_SIMULATE": "4xA40,busy=0"}
    cluster = cluster_status(nodes=2, options=SlurmOptions(), environ=env)
    assert [n.node for n in cluster.nodes] == ["n1", "n2"]
    frame = cluster.records()
    assert len(frame) == 8
    assert {(r["node"], r["gpu"]) for r in frame} == {
        (n, g) for n in ("n1", "n2") for g in range(4)
    }
    assert all(r["name"] == "NVIDIA A40" for r in frame)
    text = cluster.text()
    assert "2 nodes · 8 GPUs" in text
    assert text.count("BUSY") == 2  # GPU 0 of each node, as each node saw it
    assert not slurm_cluster.squeue()


def test_the_cli_prints_the_merged_json(slurm_cluster):
    env = {**slurm_cluster.env, "NBGPU_SIMULATE": "2xH100"}
    done = subprocess.run(
        [sys.executable, "-m", "nbgpu.cli", "status", "--slurm", "--nodes", "2", "--json"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert [n["node"] for n in data["nodes"]] == ["n1", "n2"]
    assert [len(n["gpus"]) for n in data["nodes"]] == [2, 2]


def test_more_nodes_than_the_cluster_has_is_one_line(slurm_cluster):
    with pytest.raises(UserInputError, match=r"--nodes 3: the cluster has 2 node\(s\)"):
        cluster_status(nodes=3, options=SlurmOptions(), environ=slurm_cluster.env)
