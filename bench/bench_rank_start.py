"""A rank's own start: from its process to the user's first line, nbgpu's worker against
``python script.py``.

    .venv/bin/python bench/bench_rank_start.py [N] [--before REV]

Every torchrun worker nbgpu starts is ``python -m nbgpu.rank.worker``: before the user's
first line it imports its modules, redirects its output into the rank's log, registers its
stack dumps, starts the flight-record thread and the memory sampler. Bare torchrun's worker
is the script itself. Both are timed here outside torchrun (one process, no rendezvous),
so the difference is the worker's alone: ``first line`` from the spawn to the script's
first statement (it writes ``time.time()`` to a file), ``whole`` to the process's exit.
``--before REV`` adds the worker of another commit (a temporary git worktree, first on
``PYTHONPATH``), in the same alternating rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import PYTHON, REPO, Case, alternate, prime_bytecode

SCRIPT = "import os, time\nopen(os.environ['FIRST_LINE_FILE'], 'w').write(repr(time.time()))\n"
# Spawns the case, then prints (first line, whole) in ms from the spawn: its own start
# is outside both figures.
TIMER = (
    "import os, subprocess, sys, time\n"
    "started = time.time()\n"
    "subprocess.run(sys.argv[1:], check=True)\n"
    "ended = time.time()\n"
    "first = float(open(os.environ['FIRST_LINE_FILE']).read())\n"
    "print(f'{(first - started) * 1000:.2f} {(ended - started) * 1000:.2f}')\n"
)


def run_dir(root: Path, name: str, script: Path) -> Path:
    """What a rank's worker reads before the user's code: a cold run of *script*."""
    path = root / name
    path.mkdir(mode=0o700)
    spec = {"script": str(script), "script_args": [], "pull": [], "mem_sample_s": 0.1}
    (path / "bootstrap.json").write_text(json.dumps(spec), encoding="utf-8")
    return path


def case(name: str, argv: list[str], root: Path, env: dict[str, str]) -> Case:
    first = str(root / f"{name}.first")
    return Case(name, [PYTHON, "-c", TIMER, *argv], {**env, "FIRST_LINE_FILE": first})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("n", nargs="?", type=int, default=21)
    parser.add_argument("--before", help="a commit whose worker is timed alongside")
    args = parser.parse_args()
    prime_bytecode()
    with tempfile.TemporaryDirectory(prefix="nbgpu-bench-rank-") as tmp:
        root = Path(tmp)
        script = root / "script.py"
        script.write_text(SCRIPT, encoding="utf-8")
        rank = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
        cases = [case("python script.py", [PYTHON, "-P", str(script)], root, {})]
        # -P: no working directory on sys.path (the repository, from which the harness runs
        # every case), so that --before's tree on PYTHONPATH is the nbgpu imported.
        worker = [PYTHON, "-P", "-m", "nbgpu.rank.worker"]
        here = {**rank, "NBGPU_RUN_DIR": str(run_dir(root, "now", script))}
        cases.append(case("nbgpu worker, this tree", worker, root, here))
        if args.before:
            tree = root / "before"
            subprocess.run(
                [
                    "git",
                    "-C",
                    str(REPO),
                    "worktree",
                    "add",
                    "-q",
                    "--detach",
                    str(tree),
                    args.before,
                ],
                check=True,
            )
            then = {**rank, "NBGPU_RUN_DIR": str(run_dir(root, "then", script))}
            then["PYTHONPATH"] = str(tree)
            cases.append(case(f"nbgpu worker, {args.before}", worker, root, then))
        try:
            rows = alternate(cases, args.n, warmup=2)
        finally:
            if args.before:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                               check=False)  # fmt: skip
    print(f"\n### A rank's start, {args.n} alternating rounds (ms from the spawn)\n")
    print("| case | first line: median | min-max | whole process: median | min-max |")
    print("|---|---:|---:|---:|---:|")
    for row in rows.values():
        first, whole = zip(*(map(float, out.split()) for out in row.stdouts), strict=True)
        print(
            f"| {row.name} | {statistics.median(first):.1f} | {min(first):.1f}-{max(first):.1f} "
            f"| {statistics.median(whole):.1f} | {min(whole):.1f}-{max(whole):.1f} |"
        )


if __name__ == "__main__":
    sys.exit(main())
