"""Helpers for code running *inside* a rank of a ``%%torchrun`` job (or any torchrun job).

    import nbgpu.rank as nr
    nr.init()                       # process group from torchrun's environment
    dev = nr.device()               # cuda:LOCAL_RANK, validated; CPU when simulated
    nr.print0("world", nr.world_size())
    with nr.one_at_a_time("imports"):
        import transformers         # heavy imports one rank at a time

Every child process nbgpu starts lives in this package too (``agent``, ``worker``,
``usercode``, ``slurm_node``); none of it imports ``launch/``. Importing it is cheap:
never torch at module level, never IPython, pynvml or psutil.
"""

from nbgpu.rank.job import (
    NOT_IN_JOB,
    RUN_DIR_ENV,
    all_reduce_sum,
    barrier,
    destroy,
    device,
    init,
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
    "NOT_IN_JOB", "RUN_DIR_ENV", "all_reduce_sum", "barrier", "destroy", "device", "init",
    "is_main", "local_rank", "local_world_size", "one_at_a_time", "parse_size", "print0", "rank",
    "set_memory_limit", "world_size",
]  # fmt: skip
