"""A run's lines in a notebook: the running cell, a widget panel, or a background display.

A background run writes through a display handle created in the cell that started it, so
its output never lands in whatever cell runs later. Each view is a
:class:`~nbgpu.notebook.live.LiveView` whose face (:mod:`nbgpu.notebook.run_record`)
becomes the run's record when the run (or a warm cell) ends.
"""

from __future__ import annotations

import functools
import os
import threading
from collections import deque
from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from nbgpu._render import Block, Line, rank_colour
from nbgpu.notebook.live import Bundle, LiveView
from nbgpu.notebook.run_record import MemoryTimeline, Tails, live_bundle, record_bundle, strip_ansi

if TYPE_CHECKING:  # the launch engine loads on first use
    from argparse import Namespace

    from nbgpu.launch.execute import Output
    from nbgpu.launch.run import Run
    from nbgpu.launch.warm import CellResult

__all__ = ["CellView", "RunPanel", "background_output", "foreground_output", "widgets_available"]

REFRESH_S = 0.25  # display updates count against Jupyter's message rate
FOREGROUND_NOTE = (
    "foreground run: stop it with the notebook's interrupt button (■); "
    "the kernel is busy following it and would only see a click here afterwards"
)


def background_note(name: str) -> str:
    """What a background run's face says while it runs (its record says what happened)."""
    return f"running in the background: %gpu_runs, %gpu_stop {name}, nbgpu.runs()['{name}'].wait()"


def widgets_available() -> bool:
    try:
        import ipywidgets  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def background_output(run: Run, view: str, *, quiet: bool) -> Output:
    """Widgets (tabs, badges, Stop) where they render; a display-handle tail otherwise."""
    from nbgpu.launch.execute import Output  # noqa: PLC0415

    use_widgets = view == "widgets" or (
        view == "auto" and widgets_available() and not _under_test_runner()
    )
    if use_widgets and not quiet:
        return _panel_output(run)
    text_view = _BackgroundView(run, quiet=quiet)
    return Output(text_view, text_view.tick)


def foreground_output(args: Namespace) -> Callable[[Run], Output]:
    """Where a foreground run's (or warm cell's) lines go: this cell, or a widget panel."""
    from nbgpu.launch.execute import to_screen  # noqa: PLC0415

    if args.view == "widgets" and not args.quiet:
        # Opt-in in the foreground: the text lives in the panel's tabs, unseen by exports and nbval.
        return lambda run: _panel_output(run, stoppable=False)
    write = functools.partial(print, end="", flush=True)
    live = not _under_test_runner()  # live_status: the node's memory, one line
    return to_screen(write, quiet=args.quiet, color=True, live_status=live)


def _panel_output(run: Run, *, stoppable: bool = True) -> Output:
    from nbgpu.launch.execute import Output  # noqa: PLC0415

    panel = RunPanel(run, stoppable=stoppable)
    # follow() flushes the panel each tick; once the run is over, show final badges.
    return Output(panel, lambda r: panel.finish(str(r.dir)) if r.done else None)


def _under_test_runner() -> bool:
    # nbval/pytest kernels have no widget manager: their output must be plain text.
    return "PYTEST_CURRENT_TEST" in os.environ


class _BackgroundView:
    """A bounded live tail of a background run, in the cell that started it: a LiveView
    without controls (headline, node memory, newest lines) that ends as the run's record."""

    def __init__(self, run: Run, *, quiet: bool) -> None:
        from nbgpu.launch.streams import ScreenWriter  # noqa: PLC0415

        self.run = run
        self._lines: deque[str] = deque(maxlen=40)
        self._lock = threading.Lock()
        self.record: Bundle | None = None  # the static record, once the run ended
        # --quiet: the record keeps the summary only, no rank output.
        self.tails = Tails({} if quiet else run.logs)
        self._memory: str | None = None  # the node's memory line
        self.screen = ScreenWriter((lambda _t: None) if quiet else self.write)
        self.view = LiveView(self._face, interval_s=REFRESH_S)

    def _face(self) -> Bundle:
        run = self.run
        with self._lock:
            body = "\n".join(self._lines)
        head = run._headline()
        if not run.done:
            self._memory = run.memory_status() or self._memory
            head += f"\n{background_note(run.name)}" + (f"\n{self._memory}" if self._memory else "")
        return {"text/plain": f"{head}\n{body}" if body else head}

    def write(self, text: str) -> None:
        with self._lock:
            self._lines.extend(strip_ansi(text).rstrip("\n").split("\n"))

    def tick(self, run: Run) -> None:
        if run.done and self.record is None:
            self.record = record_bundle(run, self.tails)
            self.view.end(self.record)
        self.view.refresh()

    def add(self, label: str, lines: list[str]) -> None:
        self.tails.extend(label, lines)
        self.screen.add(label, lines)

    def flush(self) -> None:
        self.screen.flush()

    def finish(self, log_hint: str) -> None:
        self.screen.finish(log_hint)


