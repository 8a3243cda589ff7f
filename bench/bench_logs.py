"""Log throughput: 2 ranks × 200,000 lines each, bare torchrun to files vs nbgpu.

Every rank prints the same deterministic mix (see ``LINES_SOURCE``): plain ASCII
lines, one in ten with multi-byte UTF-8 (``ünïcode ✓ 日本``), one in a hundred a
tqdm-style bar (five ``\\r`` updates, each written and flushed on its own, then the
newline), and a final ``DONE`` line. Cases, alternating:

a. bare ``torchrun --standalone --nproc-per-node 2 --redirects 3 --log-dir D`` — each
   rank's stdout is its own file, as ``python script.py > file``: Python
   block-buffers, the fastest honest baseline
a'. the same with ``PYTHONUNBUFFERED=1`` (what nbgpu's ranks run with): splits
   nbgpu's cost into "unbuffered writes" and "streaming"
b. ``nbgpu.torchrun(code, 2, write=collector)`` in a fresh interpreter; the collector
   timestamps every on-screen write

Checked on every run: the per-rank logs on disk hold every line, exactly (the
``\\r`` updates of a bar resolve to its final text), valid UTF-8; for nbgpu also that
each rank's ``DONE`` line reached the screen. Reported for nbgpu: display messages
(``ScreenWriter.writes``) and bytes shown per second over the run, the peak over any
3 s window (jupyter_server's window), the longest gap between two screen writes while
the ranks were printing, and lines shown / elided. Then one run of ``%%torchrun 2``
in a real kernel, counting the iopub ``stream`` messages and bytes the client got.

    .venv/bin/python bench/bench_logs.py [N]       # N timed rounds (default 5)
"""

from __future__ import annotations

import contextlib
import itertools
import json
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_launch import (
    TAG_ENV,
    Cell,
    Timed,
    kernel,
    leak_check,
    run_subprocess,
)
from harness import PYTHON, Case, Row, child_env, print_ratios, print_table, run_once

BUDGET_RATIO = 1.25
BUDGET_MSGS_PER_S = 10.0
BUDGET_BYTES_PER_S = 200_000
SERVER_MSGS_PER_S = 1000  # jupyter_server's iopub_msg_rate_limit
SERVER_BYTES_PER_S = 1_000_000  # iopub_data_rate_limit (stream bytes)
SERVER_WINDOW_S = 3.0
NPROC = 2
LINES = 200_000

# Shared by the ranks (written into the script) and by the checker (exec'd here).
LINES_SOURCE = """\
def segments(rank, i):
    \"\"\"The writes that make line *i* of *rank*; the last one ends with a newline.\"\"\"
    if i == LINES - 1:
        return [f"rank {rank} DONE {LINES} lines \\u2713\\n"]
    if i % 100 == 7:  # a tqdm-style bar: each update rewrites the line, then a newline
        bars = [f"\\rrank {rank} bar {i:06d} {p:3d}%|{'#' * (p // 10):<10}|" for p in (0, 25, 50, 75, 100)]
        return [*bars, "\\n"]
    if i % 10 == 3:
        return [f"rank {rank} line {i:06d} \\u00fcn\\u00efcode \\u2713 \\u65e5\\u672c loss={i / 7:.4f}\\n"]
    return [f"rank {rank} line {i:06d} plain ascii payload abcdefghijklmnopqrstuvwxyz\\n"]
"""

RANK_MAIN = """\
import os
import sys

rank = int(os.environ["RANK"])
out = sys.stdout
for i in range(LINES):
    parts = segments(rank, i)
    if len(parts) == 1:
        print(parts[0][:-1])  # as a program prints: print(text)
    else:
        for part in parts:  # as tqdm does: write, flush, per update
            out.write(part)
            out.flush()
"""

