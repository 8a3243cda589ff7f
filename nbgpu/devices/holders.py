"""Who holds a GPU: turn a pid from NVML into facts about a process on this machine.

NVML only says *which* pids hold a GPU; the operating system (psutil, ``/proc``) answers
the rest, never guesses: alive, zombie, stopped, gone, or a host pid a container cannot
see; whose, running what, orphaned (its launcher gone), a torchrun worker, started with
which ``CUDA_VISIBLE_DEVICES``. Also the ``/dev/nvidia*`` files open in ``/proc/*/fd``
(what ``lsof /dev/nvidia*`` shows), and whether we run in a container and in the host's
PID namespace. Of nbgpu only :mod:`nbgpu.errors` (``model.py`` names these types).
"""

import contextlib
import ctypes
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import psutil

from nbgpu.errors import UserInputError

__all__ = [
    "PID_MAX_LIMIT", "ContainerInfo", "HolderInfo", "describe_pid", "detect_container",
    "device_file_holders", "is_torchrun_agent", "recorded_holder",
]  # fmt: skip

#: Linux's hard ceiling for pid_max on 64-bit kernels (``PID_MAX_LIMIT``, 2**22). Pids are
#: allocated below pid_max, so no namespace anywhere can hold a pid at or above this.
PID_MAX_LIMIT = 4_194_304

# psutil status strings grouped by holder state. "dead" is the kernel's X state: the task is
# being torn down right now, so for our purposes it is gone.
_STOPPED_STATES = frozenset({psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP})
# Every status string psutil reports on Linux (spelled out: psutil's type stubs lack some).
_KNOWN_STATES = frozenset({
    "running", "sleeping", "disk-sleep", "stopped", "tracing-stop", "zombie", "dead",
    "wake-kill", "waking", "idle", "locked", "waiting", "parked",
})  # fmt: skip
# States a fleet file's "observed" record may carry that are holder states, not psutil statuses.
_RECORDED_STATES = frozenset({"dead", "zombie", "other_namespace", "no_access"})

# /proc/PID/stat flags bit of kernel threads (include/linux/sched.h). Kernel threads
# live only in the initial PID namespace, so seeing one proves we share the host's.
_PF_KTHREAD = 0x00200000

T = TypeVar("T")
P = ParamSpec("P")


@dataclass(frozen=True)
class ContainerInfo:
    in_container: bool
    host_pid_namespace: bool  # False when our PID namespace is not the host's
    reason: str | None  # the evidence, e.g. "/.dockerenv exists"


