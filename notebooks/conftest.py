"""nbval setup for the tutorials (``make notebooks``): give the kernel a known world.

The outputs stored in the notebooks (and compared in cells marked
``# NBVAL_CHECK_OUTPUT``) were produced by ``run_headless.py --write`` on the simulated
``seed000`` fleet in a clean launch environment. nbval's kernel inherits this
process's environment, so remove what would change those outputs:

- ``NBGPU_SIMULATE``: the notebook itself picks ``seed000`` when it is unset, as it
  does for a new user; a fleet chosen outside (``NBGPU_SIMULATE=healthy make ...``)
  would not match the stored outputs. ``make demo`` and ``tests/test_notebooks.py``
  run the notebooks on other fleets.
- ``CUDA_VISIBLE_DEVICES`` and the torchrun variables: ``%gpu_doctor`` reports them.
- ``COLUMNS``: ``-h`` help is wrapped to the terminal width; pin it to 80.

This module only sets up the environment; it has no tests.
"""

from __future__ import annotations

import os

_LAUNCH_VARIABLES = (
    "NBGPU_SIMULATE",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NPROC_PER_NODE",
)

for _name in _LAUNCH_VARIABLES:
    os.environ.pop(_name, None)
os.environ["COLUMNS"] = "80"
