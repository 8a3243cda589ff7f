"""The notebook's end of pdb on a warm job's rank (the rank's end: ``nbgpu.rank.debugger``).
:class:`Console` shows what pdb writes as the rank's lines and answers each of its prompts:
with ``input()`` (in a kernel, an input request the notebook answers) or with the commands
given with ``-c``. A ``breakpoint()`` reaches it through its cell's follow loop;
``%gpu_debug`` is :func:`post_mortem`, on a job between cells (the other ranks stay idle).
"""

import builtins
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from nbgpu.errors import UserInputError
from nbgpu.launch.relay import CellServer, NodeChannel
from nbgpu.launch.streams import LineSink
from nbgpu.launch.warm import INTERRUPT_WAIT_S, CellResult

if TYPE_CHECKING:
    from nbgpu.launch.run_view import RunView

__all__ = ["Console", "choose_rank", "debug_target", "failed_ranks", "post_mortem"]

POLL_S = 0.1
USAGE = "%gpu_debug [NAME] [RANK] [-c CMD ...]"


class Console:
    """One debugger conversation with a job's ranks. *unanswered* is what a prompt gets
    when nobody can answer (None: EOF, pdb quits), *note* what is said then."""

    def __init__(
        self,
        server: CellServer | NodeChannel,
        sink: LineSink,
        label: Callable[[int], str],
        *,
        commands: Sequence[str] | None = None,
        ask: Callable[[str], str] | None = None,
        unanswered: str | None = None,
        note: str = "",
        before: Callable[[], None] | None = None,
    ) -> None:
        self.server, self.sink, self.label = server, sink, label
        self.commands = None if commands is None else deque(commands)
        self.ask = ask or builtins.input  # looked up now: ipykernel replaces it per cell
        self.unanswered, self.note = unanswered, note
        # Catch up with the ranks' logs (the lines keep their order; a prompt is no stall).
        self.before = before
        self.no_input = False  # input() is not available here (nbconvert, nbval)
        self.closing = False  # interrupted: every prompt from now on gets EOF
        self.ended = False
        self.error: str | None = None
        self.asked_s = 0.0  # how long the prompts waited for a person (not run time)

    @staticmethod
    def hears(message: Mapping[str, Any]) -> bool:
        return str(message.get("op", "")).startswith("debug-")

    def hear(self, rank: int, message: Mapping[str, Any]) -> None:
        op, text = message.get("op"), str(message.get("text") or "")
        if op == "debug-end":
            self.ended, self.error = True, message.get("error")
        prompt = ""
        if op == "debug-prompt":
            text, _, prompt = text.rpartition("\n")  # the prompt is the unfinished last line
        self._show(rank, text)
        if op == "debug-prompt":
            self.server.send([rank], {"op": "debug-input", "line": self._answer(rank, prompt)})
            if self.before is not None:
                self.before()  # the time spent answering is not the job's silence

    def _show(self, rank: int, text: str) -> None:
        if not text.strip():
            return
        if self.before is not None:
            self.before()
        self.sink.add(self.label(rank), text.removesuffix("\n").split("\n"))
        self.sink.flush()

    def _answer(self, rank: int, prompt: str) -> str | None:
        if self.closing:
            return None
        if self.commands is not None:
            if not self.commands:
                return None  # the script is done: EOF ends pdb
            line = self.commands.popleft()
            self._show(rank, prompt + line)  # the transcript reads as if typed
            return line
        if self.no_input:
            return self.unanswered
        asked = time.monotonic()
        try:
            return self.ask(f"[{self.label(rank)}] {prompt}")
        except NotImplementedError:  # IPython's StdinNotImplementedError is one
            self.no_input = True
            if self.note:
                self.sink.add("nbgpu", [self.note.format(rank=rank)])
            return self.unanswered
        except EOFError:
            return None
        except KeyboardInterrupt:
            self.closing = True
            self.server.send([rank], {"op": "debug-input", "line": None})  # pdb quits
            raise
        finally:
            self.asked_s += time.monotonic() - asked


def failed_ranks(result: CellResult | None) -> list[int]:
    """The ranks whose cell raised or was interrupted: they keep its traceback."""
    statuses = {} if result is None else result.statuses
    return sorted(rank for rank, status in statuses.items() if status in ("error", "interrupted"))