# Live latency: a burst over the screen budget, then one line every PACE_S seconds,
# each carrying the time it was written. nbgpu promises < 200 ms from write to screen.
LIVE_CODE = """\
import os
import time

rank = int(os.environ["RANK"])
for i in range(BURST):  # a config dump / warning flood: more than the screen budget
    print(f"rank {rank} burst {i:06d} " + "x" * 60)
for i in range(PACED):  # then training-loop progress, ten lines a second
    print(f"rank {rank} paced {i:03d} t={time.time():.6f}")
    time.sleep(PACE_S)
print(f"rank {rank} DONE live")
"""
BURST = 4000  # x ~85 bytes = ~340 KB per rank, the screen budget is 200 KB/s
PACED = 30
PACE_S = 0.1
LATENCY_BUDGET_S = 0.2

# nbgpu in a fresh interpreter: the same start-up cost as torchrun's own interpreter.
DRIVER = """\
import json, sys, time
import nbgpu

stamps = []
chunks = []

def collect(text):
    stamps.append((time.time(), len(text.encode("utf-8"))))
    chunks.append(text)

run = nbgpu.torchrun(CODE, NPROC, write=collect)
w = run.writer
with open(SHOWN, "w", encoding="utf-8") as f:
    json.dump([[t, c] for (t, _), c in zip(stamps, chunks)], f)
print(json.dumps({
    "dir": str(run.dir), "state": run.state,
    "started_at": run.started_at, "first_output_at": run.first_output_at,
    "ended_at": run.ended_at, "writes": w.writes, "lines_shown": w.lines_shown,
    "lines_not_shown": w.lines_not_shown, "stamps": stamps,
}))
"""


def _namespace() -> dict[str, Any]:
    ns: dict[str, Any] = {"LINES": LINES}
    exec(LINES_SOURCE, ns)  # noqa: S102  (our own constant source, shared with the ranks)
    return ns


def rank_code() -> str:
    return f"LINES = {LINES}\n" + LINES_SOURCE + "\n" + RANK_MAIN


def resolve(line: str) -> str:
    """What a terminal shows for one line: the text after its last ``\\r``."""
    line = line.removesuffix("\r")
    return line.rsplit("\r", 1)[-1]


def expected_lines(rank: int) -> list[str]:
    segments = _namespace()["segments"]
    return [resolve("".join(segments(rank, i))[:-1]) for i in range(LINES)]


def expected_lines_last(rank: int) -> str:
    return str(_namespace()["segments"](rank, LINES - 1)[0][:-1])


def check_log(path: Path, expected: list[str]) -> str | None:
    """None if *path* holds exactly the expected lines (after ``\\r`` resolution)."""
    try:
        text = path.read_bytes().decode("utf-8")  # strict: a broken character fails
    except (OSError, UnicodeDecodeError) as exc:
        return f"{path.name}: {exc}"
    if not text.endswith("\n"):
        return f"{path.name}: does not end with a newline (last line cut?)"
    lines = [resolve(line) for line in text[:-1].split("\n")]
    if lines == expected:
        return None
    lost = len(expected) - len(lines)
    first_bad = next(
        (i for i, (a, b) in enumerate(zip(lines, expected, strict=False)) if a != b), None
    )
    return (
        f"{path.name}: {len(lines)} lines, expected {len(expected)} ({lost} lost); "
        f"first difference at line {first_bad}"
    )


# -- one run of each kind ------------------------------------------------------------


@dataclass
class LogRun:
    timed: Timed
    stats: dict[str, Any] = field(default_factory=dict)


def run_bare(work: Path, script: Path, env: dict[str, str], index: int) -> LogRun:
    log_dir = work / f"bare-logs-{index}"
    argv = [
        PYTHON,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(NPROC),
        "--redirects",
        "3",
        "--log-dir",
        str(log_dir),
        str(script),
    ]
    timed, stderr, code = run_subprocess(argv, env, work)
    if code != 0:
        raise RuntimeError(f"bare torchrun: exit code {code}: {stderr[-1500:]}")
    problems = []
    for rank in range(NPROC):
        found = sorted(log_dir.glob(f"*/attempt_0/{rank}/stdout.log"))
        if len(found) != 1:
            problems.append(f"rank {rank}: {len(found)} stdout.log files under {log_dir}")
            continue
        problem = check_log(found[0], EXPECTED[rank])
        if problem:
            problems.append(f"rank {rank}: {problem}")
    shutil.rmtree(log_dir, ignore_errors=True)
    if problems:
        raise RuntimeError("bare torchrun lost output: " + "; ".join(problems))
    return LogRun(timed)


