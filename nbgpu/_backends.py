"""The process-group backends ``torch.distributed`` knows, for ``--backend`` and
``nbgpu.rank.init()``: its own module so that ``%load_ext`` does not load ``nbgpu.rank``.
"""

__all__ = ["BACKENDS"]

# torch 2.13: torch.distributed.Backend.backend_list, without "undefined".
BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")
