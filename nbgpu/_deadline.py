"""One deadline for processes: run a child against it, wait for processes to go by it.

Two needs meet here, standard library only so that every layer can share them:

- :func:`run_with_deadline` runs a short-lived child (the CUDA probe; a stack dumper) in
  its own session and, past the deadline, kills its whole process group with SIGKILL,
  reaps it and returns what it wrote. A child stuck in a driver (uninterruptible sleep)
  cannot be reaped: the result says so instead of blocking.
- :func:`wait_gone` polls a set of processes (or anything else that goes away) until
  every one is gone or a monotonic deadline passes, and returns the rest. The launch
  layer's stop ladder, ``clean`` and the runner above all wait this way.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

__all__ = ["Finished", "run_with_deadline", "wait_gone"]

T = TypeVar("T")

# After SIGKILL a process normally disappears at once; one stuck in the driver
# (uninterruptible sleep) does not, and we must not wait for it forever.
_REAP_TIMEOUT_S = 5.0


def wait_gone(
    items: Iterable[T], gone: Callable[[T], bool], deadline: float, *, poll_s: float = 0.02
) -> list[T]:
    """Poll until ``gone(item)`` holds for every item or ``deadline`` (monotonic) passes.

    Returns the items still there, in their order.
    """
    pending = [item for item in items if not gone(item)]
    while pending and time.monotonic() < deadline:
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
        pending = [item for item in pending if not gone(item)]
    return pending


@dataclass(frozen=True)
class Finished:
    """How a child run against a deadline ended, with everything it wrote."""

    pid: int
    stdout: bytes
    stderr: bytes
    returncode: int | None  # None: still there after SIGKILL (stuck in the driver)
    timed_out: bool
    elapsed_ms: float


def run_with_deadline(argv: Sequence[str], env: Mapping[str, str], *, timeout_s: float) -> Finished:
    """Run ``argv`` in its own session; past ``timeout_s`` kill its whole process group.

    Raises ``OSError`` when the child cannot be started. An interrupt (or any other
    exception) while waiting kills the group before it propagates: no child is left.
    """
    started = time.perf_counter()
    proc = subprocess.Popen(
        list(argv),
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # Its own session and group: one killpg reaches anything it started, and a
        # Ctrl-C meant for the kernel does not reach it behind our back.
        start_new_session=True,
    )
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        stdout, stderr = _kill_group(proc)
    except BaseException:
        # KeyboardInterrupt (the user stopped the cell) or any other exit: leave no child.
        _kill_group(proc)
        raise
    return Finished(
        proc.pid,
        stdout,
        stderr,
        proc.returncode,
        timed_out,
        (time.perf_counter() - started) * 1000,
    )


def _kill_group(proc: subprocess.Popen[bytes]) -> tuple[bytes, bytes]:
    """SIGKILL the child's process group, reap it, and return what it had written."""
    # SIGKILL straight away: the deadline has already passed, and a child run this way
    # holds nothing worth a graceful exit (the kernel frees a dead process's contexts).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=_REAP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # Uninterruptible sleep in the driver: it dies when the driver lets go. Its pipes
        # stay open until then, so reading them would block too.
        _close_pipes(proc)
        return b"", b""
    # SIGKILL is asynchronous: wait until no live process is left in the group.
    wait_gone([proc.pid], _group_gone, time.monotonic() + _REAP_TIMEOUT_S, poll_s=0.01)
    try:
        return proc.communicate(timeout=_REAP_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # a descendant left the group and holds the pipes
        _close_pipes(proc)
        return b"", b""


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True  # the usual case: the child started nothing else
    except PermissionError:
        return False
    proc = Path("/proc")
    if not proc.is_dir():
        return False
    # Killed descendants stay in the group as zombies until init reaps them, which may
    # take a while (or forever, under a PID 1 that does not reap): only live ones count.
    for stat in proc.glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = stat.read_text()
            state, _ppid, pgrp = text[text.rindex(")") + 2 :].split()[:3]
            if int(pgrp) == pgid and state not in ("Z", "X"):
                return False
    return True


def _close_pipes(proc: subprocess.Popen[bytes]) -> None:
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
