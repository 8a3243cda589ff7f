"""The processes nbgpu starts, from the parent's side and the child's: standard library only.

Every process nbgpu starts (the device probe, torchrun's agent, each rank) must die with
its parent and import the same nbgpu, also from a checkout that is not installed. A
short-lived child (the CUDA probe, a stack dumper) runs in its own session against one
deadline, its whole group killed past it. A message between a warm job's kernel and its
ranks crosses whole, whatever SIGINT does meanwhile. Importable by every layer and by rank
processes before anything heavy is loaded.
"""

import contextlib
import ctypes
import os
import signal
import site
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

__all__ = ["Finished", "die_with_parent", "package_root", "pid_exists", "run_with_deadline",
           "set_parent_death_signal", "sigint_held", "wait_gone", "with_package_importable"]  # fmt: skip

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def set_parent_death_signal(sig: int) -> str | None:
    """Ask the kernel to send *sig* when our parent dies; the reason if it refused (prctl
    fails through its return value: unchecked, the guarantee would be lost silently)."""
    if sys.platform != "linux":
        return f"no parent-death signal on {sys.platform}"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            return f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(errno) if errno else 'error'}"
    except (OSError, AttributeError) as exc:
        return f"prctl(PR_SET_PDEATHSIG) unavailable: {exc}"
    return None


def die_with_parent(sig: int, expected_parent: int | None) -> str | None:
    """Receive *sig* when the parent dies, and exit now if it died while this interpreter
    started (before prctl took effect, so no signal will come); why the signal could not be
    set up, else None. *expected_parent* (the launcher's pid) must still be an ancestor, not
    the parent: a wrapper (``sudo``, a venv shim) may sit in between."""
    problem = set_parent_death_signal(sig)
    if expected_parent and not _is_ancestor(expected_parent):
        os._exit(128 + int(sig))
    return problem


def _is_ancestor(pid: int) -> bool:
    current = os.getppid()
    # /proc is exact (a reused pid elsewhere does not count); without it, the pid existing must do.
    for _ in range(64):
        if current == pid:
            return True
        if current <= 1:
            return False
        try:
            stat = Path(f"/proc/{current}/stat").read_text(encoding="utf-8")
        except OSError:
            return pid_exists(pid)
        # The command name (field 2) may contain spaces and parentheses: split after it.
        current = int(stat.rsplit(")", 1)[1].split()[1])
    return False


def pid_exists(pid: int) -> bool:
    try:
        with contextlib.suppress(PermissionError):  # alive, under another user
            os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def sigint_held() -> Iterator[None]:
    """SIGINT waits while a message crosses a channel, then goes to the handler it waited
    for. A ``multiprocessing`` connection reads a message's length, then its body: a
    KeyboardInterrupt between the two leaves the body to be read as the next message's
    length, and the channel speaks garbage from then on. Signals reach the main thread
    only; elsewhere (and under a handler set outside Python) this holds nothing."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield
        return
    held: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held and callable(previous):
            previous(signal.SIGINT, sys._getframe())  # the KeyboardInterrupt, now
        elif held and previous == signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGINT)


def package_root() -> str:
    return str(Path(__file__).resolve().parent.parent)


def with_package_importable(environ: Mapping[str, str]) -> dict[str, str]:
    """A copy of *environ* in which a child Python imports this same nbgpu: a checkout
    that is not installed goes in front of PYTHONPATH. An installed copy is left alone
    (site-packages on PYTHONPATH would come before the standard library)."""
    env = dict(environ)
    root = package_root()
    site_dirs: set[str] = set()
    with contextlib.suppress(AttributeError):  # site helpers are missing in some venvs
        site_dirs = {
            str(Path(p).resolve()) for p in [*site.getsitepackages(), site.getusersitepackages()]
        }
    if root in site_dirs:
        return env
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([root, *paths])
    return env


T = TypeVar("T")

# After SIGKILL a process normally disappears at once; one stuck in the driver
# (uninterruptible sleep) does not, and we must not wait for it forever.
_REAP_TIMEOUT_S = 5.0


def wait_gone(
    items: Iterable[T], gone: Callable[[T], bool], deadline: float, *, poll_s: float = 0.02
) -> list[T]:
    """The items not ``gone`` by *deadline* (monotonic), in their order; polls until then."""
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
    """Run ``argv`` in its own session; past ``timeout_s`` kill its whole process group, as
    on an interrupt while waiting. ``OSError`` when the child cannot be started."""
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
        proc.pid, stdout, stderr, proc.returncode, timed_out, (time.perf_counter() - started) * 1000
    )


def _kill_group(proc: subprocess.Popen[bytes]) -> tuple[bytes, bytes]:
    """SIGKILL the child's process group, reap it, and return what it had written."""
    # SIGKILL straight away: the deadline has already passed, and a child run this way
    # holds nothing worth a graceful exit (the kernel frees a dead process's contexts).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=_REAP_TIMEOUT_S)
        # SIGKILL is asynchronous: wait until no live process is left in the group.
        wait_gone([proc.pid], _group_gone, time.monotonic() + _REAP_TIMEOUT_S, poll_s=0.01)
        return proc.communicate(timeout=_REAP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # Uninterruptible sleep in the driver (it dies when the driver lets go), or a descendant
        # that left the group: either holds the pipes open, so reading them would block too.
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
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
