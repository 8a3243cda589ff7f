"""Shared machinery: time whole subprocesses in alternation, summarise, print tables.

A benchmark here is a set of named *cases* (argv + environment), each run N times
in rotating order so that drift on a busy machine (2 shared cores) hits every case
alike. Each run records wall time and the child's CPU time (user + system, from
``RUSAGE_CHILDREN``). Results are medians; ratios compare cases of the same run.
"""

from __future__ import annotations

import functools
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
PYTHON = sys.executable
VENV_BIN = Path(PYTHON).parent


@dataclass(frozen=True)
class Case:
    """One command to time; ``check`` validates one run's output (None: fine)."""

    name: str
    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    check: Callable[[subprocess.CompletedProcess[str]], str | None] | None = None


@dataclass(frozen=True)
class Run:
    wall_ms: float
    cpu_ms: float
    proc: subprocess.CompletedProcess[str]


@dataclass
class Row:
    """One line of a results table."""

    name: str
    wall_ms: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)
    note: str = ""
    stdouts: list[str] = field(default_factory=list)  # of the timed runs, for reports

    @property
    def median_wall(self) -> float:
        return statistics.median(self.wall_ms) if self.wall_ms else float("nan")

    @property
    def median_cpu(self) -> float:
        return statistics.median(self.cpu_ms) if self.cpu_ms else float("nan")


# Children must run from cached bytecode, as an installed package does. This
# environment may set PYTHONDONTWRITEBYTECODE, which would make every run recompile
# nbgpu (an editable install) but not gpustat or nvitop (compiled by pip). So every
# child reads and writes bytecode under one private prefix, for all tools alike,
# filled by the untimed validation and warm-up runs; nothing is written in the repo.
_PYCACHE = tempfile.TemporaryDirectory(prefix="nbgpu-bench-pycache-")
_UNSET = ("NBGPU_SIMULATE", "PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")


# Everything the benchmarks import, compiled into the private cache before timing.
_PRIME = "import IPython, gpustat, nvitop.cli, pynvml, nbgpu.api, nbgpu.cli, nbgpu.notebook.magics"


@functools.cache
def prime_bytecode() -> None:
    """Compile every module the children will import (once per process)."""
    run_once(Case("prime bytecode", [PYTHON, "-c", _PRIME]))


def child_env(extra: Mapping[str, str]) -> dict[str, str]:
    """This environment with a private bytecode cache and no NBGPU_SIMULATE, plus *extra*."""
    env = {k: v for k, v in os.environ.items() if k not in _UNSET}
    env["PYTHONPYCACHEPREFIX"] = _PYCACHE.name
    env.update(extra)
    return env


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(case: Case, timeout_s: float = 60.0) -> Run:
    """Run *case* to completion; stdout and stderr are captured (as a pipe would be)."""
    cpu_before = _children_cpu_s()
    started = time.perf_counter()
    proc = subprocess.run(
        list(case.argv),
        env=child_env(case.env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        cwd=REPO,
    )
    wall = time.perf_counter() - started
    cpu = _children_cpu_s() - cpu_before
    return Run(wall_ms=wall * 1000, cpu_ms=cpu * 1000, proc=proc)


def validate(case: Case) -> str | None:
    """Run *case* once untimed; a reason string if it failed or printed the wrong thing."""
    run = run_once(case)
    if run.proc.returncode != 0:
        tail = (run.proc.stderr or run.proc.stdout).strip().splitlines()[-3:]
        return f"exit code {run.proc.returncode}: {' / '.join(tail)}"
    return case.check(run.proc) if case.check else None


def alternate(cases: Sequence[Case], n: int, warmup: int = 1) -> dict[str, Row]:
    """Time every case *n* times, rotating the order each round; *warmup* rounds untimed."""
    rows = {case.name: Row(case.name) for case in cases}
    for round_index in range(warmup + n):
        shift = round_index % len(cases)
        for case in [*cases[shift:], *cases[:shift]]:
            run = run_once(case)
            if run.proc.returncode != 0:
                raise RuntimeError(f"{case.name} failed in round {round_index}: {run.proc.stderr}")
            if round_index >= warmup:
                rows[case.name].wall_ms.append(run.wall_ms)
                rows[case.name].cpu_ms.append(run.cpu_ms)
                rows[case.name].stdouts.append(run.proc.stdout)
    return rows


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"


def ratio(numerator: float, denominator: float) -> str:
    if math.isnan(numerator) or math.isnan(denominator) or denominator == 0:
        return "n/a"
    return f"{numerator / denominator:.2f}"


def print_table(title: str, rows: Sequence[Row], *, cpu: bool = True) -> None:
    """A Markdown table: readable in a terminal, pasteable into RESULTS.md."""
    print(f"\n### {title}\n")
    header = ["case", "n", "median wall ms"] + (["median CPU ms"] if cpu else []) + ["note"]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        cells = [row.name, str(len(row.wall_ms)), _ms(row.median_wall)]
        if cpu:
            cells.append(_ms(row.median_cpu))
        cells.append(row.note)
        print("| " + " | ".join(cells) + " |")


def print_ratios(title: str, pairs: Sequence[tuple[str, Row, Row]]) -> None:
    """Ratios of medians, numerator / denominator (< 1: the numerator is faster)."""
    print(f"\n### {title}\n")
    print("| ratio | wall | CPU |")
    print("|---|---|---|")
    for label, num, den in pairs:
        wall = ratio(num.median_wall, den.median_wall)
        cpu = ratio(num.median_cpu, den.median_cpu)
        print(f"| {label} | {wall} | {cpu} |")
