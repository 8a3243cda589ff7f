"""The rank's side of the flight recorder: its collectives, written to the run directory on request.

PyTorch records each rank's last collectives when ``TORCH_FR_BUFFER_SIZE`` is set (the
launcher sets it). Only the rank itself can read them, and a rank stuck in a collective runs
no Python signal handler until the collective returns, so a daemon thread does it: it looks
for a new request in ``fr-request`` twice a second (a file, not a signal or a pipe, so it
works on every node of a run dir shared over NFS) and writes ``fr-rank{N}.json``.
Standard library at import time; torch only once the user's code has imported it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from pathlib import Path

__all__ = ["REQUEST", "dump", "record_path", "serve"]

REQUEST = "fr-request"
_POLL_S = 0.5


def record_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"fr-rank{rank}.json"


def dump(run_dir: Path, rank: int, token: str) -> bool:
    """Write this rank's flight record, tagged with *token* (an empty one when the user's
    code never imported torch.distributed, or this torch has no recorder)."""
    trace = b"{}"  # an answer all the same: the kernel need not wait for this rank
    if "torch.distributed" in sys.modules:
        with contextlib.suppress(ImportError, RuntimeError):
            # Not in torch's type stubs (torch 2.13 has it, CPU builds too).
            from torch._C._distributed_c10d import _dump_fr_trace_json  # type: ignore[attr-defined]  # noqa: PLC0415

            trace = bytes(_dump_fr_trace_json())
    head = f'{{"token": "{token}", "pid": {os.getpid()}, "time_ns": {time.time_ns()}, "trace": '
    path = record_path(run_dir, rank)
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(OSError):
        tmp.write_bytes(head.encode() + trace + b"}")
        tmp.replace(path)  # atomic: the kernel never reads half a record
        return True
    return False


def _requested(request: Path) -> str | None:
    try:
        return request.read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def _serve(run_dir: Path, rank: int) -> None:
    request = run_dir / REQUEST
    seen = _requested(request)  # a request older than this rank is not for it
    while True:
        time.sleep(_POLL_S)
        token = _requested(request)
        if token is not None and token != seen:
            seen = token
            dump(run_dir, rank, token)


def serve(run_dir: Path, rank: int) -> None:
    """Answer the kernel's requests for this rank's flight record, for the life of the rank."""
    threading.Thread(
        target=_serve, args=(run_dir, rank), name="nbgpu-flight-recorder", daemon=True
    ).start()
