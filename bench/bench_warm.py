"""Warm ranks: a cell's round trip on a kept job, against the tools that keep workers warm.

Three parts, in one run, each in real Jupyter kernels driven by jupyter_client (a cell
is timed from ``execute_request`` to ``status: idle``, as a user waits for it):

1. Overhead of a trivial cell on 2 ranks (body ``x = 1``), cases alternating round by
   round, each in its own kernel started once:

   a. ``%%torchrun --on w`` on a warm nbgpu job (started once with ``--keep``)
   b. ``%%torchrun 2`` (a cold job per cell: the anchor nbgpu replaces here)
   c. ipyparallel's ``%%px`` on 2 engines (``ipp.Cluster(n=2)``, started once)
   d. nbdistributed's ``%%distributed`` after ``%dist_init -n 2`` (started once)
   e. a plain ``x = 1`` cell in the same kernel as (a): the kernel's own round trip

2. A 2-rank job that loads a ~100 MB model (a stack of ``Linear(2048, 2048)``,
   ``torch.load`` from disk, then a gloo process group) and runs ten short cells (a
   forward pass and an ``all_reduce``): warm (one ``--keep`` cell that loads, ten
   ``--on`` cells, ``%gpu_stop``) against ten cold ``%%torchrun 2`` cells that each
   load and run the step.

3. Streaming inside a warm cell: each rank prints 20,000 lines that look like an
   ``NCCL_DEBUG=INFO`` run (NCCL INFO chatter, tqdm bars, loss lines, a warning), then
   a ``DONE`` line. Checked: every line is in the rank's log after the cell's marker
   (0 lost), each rank's ``DONE`` line reached the notebook. The same body as a cold
   ``%%torchrun 2`` for comparison.

4. Across nodes (``--nodes``, as root): a trivial cell on a warm job of 2 nodes x 2 ranks
   through the real two-node SLURM cluster on loopback that tests/slurm start (each node's
   relay carries the cell over TCP to its ranks), against the same cell on a warm job of
   4 ranks on one node (the Unix socket only), alternating, in one kernel.

    .venv/bin/python bench/bench_warm.py [N]       # N timed rounds of part 1 (default 20)
    sudo .venv/bin/python bench/bench_warm.py --nodes [N]   # part 4 only (default 20)

ipyparallel and nbdistributed come with ``make bench`` (the ``bench`` extra).
"""

from __future__ import annotations

import contextlib
import re
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench_launch import TAG_ENV, Kernel, kernel, leak_check
from harness import child_env

TRIVIAL = "x = 1"
MODEL_MB = 96  # 6 x Linear(2048, 2048) in float32, plus biases
STREAM_LINES = 20_000

MODEL_SETUP = """\
import os, time, torch, torch.distributed as dist
torch.set_num_threads(1)
t0 = time.perf_counter()
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(6)])
model.load_state_dict(torch.load({path!r}))
if not dist.is_initialized():
    dist.init_process_group("gloo")
loaded_s = time.perf_counter() - t0
"""
MODEL_STEP = """\
with torch.no_grad():
    out = model(torch.ones(8, 2048)).sum()
t = torch.tensor([float(out)])
dist.all_reduce(t)
"""

STREAM_BODY = f"""\
import os, sys
rank = int(os.environ["RANK"])
for i in range({STREAM_LINES} - 1):
    if i % 5 == 0:
        print(f"node0:{{os.getpid()}}:{{os.getpid()}} [{{rank}}] NCCL INFO Channel {{i % 32:02d}}/0 : "
              f"{{rank}}[{{rank}}] -> {{1 - rank}}[{{1 - rank}}] via P2P/CUMEM/read")
    elif i % 100 == 7:
        for p in (0, 50, 100):
            sys.stdout.write(f"\\r{{p:3d}}%|{{'#' * (p // 10):<10}}| {{i}}/{STREAM_LINES}")
            sys.stdout.flush()
        print()
    elif i % 1000 == 999:
        print(f"[rank{{rank}}]:[W socket.cpp:697] [c10d] The client socket has timed out "
              f"after 1800s while trying to connect", file=sys.stderr)
    else:
        print(f"step {{i}} loss={{1 / (i + 1):.6f}} lr=3.0e-04 rank={{rank}}")
print(f"rank {{rank}} DONE")
"""


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _run(k: Kernel, code: str) -> float:
    cell = k.execute(code, timeout_s=600)
    if cell.error:
        raise RuntimeError(f"{code.splitlines()[0]!r}: {cell.error}\n{cell.text[-2000:]}")
    return cell.wall_s * 1000


