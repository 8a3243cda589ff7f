"""The memory figure: every rank over time, phases as bands, the node's total, the limits.

Built on ``matplotlib.figure.Figure`` (no pyplot state, no backend switch), so it
renders the same in a kernel, a terminal (``--png``) and a saved notebook. It draws a
:class:`~nbgpu.profile.records.MemoryTimeline` (the report is one, and shows the
figure as its own: no import back).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nbgpu._render import rank_colour
from nbgpu.profile.records import ranks_text, unit_of
from nbgpu.sizes import fmt_bytes

if TYPE_CHECKING:
    from nbgpu.profile.records import MemoryTimeline, RankRecords

__all__ = ["draw"]

_PHASE_COLORS = (
    "#8dd3c7", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5", "#bc80bd",
    "#ccebc5", "#ffed6f",
)  # fmt: skip
_NOTE: dict[str, Any] = {"textcoords": "offset points", "fontsize": 9, "fontweight": "bold"}
_NOTE["bbox"] = {"fc": "white", "ec": "none", "alpha": 0.8, "pad": 1}  # no line strikes it through
_BAND: dict[str, Any] = {"ha": "center", "va": "bottom", "fontsize": 7, "color": "#555"}
_NAMED = 16  # ranks named one by one (legend, phase rows); more would cover each other


def draw(report: MemoryTimeline, *, title: str | None = None) -> Any:  # noqa: PLR0915  (one figure, top to bottom)
    from matplotlib.figure import Figure  # noqa: PLC0415

    ranks = [r for r in report.ranks if r.samples or r.phases]
    gpu = report.has_gpu
    bars_height = 0.35 * min(len(ranks), _NAMED) + 0.4
    heights = [3.0, 1.8, bars_height] if gpu else [3.0, bars_height]
    fig = Figure(figsize=(10, sum(heights) + 0.9), layout="constrained")
    axes = fig.subplots(len(heights), 1, sharex=True, gridspec_kw={"height_ratios": heights})
    host, bars = axes[0], axes[-1]
    spans = (s for r in report.ranks for s in sorted(r.phases, key=lambda s: s.start_t))
    entered = dict.fromkeys(s.name for s in spans)  # the order phases were first entered
    colors = {n: _PHASE_COLORS[i % len(_PHASE_COLORS)] for i, n in enumerate(entered)}
    # One node: the sum of all ranks. Several: a sum per node (its own memory), the highest named.
    names: list[str | None] = [*report.node_names] or [None]
    sums = [(name, report.node_series(name)) for name in names] if len(ranks) > 1 else []
    lines = [report.host_series(rank) for rank in ranks]
    largest = max((v for line in [*lines, *(s for _, s in sums)] for _, v in line), default=0)
    scale, unit = unit_of(largest)
    x_end = max((line[-1][0] for line in lines if line), default=0.0) or 1.0
    deaths: dict[str, list[tuple[RankRecords, float, float]]] = {}
    for i, (rank, line) in enumerate(zip(ranks, lines, strict=True)):
        xs, ys = [t for t, _v in line], [v / scale for _t, v in line]
        label = rank.label if len(ranks) <= _NAMED else "_" if i else f"{len(ranks)} ranks"
        # Steps, not slopes: between two samples the value is unknown, and a straight
        # line would invent a gradual climb (a rank holding the GIL takes no samples).
        host.step(xs, ys, where="post", linewidth=1.2, label=label, color=rank_colour(rank.label))
        if rank.died_in is not None and xs:
            host.plot([xs[-1]], [ys[-1]], marker="X", markersize=11, color="#c0392b", zorder=5)
            deaths.setdefault(rank.died_in.path, []).append((rank, xs[-1], ys[-1]))
    for name, node in sums:
        label = f"node {name}: its ranks (Σ PSS)" if name else "node: all ranks (Σ PSS)"
        style = {"color": "black"} if name is None else {"linestyle": "-."}
        xs, ys = [s[0] for s in node], [s[1] / scale for s in node]
        host.step(xs, ys, where="post", linewidth=2.2, label=label, **style)
    # One label per phase ranks died in, at the latest death: ranks that died together are
    # one event, not labels stacked into a smear. Then the node's peak.
    notes: list[tuple[str, tuple[float, float], str]] = []  # (text, at, colour)
    for path, dead in deaths.items():
        numbers = tuple(rank.rank or 0 for rank, _x, _y in dead)
        who = dead[0][0].label if len(dead) == 1 else ranks_text(numbers)
        _rank, x, y = max(dead, key=lambda d: d[1])
        notes.append((f"{who} died in '{path}'", (x, y), "#c0392b"))
    peak = report.node_peak() if len(ranks) > 1 else None
    if peak is not None:
        where = f" · all in '{peak.all_in}'" if peak.all_in else ""
        text = f"node peak{f' ({peak.node})' if peak.node else ''} {fmt_bytes(peak.total_bytes)}"
        notes.append((text + where, (peak.t_s, peak.total_bytes / scale), "black"))
    for text, (x, y), colour in notes:
        # Near the right edge the text ends at the point: inside the axes.
        offset, align = (-8, "right") if x > 0.6 * x_end else (8, "left")
        host.annotate(text, (x, y), xytext=(offset, 6), ha=align, color=colour, **_NOTE)
    host.set_ylim(0, max(largest * 1.25, scale / 10) / scale)
    _limit_line(host, report.mem_total_bytes, "machine memory", ("#c0392b", "--"), scale)
    _limit_line(host, report.mem_limit_bytes, "--mem-limit (per rank)", ("#d35400", ":"), scale)
    host.set_ylabel(f"host {unit} (PSS)")
    host.grid(alpha=0.3)
    host.legend(loc="upper left", fontsize=8, ncol=4, framealpha=0.85)
    _bands(host, report, colors)
    if gpu:
        ax = axes[1]
        pts = [[p for p in report.points(r) if isinstance(p.get("gpu_alloc"), int)] for r in ranks]
        scale, unit = unit_of(max((p["gpu_alloc"] for ps in pts for p in ps), default=0))
        for rank, points in zip(ranks, pts, strict=True):
            xs = [p["t"] - report.origin for p in points]
            ys = [p["gpu_alloc"] / scale for p in points]
            ax.step(xs, ys, where="post", linewidth=1.2, color=rank_colour(rank.label))
        ax.set_ylabel(f"GPU {unit}\n(allocated)")
        ax.grid(alpha=0.3)
        _bands(ax, report, colors, labels=False)
    _gantt(bars, ranks, report.origin, colors)
    kernel = report.source == "this kernel"  # not a run: its clock starts at its first record
    bars.set_xlabel("seconds since the " + ("first phase" if kernel else "run started"))
    heading = title or f"Memory of {report.source}"
    if not gpu:
        heading += f"  (no GPU figures: CUDA not used by {'the kernel' if kernel else 'any rank'})"
    if report.simulated:
        heading += f"  · SIMULATED fleet '{report.simulated}'"
    fig.suptitle(heading, fontsize=11)
    _declutter(fig, host)
    return fig


def _declutter(fig: Any, ax: Any) -> None:
    """Let no two texts of *ax* (nor one and the legend) cover each other: an annotation
    steps down a line at a time, a phase band's name (the Gantt rows name it too) is left out."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    from matplotlib.text import Annotation  # noqa: PLC0415

    renderer = FigureCanvasAgg(fig).get_renderer()  # type: ignore[no-untyped-call]  # unannotated
    fig.draw_without_rendering()  # the layout places the texts
    taken = [ax.get_legend().get_window_extent(renderer)]
    for text in sorted(ax.texts, key=lambda t: not isinstance(t, Annotation)):
        box = text.get_window_extent(renderer)
        steps = 6 if isinstance(text, Annotation) else 0  # a band's name is only left out
        while steps and any(box.overlaps(other) for other in taken):
            steps -= 1
            text.xyann = (text.xyann[0], text.xyann[1] - box.height * 72 / fig.dpi - 2)
            box = text.get_window_extent(renderer)
        text.set_visible(not any(box.overlaps(other) for other in taken))
        if text.get_visible():
            taken.append(box)