def _check_nbgpu_logs(run_dir: Path) -> list[str]:
    problems = []
    for rank in range(NPROC):
        problem = check_log(run_dir / f"rank{rank}.log", EXPECTED[rank])
        if problem:
            problems.append(f"rank {rank}: {problem}")
    return problems


def _missing_last_lines(shown: str) -> list[int]:
    return [r for r in range(NPROC) if expected_lines_last(r) not in shown]


def run_nbgpu(work: Path, env: dict[str, str], index: int) -> LogRun:
    shown_path = work / f"shown-{index}.txt"
    driver = f"CODE = {rank_code()!r}\nNPROC = {NPROC}\nSHOWN = {str(shown_path)!r}\n" + DRIVER
    timed, stderr, code = run_subprocess([PYTHON, "-c", driver], env, work)
    if code != 0:
        raise RuntimeError(f"nbgpu.torchrun: exit code {code}: {stderr[-1500:]}")
    stats = json.loads(timed.text.strip().splitlines()[-1])
    run_dir = Path(stats["dir"])
    problems = _check_nbgpu_logs(run_dir)
    shown = "".join(text for _, text in json.loads(shown_path.read_text(encoding="utf-8")))
    missing = _missing_last_lines(shown)
    if missing:
        problems.append(f"last line of rank(s) {missing} not on screen")
    if stats["state"] != "succeeded":
        problems.append(f"run state {stats['state']}")
    if problems:
        raise RuntimeError(f"nbgpu ({run_dir}): " + "; ".join(problems))
    stats["shown_bytes"] = len(shown.encode("utf-8"))
    shutil.rmtree(run_dir, ignore_errors=True)
    shown_path.unlink()
    return LogRun(timed, stats)


def run_live(work: Path, env: dict[str, str]) -> dict[str, Any]:
    """One nbgpu run of LIVE_CODE: when did each paced line reach the screen?"""
    shown_path = work / "shown-live.json"
    code = f"BURST = {BURST}\nPACED = {PACED}\nPACE_S = {PACE_S}\n" + LIVE_CODE
    driver = f"CODE = {code!r}\nNPROC = {NPROC}\nSHOWN = {str(shown_path)!r}\n" + DRIVER
    timed, stderr, exit_code = run_subprocess([PYTHON, "-c", driver], env, work)
    if exit_code != 0:
        raise RuntimeError(f"nbgpu.torchrun (live): exit code {exit_code}: {stderr[-1500:]}")
    stats = json.loads(timed.text.strip().splitlines()[-1])
    chunks = json.loads(shown_path.read_text(encoding="utf-8"))
    shutil.rmtree(stats["dir"], ignore_errors=True)
    latencies = [
        stamp - float(line.rsplit(" t=", 1)[1])
        for stamp, text in chunks
        for line in text.splitlines()
        if " paced " in line and " t=" in line
    ]
    total = NPROC * PACED
    return {
        "paced": total,
        "shown": len(latencies),
        "on_time": sum(1 for x in latencies if x <= LATENCY_BUDGET_S),
        "median_s": statistics.median(latencies) if latencies else float("nan"),
        "max_s": max(latencies, default=float("nan")),
        "writes": stats["writes"],
        "duration_s": stats["ended_at"] - stats["started_at"],
        "gap_s": longest_gap([(float(t), 0) for t, _ in chunks], None),
    }


# -- figures -------------------------------------------------------------------------


