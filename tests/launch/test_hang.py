"""A job that hangs, found and explained by itself: real gloo ranks, each way a job gets stuck."""

import json
import threading
import time

import pytest

import nbgpu
from nbgpu.launch.execute import runs_table
from nbgpu.launch.launcher import prepare
from nbgpu.launch.run import Run, leftover_processes
from nbgpu.launch.streams import ScreenWriter

pytestmark = pytest.mark.slow

PRELUDE = """
import os
import time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(16)
for _ in range(3):
    dist.all_reduce(t)
"""

SLEEPING_RANK = (
    PRELUDE
    + """
def load_batch():
    time.sleep(600)

if rank == 1:
    load_batch()
dist.all_reduce(t)
"""
)

OTHER_COLLECTIVE = (
    PRELUDE
    + """
if rank == 1:
    dist.barrier()
else:
    dist.all_reduce(t)
"""
)

DATA_LOADER = (
    PRELUDE
    + """
from torch.utils.data import DataLoader, Dataset

class Shards(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        if rank == 1 and i >= 8:
            time.sleep(600)  # a shard on a dead mount
        return torch.ones(16)

for batch in DataLoader(Shards(), batch_size=4, num_workers=1):
    dist.all_reduce(batch)
"""
)

SLOW_STEP = (
    PRELUDE
    + """
for step in range(2):
    time.sleep(4.0)  # every rank computes, silently, longer than --hang-after
    if rank == 1:
        time.sleep(1.0)  # and one is a little slower: the others wait 1 s in the collective
    dist.all_reduce(t)
print("done", flush=True)
"""
)


def _run(env, code, **options):
    lines = []
    run = nbgpu.torchrun(code, 2, check=False, write=lines.append, environ=env, **options)
    return run, "".join(lines)


def _stall(run):
    return json.loads((run.dir / "stall.json").read_text())


def test_a_rank_that_never_enters_the_collective_is_named_with_its_line(env):
    run, out = _run(env, SLEEPING_RANK, hang_after_s=3, on_hang="stop")
    assert "in all_reduce #4 [16] (rank 0 waiting)" in out, out
    assert "rank 1 never entered it: it is in cell.py:14 load_batch(): time.sleep(600)" in out
    stall = _stall(run)
    assert (stall["op"], stall["seq"], stall["waiting"]) == ("all_reduce", 4, [0])
    assert stall["never_entered"] == {"1": 3}
    assert run.state == "hung"
    assert "(--on-hang stop): stalled" in run.failure_summary()
    assert leftover_processes(run) == []


def test_a_rank_in_a_different_collective_is_named_with_it(env):
    run, out = _run(env, OTHER_COLLECTIVE, hang_after_s=3, on_hang="stop")
    assert "rank 1 entered barrier #4 instead" in out, out
    assert _stall(run)["entered_other"]["1"]["op"] == "barrier"
    assert leftover_processes(run) == []


def test_a_rank_waiting_on_a_stuck_data_loader_worker_shows_the_worker(env):
    run, out = _run(env, DATA_LOADER, hang_after_s=3, on_hang="stop")
    assert "rank 1 never entered it" in out, out
    assert "→ torch.utils.data.dataloader._try_get_data; its DataLoader worker is in" in out
    assert "cell.py:21 __getitem__(): time.sleep(600)" in out, out
    assert leftover_processes(run) == []


def test_a_slow_step_is_not_a_hang(env):
    run, out = _run(env, SLOW_STEP, hang_after_s=2, on_hang="stop")
    assert run.state == "succeeded", out
    assert "stalled" not in out
    assert not (run.dir / "stall.json").exists()


def test_diagnose_reads_the_stall_afterwards(env):
    run, _out = _run(env, SLEEPING_RANK, hang_after_s=3, on_hang="stop")
    result = nbgpu.diagnose(run)  # the run itself, as a notebook user has it
    assert result.cause == "stalled_collective", result.text()
    assert result.failed_rank == 1
    assert "load_batch(): time.sleep(600)" in result.text()


def test_a_reported_stall_leaves_the_job_running_and_shows_in_gpu_runs(env):
    prepared = prepare(code=SLEEPING_RANK, nproc=2, environ=env, hang_after_s=3)
    run = Run(prepared.config, environ=env).start()
    lines = []
    follower = threading.Thread(target=run.follow, args=(ScreenWriter(lines.append),))
    follower.start()
    try:
        deadline = time.time() + 60
        while not run.stall_lines and time.time() < deadline:
            time.sleep(0.2)
        assert run.stall_lines, "".join(lines)
        assert run.state == "running"  # --on-hang report (the default): the job goes on
        shown = runs_table().text()
        assert "STALLED (stall after 3 s)" in shown
        assert f"{run.name}: stalled " in shown
        assert "a run quiet for 2 min with a collective pending is stalled" in shown
    finally:
        run.stop("stopped")
        follower.join(60)
    assert run.state == "stopped"
    assert leftover_processes(run) == []


MISMATCHED_SIZES = (
    PRELUDE
    + """
dist.all_reduce(torch.ones(8) if rank == 2 else t)  # the last, uneven batch on rank 2
"""
)


def test_mismatched_sizes_are_named_on_the_rank_that_had_them(env):
    # gloo checks sizes: the job fails at once instead of hanging, and says why.
    lines = []
    run = nbgpu.torchrun(MISMATCHED_SIZES, 3, check=False, write=lines.append, environ=env)
    assert run.state == "failed"
    result = nbgpu.diagnose(run)
    assert result.cause == "collective_mismatch", result.text()
    assert result.failed_rank == 2
    assert leftover_processes(run) == []
