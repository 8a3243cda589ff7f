"""Reading memory records back: one rank's JSONL, or every rank of a run directory.

Tolerates what crashes leave: a last line cut off mid-write (the rank was killed while
writing it), a phase entered and never left (the rank died inside it, or is still
running), a phase ended before the phases nested in it. Each such thing becomes a note
or a status, never an exception. Standard library only (``nbgpu.diagnose`` reads this).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PhaseSpan", "RankRecords", "read_file", "read_records", "read_run_dir"]

_FILE = re.compile(r"^mem-(rank|pid)(\d+)\.jsonl$")


@dataclass(frozen=True)
class PhaseSpan:
    """One phase of one process: its start and end records merged."""

    id: int
    name: str
    parent: int | None
    depth: int
    begin: dict[str, Any]
    end: dict[str, Any] | None  # None: never ended (see ``status``)
    status: str  # done | failed | died in | running
    path: str  # "run > model" for nested phases

    @property
    def start_t(self) -> float:
        return float(self.begin["t"])

    @property
    def end_t(self) -> float | None:
        return None if self.end is None else float(self.end["t"])

    @property
    def error(self) -> str | None:
        return None if self.end is None else self.end.get("error")


@dataclass(frozen=True)
class RankRecords:
    """Everything one process recorded."""

    label: str  # rank0, pid1234, kernel
    rank: int | None
    proc: dict[str, Any]
    phases: tuple[PhaseSpan, ...]
    marks: tuple[dict[str, Any], ...]
    samples: tuple[dict[str, Any], ...]
    closed: bool  # the process wrote its closing record (ended normally)
    notes: tuple[str, ...]
    path: Path | None = None

    @property
    def died_in(self) -> PhaseSpan | None:
        """The innermost phase open when the process died, if it died in one."""
        dead = [p for p in self.phases if p.status == "died in"]
        return max(dead, key=lambda p: p.depth) if dead else None

    @property
    def last_t(self) -> float | None:
        times = [s["t"] for s in self.samples[-1:]]
        times += [p.end_t or p.start_t for p in self.phases]
        times += [m["t"] for m in self.marks]
        return max(times) if times else None

    def phase_at(self, t: float) -> str | None:
        """The innermost phase open at time *t*."""
        best: PhaseSpan | None = None
        for p in self.phases:
            end = p.end_t if p.end_t is not None else float("inf")
            if p.start_t <= t <= end and (best is None or p.depth >= best.depth):
                best = p
        return None if best is None else best.name


def _alive(proc: dict[str, Any]) -> bool:
    pid = proc.get("pid")
    if not isinstance(pid, int) or proc.get("host") != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A reused pid is another process: its start time tells.
    started = proc.get("process_started")
    if started is not None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            boot = next(
                float(line.split()[1])
                for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime")
            )
            return bool(abs(boot + int(fields[19]) / os.sysconf("SC_CLK_TCK") - started) < 2)
    return True


def read_records(
    lines: Iterable[dict[str, Any]],
    *,
    label: str,
    notes: list[str] | None = None,
    path: Path | None = None,
    alive: bool | None = None,
) -> RankRecords:
    """Merge one process's records (in the order written) into phases, marks, samples."""
    notes = list(notes or [])
    proc: dict[str, Any] = {}
    begins: dict[int, dict[str, Any]] = {}
    ends: dict[int, dict[str, Any]] = {}
    marks: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    closed = False
    for record in lines:
        kind = record.get("k")
        if kind == "proc" and not proc:
            proc = record
        elif kind == "begin" and isinstance(record.get("id"), int):
            begins[record["id"]] = record
        elif kind == "end" and isinstance(record.get("id"), int):
            ends.setdefault(record["id"], record)
            if record.get("order"):
                notes.append(f"phase {record.get('phase')!r} {record['order']}")
        elif kind == "mark":
            marks.append(record)
        elif kind == "s":
            samples.append(record)
        elif kind == "close":
            closed = True
            if record.get("write_error"):
                notes.append(f"records stopped being written: {record['write_error']}")
    if alive is None:
        alive = not closed and _alive(proc)
    names = {i: b.get("phase", "?") for i, b in begins.items()}
    phases = []
    for phase_id, begin in sorted(begins.items(), key=lambda kv: (kv[1].get("t", 0), kv[0])):
        end = ends.get(phase_id)
        if end is not None:
            status = "failed" if end.get("error") else "done"
        else:
            status = "running" if alive else "died in"
        chain, parent = [str(begin.get("phase", "?"))], begin.get("parent")
        while isinstance(parent, int) and parent in names and len(chain) < 32:
            chain.append(str(names[parent]))
            parent = begins[parent].get("parent")
        phases.append(
            PhaseSpan(
                id=phase_id,
                name=str(begin.get("phase", "?")),
                parent=begin.get("parent"),
                depth=int(begin.get("depth") or 0),
                begin=begin,
                end=end,
                status=status,
                path=" > ".join(reversed(chain)),
            )
        )
    rank = proc.get("rank")
    return RankRecords(
        label=label,
        rank=rank if isinstance(rank, int) else None,
        proc=proc,
        phases=tuple(phases),
        marks=tuple(marks),
        samples=tuple(samples),
        closed=closed,
        notes=tuple(notes),
        path=path,
    )


def read_file(path: Path) -> RankRecords:
    """One JSONL file; a cut-off last line or unreadable lines become notes."""
    match = _FILE.match(path.name)
    label = f"{match.group(1)}{match.group(2)}" if match else path.stem
    notes: list[str] = []
    records: list[dict[str, Any]] = []
    try:
        data = path.read_bytes()
    except OSError as exc:
        return read_records([], label=label, notes=[f"{path.name}: {exc.strerror}"], path=path)
    lines = data.split(b"\n")
    bad = 0
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            value = json.loads(raw)
        except ValueError:
            if number == len(lines):  # no newline after it: cut off mid-write
                notes.append(f"{path.name}: last record cut off mid-write (killed while writing)")
            else:
                bad += 1
            continue
        if isinstance(value, dict):
            records.append(value)
        else:
            bad += 1
    if bad:
        notes.append(f"{path.name}: {bad} unreadable line(s) skipped")
    return read_records(records, label=label, notes=notes, path=path)


def _order(path: Path) -> tuple[int, int]:
    match = _FILE.match(path.name)
    if match is None:
        return (2, 0)
    return (0 if match.group(1) == "rank" else 1, int(match.group(2)))


def read_run_dir(directory: Path) -> tuple[RankRecords, ...]:
    """Every ``mem-*.jsonl`` in a run directory, ranks in order."""
    return tuple(read_file(p) for p in sorted(directory.glob("mem-*.jsonl"), key=_order))
