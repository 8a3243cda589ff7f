"""The test cluster itself: one task lands on each of its two nodes."""

import subprocess

import pytest

pytestmark = pytest.mark.slow


def test_the_cluster_runs_a_task_on_each_node(slurm_cluster):
    out = subprocess.run(
        ["srun", "-N2", "-n2", "bash", "-c", "echo $SLURMD_NODENAME"],
        env=slurm_cluster.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert sorted(out.stdout.split()) == ["n1", "n2"], out.stderr
