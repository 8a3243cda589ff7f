"""Run every nbgpu benchmark and print Markdown tables (``make bench``).

    .venv/bin/python bench/run_all.py [--n N] [--only load_ext|status|launch|logs|diagnose|
                                               warm|slurm|estimate]

Benchmarks, not tests: nothing here fails on a slow number; budgets are printed as
OK/OVER next to the figure. Anchors (bare IPython, gpustat, nvitop, the bare
interpreter, bare torchrun, accelerate's notebook_launcher) are measured in the same run, alternating with nbgpu, so the ratios
hold on whatever machine runs them.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import bench_diagnose
import bench_launch
import bench_load_ext
import bench_logs
import bench_status
import bench_warm

PACKAGES = (
    "nbgpu",
    "ipython",
    "nvidia-ml-py",
    "gpustat",
    "nvitop",
    "psutil",
    "torch",
    "ipykernel",
    "ipyparallel",
    "nbdistributed",
)


def _slurm(n: int = 5) -> None:
    """2 nodes x 2 ranks on a loopback SLURM cluster (as root, with slurm-wlm and munge)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests/
    from tests.slurm.cluster import missing_binaries  # noqa: PLC0415

    missing = missing_binaries()
    if missing or os.geteuid() != 0:
        why = f"missing {', '.join(missing)}" if missing else "not root"
        print(f"skipped: the loopback SLURM cluster needs root and slurm-wlm, munge ({why})")
        return
    import bench_slurm  # noqa: PLC0415

    bench_slurm.main(n)


def _estimate(n: int | None = None) -> None:
    """Every section of bench_estimate.py (their own repeat counts; --n does not apply)."""
    del n
    import bench_estimate  # noqa: PLC0415  (imports torch)

    for key in sorted(bench_estimate.SECTIONS):
        bench_estimate.SECTIONS[key]()


BENCHMARKS = {
    "load_ext": bench_load_ext.main,
    "status": bench_status.main,
    "launch": bench_launch.main,  # ~3.5 min: real torchrun jobs, default 7 rounds
    "logs": bench_logs.main,  # ~2 min: 2 x 200k lines, default 5 rounds
    "diagnose": bench_diagnose.main,  # ~20 s: a 200 MB four-rank log, fresh interpreters
    "warm": bench_warm.main,  # ~2 min: warm cells vs cold, ipyparallel, nbdistributed
    "slurm": _slurm,  # ~4 min: bare srun + torchrun (both anchors) vs nbgpu run --slurm
    "estimate": _estimate,  # estimates against measured peaks and Lightning's finder
}


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def print_machine() -> None:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"date: {now}")
    print(f"machine: {platform.platform()}, nproc {os.cpu_count()}, load average {load}")
    print(f"python: {platform.python_version()} ({sys.executable})")
    print("versions: " + ", ".join(f"{p} {_version(p)}" for p in PACKAGES))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--n",
        type=int,
        default=None,
        help="timed runs per case (default: each benchmark's own: 15; launch 7, logs 5)",
    )
    parser.add_argument("--only", choices=sorted(BENCHMARKS), action="append", default=None)
    args = parser.parse_args()
    print_machine()
    started = time.perf_counter()
    for name in args.only or BENCHMARKS:
        print(f"\n## {name}")
        BENCHMARKS[name](**({} if args.n is None else {"n": args.n}))
    print(f"\ntotal benchmark time: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
