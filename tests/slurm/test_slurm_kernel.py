"""``%%torchrun --slurm`` in a real Jupyter kernel on the two-node test cluster."""

import re
import time

import pytest

from tests.notebook.test_kernel_e2e import _execute, started_kernel
from tests.slurm.test_slurm_plan import write_cluster_file
from tests.slurm.test_slurm_runs import processes_of

pytestmark = pytest.mark.slow


def queue_empties(cluster, timeout=15):
    """SLURM's queue is empty, or becomes so within *timeout*: a job that just ended is
    COMPLETING for a moment (slurmctld's bookkeeping after srun returned), then gone."""
    deadline = time.time() + timeout
    while cluster.squeue() and time.time() < deadline:
        time.sleep(0.2)
    return not cluster.squeue()


@pytest.fixture
def slurm_kernel(env, tmp_path):
    for _km, client in started_kernel(env, tmp_path):
        yield client


def test_the_magic_runs_two_nodes_and_names_the_failing_one(slurm_kernel, slurm_cluster):
    client = slurm_kernel
    assert _execute(client, "%load_ext nbgpu")[1] is None
    out, error = _execute(
        client,
        "%%torchrun --slurm --nodes 2 --nproc-per-node 2 --name k2x2\n"
        "import os, nbgpu.rank as R\nR.init()\n"
        "print('hello from', os.environ['RANK'], 'sum', R.all_reduce_sum(1))\n",
        timeout=180,
    )
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    assert error is None, plain
    for rank in range(4):
        assert re.search(rf"\[n[12]/rank{rank}\] hello from {rank} sum 4", plain), plain
    assert queue_empties(slurm_cluster), slurm_cluster.squeue()
    # Flags that need --slurm, or that --slurm replaces: one line each, nothing queued.
    out, _ = _execute(client, "%%torchrun --nodes 2 --nproc-per-node 2 --partition debug\nx=1")
    assert "UsageError: --partition asks SLURM for something: add --slurm" in out
    out, _ = _execute(client, "%%torchrun --slurm --nodes 2 --nproc-per-node 2 --time soon\nx=1")
    assert "UsageError: --time 'soon': expected SLURM's forms" in out
    out, _ = _execute(client, "%%torchrun --slurm --nodes 2 --gpus 0\nx=1")
    assert "UsageError: --gpus names this machine's GPUs" in out
    out, _ = _execute(client, "%%torchrun --nodes 2 --nproc-per-node 2\nx=1")
    assert "UsageError: --nodes 2 without --slurm: give --rdzv-endpoint HOST:PORT" in out
    assert not slurm_cluster.squeue()  # at once: a job they had queued would still be there
    # A rank that fails on one node: the cell's error names its node and rank.
    out, error = _execute(
        client,
        "%%torchrun --slurm --nodes 2 --nproc-per-node 2 --name kbad\n"
        "import os, time, nbgpu.rank as R\nR.init()\n"
        "if os.environ['RANK'] == '2':\n    raise ValueError('bad shard')\ntime.sleep(30)\n",
        timeout=180,
    )
    assert error is not None
    assert re.search(r"rank 2 on node n[12] failed first", error), error
    assert queue_empties(slurm_cluster), slurm_cluster.squeue()


@pytest.fixture
def planning_kernel(env, tmp_path):
    simulated = {**env, "NBGPU_SIMULATE": str(write_cluster_file(tmp_path))}
    for _km, client in started_kernel(simulated, tmp_path):
        yield client


def test_plan_across_the_nodes_then_launch_the_plan(planning_kernel, slurm_cluster):
    client = planning_kernel
    assert _execute(client, "%load_ext nbgpu")[1] is None
    out, error = _execute(
        client, "p = %gpu_plan --slurm --nproc-per-node 2 --batch 8\nprint(p.text())", timeout=120
    )
    assert error is None, out
    assert "2 node(s) × 2 GPUs" in out
    assert "ready" in out
    assert re.search(r"n1\s+train\s+1,2\s+2\s+A40\s+GPU 0: BUSY", out), out
    assert re.search(r"n2\s+train\s+0,1\s+2\s+A40\s+GPU 2: LOST", out), out
    out, error = _execute(
        client,
        "%%torchrun --plan p --name planned\n"
        "import os, nbgpu.rank as R\nR.device()\n"
        "print('sees', os.environ['CUDA_VISIBLE_DEVICES'])\n",
        timeout=180,
    )
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    assert error is None, plain
    assert len(re.findall(r"\[n1/rank\d\] sees 1,2", plain)) == 2, plain
    assert len(re.findall(r"\[n2/rank\d\] sees 0,1", plain)) == 2, plain
    assert queue_empties(slurm_cluster), slurm_cluster.squeue()
    # What the plan decided cannot be changed on the way: one line.
    out, _ = _execute(client, "%%torchrun --plan p --nodes 3\nx=1")
    assert "UsageError: --nodes 3: the plan is for 2 node(s) (n1,n2)" in out
    assert not slurm_cluster.squeue()


def test_gpu_stop_cancels_a_background_run_on_every_node(slurm_kernel, slurm_cluster):
    client = slurm_kernel
    assert _execute(client, "%load_ext nbgpu")[1] is None
    out, error = _execute(
        client,
        "%%torchrun --slurm --nodes 2 --nproc-per-node 1 --bg --name kbg\n"
        "import time\nprint('up', flush=True)\ntime.sleep(300)\n",
        timeout=60,
    )
    assert error is None, out
    # Wait until both nodes' ranks run, then stop the run from another cell.
    out, error = _execute(
        client,
        "import time, nbgpu\nrun = nbgpu.runs()['kbg']\ndeadline = time.time() + 90\n"
        "while len(list(run.dir.glob('rank*.node'))) < 2 and time.time() < deadline:\n"
        "    time.sleep(0.2)\nprint('ranks up', len(list(run.dir.glob('rank*.node'))))\n",
        timeout=120,
    )
    assert "ranks up 2" in out, (out, error)
    out, error = _execute(client, "%gpu_stop kbg", timeout=90)
    assert error is None, out
    out, _ = _execute(client, "print(nbgpu.runs()['kbg'].state, run.run_id)")
    state, run_id = out.split()
    assert state == "stopped"
    deadline = time.time() + 30
    while (processes_of(run_id) or slurm_cluster.squeue()) and time.time() < deadline:
        time.sleep(0.2)
    assert not processes_of(run_id)
    assert not slurm_cluster.squeue()
