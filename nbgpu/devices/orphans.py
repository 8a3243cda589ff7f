"""How a GPU holder came to be: a torchrun worker or agent, or orphaned by its launcher.

Linux does not record who forked a process; these functions read the traces a fork
leaves (sessions, start times, the parent's command) and say why a process looks
orphaned, or nothing when in doubt: ``clean`` offers to stop orphans, so "not orphaned"
is the safe answer. Standard library and psutil only.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

__all__ = ["find_orphan_reason", "is_torchelastic", "is_torchrun_agent"]

# prctl(2) option: is this process a child subreaper?
_PR_GET_CHILD_SUBREAPER = 37
_AGENT_MODULES = frozenset({"torch.distributed.run", "torch.distributed.launch"})


def is_torchelastic(environ: Mapping[str, str]) -> bool:
    """Whether a process's environment marks it as a worker torchrun started."""
    # torch.distributed.elastic sets these for every worker it starts (local_elastic_agent).
    return "TORCHELASTIC_RUN_ID" in environ or ("LOCAL_RANK" in environ and "WORLD_SIZE" in environ)


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


def _cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def is_torchrun_agent(cmdline: Sequence[str]) -> bool:
    """True when ``cmdline`` starts torchrun's elastic agent.

    Recognises ``torchrun ...``, ``python .../torchrun ...`` and ``python -m
    torch.distributed.run`` (or ``.launch``) by the program and interpreter options only,
    never by an argument of the script. Used only to *spare* workers whose parent is
    such an agent; clean never selects a process by its command.
    """
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


def _getsid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def find_orphan_reason(pid: int, ppid: int, start_time: float, torchelastic: bool) -> str | None:
    """Why we believe ``pid`` was reparented (its launcher is gone), or None.

    Linux does not record who forked a process, so this reads the traces a fork leaves:
    a child inherits its launcher's session unless it makes its own (setsid), and a
    launcher always starts before its child. Adoption by a subreaper that shares the
    child's session, and a session-leader child adopted by one, leave no trace; those
    stay "not orphaned", the safe side for a tool that offers to kill orphans.
    """
    if ppid <= 0:
        # The parent lives outside this PID namespace (docker exec) or this is pid 1.
        return None
    sid = _getsid(pid)
    if ppid == 1:
        init_sid = _getsid(1)
        if sid is not None and sid not in (0, pid) and sid == init_sid:
            # Still in pid 1's own session: pid 1 is its launcher (a container whose
            # entrypoint is the job itself), not an init that adopted it.
            return None
        if torchelastic and is_torchrun_agent(_cmdline(1)):
            # `docker run ... torchrun`: pid 1 is the agent itself, and its workers run
            # in sessions of their own. The command only ever spares, never selects.
            return None
        return "reparented to pid 1: its launcher is gone"
    try:
        parent = psutil.Process(ppid)
        parent_start = parent.create_time()
    except psutil.NoSuchProcess:
        return f"parent pid {ppid} is gone"
    except psutil.AccessDenied:
        return None
    if parent_start > start_time:
        return f"parent pid {ppid} started after it, so adopted it"
    if ppid == os.getpid() and torchelastic and _self_is_subreaper():
        # nbgpu never starts torchrun workers itself: only an agent does, so a worker
        # whose parent is this subreaper was adopted after its agent died.
        return "adopted by this process (a subreaper): its torchrun agent is gone"
    parent_sid = _getsid(ppid)
    if sid is not None and sid not in (0, pid) and parent_sid is not None and parent_sid != sid:
        return f"adopted by pid {ppid}: it is not in its parent's session, so its launcher is gone"
    return None
