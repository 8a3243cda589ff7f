"""Carry out a clean plan: ask, re-check each pid's identity, SIGTERM, wait, SIGKILL.

Every candidate shares one deadline after SIGTERM (``nbgpu._deadline.wait_gone``);
survivors get SIGKILL and a little more time. A pidfd pins each process so a signal can
never reach a newcomer that reused its pid after the identity check.
"""

from __future__ import annotations

import os
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from nbgpu._deadline import wait_gone
from nbgpu._render import Block, Line, Result
from nbgpu.devices.clean.plan import CleanCandidate, CleanPlan, wrapped
from nbgpu.errors import UserInputError

__all__ = ["CleanOutcome", "CleanReport", "execute_clean"]

# How often the wait loop looks again; short enough that a clean finishes promptly.
_POLL_S = 0.02
# create_time is derived from clock ticks since boot (1/100 s on Linux); a different
# process on the same pid cannot start within this of the one we planned for.
_START_TIME_TOLERANCE_S = 0.05


@dataclass(frozen=True)
class CleanOutcome:
    """What happened to one candidate."""

    pid: int
    result: str  # "terminated" | "killed" | "gone" | "failed: <reason>"


@dataclass(frozen=True)
class CleanReport(Result):
    """The plan, whether it was carried out, and each candidate's outcome."""

    plan: CleanPlan
    outcomes: tuple[CleanOutcome, ...]
    dry_run: bool
    confirmed: bool

    @property
    def ok(self) -> bool:
        """True when no candidate's outcome is a failure."""
        return not any(o.result.startswith("failed") for o in self.outcomes)

    def content(self) -> list[Block]:
        blocks = self.plan.content()
        if not self.plan.candidates:
            return [*blocks, Line("Nothing to stop.")]
        if self.dry_run or not self.confirmed:
            why = "Dry run" if self.dry_run else "Not confirmed"
            return [*blocks, Line(f"{why}: nothing was signalled.")]
        return [
            *blocks,
            Line("Outcome:"),
            *(
                wrapped(
                    f"pid {o.pid}: {o.result}", "  ", "bad" if o.result.startswith("failed") else ""
                )
                for o in self.outcomes
            ),
        ]


# --------------------------------------------------------------------------- executing


@dataclass(eq=False)  # compared by identity in the wait loop
class _Target:
    """A verified candidate: its psutil handle and, where Linux has it, a pidfd.

    A pidfd pins the process itself rather than its number, so a signal sent through it
    can never reach a newcomer that reused the pid after our identity check.
    """

    pid: int
    proc: psutil.Process
    pidfd: int | None
    stopped: bool

    def send(self, sig: signal.Signals) -> None:
        if self.pidfd is not None:
            signal.pidfd_send_signal(self.pidfd, sig)
        else:
            self.proc.send_signal(sig)

    def gone(self) -> bool:
        """Exited: reaped, or a zombie waiting for its (adoptive) parent to reap it."""
        if self.pidfd is not None:
            # A pidfd polls readable once the process has exited, zombie or not.
            readable, _, _ = select.select([self.pidfd], [], [], 0)
            if not readable:
                return False
        try:
            # Reaps it if it happens to be our child, so it does not linger as our zombie.
            self.proc.wait(timeout=0)
        except psutil.TimeoutExpired:
            try:
                return self.proc.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True
        return True

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _open_pidfd(pid: int) -> int | None:
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None or not hasattr(signal, "pidfd_send_signal"):
        return None
    try:
        fd: int = pidfd_open(pid)
    except OSError:
        # ESRCH is caught by the identity check that follows; ENOSYS etc.: fall back.
        return None
    return fd


def _verify(candidate: CleanCandidate) -> _Target | CleanOutcome:
    """Re-check that ``candidate``'s pid is still the process we planned for."""
    holder = candidate.holder
    pidfd = _open_pidfd(holder.pid)  # pin first, then check: no window for pid reuse
    try:
        proc = psutil.Process(holder.pid)
        with proc.oneshot():
            start_time = proc.create_time()
            uid = proc.uids().real
            status = proc.status()
    except psutil.NoSuchProcess:
        if pidfd is not None:
            os.close(pidfd)
        return CleanOutcome(holder.pid, "gone")
    except psutil.AccessDenied:
        if pidfd is not None:
            os.close(pidfd)
        return CleanOutcome(holder.pid, "failed: permission denied re-reading it; not signalled")
    mismatch = None
    if holder.start_time is None or abs(start_time - holder.start_time) > _START_TIME_TOLERANCE_S:
        mismatch = (
            f"pid {holder.pid} is now a different process (started {start_time:.2f}, "
            f"planned for one started {holder.start_time}); not signalled"
        )
    elif uid != holder.uid:
        mismatch = f"pid {holder.pid} now belongs to uid {uid}, not uid {holder.uid}; not signalled"
    elif status == psutil.STATUS_ZOMBIE:
        if pidfd is not None:
            os.close(pidfd)
        return CleanOutcome(holder.pid, "gone")
    if mismatch is not None:
        if pidfd is not None:
            os.close(pidfd)
        return CleanOutcome(holder.pid, f"failed: {mismatch}")
    stopped = status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    return _Target(holder.pid, proc, pidfd, stopped)


