"""pdb on a warm job's rank, its prompt in the notebook (the kernel's end:
``nbgpu.launch.debug``). pdb reads and writes over the job's channel: what it writes goes
with its next prompt (``debug-prompt``), the kernel answers each prompt with one line
(``debug-input``; None is EOF). ``breakpoint()`` in a warm cell stops this rank there;
``%gpu_debug`` walks the last failed cell's traceback (post-mortem), which the rank keeps
until its next cell. A cold run has no channel: ``breakpoint()`` says so and goes on.
Standard library (and ``nbgpu._children``) only; pdb itself is imported when a debugger
starts.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, cast

from nbgpu._children import sigint_held

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

__all__ = ["post_mortem", "refuse_breakpoints", "remember_failure", "stop_at_breakpoints"]

_OURS = str(Path(__file__).parents[1])  # the nbgpu package: frames users need not walk
# The last failed cell's exception (with its frames: the values at the failure), until the
# next cell begins.
_failed: list[BaseException | None] = [None]


def remember_failure(exc: BaseException | None) -> None:
    _failed[0] = exc


class _Channel:
    """pdb's stdin and stdout: output waits for the next prompt (one message per prompt)."""

    def __init__(self, conn: Connection, send: Callable[[dict[str, Any]], None]) -> None:
        self.conn, self.send = conn, send  # send: the rank's one writer to the channel
        self.pending: list[str] = []

    def write(self, text: str) -> int:
        self.pending.append(text)
        return len(text)

    def flush(self) -> None:
        """pdb flushes before each prompt; the text goes with it (``readline``)."""

    def take(self) -> str:
        text, self.pending = "".join(self.pending), []
        return text

    def readline(self) -> str:
        # What this rank printed itself (its log) goes out before the kernel shows ours.
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            self.send({"op": "debug-prompt", "text": self.take()})
            while True:  # a late answer to a prompt an interrupt cancelled is read here too
                # An interrupt while waiting lands here, with nothing read (pdb asks again);
                # one during the read waits until the message is whole.
                self.conn.poll(None)
                with sigint_held():
                    message = self.conn.recv()
                if message.get("op") == "debug-input":
                    line = message.get("line")
                    return "" if line is None else f"{line}\n"
        except (EOFError, OSError):
            return ""  # the kernel is gone: EOF ends the debugger


def _debugger(conn: Connection, send: Callable[[dict[str, Any]], None]) -> Any:
    """A pdb that talks over *conn*; frames of the run directory are named as the
    tracebacks name them (``cell3.py``)."""
    import pdb  # noqa: PLC0415  (only a rank that debugs pays for it)

    run_dir = os.environ.get("NBGPU_RUN_DIR", "\0") + os.sep

    class ChannelPdb(pdb.Pdb):
        def format_stack_entry(self, frame_lineno: Any, lprefix: str = ": ") -> str:
            return str(super().format_stack_entry(frame_lineno, lprefix)).replace(run_dir, "")

        def interaction(self, frame: Any, traceback: Any) -> None:
            try:
                super().interaction(frame, traceback)
            finally:  # what came after the last prompt (``c`` prints nothing, ``q`` a line)
                rest = channel.take()
                if rest:
                    channel.send({"op": "debug-output", "text": rest})

    channel = _Channel(conn, send)
    # nosigint: pdb's own SIGINT handler (set on `continue`) would replace the warm loop's,
    # and a later interrupt would open a debugger instead of stopping the cell.
    stream = cast("IO[str]", channel)  # the part of a text file pdb uses
    debugger = ChannelPdb(stdin=stream, stdout=stream, nosigint=True)
    debugger.use_rawinput = False  # read the channel, not this rank's stdin
    return debugger


def stop_at_breakpoints(conn: Connection, send: Callable[[dict[str, Any]], None]) -> None:
    """``breakpoint()`` in this rank's cells: pdb here, its prompt in the notebook."""

    def stop(*_args: Any, **_kwargs: Any) -> None:
        if os.environ.get("PYTHONBREAKPOINT") == "0":
            return  # Python's own switch for "ignore breakpoints"
        debugger = _debugger(conn, send)
        debugger.message(
            "breakpoint(): this rank waits for your pdb commands (c continues, q stops the "
            "cell here); the other ranks run on"
        )
        debugger.set_trace(sys._getframe(1))

    sys.breakpointhook = stop


def refuse_breakpoints() -> None:
    """A cold run: ``breakpoint()`` is one line and the code goes on (pdb would read the
    rank's stdin, which nobody can type into)."""

    def refuse(*_args: Any, **_kwargs: Any) -> None:
        caller = sys._getframe(1)
        where = f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}"
        print(
            f"[nbgpu] breakpoint() at {where} skipped: a debugger prompt needs a warm job "
            "(%%torchrun N --keep, then --on NAME)",
            file=sys.stderr,
            flush=True,
        )

    sys.breakpointhook = refuse


def _user_part(traceback: TracebackType) -> TracebackType:
    """The traceback without nbgpu's frames (the warm loop, the interrupt handler, the
    simulated GPU), as the traceback users saw leaves them out; all of it if nothing is left."""
    kept: list[TracebackType] = []
    entry: TracebackType | None = traceback
    while entry is not None:
        if not entry.tb_frame.f_code.co_filename.startswith(_OURS):
            kept.append(entry)
        entry = entry.tb_next
    chain: TracebackType | None = None
    for entry in reversed(kept):
        chain = TracebackType(chain, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return chain or traceback


def post_mortem(
    conn: Connection, send: Callable[[dict[str, Any]], None], interruptible: list[bool]
) -> dict[str, Any]:
    """pdb on the last failed cell's traceback until ``q``, ``c`` or EOF; the answer that
    ends the session. An interrupt cancels the command being run, as in a terminal
    (*interruptible*: the warm loop's switch for SIGINT)."""
    exc = _failed[0]
    if exc is None or exc.__traceback__ is None:
        return {"op": "debug-end", "error": "no failed cell's traceback is kept on this rank"}
    debugger = _debugger(conn, send)
    debugger.reset()
    debugger.message(
        f"post-mortem of {type(exc).__name__}: {exc} (q or c ends it; the job stays warm)"
    )
    interruptible[0] = True
    try:
        debugger.interaction(None, _user_part(exc.__traceback__))
    except KeyboardInterrupt:
        pass  # between two commands: the session ends
    finally:
        interruptible[0] = False
    return {"op": "debug-end"}
