"""``nbgpu status --slurm``: each node reports its own GPUs through srun, merged."""

import json
import subprocess
import sys

import pytest

from nbgpu.devices.inventory import take_inventory
from nbgpu.errors import UserInputError
from nbgpu.launch.config import SlurmOptions
from nbgpu.launch.slurm import cluster_status

pytestmark = pytest.mark.slow


def test_every_node_reports_its_gpus(slurm_cluster, tmp_path):
    # Each node plays its own GPUs (a cluster file as NBGPU_SIMULATE): a merge that took one
    # node's report for both, or mixed their rows, shows here.
    nodes = [
        {
            "node": node,
            **take_inventory({"NBGPU_SIMULATE": spec}, scan_device_files=False).to_dict(),
        }
        for node, spec in (("n1", "4xA40,busy=0"), ("n2", "2xH100,lost=1"))
    ]
    fleets = tmp_path / "cluster.json"
    fleets.write_text(json.dumps({"source": "test cluster", "nodes": nodes}))
    env = {**slurm_cluster.env, "NBGPU_SIMULATE": str(fleets)}
    cluster = cluster_status(nodes=2, options=SlurmOptions(), environ=env)
    assert [n.node for n in cluster.nodes] == ["n1", "n2"]
    frame = cluster.records()
    assert [(r["node"], r["gpu"], r["name"]) for r in frame] == [
        *(("n1", g, "NVIDIA A40") for g in range(4)),
        ("n2", 0, "NVIDIA H100 80GB HBM3"),
        ("n2", 1, None),  # lost: NVML gives no name
    ]
    health = {n.node: n.health for n in cluster.nodes}
    assert health["n1"][0].startswith("BUSY")
    assert health["n1"][1:] == ("ok",) * 3
    assert health["n2"] == ("ok", "LOST")
    assert "2 nodes · 6 GPUs" in cluster.text()
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
