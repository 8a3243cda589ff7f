"""Diagnose a 200 MB training log: wall time and peak memory (budget: < 5 s, constant memory).

    .venv/bin/python bench/bench_diagnose.py [--mb 200] [--n 3]
    .venv/bin/python bench/bench_diagnose.py --density 0,1/1000,1/10,1 [--mb 200] [--n 3] [--fresh]

Self-contained: writes a realistic log into a temporary directory - four ranks'
interleaved ``[rankN]:`` output (loss lines, ``\\r`` tqdm bars, warnings with "Error" in
them, and an ``NCCL INFO`` line every fifth line as ``NCCL_DEBUG=INFO`` prints) ending in
rank 2's CUDA OOM buried under the other ranks' NCCL timeouts and torchrun's
ChildFailedError banner - then runs ``nbgpu.diagnose`` on it
in a fresh interpreter per run, alternating with ``grep -E`` for the same trigger
words over the same file (one C pass: the floor any scan pays), in the same run
(so peak RSS is the diagnosis' own, from
``RUSAGE_CHILDREN``). A 20 MB log is diagnosed too: equal peak memory for 20 and
200 MB shows the memory does not grow with the log. Prints a Markdown table; nothing
here fails on a slow number (OK/OVER is printed next to the budget).

``--density`` writes one 200 MB log per trigger density instead: the fraction of filler
lines (loss lines, bars, NCCL chatter) that carry a trigger word and are still not the
failure - a loss line with a field named ``eval_error``, DDP's "This is not an error"
UserWarning repeated by every rank, a retried request's traceback logged by one rank -
as users' logs look at their worst. Each density is timed next to ``grep -E`` on the
same file and judged against both budgets: under 5 s and within 40x ``grep -E``.
``--fresh`` makes every such line new text (wandb's upload error naming a file no earlier
line named): no two alike, so none is routine output.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUDGET_S = 5.0
BUDGET_GREP_RATIO = 40.0  # diagnose may take at most this many times grep -E
MB = 1024 * 1024

_CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
import nbgpu.diagnose as d
t1 = time.perf_counter()
r = d.diagnose(sys.argv[1])
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "diagnose_s": t2 - t1, "cause": r.cause,
                  "rank": r.failed_rank, "lines": sum(s.lines for s in r.sources)}))
"""

_FAILURE = [
    "[default2]:Traceback (most recent call last):",
    '[default2]:  File "/workspace/train.py", line 214, in <module>',
    "[default2]:    main()",
    '[default2]:  File "/workspace/train.py", line 188, in main',
    "[default2]:    loss.backward()",
    (
        "[default2]:torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.50 GiB. GPU 2 has "
        "a total capacity of 44.34 GiB of which 1.02 GiB is free."
    ),
    (
        "[default0]:[rank0]:[E1206 18:44:12.715298746 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog "
        "caught collective operation timeout: WorkNCCL(SeqNum=7753, OpType=ALLREDUCE, NumelIn=1, "
        "NumelOut=1, Timeout(ms)=600000) ran for 600061 milliseconds before timing out."
    ),
    (
        "[default1]:[rank1]:[E1206 18:44:12.755262105 ProcessGroupNCCL.cpp:607] [Rank 1] Watchdog "
        "caught collective operation timeout: WorkNCCL(SeqNum=7753, OpType=ALLREDUCE, NumelIn=1, "
        "NumelOut=1, Timeout(ms)=600000) ran for 600099 milliseconds before timing out."
    ),
    (
        "W1206 18:44:13.001000 4242 torch/distributed/elastic/multiprocessing/api.py:897] Sending "
        "process 4301 closing signal SIGTERM"
    ),
    (
        "E1206 18:44:14.102000 4242 torch/distributed/elastic/multiprocessing/api.py:869] failed "
        "(exitcode: 1) local_rank: 2 (pid: 4303) of binary: /usr/bin/python3"
    ),
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    "============================================================",
    "train.py FAILED",
    "------------------------------------------------------------",
    "Root Cause (first observed failure):",
    "[0]:",
    "  time      : 2024-12-06_18:44:13",
    "  host      : node-1",
    "  rank      : 2 (local_rank: 2)",
    "  exitcode  : 1 (pid: 4303)",
    "  error_file: <N/A>",
    "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
    "============================================================",
]


