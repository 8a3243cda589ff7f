"""Stop stale GPU holders: this user's orphans only, listed first, confirmed, by pid.

It replaces the folklore ``pkill -9 -f sglang`` and ``fuser -k /dev/nvidia*``: by name, all
of them, other people's jobs too. A candidate is the current user's (real uid), looked up
on this machine (not a fleet file's record), not this process, an ancestor or a protected
pid, holds a GPU or a ``/dev/nvidia*`` file, and is stale: orphaned, or a torchrun worker
whose agent is gone. Everything else is *skipped with a reason* saying what to do instead;
a name never selects anything. :func:`execute_clean` asks, re-checks each pid's identity
through a pidfd that pins it (pid reuse), sends SIGTERM, waits on one shared deadline, then
SIGKILLs what is left. NVML's holders arrive as ``HolderInfo`` from the caller: no pynvml.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import textwrap
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import psutil

from nbgpu._children import wait_gone
from nbgpu._render import Block, Line, Result, Section, Title
from nbgpu.devices.holders import _STOPPED_STATES, HolderInfo, _clip, describe_pid
from nbgpu.errors import UserInputError

__all__ = ["CleanEntry", "CleanOutcome", "CleanPlan", "CleanReport", "execute_clean", "plan_clean"]

# How often the wait loop looks again; short enough that a clean finishes promptly.
_POLL_S = 0.02
# create_time is derived from clock ticks since boot (1/100 s on Linux); a different
# process on the same pid cannot start within this of the one we planned for.
_START_TIME_TOLERANCE_S = 0.05
_WIDTH = 80


def _wrapped(text: str, indent: str = " " * 6, level: str = "") -> Line:
    """A sentence under its holder's line, continued two columns further in."""
    lines = textwrap.wrap(text, _WIDTH, initial_indent=indent, subsequent_indent=indent + "  ")
    return Line("\n".join(lines) or indent, wrap=False, level=level)


def _holds(gpus: Sequence[int], files: Sequence[str]) -> str:
    held = ("GPU " if len(gpus) == 1 else "GPUs ") + ",".join(map(str, gpus)) if gpus else ""
    return " and ".join(part for part in (held, ", ".join(files)) if part) or "nothing"


def _head(entry: CleanEntry) -> Line:
    """The entry's line: pid, user, what it holds, its command (columns in terminals)."""
    holder = entry.holder
    where = ("GPU " + ",".join(map(str, entry.gpus))) if entry.gpus else "fd only"
    head = f"  pid {holder.pid:<7} {_clip(holder.user or '?', 10):<10} {where:<10} "
    return Line(head + _clip(holder.command or "(command unknown)", _WIDTH - len(head)), wrap=False)


@dataclass(frozen=True)
class CleanEntry:
    """A GPU holder, and why clean stops it (the evidence it is stale) or leaves it alone."""

    holder: HolderInfo
    gpus: tuple[int, ...]  # NVML indices it holds; empty if it only holds a /dev/nvidia* fd
    reason: str  # e.g. "orphaned torchrun rank (agent gone: parent is pid 1)"
    device_files: tuple[str, ...] = ()  # /dev/nvidia* files it holds open


@dataclass(frozen=True)
class CleanPlan(Result):
    """What :func:`execute_clean` would stop, and what it leaves alone and why."""

    candidates: tuple[CleanEntry, ...]  # to stop
    skipped: tuple[CleanEntry, ...]  # left alone

    def content(self) -> list[Block]:
        # The listing shown before anything is signalled; fits 80 columns.
        if not self.candidates and not self.skipped:
            return [Title("nbgpu clean: no process holds a GPU or a /dev/nvidia* file.")]
        headline = (
            f"nbgpu clean: {len(self.candidates)} stale process(es) of yours to stop, "
            f"{len(self.skipped)} left alone."
        )
        blocks: list[Block] = [Title(headline)]
        for title, group, level in (
            ("To stop (SIGTERM, then SIGKILL if still running):", self.candidates, "warn"),
            ("Left alone:", self.skipped, ""),
        ):
            if group:
                blocks.append(Line(title, wrap=False))
            blocks += [Section([_head(e), _wrapped(e.reason)], level) for e in group]
        return blocks


@dataclass(frozen=True)
class CleanOutcome:
    pid: int
    result: str  # "terminated" | "killed" | "gone" | "failed: <reason>"


