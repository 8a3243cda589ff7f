"""The user's code inside a rank: once (a cold run), or cell after cell (a warm job).

A warm job's rank runs the cells the kernel sends over the job's private channel (a
``multiprocessing`` Client, the job's token as authkey; the kernel's end is
``nbgpu.launch.streams``). An exception fails the cell, not the rank; SIGINT interrupts a
running cell only; ``stop`` or a hang-up ends the loop and the rank exits normally.
Standard library (and nbgpu's recording side).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import json
import os
import pickle
import runpy
import signal
import sys
import threading
import time
import traceback
import types
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from nbgpu._children import sigint_held
from nbgpu.profile.phases import Phase
from nbgpu.profile.recorder import Recorder
from nbgpu.rank.debugger import post_mortem, remember_failure, stop_at_breakpoints

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

__all__ = ["pull_payload", "report_error", "run_code", "run_once", "serve"]

_OURS = str(Path(__file__).parents[1])  # the nbgpu package: the worker, init, the simulation


def user_traceback(exc: BaseException) -> str:
    """The traceback without nbgpu's frames (the worker, ``init``, the interrupt handler, the
    simulated GPU) and runpy's, as IPython leaves out its own machinery; a cell's file is
    named as it is in the run directory (``cell3.py``), which the record names once."""
    run_dir = os.environ.get("NBGPU_RUN_DIR", "\0")
    shown = traceback.TracebackException.from_exception(exc)
    error: traceback.TracebackException | None = shown
    while error is not None:
        kept = [f for f in error.stack if not f.filename.startswith((_OURS, runpy.__file__))]
        for frame in kept:
            if frame.filename.startswith(run_dir):
                _ = frame.line  # read from the file by its full name, before it is shortened
                frame.filename = os.path.relpath(frame.filename, run_dir)
        if kept:  # an error inside nbgpu itself keeps every frame
            error.stack = traceback.StackSummary.from_list(kept)
        error = error.__cause__ or error.__context__
    return "".join(shown.format())


def report_error(exc: BaseException, error_path: str) -> None:
    """The traceback on stderr (the rank's log), and torchelastic's error file."""
    formatted = user_traceback(exc)
    sys.stderr.write(formatted)
    # The exact structure torch's ErrorHandler.record_exception writes, plus a finer
    # timestamp of our own: whole seconds cannot order ranks that fail together.
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": formatted,
                "timestamp": str(int(time.time())),
                "nbgpu_time": repr(time.time()),
            },
        }
    }
    with contextlib.suppress(OSError):
        Path(error_path).write_text(json.dumps(data), encoding="utf-8")


def _split_leading_imports(source: str, filename: str) -> tuple[Any, Any, int]:
    """(leading import block, rest), compiled with their line numbers; the block's length."""
    tree = ast.parse(source, filename)
    cut = 0
    for node in tree.body:
        is_doc = cut == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        if isinstance(node, ast.Import | ast.ImportFrom) or is_doc:
            cut += 1
        else:
            break
    head = ast.Module(body=tree.body[:cut], type_ignores=[])
    tail = ast.Module(body=tree.body[cut:], type_ignores=[])
    return compile(head, filename, "exec"), compile(tail, filename, "exec"), cut


def run_code(
    source: str,
    filename: str,
    namespace: dict[str, Any],
    rec: Recorder,
    *,
    serial_imports: bool,
    open_phase: int | None = None,
    phases: tuple[str, str] = ("imports", "run"),
    empty_imports_phase: bool = True,
) -> None:
    """Cells, scripts and warm cells alike (``--serial-imports`` serialises a script's leading
    imports too). *open_phase* (the rank's ``start``) ends once the code compiled."""
    head, tail, imports = _split_leading_imports(source, filename)
    if open_phase is not None:
        rec.end(open_phase)
    if imports or empty_imports_phase:
        with contextlib.ExitStack() as turn:
            if serial_imports:
                from nbgpu.rank.job import one_at_a_time  # noqa: PLC0415  (--serial-imports only)

                waiting = rec.begin("wait-imports")
                turn.enter_context(one_at_a_time("imports"))
                rec.end(waiting)
            with Phase(phases[0], rec):
                exec(head, namespace)  # noqa: S102  (running the user's own code is the point)
    with Phase(phases[1], rec):
        exec(tail, namespace)  # noqa: S102


def pull_payload(names: list[str], namespace: dict[str, Any]) -> dict[str, Any]:
    """The pulled variables, each pickled on its own: one bad value hides no other."""
    payload: dict[str, Any] = {"values": {}, "missing": [], "errors": {}}
    for name in names:
        if name not in namespace:
            payload["missing"].append(name)
            continue
        value = namespace[name]
        try:
            payload["values"][name] = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001  (any pickling failure is reported, not fatal)
            payload["errors"][name] = f"{type(value).__name__} cannot be pickled ({exc})"
    return payload


def _enter(
    namespace: dict[str, Any], filename: str, push: dict[str, bytes], args: list[str]
) -> None:
    """Pushed values in; ``__file__`` and ``sys.argv`` (``%%torchrun ... -- args``) set."""
    # Pickled by the kernel; they came through the 0700 run directory or the private channel.
    namespace.update({name: pickle.loads(blob) for name, blob in push.items()})  # noqa: S301
    namespace["__file__"] = filename
    sys.argv = [filename, *args]


def run_once(
    spec: dict[str, Any],
    namespace: dict[str, Any],
    rec: Recorder,
    start_phase: int,
    error_path: str,
) -> tuple[int, dict[str, Any]]:
    """A cold run: the cell or script, once; the rank's exit code and namespace."""
    push = Path(os.environ["NBGPU_RUN_DIR"]) / "push.pkl"
    try:
        filename = spec.get("script") or spec["cell"]
        if spec.get("script"):
            # A fresh ``__main__`` module for a script, as ``python script.py`` would make it.
            module = types.ModuleType("__main__")
            module.__file__ = filename
            module.__dict__["__builtins__"] = __builtins__
            sys.modules["__main__"] = module  # pickling classes the script defines finds them
            sys.path.insert(0, str(Path(filename).resolve().parent))
            namespace = module.__dict__
        pushed = pickle.loads(push.read_bytes()) if push.exists() else {}  # noqa: S301
        _enter(namespace, filename, pushed, spec.get("script_args", []))
        run_code(
            Path(filename).read_text(encoding="utf-8"),
            filename,
            namespace,
            rec,
            serial_imports=bool(spec.get("serial_imports")),
            open_phase=start_phase,
        )
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code not in (None, 0) and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
        return code, namespace
    except BaseException as exc:  # noqa: BLE001  (a rank must report every failure, then exit)
        report_error(exc, error_path)
        return 130 if isinstance(exc, KeyboardInterrupt) else 1, namespace
    return 0, namespace


_in_cell = [False]  # whether SIGINT means KeyboardInterrupt right now
_SENDING = threading.Lock()  # the channel's writers: the cell loop and a --ranks watchdog
_INTERRUPTED = {"status": "interrupted", "error": "KeyboardInterrupt"}


def _on_interrupt(_signum: int, _frame: FrameType | None) -> None:
    if _in_cell[0]:
        raise KeyboardInterrupt


def serve(spec: dict[str, Any], namespace: dict[str, Any], rec: Recorder, *, rank: int) -> int:
    """Run cells until the kernel says stop or goes away; the rank's exit code (0)."""
    from multiprocessing.connection import Client  # noqa: PLC0415  (only warm jobs' ranks)

    # Both ends prove they hold the job's token before anything is unpickled. Across nodes
    # the socket is the node's relay's (nbgpu.launch.relay), named in NBGPU_CELLS.
    address = os.environ.get("NBGPU_CELLS") or spec["channel"]
    conn = Client(address, family="AF_UNIX", authkey=spec["token"].encode())
    conn.send({"op": "hello", "rank": rank, "pid": os.getpid()})
    signal.signal(signal.SIGINT, _on_interrupt)
    say = functools.partial(_send, conn)
    stop_at_breakpoints(conn, say)
    try:
        while True:
            message = conn.recv()
            if message.get("op") == "stop":
                return 0
            if message.get("op") == "debug":  # %gpu_debug: pdb on the last failed cell
                say(post_mortem(conn, say, _in_cell))
                continue
            if message.get("op") != "cell":
                continue
            try:
                answer = _run_cell(message, namespace, rec, conn, rank)
            except KeyboardInterrupt:
                # Landed after the cell's code, before its answer: still an interrupted cell.
                answer = {"op": "done", "cell": int(message["cell"]), **_INTERRUPTED}
            sys.stdout.flush()
            sys.stderr.flush()
            _send(conn, answer)
    except (EOFError, OSError):
        return 0  # the kernel hung up (mid-message too): it is gone, and so is the job
    finally:
        conn.close()


def _run_cell(
    message: dict[str, Any], namespace: dict[str, Any], rec: Recorder, conn: Connection, rank: int
) -> dict[str, Any]:
    # Warm jobs only: a cold rank reaches the user's first line without them.
    from nbgpu.rank.held import held_names  # noqa: PLC0415
    from nbgpu.rank.subset import on_ranks  # noqa: PLC0415

    number = int(message["cell"])
    filename = str(message["filename"])
    print(message["mark"], flush=True)  # the log's cell boundary, as the kernel reads it
    _send(conn, {"op": "started", "cell": number})
    status, error = "ok", None
    remember_failure(None)
    _in_cell[0] = True
    subset = on_ranks(message, namespace, lambda note: _send(conn, note))  # None: every rank
    try:
        _enter(namespace, filename, message.get("push") or {}, message.get("script_args", []))
        run_code(
            message["source"],
            filename,
            namespace,
            rec,
            serial_imports=bool(message.get("serial_imports")),
            phases=(f"cell {number} imports", f"cell {number}"),
            empty_imports_phase=False,
        )
    except SystemExit as exc:
        if exc.code not in (None, 0):
            status, error = "error", f"SystemExit: {exc.code}"
            print(f"SystemExit: {exc.code}", file=sys.stderr)
    except KeyboardInterrupt as exc:
        status, error = "interrupted", "KeyboardInterrupt"
        sys.stderr.write(user_traceback(exc))
        remember_failure(exc)
    except BaseException as exc:  # noqa: BLE001  (a cell's failure is reported; the rank stays)
        status, error = "error", f"{type(exc).__name__}: {exc}"
        sys.stderr.write(user_traceback(exc))
        remember_failure(exc)
    finally:
        _in_cell[0] = False
        if subset is not None:
            subset.close()
    answer: dict[str, Any] = {"op": "done", "cell": number, "status": status, "error": error}
    answer["names"] = held_names(namespace)  # for %gpu_runs NAME and --pull <TAB>
    names = list(message.get("pull") or [])
    first = min(message.get("ranks") or [0])  # --pull takes rank 0's, or the first that ran
    if status == "ok" and names and (rank == first or message.get("pull_all_ranks")):
        answer["pulled"] = pull_payload(names, namespace)
    return answer


def _send(conn: Connection, message: dict[str, Any]) -> None:
    with sigint_held(), _SENDING:  # the lock is let go before a held interrupt lands
        conn.send(message)
