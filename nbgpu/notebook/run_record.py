"""What a run's face shows: live (the picked rank's newest lines) and once it ended.

Both states of a run's :class:`~nbgpu.notebook.live.LiveView` are static HTML and text,
so a notebook saved at any moment holds a readable picture. Pure rendering over a
:class:`~nbgpu.launch.run.Run` (duck-typed); no IPython, no ipywidgets.
"""

import html
import re
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbgpu._render import ROOT_STYLE, rank_colour, to_html, to_text
from nbgpu.notebook.live import Bundle, svg_img
from nbgpu.sizes import fmt_bytes

__all__ = ["MemoryTimeline", "RankTail", "Tails", "live_bundle", "record_bundle", "strip_ansi"]

#: Lines per rank a saved notebook keeps (the panel shows more; the log has all).
RECORD_TAIL_LINES = 40
#: Height of the live panel's scroll area: it stays this size however much a rank prints.
LIVE_HEIGHT = "20em"
# CSI sequences (colours, cursor moves) and two-byte escapes: a static record shows them raw.
_ANSI = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|[@-Z\\-_])")
_BADGE_COLOURS = {
    "running": "#2a7ae2",
    "ok": "#2e8b57",
    "failed": "#c0392b",
    "stopped": "#7f8c8d",
    "idle": "#7f8c8d",
}
_SMALL = '<div style="font-size:11px">'
_RUN_KINDS = {"succeeded": "ok", "stopped": "stopped", "interrupted": "stopped"}


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


@dataclass(frozen=True)
class RankTail:
    """The last lines of one rank's output, and how many came before them."""

    label: str  # "rank0"
    lines: tuple[str, ...]
    total_lines: int  # every line the rank printed so far
    log: Path

    def earlier_note(self) -> str | None:
        n = self.total_lines - len(self.lines)  # the lines only the log holds
        return f"{n:,} earlier line{'s' if n != 1 else ''} only in {self.log}" if n > 0 else None

    def heading(self) -> str:
        shown = len(self.lines)
        if self.total_lines == 0:
            return "no output"
        if self.total_lines > shown:
            return f"last {shown:,} of {self.total_lines:,} lines"
        return f"{shown:,} line{'s' if shown != 1 else ''}"

    def text(self) -> str:
        note = self.earlier_note()
        body = "\n".join(self.lines)
        return f"… {note}\n{body}" if note else body


class Tails:
    """Each rank's newest lines and line count, fed from the run's reader thread."""

    def __init__(self, logs: Mapping[str, Path], keep: int = 200) -> None:
        self._lock = threading.Lock()
        self._logs = {label: Path(p) for label, p in logs.items() if label.startswith("rank")}
        self._lines: dict[str, deque[str]] = {label: deque(maxlen=keep) for label in self._logs}
        self._counts = dict.fromkeys(self._logs, 0)

    @property
    def labels(self) -> list[str]:
        return list(self._logs)

    def extend(self, label: str, lines: list[str]) -> None:
        if label in self._lines:
            with self._lock:
                self._lines[label].extend(lines)
                self._counts[label] += len(lines)

    def tail(self, label: str, last: int | None = None) -> RankTail:
        with self._lock:
            lines, total = tuple(self._lines[label]), self._counts[label]
        if last is not None:
            lines = lines[-last:] if last else ()
        return RankTail(label, lines, total, self._logs[label])


def _badges(run: Any) -> list[tuple[int, str, str]]:
    """(rank, colour name, text) per rank: 'rank0 · GPU 1: running', 'rank1: exit 1 …'."""
    states = {r.rank: run._rank_state(r) for r in run.ranks}
    out = []
    for r in range(run.config.world_size):
        state = states.get(r)
        if (state is None and not run.done) or state in ("ok", "idle"):  # idle: not in the cell
            kind = text = state or "running"
        elif state is None:
            kind, text = _RUN_KINDS.get(run.state, "failed"), run.state.replace("_", " ")
        elif run.stop_reason is not None and run.root_cause is None:
            # Stopped by the user, a timeout or an interrupt: grey, not a crash's red.
            kind = "failed" if run.state in ("timed_out", "hung") else "stopped"
            text = state
        else:
            kind, text = "failed", state
        if run.root_cause is not None and run.root_cause.rank == r:
            text += " (root cause)"
        gpu = run.rank_gpu(r)
        where = f"rank{r} · GPU {gpu}" if gpu is not None else f"rank{r}"
        out.append((r, kind, f"{where}: {text}"))
    return out


