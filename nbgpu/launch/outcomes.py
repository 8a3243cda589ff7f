"""What a run's processes leave in its directory, read by the kernel: once it ended, the
agent's ``result.json`` (exit codes, signals), each rank's torchelastic error file (the
exception, its traceback, a sub-second clock) and the ``--pull`` values; while it runs,
the markers behind one-line notices (a refused parent-death signal, a full disk, a stall).

A job stalls when no rank writes for ``--hang-after`` seconds with a collective pending that
long: :class:`StallWatch` asks every rank for its flight record (``nbgpu.rank.worker``
answers from a thread: a rank stuck in a collective runs no signal handler) and its stack (a
DataLoader worker's too), and names once the collective, the ranks that never entered it or
entered another, and where they are (``stall.json`` keeps it for ``nbgpu diagnose``). A
quiet job with no collective pending is computing: it is looked at again later.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import secrets
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from nbgpu._serial import read_json_object
from nbgpu.launch.procs import STACKS_SIGNAL, rank_stacks, wait_for_dump
from nbgpu.launch.rundirs import error_file, rank_log

if TYPE_CHECKING:
    from nbgpu.diagnose import hang
    from nbgpu.diagnose.report import Diagnosis

__all__ = [
    "FR_REQUEST", "Pulled", "RankOutcome", "RunNotices", "StallWatch", "add_pulled",
    "collect_pulled", "diagnose_failure", "flight_records", "rank_outcomes", "read_agent_result",
]  # fmt: skip

DISK_FULL_BELOW_BYTES = 64 * 1024  # less free space than this under the run dir: full


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    exit_code: int | None  # None: unknown (the agent was killed before reporting)
    signal: str | None
    pid: int | None
    log: Path
    error: str | None  # the exception line from the error file
    traceback: str | None
    failed_at: float | None


def read_agent_result(run_dir: Path) -> dict[str, Any]:
    """The agent's ``result.json`` (empty when it could not write one); over several nodes
    their ``result-node{N}.json`` merged: failures by global rank, well only if every node's."""
    paths = [run_dir / "result.json", *sorted(run_dir.glob("result-node*.json"))]
    results = [data for path in paths if (data := read_json_object(path))]
    if len(results) <= 1:
        return results[0] if results else {}

    def first(key: str) -> Any:
        return next((r[key] for r in results if r.get(key)), None)

    failures = sorted((f for r in results for f in r.get("failures", [])), key=lambda f: f["rank"])
    codes = [r.get("agent_exit_code") for r in results]
    return {
        "failures": failures,
        "signal": first("signal"),
        "agent_exit_code": 0 if all(c == 0 for c in codes) else next((c for c in codes if c), 1),
        "error": first("error"),
        "rendezvous_timeout_s": first("rendezvous_timeout_s"),
    }


def rank_outcomes(
    run_dir: Path, nproc: int, agent_result: dict[str, Any], agent_exit_code: int | None
) -> tuple[RankOutcome, ...]:
    failures = {f["rank"]: f for f in agent_result.get("failures", [])}
    # torchrun exits 0 only when every rank did (also when a full disk kept the agent
    # from writing result.json).
    all_ok = (
        bool(agent_result)
        and not agent_result.get("signal")
        and agent_result.get("agent_exit_code") == 0
    ) or (not agent_result and agent_exit_code == 0)
    outcomes = []
    for rank in range(nproc):
        failure = failures.get(rank)
        if failure is not None:
            code, sig, pid = failure["exit_code"], failure["signal"], failure["pid"]
        else:
            code, sig, pid = 0 if all_ok else None, None, None
        details = _error_details(run_dir, rank, failure)
        outcomes.append(RankOutcome(rank, code, sig, pid, rank_log(run_dir, rank), *details))
    return tuple(outcomes)


def _error_details(
    run_dir: Path, rank: int, failure: dict[str, Any] | None
) -> tuple[str | None, str | None, float | None]:
    candidates = []
    if failure and failure.get("error_file"):
        candidates.append(Path(failure["error_file"]))
    candidates.append(error_file(run_dir, rank))
    candidates.extend(sorted((run_dir / "torchelastic").glob(f"*/attempt_*/{rank}/error.json")))
    for path in candidates:
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            message = data["message"]
            info = message.get("extraInfo", {})
            stamp = float(info.get("nbgpu_time") or info.get("timestamp") or 0) or None
            target = error_file(run_dir, rank)
            if path != target:
                with contextlib.suppress(OSError):
                    shutil.move(path, target)  # one copy, next to the logs, for diagnosis
            return str(message.get("message")), info.get("py_callstack"), stamp
        except (ValueError, KeyError, TypeError, OSError, AttributeError):
            continue
    # No error file: a signal or an exit without raising; the exit code and signal tell it.
    return None, None, None


