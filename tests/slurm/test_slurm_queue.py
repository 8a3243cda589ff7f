"""A job that waits in SLURM's queue: the cell says why; one that never starts is cancelled.

The test cluster's partition ``grant`` admits the account ``physics`` only; without an
accounting database SLURM keeps any job sent there pending with its reason, as a real
cluster does for an account the partition does not allow.
"""

import subprocess
import time

import pytest

from nbgpu.errors import UserInputError
from nbgpu.launch.config import SlurmOptions
from nbgpu.launch.launcher import torchrun
from nbgpu.launch.run import RunFailed
from nbgpu.launch.slurm import cluster_status
from tests.slurm.test_slurm_runs import Screen, nothing_left

pytestmark = pytest.mark.slow


def test_a_job_the_partition_will_never_start_is_cancelled_in_slurms_words(env, slurm_cluster):
    screen = Screen()
    began = time.monotonic()
    with pytest.raises(RunFailed) as failure:
        torchrun("print(1)", 1, nnodes=2, environ=env, write=screen,
                 slurm=SlurmOptions(partition="grant", account="chemistry"))  # fmt: skip
    run = failure.value.run
    assert time.monotonic() - began < 30
    summary = run.failure_summary()
    assert "SLURM says it will not start job" in summary
    assert "can't use this partition (grant allows physics)" in summary
    assert "is queued: Job's account not known" in screen.text
    assert nothing_left(run, slurm_cluster)


def test_a_job_waiting_for_nodes_says_so_and_its_timeout_leaves_nothing_queued(
    env, slurm_cluster, tmp_path
):
    # Another user's job holds both nodes whole: ours waits for resources.
    holder = subprocess.run(
        ["sbatch", "--parsable", "-N2", "--exclusive", "-J", "others", "--wrap", "sleep 120",
         # sbatch writes slurm-<id>.out into the directory it runs in: keep it out of the checkout
         "--output", str(tmp_path / "others-%j.out")],
        env=env, capture_output=True, text=True, timeout=30, check=True,
    ).stdout.strip()  # fmt: skip
    try:
        screen = Screen()
        with pytest.raises(RunFailed) as failure:
            torchrun("print(1)", 1, nnodes=2, slurm=SlurmOptions(), environ=env,
                     write=screen, timeout_s=8)  # fmt: skip
        run = failure.value.run
        assert run.state == "timed_out"
        assert "is queued: " in screen.text
        # A look at the nodes does not queue behind the holder: it says SLURM's words.
        with pytest.raises(UserInputError, match=r"--slurm: 0 of 2 nodes answered; srun says"):
            cluster_status(nodes=2, options=SlurmOptions(), environ=env, wait_s=2)
        deadline = time.time() + 30
        while time.time() < deadline and len(slurm_cluster.squeue()) > 1:
            time.sleep(0.2)
        assert [line.split()[0] for line in slurm_cluster.squeue()] == [holder]
    finally:
        subprocess.run(["scancel", holder], env=env, timeout=30, check=False)
    assert nothing_left(run, slurm_cluster)
