"""Where ``nbgpu status --json`` spends its time (a diagnosis aid, not part of ``make bench``).

    .venv/bin/python bench/profile_status.py [RUNS]

1. ``python -X importtime``, RUNS fresh runs: median self and cumulative import time
   per module; the top modules by self time, and every nbgpu module.
2. How much of importing ``nbgpu.api`` is spent creating dataclasses.
3. ``cProfile`` of ``nbgpu.cli.main(["status", "--json"])`` after the imports (the
   work itself), by total time per function.

Steps 2 and 3 run in child processes so that this script's own imports do not hide
anything.
"""

from __future__ import annotations

import re
import statistics
import sys
from collections import defaultdict

from harness import PYTHON, Case, prime_bytecode, run_once

SPEC = "8xH100,procs=40"
TOP = 20
IMPORT_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|\s*(\S+)")
OURS = ("nbgpu", "pynvml", "psutil")

DATACLASS_COST = """\
import dataclasses, time
original = dataclasses._process_class
spent = [0.0, 0]
def timed(*args, **kwargs):
    t0 = time.perf_counter()
    try:
        return original(*args, **kwargs)
    finally:
        spent[0] += time.perf_counter() - t0
        spent[1] += 1
dataclasses._process_class = timed
t0 = time.perf_counter()
import nbgpu.api, nbgpu.cli
total = (time.perf_counter() - t0) * 1000
print(f"{spent[1]} dataclasses created, {spent[0] * 1000:.1f} ms "
      f"of {total:.1f} ms importing nbgpu.api + nbgpu.cli (after dataclasses itself)")
"""

WORK_PROFILE = """\
import contextlib, cProfile, io, pstats
from nbgpu import api, cli
profiler = cProfile.Profile()
with contextlib.redirect_stdout(io.StringIO()):
    profiler.runcall(cli.main, ["status", "--json"])
pstats.Stats(profiler).sort_stats("tottime").print_stats(TOP)
"""


def _child(name: str, argv: list[str]) -> str:
    run = run_once(Case(name, argv, {"NBGPU_SIMULATE": SPEC}))
    if run.proc.returncode != 0:
        raise RuntimeError(f"{name} failed: {run.proc.stderr.strip()[-500:]}")
    return run.proc.stdout + run.proc.stderr


def import_times(runs: int) -> dict[str, tuple[float, float]]:
    """module -> (median self ms, median cumulative ms) over *runs* fresh runs."""
    samples: dict[str, list[tuple[int, int]]] = defaultdict(list)
    argv = [PYTHON, "-X", "importtime", "-m", "nbgpu", "status", "--json"]
    for _ in range(runs):
        for own, cum, name in IMPORT_LINE.findall(_child("importtime", argv)):
            samples[name].append((int(own), int(cum)))
    return {
        name: (
            statistics.median(s[0] for s in rows) / 1000,
            statistics.median(s[1] for s in rows) / 1000,
        )
        for name, rows in samples.items()
    }


def _print_rows(title: str, rows: list[tuple[str, tuple[float, float]]]) -> None:
    print(f"\n### {title}\n")
    print("| module | self ms | cumulative ms |")
    print("|---|---|---|")
    for name, (own, cum) in rows:
        print(f"| {name} | {own:.1f} | {cum:.1f} |")


def print_imports(times: dict[str, tuple[float, float]]) -> None:
    by_self = sorted(times.items(), key=lambda kv: -kv[1][0])
    _print_rows(f"import time, median of runs: top {TOP} by self time", by_self[:TOP])
    ours = [kv for kv in times.items() if kv[0].split(".")[0] in OURS and kv[0] != "psutil._"]
    ours = [kv for kv in ours if kv[0].startswith("nbgpu") or "." not in kv[0]]
    _print_rows("nbgpu's modules, pynvml and psutil", sorted(ours, key=lambda kv: -kv[1][1]))


def main(runs: int = 9) -> None:
    prime_bytecode()
    print_imports(import_times(runs))
    print("\n### dataclass creation while importing nbgpu\n")
    print(_child("dataclasses", [PYTHON, "-c", DATACLASS_COST]).strip())
    print(f"\n### cProfile of cli.main(['status', '--json']) after the imports, top {TOP}\n")
    print(_child("cProfile", [PYTHON, "-c", f"TOP = {TOP}\n{WORK_PROFILE}"]).strip())


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 9)