def part_overhead(n: int, work: Path, env: dict[str, str]) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in ("warm", "cold", "px", "nbdist", "plain")}
    with contextlib.ExitStack() as stack:
        nb = stack.enter_context(kernel(work, env, "nbgpu"))
        _run(nb, "%load_ext nbgpu")
        _run(nb, f"%%torchrun 2 --keep --name w --quiet\n{TRIVIAL}")
        px = stack.enter_context(kernel(work, env, "ipp"))
        _run(
            px,
            "import ipyparallel as ipp\ncluster = ipp.Cluster(n=2, log_level=40)\n"
            "rc = cluster.start_and_connect_sync()\nrc.activate()",
        )
        nd = stack.enter_context(kernel(work, env, "nbdist"))
        _run(nd, "%load_ext nbdistributed")
        _run(nd, "%dist_init -n 2")
        cases: dict[str, Callable[[], float]] = {
            "warm": lambda: _run(nb, f"%%torchrun --on w --quiet\n{TRIVIAL}"),
            "cold": lambda: _run(nb, f"%%torchrun 2 --quiet\n{TRIVIAL}"),
            "px": lambda: _run(px, f"%%px\n{TRIVIAL}"),
            "nbdist": lambda: _run(nd, f"%%distributed\n{TRIVIAL}"),
            "plain": lambda: _run(nb, TRIVIAL),
        }
        for case in cases.values():  # one untimed round: imports, caches
            case()
        for round_ in range(n):
            order = list(cases)
            order = order[round_ % len(order) :] + order[: round_ % len(order)]
            for name in order:
                times[name].append(cases[name]())
        _run(nb, "%gpu_stop w")
        with contextlib.suppress(RuntimeError):
            _run(px, "cluster.stop_cluster_sync()")
        with contextlib.suppress(RuntimeError):
            _run(nd, "%dist_shutdown")
    return times


def part_model(work: Path, env: dict[str, str]) -> dict[str, float]:
    path = work / "model.pt"
    import torch  # noqa: PLC0415

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(6)])
    torch.save(model.state_dict(), path)
    size_mb = path.stat().st_size / 2**20
    setup = MODEL_SETUP.format(path=str(path))
    out: dict[str, float] = {"model_mb": size_mb}
    with kernel(work, env, "model") as k:
        _run(k, "%load_ext nbgpu")
        started = time.perf_counter()
        first = _run(k, f"%%torchrun 2 --keep --name m --quiet\n{setup}")
        cells = [_run(k, f"%%torchrun --on m --quiet\n{MODEL_STEP}") for _ in range(10)]
        _run(k, "%gpu_stop m")
        out["warm_total_s"] = time.perf_counter() - started
        out["warm_first_s"] = first / 1000
        out["warm_cell_ms"] = _median(cells)
        started = time.perf_counter()
        cold = [_run(k, f"%%torchrun 2 --quiet\n{setup}{MODEL_STEP}") for _ in range(10)]
        out["cold_total_s"] = time.perf_counter() - started
        out["cold_cell_s"] = _median(cold) / 1000
    return out


def _stream_check(k: Kernel, code: str, run_dir_glob: str, work: Path) -> dict[str, object]:
    cell = k.execute(code, timeout_s=600)
    if cell.error:
        raise RuntimeError(cell.error)
    text = re.sub(r"\x1b\[[0-9;]*m", "", cell.text)
    run_dir = sorted((work / "runs").glob(run_dir_glob))[-1]
    lost = 0
    for rank in (0, 1):
        log = (run_dir / f"rank{rank}.log").read_text(errors="replace")
        # The lines of the last cell only (a warm job's log holds every cell).
        cut = log.rfind("#### nbgpu cell ")
        body = log[log.index("\n", cut) + 1 :] if cut >= 0 else log
        lines = [ln for ln in body.splitlines() if ln.strip()]
        lost += max(0, STREAM_LINES - len(lines))
    return {
        "wall_s": cell.wall_s,
        "lost": lost,
        "done_on_screen": all(f"[rank{r}] rank {r} DONE" in text for r in (0, 1)),
        "stream_messages": cell.messages,
    }


def part_stream(work: Path, env: dict[str, str]) -> dict[str, dict[str, object]]:
    with kernel(work, env, "stream") as k:
        _run(k, "%load_ext nbgpu")
        _run(k, "%%torchrun 2 --keep --name s --quiet\nimport os")
        warm = _stream_check(k, f"%%torchrun --on s\n{STREAM_BODY}", "s-*", work)
        _run(k, "%gpu_stop s")
        cold = _stream_check(k, f"%%torchrun 2 --name c\n{STREAM_BODY}", "c-*", work)
    return {"warm": warm, "cold": cold}


