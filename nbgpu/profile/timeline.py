"""A run's memory on one clock: each rank's series, the node's sum, the peaks, the deaths.

:class:`MemoryTimeline` holds every rank's records (``records.py``) and answers what
they add up to: the points of a rank in time order, its host memory (PSS, RSS between
PSS readings), the ranks' sum per node and its peak, each phase's peak, the phase a
rank died in, why a column is empty, and :func:`import_storm` (what
``--serial-imports`` would have done to the peak, from the measured numbers). The
report (``report.py``) renders it, the figure (``figure.py``) draws it, the diagnosis
reads it. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nbgpu._render import fmt_bytes
from nbgpu.profile.records import PhaseSpan, RankRecords

__all__ = ["MemoryTimeline", "NodePeak", "import_storm"]


def _gib(value: float) -> str:
    return f"{value / 1024**3:.2f} GiB"


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


def _host_values(points: list[dict[str, Any]]) -> list[int | None]:
    """A rank's PSS at each point: read where the point has it; between full readings,
    the last PSS moved by the change in RSS since (new memory is the rank's own); RSS
    where the process never had a PSS reading."""
    out: list[int | None] = []
    base: tuple[int, int] | None = None  # (pss, rss) of the last full reading
    for p in points:
        pss, rss = p.get("pss"), p.get("rss")
        if isinstance(pss, int) and isinstance(rss, int):
            base = (pss, rss)
            out.append(pss)
        elif isinstance(rss, int):
            out.append(max(0, base[0] + rss - base[1]) if base else rss)
        else:
            out.append(None)
    return out


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

    def _on(self, node: str | None) -> list[RankRecords]:
        return [r for r in self.ranks if node is None or self.nodes.get(r.label) == node]

    # -- derived -----------------------------------------------------------------

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
        pts = list(rank.samples)
        pts += [p.begin for p in rank.phases] + [p.end for p in rank.phases if p.end]
        pts += list(rank.marks)
        return sorted((p for p in pts if isinstance(p.get("t"), int | float)), key=lambda p: p["t"])

    def host_series(self, rank: RankRecords) -> list[tuple[float, int]]:
        """(seconds, PSS) of one rank over time (see ``_host_values``)."""
        pts = self.points(rank)
        t0 = self.origin
        return [
            (p["t"] - t0, v) for p, v in zip(pts, _host_values(pts), strict=True) if v is not None
        ]

    def node_series(self, node: str | None = None) -> list[tuple[float, int]]:
        """(seconds, the ranks' summed host memory) at every recorded moment of any rank.

        Each rank counts with its newest value from its first record to its last, so a
        rank that died stops counting there; PSS where known (shared pages once), else RSS.
        *node*: only that node's ranks (a run over several nodes); None: every rank.
        """
        events: list[tuple[float, int, str, int | None]] = []
        for rank in self._on(node):
            pts = self.points(rank)
            for order, (p, value) in enumerate(zip(pts, _host_values(pts), strict=True)):
                events.append((float(p["t"]), order, rank.label, value))
            if pts:
                events.append((float(pts[-1]["t"]) + 1e-6, len(pts), rank.label, None))
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
                out[-1] = (t - t0, total)
            else:
                out.append((t - t0, total))
        return out

    def phases_at(self, t_s: float, node: str | None = None) -> dict[str, str | None]:
        """The phase each living rank (of *node*, if given) was in, *t_s* s after the start."""
        t = self.origin + t_s
        out: dict[str, str | None] = {}
        for rank in self._on(node):
            pts = self.points(rank)
            if pts and pts[0]["t"] <= t <= pts[-1]["t"]:
                out[rank.label] = rank.phase_at(t)
        return out

    def node_peak(self) -> NodePeak | None:
        """The highest the ranks of one node summed to (over several nodes: the highest
        node's, named): what that node's memory had to hold at once."""
        names: list[str | None] = [*self.node_names] or [None]
        peaks = [self._peak_of(node) for node in names]
        found = [p for p in peaks if p is not None]
        return max(found, key=lambda p: p.total_bytes) if found else None

    def _peak_of(self, node: str | None) -> NodePeak | None:
        series = self.node_series(node)
        if not series:
            return None
        t, total = max(series, key=lambda item: item[1])
        avail = self._available_near(self.origin + t, node)
        return NodePeak(t, total, self.phases_at(t, node), avail, node)

    def _available_near(self, t: float, node: str | None = None) -> int | None:
        best: tuple[float, int] | None = None
        for rank in self._on(node):
            for p in self.points(rank):
                if isinstance(p.get("avail"), int):
                    gap = abs(p["t"] - t)
                    if best is None or gap < best[0]:
                        best = (gap, p["avail"])
        return None if best is None else best[1]

    def phase_peak(self, rank: RankRecords, span: PhaseSpan) -> tuple[int | None, int | None]:
        """(peak RSS, peak PSS) of one phase: recorded at its end, or from samples if it died."""
        if span.end is not None:
            peak = span.end.get("peak_rss")
            hwm = span.end.get("hwm")
            if isinstance(hwm, int) and not span.end.get("hwm_why"):
                peak = max(peak or 0, hwm)
            return peak, span.end.get("peak_pss")
        inside = [
            p for p in self.points(rank) if p["t"] >= span.start_t and (p.get("rss") is not None)
        ]
        rss = max((p["rss"] for p in inside), default=None)
        innermost = span.depth == max((s.depth for s in rank.phases if s.end is None), default=0)
        hwms = [p["hwm"] for p in inside if isinstance(p.get("hwm"), int)]
        if hwms and innermost and not any(p.get("hwm_why") for p in inside):
            rss = max(rss or 0, *hwms)  # VmHWM was reset when this phase began
        pss = max((p["pss"] for p in inside if isinstance(p.get("pss"), int)), default=None)
        return rss, pss

    def records(self) -> list[dict[str, Any]]:
        t0 = self.origin
        rows = []
        for rank in self.ranks:
            for span in rank.phases:
                end = span.end or {}
                peak_rss, peak_pss = self.phase_peak(rank, span)
                last = rank.last_t if span.end is None else span.end_t
                rows.append(
                    {
                        "phase": span.path,
                        "rank": rank.label,
                        "status": span.status,
                        "start_s": round(span.start_t - t0, 3),
                        "duration_s": None if last is None else round(last - span.start_t, 3),
                        "rss_start_bytes": span.begin.get("rss"),
                        "rss_end_bytes": end.get("rss"),
                        "peak_rss_bytes": peak_rss,
                        "uss_end_bytes": end.get("uss"),
                        "pss_end_bytes": end.get("pss"),
                        "peak_pss_bytes": peak_pss,
                        "mem_available_end_bytes": end.get("avail"),
                        "gpu_allocated_end_bytes": end.get("gpu_alloc"),
                        "gpu_reserved_end_bytes": end.get("gpu_reserved"),
                        "gpu_peak_allocated_bytes": end.get("gpu_peak"),
                        "nvml_used_bytes": end.get("nvml_used"),
                    }
                )
        return rows

    def why_empty(self) -> list[str]:
        """Why columns are empty, once each (no USS/PSS, no VmHWM reset, no GPU figures)."""
        out: list[str] = []
        for rank in self.ranks:
            if rank.proc.get("mem_why"):
                out.append(str(rank.proc["mem_why"]))
            for span in rank.phases:
                if span.end and span.end.get("hwm_why"):
                    out.append(str(span.end["hwm_why"]))
                if span.end and span.end.get("nvml_why"):
                    out.append(f"NVML per-process memory: {span.end['nvml_why']}")
        if any(p.end is not None and "pss" not in p.end for r in self.ranks for p in r.phases):
            out.append(
                "USS/PSS are read at most once a second (their page walk is costly): phases "
                "that ended in between show RSS only"
            )
        if self.ranks and not self.has_gpu:
            out.append(
                "no GPU figures: no rank initialised CUDA"
                + (
                    f" (simulated fleet '{self.simulated}': ranks run on CPU)"
                    if self.simulated
                    else ""
                )
            )
        return list(dict.fromkeys(out))

    def deaths(self) -> list[tuple[str, str]]:
        """(rank label, phase path) of each rank that died inside a phase."""
        return [(r.label, r.died_in.path) for r in self.ranks if r.died_in is not None]

    def findings(self) -> list[str]:
        """What a reader should see first: deaths, the node's peak, the import storm."""
        out = [f"{label} died in '{path}'" for label, path in self.deaths()]
        peak = self.node_peak()
        if peak is not None and len(self.ranks) > 1:
            where = peak.all_in
            on = f" on {peak.node}" if peak.node else ""
            line = (
                f"node peak{on}: {fmt_bytes(peak.total_bytes)} summed over {len(peak.phases)} "
                f"ranks at {peak.t_s:.1f} s"
            )
            if where:
                line += f", every rank in '{where}'"
            if peak.available_bytes is not None:
                line += f"; MemAvailable then {fmt_bytes(peak.available_bytes)}"
            out.append(line)
        return out

    def phase_names(self) -> list[str]:
        seen: dict[str, None] = {}
        for rank in self.ranks:
            for span in sorted(rank.phases, key=lambda s: s.start_t):
                seen.setdefault(span.path, None)
        return list(seen)


def import_storm(report: MemoryTimeline) -> str | None:
    """When every rank was in 'imports' at the node's peak: the measured case for
    ``--serial-imports`` (one transient at a time instead of all at once)."""
    peak = report.node_peak()
    if peak is None or len(peak.phases) < 2 or peak.all_in != "imports":
        return None
    transient = 0
    settled = 0
    tops = []
    # Over several nodes, the node that peaked: its ranks shared its memory.
    on_node = [
        r for r in report.ranks if peak.node is None or report.nodes.get(r.label) == peak.node
    ]
    for rank in on_node:
        span = next((p for p in rank.phases if p.name == "imports" and p.depth == 0), None)
        if span is None:
            return None
        rss_peak, pss_peak = report.phase_peak(rank, span)
        top = pss_peak or rss_peak or 0
        tops.append(top)
        ended_at = span.end_t
        if span.end is None or ended_at is None:
            continue  # died importing: where it would have settled is unknown
        end = span.end.get("pss") or span.end.get("rss") or top
        transient = max(transient, top - end)
        # Taking turns, a rank that has imported holds what it holds afterwards (its
        # later phases: the process group, the model) while the others import.
        later = [v for t, v in report.host_series(rank) if t + report.origin > ended_at]
        settled += max([end, *later])
    if len(tops) > len(
        [r for r in on_node if any(p.name == "imports" and p.end for p in r.phases)]
    ):
        return (
            f"{_every(peak)} was in 'imports' at once when the node peaked at "
            f"{_gib(peak.total_bytes)} ({len(peak.phases)} ranks, each up to {_gib(max(tops))} "
            "while importing): with --serial-imports one rank imports at a time, so one "
            "import's transient is held instead of all of them (measured from these records)"
        )
    serial = settled + transient
    if serial >= peak.total_bytes:
        return None
    return (
        f"{_every(peak)} was in 'imports' at once when the node peaked at {_gib(peak.total_bytes)} "
        f"({len(peak.phases)} ranks): each import rose up to {_gib(transient)} above where it "
        f"settled; with --serial-imports (one rank at a time) the peak would be about "
        f"{_gib(serial)} (every rank at its most after importing, plus one import's "
        "transient), measured from these records"
    )


def _every(peak: NodePeak) -> str:
    return f"every rank of node {peak.node}" if peak.node else "every rank"
