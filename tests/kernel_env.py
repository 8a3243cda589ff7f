"""The environment a test's kernel starts with: nothing of the launching shell that
would change what nbgpu sees (a GPU selection, torchrun's variables, a simulated fleet)."""

from __future__ import annotations

import os

from nbgpu.devices.doctor import DIST_VARS

__all__ = ["SCRUBBED", "kernel_environ"]

SCRUBBED = (
    "PYTEST_CURRENT_TEST",  # ipykernel stops capturing fd 1/2 when it sees this
    "NBGPU_SIMULATE",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "GROUP_RANK",
    *DIST_VARS,
)


def kernel_environ(*also: str) -> dict[str, str]:
    """``os.environ`` without :data:`SCRUBBED` (and the names in *also*)."""
    drop = {*SCRUBBED, *also}
    return {k: v for k, v in os.environ.items() if k not in drop}
