"""Helpers for code running *inside* a rank of a ``%%torchrun`` job (or any torchrun job).

    import nbgpu.rank as nr
    nr.init()                       # process group from torchrun's environment
    dev = nr.device()               # cuda:LOCAL_RANK, validated; CPU when simulated
    nr.print0("world", nr.world_size())
    with nr.one_at_a_time("imports"):
        import transformers         # heavy imports one rank at a time

The user's helpers: ``job`` (rank, sizes, ``print0``, ``one_at_a_time``,
``set_memory_limit``) · ``group`` (``device``: the real CUDA path, the simulated one,
``nbgpu.devices.sim.ranks``, imported only under ``NBGPU_SIMULATE``; the process group). The rest of every child process nbgpu starts lives here too, imported by
none of the above: ``agent`` (torchrun, wrapped) · ``worker`` (every rank's entry point) ·
``usercode`` (the user's code, once or cell by cell) · ``slurm_node`` (a SLURM node's
first process). None of it imports ``launch/``.

Importing this package is cheap: never torch at module level (the functions that need it
import it), never IPython, pynvml or psutil. Of nbgpu it reads only ``nbgpu.devices.sim``
and ``nbgpu.devices.cuda_errors`` (standard library only) at import, and
``nbgpu.profile.phases`` when ``init`` records its memory phase.
"""

from __future__ import annotations

from nbgpu.rank.group import all_reduce_sum, barrier, destroy, device, init
from nbgpu.rank.job import (
    NOT_IN_JOB,
    RUN_DIR_ENV,
    is_main,
    local_rank,
    local_world_size,
    one_at_a_time,
    parse_size,
    print0,
    rank,
    set_memory_limit,
    world_size,
)

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
