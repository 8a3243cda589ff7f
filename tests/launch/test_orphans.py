"""No orphans: a rank's own children (a data-loader worker, a shell) end with the run.

Survivors are looked for in every process on the machine, by the run's id in
/proc/PID/environ: not through ``run_processes``, which the stop logic itself uses.
"""

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from nbgpu.launch.launcher import prepare
from nbgpu.launch.run import Run
from nbgpu.launch.streams import ScreenWriter

pytestmark = pytest.mark.slow

RANK_WITH_CHILDREN = """
import multiprocessing
import subprocess
import time

def loader_worker():
    time.sleep(300)

worker = multiprocessing.get_context("fork").Process(target=loader_worker, daemon=False)
worker.start()
shell = subprocess.Popen("sleep 300; true", shell=True)
print("ready", flush=True)
time.sleep(300)
"""


def tagged(run_id):
    """Every live process on the machine whose environment carries the run's id."""
    needle = f"NBGPU_RUN_ID={run_id}".encode()
    found = []
    for proc in psutil.process_iter():
        try:
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
            if needle in environ and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (OSError, psutil.Error):  # noqa: PERF203  (processes come and go)
            continue
    return found


def wait_until(predicate, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_agent_sigkill_leaves_no_child_of_any_rank(env):
    prepared = prepare(code=RANK_WITH_CHILDREN, nproc=2, environ=env)
    run = Run(prepared.config, environ=env).start()
    # agent + 2 x (rank, loader worker, sh, sleep)
    assert wait_until(lambda: len(tagged(run.run_id)) >= 9, 120), tagged(run.run_id)
    os.kill(run.agent.pid, signal.SIGKILL)
    shown = []
    run.follow(ScreenWriter(shown.append))
    assert wait_until(lambda: not tagged(run.run_id), 15), [
        (p, psutil.Process(p).cmdline()) for p in tagged(run.run_id)
    ]
    assert "outlived them; stopped" in "".join(shown)
