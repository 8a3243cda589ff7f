"""The follow loop: stream a started run to its output until it ends.

Polls every rank's log, flushes the output within its screen budget, shows one-line
notices (a full disk, a lost parent-death guarantee), enforces ``--timeout``, and turns
the notebook's interrupt into stopping the whole run on one deadline. Whatever way
the loop ends, the run is stopped, its orphans swept, its last lines drained and its
outcomes collected.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from nbgpu.launch.streams import LineSink, ScreenWriter

if TYPE_CHECKING:
    from nbgpu.launch.run import Run

__all__ = ["follow", "tick"]


def tick(run: Run, writer: LineSink, on_tick: Callable[[Run], None] | None) -> None:
    """One refresh of the output: the memory line, notices, the lines, the face's own."""
    if isinstance(writer, ScreenWriter) and writer.live_status:
        writer.status(run.memory_status())
    notices = run.take_notices()
    if notices:
        writer.add("nbgpu", notices)
    writer.flush()
    if on_tick is not None:
        on_tick(run)


def follow(
    run: Run,
    writer: LineSink,
    *,
    poll_s: float = 0.05,
    flush_s: float = 0.1,
    on_tick: Callable[[Run], None] | None = None,
) -> Run:
    """Stream a started run to *writer* until it ends; stop it on timeout or interrupt."""
    run.writer = writer
    timeout = run.config.timeout_s
    last_flush = 0.0
    try:
        while True:
            for label, lines in run.poll_lines():
                writer.add(label, lines)
            now = time.monotonic()
            if now - last_flush >= flush_s:
                tick(run, writer, on_tick)
                last_flush = now
            if run.agent_done:
                break
            if run.stop_reason is not None and not run.agent_done:
                # Stopped from elsewhere (%gpu_stop): wait for the stopper to finish.
                time.sleep(poll_s)
                continue
            if (
                timeout is not None
                and run.started_at is not None
                and (time.time() - run.started_at > timeout)
            ):
                run.stop("timed_out", first_signal=signal.SIGTERM)
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        # The notebook's stop button: SIGINT to torchrun (it forwards and shuts down),
        # then SIGTERM/SIGKILL of whatever remains, on one short deadline.
        try:
            run.stop("interrupted", first_signal=signal.SIGINT)
        except KeyboardInterrupt:
            run.stop("interrupted", first_signal=signal.SIGKILL, grace_s=0.5)
    finally:
        if not run.agent_done:
            run.stop(run.stop_reason or "stopped")
        run.sweep_orphans()
        for label, lines in run.poll_lines() + run.drain():
            writer.add(label, lines)
        notices = run.take_notices()
        if notices:
            writer.add("nbgpu", notices)
        writer.finish(str(run.dir))
        run.finish()
        if on_tick is not None:
            on_tick(run)
    return run
