"""Ranks nbgpu launches on a simulated fleet appear as processes on their simulated GPUs."""

from __future__ import annotations

import time

import psutil
import pytest

from nbgpu.devices.inventory import take_inventory
from nbgpu.devices.sim import box as sim_ranks
from nbgpu.launch.launcher import prepare
from nbgpu.launch.run import Run

pytestmark = pytest.mark.slow


def test_ranks_show_up_on_the_gpus_they_were_given(sim_env, tmp_path):
    env = {**sim_env, "NBGPU_SIMULATE": "4xA40,busy=0", "NBGPU_RUNS_DIR": str(tmp_path)}
    code = "import time\nprint('ready', flush=True)\ntime.sleep(60)\n"
    prepared = prepare(code=code, nproc=2, environ=env)  # healthy GPUs only: 1 and 2
    run = Run(prepared.config, environ=env).start()
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            logs = [p.read_text() if p.exists() else "" for p in run.logs.values()]
            if sum("ready" in text for text in logs) >= 2:
                break
            time.sleep(0.1)
        sim_ranks._cache.clear()
        inv = take_inventory(env, scan_device_files=False)
        on_gpu = {g.nvml_index: [p.pid for p in g.processes] for g in inv.gpus}
        rank_pids = {
            p.pid
            for p in psutil.process_iter()
            if p.pid in {pid for pids in on_gpu.values() for pid in pids}
        }
        assert on_gpu[3] == []  # not given to the run
        assert len(on_gpu[1]) == 1
        assert len(on_gpu[2]) == 1
        assert len(rank_pids) == 2  # real, live processes
        gpu1 = next(g for g in inv.gpus if g.nvml_index == 1)
        (rank,) = gpu1.processes
        assert rank.state == "alive"
        rss = psutil.Process(rank.pid).memory_info().rss
        assert rank.used_bytes is not None
        assert abs(rank.used_bytes - rss) < 64 << 20  # the host memory it really uses
        assert gpu1.memory_used_bytes >= rank.used_bytes
        assert inv.simulated
    finally:
        run.stop()
        run.finish()


def test_a_rank_that_ended_is_not_listed_from_the_cache(sim_env, tmp_path):
    env = {**sim_env, "NBGPU_SIMULATE": "4xA40", "NBGPU_RUNS_DIR": str(tmp_path)}
    prepared = prepare(code="import time\ntime.sleep(60)\n", nproc=2, environ=env)
    run = Run(prepared.config, environ=env).start()
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            sim_ranks._cache.clear()
            listed = sim_ranks.ranks_on_gpus("4xA40")
            if sum(len(v) for v in listed.values()) == 2:
                break
            time.sleep(0.1)
        assert sum(len(v) for v in listed.values()) == 2
    finally:
        run.stop()
        run.finish()
    # Within the cache's second the table is not read again; the ended ranks still go.
    assert sum(len(v) for v in sim_ranks.ranks_on_gpus("4xA40").values()) == 0
