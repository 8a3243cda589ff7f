"""What a run's face shows: live (the picked rank's newest lines) and once it ended.

The live face and the record are the two states of a run's
:class:`~nbgpu.notebook.live.LiveView`: both are static HTML and text, so a notebook
saved at any moment holds a readable picture. The record has the run's headline, a
state badge per rank, each rank's last lines (and how many earlier lines only its
``rank{N}.log`` holds, with the path), the run's summary (ranks table, failure
summary, diagnosis) and the ranks' memory over time.

Pure rendering over a :class:`~nbgpu.launch.run.Run` (duck-typed) and the tails that
the view kept; no IPython, no ipywidgets.
"""

from __future__ import annotations

import html
import re
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbgpu._render import ROOT_STYLE, to_html, to_text
from nbgpu.notebook.live import svg_img

__all__ = [
    "RECORD_TAIL_LINES",
    "MemoryTimeline",
    "RankTail",
    "Tails",
    "TeeToTails",
    "badges",
    "badges_html",
    "badges_text",
    "live_html",
    "live_text",
    "record_bundle",
    "record_html",
    "record_text",
    "scroll_box",
    "strip_ansi",
    "timeline_svg",
]

#: Lines per rank a saved notebook keeps (the panel shows more; the log has all).
RECORD_TAIL_LINES = 40
# Any CSI sequence (colours, cursor moves) and the two-byte escapes: a static record
# is read where nothing interprets them.
_ANSI = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|[@-Z\\-_])")

_COLORS = {
    "running": "#2a7ae2",
    "ok": "#2e8b57",
    "failed": "#c0392b",
    "stopped": "#7f8c8d",
}


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


@dataclass(frozen=True)
class RankTail:
    """The last lines of one rank's output, and how many came before them."""

    label: str  # "rank0"
    lines: tuple[str, ...]
    total_lines: int  # every line the rank printed so far
    log: Path

    @property
    def earlier_lines(self) -> int:
        """Lines not in :attr:`lines`: only in :attr:`log`."""
        return self.total_lines - len(self.lines)

    def earlier_note(self) -> str | None:
        n = self.earlier_lines
        if n <= 0:
            return None
        return f"{n:,} earlier line{'s' if n != 1 else ''} only in {self.log}"


class Tails:
    """Each rank's newest lines and line count, fed from the run's reader thread."""

    def __init__(self, logs: Mapping[str, Path], keep: int) -> None:
        self._lock = threading.Lock()
        self._logs = {label: Path(p) for label, p in logs.items() if label.startswith("rank")}
        self._lines: dict[str, deque[str]] = {label: deque(maxlen=keep) for label in self._logs}
        self._counts = dict.fromkeys(self._logs, 0)

    @property
    def labels(self) -> list[str]:
        return list(self._logs)

    def extend(self, label: str, lines: list[str]) -> bool:
        """Keep *lines* of *label*; False (nothing kept) for a label that is not a rank."""
        if label not in self._lines:
            return False
        with self._lock:
            self._lines[label].extend(lines)
            self._counts[label] += len(lines)
        return True

    def tail(self, label: str, last: int | None = None) -> RankTail:
        with self._lock:
            lines = tuple(self._lines[label])
            total = self._counts[label]
        if last is not None:
            lines = lines[-last:] if last else ()
        return RankTail(label, lines, total, self._logs[label])

    def all(self, last: int | None = None) -> list[RankTail]:
        return [self.tail(label, last) for label in self._logs]


class TeeToTails:
    """A line sink that keeps tails for the record and passes everything to *inner*."""

    def __init__(self, inner: Any, tails: Tails) -> None:
        self.inner = inner
        self.tails = tails

    def add(self, label: str, lines: list[str]) -> None:
        self.tails.extend(label, lines)
        self.inner.add(label, lines)

    def flush(self) -> None:
        self.inner.flush()

    def finish(self, log_hint: str) -> None:
        self.inner.finish(log_hint)


# -- badges -----------------------------------------------------------------------------


def badges(run: Any) -> list[tuple[int, str, str]]:
    """(rank, colour name, text) per rank: 'rank0 · GPU 1: running', 'rank1: exit 1 …'."""
    states = {r.rank: run._rank_state(r) for r in run.ranks}
    out = []
    for r in range(run.config.world_size):
        state = states.get(r)
        if state is None:
            kind = "running" if not run.done else _kind_of_run(run.state)
            text = "running" if not run.done else run.state.replace("_", " ")
        elif state == "ok":
            kind, text = "ok", "ok"
        elif run.stop_reason is not None and run.root_cause is None:
            # Stopped by the user, a timeout or an interrupt: grey, not a crash's red.
            kind = "failed" if run.state == "timed_out" else "stopped"
            text = state
        else:
            kind, text = "failed", state
        if run.root_cause is not None and run.root_cause.rank == r:
            text += " (root cause)"
        gpu = run.rank_gpu(r)
        where = f"rank{r} · GPU {gpu}" if gpu is not None else f"rank{r}"
        out.append((r, kind, f"{where}: {text}"))
    return out


def _kind_of_run(state: str) -> str:
    return {"succeeded": "ok", "stopped": "stopped", "interrupted": "stopped"}.get(state, "failed")


def badges_html(run: Any) -> str:
    return "".join(
        f'<span style="background:{_COLORS[kind]};color:white;border-radius:3px;'
        f'padding:1px 6px;margin-right:4px;white-space:nowrap">{html.escape(text)}</span>'
        for _, kind, text in badges(run)
    )


