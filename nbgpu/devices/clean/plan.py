"""Which GPU holders ``clean`` would stop, and which it leaves alone and why.

:func:`plan_clean` decides and lists; nothing is signalled here (``execute.py`` does that).
A process is a candidate only when it is this user's, not this process or an ancestor,
holds a GPU or a ``/dev/nvidia*`` file, and is stale (orphaned, or a torchrun worker
whose agent is gone); everything else is skipped with what to do instead.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import psutil

from nbgpu._render import Block, Line, Result, Section, Title
from nbgpu.devices.holders import HolderInfo, describe_pid

__all__ = ["CleanCandidate", "CleanPlan", "Skipped", "plan_clean", "wrapped"]

_WIDTH = 80


def wrapped(text: str, indent: str = " " * 6, level: str = "") -> Line:
    """A sentence under its holder's line, continued two columns further in."""
    lines = textwrap.wrap(text, _WIDTH, initial_indent=indent, subsequent_indent=indent + "  ")
    return Line("\n".join(lines) or indent, wrap=False, level=level)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _holds(gpus: Sequence[int], files: Sequence[str]) -> str:
    parts = []
    if gpus:
        parts.append(("GPU " if len(gpus) == 1 else "GPUs ") + ",".join(map(str, gpus)))
    if files:
        parts.append(", ".join(files))
    return " and ".join(parts) or "nothing"


def _head_line(holder: HolderInfo, gpus: Sequence[int]) -> str:
    where = ("GPU " + ",".join(map(str, gpus))) if gpus else "fd only"
    user = holder.user or "?"
    head = f"  pid {holder.pid:<7} {_clip(user, 10):<10} {where:<10} "
    return head + _clip(holder.command or "(command unknown)", _WIDTH - len(head))


@dataclass(frozen=True)
class CleanCandidate:
    """A process clean would stop, with the evidence that it is stale."""

    holder: HolderInfo
    gpus: tuple[int, ...]  # NVML indices it holds; empty if it only holds a /dev/nvidia* fd
    reason: str  # e.g. "orphaned torchrun rank (agent gone: parent is pid 1)"
    device_files: tuple[str, ...] = ()  # /dev/nvidia* files it holds open


@dataclass(frozen=True)
class Skipped:
    """A holder clean leaves alone, and what the user can do about it instead."""

    holder: HolderInfo
    gpus: tuple[int, ...]
    reason: str
    device_files: tuple[str, ...] = ()


@dataclass(frozen=True)
class CleanPlan(Result):
    """What :func:`execute_clean` would stop, and what it leaves alone and why."""

    candidates: tuple[CleanCandidate, ...]
    skipped: tuple[Skipped, ...]

    def content(self) -> list[Block]:
        """The listing shown before anything is signalled; fits 80 columns."""
        if not self.candidates and not self.skipped:
            return [Title("nbgpu clean: no process holds a GPU or a /dev/nvidia* file.")]
        blocks: list[Block] = [
            Title(
                f"nbgpu clean: {len(self.candidates)} stale process(es) of yours to stop, "
                f"{len(self.skipped)} left alone."
            )
        ]
        for title, group, level in (
            ("To stop (SIGTERM, then SIGKILL if still running):", self.candidates, "warn"),
            ("Left alone:", self.skipped, ""),
        ):
            if group:
                blocks.append(Line(title, wrap=False))
            blocks += [
                Section(
                    [
                        Line(_head_line(h.holder, h.gpus), wrap=False),
                        wrapped(h.reason),
                    ],
                    level=level,
                )
                for h in group
            ]
        return blocks


# --------------------------------------------------------------------------- planning


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


def _stale_reason(holder: HolderInfo, gpus: Sequence[int], files: Sequence[str]) -> str | None:
    if not holder.orphaned:
        return None
    why = holder.orphan_reason or "launcher gone"
    if holder.torchelastic:
        return f"orphaned torchrun rank (agent gone: {why}); holds {_holds(gpus, files)}"
    return f"orphaned ({why}); holds {_holds(gpus, files)} with no live parent job"


def plan_clean(
    gpu_holders: Mapping[int, Sequence[HolderInfo]],
    device_files: Mapping[int, Sequence[str]] | None = None,
    *,
    uid: int | None = None,
    protect: Collection[int] = (),
) -> CleanPlan:
    """Decide, for every GPU holder and ``/dev/nvidia*`` holder, stop or leave alone.

    ``gpu_holders`` maps NVML index -> the holders NVML listed there. ``device_files``
    maps pid -> open device paths (:func:`~nbgpu.devices.holders.device_file_holders`);
    pids not already described are looked up here. ``uid`` defaults to ours.
    ``protect`` adds pids never to touch; this process and its ancestors always are.
    """
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
    for pid in files:
        if pid not in holders:
            holders[pid] = describe_pid(pid)

    candidates: list[CleanCandidate] = []
    skipped: list[Skipped] = []
    for pid in sorted(holders):
        holder = holders[pid]
        held = tuple(sorted(gpus.get(pid, ())))
        held_files = files.get(pid, ())
        reason = _skip_reason(holder, own_uid, protected)
        if reason is None:
            stale = _stale_reason(holder, held, held_files)
            if stale is not None:
                candidates.append(CleanCandidate(holder, held, stale, held_files))
                continue
            reason = f"alive, {_parent_phrase(holder)} still running: stop that job instead"
        skipped.append(Skipped(holder, held, reason, held_files))
    return CleanPlan(tuple(candidates), tuple(skipped))