@dataclass(frozen=True)
class CleanReport(Result):
    plan: CleanPlan
    outcomes: tuple[CleanOutcome, ...]
    dry_run: bool
    confirmed: bool

    @property
    def ok(self) -> bool:
        return not any(o.result.startswith("failed") for o in self.outcomes)

    def content(self) -> list[Block]:
        blocks = self.plan.content()
        if not self.plan.candidates:
            return [*blocks, Line("Nothing to stop.")]
        if self.dry_run or not self.confirmed:
            why = "Dry run" if self.dry_run else "Not confirmed"
            return [*blocks, Line(f"{why}: nothing was signalled.")]
        outcomes = [
            _wrapped(
                f"pid {o.pid}: {o.result}", "  ", "bad" if o.result.startswith("failed") else ""
            )
            for o in self.outcomes
        ]
        return [*blocks, Line("Outcome:"), *outcomes]


def _self_and_ancestors() -> dict[int, str]:
    protected = {os.getpid(): "this process"}
    try:
        for parent in psutil.Process().parents():
            protected.setdefault(parent.pid, "an ancestor of this process")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        # An ancestor exited while we walked up; the direct parent is still known.
        protected.setdefault(os.getppid(), "an ancestor of this process")
    return protected


def _parent_phrase(holder: HolderInfo) -> str:
    if holder.ppid is None or holder.ppid <= 0:
        return "a parent outside this PID namespace"
    if holder.ppid == os.getpid():
        return f"parent pid {holder.ppid} (this process)"
    command = _clip(holder.parent_command, 40) if holder.parent_command else "command unknown"
    return f"parent pid {holder.ppid} ({command})"


def _skip_reason(holder: HolderInfo, uid: int, protected: Mapping[int, str]) -> str | None:
    """Why ``holder`` must not be touched, or None if it may be judged stale."""
    if holder.recorded:
        return "recorded in a fleet file, not a process on this machine: nothing to signal here"
    if holder.pid in protected:
        return f"{protected[holder.pid]}: never stopped by clean"
    if holder.state == "dead":
        return (
            "already gone: nothing to stop. If the GPU stays busy its context leaked: "
            "reset the GPU (nvidia-smi --gpu-reset) or reboot"
        )
    if holder.state == "other_namespace":
        return (
            "not in this PID namespace (a host pid): it cannot be signalled from here; "
            "stop it on the host, or run this container with --pid=host"
        )
    if holder.state == "no_access":
        return "cannot inspect it (permission denied): not provably yours"
    if holder.uid is None:
        return "owner unknown: not provably yours"
    if holder.uid != uid:
        who = f"{holder.user} (uid {holder.uid})" if holder.user else f"uid {holder.uid}"
        return f"belongs to {who}, not you: clean only stops your own processes"
    if holder.state == "zombie":
        if holder.ppid == 1:
            return (
                "zombie (already exited): only its parent can clear it, and that is pid 1, "
                "which does not reap it; run the container with --init, or restart it"
            )
        return (
            f"zombie (already exited): signals cannot clear it; its {_parent_phrase(holder)} "
            "must reap it: stop or restart that parent"
        )
    if holder.start_time is None:
        return "start time unreadable: cannot guard against pid reuse"
    return None


def plan_clean(
    gpu_holders: Mapping[int, Sequence[HolderInfo]],
    device_files: Mapping[int, Sequence[str]] | None = None,
    *,
    uid: int | None = None,
    protect: Collection[int] = (),
) -> CleanPlan:
    """Stop or leave alone each GPU holder (by NVML index) and ``/dev/nvidia*`` holder (pid
    -> open paths; looked up here when NVML did not list it); ``protect``: more pids to spare."""
    own_uid = os.getuid() if uid is None else uid
    protected = _self_and_ancestors()
    for pid in protect:
        protected.setdefault(pid, "protected by the caller")
    # pid 1 is the namespace's init: signalling it is never a clean-up.
    protected.setdefault(1, "pid 1 (init)")

    holders: dict[int, HolderInfo] = {}
    gpus: dict[int, set[int]] = {}
    for index, listed in gpu_holders.items():
        for holder in listed:
            holders.setdefault(holder.pid, holder)
            gpus.setdefault(holder.pid, set()).add(index)
    files = {pid: tuple(sorted(paths)) for pid, paths in (device_files or {}).items()}
    holders |= {pid: describe_pid(pid) for pid in files if pid not in holders}

    candidates: list[CleanEntry] = []
    skipped: list[CleanEntry] = []
    for pid in sorted(holders):
        holder = holders[pid]
        held = tuple(sorted(gpus.get(pid, ())))
        held_files = files.get(pid, ())
        reason = _skip_reason(holder, own_uid, protected)
        if reason is None and holder.orphaned:
            why, holds = holder.orphan_reason or "launcher gone", _holds(held, held_files)
            stale = f"orphaned ({why}); holds {holds} with no live parent job"
            if holder.torchelastic:
                stale = f"orphaned torchrun rank (agent gone: {why}); holds {holds}"
            candidates.append(CleanEntry(holder, held, stale, held_files))
            continue
        if reason is None:
            reason = f"alive, {_parent_phrase(holder)} still running: stop that job instead"
        skipped.append(CleanEntry(holder, held, reason, held_files))
    return CleanPlan(tuple(candidates), tuple(skipped))


