"""%gpu_watch's sampling cost at 1 Hz on 8 simulated GPUs (budget: under 1 % of one core).

    .venv/bin/python bench/bench_watch.py [--seconds 30]

In one fresh interpreter per case, after imports and one warm-up sample: the watcher
samples every second for ``--seconds`` (NVML calls through the simulated library,
process lookups in /proc, the inventory's verdicts); the process's own CPU time over
that window is compared with the same window of an idle interpreter that loaded the
same modules, so the figure is what sampling adds. The sampler thread's own CPU time
(``time.thread_time``) is reported beside it. Fleets: 8 H100 with 16 recorded
processes, and the same with 16 live holder processes (real ``sleep`` children, so
the /proc lookups are real).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_CHILD = r"""
import json, os, resource, subprocess, sys, time
from nbgpu.devices.watch import Watcher
seconds, mode, live = float(sys.argv[1]), sys.argv[2], sys.argv[3] == "live"
env = dict(os.environ)
holders = []
if live:
    holders = [subprocess.Popen(["sleep", "600"]) for _ in range(16)]
    env["NBGPU_SIMULATE"] = "8xH100," + ",".join(f"holder={i % 8}:{p.pid}" for i, p in enumerate(holders))
else:
    env["NBGPU_SIMULATE"] = "8xH100,procs=16"
w = Watcher(interval_s=1.0, history=300, environ=env)
w.sample_now()  # warm-up: imports, NVML init, first inventory
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
c0, t0, s0 = cpu(), time.monotonic(), w.sampling_s
if mode == "watch":
    w.start()
time.sleep(seconds)
w.stop()
c1, t1 = cpu(), time.monotonic()
for p in holders:
    p.kill()
print(json.dumps({"cpu_s": c1 - c0, "wall_s": t1 - t0, "samples": len(w.samples) - 1,
                  "thread_s": w.sampling_s - s0}))
"""


def run(mode: str, live: bool, seconds: float) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(seconds), mode, "live" if live else "recorded"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=seconds + 120,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(seconds: float = 30.0) -> None:
    print(f"%gpu_watch sampler at 1 Hz, {seconds:g} s per case, 8 simulated H100\n")
    print(
        "| holders | samples | process CPU added | % of one core | sampler thread CPU | per sample | budget |"
    )
    print("|---|---|---|---|---|---|---|")
    for live in (False, True):
        idle = run("idle", live, seconds)
        busy = run("watch", live, seconds)
        added = busy["cpu_s"] - idle["cpu_s"]
        share = 100 * added / busy["wall_s"]
        per = 1000 * busy["thread_s"] / max(1, busy["samples"])
        verdict = "OK" if share < 1.0 else "OVER"
        print(
            f"| {'16 live' if live else '16 recorded'} | {busy['samples']:.0f} | {added * 1000:.0f} ms "
            f"| {share:.2f} % | {busy['thread_s'] * 1000:.0f} ms | {per:.1f} ms | {verdict} |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    main(parser.parse_args().seconds)
