"""Memory records read back, and what they add up to on one clock.

Reading tolerates what crashes leave: a last line cut off mid-write, a phase entered and never left
(the rank died inside it, or is still running), a phase ended before the phases nested in it - each
a note or a status, never an exception. The report renders a :class:`MemoryTimeline`, the figure
draws it, the diagnosis reads it. Standard library only (and the recorder's /proc helpers).
"""

import contextlib
import json
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbgpu._children import pid_exists
from nbgpu.profile.recorder import process_start_time
from nbgpu.sizes import gib

__all__ = ["MemoryTimeline", "NodePeak", "PhaseSpan", "RankRecords", "gib", "host_value",
           "import_storm", "ranks_text", "read_file", "read_node", "read_records", "read_run_dir",
           "unit_of"]  # fmt: skip

_FILE = re.compile(r"^mem-(rank|pid)(\d+)\.jsonl$")
Base = tuple[int, int] | None  # (pss, rss) of the last full reading
# What the reader computes with; a value of another type there (a damaged line) is dropped.
_NUMBERS = frozenset(("t", "id", "parent", "depth", "pid", "rss", "uss", "pss", "avail",
                      "mem_total", "hwm", "peak_rss", "peak_pss", "gpu_alloc", "gpu_reserved",
                      "gpu_peak", "nvml_used", "process_started", "sample_s"))  # fmt: skip


def _as_written(key: str, value: object) -> bool:
    """Whether *value* has a type the recorder writes under *key* (no list or object)."""
    if key in _NUMBERS:
        return value is None or isinstance(value, int | float)
    return not isinstance(value, list | dict)


def ranks_text(ranks: tuple[int, ...]) -> str:
    """``ranks 0-7``, ``ranks 1, 3``, ``rank 2``: ranks named once, however many."""
    if not ranks:
        return ""
    if len(ranks) > 1 and ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def unit_of(largest: float) -> tuple[int, str]:
    """(bytes, name) of the unit values read in, from the largest: 50 MiB, never 0.0 GiB."""
    return (1 << 20, "MiB") if largest < 1 << 30 else (1 << 30, "GiB")


def host_value(point: dict[str, Any], base: Base) -> tuple[int | None, Base]:
    """A point's host memory, and the base for the next: PSS where the point has it;
    between full readings the last PSS moved by the change in RSS since (new memory is
    the rank's own); RSS where the process never had a PSS reading."""
    pss, rss = point.get("pss"), point.get("rss")
    if isinstance(pss, int) and isinstance(rss, int):
        return pss, (pss, rss)
    if isinstance(rss, int):
        return (max(0, base[0] + rss - base[1]) if base else rss), base
    return None, base


@dataclass(frozen=True)
class PhaseSpan:
    """One phase of one process: its start and end records merged."""

    name: str
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

    def span_end(self, span: PhaseSpan) -> float:
        """When *span* ended, or (never ended) this process's last record: where to draw it."""
        return span.end_t if span.end_t is not None else (self.last_t or span.start_t)

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
    if not isinstance(pid, int) or proc.get("host") != socket.gethostname() or not pid_exists(pid):
        return False
    # A reused pid (another user's too) is another process: its start time tells.
    started, now = proc.get("process_started"), process_start_time(pid)
    return started is None or now is None or abs(now - started) < 2


def read_records(
    lines: Iterable[dict[str, Any]],
    *,
    label: str,
    notes: list[str] | None = None,
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
    phases = []
    for phase_id, begin in sorted(begins.items(), key=lambda kv: (kv[1].get("t", 0), kv[0])):
        end = ends.get(phase_id)
        ended = "failed" if end is not None and end.get("error") else "done"
        status = ended if end is not None else "running" if alive else "died in"
        chain, parent = [str(begin.get("phase", "?"))], begin.get("parent")
        while isinstance(parent, int) and parent in begins and len(chain) < 32:
            chain.append(str(begins[parent].get("phase", "?")))
            parent = begins[parent].get("parent")
        path = " > ".join(reversed(chain))
        phases.append(PhaseSpan(chain[0], int(begin.get("depth") or 0), begin, end, status, path))
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
    )


def read_file(path: Path) -> RankRecords:
    """One JSONL file; a cut-off last line or unreadable lines become notes."""
    match = _FILE.match(path.name)
    label = f"{match.group(1)}{match.group(2)}" if match else path.stem
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError as exc:
        return read_records([], label=label, notes=[f"{path.name}: {exc.strerror}"])
    notes: list[str] = []
    records: list[dict[str, Any]] = []
    bad = 0
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            value = json.loads(raw)
        except ValueError:
            if number == len(lines):  # no newline after it: cut off mid-write
                notes.append(f"{path.name}: last record cut off mid-write (killed while writing)")
                continue
            value = None
        if isinstance(value, dict) and isinstance(value.get("t"), int | float):
            records.append({k: v for k, v in value.items() if _as_written(k, v)})
        else:  # not a record, or one without its time
            bad += 1
    if bad:
        notes.append(f"{path.name}: {bad} unreadable line(s) skipped")
    return read_records(records, label=label, notes=notes)


