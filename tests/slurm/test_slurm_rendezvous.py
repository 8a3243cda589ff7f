"""A node that never starts its agent: the run ends in one line, and nothing is left."""

import os
import signal
import time

import pytest

from nbgpu.launch.config import SlurmOptions
from nbgpu.launch.launcher import torchrun
from nbgpu.launch.run import RunFailed
from tests.slurm.test_slurm_runs import Screen, nothing_left

pytestmark = pytest.mark.slow


def test_a_node_whose_slurmd_hangs_never_starts_its_agent(env, slurm_cluster):
    slurmd = slurm_cluster.slurmd("n2")
    os.kill(slurmd.pid, signal.SIGSTOP)  # n2 takes the job but cannot start anything
    began = time.monotonic()
    try:
        with pytest.raises(RunFailed) as failure:
            torchrun("print('up', flush=True)\n", 1, nnodes=2, slurm=SlurmOptions(),
                     environ=env, write=Screen(), rdzv_timeout_s=15, name="hung")  # fmt: skip
    finally:
        os.kill(slurmd.pid, signal.SIGCONT)
    run = failure.value.run
    assert run.state == "failed"
    summary = run.failure_summary()
    assert "the 2 nodes did not meet within 15 s (--rdzv-timeout)" in summary
    assert "SLURM gave the job node n2 but it never started its agent (started: n1)" in summary
    assert "\n" not in summary
    assert time.monotonic() - began < 60
    # Once n2's slurmd runs again it must not start the cancelled job's task late.
    assert nothing_left(run, slurm_cluster, timeout=60)
    time.sleep(3)
    assert nothing_left(run, slurm_cluster, timeout=1)
