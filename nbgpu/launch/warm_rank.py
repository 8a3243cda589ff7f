"""A warm job's rank: run the kernel's cells, one after another, in one namespace.

The rank connects to the job's private channel (``channel.py``) and waits. For each
cell it marks the boundary in its log (``#### nbgpu cell N ####``), says it started,
loads pushed values, runs the code as memory phases ``cell N imports`` and ``cell N``,
and answers with how the cell ended and the pulled values. An exception is a failed
cell, not a dead rank: the traceback goes to the log and the rank waits for the next
cell, its globals, process group and CUDA context intact.

SIGINT interrupts a running cell only (KeyboardInterrupt in the user's code, like a
kernel); between cells it is ignored, so a late interrupt never kills a rank. The
kernel saying ``stop``, or hanging up (it died), ends the loop: the rank then exits
normally and its finalizers run.

Runs inside rank processes only: standard library at import time.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
from types import FrameType
from typing import Any

from nbgpu.launch.channel import CELL_MARK, connect, receive, send
from nbgpu.launch.rank_code import pull_payload, run_code, user_traceback
from nbgpu.profile.recorder import Recorder

__all__ = ["serve"]

_in_cell = [False]  # whether SIGINT means KeyboardInterrupt right now


def _on_interrupt(_signum: int, _frame: FrameType | None) -> None:
    if _in_cell[0]:
        raise KeyboardInterrupt


def serve(spec: dict[str, Any], namespace: dict[str, Any], rec: Recorder, *, rank: int) -> int:
    """Run cells until the kernel says stop or goes away; the rank's exit code (0)."""
    sock = connect(spec["channel"], spec["token"], {"rank": rank, "pid": os.getpid()})
    signal.signal(signal.SIGINT, _on_interrupt)
    try:
        while True:
            message = receive(sock)
            if message is None or message.get("op") == "stop":
                return 0
            if message.get("op") != "cell":
                continue
            number = int(message["cell"])
            try:
                answer = _run_cell(message, namespace, rec, sock, rank)
            except KeyboardInterrupt:
                # Landed after the cell's code, before its answer: still an interrupted cell.
                answer = {"op": "done", "cell": number, "status": "interrupted",
                          "error": "KeyboardInterrupt"}  # fmt: skip
            sys.stdout.flush()
            sys.stderr.flush()
            send(sock, answer)
    except OSError:
        return 0  # the kernel's end closed mid-message: it is gone, and so is the job
    finally:
        sock.close()


def _run_cell(
    message: dict[str, Any],
    namespace: dict[str, Any],
    rec: Recorder,
    sock: Any,
    rank: int,
) -> dict[str, Any]:
    number = int(message["cell"])
    filename = str(message["filename"])
    print(f"{CELL_MARK}{number} ####", flush=True)  # the log's cell boundary
    send(sock, {"op": "started", "cell": number})
    status, error = "ok", None
    _in_cell[0] = True
    try:
        for name, blob in (message.get("push") or {}).items():
            namespace[name] = pickle.loads(blob)  # noqa: S301  (from our private channel)
        namespace["__file__"] = filename
        sys.argv = [filename, *message.get("script_args", [])]
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
    except BaseException as exc:  # noqa: BLE001  (a cell's failure is reported; the rank stays)
        status, error = "error", f"{type(exc).__name__}: {exc}"
        sys.stderr.write(user_traceback(exc))
    finally:
        _in_cell[0] = False
    answer: dict[str, Any] = {"op": "done", "cell": number, "status": status, "error": error}
    names = list(message.get("pull") or [])
    if status == "ok" and names and (rank == 0 or message.get("pull_all_ranks")):
        answer["pulled"] = pull_payload(names, namespace)
    return answer
