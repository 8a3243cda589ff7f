"""The memory report: phase x rank, the node's total over time, and what stands out.

Of a run directory's ``mem-rank{N}.jsonl`` files (:func:`memory_report`), or of this
process's in-memory records (:func:`report_from_recorder`: the kernel's ``%%gpu_phase``
cells). matplotlib is imported only by ``figure()``.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from nbgpu._render import Block, Bullets, Figure, Line, Result, Table, Title, fmt_bytes
from nbgpu._serial import read_json_object, to_data
from nbgpu.errors import UserInputError, user_path
from nbgpu.profile.records import MemoryTimeline, read_node, read_records, read_run_dir, unit_of

__all__ = ["MemoryReport", "memory_report", "report_from_recorder"]


# A cell's mark and the row's severity by phase status (a death outranks a failure).
_MARKS = {"died in": (" ✗died", "bad"), "running": (" …", ""), "failed": (" !", "warn")}


class _WideTable(Table):
    """A phase x rank table: as wide as its ranks need, up to 120 columns of text."""

    def text(self, max_width: int = 80) -> str:
        return super().text(max(max_width, 120))


@dataclass(frozen=True)
class MemoryReport(MemoryTimeline, Result):
    """Memory by phase and rank, for one run (or one process)."""

    #: One row per phase and rank (``records()``, the frame and the JSON).
    FRAME_COLUMNS = (
        "phase", "rank", "status", "start_s", "duration_s", "rss_start_bytes", "rss_end_bytes",
        "peak_rss_bytes", "uss_end_bytes", "pss_end_bytes", "peak_pss_bytes",
        "mem_available_end_bytes", "gpu_allocated_end_bytes", "gpu_reserved_end_bytes",
        "gpu_peak_allocated_bytes", "nvml_used_bytes",
    )  # fmt: skip

    # The figure as base64 PNG once drawn in (``with_figure()``); HTML shows it.
    png_base64: str = field(default="", repr=False)

    def records(self) -> list[dict[str, Any]]:
        t0 = self.origin
        rows = []
        for rank in self.ranks:
            for span in rank.phases:
                end = span.end or {}
                peak_rss, peak_pss = self.phase_peak(rank, span)
                values = (
                    span.path,
                    rank.label,
                    span.status,
                    round(span.start_t - t0, 3),
                    round(rank.span_end(span) - span.start_t, 3),
                    span.begin.get("rss"),
                    end.get("rss"),
                    peak_rss,
                    end.get("uss"),
                    end.get("pss"),
                    peak_pss,
                    end.get("avail"),
                    end.get("gpu_alloc"),
                    end.get("gpu_reserved"),
                    end.get("gpu_peak"),
                    end.get("nvml_used"),
                )
                rows.append(dict(zip(self.FRAME_COLUMNS, values, strict=True)))
        return rows

    def _table(self, metric: str, title: str) -> list[Block]:
        """Phase x rank in a unit from the values, *title* a line of its own (not a caption)."""
        by = {(row["phase"], row["rank"]): row for row in self.records()}
        labels = [r.label for r in self.ranks]
        scale, unit = unit_of(max((row[metric] or 0 for row in by.values()), default=0))
        table = _WideTable(["phase", *labels])
        for name in self.phase_names():
            cells = []
            level = ""
            for label in labels:
                row = by.get((name, label))
                if row is None:
                    cells.append("")
                    continue
                mark, severity = _MARKS.get(row["status"], ("", ""))
                value = row[metric]
                cells.append(("-" if value is None else f"{value / scale:.2f}") + mark)
                level = "bad" if "bad" in (level, severity) else level or severity
            table.add(name, *cells, level=level)
        return [Line(title.format(unit), wrap=False), table]

    def content(self) -> list[Block]:
        if not self.ranks:
            return [
                Title(f"memory of {self.source}: no records"),
                *(Line(n, wrap=False) for n in self.notes),
            ]
        parts = [f"memory of {self.source}", f"{len(self.ranks)} process(es)"]
        if self.mem_total_bytes:
            parts.append(f"machine {fmt_bytes(self.mem_total_bytes)}")
        if self.mem_limit_bytes:
            parts.append(f"--mem-limit {fmt_bytes(self.mem_limit_bytes)} per rank")
        if self.simulated:
            parts.append(f"SIMULATED fleet '{self.simulated}'")
        blocks: list[Block] = [Title(" · ".join(parts), simulated=bool(self.simulated))]
        if self.png_base64:
            alt = f"figure: memory of {self.source} over time, per rank, phases as bands"
            blocks.append(Figure(alt, png_base64=self.png_base64))
        blocks += self._table("peak_rss_bytes", "peak host memory (RSS, {}) by phase:")
        if self.has_gpu:
            blocks += self._table("gpu_peak_allocated_bytes", "peak GPU allocated ({}):")
        return [
            *blocks,
            Bullets(self.findings(), marker="* ", level="warn"),
            Bullets(self.notes, marker="! ", level="bad"),
            Bullets(self.why_empty(), marker="  "),
        ]

    def to_frame(self) -> Any:
        """pandas DataFrame indexed by (phase, rank): peaks, ends, durations, GPU figures."""
        return super().to_frame().set_index(["phase", "rank"])

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "mem_total_bytes": self.mem_total_bytes,
            "mem_limit_bytes": self.mem_limit_bytes,
            "simulated": self.simulated,
            "phases": self.records(),
            "node_peak": to_data(self.node_peak()),
            "nodes": dict(self.nodes),
            "died_in": dict(self.deaths()),
            "findings": self.findings(),
            "notes": list(self.notes),
            "empty_because": self.why_empty(),
        }

    def why_empty(self) -> list[str]:
        """Why columns are empty, once each (no USS/PSS, no VmHWM reset, no GPU figures)."""
        out: list[str] = []
        for rank in self.ranks:
            if rank.proc.get("mem_why"):
                out.append(str(rank.proc["mem_why"]))
            for end in (span.end for span in rank.phases if span.end):
                if end.get("hwm_why"):
                    out.append(str(end["hwm_why"]))
                if end.get("nvml_why"):
                    out.append(f"NVML per-process memory: {end['nvml_why']}")
        if any(p.end is not None and "pss" not in p.end for r in self.ranks for p in r.phases):
            out.append(
                "USS/PSS are read at most once a second (their page walk is costly): phases "
                "that ended in between show RSS only"
            )
        if self.ranks and not self.has_gpu:
            on_cpu = f" (simulated fleet '{self.simulated}': ranks run on CPU)"
            fleet = on_cpu if self.simulated else ""
            by = "the kernel" if self.source == "this kernel" else "any rank"
            out.append(f"no GPU figures: CUDA was not initialised by {by}{fleet}")
        return list(dict.fromkeys(out))

    def deaths(self) -> list[tuple[str, str]]:
        """(rank label, phase path) of each rank that died inside a phase."""
        return [(r.label, r.died_in.path) for r in self.ranks if r.died_in is not None]

    def findings(self) -> list[str]:
        """What a reader should see first: deaths, the node's peak, the import storm."""
        out = [f"{label} died in '{path}'" for label, path in self.deaths()]
        if len(self.ranks) > 1 and (line := self.peak_line()):
            out.append(line)
        return out

    def peak_line(self) -> str | None:
        """The node's peak (over several ranks) and the largest rank's, with their phases."""
        tops = [(v, t, rank) for rank in self.ranks for t, v in self.host_series(rank)]
        if not tops:
            return None
        value, t, rank = max(tops, key=lambda top: top[0])
        largest = f"largest {rank.label}: {fmt_bytes(value)}"
        if phase := rank.phase_at(self.origin + t):
            largest += f" in '{phase}'"
        if (peak := self.node_peak()) is None or len(self.ranks) < 2:
            return largest
        on = f" on {peak.node}" if peak.node else ""
        total = fmt_bytes(peak.total_bytes)
        line = f"node peak{on}: {total} summed over {len(peak.phases)} ranks at {peak.t_s:.1f} s"
        if peak.all_in:
            line += f", every rank in '{peak.all_in}'"
        if peak.available_bytes is not None:
            line += f"; MemAvailable then {fmt_bytes(peak.available_bytes)}"
        return f"{line} · {largest}"

    def phase_names(self) -> list[str]:
        """Every phase path, in the order the ranks first entered them."""
        spans = (s for r in self.ranks for s in sorted(r.phases, key=lambda s: s.start_t))
        return list(dict.fromkeys(s.path for s in spans))

    def figure(self, *, title: str | None = None) -> Any:
        """A matplotlib Figure: ranks over time, phases as bands, the node's total."""
        from nbgpu.profile.figure import draw  # noqa: PLC0415  (matplotlib only here)

        return draw(self, title=title)

    def png(self, path: str | None = None) -> bytes:
        """The figure as PNG bytes, also written to *path* (``--png``) when given."""
        buffer = io.BytesIO()
        self.figure().savefig(buffer, format="png", dpi=96)
        png = buffer.getvalue()
        if path is not None:
            try:
                user_path(path).write_bytes(png)
            except OSError as exc:
                raise UserInputError(f"--png {path!r}: cannot write ({exc.strerror})") from None
        return png

    def with_figure(self) -> MemoryReport:
        """This report with its figure drawn in (HTML shows it; no records, no figure)."""
        if not self.ranks:
            return self
        return replace(self, png_base64=base64.b64encode(self.png()).decode("ascii"))