def debug_target(words: Sequence[str], runs: Mapping[str, "RunView"]) -> tuple[str, int | None]:
    """The job and rank ``%gpu_debug [NAME] [RANK]`` names (default: the latest warm job)."""
    numbers = [word for word in words if word.isdigit()]
    names = [word for word in words if not word.isdigit()]
    if len(numbers) > 1 or len(names) > 1:
        raise UserInputError(
            f"%gpu_debug {' '.join(words)}: expected {USAGE}, e.g. %gpu_debug 1 or %gpu_debug w 1"
        )
    if names:
        return names[0], int(numbers[0]) if numbers else None
    warm = [name for name, run in runs.items() if run.warm is not None]
    if not warm:
        raise UserInputError(
            "%gpu_debug: no warm job in this kernel: it debugs a failed cell of one (start it "
            "with %%torchrun N --keep --name NAME, then run cells with --on NAME)"
        )
    return warm[-1], int(numbers[0]) if numbers else None


def choose_rank(run: "RunView", rank: int | None) -> int:
    """*rank*, checked: one of the job's that failed in its last cell (default: the lowest)."""
    last = None if run.warm is None else run.warm.last
    failed = failed_ranks(last)
    world = run.config.world_size
    if rank is not None and not 0 <= rank < world:
        raise UserInputError(
            f"%gpu_debug {run.name} {rank}: '{run.name}' has ranks 0 to {world - 1}"
        )
    if rank is None and failed:
        return failed[0]
    if rank in failed:
        return rank
    which = "no rank" if rank is None else f"rank {rank}"
    cell = "no cell has run yet" if last is None else f"cell {last.number}"
    if failed:
        others = ",".join(map(str, failed))
        hint = f"rank {others} did: %gpu_debug {run.name} {failed[0]}"
    else:
        hint = "post-mortem debugs a failed cell; breakpoint() in a cell stops a rank there"
    raise UserInputError(
        f"%gpu_debug {run.name}: {which} failed in the last cell of '{run.name}' ({cell}); {hint}"
    )


def post_mortem(
    run: "RunView",
    rank: int,
    sink: LineSink,
    *,
    commands: Sequence[str] | None = None,
    ask: Callable[[str], str] | None = None,
) -> None:
    """pdb on *rank*'s last failed cell until ``q``, ``c`` or the end of *commands*; the
    other ranks stay idle, the job stays warm. An interrupt ends the session."""
    warm = run.warm
    if warm is None:
        raise UserInputError(f"%gpu_debug {run.name}: a cold run, not a warm job")
    console = Console(warm.server, sink, run.rank_label, commands=commands, ask=ask)
    with warm.lock:  # the idle watchdog waits; no cell can start meanwhile
        warm.server.send([rank], {"op": "debug"})
        try:
            _converse(run, rank, console)
        finally:
            warm.idle_since = time.time()
            sink.flush()
    if console.error:
        raise UserInputError(f"%gpu_debug {run.name} {rank}: {console.error}")
    if console.no_input:
        raise UserInputError(
            "%gpu_debug: this frontend cannot answer input() (nbconvert, nbval): give pdb's "
            f"commands with -c, e.g. %gpu_debug {run.name} {rank} -c 'p x' -c where"
        )


def _converse(run: "RunView", rank: int, console: Console) -> None:
    """Hear *rank*'s debugger until it ends; an interrupt cancels the command it runs (or
    ends the session at its prompt) and waits a bounded time for the end."""
    warm = run.warm
    assert warm is not None  # noqa: S101  (post_mortem checked it)
    deadline = None
    while not console.ended:
        if rank in warm.server.gone or warm.server.closed:
            console.sink.add("nbgpu", [f"rank {rank} left during the debugger session"])
            return
        if deadline is not None and time.monotonic() > deadline:
            console.sink.add("nbgpu", [f"rank {rank} did not leave its debugger in time"])
            return
        try:
            for who, message in warm.server.poll(POLL_S):
                if who == rank and console.hears(message):
                    console.hear(who, message)
                elif message.get("op") == "done":  # a late answer to an interrupted cell
                    warm.answered(who, int(message.get("cell") or 0))
        except KeyboardInterrupt:
            if deadline is not None:
                raise  # a second interrupt: stop waiting
            deadline = time.monotonic() + INTERRUPT_WAIT_S
            if not console.closing:  # the rank runs a command: cancel it, then quit
                console.closing = True
                warm.interrupt([rank])
                warm.server.send([rank], {"op": "debug-input", "line": None})
