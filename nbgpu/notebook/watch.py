"""``%gpu_watch``: a live GPU dashboard in the cell's output.

:mod:`nbgpu.devices.watch` samples; this face draws the samples as a
:class:`~nbgpu.notebook.live.LiveView` of static HTML, so a saved notebook keeps the last
picture. Sampling stops with the Stop button, ``--stop``, the kernel's end, or when the
front end has shown the dashboard nowhere for a few seconds (its output cleared, the
notebook closed: the controls count their views). The text view stops with ``--stop``
or the kernel only.
"""

from __future__ import annotations

import html
import threading
import time
from typing import Any

from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from nbgpu._render import ROOT_STYLE, fmt_opt, memory_bar_html, simulated_label, title_html
from nbgpu.notebook.live import LiveView, svg_img
from nbgpu.notebook.magics import parse_or_help, user_errors

__all__ = ["Dashboard", "WatchMagics", "chart_svg", "dashboard_html", "dashboard_text"]

_COLOURS = ("#1565c0", "#c62828", "#2e7d32", "#ef6c00", "#6a1b9a", "#00838f", "#ad1457", "#4e342e")
_BAD_STATES = ("dead", "zombie")  # holders drawn in red
#: Seconds a dashboard may go unseen (output cleared, notebook closed) before it stops.
ORPHAN_GRACE_S = 3.0
#: Dashboards of this kernel, so ``--stop`` and interpreter exit end every thread.
DASHBOARDS: list[Dashboard] = []