@dataclass
class Pulled:
    """``--pull`` values: rank 0's, every rank's (``--all-ranks``), and what went wrong."""

    values: dict[str, Any] = field(default_factory=dict)
    every_rank: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def add_pulled(pulled: Pulled, rank: int, payload: dict[str, Any]) -> None:
    """Fold one rank's pull payload (``nbgpu.rank.usercode.pull_payload``) into *pulled*."""
    values: dict[str, Any] = {}
    for name, blob in payload["values"].items():
        try:
            values[name] = pickle.loads(blob)  # noqa: S301  (written by our own ranks)
        except Exception as exc:  # noqa: BLE001, PERF203  (e.g. a class the notebook lacks)
            pulled.problems.append(f"--pull {name}: the value cannot be loaded here ({exc})")
    pulled.problems.extend(
        f"--pull {name}: rank {rank} never set {name!r}" for name in payload["missing"]
    )
    pulled.problems.extend(f"--pull {name}: {why}" for name, why in payload["errors"].items())
    if rank == 0:
        pulled.values = values
    pulled.every_rank.append(values)


def collect_pulled(run_dir: Path, nproc: int) -> Pulled:
    pulled = Pulled()
    for r in range(nproc):
        path = run_dir / f"pull-rank{r}.pkl"
        if path.exists():
            add_pulled(pulled, r, pickle.loads(path.read_bytes()))  # noqa: S301  (our own ranks)
    return pulled


def diagnose_failure(
    run_dir: Path, environ: Mapping[str, str], name: str, ranks: Sequence[RankOutcome]
) -> tuple[Diagnosis | None, str | None, RankOutcome | None]:
    """A failed run's diagnosis (with this machine's GPUs as context), why the diagnosis
    itself failed if it did, and the rank that failed first (the diagnosis decides)."""
    try:
        from nbgpu.devices.inventory import take_inventory  # noqa: PLC0415
        from nbgpu.diagnose import diagnose  # noqa: PLC0415

        inventory = take_inventory(environ, scan_device_files=False)
        diagnosis = diagnose(run_dir, inventory=inventory, name=name)
    except Exception as exc:  # noqa: BLE001  (a diagnosis must never hide the failure itself)
        # ...nor hide its own failure: the summary says it failed and why.
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        error = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        # Which rank failed first is the diagnosis' answer; without it: the earliest
        # error-file clock, ranks the agent stopped (SIGTERM/SIGINT) after another failed last.
        failed = [r for r in ranks if r.exit_code not in (0, None)]
        stopped = {r.rank for r in failed if r.signal in ("SIGTERM", "SIGINT") and r.error is None}
        earliest = min(
            failed,
            key=lambda r: (r.rank in stopped, r.failed_at or float("inf"), r.rank),
            default=None,
        )
        return None, error, earliest
    root = next((r for r in ranks if r.rank == diagnosis.failed_rank), None)
    return diagnosis, None, root


class RunNotices:
    """The one-line notices of one run; ``run_dir`` is set once the directory exists."""

    def __init__(self, nproc: int) -> None:
        self.nproc = nproc
        self.run_dir: Path | None = None
        self.pending: list[str] = []
        self.disk_full_since: float | None = None  # when the run directory's disk filled
        self._guarantee_told = False

    def guarantee_record(self) -> dict[str, Any]:
        """Processes (agent, rankN) whose parent-death signal the kernel refused, and why."""
        lost: dict[str, str] = {}
        for path in sorted(self.run_dir.glob("pdeathsig-*.txt")) if self.run_dir else []:
            with contextlib.suppress(OSError):
                lost[path.stem.removeprefix("pdeathsig-")] = path.read_text("utf-8").strip()
        return {"ok": not lost, "lost": lost}

    def take(self, on_guarantee_lost: Callable[[], object]) -> list[str]:
        """Messages not shown yet. *on_guarantee_lost* runs once, when one is first seen."""
        out, self.pending = self.pending, []
        lost = {} if self._guarantee_told else self.guarantee_record()["lost"]
        if lost:
            self._guarantee_told = True
            with contextlib.suppress(OSError):
                on_guarantee_lost()
            out.append(
                f"no parent-death signal for {', '.join(lost)} ({next(iter(lost.values()))}): "
                "if this process is killed, the run's processes keep running; stop them with "
                "%gpu_stop / nbgpu clean"
            )
        if self.disk_full_since is None and self.run_dir is not None:
            self.disk_full_since = _disk_full_since(self.run_dir)
            if self.disk_full_since is not None:
                when = time.strftime("%H:%M:%S", time.localtime(self.disk_full_since))
                out.append(
                    f"the disk under {self.run_dir} is full: rank logs (rank0..rank"
                    f"{self.nproc - 1}.log) and the output shown here are incomplete from {when} "
                    "on; the ranks keep running (free space, or set NBGPU_RUNS_DIR elsewhere for "
                    "the next run)"
                )
        return out


