"""The memory report: phase x rank, the node's total over time, and what stands out.

:func:`memory_report` reads a run directory's ``mem-rank{N}.jsonl`` files;
:func:`report_from_recorder` turns this process's in-memory records into the same
report (the notebook kernel's ``%%gpu_phase`` cells). A :class:`MemoryReport` renders
as text and HTML (a phase x rank table of peaks), converts with ``to_frame()`` (pandas,
indexed by phase and rank) and ``to_dict()``, and draws itself with ``figure()``
(matplotlib, imported there). Missing figures stay empty, with the reason in the notes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

from nbgpu._render import Result, Table, fmt_bytes, wrap
from nbgpu.errors import UserInputError
from nbgpu.profile.records import PhaseSpan, RankRecords, read_records, read_run_dir

__all__ = ["MemoryReport", "NodePeak", "memory_report", "report_from_recorder"]

FRAME_COLUMNS = (
    "phase", "rank", "status", "start_s", "duration_s", "rss_start_bytes", "rss_end_bytes",
    "peak_rss_bytes", "uss_end_bytes", "pss_end_bytes", "peak_pss_bytes",
    "mem_available_end_bytes", "gpu_allocated_end_bytes", "gpu_reserved_end_bytes",
    "gpu_peak_allocated_bytes", "nvml_used_bytes",
)  # fmt: skip


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / 1024**3:.2f}"


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
class MemoryReport(Result):
    """Memory by phase and rank, for one run (or one process)."""

    source: str
    ranks: tuple[RankRecords, ...]
    mem_total_bytes: int | None = None
    mem_limit_bytes: int | None = None
    simulated: str | None = None
    notes: tuple[str, ...] = field(default=())
    # Over several nodes, each rank's node (rank label -> node name): sums are per node.
    nodes: dict[str, str] = field(default_factory=dict)

    FRAME_COLUMNS = FRAME_COLUMNS

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

    # -- records -----------------------------------------------------------------

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

    def to_frame(self) -> Any:
        """pandas DataFrame indexed by (phase, rank): peaks, ends, durations, GPU figures."""
        frame = super().to_frame()
        return frame.set_index(["phase", "rank"])

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

    def _table(self, metric: str, title: str) -> Table:
        labels = [r.label for r in self.ranks]
        table = Table(["phase", *labels], title=title)
        by = {(row["phase"], row["rank"]): row for row in self.records()}
        for name in self.phase_names():
            cells = []
            level = ""
            for label in labels:
                row = by.get((name, label))
                if row is None:
                    cells.append("")
                    continue
                text = _gib(row[metric])
                if row["status"] == "died in":
                    text += " ✗died"
                    level = "bad"
                elif row["status"] == "running":
                    text += " …"
                elif row["status"] == "failed":
                    text += " !"
                    level = level or "warn"
                cells.append(text)
            table.add(name, *cells, level=level)
        return table

    def text(self) -> str:
        if not self.ranks:
            return "\n".join([f"memory of {self.source}: no records", *self.notes])
        lines = [self._headline()]
        lines.append(
            self._table("peak_rss_bytes", "peak host memory (RSS, GiB) by phase:").text(120)
        )
        if self.has_gpu:
            lines.append(
                self._table("gpu_peak_allocated_bytes", "peak GPU allocated (GiB):").text(120)
            )
        lines += [wrap(f, "* ") for f in self.findings()]
        lines += [wrap(n, "! ") for n in self.notes]
        lines += [wrap(n, "  ") for n in self.why_empty()]
        return "\n".join(lines)

    def _headline(self) -> str:
        parts = [f"memory of {self.source}", f"{len(self.ranks)} process(es)"]
        if self.mem_total_bytes:
            parts.append(f"machine {fmt_bytes(self.mem_total_bytes)}")
        if self.mem_limit_bytes:
            parts.append(f"--mem-limit {fmt_bytes(self.mem_limit_bytes)} per rank")
        if self.simulated:
            parts.append(f"SIMULATED fleet '{self.simulated}'")
        return " · ".join(parts)

    def html_body(self) -> str:
        if not self.ranks:
            return "<p>" + "<br>".join(escape(x) for x in self.text().splitlines()) + "</p>"
        parts = [f"<b>{escape(self._headline())}</b>"]
        parts.append(self._table("peak_rss_bytes", "peak host memory (RSS, GiB) by phase").html())
        if self.has_gpu:
            parts.append(self._table("gpu_peak_allocated_bytes", "peak GPU allocated (GiB)").html())
        items = [f'<li class="warn">{escape(f)}</li>' for f in self.findings()]
        items += [f'<li class="bad">{escape(n)}</li>' for n in self.notes]
        items += [f"<li>{escape(n)}</li>" for n in self.why_empty()]
        if items:
            parts.append(f"<ul>{''.join(items)}</ul>")
        return "".join(parts)

    def to_dict(self) -> dict[str, Any]:
        peak = self.node_peak()
        return {
            "source": self.source,
            "mem_total_bytes": self.mem_total_bytes,
            "mem_limit_bytes": self.mem_limit_bytes,
            "simulated": self.simulated,
            "phases": self.records(),
            "node_peak": None
            if peak is None
            else {
                "t_s": peak.t_s,
                "total_bytes": peak.total_bytes,
                "phases": peak.phases,
                "available_bytes": peak.available_bytes,
                "node": peak.node,
            },
            "nodes": dict(self.nodes),
            "died_in": {r.label: r.died_in.path for r in self.ranks if r.died_in is not None},
            "findings": self.findings(),
            "notes": list(self.notes),
            "empty_because": self.why_empty(),
        }

    def figure(self, *, title: str | None = None) -> Any:
        """A matplotlib Figure: ranks over time, phases as bands, the node's total."""
        from nbgpu.profile.figure import draw  # noqa: PLC0415  (matplotlib only here)

        return draw(self, title=title)

    def png(self) -> bytes:
        from nbgpu.profile.figure import png_bytes  # noqa: PLC0415

        return png_bytes(self.figure())


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def memory_report(run_dir: Path | str, *, label: str | None = None) -> MemoryReport:
    """The report of a run directory; a directory without records is a clear, empty report."""
    directory = Path(run_dir).expanduser()
    if not directory.is_dir():
        raise UserInputError(
            f"{str(run_dir)!r} is not a run directory (expected a directory holding "
            "mem-rank0.jsonl, rank0.log, ...)"
        )
    ranks = read_run_dir(directory)
    meta = _json(directory / "run.json")
    spec = _json(directory / "bootstrap.json")
    notes = [n for r in ranks for n in r.notes]
    if not ranks:
        why = (
            "memory sampling was off (--mem-sample 0) and no phases were recorded"
            if spec.get("mem_sample_s") == 0
            else "no memory records (mem-rank*.jsonl): a run from an older nbgpu, or not an "
            "nbgpu run directory"
        )
        notes.append(why)
    totals = [int(r.proc["mem_total"]) for r in ranks if isinstance(r.proc.get("mem_total"), int)]
    return MemoryReport(
        nodes=_rank_nodes(directory, ranks),
        source=label or f"run '{meta.get('name') or directory.name}'",
        ranks=ranks,
        mem_total_bytes=max(totals) if totals else None,
        mem_limit_bytes=spec.get("mem_limit_bytes") or None,
        simulated=meta.get("simulated") or None,
        notes=tuple(notes),
    )


def _rank_nodes(directory: Path, ranks: Sequence[RankRecords]) -> dict[str, str]:
    """Each rank's node, from the ``rank{R}.node`` a rank over several nodes writes."""
    out = {}
    for rank in ranks:
        if rank.rank is None:
            continue
        try:
            name = (directory / f"rank{rank.rank}.node").read_text(encoding="utf-8").strip()
        except OSError:
            continue
        if name:
            out[rank.label] = name
    return out


def report_from_recorder(recorder: Any, *, label: str = "this process") -> MemoryReport:
    """This process's in-memory records (the kernel's ``%%gpu_phase`` cells) as a report."""
    lines: Sequence[dict[str, Any]] = [*recorder.records, *recorder.samples]
    ordered = sorted(lines, key=lambda r: (r.get("k") != "proc", r.get("t", 0)))
    rank = read_records(
        ordered, label="kernel" if label == "this kernel" else "process", alive=True
    )
    total = rank.proc.get("mem_total")
    return MemoryReport(
        source=label,
        ranks=(rank,) if rank.phases or rank.samples else (),
        mem_total_bytes=total if isinstance(total, int) else None,
        notes=() if rank.phases else ("no phases recorded yet in this process",),
    )
