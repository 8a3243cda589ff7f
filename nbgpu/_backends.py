"""The process-group backends ``torch.distributed`` knows by name: one list for the
launch flag (``--backend``) and for ``nbgpu.rank.init()``.

A module of its own so that declaring the flags (at ``%load_ext``) does not load
``nbgpu.rank``; standard library only.
"""

from __future__ import annotations

__all__ = ["BACKENDS"]

# torch 2.13: torch.distributed.Backend.backend_list, without "undefined".
BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")