def _head(run: Any) -> tuple[list[str], list[str], list[tuple[int, str, str]]]:
    """The headline and the badges, as text lines and HTML parts (and the badges)."""
    headline, ranks = run._headline(), _badges(run)
    row = "".join(
        f'<span style="background:{_BADGE_COLOURS[kind]};color:white;border-radius:3px;'
        f"border-left:6px solid {rank_colour(r)};padding:1px 6px;margin-right:4px;"
        f'white-space:nowrap">{html.escape(text)}</span>'
        for r, kind, text in ranks
    )
    text = [headline, " | ".join(text for _, _, text in ranks)]
    return text, [f"<b>{html.escape(headline)}</b>", f"<div>{row}</div>"], ranks


def live_bundle(run: Any, tail: RankTail | None, memory: str, note: str | None = None) -> Bundle:
    """The face of a live panel: what it shows while the run lives, and what a notebook
    saved meanwhile keeps (the shown rank's newest lines; the text keeps the last 10)."""
    text, parts, _ = _head(run)
    parts.append(f"{_SMALL}logs: <code>{html.escape(str(run.dir))}</code></div>")
    if note:
        parts.append(f"{_SMALL}{html.escape(note)}</div>")
    if tail is not None:
        text.append(f"--- {tail.label}: {tail.heading()}")
        text.extend(strip_ansi(line) for line in tail.lines[-10:])
        parts.append(f"{_SMALL}{html.escape(tail.label)} · {tail.heading()}</div>")
        parts.append(_scroll_box(tail.text(), LIVE_HEIGHT))
    parts.append(memory)
    page = f'<div class="nbgpu" style="{ROOT_STYLE}">{"".join(parts)}</div>'
    return {"text/plain": "\n".join(text), "text/html": page}


def _scroll_box(text: str, height: str = "16em") -> str:
    """*text* in a box of at most *height* that opens at its newest (last) line:
    ``column-reverse`` anchors the scroll position at the end, with no script (which a
    saved notebook could not run)."""
    return (
        f'<div class="nbgpu-scroll" style="max-height:{height};overflow:auto;display:flex;'
        'flex-direction:column-reverse;border:1px solid #ddd;margin:2px 0 6px 0">'
        '<pre style="flex:none;margin:0;padding:2px 6px;white-space:pre-wrap;font-size:12px">'
        f"{html.escape(strip_ansi(text))}</pre></div>"
    )


def record_bundle(run: Any, tails: Tails, extra: Iterable[tuple[str, str]] = ()) -> Bundle:
    """The run's record as text/plain and text/html, for ``display(..., raw=True)``:
    each rank's last lines, the run's summary, then *extra* (text, HTML) parts."""
    text, parts, ranks = _head(run)
    states = {r: state for r, _, state in ranks}
    # Open the rank a reader needs first: the root cause, else rank 0.
    opened = run.root_cause.rank if getattr(run, "root_cause", None) is not None else 0
    for number, label in enumerate(tails.labels):
        tail = tails.tail(label, RECORD_TAIL_LINES)
        text.append(f"--- {tail.label}: {tail.heading()}")
        if note := tail.earlier_note():
            text.append(f"… {note}")
        text.extend(strip_ansi(line) for line in tail.lines)
        parts.append(
            f"<details{' open' if number == opened else ''}><summary>"
            f'<span style="color:{rank_colour(number)}">■</span> '
            f"{html.escape(states.get(number, tail.label))} · {html.escape(tail.heading())}"
            f"</summary>{_scroll_box(tail.text() if tail.lines else '(no output)')}</details>"
        )
    # The record opens with the headline already; the summary need not repeat it.
    summary = run.summary_blocks()
    text += ["---", *to_text(summary).splitlines()]
    parts.append(to_html(summary))
    for text_part, html_part in extra:
        text.append(text_part)
        parts.append(html_part)
    page = f'<div class="nbgpu nbgpu-record" style="{ROOT_STYLE}">{"".join(parts)}</div>'
    return {"text/plain": "\n".join(text), "text/html": page}