def read_run_dir(directory: Path) -> tuple[RankRecords, ...]:
    """Every ``mem-*.jsonl`` in a run directory, ranks in order (then pids, then others)."""

    def order(path: Path) -> tuple[int, int]:
        match = _FILE.match(path.name)
        return (2, 0) if match is None else (match.group(1) != "rank", int(match.group(2)))

    return tuple(read_file(p) for p in sorted(directory.glob("mem-*.jsonl"), key=order))


def read_node(directory: Path, rank: int) -> str | None:
    """The node rank *rank* ran on (``rank{R}.node``, written over several nodes)."""
    with contextlib.suppress(OSError):
        return (directory / f"rank{rank}.node").read_text(encoding="utf-8").strip()
    return None


@dataclass(frozen=True)
class NodePeak:
    """The moment the ranks' summed memory was highest."""

    t_s: float  # seconds after the run's first record
    total_bytes: int  # sum of every rank's PSS (RSS where PSS is unknown)
    phases: dict[str, str | None]  # rank label -> the phase it was in
    available_bytes: int | None  # the node's MemAvailable nearest that moment
    node: str | None = None  # over several nodes: the node that peaked highest

    @property
    def all_in(self) -> str | None:
        """The one phase every rank was in at the peak, if they shared one."""
        names = set(self.phases.values())
        return names.pop() if len(names) == 1 and len(self.phases) > 1 else None


@dataclass(frozen=True)
class MemoryTimeline:
    """Memory by phase and rank, for one run (or one process): the numbers."""

    source: str
    ranks: tuple[RankRecords, ...]
    mem_total_bytes: int | None = None
    mem_limit_bytes: int | None = None
    simulated: str | None = None
    notes: tuple[str, ...] = field(default=())
    # Over several nodes, each rank's node (rank label -> node name): sums are per node.
    nodes: dict[str, str] = field(default_factory=dict)

    @property
    def node_names(self) -> list[str]:
        """The nodes of a run over several nodes, in rank order; empty on one node."""
        names = list(dict.fromkeys(self.nodes.get(r.label, "") for r in self.ranks))
        return names if len(names) > 1 else []

    def on_node(self, node: str | None) -> list[RankRecords]:
        """The ranks of *node* (None: every rank)."""
        return [r for r in self.ranks if node is None or self.nodes.get(r.label) == node]

    @property
    def origin(self) -> float:
        """Time zero: the first record of any rank."""
        times = [float(r.proc["t"]) for r in self.ranks if "t" in r.proc]
        times += [p.start_t for r in self.ranks for p in r.phases]
        times += [float(s["t"]) for r in self.ranks for s in r.samples[:1]]
        return min(times) if times else 0.0

    @property
    def has_gpu(self) -> bool:
        return any("gpu_alloc" in s for r in self.ranks for s in r.samples) or any(
            p.end is not None and "gpu_alloc" in p.end for r in self.ranks for p in r.phases
        )

    def points(self, rank: RankRecords) -> list[dict[str, Any]]:
        """A rank's timeline: samples plus every phase boundary and mark, in time order."""
        pts = [*rank.samples, *(p.begin for p in rank.phases)]
        pts += [p.end for p in rank.phases if p.end] + list(rank.marks)
        return sorted((p for p in pts if isinstance(p.get("t"), int | float)), key=lambda p: p["t"])

    def _host(self, rank: RankRecords) -> list[tuple[float, int | None]]:
        out: list[tuple[float, int | None]] = []
        base: Base = None
        for p in self.points(rank):
            value, base = host_value(p, base)
            out.append((float(p["t"]), value))
        return out

    def host_series(self, rank: RankRecords) -> list[tuple[float, int]]:
        """(seconds, PSS) of one rank over time (see :func:`host_value`)."""
        t0 = self.origin
        return [(t - t0, v) for t, v in self._host(rank) if v is not None]

    def node_series(self, node: str | None = None) -> list[tuple[float, int]]:
        """(seconds, the summed host memory of *node*'s ranks, None: of every rank) at each
        recorded moment. Each rank counts with its newest value from its first record to its
        last, so a rank that died stops counting there; PSS (shared pages once), else RSS."""
        events: list[tuple[float, int, str, int | None]] = []
        for rank in self.on_node(node):
            values = self._host(rank)
            events += [(t, order, rank.label, v) for order, (t, v) in enumerate(values)]
            if values:
                events.append((values[-1][0] + 1e-6, len(values), rank.label, None))
        events.sort(key=lambda e: (e[0], e[1]))
        current: dict[str, int] = {}
        total = 0
        out: list[tuple[float, int]] = []
        t0 = self.origin
        for t, _order, label, value in events:
            total -= current.pop(label, 0)
            if value is not None:
                current[label] = value
                total += value
            if out and abs(out[-1][0] - (t - t0)) < 1e-9:
                out.pop()  # the same instant: its last total stands
            out.append((t - t0, total))
        return out

    def node_peak(self) -> NodePeak | None:
        """The highest the ranks of one node summed to (over several nodes: the highest
        node's, named): what that node's memory had to hold at once."""
        peaks = []
        nodes: list[str | None] = [*self.node_names] or [None]
        for node in nodes:
            series = self.node_series(node)
            if not series:
                continue
            t_s, total = max(series, key=lambda item: item[1])
            t = self.origin + t_s
            phases = {}  # the phase each living rank of the node was in then
            avail: list[tuple[float, int]] = []  # (how far from then, MemAvailable)
            for rank in self.on_node(node):
                pts = self.points(rank)
                if pts and pts[0]["t"] <= t <= pts[-1]["t"]:
                    phases[rank.label] = rank.phase_at(t)
                avail += [
                    (abs(p["t"] - t), p["avail"]) for p in pts if isinstance(p.get("avail"), int)
                ]
            nearest = min(avail, key=lambda gap: gap[0])[1] if avail else None
            peaks.append(NodePeak(t_s, total, phases, nearest, node))
        return max(peaks, key=lambda p: p.total_bytes) if peaks else None

    def phase_peak(self, rank: RankRecords, span: PhaseSpan) -> tuple[int | None, int | None]:
        """(peak RSS, peak PSS) of one phase: recorded at its end, or from samples if it died."""
        if span.end is not None:
            peak, hwm = span.end.get("peak_rss"), span.end.get("hwm")
            if isinstance(hwm, int) and not span.end.get("hwm_why"):
                peak = max(peak or 0, hwm)
            return peak, span.end.get("peak_pss")
        inside = [
            p for p in self.points(rank) if p["t"] >= span.start_t and p.get("rss") is not None
        ]
        rss = max((p["rss"] for p in inside), default=None)
        innermost = span.depth == max((s.depth for s in rank.phases if s.end is None), default=0)
        hwms = [p["hwm"] for p in inside if isinstance(p.get("hwm"), int)]
        if hwms and innermost and not any(p.get("hwm_why") for p in inside):
            rss = max(rss or 0, *hwms)  # VmHWM was reset when this phase began
        pss = max((p["pss"] for p in inside if isinstance(p.get("pss"), int)), default=None)
        return rss, pss