def peak_rate(stamps: list[tuple[float, int]], window_s: float) -> tuple[float, float]:
    """(messages/s, bytes/s) over the busiest *window_s* window starting at a message."""
    best_msgs, best_bytes = 0.0, 0.0
    times = [t for t, _ in stamps]
    for i, start in enumerate(times):
        j = i
        total = 0
        while j < len(times) and times[j] < start + window_s:
            total += stamps[j][1]
            j += 1
        best_msgs = max(best_msgs, (j - i) / window_s)
        best_bytes = max(best_bytes, total / window_s)
    return best_msgs, best_bytes


def longest_gap(stamps: list[tuple[float, int]], until: float | None) -> float:
    """The longest time between two screen writes up to *until* (ranks still printing)."""
    times = [t for t, _ in stamps if until is None or t <= until]
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def screen_figures(stats: dict[str, Any]) -> dict[str, float]:
    duration = stats["ended_at"] - stats["started_at"]
    stamps = [(float(t), int(n)) for t, n in stats["stamps"]]
    peak_msgs, peak_bytes = peak_rate(stamps, SERVER_WINDOW_S)
    first = stats["first_output_at"] or stats["started_at"]
    # The ranks print until about the last write; the final write is the summary tail.
    last_live = stamps[-2][0] if len(stamps) > 1 else None
    return {
        "duration_s": duration,
        "writes": stats["writes"],
        "msgs_per_s": stats["writes"] / duration,
        "bytes_per_s": stats["shown_bytes"] / duration,
        "shown_bytes": stats["shown_bytes"],
        "peak3_msgs_per_s": peak_msgs,
        "peak3_bytes_per_s": peak_bytes,
        "lines_shown": stats["lines_shown"],
        "lines_not_shown": stats["lines_not_shown"],
        "first_output_s": first - stats["started_at"],
        "longest_gap_s": longest_gap(stamps, last_live),
        "printing_s": (last_live or first) - first,
    }


def kernel_figures(cell: Cell) -> dict[str, float]:
    stamps = [(t, len(text.encode("utf-8"))) for t, _, text in cell.streams]
    peak_msgs, peak_bytes = peak_rate(stamps, SERVER_WINDOW_S)
    total = sum(n for _, n in stamps)
    return {
        "wall_s": cell.wall_s,
        "stream_msgs": len(stamps),
        "iopub_msgs": cell.messages,
        "stream_bytes": total,
        "msgs_per_s": len(stamps) / cell.wall_s,
        "bytes_per_s": total / cell.wall_s,
        "peak3_msgs_per_s": peak_msgs,
        "peak3_bytes_per_s": peak_bytes,
        "longest_gap_s": longest_gap(stamps, stamps[-2][0] if len(stamps) > 1 else None),
    }


def _verdict(value: float, budget: float) -> str:
    return "OK" if value <= budget else "OVER"


# -- the benchmark ----------------------------------------------------------------------

EXPECTED: dict[int, list[str]] = {}

CASE_A = "a. bare torchrun, rank stdout → own file (block-buffered)"
CASE_A1 = "a'. same, PYTHONUNBUFFERED=1"
CASE_B = "b. nbgpu.torchrun(code, 2, write=collector)"


def measure(
    n: int, work: Path, tag: str
) -> tuple[dict[str, list[LogRun]], Cell, dict[str, Any], dict[str, Any]]:
    base = child_env({TAG_ENV: tag, "NBGPU_RUNS_DIR": str(work / "runs")})
    base.pop("PYTHONUNBUFFERED", None)
    script = work / "logs.py"
    script.write_text(rank_code(), encoding="utf-8")
    cases = {
        CASE_A: lambda i: run_bare(work, script, base, i),
        CASE_A1: lambda i: run_bare(work, script, {**base, "PYTHONUNBUFFERED": "1"}, i),
        CASE_B: lambda i: run_nbgpu(work, base, i),
    }
    runs: dict[str, list[LogRun]] = {name: [] for name in cases}
    names = list(cases)
    for round_index in range(1 + n):  # one untimed warm-up round
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            result = cases[name](round_index)
            if round_index:
                runs[name].append(result)
    live = run_live(work, base)

    # Once through a real kernel: what a Jupyter client (and jupyter_server) receives.
    kenv = {**base, "IPYTHONDIR": str(work / "ipy"), "NBGPU_RUNS_DIR": str(work / "kruns")}
    with kernel(work, kenv, "logs") as k:
        loaded = k.execute("%load_ext nbgpu")
        if loaded.error:
            raise RuntimeError(f"%load_ext nbgpu failed in the kernel: {loaded.error}")
        cell = k.execute("%%torchrun 2\n" + rank_code(), timeout_s=300)
    if cell.error:
        raise RuntimeError(f"%%torchrun in the kernel: {cell.error}\n{cell.text[-1500:]}")
    run_dirs = sorted((work / "kruns").iterdir())
    kcheck = {
        "disk_problems": _check_nbgpu_logs(run_dirs[-1]) if len(run_dirs) == 1 else ["no run dir"],
        "missing_last": _missing_last_lines(cell.text),
    }
    return runs, cell, kcheck, live


