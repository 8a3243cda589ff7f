"""The memory figure: every rank over time, phases as bands, the node's total, the limits.

Built on ``matplotlib.figure.Figure`` (no pyplot state, no backend switch), so it
renders the same in a kernel, a terminal (``--png``) and a saved notebook. It draws a
:class:`~nbgpu.profile.records.MemoryTimeline` (the report is one, and shows the
figure as its own: no import back).
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nbgpu.profile.records import MemoryTimeline, RankRecords

__all__ = ["draw", "png_bytes"]

_GIB = 1024**3
_PHASE_COLORS = (
    "#8dd3c7", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5", "#bc80bd",
    "#ccebc5", "#ffed6f",
)  # fmt: skip


def draw(report: MemoryTimeline, *, title: str | None = None) -> Any:  # noqa: PLR0915  (one figure, top to bottom)
    from matplotlib.figure import Figure  # noqa: PLC0415

    ranks = [r for r in report.ranks if r.samples or r.phases]
    gpu = report.has_gpu
    bars_height = 0.35 * max(len(ranks), 1) + 0.4
    heights = [3.0, 1.8, bars_height] if gpu else [3.0, bars_height]
    fig = Figure(figsize=(10, sum(heights) + 0.9), layout="constrained")
    axes = fig.subplots(len(heights), 1, sharex=True, gridspec_kw={"height_ratios": heights})
    host, bars = axes[0], axes[-1]
    t0 = report.origin
    spans = (s for r in report.ranks for s in sorted(r.phases, key=lambda s: s.start_t))
    entered = dict.fromkeys(s.name for s in spans)  # the order phases were first entered
    colors = {n: _PHASE_COLORS[i % len(_PHASE_COLORS)] for i, n in enumerate(entered)}
    line_colors = {}
    peak_seen = 0.0
    report_end = max((r.last_t or t0) - t0 for r in ranks) if ranks else 1.0
    for rank in ranks:
        series = report.host_series(rank)
        xs = [t for t, _v in series]
        ys = [v / _GIB for _t, v in series]
        # Steps, not slopes: between two samples the value is unknown, and a straight
        # line would invent a gradual climb (a rank holding the GIL takes no samples).
        (line,) = host.step(xs, ys, where="post", linewidth=1.2, label=rank.label)
        line_colors[rank.label] = line.get_color()
        peak_seen = max([peak_seen, *ys])
        died = rank.died_in
        if died is not None and xs:
            host.plot([xs[-1]], [ys[-1]], marker="X", markersize=11, color="#c0392b", zorder=5)
            late = xs[-1] > 0.6 * max(report_end, 1e-9)
            text = f"{rank.label} died in '{died.path}'"
            _label(host, text, (xs[-1], ys[-1]), (-8 if late else 6, 6), color="#c0392b")
    # One node: the sum of all ranks. Several: a sum per node (its own memory), the highest named.
    names: list[str | None] = [*report.node_names] or [None]
    sums = [(name, report.node_series(name)) for name in names]
    for name, node in sums:
        if len(ranks) < 2 or not node:
            continue
        xs = [s[0] for s in node]
        ys = [s[1] / _GIB for s in node]
        label = f"node {name}: its ranks (Σ PSS)" if name else "node: all ranks (Σ PSS)"
        style = {"color": "black"} if name is None else {"linestyle": "-."}
        host.step(xs, ys, where="post", linewidth=2.2, label=label, **style)
    peak = report.node_peak() if len(ranks) > 1 else None
    if peak is not None:  # then some node's series has points: the peak is one of them
        peak_seen = max(peak_seen, peak.total_bytes / _GIB)
        where = f" · all in '{peak.all_in}'" if peak.all_in else ""
        on = f" ({peak.node})" if peak.node else ""
        right = peak.t_s > 0.6 * (max(s[0] for _name, node in sums for s in node) or 1)
        text = f"node peak{on} {peak.total_bytes / _GIB:.2f} GiB{where}"
        xy = (peak.t_s, peak.total_bytes / _GIB)
        _label(host, text, xy, (-8 if right else 8, 4), va="bottom")
    top = max(peak_seen * 1.25, 0.1)
    _limit_line(host, report.mem_total_bytes, "machine memory", "#c0392b", "--", top)
    _limit_line(host, report.mem_limit_bytes, "--mem-limit (per rank)", "#d35400", ":", top)
    host.set_ylim(0, top)
    host.set_ylabel("host GiB (PSS)")
    host.grid(alpha=0.3)
    host.legend(loc="upper left", fontsize=8, ncol=min(4, len(ranks) + 2), framealpha=0.85)
    _bands(host, report, colors)
    if gpu:
        ax = axes[1]
        for rank in ranks:
            pts = [p for p in report.points(rank) if isinstance(p.get("gpu_alloc"), int)]
            xs = [p["t"] - t0 for p in pts]
            ys = [p["gpu_alloc"] / _GIB for p in pts]
            ax.step(xs, ys, where="post", linewidth=1.2, color=line_colors.get(rank.label))
        ax.set_ylabel("GPU GiB\n(allocated)")
        ax.grid(alpha=0.3)
        _bands(ax, report, colors, labels=False)
    _gantt(bars, ranks, t0, colors)
    bars.set_xlabel("seconds since the run started")
    heading = title or f"Memory of {report.source}"
    if not gpu:
        heading += "  (no GPU figures: no rank used CUDA)"
    if report.simulated:
        heading += f"  · SIMULATED fleet '{report.simulated}'"
    fig.suptitle(heading, fontsize=11)
    return fig


def _label(
    ax: Any, text: str, xy: tuple[float, float], offset: tuple[int, int], **style: Any
) -> None:
    # Near the right edge (offset to the left) the text ends at the point: inside the axes.
    ax.annotate(
        text,
        xy,
        textcoords="offset points",
        xytext=offset,
        ha="right" if offset[0] < 0 else "left",
        fontsize=9,
        fontweight="bold",
        **style,
    )


def _limit_line(  # noqa: PLR0917  (private; the line's look in one call)
    ax: Any, value: int | None, label: str, color: str, style: str, top: float
) -> None:
    if not value:
        return
    gib = value / _GIB
    if gib <= top * 1.6:
        ax.axhline(gib, color=color, linestyle=style, linewidth=1.3, label=f"{label} {gib:.1f} GiB")
    else:
        # Off the scale of the data: say it, rather than squash every line to the floor.
        ax.annotate(
            f"{label}: {gib:.1f} GiB (off scale)",
            xy=(1, 1),
            xycoords="axes fraction",
            xytext=(-4, -14 if "machine" in label else -28),
            textcoords="offset points",
            ha="right",
            color=color,
            fontsize=8,
        )


def _bands(ax: Any, report: MemoryTimeline, colors: dict[str, str], *, labels: bool = True) -> None:
    """Shade the top-level phases of the first rank with records, labelled on top."""
    first = next((r for r in report.ranks if r.phases), None)
    if first is None:
        return
    t0 = report.origin
    for span in (s for s in first.phases if not s.depth):
        end = first.span_end(span)
        ax.axvspan(
            span.start_t - t0, end - t0, color=colors.get(span.name, "#ddd"), alpha=0.18, lw=0
        )
        if labels and end - span.start_t > 0:
            ax.text(
                (span.start_t + end) / 2 - t0,
                0.02,
                span.name,
                transform=ax.get_xaxis_transform(),
                ha="center",
                va="bottom",
                fontsize=7,
                color="#555",
                clip_on=True,
            )


def _gantt(ax: Any, ranks: list[RankRecords], t0: float, colors: dict[str, str]) -> None:
    ax.set_yticks(range(len(ranks)), [r.label for r in ranks], fontsize=8)
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    seen: dict[str, Any] = {}
    for row, rank in enumerate(ranks):
        for span in rank.phases:
            end = rank.span_end(span)
            height = 0.8 if span.depth == 0 else 0.4
            bar = ax.broken_barh(
                [(span.start_t - t0, max(end - span.start_t, 1e-3))],
                (row - height / 2, height),
                facecolors=colors.get(span.name, "#ddd"),
                edgecolors="#c0392b" if span.status == "died in" else "#666",
                linewidth=2 if span.status == "died in" else 0.4,
            )
            seen.setdefault(span.name, bar)
            if span.status == "died in":
                ax.plot([end - t0], [row], marker="X", color="#c0392b", markersize=9)
    ax.set_ylabel("phases")
    ax.legend(
        list(seen.values()),
        list(seen),
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=7,
        frameon=False,
    )


def png_bytes(fig: Any, dpi: int = 96) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()
