"""Several nodes without SLURM: the same cell started on each "node", meeting at c10d.

Two launchers on this machine stand in for two nodes: each is a separate Python process
(as each node's kernel would be) with its own runs directory, the same run name and
``--rdzv-endpoint``; torchrun's c10d rendezvous joins their ranks into one job.
"""

import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

LAUNCH = """
import sys, nbgpu
run = nbgpu.torchrun(
    "import os, nbgpu.rank as R\\nR.init()\\n"
    "print('rank', os.environ['RANK'], 'of', R.world_size(), 'sum', R.all_reduce_sum(1))\\n",
    2, nnodes=2, rdzv_endpoint=sys.argv[1], name="manual", check=False,
)
print("STATE", run.state)
"""


def test_two_launchers_join_one_job_at_the_endpoint(env, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    nodes = []
    for node in (0, 1):
        node_env = {**env, "NBGPU_RUNS_DIR": str(tmp_path / f"node{node}")}
        nodes.append(
            subprocess.Popen(
                [sys.executable, "-c", LAUNCH, f"127.0.0.1:{port}"],
                env=node_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = [proc.communicate(timeout=180) for proc in nodes]
    text = "".join(out for out, _err in outputs)
    assert [proc.returncode for proc in nodes] == [0, 0], outputs
    assert text.count("STATE succeeded") == 2, outputs
    for rank in range(4):
        assert f"rank {rank} of 4 sum 4" in text
