"""A per-rank run panel for widget frontends: tabs, state badges, a Stop button.

One tab per rank holds a bounded tail of its output (the full log is on disk); a
badge row shows each rank's state; Stop ends the run. Updates are throttled (at
most 4 per second) and each one *replaces* a tab's outputs instead of appending,
because ``Output.append_stdout`` re-sends the whole widget on every call and
Jupyter's server drops messages above ~1000/s. Used for background runs, where the
kernel stays free to receive the button's click. ipywidgets is imported here only.
"""

from __future__ import annotations

import html
import threading
import time
from collections import deque
from typing import Any

__all__ = ["RunPanel", "widgets_available"]

REFRESH_S = 0.25
_BADGE = {
    "running": ("#2a7ae2", "running"),
    "succeeded": ("#2e8b57", "ok"),
    "failed": ("#c0392b", "failed"),
    "stopped": ("#7f8c8d", "stopped"),
    "timed_out": ("#c0392b", "timed out"),
    "interrupted": ("#7f8c8d", "interrupted"),
}


def widgets_available() -> bool:
    try:
        import ipywidgets  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


class RunPanel:
    """The live view of one run; implements the writer interface ``follow`` uses."""

    def __init__(self, run: Any, *, tail_lines: int = 200, stoppable: bool = True) -> None:
        import ipywidgets as w  # noqa: PLC0415
        from IPython.display import display  # noqa: PLC0415

        self.run = run
        self._lock = threading.Lock()
        self._tails: dict[str, deque[str]] = {
            f"rank{r}": deque(maxlen=tail_lines) for r in range(run.config.nproc)
        }
        self._dirty: set[str] = set()
        self._last = 0.0
        self.writes = 0
        self.title = w.HTML()
        self.badges = w.HTML()
        self.stop_button = w.Button(description="Stop", button_style="danger", icon="stop")
        self.stop_button.on_click(self._on_stop)
        # A foreground run keeps the kernel busy, so a click would only arrive afterwards:
        # there the notebook's interrupt button is the stop button.
        self._stoppable = stoppable
        if not stoppable:
            self.stop_button.tooltip = "foreground run: use the notebook's interrupt button"
        self.outputs = {label: w.Output() for label in self._tails}
        self.tabs = w.Tab(children=list(self.outputs.values()))
        for i, label in enumerate(self.outputs):
            self.tabs.set_title(i, label)
        from nbgpu.notebook.memory_timeline import MemoryTimeline  # noqa: PLC0415

        self.memory = MemoryTimeline(run)  # the ranks' memory, refreshed at most 1/s
        self.box = w.VBox(
            [w.HBox([self.title, self.stop_button]), self.badges, self.memory.widget, self.tabs]
        )
        self._refresh_header()
        display(self.box)

    # -- the writer interface (add / flush / finish) ----------------------------------

    def add(self, label: str, lines: list[str]) -> None:
        if label not in self._tails:
            return
        with self._lock:
            self._tails[label].extend(lines)
            self._dirty.add(label)

    def flush(self) -> None:
        now = time.monotonic()
        if now - self._last < REFRESH_S:
            return
        self._last = now
        self._render()

    def finish(self, log_hint: str) -> None:  # noqa: ARG002  (the header shows the log dir)
        self._render()

    # -- rendering -----------------------------------------------------------------

    def _render(self) -> None:
        with self._lock:
            dirty = {label: "\n".join(self._tails[label]) for label in self._dirty}
            self._dirty.clear()
        for label, text in dirty.items():
            # Replacing the outputs sends one bounded message, not the whole history.
            self.outputs[label].outputs = (
                {"output_type": "stream", "name": "stdout", "text": text + "\n"},
            )
            self.writes += 1
        self._refresh_header()
        self.memory.refresh(force=self.run.done)

    def _refresh_header(self) -> None:
        run = self.run
        self.title.value = f"<b>{html.escape(run._headline())}</b>"
        self.stop_button.disabled = run.done or not self._stoppable
        states = {r.rank: run._rank_state(r) for r in run.ranks}
        badges = []
        for r in range(run.config.nproc):
            state = states.get(r)
            if state is None:
                color, text = _BADGE["running" if not run.done else run.state]
            elif state == "ok":
                color, text = _BADGE["succeeded"]
            elif run.stop_reason is not None and run.root_cause is None:
                # Stopped by the user, a timeout or an interrupt: grey, not a crash's red.
                color, text = _BADGE.get(run.state, _BADGE["stopped"])[0], state
            else:
                color, text = _BADGE["failed"][0], state
            if run.root_cause is not None and run.root_cause.rank == r:
                text += " (root cause)"
            badges.append(
                f'<span style="background:{color};color:white;border-radius:3px;'
                f'padding:1px 6px;margin-right:4px">rank{r}: {html.escape(text)}</span>'
            )
        self.badges.value = "".join(badges) + (
            f'<div style="font-size:11px">logs: <code>{html.escape(str(run.dir))}</code></div>'
        )

    def _on_stop(self, _button: Any) -> None:
        self.stop_button.disabled = True
        threading.Thread(target=self.run.stop, args=("stopped",), daemon=True).start()
