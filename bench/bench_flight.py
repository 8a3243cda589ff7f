"""The flight recorder's cost on a small CPU training step, and what a dump costs.

    .venv/bin/python bench/bench_flight.py [--rounds 5] [--steps 300]

Every run nbgpu starts sets ``TORCH_FR_BUFFER_SIZE`` (PyTorch's flight recorder: each
rank keeps its last N collectives) and starts a thread in each rank that answers a request
for the record (``nbgpu.rank.worker``). This measures what that costs. The same script runs
under bare torchrun, 2 ranks, gloo, one thread each: a DDP step of an MLP (about 1.1 M
parameters, so a few all_reduce buckets a step) timed over ``--steps`` steps after a
warm-up, in alternating rounds:

  a. recorder off (``TORCH_FR_BUFFER_SIZE=0``), no thread: the anchor
  b. recorder on, 2,000 entries (nbgpu's default), no thread
  c. the same plus nbgpu's request thread (it looks for a request twice a second)
  d. recorder on, 20,000 entries

Then, in one rank after the steps of (b) and (d): the time and size of one dump of the
whole record (what a stall look costs each rank). Prints Markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

STEP = """
import json, os, sys, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
if os.environ.get("BENCH_THREAD"):
    from pathlib import Path
    from nbgpu.rank.worker import serve_flight_records
    serve_flight_records(Path(os.environ["BENCH_DIR"]), rank)
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(
    torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512),
    torch.nn.ReLU(), torch.nn.Linear(512, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 512), torch.randint(0, 10, (32,))

def step():
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()

for _ in range(20):
    step()
steps = int(os.environ["BENCH_STEPS"])
dist.barrier()
t0 = time.perf_counter()
for _ in range(steps):
    step()
elapsed = time.perf_counter() - t0
dump = {}
if rank == 0 and int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0")):
    from torch._C._distributed_c10d import _dump_fr_trace_json
    d0 = time.perf_counter()
    data = _dump_fr_trace_json()
    dump = {"dump_ms": (time.perf_counter() - d0) * 1000, "dump_bytes": len(data),
            "entries": len(json.loads(data).get("entries", []))}
if rank == 0:
    print("RESULT " + json.dumps({"step_ms": elapsed / steps * 1000, **dump}), flush=True)
dist.destroy_process_group()
"""

CASES = {
    "a. recorder off (anchor)": {"TORCH_FR_BUFFER_SIZE": "0"},
    "b. recorder on, 2,000 entries (nbgpu's default)": {"TORCH_FR_BUFFER_SIZE": "2000"},
    "c. b + nbgpu's request thread": {"TORCH_FR_BUFFER_SIZE": "2000", "BENCH_THREAD": "1"},
    "d. recorder on, 20,000 entries": {"TORCH_FR_BUFFER_SIZE": "20000"},
}


def _torchrun() -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def _once(script: Path, env_extra: dict[str, str], steps: int, port: int) -> dict[str, float]:
    env = {**os.environ, **env_extra, "BENCH_STEPS": str(steps), "OMP_NUM_THREADS": "1"}
    env["BENCH_DIR"] = str(script.parent)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    argv = [*_torchrun(), "--nproc-per-node", "2", "--master-port", str(port), str(script)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=False)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"run failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    import torch  # noqa: PLC0415  (only for the version line)

    results: dict[str, list[dict[str, float]]] = {name: [] for name in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "step.py"
        script.write_text(STEP)
        port = 29731
        for _ in range(args.rounds):  # alternating: drift on the machine hits every case
            for name, env in CASES.items():
                results[name].append(_once(script, env, args.steps, port))
                port += 1
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(
        f"torch {torch.__version__}, 2 ranks, gloo, {args.steps} steps x {args.rounds} "
        f"alternating rounds, {stamp}, load {os.getloadavg()[0]:.2f}\n"
    )
    anchor = statistics.median(r["step_ms"] for r in results["a. recorder off (anchor)"])
    print("| case | median step ms (range) | / anchor | one dump of the record |")
    print("|---|---|---|---|")
    for name, runs in results.items():
        steps = sorted(r["step_ms"] for r in runs)
        median = statistics.median(steps)
        dumps = [r for r in runs if "dump_ms" in r]
        dump = "-"
        if dumps:
            ms = statistics.median(r["dump_ms"] for r in dumps)
            dump = f"{ms:.1f} ms, {dumps[0]['dump_bytes'] / 1024:.0f} KiB, {dumps[0]['entries']} entries"
        print(
            f"| {name} | {median:.2f} ({steps[0]:.2f}-{steps[-1]:.2f}) | "
            f"{median / anchor:.3f} | {dump} |"
        )


if __name__ == "__main__":
    main()
