"""What planning an allocation across nodes costs as the cluster grows (issue 22).

AReaL's published 24-node allocation ``sglang:d80m2p1+d4m2p4`` (20 nodes of SGLang
servers, 4 trainer nodes of 8 GPUs) planned by ``nbgpu.plan.nodes`` on 24 simulated
nodes, on 24 described nodes (not seen), and a 512-GPU allocation on 64 simulated
nodes; the anchor is the same 24 nodes given as 24 different fleets, one simulated
snapshot per node (what every cluster cost before nodes of one fleet shared one).

    .venv/bin/python bench/bench_plan_nodes.py
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

AREAL = "sglang:d80m2p1+d4m2p4"


def _median_ms(call: Callable[[], object], runs: int = 15) -> tuple[float, float, float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times), min(times), max(times)


def main() -> None:
    start = time.perf_counter()
    import nbgpu  # noqa: PLC0415  (timed: the first plan imports the inventory)

    first = nbgpu.plan.nodes("24x(8xH100)", allocation=AREAL, global_batch=64)
    print(f"first plan in a fresh process: {1e3 * (time.perf_counter() - start):.0f} ms")
    assert first.ok, first.text()
    distinct = {f"n{i}": f"8xH100,driver=550.{i}.1" for i in range(24)}
    cases: dict[str, Callable[[], object]] = {
        "24x(8xH100), 192 GPUs": lambda: nbgpu.plan.nodes("24x(8xH100)", allocation=AREAL),
        "24x(8) described, 192 GPUs": lambda: nbgpu.plan.nodes("24x(8)", allocation=AREAL),
        "64x(8xH100), 512 GPUs": lambda: nbgpu.plan.nodes(
            "64x(8xH100)", allocation="sglang:d192t2+megatron:d16t2p4"
        ),
        "anchor: 24 different fleets": lambda: nbgpu.plan.nodes(distinct, allocation=AREAL),
    }
    print("| cluster | median | min | max |\n|---|---:|---:|---:|")
    for name, call in cases.items():
        median, low, high = _median_ms(call)
        print(f"| {name} | {median:.1f} ms | {low:.1f} | {high:.1f} |")


if __name__ == "__main__":
    main()