def part_nodes(n: int) -> dict[str, list[float]]:
    """Part 4: a warm cell on 2 nodes x 2 ranks (SLURM on loopback) vs on 4 ranks here."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (the cluster)
    from tests.slurm.cluster import Cluster  # noqa: PLC0415

    times: dict[str, list[float]] = {"nodes": [], "one": []}
    with tempfile.TemporaryDirectory(prefix="nbgpu-bench-nodes-") as tmp:
        work = Path(tmp)
        cluster = Cluster(work / "cluster").start()
        try:
            tag = secrets.token_hex(6)
            extra = {TAG_ENV: tag, "NBGPU_RUNS_DIR": str(work / "runs")}
            extra["SLURM_CONF"] = str(cluster.conf)
            env = child_env(extra)
            with kernel(work, env, "nodes") as k:
                _run(k, "%load_ext nbgpu")
                _run(k, f"%%torchrun --slurm --nodes 2 --nproc-per-node 2 --keep --name wn "
                        f"--quiet\n{TRIVIAL}")  # fmt: skip
                _run(k, f"%%torchrun 4 --keep --name w1 --quiet\n{TRIVIAL}")
                cases = {
                    "nodes": lambda: _run(k, f"%%torchrun --on wn --quiet\n{TRIVIAL}"),
                    "one": lambda: _run(k, f"%%torchrun --on w1 --quiet\n{TRIVIAL}"),
                }
                for case in cases.values():  # one untimed round
                    case()
                for round_ in range(n):
                    for name in sorted(cases, reverse=round_ % 2 == 1):
                        times[name].append(cases[name]())
                _run(k, "%gpu_stop")
            left = cluster.squeue() + leak_check(tag)
        finally:
            cluster.stop()
    print(f"\n== 4. a trivial warm cell, {n} rounds (median ms, execute_request -> idle) ==")
    for name, label in (
        ("nodes", "2 nodes x 2 ranks (SLURM, relays)"),
        ("one", "4 ranks, one node"),
    ):
        med = _median(times[name])
        q = statistics.quantiles(times[name], n=4) if len(times[name]) > 1 else [med, med, med]
        print(f"{label:44s} {med:8.1f}  (q1 {q[0]:.1f}, q3 {q[2]:.1f})")
    print(f"across nodes over one node: {_median(times['nodes']) - _median(times['one']):+.1f} ms")
    print(f"jobs queued and processes left behind: {len(left)}" + (f": {left}" if left else ""))
    return times


def main(n: int = 20) -> None:
    tag = secrets.token_hex(6)
    with tempfile.TemporaryDirectory(prefix="nbgpu-bench-warm-") as tmp:
        work = Path(tmp)
        env = child_env({TAG_ENV: tag, "NBGPU_RUNS_DIR": str(work / "runs")})
        env.pop("PYTEST_CURRENT_TEST", None)
        times = part_overhead(n, work, env)
        model = part_model(work, env)
        stream = part_stream(work, env)
    leaks = leak_check(tag)
    print(f"\n== 1. a trivial cell on 2 ranks, {n} rounds (median ms, execute_request -> idle) ==")
    plain = _median(times["plain"])
    for name, label in (
        ("warm", "%%torchrun --on w (warm nbgpu job)"),
        ("cold", "%%torchrun 2 (cold job)"),
        ("px", "ipyparallel %%px, 2 engines"),
        ("nbdist", "nbdistributed %%distributed, 2 ranks"),
        ("plain", "plain cell (the kernel's own round trip)"),
    ):
        med = _median(times[name])
        q = statistics.quantiles(times[name], n=4) if len(times[name]) > 1 else [med, med, med]
        print(
            f"{label:44s} {med:8.1f}  (q1 {q[0]:.1f}, q3 {q[2]:.1f}; over plain {med - plain:+.1f})"
        )
    warm = _median(times["warm"])
    for name in ("cold", "px", "nbdist"):
        print(f"ratio warm / {name}: {warm / _median(times[name]):.3f}")
    print(f"warm cell overhead over a plain cell: {warm - plain:.1f} ms (budget 50 ms)")
    print(
        f"\n== 2. a {model['model_mb']:.0f} MB model, loaded once vs per cell, ten short cells =="
    )
    print(
        f"warm: first cell (load) {model['warm_first_s']:.2f} s, each step cell "
        f"{model['warm_cell_ms']:.1f} ms, total with %gpu_stop {model['warm_total_s']:.2f} s"
    )
    print(f"cold: each cell {model['cold_cell_s']:.2f} s, total {model['cold_total_s']:.2f} s")
    print(f"ratio warm / cold total: {model['warm_total_s'] / model['cold_total_s']:.3f}")
    print(f"\n== 3. streaming {STREAM_LINES} lines per rank (NCCL INFO chatter, bars) ==")
    for name, r in stream.items():
        print(
            f"{name}: {r['wall_s']:.2f} s, lines lost on disk {r['lost']}, last line of "
            f"each rank on screen: {r['done_on_screen']}, iopub messages {r['stream_messages']}"
        )
    print(f"\nprocesses left behind: {len(leaks)}" + ("" if not leaks else f": {leaks}"))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--nodes"]:
        part_nodes(int(sys.argv[2]) if len(sys.argv) > 2 else 20)
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
