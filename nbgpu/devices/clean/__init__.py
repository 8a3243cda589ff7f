"""Stop stale GPU holders: this user's orphans only, listed first, confirmed, by pid.

The folklore this replaces is ``pkill -9 -f sglang`` and ``fuser -k /dev/nvidia*``:
kill by name, kill everything, kill other people's jobs. Here a process is a candidate
only when every rule holds:

- it is a process of the current user (real uid), looked up on this machine, not a
  record from a fleet file;
- it is not this process, not one of its ancestors, not a pid the caller protects;
- it holds a GPU (NVML) or a ``/dev/nvidia*`` file, and it is stale: (a) orphaned, so
  the job that launched it is gone, or (b) a torchrun worker whose agent is gone.

Everything else is *skipped with a reason* that tells the user what to do instead
(stop the parent job, let the parent reap its zombie, act on the host). Matching by
name never selects anything. :func:`plan_clean` decides and lists;
:func:`execute_clean` asks, re-checks each pid's identity (pid reuse), sends SIGTERM,
waits on one shared deadline, then SIGKILLs what is left.

Layout: ``plan`` (:func:`plan_clean`, :class:`CleanPlan`, :class:`CleanCandidate`,
:class:`Skipped`) · ``execute`` (:func:`execute_clean`, :class:`CleanReport`,
:class:`CleanOutcome`). It imports only the standard library, psutil, :mod:`nbgpu.errors` and
:mod:`nbgpu.devices.holders`; never pynvml, torch or IPython (NVML's holders arrive
as :class:`~nbgpu.devices.holders.HolderInfo` from the caller).
"""

from __future__ import annotations

from nbgpu.devices.clean.execute import CleanOutcome, CleanReport, execute_clean
from nbgpu.devices.clean.plan import CleanCandidate, CleanPlan, Skipped, plan_clean

__all__ = [
    "CleanCandidate",
    "CleanOutcome",
    "CleanPlan",
    "CleanReport",
    "Skipped",
    "execute_clean",
    "plan_clean",
]
