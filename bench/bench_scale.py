"""What the notebook side costs as ranks multiply (for docs/scale-out.md).

For 16, 128, 512 and 4096 ranks (2, 16, 64 and 512 nodes of 8 GPUs), measured here on
real files and the real classes:

1. one poll of the rank logs (``LogTail.poll``: a read on each file, 20 times a second)
   while every rank has written one new line: every log each poll on descriptors kept
   open (the anchor, as the follow loop did), and as it does now: at most 256 a poll, the
   logs taking turns, each opened for its read beyond 256 ranks;
2. what one tick of the screen writer sends when every rank printed five lines in that
   tick, against the 200 kB/s budget that keeps Jupyter under its rate limit: over the
   budget each rank is cut to a count and its newest line (the anchor, measured in the
   same run), and beyond 64 ranks the per-node view sends a line per node, beyond 64
   nodes one line for the job.

    .venv/bin/python bench/bench_scale.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nbgpu.launch import streams
from nbgpu.launch.streams import MAX_LOGS_PER_POLL, LogTail, ScreenWriter, in_turn

LINE = "step 1200 loss=0.4312 lr=3.0e-04 tokens/s=91234 mem=61.2G " * 2 + "\n"


def poll_cost(ranks: int, rounds: int = 20, *, in_turns: bool = False) -> float:
    """Median ms of one poll; ``in_turns``: as the follow loop polls now (256 logs a poll,
    taking turns), else every log each poll (the anchor, as before)."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp) / f"rank{r}.log" for r in range(ranks)]
        for path in paths:
            path.write_text("")
        # As the follow loop does now: beyond 256 ranks no descriptor is kept per rank.
        keep_open = not in_turns or ranks <= MAX_LOGS_PER_POLL
        tails = [LogTail(p, keep_open=keep_open) for p in paths]
        handles = [p.open("a", encoding="utf-8") for p in paths]
        times = []
        cursor = 0
        try:
            for _ in range(rounds):
                for h in handles:
                    h.write(LINE)
                    h.flush()
                started = time.perf_counter()
                if in_turns:
                    turn, cursor = in_turn(len(tails), cursor)
                    for index in turn:
                        tails[index].poll()
                else:
                    for tail in tails:
                        tail.poll()
                times.append((time.perf_counter() - started) * 1000)
        finally:
            for h in handles:
                h.close()
    return statistics.median(times)


def tick_bytes(ranks: int, *, per_rank_only: bool = False) -> int:
    """Bytes of one busy tick; ``per_rank_only``: as before the per-node view (a line per
    rank however many ranks there are), the anchor in the same run."""
    saved = streams.MAX_CUT_LINES
    if per_rank_only:
        streams.MAX_CUT_LINES = 10**9
    try:
        return _tick_bytes(ranks)
    finally:
        streams.MAX_CUT_LINES = saved


def _tick_bytes(ranks: int) -> int:
    sent: list[str] = []
    writer = ScreenWriter(sent.append)
    writer._tokens = 0  # a tick in the middle of a busy run: the budget is spent
    for r in range(ranks):
        writer.add(f"n{r // 8}/rank{r}", [LINE.rstrip("\n")] * 5)
    writer.flush()
    return sum(len(s.encode()) for s in sent)


def main() -> None:
    print(
        "| ranks (nodes x 8) | one poll, every log | one poll, logs in turn | "
        "busy tick, a line per rank | busy tick, per-node view | ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for ranks in (16, 128, 512, 4096):
        every = poll_cost(ranks)
        turns = poll_cost(ranks, in_turns=True)
        before = tick_bytes(ranks, per_rank_only=True)
        after = tick_bytes(ranks)
        print(
            f"| {ranks} ({ranks // 8} nodes) | {every:.2f} ms ({every * 20 / 10:.1f} % of a "
            f"core at 20 Hz) | {turns:.2f} ms ({turns * 20 / 10:.1f} %) | "
            f"{before / 1000:.1f} kB | {after / 1000:.1f} kB | {after / before:.3f} |"
        )
    print("budget: 20 kB per 0.1 s tick (200 kB/s); logs in turn: at most 256 read a poll")


if __name__ == "__main__":
    main()