_NCCL_CHATTER = (
    "node-1:{pid}:{tid} [{r}] NCCL INFO Channel {c:02d}/24 : {r}[{r}] -> {n}[{n}] via P2P/IPC/read",
    "node-1:{pid}:{tid} [{r}] NCCL INFO Connected all rings",
    (
        "node-1:{pid}:{tid} [{r}] NCCL INFO comm 0x55d1c{r}a0 rank {r} nRanks 4 nNodes 1 localRanks 4 "
        "localRank {r} MNNVL 0"
    ),
    "node-1:{pid}:{tid} [{r}] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.{r}<0>",
    "node-1:{pid}:{tid} [{r}] NCCL INFO Using network Socket",
    (
        "node-1:{pid}:{tid} [{r}] NCCL INFO ncclCommInitRank comm 0x55d1c{r}a0 rank {r} nranks 4 "
        "cudaDev {r} nvmlDev {r} busId {r}0000 commId 0x9c5e - Init COMPLETE"
    ),
    (
        "node-1:{pid}:{tid} [{r}] NCCL INFO AllReduce: opCount {c:x} sendbuff 0x7f2a send count 1 "
        "datatype 7 op 0 root 0 comm 0x55d1c{r}a0 [nranks=4] stream 0x55d2"
    ),
)
# Warnings with "Error" in them that are not the failure (what wandb, urllib3 and
# torch print on a long run): the scanner must look at them and move on.
_NOISY_WARNINGS = (
    "wandb: Network error (ConnectionError), entering retry loop.",
    (
        "WARNING:urllib3.connectionpool:Retrying (Retry(total=4, connect=None, read=None, "
        "redirect=None, status=None)) after connection broken by 'NewConnectionError(...: Failed "
        "to establish a new connection: [Errno 111] Connection refused')': /api/runs"
    ),
    (
        "/usr/lib/python3/site-packages/torch/utils/checkpoint.py:91: UserWarning: None of the "
        "inputs have requires_grad=True. Gradients will be None"
    ),
    (
        "[W reducer.cpp:1300] Warning: find_unused_parameters=True was specified in DDP constructor, "
        "but did not find any unused parameters in the forward pass. (function operator())"
    ),
)


# Filler that carries a trigger word and is still not the failure (``--density``).
_DDP_STRIDES = (
    "/usr/lib/python3/site-packages/torch/autograd/graph.py:825: UserWarning: Grad strides do "
    "not match bucket view strides. This may indicate grad was not created according to the "
    "gradient layout contract, or that the param's strides changed since DDP was constructed. "
    "This is not an error, but may impair performance."
)
_RETRY_TRACEBACK = (
    "Traceback (most recent call last):",
    '  File "/usr/lib/python3/site-packages/wandb/sdk/internal/internal_api.py", line 212, in execute',
    "    return self.client.execute(*args, **kwargs)",
    (
        "requests.exceptions.ReadTimeout: HTTPSConnectionPool(host='api.wandb.ai', port=443): "
        "Read timed out. (read timeout=20)"
    ),
)


def _triggered(kind: int, rank: int, step: int) -> str:
    """A filler line with a trigger word in it (a traceback: several lines)."""
    prefix = f"[rank{rank}]:"
    if kind == 0:  # the same loss line, one field renamed
        return (
            f"{prefix}step {step} loss={2.5 - (step % 1000) / 1000:.4f} lr=3.0e-04 "
            f"eval_error={(step % 13) / 100:.2f} tokens/s={11800 + step % 500} mem=40.1GiB\n"
        )
    if kind == 1:  # every rank prints the same warning
        return "".join(f"[rank{r}]:{_DDP_STRIDES}\n" for r in range(4))
    if kind == 3:  # --fresh: new text every time (a file name no earlier line had)
        name = "".join(chr(97 + int(d)) for d in f"{step:07d}")
        return f'{prefix}wandb: ERROR Error uploading "media/images/sample_{name}.png", retrying\n'
    return "".join(f"{prefix}{line}\n" for line in _RETRY_TRACEBACK)