def chart_svg(samples: list[Any], metric: str, title: str, width: int = 420) -> str:
    """One SVG line chart, a line per GPU, 0-100 % on the y axis."""
    height, left, top = 110, 30, 16
    plot_w, plot_h = width - left - 8, height - top - 18
    if not samples:
        return (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">'
            f'<text x="4" y="12">{html.escape(title)}</text></svg>'
        )
    t0, t1 = samples[0].at, samples[-1].at
    span = max(t1 - t0, 1e-9)
    lines: dict[int, list[str]] = {}
    for sample in samples:
        x = left + plot_w * ((sample.at - t0) / span if len(samples) > 1 else 1.0)
        for gpu in sample.gpus:
            if (value := _percent(gpu, metric)) is not None:
                y = top + plot_h * (1 - value / 100)
                lines.setdefault(gpu.index, []).append(f"{x:.1f},{y:.1f}")
    parts = [
        (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'font-family="sans-serif" font-size="10" role="img" aria-label="{html.escape(title)}">'
        ),
        f'<text x="{left}" y="11" font-weight="bold">{html.escape(title)}</text>',
        f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#ccc"/>',
        f'<text x="2" y="{top + 8}">100</text><text x="14" y="{top + plot_h}">0</text>',
    ]
    for index, points in sorted(lines.items()):
        colour = _COLOURS[index % len(_COLOURS)]
        parts.append(
            f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{" ".join(points)}">'
            f"<title>GPU {index}</title></polyline>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _percent(gpu: Any, metric: str) -> float | None:
    if metric == "util":
        return None if gpu.utilization_pct is None else float(gpu.utilization_pct)
    if gpu.memory_used_bytes is None or not gpu.memory_total_bytes:
        return None
    return 100.0 * float(gpu.memory_used_bytes) / float(gpu.memory_total_bytes)


def _table_html(sample: Any) -> str:
    rows = []
    for gpu in sample.gpus:
        colour = _COLOURS[gpu.index % len(_COLOURS)]
        if gpu.error:
            rows.append(
                f'<tr><td style="text-align:left;color:{colour}">■ {gpu.index}</td>'
                f'<td style="text-align:left" colspan="5">{html.escape(gpu.error)}</td></tr>'
            )
            continue
        procs = []
        for p in gpu.processes:
            style = ' style="color:#c62828;font-weight:bold"' if p.state in _BAD_STATES else ""
            who = f" <b>{html.escape(p.label)}</b>" if p.label else ""
            procs.append(f"<span{style}>{p.pid}{who} ({html.escape(p.state)})</span>")
        bar = memory_bar_html(gpu.memory_used_bytes, gpu.memory_total_bytes) or "-"
        power = "-" if gpu.power_w is None else f"{gpu.power_w:.0f} W"
        util, temp = fmt_opt(gpu.utilization_pct, "%"), fmt_opt(gpu.temperature_c, "C")
        cells = [f'<span style="color:{colour}">■</span> {gpu.index}', util, bar, temp, power]
        cells.append(", ".join(procs) or "-")
        rows.append(
            "<tr>" + "".join(f'<td style="text-align:left">{c}</td>' for c in cells) + "</tr>"
        )
    head = "".join(
        f'<th style="text-align:left">{h}</th>'
        for h in ("GPU", "util", "memory", "temp", "power", "processes")
    )
    return f'<table class="nbgpu-table"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _headline(samples: list[Any], state: str) -> str:
    last = samples[-1] if samples else None
    parts = ["nbgpu watch", state]
    if last is not None:
        parts.append(time.strftime("%H:%M:%S", time.localtime(last.at)))
        parts.append(f"{len(samples)} samples over {last.at - samples[0].at:.0f} s")
        if last.simulated:
            parts.append(simulated_label(last.simulated))
        if last.note:
            parts.append(last.note)
    return " · ".join(parts)


def dashboard_html(samples: list[Any], state: str) -> str:
    """The whole dashboard as static HTML, styled inline (the face, live and stopped)."""
    title = title_html(_headline(samples, state), simulated=bool(samples and samples[-1].simulated))
    body = f"<div><b>{title}</b></div>"
    if samples:
        body += (
            '<div style="display:flex;flex-wrap:wrap;gap:8px">'
            f"{svg_img(chart_svg(samples, 'util', 'utilisation %'), 'utilisation %')}"
            f"{svg_img(chart_svg(samples, 'memory', 'memory used %'), 'memory used %')}"
            f"</div>{_table_html(samples[-1])}"
        )
    return f'<div class="nbgpu" style="{ROOT_STYLE}">{body}</div>'


def dashboard_text(samples: list[Any], state: str) -> str:
    lines = [_headline(samples, state)]
    if samples:
        lines.append("GPU  util  memory              temp  power   processes")
        for gpu in samples[-1].gpus:
            if gpu.error:
                lines.append(f"{gpu.index:<4} {gpu.error}")
                continue
            util = fmt_opt(gpu.utilization_pct, "%")
            used = gpu.memory_used_bytes or 0
            total = gpu.memory_total_bytes or 0
            mem = f"{used / 2**30:.1f}/{total / 2**30:.1f} GiB" if total else "-"
            temp = fmt_opt(gpu.temperature_c, "C")
            power = "-" if gpu.power_w is None else f"{gpu.power_w:.0f} W"
            procs = [
                f"{p.pid}{f' {p.label}' if p.label else ''} ({p.state})" for p in gpu.processes
            ]
            lines.append(
                f"{gpu.index:<4} {util:<5} {mem:<19} {temp:<5} {power:<7} {', '.join(procs) or '-'}"
            )
    return "\n".join(lines)


def _label_run_rank(pid: int) -> str | None:
    """Name a process nbgpu launched ("run 'x' rank 1") from its environment."""
    try:
        import psutil  # noqa: PLC0415

        env = psutil.Process(pid).environ()
    except Exception:  # noqa: BLE001  (gone, other user, other namespace: no label)
        return None
    name = env.get("NBGPU_RUN_NAME")
    if not name:
        return None
    rank = env.get("RANK")
    return f"run '{name}'" + (f" rank {rank}" if rank is not None else " agent")


class Dashboard:
    """The live view of one :class:`~nbgpu.devices.watch.Watcher`."""

    def __init__(self, interval_s: float, history: int, *, widgets: bool) -> None:
        from nbgpu.devices.watch import Watcher  # noqa: PLC0415

        self.widgets = widgets
        self.watcher = Watcher(
            interval_s=interval_s,
            history=history,
            label_pid=_label_run_rank,
            on_sample=lambda _s: self.refresh(),
        )
        self.cleared = False  # stopped because no view of it was left
        self.controls: Any = None
        if widgets:
            import ipywidgets as w  # noqa: PLC0415

            self.pause_button = w.ToggleButton(description="Pause", icon="pause")
            self.stop_button = w.Button(description="Stop", icon="stop")
            self.pause_button.observe(self._on_pause, names="value")
            self.stop_button.on_click(lambda _b: self.stop())
            self.controls = w.HBox([self.pause_button, self.stop_button])
            # A count that drops to 0 and stays there (no re-render) stops sampling.
            self.controls._view_count = 0
            self.controls.observe(self._on_views, names="_view_count")
            self._orphan_timer: threading.Timer | None = None
        self.view = LiveView(self._face, controls=self.controls, interval_s=0.1, on_exit=self.stop)
        DASHBOARDS.append(self)

    @property
    def state(self) -> str:
        if self.watcher.error:
            return f"stopped: sampling failed ({self.watcher.error})"
        if self.watcher.stopped:
            return "stopped"
        return "paused" if self.watcher.paused else f"live, every {self.watcher.interval_s:g} s"

    def _face(self, *, final: bool = False) -> dict[str, str]:
        samples = list(self.watcher.samples)
        state = self.state if samples or final else "starting"
        face = {"text/plain": dashboard_text(samples, state)}
        if self.widgets or final:  # --view text draws text while it lives
            face["text/html"] = dashboard_html(samples, state)
        return face

    def start(self) -> Dashboard:
        self.watcher.sample_now()  # the first picture at once, not after one interval
        self.refresh()
        self.watcher.start()
        return self

    def refresh(self) -> None:
        self.view.refresh()
        if self.watcher.error:
            self.view.end(self._face(final=True))

    def _on_views(self, change: dict[str, Any]) -> None:
        if self._orphan_timer is not None:
            self._orphan_timer.cancel()
            self._orphan_timer = None
        if change["new"] == 0 and (change["old"] or 0) > 0:
            self._orphan_timer = threading.Timer(ORPHAN_GRACE_S, self._stop_if_unseen)
            self._orphan_timer.daemon = True
            self._orphan_timer.start()

    def _stop_if_unseen(self) -> None:
        if self.controls._view_count == 0 and not self.watcher.stopped:
            self.cleared = True  # before stop(): whoever waits for the stop reads it
            self.stop()

    def _on_pause(self, change: dict[str, Any]) -> None:
        paused = bool(change["new"])
        (self.watcher.pause if paused else self.watcher.resume)()
        look = ("Resume", "play") if paused else ("Pause", "pause")
        self.pause_button.description, self.pause_button.icon = look
        self.refresh()

    def stop(self) -> None:
        self.watcher.stop()
        if self.widgets:
            self.pause_button.disabled = self.stop_button.disabled = True
        self.view.end(self._face(final=True))


@magics_class
class WatchMagics(Magics):
    """``%gpu_watch``: a live dashboard of every GPU."""

    @magic_arguments()
    @argument("--interval", default="1", help="seconds between samples (default 1, at least 0.2)")
    @argument("--history", default="300", help="samples kept and drawn (default 300)")
    @argument("--view", choices=("auto", "widgets", "text"), default="auto", help="how to draw")
    @argument("--stop", action="store_true", help="stop every dashboard of this kernel")
    @line_magic
    def gpu_watch(self, line: str = "") -> Any:
        """Live GPU dashboard: utilisation and memory over time, memory bars, temperature,
        power and processes (dead holders in red, this kernel and nbgpu ranks named).
        Pause / Stop buttons; the saved notebook keeps the last picture."""
        if (args := parse_or_help(self, "gpu_watch", line)) is None:
            return None
        if args.stop:
            for dashboard in DASHBOARDS:
                dashboard.stop()
            print(f"[nbgpu] stopped {len(DASHBOARDS)} dashboard(s)")
            DASHBOARDS.clear()
            return None
        from nbgpu.devices.watch import parse_watch_options  # noqa: PLC0415
        from nbgpu.notebook.widgets import widgets_available  # noqa: PLC0415

        with user_errors():
            interval_s, history = parse_watch_options(args.interval, args.history)
        widgets = args.view == "widgets" or (args.view == "auto" and widgets_available())
        Dashboard(interval_s, history, widgets=widgets).start()
        return None