def badges_text(run: Any) -> str:
    return " | ".join(text for _, _, text in badges(run))


# -- the record -------------------------------------------------------------------------


def live_text(run: Any, tail: RankTail | None, last: int = 10) -> str:
    """The plain-text face of a live panel: headline, badges, the shown rank's newest lines."""
    lines = [run._headline(), badges_text(run)]
    if tail is not None:
        lines.append(f"--- {tail.label}: {_tail_heading(tail)}")
        lines.extend(strip_ansi(line) for line in tail.lines[-last:])
    return "\n".join(lines)


def live_html(
    run: Any, tail: RankTail | None, memory: str, height: str, note: str | None = None
) -> str:
    """The HTML face of a live panel: what it shows while the run lives, and what a
    notebook saved meanwhile keeps."""
    parts = [
        f"<b>{html.escape(run._headline())}</b>",
        f"<div>{badges_html(run)}</div>",
        f'<div style="font-size:11px">logs: <code>{html.escape(str(run.dir))}</code></div>',
    ]
    if note:
        parts.append(f'<div style="font-size:11px">{html.escape(note)}</div>')
    if tail is not None:
        text = "\n".join(tail.lines)
        earlier = tail.earlier_note()
        if earlier:
            text = f"… {earlier}\n{text}"
        parts.append(
            f'<div style="font-size:11px">{html.escape(tail.label)} · {_tail_heading(tail)}</div>'
        )
        parts.append(scroll_box(text, height))
    parts.append(memory)
    return f'<div class="nbgpu" style="{ROOT_STYLE}">{"".join(parts)}</div>'


def scroll_box(text: str, height: str = "16em") -> str:
    """*text* in a box of at most *height* that shows its newest (last) line.

    ``column-reverse`` anchors the scroll position at the end of the content, so the
    box opens at the bottom and stays there as it is re-rendered: no script needed,
    which a saved notebook could not run anyway.
    """
    return (
        f'<div class="nbgpu-scroll" style="max-height:{height};overflow:auto;display:flex;'
        'flex-direction:column-reverse;border:1px solid #ddd;margin:2px 0 6px 0">'
        '<pre style="flex:none;margin:0;padding:2px 6px;white-space:pre-wrap;font-size:12px">'
        f"{html.escape(strip_ansi(text))}</pre></div>"
    )


def _tail_heading(tail: RankTail) -> str:
    shown = len(tail.lines)
    if tail.total_lines == 0:
        return "no output"
    if tail.earlier_lines > 0:
        return f"last {shown:,} of {tail.total_lines:,} lines"
    return f"{shown:,} line{'s' if shown != 1 else ''}"


def _open_rank(run: Any) -> int:
    # Open the rank a reader needs first: the root cause, else rank 0.
    return run.root_cause.rank if getattr(run, "root_cause", None) is not None else 0


def record_html(run: Any, tails: Iterable[RankTail], extra: Iterable[tuple[str, str]] = ()) -> str:
    tails = list(tails)
    states = {r: text for r, _, text in badges(run)}
    sections = [
        f"<b>{html.escape(run._headline())}</b>",
        f"<div>{badges_html(run)}</div>",
    ]
    opened = _open_rank(run)
    for number, tail in enumerate(tails):
        state = states.get(number, tail.label)
        note = tail.earlier_note()
        body = strip_ansi("\n".join(tail.lines)) if tail.lines else "(no output)"
        if note:
            body = f"… {note}\n{body}"
        sections.append(
            f"<details{' open' if number == opened else ''}><summary>"
            f"{html.escape(state)} · {html.escape(_tail_heading(tail))}</summary>"
            f"{scroll_box(body)}</details>"
        )
    # The record opens with the headline already; the summary need not repeat it.
    sections.append(to_html(run.summary_blocks()))
    sections.extend(html_part for _, html_part in extra)
    return f'<div class="nbgpu nbgpu-record" style="{ROOT_STYLE}">{"".join(sections)}</div>'


def record_text(run: Any, tails: Iterable[RankTail], extra: Iterable[tuple[str, str]] = ()) -> str:
    lines = [run._headline(), badges_text(run)]
    for tail in tails:
        lines.append(f"--- {tail.label}: {_tail_heading(tail)}")
        note = tail.earlier_note()
        if note:
            lines.append(f"… {note}")
        lines.extend(strip_ansi(line) for line in tail.lines)
    lines.append("---")
    lines.extend(to_text(run.summary_blocks()).splitlines())
    lines.extend(text_part for text_part, _ in extra)
    return "\n".join(lines)


def record_bundle(
    run: Any, tails: Iterable[RankTail], extra: Iterable[tuple[str, str]] = ()
) -> dict[str, str]:
    """text/plain and text/html of the record, for ``display(..., raw=True)``."""
    tails = list(tails)
    extra = list(extra)
    return {
        "text/plain": record_text(run, tails, extra),
        "text/html": record_html(run, tails, extra),
    }


# -- the memory timeline ----------------------------------------------------------------
# One line per rank and the node's total, drawn as a small SVG image (no matplotlib in the
# refresh loop: a redraw costs microseconds), read at most once a second from the ranks'
# memory records (:class:`nbgpu.profile.live.MemoryFollower`). The full figure is
# ``%gpu_memory NAME`` once the run is over.

MEMORY_REFRESH_S = 1.0
_LINE_COLOURS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
)
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
        color = _LINE_COLOURS[i % len(_LINE_COLOURS)]
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
        if not force and now - self._last < MEMORY_REFRESH_S:
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
