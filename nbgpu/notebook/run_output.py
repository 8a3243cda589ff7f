"""Where a run's lines go in a notebook: the running cell, a widget panel, a display tail.

A foreground run (or a warm cell) writes prefixed text into the cell that runs it, within
the screen budget, or into a widget panel on request. A background run writes through a
display handle created in the cell that started it, so its output never lands in
whatever cell runs later; once it ends, that display shows the run's static record.
"""

from __future__ import annotations

import sys
import threading
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

    A :class:`~nbgpu.notebook.live.LiveView` without controls: its face is the run's
    headline, the node's memory and the newest lines; once the run ends, the run's
    record (each rank's last lines, the badges, the summary) as HTML and text.
    """

    def __init__(self, run: Run, *, keep_tails: bool = True) -> None:
        from nbgpu.notebook.live import LiveView  # noqa: PLC0415
        from nbgpu.notebook.run_record import RECORD_TAIL_LINES, Tails  # noqa: PLC0415

        self.run = run
        self._lines: deque[str] = deque(maxlen=40)
        self._lock = threading.Lock()
        self.record: dict[str, str] | None = None  # the static record, once the run ended
        # --quiet: the record keeps the summary only, no rank output.
        self.tails = Tails(run.logs if keep_tails else {}, keep=RECORD_TAIL_LINES)
        self._memory: str | None = None  # the node's memory line
        self.view = LiveView(self._face, interval_s=BACKGROUND_REFRESH_S)

    def _face(self) -> dict[str, str]:
        run = self.run
        with self._lock:
            body = "\n".join(self._lines)
        head = run._headline()
        if not run.done:
            self._memory = run.memory_status() or self._memory
            if self._memory:
                head += f"\n{self._memory}"
        return {"text/plain": f"{head}\n{body}" if body else head}

    def write(self, text: str) -> object:
        from nbgpu.notebook.run_record import strip_ansi  # noqa: PLC0415

        with self._lock:
            self._lines.extend(strip_ansi(text).rstrip("\n").split("\n"))
        return None

    def tick(self, run: Run) -> None:
        if run.done and self.record is None:
            from nbgpu.notebook.run_record import record_bundle  # noqa: PLC0415

            self.record = record_bundle(run, self.tails.all())
            self.view.end(self.record)
        self.view.refresh()


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
