"""Launch overhead of a 2-node x 2-rank SLURM run: bare ``srun ... torchrun`` vs nbgpu.

The same work on the same real two-node SLURM cluster on loopback (the one the tests
start: munged, slurmctld, two slurmd), alternating, in one run:

a. bare ``srun --nodes 2 --ntasks-per-node 1 python -m torch.distributed.run --nnodes 2
   --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:<free port>
   --rdzv-id <id> --max-restarts 0 hello.py``: the anchor, torchrun's c10d rendezvous
   at an endpoint chosen before the job starts
t. the same as (a) with ``bench/torchrun_no_teardown.py`` as the launcher on each node:
   torchrun ending in ``os._exit`` as nbgpu's agents do (no interpreter teardown of torch
   in the launchers; the ranks tear down in every case): the like-for-like anchor
b. ``nbgpu run --slurm --nodes 2 --nproc-per-node 2 hello.py`` (the CLI): the same c10d
   rendezvous, its endpoint published by the first node

The script initialises gloo, does one ``all_reduce``, prints one line per rank and tears
the group down. Reported: median wall time and time to the first rank line on the
command's stdout per case, the ratios (b)/(a) and (b)/(t).

    sudo .venv/bin/python bench/bench_slurm.py [N]   # N alternating rounds (default 5)

Needs Debian's ``slurm-wlm`` and ``munge`` (``make test`` installs them as root).
"""

from __future__ import annotations

import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

from bench_launch import HELLO_BODY  # noqa: E402  (bench/ is this script's directory)

from tests.slurm.cluster import Cluster  # noqa: E402  (the repository root, added above)

HELLO = HELLO_BODY  # the same work as the single-node launch benchmark


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall ms, ms to the first rank line on stdout)."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    errors: list[bytes] = []
    reader = threading.Thread(target=lambda: errors.append(proc.stderr.read()), daemon=True)
    reader.start()
    first, lines = None, 0
    for line in proc.stdout:
        if b"hello from rank" in line:  # (srun may join two tasks' lines into one)
            lines += line.count(b"hello from rank")
            first = first or time.perf_counter() - started
    proc.wait(timeout=300)
    wall = time.perf_counter() - started
    reader.join(timeout=10)
    if proc.returncode != 0 or lines != 4 or first is None:
        raise RuntimeError(f"{argv[:3]}: exit {proc.returncode}, {lines} lines\n{errors}")
    return wall * 1000, first * 1000


FAILING = """\
import os, sys, time
import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 3:
    with open(sys.argv[1], "w") as f:
        f.write(repr(time.time()))
    os._exit(1)
time.sleep(60)
"""


# The same 2 nodes x 2 ranks run through nbgpu, timed and in the failure detection.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
NO_TEARDOWN = [sys.executable, str(BENCH / "torchrun_no_teardown.py")]
NBGPU_RUN = [sys.executable, "-m", "nbgpu.cli", "run", "--slurm", "--nodes", "2"]
NBGPU_RUN += ["--nproc-per-node", "2"]


def _failure_detection(root: Path, env: dict[str, str], rounds: int = 3) -> dict[str, object]:
    """Seconds from a rank's death on one node to the run ending, as the CLI returns."""
    script = root / "failing.py"
    script.write_text(FAILING)
    delays, node = [], "?"
    for i in range(rounds):
        stamp = root / f"died-{i}.txt"
        done = subprocess.run(
            [*NBGPU_RUN, str(script), str(stamp)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        ended = time.time()
        delays.append(ended - float(stamp.read_text()))
        found = [line for line in done.stderr.splitlines() if "failed first" in line]
        node = found[0].split("on node ")[1].split()[0] if found else "?"
    return {"detect_s": statistics.median(delays), "rounds": rounds, "node": node}


def main(n: int = 5) -> None:
    with tempfile.TemporaryDirectory(prefix="nbgpu-bench-slurm-") as tmp:
        root = Path(tmp)
        cluster = Cluster(root / "cluster").start()
        try:
            script = root / "hello.py"
            script.write_text(HELLO)
            env = {**cluster.env, "NBGPU_RUNS_DIR": str(root / "runs"), "OMP_NUM_THREADS": "1"}
            env.pop("NBGPU_SIMULATE", None)

            def bare(launcher: list[str]) -> tuple[float, float]:
                return _timed(
                    [
                        *("srun", "--nodes", "2", "--ntasks-per-node", "1"),
                        *launcher,
                        *("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d"),
                        *("--rdzv-endpoint", f"127.0.0.1:{_free_port()}"),
                        *("--rdzv-id", secrets.token_hex(4), "--max-restarts", "0"),
                        str(script),
                    ],
                    env,
                )

            def nbgpu() -> tuple[float, float]:
                return _timed([*NBGPU_RUN, str(script)], env)

            detection = _failure_detection(root, env)
            cases = {
                "a. bare srun + torchrun (c10d)": lambda: bare(TORCHRUN),
                "t. as (a), launchers skip teardown": lambda: bare(NO_TEARDOWN),
                "b. nbgpu run --slurm": nbgpu,
            }
            for case in cases.values():  # one untimed round: caches, the cluster's first job
                case()
            times: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
            names = list(cases)
            for round_ in range(n):
                shift = round_ % len(names)
                for name in names[shift:] + names[:shift]:
                    times[name].append(cases[name]())
            left = cluster.squeue()
        finally:
            cluster.stop()
    print(f"\n== 2 nodes x 2 ranks through SLURM, {n} alternating rounds ==")
    print("| case | median wall ms | min | max | first rank line ms (median) |")
    print("|---|---:|---:|---:|---:|")
    for name, values in times.items():
        walls = [w for w, _ in values]
        first = statistics.median(f for _, f in values)
        print(f"| {name} | {statistics.median(walls):.0f} | {min(walls):.0f} | {max(walls):.0f} "
              f"| {first:.0f} |")  # fmt: skip
    wall = {name[0]: statistics.median(w for w, _ in v) for name, v in times.items()}
    first = {name[0]: statistics.median(f for _, f in v) for name, v in times.items()}
    print(f"ratio (b)/(a): {wall['b'] / wall['a']:.2f}; (b)/(t): {wall['b'] / wall['t']:.2f}")
    print(f"first rank line, (b) - (t): {first['b'] - first['t']:+.0f} ms")
    print(f"jobs left in squeue: {len(left)}")
    print(
        f"\nfailure detection: a rank on one node exits 1 while the others wait; nbgpu run "
        f"--slurm returned {detection['detect_s']:.2f} s later (median of "
        f"{detection['rounds']}), the diagnosis named rank 3 on node {detection['node']}"
    )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