def _send(target: _Target, sig: signal.Signals) -> str | None:
    """Send ``sig``; return an outcome if that already settles the target, else None."""
    try:
        target.send(sig)
        if target.stopped and sig == signal.SIGTERM:
            # A stopped process with a SIGTERM handler would sit on the signal until
            # continued; let it run its handler instead of waiting for SIGKILL.
            target.send(signal.SIGCONT)
    except (ProcessLookupError, psutil.NoSuchProcess):
        # Vanished before SIGTERM: it went by itself. Before SIGKILL: SIGTERM did it, late.
        return "gone" if sig == signal.SIGTERM else "terminated"
    except (PermissionError, psutil.AccessDenied):
        return f"failed: permission denied sending {sig.name}"
    except OSError as exc:
        return f"failed: {sig.name}: {exc.strerror}"
    return None


def _signal_all(targets: list[_Target], sig: signal.Signals, results: dict[int, str]) -> None:
    for target in targets:
        outcome = _send(target, sig)
        if outcome is not None:
            results[target.pid] = outcome


def execute_clean(
    plan: CleanPlan,
    *,
    confirm: Callable[[CleanPlan], bool] | None,
    dry_run: bool = False,
    grace_s: float = 3.0,
    kill_wait_s: float = 2.0,
) -> CleanReport:
    """Carry out ``plan``: ask, re-check identities, SIGTERM, wait, SIGKILL, wait.

    ``dry_run`` signals nothing and asks nothing. ``confirm=None`` means the user
    already said yes (``--yes``); otherwise ``confirm(plan)`` is asked once and
    ``False`` signals nothing. All candidates share one ``grace_s`` deadline after
    SIGTERM; survivors get SIGKILL and ``kill_wait_s`` more to disappear.
    """
    if grace_s < 0 or kill_wait_s < 0:
        raise UserInputError(f"grace_s={grace_s}, kill_wait_s={kill_wait_s}: expected seconds >= 0")
    if dry_run or not plan.candidates:
        return CleanReport(plan, (), dry_run=dry_run, confirmed=False)
    confirmed = True if confirm is None else bool(confirm(plan))
    if not confirmed:
        return CleanReport(plan, (), dry_run=False, confirmed=False)

    results: dict[int, str] = {}
    targets: list[_Target] = []
    try:
        for candidate in plan.candidates:
            verified = _verify(candidate)
            if isinstance(verified, CleanOutcome):
                results[verified.pid] = verified.result
            else:
                targets.append(verified)

        _signal_all(targets, signal.SIGTERM, results)
        live = [t for t in targets if t.pid not in results]
        survivors = wait_gone(live, _Target.gone, time.monotonic() + grace_s, poll_s=_POLL_S)
        for target in live:
            if target not in survivors:
                results[target.pid] = "terminated"

        _signal_all(survivors, signal.SIGKILL, results)
        live = [t for t in survivors if t.pid not in results]
        stuck = wait_gone(live, _Target.gone, time.monotonic() + kill_wait_s, poll_s=_POLL_S)
        for target in live:
            if target in stuck:
                try:
                    state = target.proc.status()
                except psutil.NoSuchProcess:
                    results[target.pid] = "killed"
                    continue
                # Typically disk-sleep: stuck in the driver, beyond the reach of signals.
                results[target.pid] = (
                    f"failed: still present {kill_wait_s:g} s after SIGKILL (state {state})"
                )
            else:
                results[target.pid] = "killed"
    finally:
        for target in targets:
            target.close()

    outcomes = tuple(
        CleanOutcome(c.holder.pid, results.get(c.holder.pid, "failed: not handled"))
        for c in plan.candidates
    )
    return CleanReport(plan, outcomes, dry_run=False, confirmed=True)