def _disk_full_since(run_dir: Path) -> float | None:
    """When the disk under the run directory filled, if it did: a rank's own marker (ranks
    drop their output instead of failing) or, too full for markers, the disk's free space."""
    stamps = []
    for path in run_dir.glob("logfull-rank*.txt"):
        with contextlib.suppress(OSError, ValueError):
            stamps.append(float(path.read_text(encoding="utf-8")))
    if stamps:
        return min(stamps)
    with contextlib.suppress(OSError):
        st = os.statvfs(run_dir)
        if st.f_bavail * st.f_frsize < DISK_FULL_BELOW_BYTES:
            return time.time()
    return None


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
    # The diagnose package (~0.1 s of imports) only when a run is asked about its stall.
    from nbgpu.diagnose import hang  # noqa: PLC0415

    found: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while len(found) < len(ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
        for rank in [r for r in ranks if r not in found]:
            with contextlib.suppress(OSError, ValueError):
                data = (run_dir / f"fr-rank{rank}.json").read_bytes()
                if token.encode() in data[:64]:  # the answer to this request, not an older one
                    found[rank] = hang.read_trace(data)
    return found


def _worker_stack(run_dir: Path, rank: int, pid: int) -> tuple[hang.Frame, ...]:
    """The stack of the DataLoader worker a rank waits on, if one is in user code. Forked
    workers carry the rank's stack handler; an exec'd child has none (the signal would kill
    it): only children with the rank's command line are asked, one at a time."""
    from nbgpu.diagnose import hang  # noqa: PLC0415

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
        frames = hang.main_thread(hang.parse_stacks(wait_for_dump(path, offset, 2.0)))
        if any(not f.library for f in frames):
            return frames
    return ()


class StallWatch:
    """One run's stall detector: quiet for ``after_s``, then one look at its collectives."""

    def __init__(self, run_dir: Path, world_size: int, after_s: float) -> None:
        self.run_dir = run_dir
        self.world_size = world_size
        self.after_s = after_s
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
        self.reported_at = time.time()
        lines = stall.lines()
        with contextlib.suppress(OSError):  # what `nbgpu diagnose RUNDIR` reads
            (self.run_dir / "stall.json").write_text(
                json.dumps({"lines": lines, **stall.to_dict()}, indent=1) + "\n", encoding="utf-8"
            )
        return lines

    def _look(self) -> hang.Stall | None:
        from nbgpu.diagnose import hang  # noqa: PLC0415

        ranks = list(range(self.world_size))
        records = flight_records(self.run_dir, ranks)
        clock = max((int(r.get("time_ns", 0)) for r in records.values()), default=0)
        traces = {rank: r.get("trace") or {} for rank, r in records.items()}
        stall = hang.find_stall(traces, now_ns=clock or time.time_ns(), world=ranks)
        if stall is None or (stall.waited_s or 0.0) < self.after_s:
            return None
        for entry in rank_stacks(self.run_dir, timeout_s=_STACKS_S).ranks:
            if entry.rank not in stall.culprits or not entry.python:
                continue
            frames = hang.main_thread(hang.parse_stacks(entry.python))
            worker: tuple[hang.Frame, ...] = ()
            on_loader = any("torch/utils/data" in f.file.replace("\\", "/") for f in frames[:8])
            if entry.pid and on_loader:
                worker = _worker_stack(self.run_dir, entry.rank, entry.pid)
            stall.places[entry.rank] = hang.RankPlace(frames, worker)
        return stall
