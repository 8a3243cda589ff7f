"""The live memory timeline on a run panel's face: one line per rank and the node's total.

Drawn as a small inline SVG (no matplotlib in the refresh loop: a redraw costs
microseconds, not a PNG render per second), read at most once a second from the ranks'
memory records (:class:`nbgpu.profile.live.MemoryFollower`). The full figure is
``%gpu_memory NAME`` once the run is over.
"""

from __future__ import annotations

import html
import time
from typing import Any

from nbgpu.notebook.live import svg_img

__all__ = ["MemoryTimeline", "timeline_svg"]

REFRESH_S = 1.0
_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
_GIB = 1024**3


def timeline_svg(
    series: dict[str, list[tuple[float, int]]], summary: str, *, width: int = 560, height: int = 120
) -> str:
    """Per-rank lines (seconds, bytes) and their sum, with the summary line under them
    (an image: untrusted notebooks strip inline SVG)."""
    points = [p for pts in series.values() for p in pts]
    if not points:
        return f'<div style="font-size:11px;color:#666">{html.escape(summary or "memory: waiting for the first samples…")}</div>'
    t0 = min(t for t, _ in points)
    t1 = max(max(t for t, _ in points) - t0, 1.0)
    total = _sum_series(series)
    top = max(*(v for _, v in total), 1) * 1.15

    def xy(t: float, v: int) -> str:
        return (
            f"{(t - t0) / t1 * (width - 40) + 36:.1f},{height - 14 - v / top * (height - 24):.1f}"
        )

    head = f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}"'
    parts = [f'{head} font-family="sans-serif" font-size="10">']
    parts.append(f'<text x="2" y="12">{top / _GIB:.1f} GiB</text>')
    parts.append(f'<text x="2" y="{height - 16}">0</text>')
    parts.append(f'<text x="{width - 60}" y="{height - 2}">{t1:.0f} s</text>')
    for i, (label, pts) in enumerate(series.items()):
        color = _COLORS[i % len(_COLORS)]
        line = " ".join(xy(t, v) for t, v in pts)
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.2" points="{line}"/>')
        parts.append(
            f'<text x="{40 + 52 * i}" y="{height - 2}" fill="{color}">{html.escape(label)}</text>'
        )
    line = " ".join(xy(t, v) for t, v in total)
    parts.append(f'<polyline fill="none" stroke="black" stroke-width="2" points="{line}"/>')
    parts.append("</svg>")
    return svg_img("".join(parts), "memory per rank") + (
        f'<div style="font-size:11px">{html.escape(summary)}</div>'
    )


def _sum_series(series: dict[str, list[tuple[float, int]]]) -> list[tuple[float, int]]:
    events = sorted((t, label, v) for label, pts in series.items() for t, v in pts)
    current: dict[str, int] = {}
    out = []
    for t, label, v in events:
        current[label] = v
        out.append((t, sum(current.values())))
    return out


class MemoryTimeline:
    """A running job's memory as HTML (:attr:`html`); call :meth:`refresh` often."""

    def __init__(self, run: Any) -> None:
        from nbgpu.profile.live import MemoryFollower  # noqa: PLC0415

        self.run = run
        self.follower = MemoryFollower(run.dir, run.config.world_size)
        self.html = timeline_svg({}, "")
        self._last = 0.0
        self.updates = 0

    def refresh(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < REFRESH_S:
            return
        self._last = now
        summary = self.follower.summary() or ""
        series = {r.label: list(r.points) for r in self.follower.ranks.values() if r.points}
        self.html = timeline_svg(series, summary)
        self.updates += 1

    def record(self) -> tuple[str, str]:
        """(text, html) of the final timeline, for the run's static record."""
        self.refresh(force=True)
        summary = self.follower.summary() or "no memory records (sampling off?)"
        return f"memory: {summary}", self.html
