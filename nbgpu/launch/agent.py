"""The torchrun agent, wrapped: ``python -m nbgpu.launch.agent RESULT.json -- <torchrun args>``.

It is torchrun (``torch.distributed.run``) with three additions nbgpu relies on:
it dies when the process that launched it dies (parent-death signal: a kernel
killed with SIGKILL takes its jobs with it); it tells the workers its pid so they
can do the same; and it writes a machine-readable result — per-rank exit codes,
signals, error files and the first failure — instead of leaving nbgpu to parse
torchrun's banner.

Runs in its own process; imports torch (it is torchrun).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # SIGTERM, not SIGKILL: torchrun's handler then stops its workers itself; the
    # workers' own parent-death signal covers the case where that fails.
    expected = int(os.environ.get("NBGPU_LAUNCHER_PID", "0") or 0)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if expected and os.getppid() != expected:
        os._exit(128 + signal.SIGTERM)


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2), encoding="utf-8")
    tmp.replace(path)


def _failures(exc: Any) -> list[dict[str, Any]]:
    out = []
    for rank, failure in sorted(exc.failures.items()):
        exitcode = int(failure.exitcode)
        out.append(
            {
                "rank": int(rank),
                "local_rank": int(failure.local_rank),
                "pid": int(failure.pid),
                "exit_code": exitcode,
                "signal": failure.signal_name() if exitcode < 0 else None,
                "error_file": failure.error_file or None,
                "timestamp": failure.timestamp,
                "message": failure.message,
            }
        )
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] != "--":
        print("usage: python -m nbgpu.launch.agent RESULT.json -- <torchrun args>", file=sys.stderr)
        return 2
    result_path = Path(argv[0])
    _die_with_parent()
    os.environ["NBGPU_AGENT_PID"] = str(os.getpid())  # inherited by every worker
    started = time.time()
    from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: PLC0415
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: PLC0415
    from torch.distributed.run import parse_args, run  # noqa: PLC0415

    args = parse_args(argv[2:])
    result: dict[str, Any] = {"started_at": started, "failures": [], "signal": None}
    code = 0
    try:
        run(args)
    except ChildFailedError as exc:
        result["failures"] = _failures(exc)
        first_rank, _ = exc.get_first_failure()
        result["first_failure_rank"] = int(first_rank)
        code = 1
    except SignalException as exc:
        result["signal"] = exc.sigval.name
        code = 128 + int(exc.sigval)
    except KeyboardInterrupt:
        result["signal"] = "SIGINT"
        code = 130
    except Exception as exc:  # noqa: BLE001  (torchrun's own failures: report them, exit non-zero)
        import traceback  # noqa: PLC0415

        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}"
        code = 1
    result["ended_at"] = time.time()
    result["agent_exit_code"] = code
    _write(result_path, result)
    return code


if __name__ == "__main__":
    exit_code = main(sys.argv[1:])
    # The agent runs no user code and its result is on disk: skip the interpreter's
    # teardown of torch (about a second on 2 cores) instead of making the user wait.
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
