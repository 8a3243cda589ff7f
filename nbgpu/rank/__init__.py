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

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    # The helpers load on first use: every rank imports this package (its worker lives
    # here), and a rank that never calls them reaches the user's first line without them.
    if name in __all__:
        from nbgpu.rank import job  # noqa: PLC0415

        globals().update({helper: getattr(job, helper) for helper in __all__})  # once
        return globals()[name]
    raise AttributeError(f"module 'nbgpu.rank' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})  # completion offers the helpers before their load