def memory_report(run_dir: Path | str, *, label: str | None = None) -> MemoryReport:
    """The report of a run directory; a directory without records is a clear, empty report."""
    directory = user_path(run_dir)
    if not directory.is_dir():
        raise UserInputError(
            f"{str(run_dir)!r} is not a run directory (expected a directory holding "
            "mem-rank0.jsonl, rank0.log, ...)"
        )
    ranks = read_run_dir(directory)
    meta = read_json_object(directory / "run.json")
    spec = read_json_object(directory / "bootstrap.json")
    notes = [n for r in ranks for n in r.notes]
    if not ranks:
        notes.append(
            "memory sampling was off (--mem-sample 0) and no phases were recorded"
            if spec.get("mem_sample_s") == 0
            else "no memory records (mem-rank*.jsonl): a run from an older nbgpu, or not an "
            "nbgpu run directory"
        )
    totals = [int(r.proc["mem_total"]) for r in ranks if isinstance(r.proc.get("mem_total"), int)]
    # Over several nodes each rank wrote the node it ran on.
    nodes = {
        r.label: node
        for r in ranks
        if r.rank is not None and (node := read_node(directory, r.rank))
    }
    return MemoryReport(
        nodes=nodes,
        source=label or f"run '{meta.get('name') or directory.name}'",
        ranks=ranks,
        mem_total_bytes=max(totals) if totals else None,
        mem_limit_bytes=spec.get("mem_limit_bytes") or None,
        simulated=meta.get("simulated") or None,
        notes=tuple(notes),
    )


def report_from_recorder(recorder: Any, *, label: str = "this process") -> MemoryReport:
    """This process's in-memory records (the kernel's ``%%gpu_phase`` cells) as a report."""
    lines: Sequence[dict[str, Any]] = [*recorder.records, *recorder.samples]
    ordered = sorted(lines, key=lambda r: (r.get("k") != "proc", r.get("t", 0)))
    who = "kernel" if label == "this kernel" else "process"
    rank = read_records(ordered, label=who, alive=True)
    total = rank.proc.get("mem_total")
    return MemoryReport(
        source=label,
        ranks=(rank,) if rank.phases or rank.samples else (),
        mem_total_bytes=total if isinstance(total, int) else None,
        notes=() if rank.phases else ("no phases recorded yet in this process",),
    )