# -- the memory timeline ----------------------------------------------------------------
# One line per rank and the node's total, as a small SVG image (no matplotlib in the
# refresh loop: a redraw costs microseconds), read at most once a second from the ranks'
# memory records. The full figure is ``%gpu_memory NAME`` once the run is over.

MEMORY_REFRESH_S = 1.0


def _timeline_svg(
    series: dict[int, list[tuple[float, int]]], summary: str, *, width: int = 560, height: int = 120
) -> str:
    """Each rank's line (seconds, bytes) and their sum, with the summary line under them
    (an image: untrusted notebooks strip inline SVG)."""
    points = [p for pts in series.values() for p in pts]
    if not points:
        return f'<div style="font-size:11px;color:#666">{html.escape(summary or "memory: waiting for the first samples…")}</div>'
    t0 = min(t for t, _ in points)
    t1 = max(max(t for t, _ in points) - t0, 1.0)
    # The node's total: each rank's latest value, summed at every sample.
    current: dict[int, int] = {}
    total = []
    for t, rank, v in sorted((t, rank, v) for rank, pts in series.items() for t, v in pts):
        current[rank] = v
        total.append((t, sum(current.values())))
    top = max(*(v for _, v in total), 1) * 1.15

    def xy(t: float, v: int) -> str:
        x, y = (t - t0) / t1 * (width - 40) + 36, height - 14 - v / top * (height - 24)
        return f"{x:.1f},{y:.1f}"

    head = f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}"'
    parts = [
        f'{head} font-family="sans-serif" font-size="10">',
        f'<text x="2" y="12">{fmt_bytes(int(top))}</text>',  # its unit read from the values
        f'<text x="2" y="{height - 16}">0</text>',
        f'<text x="{width - 60}" y="{height - 2}">{t1:.0f} s</text>',
    ]
    lines = [(rank_colour(rank), 1.2, pts) for rank, pts in series.items()]
    for colour, stroke, pts in [*lines, ("black", 2, total)]:
        line = " ".join(xy(t, v) for t, v in pts)
        parts.append(
            f'<polyline fill="none" stroke="{colour}" stroke-width="{stroke}" points="{line}"/>'
        )
    keys = [(f"rank{r}", rank_colour(r)) for r in series]
    if len(keys) > 8:  # more names would run off the image
        keys = [(f"{len(keys)} ranks", "#666")]
    for i, (key, colour) in enumerate([*keys, ("node", "black")]):
        parts.append(f'<text x="{40 + 52 * i}" y="{height - 2}" fill="{colour}">{key}</text>')
    parts.append("</svg>")
    return svg_img("".join(parts), "memory per rank") + f"{_SMALL}{html.escape(summary)}</div>"


class MemoryTimeline:
    """A running job's memory as HTML (:attr:`html`); call :meth:`refresh` often."""

    def __init__(self, run: Any) -> None:
        from nbgpu.profile.live import MemoryFollower  # noqa: PLC0415

        self.follower = MemoryFollower(run.dir, run.config.world_size)
        self.html = _timeline_svg({}, "")
        self.updates = 0

    def refresh(self, *, force: bool = False, final: str | None = None) -> None:
        if not (self.follower.due(MEMORY_REFRESH_S) or force):
            return
        summary = self.follower.summary() or ""
        series = {rank: list(r.points) for rank, r in self.follower.ranks.items() if r.points}
        self.html = _timeline_svg(series, final or summary)
        self.updates += 1

    def record(self) -> tuple[str, str]:
        """(text, html) for the run's record: its peak, not the last sample of a run now over."""
        from nbgpu.profile.report import memory_report  # noqa: PLC0415

        report = memory_report(self.follower.run_dir)
        peak = report.peak_line() or "no memory records (sampling off?)"
        self.refresh(force=True, final=peak)
        return f"memory: {peak}", self.html