def write_log(
    path: Path, size_bytes: int, density: float | None = None, *, fresh: bool = False
) -> int:
    """A training log of about ``size_bytes``, failing at the end; returns its size.

    What ``NCCL_DEBUG=INFO`` runs look like: every fifth line NCCL INFO chatter, four
    ranks interleaved with ``[rankN]:`` prefixes, tqdm bars redrawn with ``\r``, and now
    and then a warning with "Error" in it that is not the failure. With ``density`` (0 to
    1) that fraction of the filler lines is replaced by lines with a trigger word in them
    (the rotation of :func:`_triggered`), and the occasional warnings are left out, so
    density 0 has no trigger before the failure.
    """
    every = round(1 / density) if density else 0
    filler = 0
    triggered = 0

    def line(text: str, rank: int, step: int) -> str:
        nonlocal filler, triggered
        filler += 1
        if every and filler % every == 0:
            triggered += 1
            return _triggered(3 if fresh else triggered % 3, rank, step)
        return text

    with path.open("w", encoding="utf-8") as out:
        step = 0
        written = 0
        block: list[str] = []
        while written < size_bytes:
            rank = step % 4
            block.append(
                line(
                    f"[rank{rank}]:step {step} loss={2.5 - (step % 1000) / 1000:.4f} lr=3.0e-04 "
                    f"grad_norm={(step % 13) / 10:.2f} tokens/s={11800 + step % 500} mem=40.1GiB\n",
                    rank,
                    step,
                )
            )
            if step % 3 == 0:  # with the loss line and the bar: one line in five
                chatter = _NCCL_CHATTER[(step // 4) % len(_NCCL_CHATTER)]
                text = chatter.format(
                    pid=4301 + rank, tid=4400 + rank, r=rank, n=(rank + 1) % 4, c=step % 24
                )
                block.append(line(text + "\n", rank, step))
            if step % 4 == 0:
                bars = "".join(
                    f"\r {p:3d}%|{'#' * (p // 10):<10}| {p * 10}/1000 [01:2{p % 10}<01:40,  5.4{p % 10}it/s]"
                    for p in range(0, 100, 20)
                )
                block.append(line(f"[rank{rank}]:{bars}\n", rank, step))
            if step % 5000 == 0 and density is None:
                warning = _NOISY_WARNINGS[(step // 5000) % len(_NOISY_WARNINGS)]
                block.append(f"[rank{rank}]:{warning}\n")
            step += 1
            # A block of triggered filler is long: flush sooner, so the size stays near.
            if len(block) >= (4096 if density is None else 256):
                text = "".join(block)
                out.write(text)
                written += len(text)
                block = []
        out.write("".join(block))
        out.write("\n".join(_FAILURE) + "\n")
    return path.stat().st_size


def run_once(log: Path) -> dict[str, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(log)],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = wall
    result["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    # ru_maxrss of children is the largest child so far (KiB on Linux): runs are
    # ordered small log first, so a growing figure would show growth with the log.
    result["maxrss_mib"] = after.ru_maxrss / 1024
    return result


def _grep_pattern() -> str:
    """The catalog's trigger words as one ``grep -E`` alternation (the scan's floor)."""
    from nbgpu.diagnose.catalog import TRIGGERS  # noqa: PLC0415

    return "|".join(t.decode() for t in TRIGGERS)


def grep_once(log: Path) -> dict[str, float]:
    """``grep -E -c`` for the same trigger words: one pass over the file in C."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run(
        ["grep", "-E", "-c", _grep_pattern(), str(log)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "wall_s": wall,
        "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "matches": float(proc.stdout.strip() or 0),
    }


def _density(text: str) -> float:
    """``0``, ``0.1``, ``1/1000`` or ``1`` (a fraction of the filler lines)."""
    try:
        num, _, den = text.partition("/")
        value = float(num) / float(den) if den else float(num)
    except (ValueError, ZeroDivisionError):
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(
            f"density {text!r}: expected a fraction from 0 to 1, like 0, 1/1000, 0.1 or 1"
        )
    return value


def _label(density: float) -> str:
    if density in (0.0, 1.0):
        return "0" if density == 0.0 else "every line"
    return f"1 in {round(1 / density):,}"


def _timed(log: Path, n: int) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    runs, greps = [], []
    for _ in range(n):  # alternate, so both see the same page cache and load
        greps.append(grep_once(log))
        runs.append(run_once(log))
    return runs, greps


def main_density(densities: list[float], n: int = 3, mb: int = 200, *, fresh: bool = False) -> None:
    """One log of ``mb`` MB per trigger density, each timed next to ``grep -E``."""
    n = max(1, min(n, 5))
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"diagnose by trigger density: {mb} MB logs, {n} run(s) each, fresh interpreter per "
        f"run, alternating with grep -E; load before: {load}\n"
    )
    print(
        "| density | lines | lines grep matches | diagnose (median, range) | `grep -E` (median) | "
        "ratio (median, worst) | peak RSS | cause / rank | < 5 s and < 40× |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="nbgpu-bench-diagnose-") as tmp:
        for density in densities:
            log = Path(tmp) / "train.log"
            actual = write_log(log, mb * MB, density, fresh=fresh)
            runs, greps = _timed(log, n)
            times = [r["diagnose_s"] for r in runs]
            ratios = [r["diagnose_s"] / g["wall_s"] for r, g in zip(runs, greps, strict=True)]
            med, grep = statistics.median(times), statistics.median(g["wall_s"] for g in greps)
            ok = max(times) < BUDGET_S and max(ratios) < BUDGET_GREP_RATIO
            first = runs[0]
            print(
                f"| {_label(density)}{', new text each' if fresh else ''} | {int(first['lines']):,} | {int(greps[0]['matches']):,} | "
                f"{med:.2f} s ({min(times):.2f}-{max(times):.2f}) | {grep:.2f} s | "
                f"{statistics.median(ratios):.1f}×, {max(ratios):.1f}× | "
                f"{max(r['maxrss_mib'] for r in runs):.0f} MiB | {first['cause']} / {first['rank']} | "
                f"{'OK' if ok else 'OVER'} ({actual / MB:.0f} MB) |",
                flush=True,
            )
            log.unlink()


def main(n: int = 3, mb: int = 200) -> None:
    """Print the table; ``n`` timed runs per log size (run_all passes its --n)."""
    n = max(1, min(n, 5))  # each run reads the whole file: a few runs are enough
    with tempfile.TemporaryDirectory(prefix="nbgpu-bench-diagnose-") as tmp:
        rows = []
        for size in (max(1, mb // 10), mb):
            log = Path(tmp) / f"train-{size}mb.log"
            actual = write_log(log, size * MB)
            runs, greps = _timed(log, n)
            rows.append((size, actual, runs, greps))
        print(
            f"diagnose: {n} run(s) per size, fresh interpreter per run; budget < {BUDGET_S:.0f} s for {mb} MB\n"
        )
        print(
            "| log | lines | trigger lines (grep) | diagnose (median) | `grep -E` (median) | "
            "ratio | diagnose cpu | peak RSS | cause / rank | budget |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for size, actual, runs, greps in rows:
            med = statistics.median(r["diagnose_s"] for r in runs)
            grep = statistics.median(g["wall_s"] for g in greps)
            cpu = statistics.median(r["cpu_s"] for r in runs)
            rss = max(r["maxrss_mib"] for r in runs)
            first = runs[0]
            verdict = "OK" if med < BUDGET_S else "OVER"
            print(
                f"| {actual / MB:.0f} MB | {int(first['lines']):,} | {int(greps[0]['matches']):,} | "
                f"{med:.2f} s | {grep:.2f} s | {med / grep:.1f}× | {cpu:.2f} s | {rss:.0f} MiB | "
                f"{first['cause']} / {first['rank']} | {verdict if size == mb else '-'} |"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3, help="timed runs per log size (default 3)")
    parser.add_argument(
        "--mb", type=int, default=200, help="size of the big log in MB (default 200)"
    )
    parser.add_argument(
        "--density",
        type=lambda text: [_density(part) for part in text.split(",")],
        help="comma-separated trigger densities, one log each (e.g. 0,1/1000,1/10,1)",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="with --density: every trigger line is new text (an upload error naming a new file)",
    )
    args = parser.parse_args()
    if args.density is None:
        main(n=args.n, mb=args.mb)
    else:
        main_density(args.density, n=args.n, mb=args.mb, fresh=args.fresh)
