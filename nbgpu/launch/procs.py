"""Process trees: find every process of a run and stop them all against one deadline.

(And a free port for a run's rendezvous.)

torchrun puts each worker in its own session, so killing the agent's process
group does not reach them, and a SIGKILLed agent orphans them. nbgpu therefore
finds a run's processes two ways — the agent's descendants, and any process of
this user whose environment carries the run's ``NBGPU_RUN_ID`` (orphans included) —
and stops them with a ladder: a first signal (SIGINT or SIGTERM), SIGTERM, then
SIGKILL, sharing one deadline. Uses psutil; never IPython.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from nbgpu._deadline import wait_gone
from nbgpu.errors import NbgpuError

__all__ = ["StopReport", "free_port", "run_processes", "stop_processes"]

RUN_ID_ENV = "NBGPU_RUN_ID"


def free_port(taken: set[int] | None = None) -> int:
    """A TCP port nobody listens on now (the kernel picks; we skip ports our runs hold)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if not taken or port not in taken:
            return port
    raise NbgpuError("no free TCP port found for the rendezvous")


def _has_run_id(pid: int, run_id: str) -> bool:
    needle = f"{RUN_ID_ENV}={run_id}".encode()
    try:
        data = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return needle in data.split(b"\0")


def run_processes(run_id: str, root_pid: int | None = None) -> list[psutil.Process]:
    """Every live process of the run: the root's tree plus orphans carrying its id."""
    found: dict[int, psutil.Process] = {}
    if root_pid is not None:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(root_pid)
            found[root.pid] = root
            for child in root.children(recursive=True):
                found[child.pid] = child
    uid = os.getuid()
    me = os.getpid()
    for proc in psutil.process_iter(["uids"]):
        try:
            if proc.pid == me or proc.pid in found or proc.info["uids"].real != uid:
                continue
        except (psutil.Error, AttributeError, TypeError):
            continue
        if _has_run_id(proc.pid, run_id):
            found[proc.pid] = proc
    return [p for p in found.values() if _alive(p)]


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@dataclass(frozen=True)
class StopReport:
    signalled: int  # processes that were alive when stopping began
    escalated_to_kill: int  # how many needed SIGKILL
    survivors: tuple[int, ...]  # pids still alive after the deadline (should be empty)
    elapsed_s: float


def _send(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)


def _wait_gone(procs: list[psutil.Process], until: float) -> list[psutil.Process]:
    return wait_gone(procs, lambda p: not _alive(p), until)


def stop_processes(
    run_id: str,
    root_pid: int | None,
    *,
    first_signal: int = signal.SIGTERM,
    grace_s: float = 3.0,
    kill_wait_s: float = 2.0,
) -> StopReport:
    """Signal the whole run, escalate within one deadline, and report survivors.

    The first signal goes to the agent only (torchrun forwards it and shuts its
    workers down in order); after half the grace period everything still alive gets
    SIGTERM, at the deadline SIGKILL.
    """
    started = time.monotonic()
    procs = run_processes(run_id, root_pid)
    if not procs:
        return StopReport(0, 0, (), 0.0)
    deadline = started + grace_s
    root = [p for p in procs if p.pid == root_pid]
    _send(root or procs, first_signal)
    alive = _wait_gone(procs, started + grace_s / 2)
    if alive:
        # Refresh: the agent may have spawned or orphaned processes meanwhile.
        alive = run_processes(run_id, root_pid) or alive
        _send(alive, signal.SIGTERM)
        alive = _wait_gone(alive, deadline)
    killed = 0
    if alive:
        alive = run_processes(run_id, root_pid) or alive
        killed = len(alive)
        _send(alive, signal.SIGKILL)
        alive = _wait_gone(alive, time.monotonic() + kill_wait_s)
    return StopReport(
        signalled=len(procs),
        escalated_to_kill=killed,
        survivors=tuple(p.pid for p in alive),
        elapsed_s=time.monotonic() - started,
    )
