"""Several nodes without SLURM: the same cell started on each "node", meeting at c10d.

Two launchers on this machine stand in for two nodes: each is a separate Python process
(as each node's kernel would be) with its own runs directory, the same run name and
``--rdzv-endpoint``; torchrun's c10d rendezvous joins their ranks into one job.
"""

import socket
import subprocess
import sys
import time

import pytest

from nbgpu.errors import UserInputError
from nbgpu.launch.launcher import prepare, torchrun
from nbgpu.launch.procs import run_processes
from nbgpu.launch.run import RunFailed

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


def test_a_node_that_never_comes_ends_the_run_in_one_line(env, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    began = time.monotonic()
    with pytest.raises(RunFailed) as failure:
        torchrun(
            "print('never')\n",
            1,
            nnodes=2,
            rdzv_endpoint=f"127.0.0.1:{port}",
            node_rank=0,
            rdzv_timeout_s=4,
            name="alone",
            write=lambda _t: None,
            environ={**env, "NBGPU_RUNS_DIR": str(tmp_path / "runs")},
        )
    run = failure.value.run
    assert time.monotonic() - began < 30
    assert run.failure_summary() == (
        "run 'alone' failed: the 2 nodes did not meet within 4 s (--rdzv-timeout): the other "
        f"nodes never joined at 127.0.0.1:{port}; run the same cell on each of them with "
        f"--nodes 2 --rdzv-endpoint 127.0.0.1:{port} --name alone and --node-rank 1 (the name "
        "is the rendezvous id)"
    )
    assert not run_processes(run.run_id)


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"rdzv_timeout_s": 5}, "--rdzv-timeout is how long several nodes wait"),
        (
            {"rdzv_timeout_s": 0, "nnodes": 2, "rdzv_endpoint": "h:29400"},
            "--rdzv-timeout 0: expected seconds >= 1",
        ),
    ],
)
def test_rdzv_timeout_mistakes_are_one_line(keywords, message):
    with pytest.raises(UserInputError, match=message):
        prepare(code="x=1", nproc=1, **keywords)
