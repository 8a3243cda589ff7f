"""Memory facts for an out-of-memory diagnosis, from the run's memory records.

For a ``host_oom`` or ``cuda_oom`` root cause in a run directory with ``mem-rank*.jsonl``:
the phase each failed rank died in, the node's ``MemAvailable`` at the last sample, and,
when every rank was in ``imports`` at the node's peak, what ``--serial-imports`` would
have done to that peak, computed from the measured per-rank numbers. Reads records
through ``nbgpu.profile.report`` (standard library only); never raises on bad records.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nbgpu.diagnose.report import FoundCause
    from nbgpu.profile.report import MemoryReport, NodePeak

__all__ = ["memory_details", "with_memory_details"]

_OOM = ("host_oom", "cuda_oom")


def _gib(value: float) -> str:
    return f"{value / 1024**3:.2f} GiB"


def memory_details(run_dir: Path) -> tuple[str, ...]:
    """Lines to add to an OOM cause (empty without memory records)."""
    from nbgpu.profile.report import memory_report  # noqa: PLC0415

    try:
        report = memory_report(run_dir)
    except Exception:  # noqa: BLE001  (a diagnosis must never fail on its extras)
        return ()
    if not report.ranks:
        return ()
    lines = [f"{label} died in phase '{path}' (memory records)" for label, path in report.deaths()]
    last = _last_sample(report)
    if last is not None:
        label, sample = last
        avail = sample.get("avail")
        if isinstance(avail, int):
            total = f" of {_gib(report.mem_total_bytes)}" if report.mem_total_bytes else ""
            phase = next(r for r in report.ranks if r.label == label).phase_at(sample["t"])
            where = f", {label} in '{phase}'" if phase else ""
            lines.append(f"node MemAvailable at the last sample: {_gib(avail)}{total}{where}")
    storm = import_storm(report)
    if storm:
        lines.append(storm)
    return tuple(lines)


def _last_sample(report: MemoryReport) -> tuple[str, dict[str, Any]] | None:
    best: tuple[str, dict[str, Any]] | None = None
    for rank in report.ranks:
        for point in report.points(rank)[-1:]:
            if best is None or point["t"] > best[1]["t"]:
                best = (rank.label, point)
    return best


def import_storm(report: MemoryReport) -> str | None:
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


def with_memory_details(
    causes: tuple[FoundCause, ...], run_dir: Path | None
) -> tuple[FoundCause, ...]:
    """The causes found, with memory facts added to an OOM root cause."""
    if run_dir is None or not causes or not causes[0].root or causes[0].cause not in _OOM:
        return causes
    extra = memory_details(run_dir)
    if not extra:
        return causes
    root = causes[0]
    return (replace(root, details=(*root.details, *extra)), *causes[1:])
