"""Helpers for code running *inside* a rank of a ``%%torchrun`` job (or any torchrun job).

    import nbgpu.rank as nr
    nr.init()                       # process group from torchrun's environment
    dev = nr.device()               # cuda:LOCAL_RANK, validated; CPU when simulated
    nr.print0("world", nr.world_size())
    with nr.one_at_a_time("imports"):
        import transformers         # heavy imports one rank at a time

This package owns what a rank asks about itself: its place in the job (``rank``,
``local_rank``, ``world_size``, ``local_world_size``, ``is_main``), its device
(``device``: "invalid device ordinal" caught before CUDA sees it, and, under
``NBGPU_SIMULATE``, CUDA's own errors for the simulated fleet), the process group
(``init``, ``destroy``, ``barrier``, ``all_reduce_sum``), serialised blocks across the
ranks of one node (``one_at_a_time``, behind ``--serial-imports``) and a per-rank
address-space limit (``set_memory_limit``, behind ``--mem-limit``).

Every function reads the job from ``environ`` (default ``os.environ``), so tests pass a
dict. ``is_main()`` and ``print0()`` treat a process outside any job as the single rank
0; the other job queries raise a one-line ``UserInputError`` there.

Layout (one idea per module): ``job`` (rank, sizes, ``print0``) · ``device`` (the real
CUDA path; the simulated one is ``nbgpu.devices.sim.cuda``, imported only under
``NBGPU_SIMULATE``) · ``group`` (the process group) · ``serial`` (``one_at_a_time``) ·
``memory`` (``set_memory_limit``, ``parse_size``). The rest of every child process nbgpu
starts lives here too, imported by none of the above: ``agent`` (torchrun, wrapped) ·
``worker`` (every rank's entry point) · ``usercode`` (the user's code, once or cell by
cell) · ``slurm_node`` (a SLURM node's first process). None of it imports ``launch/``.

Importing this package is cheap: it must never import torch at module level (torch is
imported inside the functions that need it), and never IPython, pynvml or psutil at all.
At import it reads only ``nbgpu.devices.sim`` and ``nbgpu.devices.cuda_errors``
(standard library only); the fleet and the fake driver load only under simulation;
``init`` records the memory phase ``init`` through ``nbgpu.profile.phases`` (standard
library only); nothing else of nbgpu.
"""

from __future__ import annotations

from nbgpu.rank.device import device
from nbgpu.rank.group import all_reduce_sum, barrier, destroy, init
from nbgpu.rank.job import (
    NOT_IN_JOB,
    RUN_DIR_ENV,
    is_main,
    local_rank,
    local_world_size,
    print0,
    rank,
    world_size,
)
from nbgpu.rank.memory import parse_size, set_memory_limit
from nbgpu.rank.serial import one_at_a_time

__all__ = [
    "NOT_IN_JOB",
    "RUN_DIR_ENV",
    "all_reduce_sum",
    "barrier",
    "destroy",
    "device",
    "init",
    "is_main",
    "local_rank",
    "local_world_size",
    "one_at_a_time",
    "parse_size",
    "print0",
    "rank",
    "set_memory_limit",
    "world_size",
]