def _row(name: str, rs: list[LogRun], note: str = "") -> Row:
    return Row(
        name,
        [r.timed.wall_s * 1000 for r in rs],
        [r.timed.cpu_s * 1000 for r in rs],
        note=note,
    )


def report(
    runs: dict[str, list[LogRun]], cell: Cell, kcheck: dict[str, Any], live: dict[str, Any]
) -> dict[str, float]:
    bare = _row(CASE_A, runs[CASE_A])
    bare_u = _row(CASE_A1, runs[CASE_A1])
    nb = _row(CASE_B, runs[CASE_B])
    r = nb.median_wall / bare.median_wall
    paired = statistics.median(
        b.timed.wall_s / a.timed.wall_s for a, b in zip(runs[CASE_A], runs[CASE_B], strict=True)
    )
    nb.note = (
        f"wall/bare {r:.2f} (budget {BUDGET_RATIO:.2f}: {_verdict(r, BUDGET_RATIO)}), "
        f"per-round median {paired:.2f}"
    )
    bare.note = "0 lines lost on disk, every run"
    bare_u.note = f"wall/bare {bare_u.median_wall / bare.median_wall:.2f}"
    print_table(
        f"Log throughput: {NPROC} ranks × {LINES:,} lines (medians, alternating)",
        [bare, bare_u, nb],
    )
    print_ratios(
        "Ratios (< 1: faster)",
        [("(b) / (a)", nb, bare), ("(b) / (a')", nb, bare_u), ("(a') / (a)", bare_u, bare)],
    )

    figs = [screen_figures(x.stats) for x in runs[CASE_B]]

    def med(key: str) -> float:
        return statistics.median(f[key] for f in figs)

    print("\n| nbgpu on screen (median of runs) | value | budget |")
    print("|---|---|---|")
    print("| lines lost on disk (every run, both ranks) | 0 | 0 |")
    print(f"| last line of every rank on screen | yes, {len(figs)}/{len(figs)} runs | yes |")
    print(f"| run duration (Run.started_at → ended_at) | {med('duration_s'):.2f} s | |")
    print(f"| display messages (ScreenWriter.writes) | {med('writes'):.0f} | |")
    msgs, rate = med("msgs_per_s"), med("bytes_per_s")
    print(
        f"| display messages / s | {msgs:.1f} | ≤ {BUDGET_MSGS_PER_S:g}: "
        f"{_verdict(msgs, BUDGET_MSGS_PER_S)} |"
    )
    print(
        f"| bytes shown / s | {rate / 1000:.0f} KB/s ({med('shown_bytes') / 1000:.0f} KB) | "
        f"≤ {BUDGET_BYTES_PER_S // 1000} KB/s: {_verdict(rate, BUDGET_BYTES_PER_S)} |"
    )
    print(
        f"| peak 3 s window | {med('peak3_msgs_per_s'):.1f} msg/s, "
        f"{med('peak3_bytes_per_s') / 1000:.0f} KB/s | server limits 1000 msg/s, 1 MB/s |"
    )
    print(
        f"| lines shown / not shown (of {NPROC * LINES:,}) | {med('lines_shown'):,.0f} / "
        f"{med('lines_not_shown'):,.0f} | |"
    )
    print(
        f"| time to first output (Run.first_output_at) | {med('first_output_s') * 1000:.0f} ms | |"
    )
    print(
        f"| longest gap between screen writes while printing | {med('longest_gap_s'):.2f} s "
        f"(ranks printed for {med('printing_s'):.2f} s) | ~0.1 s (flush tick) |"
    )

    print(
        f"\n| live latency: {NPROC} ranks, {BURST:,}-line burst, then {PACED} lines at "
        f"{1 / PACE_S:g}/s each | value | budget |"
    )
    print("|---|---|---|")
    print(
        f"| paced lines on screen within {LATENCY_BUDGET_S * 1000:.0f} ms | "
        f"{live['on_time']} of {live['paced']} | all: "
        f"{'OK' if live['on_time'] == live['paced'] else 'FAIL'} |"
    )
    print(f"| paced lines on screen at all | {live['shown']} of {live['paced']} | |")
    print(
        f"| write → screen latency, median / max | {live['median_s']:.2f} s / "
        f"{live['max_s']:.2f} s | {LATENCY_BUDGET_S:g} s |"
    )
    print(
        f"| screen writes / longest gap between them | {live['writes']} / {live['gap_s']:.2f} s "
        f"(run {live['duration_s']:.1f} s) | |"
    )

    k = kernel_figures(cell)
    print("\n| one %%torchrun 2 cell in a real kernel (client side) | value | limit |")
    print("|---|---|---|")
    print(f"| cell wall (execute_request → idle) | {k['wall_s']:.2f} s | |")
    print(
        f"| iopub stream messages (all iopub but status) | {k['stream_msgs']} ({k['iopub_msgs']}) | |"
    )
    print(
        f"| stream messages / s | {k['msgs_per_s']:.1f} (peak 3 s: {k['peak3_msgs_per_s']:.1f}) | "
        f"{SERVER_MSGS_PER_S} |"
    )
    print(
        f"| stream bytes / s | {k['bytes_per_s'] / 1000:.0f} KB/s (peak 3 s: "
        f"{k['peak3_bytes_per_s'] / 1000:.0f} KB/s; {k['stream_bytes'] / 1000:.0f} KB) | "
        f"{SERVER_BYTES_PER_S // 1000} KB/s |"
    )
    print(f"| longest gap between stream messages | {k['longest_gap_s']:.2f} s | |")
    print(f"| lines lost on disk | {kcheck['disk_problems'] or 0} | 0 |")
    print(f"| last line of every rank received | {not kcheck['missing_last']} | yes |")
    return {
        "ratio": r,
        "msgs_per_s": msgs,
        "bytes_per_s": rate,
        "kernel_msgs_per_s": k["msgs_per_s"],
        "kernel_bytes_per_s": k["bytes_per_s"],
        "live_on_time": live["on_time"],
    }


def main(n: int = 5) -> dict[str, float]:
    run_once(
        Case("prime bytecode", [PYTHON, "-c", "import torch.distributed.run, nbgpu.launch.run"]),
        timeout_s=300,
    )
    for rank in range(NPROC):
        EXPECTED[rank] = expected_lines(rank)
    tag = secrets.token_hex(6)
    work = Path(tempfile.mkdtemp(prefix="nbgpu-bench-logs-"))
    started = time.perf_counter()
    try:
        runs, cell, kcheck, live = measure(n, work, tag)
        figures = report(runs, cell, kcheck, live)
    finally:
        leaked = leak_check(tag)
        with contextlib.suppress(OSError):
            shutil.rmtree(work, ignore_errors=True)
    print(f"\nprocesses left behind (psutil, by this run's tag): {leaked or 'none'}")
    print(f"log benchmark time: {time.perf_counter() - started:.0f} s")
    if leaked:
        raise RuntimeError(f"processes left behind: {leaked}")
    return figures


if __name__ == "__main__":
    main(n=int(sys.argv[1]) if len(sys.argv) > 1 else 5)