def _limit_line(ax: Any, value: int | None, label: str, look: tuple[str, str], scale: int) -> None:
    """A limit's line; far above the data, in the legend only (not every line at the floor)."""
    if value:
        off = " (off scale)" if value / scale > ax.get_ylim()[1] else ""
        text = f"{label} {fmt_bytes(value)}{off}"
        ax.axhline(value / scale, color=look[0], linestyle=look[1], linewidth=1.3, label=text)


def _bands(ax: Any, report: MemoryTimeline, colors: dict[str, str], *, labels: bool = True) -> None:
    """Shade the top-level phases of the first rank with records, labelled on top."""
    first = next((r for r in report.ranks if r.phases), None)
    if first is None:
        return
    t0, along = report.origin, ax.get_xaxis_transform()  # x in seconds, y in axes fractions
    for span in (s for s in first.phases if not s.depth):
        end = first.span_end(span)
        ax.axvspan(
            span.start_t - t0, end - t0, color=colors.get(span.name, "#ddd"), alpha=0.18, lw=0
        )
        if labels and end - span.start_t > 0:
            middle = (span.start_t + end) / 2 - t0
            ax.text(middle, 0.02, span.name, transform=along, clip_on=True, **_BAND)


def _gantt(ax: Any, ranks: list[RankRecords], t0: float, colors: dict[str, str]) -> None:
    step = -(-len(ranks) // _NAMED)  # every step-th row named: the names never overlap
    ax.set_yticks(range(0, len(ranks), step), [r.label for r in ranks[::step]], fontsize=8)
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
                linewidth=2 / step if span.status == "died in" else 0.4,
            )
            seen.setdefault(span.name, bar)
            if span.status == "died in":
                ax.plot([end - t0], [row], marker="X", color="#c0392b", markersize=9 / step)
    ax.set_ylabel("phases")
    handles, names = list(seen.values()), list(seen)
    ax.legend(handles, names, loc="upper left", bbox_to_anchor=(1, 1), fontsize=7, frameon=False)
