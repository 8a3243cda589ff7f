"""Running the user's code inside a rank: the same for a cold run and a warm cell.

The code is compiled as its leading import block and the rest, each a recorded memory
phase (``--serial-imports`` takes the first one rank at a time); a failure's traceback
starts at the user's first frame; torchelastic's error file is written the way
``@record`` writes it; pulled variables are pickled one by one so one bad value does
not hide the others.

Runs inside rank processes only: standard library (and nbgpu's recording side).
"""

from __future__ import annotations

import ast
import contextlib
import json
import pickle
import runpy
import time
import traceback
from pathlib import Path
from typing import Any

from nbgpu.profile.recorder import Recorder

__all__ = [
    "pull_payload",
    "run_code",
    "user_traceback",
    "write_error_file",
]

_OURS = str(Path(__file__).parent)  # nbgpu/launch: the worker, this module, the warm loop


def user_traceback(exc: BaseException) -> str:
    """The traceback from the user's first frame on: nbgpu's and runpy's frames are noise."""
    tb = exc.__traceback__
    while (
        tb is not None
        and tb.tb_next is not None
        and (
            tb.tb_frame.f_code.co_filename.startswith(_OURS)
            or tb.tb_frame.f_code.co_filename == runpy.__file__
        )
    ):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def write_error_file(path: str, exc: BaseException, formatted: str) -> None:
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
        Path(path).write_text(json.dumps(data), encoding="utf-8")


def _split_leading_imports(source: str, filename: str) -> tuple[Any, Any, int]:
    """Compile the code as (leading import block, rest), keeping line numbers; the
    block's statement count."""
    tree = ast.parse(source, filename)
    cut = 0
    for node in tree.body:
        is_docstring = (
            cut == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        )
        if isinstance(node, ast.Import | ast.ImportFrom) or is_docstring:
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
    """Run code as its leading import block, then the rest, each a recorded phase.

    The same split for cells, scripts and warm cells, so ``--serial-imports`` serialises
    a script's leading imports exactly like a cell's, and a phase name means one thing.
    *open_phase* (the rank's ``start``) ends once the code compiled. Without
    *empty_imports_phase*, code with no leading imports records no imports phase.
    """
    head, tail, imports = _split_leading_imports(source, filename)
    imports_phase, run_phase = phases
    if open_phase is not None:
        rec.end(open_phase)
    if imports or empty_imports_phase:
        _run_imports(rec, imports_phase, head, namespace, serial=serial_imports)
    _phase_exec(rec, run_phase, tail, namespace)


def _run_imports(
    rec: Recorder, phase: str, code: Any, namespace: dict[str, Any], *, serial: bool
) -> None:
    if not serial:
        _phase_exec(rec, phase, code, namespace)
        return
    from nbgpu.rank import one_at_a_time  # noqa: PLC0415  (only with --serial-imports)

    waiting = rec.begin("wait-imports")
    with one_at_a_time("imports"):
        rec.end(waiting)
        _phase_exec(rec, phase, code, namespace)


def _phase_exec(rec: Recorder, name: str, code: Any, namespace: dict[str, Any]) -> None:
    phase_id = rec.begin(name)
    try:
        exec(code, namespace)  # noqa: S102  (running the user's own code is the point)
    except BaseException as exc:
        rec.end(phase_id, error=f"{type(exc).__name__}: {exc}"[:300])
        raise
    rec.end(phase_id)


def _pickle_or_reason(value: Any) -> tuple[bytes | None, str]:
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), ""
    except Exception as exc:  # noqa: BLE001  (any pickling failure is reported, not fatal)
        return None, f"{type(value).__name__} cannot be pickled ({exc})"


def pull_payload(names: list[str], namespace: dict[str, Any]) -> dict[str, Any]:
    """The pulled variables, each pickled on its own: values, missing names, reasons."""
    payload: dict[str, Any] = {
        "values": {},
        "missing": [n for n in names if n not in namespace],
        "errors": {},
    }
    for name in names:
        if name not in namespace:
            continue
        blob, problem = _pickle_or_reason(namespace[name])
        if blob is not None:
            payload["values"][name] = blob
        else:
            payload["errors"][name] = problem
    return payload