@dataclass(eq=False)  # compared by identity in the wait loop
class _Target:
    """A verified candidate: its psutil handle and, where Linux has it, a pidfd."""

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
        return int(pidfd_open(pid))
    except OSError:  # ESRCH: the identity check that follows says so; ENOSYS etc.: fall back
        return None


def _verify(candidate: CleanEntry) -> _Target | CleanOutcome:
    """Re-check that ``candidate``'s pid is still the process we planned for."""
    holder = candidate.holder
    pidfd = _open_pidfd(holder.pid)  # pin first, then check: no window for pid reuse
    try:
        proc = psutil.Process(holder.pid)
        with proc.oneshot():
            start_time, uid, status = proc.create_time(), proc.uids().real, proc.status()
    except psutil.NoSuchProcess:
        outcome = "gone"
    except psutil.AccessDenied:
        outcome = "failed: permission denied re-reading it; not signalled"
    else:
        changed = _changed(holder, start_time, uid, status)
        if changed is None:
            return _Target(holder.pid, proc, pidfd, stopped=status in _STOPPED_STATES)
        outcome = changed
    if pidfd is not None:
        os.close(pidfd)
    return CleanOutcome(holder.pid, outcome)


def _changed(holder: HolderInfo, start_time: float, uid: int, status: str) -> str | None:
    """The outcome when the pid is no longer the process planned for, else None."""
    if holder.start_time is None or abs(start_time - holder.start_time) > _START_TIME_TOLERANCE_S:
        return (
            f"failed: pid {holder.pid} is now a different process (started {start_time:.2f}, "
            f"planned for one started {holder.start_time}); not signalled"
        )
    if uid != holder.uid:
        return f"failed: pid {holder.pid} now belongs to uid {uid}, not uid {holder.uid}; not signalled"
    return "gone" if status == psutil.STATUS_ZOMBIE else None


def _signal_all(targets: list[_Target], sig: signal.Signals, results: dict[int, str]) -> None:
    """Send ``sig`` to each target; record an outcome where that already settles it."""
    for target in targets:
        try:
            target.send(sig)
            if target.stopped and sig == signal.SIGTERM:
                # A stopped process with a SIGTERM handler would sit on the signal until
                # continued; let it run its handler instead of waiting for SIGKILL.
                target.send(signal.SIGCONT)
        except (ProcessLookupError, psutil.NoSuchProcess):  # noqa: PERF203  (a few pids, once)
            # Vanished before SIGTERM: it went by itself. Before SIGKILL: SIGTERM did it, late.
            results[target.pid] = "gone" if sig == signal.SIGTERM else "terminated"
        except (PermissionError, psutil.AccessDenied):
            results[target.pid] = f"failed: permission denied sending {sig.name}"
        except OSError as exc:
            results[target.pid] = f"failed: {sig.name}: {exc.strerror}"


def execute_clean(
    plan: CleanPlan,
    *,
    confirm: Callable[[CleanPlan], bool] | None,
    dry_run: bool = False,
    grace_s: float = 3.0,
    kill_wait_s: float = 2.0,
) -> CleanReport:
    """Carry out ``plan``. ``confirm=None``: the user already said yes (``--yes``), else
    ``confirm(plan)`` is asked once. ``grace_s``: the one deadline after SIGTERM."""
    if grace_s < 0 or kill_wait_s < 0:
        raise UserInputError(f"grace_s={grace_s}, kill_wait_s={kill_wait_s}: expected seconds >= 0")
    if dry_run or not plan.candidates:
        return CleanReport(plan, (), dry_run=dry_run, confirmed=False)
    if confirm is not None and not confirm(plan):
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
        results.update({t.pid: "terminated" for t in live if t not in survivors})

        _signal_all(survivors, signal.SIGKILL, results)
        live = [t for t in survivors if t.pid not in results]
        stuck = wait_gone(live, _Target.gone, time.monotonic() + kill_wait_s, poll_s=_POLL_S)
        for target in live:
            results[target.pid] = "killed"
            if target in stuck:
                with contextlib.suppress(psutil.NoSuchProcess):  # gone after all: killed
                    # Typically disk-sleep: stuck in the driver, beyond the reach of signals.
                    state = target.proc.status()
                    results[target.pid] = (
                        f"failed: still present {kill_wait_s:g} s after SIGKILL (state {state})"
                    )
    finally:
        for target in targets:
            target.close()

    outcomes = tuple(
        CleanOutcome(c.holder.pid, results.get(c.holder.pid, "failed: not handled"))
        for c in plan.candidates
    )
    return CleanReport(plan, outcomes, dry_run=False, confirmed=True)