@dataclass(frozen=True)
class HolderInfo:
    """What this machine (or a fleet file's record) says about one pid that holds a GPU."""

    pid: int
    state: str  # alive | zombie | stopped | dead | other_namespace | no_access (nbgpu's word)
    user: str | None = None
    uid: int | None = None  # real uid: the one kill(2) permission and "your own processes" use
    command: str | None = None  # joined cmdline, or "[name]" when the cmdline is empty
    status: str | None = None  # psutil status string ("running", "sleeping", "disk-sleep", ...)
    start_time: float | None = None  # epoch seconds (psutil create_time); against pid reuse
    ppid: int | None = None
    orphaned: bool = False  # reparented: its launcher is gone (see orphan_reason)
    visible_devices: str | None = None  # its CUDA_VISIBLE_DEVICES at exec, when readable
    torchelastic: bool = False  # its environment marks it as a torchrun worker
    recorded: bool = False  # built from a fleet file's record, not looked up here
    orphan_reason: str | None = None  # the evidence, e.g. "reparented to pid 1: ..."
    parent_command: str | None = None  # the parent's command, to name the job to stop
    detail: str | None = None  # why this state, e.g. "no such process"

    def summary(self) -> str:
        """One line, e.g. ``pid 4242 (dead: no such process)``."""
        if self.state in ("dead", "other_namespace", "no_access") and self.command is None:
            return f"pid {self.pid} ({self._state_phrase()})"
        parts = [f"pid {self.pid}", self.user or "", _clip(self.command or "", 60)]
        notes = [
            self._state_phrase(),
            "" if self.visible_devices is None else f"CUDA_VISIBLE_DEVICES={self.visible_devices}",
            "torchrun worker" if self.torchelastic else "",
            f"orphaned, {self.orphan_reason or 'launcher gone'}" if self.orphaned else "",
        ]
        return f"{' '.join(p for p in parts if p)} ({', '.join(n for n in notes if n)})"

    def _state_phrase(self) -> str:
        phrase = self.status if self.state in ("alive", "stopped") and self.status else self.state
        if self.recorded:
            phrase += ", recorded"
        if self.detail:
            phrase += f": {self.detail}"
        return phrase

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # noqa: ARG002  (IPython's signature)
        p.text(self.summary())


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _or_none(call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T | None:
    """``call(...)``, or None when the OS refuses: a file closed or a process gone since."""
    with contextlib.suppress(OSError):
        return call(*args, **kwargs)
    return None


def _read_text(path: Path) -> str | None:
    return _or_none(path.read_text, encoding="utf-8", errors="replace")


def _container_evidence(proc_root: Path, root: Path) -> str | None:
    if (root / ".dockerenv").exists():
        return "/.dockerenv exists"
    if (root / "run" / ".containerenv").exists():
        return "/run/.containerenv exists (podman)"
    cgroup = _read_text(proc_root / "1" / "cgroup") or ""
    markers = ("docker", "kubepods", "containerd", "libpod", "lxc")
    return next((f"pid 1's cgroup names {m}" for m in markers if m in cgroup), None)


def _pid_namespace_evidence(proc_root: Path) -> tuple[bool | None, str | None]:
    """(host_pid_namespace, why), or (None, None) when /proc cannot tell."""
    # NSpid lists our pid in each nested namespace procfs sees: several mean a child namespace.
    for line in (_read_text(proc_root / "self" / "status") or "").splitlines():
        if line.startswith("NSpid:") and len(line.split()) > 2:
            return False, "NSpid shows nested PID namespaces"
    stat = _read_text(proc_root / "2" / "stat")
    if stat is not None:
        fields = stat.rpartition(")")[2].split()
        # After "(comm)": state, ppid, pgrp, session, tty_nr, tpgid, flags.
        if len(fields) > 6 and fields[6].isdigit() and int(fields[6]) & _PF_KTHREAD:
            return True, "kernel threads are visible, so this is the host's PID namespace"
    with contextlib.suppress(OSError):
        if (proc_root / "self/ns/pid").readlink() != (proc_root / "1/ns/pid").readlink():
            return False, "pid namespace differs from init's"
    mounts = _read_text(proc_root / "self" / "mountinfo") or ""
    hidden = any(
        " /proc " in line and ("hidepid=2" in line or "hidepid=invisible" in line)
        for line in mounts.splitlines()
    )
    if stat is None and not hidden and (proc_root / "1").exists():
        # pid 2 is kthreadd on every Linux host; without hidepid it would be visible.
        return False, "no kernel threads visible: a separate PID namespace"
    return None, None


def detect_container(proc_root: Path = Path("/proc"), root: Path = Path("/")) -> ContainerInfo:
    """This machine's container markers and PID namespace (a container's own without
    ``--pid=host``), which decides what a missing pid means (:func:`describe_pid`)."""
    container_why = _container_evidence(proc_root, root)
    host_ns, ns_why = _pid_namespace_evidence(proc_root)
    in_container = container_why is not None
    if host_ns is None:
        # Undecidable: inside a container assume its own namespace (the docker default),
        # so a missing pid is reported as possibly alive on the host, not as dead.
        host_ns = not in_container
        ns_why = "PID namespace undetermined; assumed from the container markers"
    # The ordinary case (no container, the host's namespace) needs no explanation.
    reasons = [] if not in_container and host_ns else [r for r in (container_why, ns_why) if r]
    return ContainerInfo(in_container, host_ns, "; ".join(reasons) or None)


def _ask(read: Callable[[], T], default: T) -> T:
    """A /proc read that may fail: the process exited (or is a zombie), or is not ours."""
    # A ZombieProcess is a NoSuchProcess.
    with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
        return read()
    return default


def _join_command(cmdline: list[str] | None, name: str | None) -> str | None:
    if cmdline:
        return " ".join(cmdline)
    # Kernel threads, zombies, exiting processes: no cmdline; ps shows [name], and so do we.
    return f"[{name}]" if name else None


#: A parent's (start time, command), None when it is gone, (None, None) when not ours to read.
ParentFacts = tuple[float | None, str | None] | None


def _parent_facts(ppid: int, memo: dict[int, ParentFacts] | None) -> ParentFacts:
    """Read once per snapshot (*memo*): the 40 workers of one job share one parent."""
    if memo is not None and ppid in memo:
        return memo[ppid]
    facts: ParentFacts
    try:
        parent = psutil.Process(ppid)
        with parent.oneshot():
            start, name = parent.create_time(), parent.name()
        facts = start, _join_command(_ask(parent.cmdline, None), name)
    except psutil.NoSuchProcess:
        facts = None
    except psutil.AccessDenied:
        facts = None, None
    if memo is not None:
        memo[ppid] = facts
    return facts


def describe_pid(
    pid: int,
    *,
    container: ContainerInfo | None = None,
    parents: dict[int, ParentFacts] | None = None,
) -> HolderInfo:
    """Look ``pid`` up on this machine. A missing pid is ``dead`` in the host's PID
    namespace, ``other_namespace`` in a container's own (NVML reports host pids):
    ``container`` (default :func:`detect_container`) is read only then. *parents*: what
    was read of parents so far in this snapshot (a dict to fill; default: read each)."""
    if pid <= 0 or pid >= PID_MAX_LIMIT:
        return HolderInfo(pid, "dead", detail="no such process (not a valid Linux pid)")
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            status = proc.status()
            uid = proc.uids().real
            ppid = proc.ppid()
            start_time = proc.create_time()
            name = proc.name()
    except psutil.NoSuchProcess:
        # Also when it exited between calls: it is gone now, which is the fact to report.
        if (container or detect_container()).host_pid_namespace:
            return HolderInfo(pid, "dead", detail="no such process")
        hidden = "not in this PID namespace (a host pid: run with --pid=host to see it)"
        return HolderInfo(pid, "other_namespace", detail=hidden)
    except psutil.AccessDenied:
        return HolderInfo(pid, "no_access", detail="permission denied reading /proc")
    user: str | None = _ask(proc.username, None)
    cmdline: list[str] = _ask(proc.cmdline, [])
    # Another user's environment is private; a zombie has none left.
    environ: dict[str, str] = _ask(proc.environ, {})
    # torch.distributed.elastic sets these for every worker it starts (local_elastic_agent).
    torchelastic = "TORCHELASTIC_RUN_ID" in environ or (
        "LOCAL_RANK" in environ and "WORLD_SIZE" in environ
    )
    orphan_reason, detail = None, None
    parent = _parent_facts(ppid, parents) if ppid > 0 else (None, None)
    if status == psutil.STATUS_ZOMBIE:
        state, detail = "zombie", f"exited; parent pid {ppid} must reap it"
    else:
        state = "stopped" if status in _STOPPED_STATES else "alive"
        if status == psutil.STATUS_DEAD:
            state, detail = "dead", "exiting right now"
        orphan_reason = _orphan_reason(pid, ppid, start_time, torchelastic, parent)
    return HolderInfo(
        pid=pid,
        state=state,
        user=user,
        uid=uid,
        command=_join_command(cmdline, name),
        status=status,
        start_time=start_time,
        ppid=ppid,
        orphaned=orphan_reason is not None,
        visible_devices=environ.get("CUDA_VISIBLE_DEVICES"),
        torchelastic=torchelastic,
        orphan_reason=orphan_reason,
        parent_command=parent[1] if parent else None,
        detail=detail,
    )


def recorded_holder(  # noqa: PLR0917  (positional: mirrors the fleet record's fields)
    pid: int,
    observed: str,
    user: str | None = None,
    command: str | None = None,
    visible_devices: str | None = None,
    start_time: float | None = None,
) -> HolderInfo:
    """A holder as a fleet file recorded it where it was captured (never looked up here);
    ``observed`` is a holder state (``dead``, ``zombie``, ...) or a psutil status."""
    if observed in _RECORDED_STATES:
        state = observed
    elif observed in _STOPPED_STATES:
        state = "stopped"
    elif observed in _KNOWN_STATES:
        state = "alive"
    else:
        accepted = sorted(_RECORDED_STATES | _KNOWN_STATES)
        raise UserInputError(
            f"recorded process state {observed!r} for pid {pid}; expected one of {', '.join(accepted)}"
        )
    return HolderInfo(
        pid,
        state,
        user=user,
        command=command,
        status=observed if observed in _KNOWN_STATES else None,
        start_time=start_time,
        visible_devices=visible_devices,
        recorded=True,
    )


def device_file_holders(
    proc_root: Path = Path("/proc"), pattern: str = "/dev/nvidia"
) -> dict[int, tuple[str, ...]]:
    """Map pid -> sorted open files whose path starts with ``pattern`` (``lsof /dev/nvidia*``).
    Pids whose fd table we may not read (other users, unless root) or that exit during the
    scan are skipped silently: the scan reports what it can prove."""
    found: dict[int, tuple[str, ...]] = {}
    try:
        entries = os.listdir(proc_root)  # noqa: PTH208  (plain strings: this loop must be fast)
    except OSError:
        return found
    for entry in filter(str.isdigit, entries):
        # One open() of the fd directory and readlink relative to it: no per-fd path walk,
        # so a few hundred processes scan in milliseconds.
        try:
            dir_fd = os.open(f"{proc_root}/{entry}/fd", os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        try:
            fds = os.listdir(dir_fd)  # noqa: PTH208  (a dir fd)
            links = [_or_none(os.readlink, fd, dir_fd=dir_fd) for fd in fds]
        except OSError:
            links = []
        finally:
            os.close(dir_fd)
        paths = sorted({p for p in links if p is not None and p.startswith(pattern)})
        if paths:
            found[int(entry)] = tuple(paths)
    return found


_PR_GET_CHILD_SUBREAPER = 37
_AGENT_MODULES = frozenset({"torch.distributed.run", "torch.distributed.launch"})


def _self_is_subreaper() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    flag = ctypes.c_int(0)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        ok = libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    return ok and flag.value != 0


def is_torchrun_agent(cmdline: Sequence[str]) -> bool:
    """``torchrun ...``, ``python .../torchrun ...`` or ``python -m torch.distributed.run``
    (or ``.launch``), by the program and interpreter options only, never a script argument.
    Used only to *spare* workers whose parent is an agent; clean never selects by command."""
    if not cmdline:
        return False
    program = Path(cmdline[0]).name
    if program == "torchrun":
        return True
    if not program.startswith("python"):
        return False
    args = list(cmdline[1:])
    i = 0
    while i < len(args) and args[i].startswith("-"):
        if args[i] == "-m":
            return i + 1 < len(args) and args[i + 1] in _AGENT_MODULES
        i += 1
    return i < len(args) and Path(args[i]).name == "torchrun"


def _orphan_reason(
    pid: int, ppid: int, start_time: float, torchelastic: bool, parent: ParentFacts
) -> str | None:
    """Why we believe ``pid`` was reparented (its launcher is gone), or None. Linux does
    not record who forked a process, so this reads the traces a fork leaves: a child
    inherits its launcher's session unless it makes its own (setsid), and a launcher always
    starts before its child. Adoption by a subreaper that shares the child's session, and a
    session-leader child adopted by one, leave no trace; those stay "not orphaned", the
    safe side for a tool that offers to kill orphans."""
    if ppid <= 0:
        # The parent lives outside this PID namespace (docker exec) or this is pid 1.
        return None
    sid = _or_none(os.getsid, pid)
    if ppid == 1:
        init_sid = _or_none(os.getsid, 1)
        if sid is not None and sid not in (0, pid) and sid == init_sid:
            # Still in pid 1's own session: pid 1 is its launcher (a container whose
            # entrypoint is the job itself), not an init that adopted it.
            return None
        if torchelastic and is_torchrun_agent(_ask(lambda: psutil.Process(1).cmdline(), [])):
            # `docker run ... torchrun`: pid 1 is the agent itself, and its workers run
            # in sessions of their own. The command only ever spares, never selects.
            return None
        return "reparented to pid 1: its launcher is gone"
    if parent is None:
        return f"parent pid {ppid} is gone"
    parent_start = parent[0]
    if parent_start is None:  # not ours to read
        return None
    if parent_start > start_time:
        return f"parent pid {ppid} started after it, so adopted it"
    if ppid == os.getpid() and torchelastic and _self_is_subreaper():
        # nbgpu never starts torchrun workers itself: only an agent does, so a worker
        # whose parent is this subreaper was adopted after its agent died.
        return "adopted by this process (a subreaper): its torchrun agent is gone"
    parent_sid = _or_none(os.getsid, ppid)
    if sid is not None and sid not in (0, pid) and parent_sid is not None and parent_sid != sid:
        return f"adopted by pid {ppid}: it is not in its parent's session, so its launcher is gone"
    return None
