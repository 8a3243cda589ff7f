"""A per-rank run panel for widget frontends: tabs, state badges, a Stop button.

One tab per rank holds a bounded tail of its output in a fixed-height scroll area
that follows the newest line (the full log is on disk, and the tab says how many
earlier lines only the log has); a badge row shows each rank's state and GPU; Stop
ends the run. Updates are throttled (at most 4 per second) and each one *replaces* a
tab's text instead of appending (``Output.append_stdout`` re-sends the whole widget on
every call, and Jupyter's server drops messages above ~1000/s).

The panel is shown through a display handle. When the run ends, the handle's output
is replaced by the run's static record (:mod:`nbgpu.notebook.run_record`, HTML and
text): a saved notebook then shows every rank's tail, the badges and the summary
instead of "Error displaying widget: model not found", and a finished run shows no
Stop button that could not do anything. ipywidgets is imported here only.
"""

from __future__ import annotations

import html
import threading
import time
from typing import Any

from nbgpu.notebook.run_record import (
    RECORD_TAIL_LINES,
    RecordPart,
    Tails,
    badges_html,
    live_html,
    live_text,
    record_bundle,
    scroll_box,
    strip_ansi,
)

__all__ = ["RunPanel", "widgets_available"]

REFRESH_S = 0.25
#: Height of a rank's scroll area: the panel stays this size however much a rank prints.
SCROLL_HEIGHT = "20em"
FOREGROUND_NOTE = (
    "foreground run: stop it with the notebook's interrupt button (■); "
    "the kernel is busy following it and would only see a click here afterwards"
)


def widgets_available() -> bool:
    try:
        import ipywidgets  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


class RunPanel:
    """The live view of one run; implements the writer interface ``follow`` uses.

    Other faces add to it with :meth:`add_section` (a widget under the tabs while the
    run is live, and what the saved record keeps of it once it ends).
    """

    def __init__(self, run: Any, *, tail_lines: int = 200, stoppable: bool = True) -> None:
        import ipywidgets as w  # noqa: PLC0415
        from IPython.display import display  # noqa: PLC0415

        self.run = run
        self.tails = Tails(run.logs, keep=tail_lines)
        self._dirty: set[str] = set()
        self._dirty_lock = threading.Lock()
        self._last = 0.0
        self._recorded = False
        self._record_parts: list[RecordPart] = []
        self.record: dict[str, str] | None = None  # the static record, once the run ended
        self.writes = 0
        self.title = w.HTML()
        self.badges = w.HTML()
        self.stop_button = w.Button(
            description="Stop",
            button_style="danger",
            icon="stop",
            tooltip="stop every process of this run: SIGTERM, then SIGKILL",
        )
        self.stop_button.on_click(self._on_stop)
        self.stop_note = w.HTML()
        # A foreground run keeps the kernel busy, so a click would only arrive afterwards:
        # there the notebook's interrupt button is the stop button, and the panel says so
        # instead of showing a button that cannot work.
        self._stoppable = stoppable
        if not stoppable:
            self.stop_button.layout.display = "none"
            self.stop_note.value = (
                f'<span style="font-size:11px">{html.escape(FOREGROUND_NOTE)}</span>'
            )
        # HTML rather than Output widgets: the scroll box is ours (fixed height, opens at
        # the newest line), and one value replaces a tab's text in one bounded message.
        self.outputs = {label: w.HTML(scroll_box("", SCROLL_HEIGHT)) for label in self.tails.labels}
        self.tabs = w.Tab(children=list(self.outputs.values()))
        for i, label in enumerate(self.outputs):
            self.tabs.set_title(i, label)
        self.box = w.VBox(
            [w.HBox([self.title, self.stop_button, self.stop_note]), self.badges, self.tabs]
        )
        self._refresh_header()
        bundle = dict(self.box._repr_mimebundle_())
        # What a notebook saved mid-run shows where widgets do not render, instead of
        # the widget's repr (JupyterLab itself prefers the widget while it lives).
        bundle["text/plain"] = live_text(run)
        bundle["text/html"] = live_html(run)
        self.handle = display(bundle, raw=True, display_id=True)
        from nbgpu.notebook.memory_timeline import MemoryTimeline  # noqa: PLC0415

        # The ranks' memory, refreshed at most 1/s; its last picture joins the saved record.
        self.memory = MemoryTimeline(run)
        self.add_section(self.memory.widget, record=self.memory.record)

    def add_section(self, widget: Any, record: RecordPart | None = None) -> None:
        """Show *widget* under the tabs; *record* gives its (text, html) for the record."""
        self.box.children = (*self.box.children, widget)
        if record is not None:
            self._record_parts.append(record)

    # -- the writer interface (add / flush / finish) ----------------------------------

    def add(self, label: str, lines: list[str]) -> None:
        if self.tails.extend(label, lines):
            with self._dirty_lock:
                self._dirty.add(label)

    def flush(self) -> None:
        now = time.monotonic()
        if now - self._last < REFRESH_S:
            return
        self._last = now
        self._render()

    def finish(self, log_hint: str) -> None:  # noqa: ARG002  (the record shows the log dir)
        self._render()
        warm = self.run.warm
        cell_over = warm is not None and not self.run.done and warm.last is not None
        if (self.run.done or cell_over) and not self._recorded:
            # The outcome is known (follow() calls this again after run.finish(); a warm
            # cell's result is set before its finish()): swap the live panel for the
            # record a saved notebook keeps.
            self._recorded = True
            subject: Any = self.run
            if cell_over and warm is not None and warm.last is not None:
                from nbgpu.notebook.cell_record import CellView  # noqa: PLC0415

                subject = CellView(self.run, warm.last)
            self.record = record_bundle(
                subject, self.tails.all(RECORD_TAIL_LINES), self._record_parts
            )
            self.handle.update(self.record, raw=True)

    # -- rendering -----------------------------------------------------------------

    def _render(self) -> None:
        with self._dirty_lock:
            dirty = sorted(self._dirty)
            self._dirty.clear()
        for label in dirty:
            tail = self.tails.tail(label)
            note = tail.earlier_note()
            text = "\n".join(tail.lines)
            if note:
                text = f"… {note}\n{text}"
            # Replacing the value sends one bounded message, not the whole history.
            self.outputs[label].value = scroll_box(text, SCROLL_HEIGHT)
            self.writes += 1
        self._refresh_header()
        self.memory.refresh(force=self.run.done)

    def _refresh_header(self) -> None:
        run = self.run
        self.title.value = f"<b>{html.escape(strip_ansi(run._headline()))}</b>"
        self.stop_button.disabled = run.done or not self._stoppable
        self.badges.value = badges_html(run) + (
            f'<div style="font-size:11px">logs: <code>{html.escape(str(run.dir))}</code></div>'
        )

    def _on_stop(self, _button: Any) -> None:
        self.stop_button.disabled = True
        self.stop_button.description = "Stopping…"
        threading.Thread(target=self.run.stop, args=("stopped",), daemon=True).start()
