"""Where a run's lines go in a notebook: the running cell, a widget panel, a display tail.

A foreground run (or a warm cell) writes prefixed text into the cell that runs it, within
the screen budget, or into a widget panel on request. A background run writes through a
display handle created in the cell that started it, so its output never lands in
whatever cell runs later; once it ends, that display shows the run's static record.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the launch engine loads on first use; %load_ext stays light
    from argparse import Namespace

    from nbgpu.launch.execute import Output
    from nbgpu.launch.run import Run

__all__ = ["background_output", "foreground_output"]

BACKGROUND_REFRESH_S = 0.25  # display updates count against Jupyter's message rate


class _BackgroundView:
    """A bounded live tail of a background run, kept in the cell that started it.

    Once the run ends, the same display shows the run's static record (each rank's
    last lines, the badges, the summary), as HTML and text, so a saved notebook keeps it.
    """

    def __init__(self, run: Run, *, keep_tails: bool = True) -> None:
        from IPython.display import Pretty, display  # noqa: PLC0415

        from nbgpu.notebook.run_record import RECORD_TAIL_LINES, Tails  # noqa: PLC0415

        self._pretty = Pretty
        self._lines: deque[str] = deque(maxlen=40)
        self._lock = threading.Lock()
        self._last = 0.0
        self._recorded = False
        self.record: dict[str, str] | None = None  # the static record, once the run ended
        # --quiet: the record keeps the summary only, no rank output.
        self.tails = Tails(run.logs if keep_tails else {}, keep=RECORD_TAIL_LINES)
        self._memory: str | None = None  # the node's memory line, refreshed at most 1/s
        self.handle = display(Pretty(f"[nbgpu] run '{run.name}' starting…"), display_id=True)

    def write(self, text: str) -> object:
        from nbgpu.notebook.run_record import strip_ansi  # noqa: PLC0415

        with self._lock:
            self._lines.extend(strip_ansi(text).rstrip("\n").split("\n"))
        return None

    def tick(self, run: Run) -> None:
        if run.done:
            if not self._recorded:
                from nbgpu.notebook.run_record import record_bundle  # noqa: PLC0415

                self._recorded = True
                self.record = record_bundle(run, self.tails.all())
                self.handle.update(self.record, raw=True)
            return
        now = time.monotonic()
        if now - self._last < BACKGROUND_REFRESH_S:
            return
        self._last = now
        with self._lock:
            body = "\n".join(self._lines)
        self._memory = run.memory_status() or self._memory
        head = run._headline()
        if self._memory and not run.done:
            head += f"\n{self._memory}"
        self.handle.update(self._pretty(f"{head}\n{body}" if body else head))


def background_output(run: Run, view: str, *, quiet: bool) -> Output:
    """Widgets (tabs, badges, Stop) where they render; a display-handle tail otherwise."""
    from nbgpu.launch.execute import Output  # noqa: PLC0415
    from nbgpu.launch.streams import ScreenWriter  # noqa: PLC0415
    from nbgpu.notebook.widgets import RunPanel, widgets_available  # noqa: PLC0415

    use_widgets = view == "widgets" or (
        view == "auto" and widgets_available() and not _under_test_runner()
    )
    if use_widgets and not quiet:
        panel = RunPanel(run)
        # follow() flushes the panel each tick; once the run is over, show final badges.
        return Output(panel, lambda r: panel.finish(str(r.dir)) if r.done else None)
    from nbgpu.notebook.run_record import TeeToTails  # noqa: PLC0415

    text_view = _BackgroundView(run, keep_tails=not quiet)
    writer = ScreenWriter(text_view.write if not quiet else (lambda _t: None))
    return Output(TeeToTails(writer, text_view.tails), text_view.tick)


def foreground_output(args: Namespace) -> Callable[[Run], Output]:
    """Where a foreground run's (or warm cell's) lines go: this cell, or a widget panel."""
    from nbgpu.launch.execute import to_screen  # noqa: PLC0415

    if args.view == "widgets" and not args.quiet:
        # Opt-in for foreground runs: their text then lives in the panel's tabs,
        # which static exports and nbval do not show (auto keeps text here).
        return _panel_output
    return to_screen(
        _write_stdout,
        quiet=args.quiet,
        color=True,
        live_status=not _under_test_runner(),  # the node's memory, one line
    )


def _panel_output(run: Run) -> Output:
    from nbgpu.launch.execute import Output  # noqa: PLC0415
    from nbgpu.notebook.widgets import RunPanel  # noqa: PLC0415

    panel = RunPanel(run, stoppable=False)
    return Output(panel, lambda r: panel.finish(str(r.dir)) if r.done else None)


def _under_test_runner() -> bool:
    # nbval/pytest kernels have no widget manager: their output must be plain text.
    import os  # noqa: PLC0415

    return "PYTEST_CURRENT_TEST" in os.environ


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
