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

from nbgpu.profile.timeline import MemoryTimeline, import_storm

if TYPE_CHECKING:
    from nbgpu.diagnose.report import FoundCause

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


def _last_sample(report: MemoryTimeline) -> tuple[str, dict[str, Any]] | None:
    best: tuple[str, dict[str, Any]] | None = None
    for rank in report.ranks:
        for point in report.points(rank)[-1:]:
            if best is None or point["t"] > best[1]["t"]:
                best = (rank.label, point)
    return best


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