def import_storm(report: MemoryTimeline) -> str | None:
    """When every rank was in 'imports' at the node's peak: the measured case for
    ``--serial-imports`` (one transient at a time instead of all at once)."""
    peak = report.node_peak()
    if peak is None or len(peak.phases) < 2 or peak.all_in != "imports":
        return None
    transient = settled = 0
    tops = []
    every = f"every rank of node {peak.node}" if peak.node else "every rank"
    # Over several nodes, the node that peaked: its ranks shared its memory.
    for rank in report.on_node(peak.node):
        span = next((p for p in rank.phases if p.name == "imports" and p.depth == 0), None)
        if span is None:
            return None
        rss_peak, pss_peak = report.phase_peak(rank, span)
        top = pss_peak or rss_peak or 0
        tops.append(top)
        if span.end is None or span.end_t is None:
            continue  # died importing: where it would have settled is unknown
        end = span.end.get("pss") or span.end.get("rss") or top
        transient = max(transient, top - end)
        # Taking turns, a rank that has imported holds what it holds afterwards (its
        # later phases: the process group, the model) while the others import.
        later = [v for t, v in report.host_series(rank) if t + report.origin > span.end_t]
        settled += max([end, *later])
    at_once = f"{every} was in 'imports' at once when the node peaked at {gib(peak.total_bytes)}"
    if not all(
        any(p.name == "imports" and p.end for p in r.phases) for r in report.on_node(peak.node)
    ):
        return (
            f"{at_once} ({len(peak.phases)} ranks, each up to {gib(max(tops))} while importing): "
            "with --serial-imports one rank imports at a time, so one import's transient is "
            "held instead of all of them (measured from these records)"
        )
    serial = settled + transient
    if serial >= peak.total_bytes:
        return None
    return (
        f"{at_once} ({len(peak.phases)} ranks): each import rose up to {gib(transient)} above "
        f"where it settled; with --serial-imports (one rank at a time) the peak would be about "
        f"{gib(serial)} (every rank at its most after importing, plus one import's transient), "
        "measured from these records"
    )