class RunPanel:
    """The live view of one run; implements the writer interface ``follow`` uses."""

    def __init__(self, run: Any, *, stoppable: bool = True) -> None:
        import ipywidgets as w  # noqa: PLC0415

        self.run = run
        self.tails = Tails(run.logs)
        self.record: Bundle | None = None  # the static record, once the run ended
        # A foreground run keeps the kernel busy, so a click would only arrive afterwards:
        # there the notebook's interrupt button is the stop button, and the face says so.
        self.note = background_note(run.name) if stoppable else FOREGROUND_NOTE
        self.stop_button = w.Button(
            description="Stop",
            button_style="danger",
            icon="stop",
            tooltip="stop every process of this run: SIGTERM, then SIGKILL",
            layout=w.Layout(display=None if stoppable else "none"),
        )
        self.stop_button.on_click(self._on_stop)
        labels = self.tails.labels
        self.ranks = w.ToggleButtons(
            options=labels, value=labels[0] if labels else None, style={"button_width": "auto"}
        )
        # Each rank's tab in the rank's own colour (ToggleButtons styles all its buttons
        # alike): a style sheet beside them, live only as long as the controls are.
        self.ranks.add_class(picker := f"nbgpu-ranks-{id(self)}")
        rules = "".join(
            f".{picker} button:nth-of-type({i + 1}){{color:{rank_colour(label)}}}"
            for i, label in enumerate(labels)
        )
        sheet = w.HTML(f"<style>{rules}</style>")
        # The ranks' memory, read at most 1/s; its last picture joins the record.
        self.memory = MemoryTimeline(run)
        self.view = LiveView(
            self._face, controls=w.HBox([self.stop_button, self.ranks, sheet]), interval_s=REFRESH_S
        )
        self.ranks.observe(lambda _change: self.view.refresh(force=True), names="value")

    def _face(self) -> Bundle:
        self.memory.refresh(force=self.run.done)
        tail = self.tails.tail(self.ranks.value) if self.ranks.value else None
        return live_bundle(self.run, tail, self.memory.html, self.note)

    def add(self, label: str, lines: list[str]) -> None:
        self.tails.extend(label, lines)

    def flush(self) -> None:
        self.view.refresh()

    def finish(self, log_hint: str) -> None:  # noqa: ARG002  (the record shows the log dir)
        warm = self.run.warm
        cell_over = warm is not None and not self.run.done and warm.last is not None
        if not (self.run.done or cell_over):
            self.view.refresh(force=True)
        elif self.record is None:
            # The outcome is known (follow() calls this again after run.finish(); a warm
            # cell's result is set before its finish()): the face becomes the record.
            subject = CellView(self.run, warm.last) if cell_over else self.run
            self.stop_button.disabled = True
            self.record = record_bundle(subject, self.tails, [self.memory.record()])
            self.view.end(self.record)

    def _on_stop(self, _button: Any) -> None:
        self.stop_button.disabled = True
        self.stop_button.description = "Stopping…"
        threading.Thread(target=self.run.stop, args=("stopped",), daemon=True).start()


class CellView:
    """What the record functions read of a run, answered for one warm cell: the cell ends
    while its job goes on, so the record says which cell, how it ended on each rank, how
    long it took, and that the ranks are kept."""

    def __init__(self, run: Run, result: CellResult) -> None:
        self._run = run
        self.result = result
        self.name = run.name
        self.config = run.config
        self.done = True
        self.root_cause = None
        self.state = "succeeded" if result.ok else "interrupted" if result.interrupted else "failed"
        self.stop_reason = "interrupted" if self.state == "interrupted" else None
        # Each rank's status: ok | error | interrupted | no answer | waiting | idle (--ranks).
        statuses = {**dict.fromkeys(result.idle, "idle"), **result.statuses}
        self.ranks = tuple(SimpleNamespace(rank=r, status=s) for r, s in sorted(statuses.items()))

    def _rank_state(self, r: SimpleNamespace) -> str:
        return str(r.status)

    def rank_gpu(self, rank: int) -> str | None:
        return self._run.rank_gpu(rank)

    def _headline(self) -> str:
        outcome = "ok" if self.result.ok else self.state
        parts = [f"run '{self.name}'", f"cell {self.result.number}", outcome]
        ran = len(self.result.statuses)
        parts.append(f"{ran} of {self.config.nproc} ranks" if self.result.idle else f"{ran} ranks")
        if self.config.cuda_visible_devices:
            parts.append(self._run.gpu_assignment())
        parts.append(f"{self.result.duration_s:.2f} s")
        return " · ".join(parts)

    def summary_blocks(self) -> list[Block]:
        """What the record shows below its headline: how the cell ended, what is kept."""
        kept = (
            f"the ranks and their state are kept: %%torchrun --on {self.name} runs the next "
            f"cell, %gpu_stop {self.name} ends the job"
        )
        return [*self.result.content(), Line(kept, wrap=False)]
