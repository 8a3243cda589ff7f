"""A hung run: silent ranks are marked, and every rank's Python stack is shown at once."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from nbgpu.launch.execute import runs_table, silent_ranks
from nbgpu.launch.launcher import prepare
from nbgpu.launch.procs import rank_stacks
from nbgpu.launch.run import Run, leftover_processes
from nbgpu.launch.streams import ScreenWriter

pytestmark = pytest.mark.slow

HANG_IN_A_COLLECTIVE = """
import os
import time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")

def rank0_never_joins():
    print("ready", flush=True)
    time.sleep(600)

def stuck_in_collective():
    print("ready", flush=True)
    dist.all_reduce(torch.ones(4))  # rank 0 never joins: blocks inside gloo

if dist.get_rank() == 0:
    rank0_never_joins()
else:
    stuck_in_collective()
"""


def wait_for(run, needle, count, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        logs = [p.read_text(errors="replace") if p.exists() else "" for p in run.logs.values()]
        if sum(needle in text for text in logs) >= count:
            return
        time.sleep(0.1)
    raise AssertionError(f"ranks never printed {needle!r}: {logs}")


def test_rank_hung_in_a_gloo_collective_is_found_in_the_stacks(env, monkeypatch):
    prepared = prepare(code=HANG_IN_A_COLLECTIVE, nproc=2, environ=env)
    run = Run(prepared.config, environ=env).start()
    try:
        wait_for(run, "ready", 2)
        time.sleep(1.5)  # inside the collective by now
        assert [r for r, _s in silent_ranks(run, after_s=1.0)] == [0, 1]
        monkeypatch.setenv("NBGPU_SILENT_AFTER", "1")
        table = runs_table()
        assert "rank 0,1 silent" in table.text()
        assert f"%gpu_stacks {run.name}" in table.text()
        assert next(r for r in table.records() if r["name"] == run.name)["silent_ranks"] == [0, 1]

        stacks = rank_stacks(run.dir, timeout_s=30)
        assert stacks.complete, stacks.text()
        by_rank = {r.rank: r.python for r in stacks.ranks}
        assert "stuck_in_collective" in by_rank[1]
        assert "all_reduce" in by_rank[1]
        assert "rank0_never_joins" in by_rank[0]
        assert "stuck_in_collective" not in by_rank[0]
        # The run is untouched by being asked: both ranks still alive and waiting.
        assert run.agent.poll() is None

        # The terminal face shows the same, by run directory.
        done = subprocess.run(
            [sys.executable, "-m", "nbgpu", "stacks", str(run.dir), "--timeout", "30"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert "stuck_in_collective" in done.stdout
        assert "py-spy" in done.stdout  # says where native frames would come from

        # A rank stopped with SIGSTOP cannot answer: it is named, not waited on forever.
        rank0_pid = next(r.pid for r in stacks.ranks if r.rank == 0)
        os.kill(rank0_pid, signal.SIGSTOP)
        try:
            deadline = time.time() + 10
            while psutil.Process(rank0_pid).status() != psutil.STATUS_STOPPED:
                assert time.time() < deadline
                time.sleep(0.02)
            stopped = rank_stacks(run.dir, timeout_s=30)
        finally:
            os.kill(rank0_pid, signal.SIGCONT)
        assert stopped.ranks[0].state.startswith("stopped (SIGSTOP)")
        assert "stuck_in_collective" in stopped.ranks[1].python
    finally:
        run.stop("stopped")
        run.follow(ScreenWriter(lambda _t: None))
    assert leftover_processes(run) == []
