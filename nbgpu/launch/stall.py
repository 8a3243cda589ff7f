"""A job that stopped making progress, noticed and explained without being asked.

The follow loop calls :meth:`StallWatch.check` on every refresh. Once no rank has written
anything for ``--hang-after`` seconds, it asks every rank for its flight record (the
collectives it entered and left; ``nbgpu.rank.worker`` answers from a thread, since a rank
stuck in a collective runs no signal handler). If a collective has been pending that long,
the job is stalled: every rank's Python stack is taken the way ``%gpu_stacks`` takes it (and,
for a rank waiting on its DataLoader, the worker's), and one answer names the collective,
the ranks that never entered it or entered another, and where those ranks are. It is said
once; ``stall.json`` keeps it for ``nbgpu diagnose``. A quiet job with no collective pending
is computing, not stalled: it is looked at again after another ``--hang-after``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

import psutil

from nbgpu.diagnose.hang import (
    Frame,
    RankPlace,
    Stall,
    find_stall,
    main_thread,
    parse_stacks,
    read_trace,
)
from nbgpu.launch.procs import STACKS_SIGNAL, rank_stacks, wait_for_dump

__all__ = ["FR_REQUEST", "StallWatch", "flight_records"]

FR_REQUEST = "fr-request"  # what nbgpu.rank.worker reads (a test ties the two)
_ANSWER_S = 3.0  # how long ranks get to write their records (they look twice a second)
_STACKS_S = 5.0


def flight_records(
    run_dir: Path, ranks: list[int], timeout_s: float = _ANSWER_S
) -> dict[int, dict[str, Any]]:
    """Every live rank's flight record, fresh: rank -> {"trace", "time_ns" (its clock)}."""
    token = secrets.token_hex(8)
    tmp = run_dir / f".{FR_REQUEST}.tmp"
    tmp.write_text(token, encoding="utf-8")
    tmp.replace(run_dir / FR_REQUEST)
    found: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while len(found) < len(ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
        for rank in ranks:
            if rank in found:
                continue
            with contextlib.suppress(OSError, ValueError):
                data = (run_dir / f"fr-rank{rank}.json").read_bytes()
                if token.encode() in data[:64]:  # the answer to this request, not an older one
                    found[rank] = read_trace(data)
    return found


def _worker_stack(run_dir: Path, rank: int, pid: int) -> tuple[Frame, ...]:
    """The stack of the DataLoader worker a rank waits on, if one is in user code.

    Workers are forked: they carry the rank's stack handler and file. Only children with
    the rank's own command line are asked (an exec'd child has no handler: the real-time
    signal would kill it), one at a time so their dumps do not interleave.
    """
    try:
        parent = psutil.Process(pid)
        same = parent.cmdline()
        children = [c for c in parent.children() if c.cmdline() == same]
    except psutil.Error:
        return ()
    path = run_dir / f"stacks-rank{rank}.txt"
    for child in children:
        offset = path.stat().st_size if path.exists() else 0
        try:
            os.kill(child.pid, STACKS_SIGNAL)
        except OSError:
            continue
        frames = main_thread(parse_stacks(wait_for_dump(path, offset, 2.0)))
        if any(not f.library for f in frames):
            return frames
    return ()


def _waits_on_loader(frames: tuple[Frame, ...]) -> bool:
    return any("torch/utils/data" in f.file.replace("\\", "/") for f in frames[:8])


class StallWatch:
    """One run's stall detector: quiet for ``after_s``, then one look at its collectives."""

    def __init__(self, run_dir: Path, world_size: int, after_s: float) -> None:
        self.run_dir = run_dir
        self.world_size = world_size
        self.after_s = after_s
        self.stall: Stall | None = None
        self.reported_at: float | None = None  # when the current stall was said
        self._next_look = 0.0

    def check(self, last_output_at: float) -> list[str]:
        """Lines to show: a stall found, or progress after one; nothing most of the time."""
        quiet_s = time.time() - last_output_at
        if self.reported_at is not None:
            if quiet_s >= self.after_s:
                return []
            waited = time.time() - self.reported_at  # output again: it was a slow step
            self.reported_at, self._next_look = None, 0.0
            return [f"output again, {waited:.0f} s after the stall was reported"]
        now = time.monotonic()
        if quiet_s < self.after_s or now < self._next_look:
            return []
        self._next_look = now + self.after_s
        stall = self._look()
        if stall is None:
            return []
        self.stall, self.reported_at = stall, time.time()
        lines = stall.lines()
        with contextlib.suppress(OSError):  # what `nbgpu diagnose RUNDIR` reads
            (self.run_dir / "stall.json").write_text(
                json.dumps({"lines": lines, **stall.to_dict()}, indent=1) + "\n", encoding="utf-8"
            )
        return lines

    def _look(self) -> Stall | None:
        ranks = list(range(self.world_size))
        records = flight_records(self.run_dir, ranks)
        clock = max((int(r.get("time_ns", 0)) for r in records.values()), default=0)
        traces = {rank: r.get("trace") or {} for rank, r in records.items()}
        stall = find_stall(traces, now_ns=clock or time.time_ns(), world=ranks)
        if stall is None or (stall.waited_s or 0.0) < self.after_s:
            return None
        for entry in rank_stacks(self.run_dir, timeout_s=_STACKS_S).ranks:
            if entry.rank not in stall.culprits or not entry.python:
                continue
            frames = main_thread(parse_stacks(entry.python))
            worker: tuple[Frame, ...] = ()
            if entry.pid and _waits_on_loader(frames):
                worker = _worker_stack(self.run_dir, entry.rank, entry.pid)
            stall.places[entry.rank] = RankPlace(frames, worker)
        return stall
