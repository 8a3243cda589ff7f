"""nbval setup for the tutorials (``make notebooks``): give the kernel a known world.

The outputs stored in the notebooks (and compared, after ``sanitize.cfg``, in cells
marked ``# NBVAL_CHECK_OUTPUT`` or tagged ``nbval-check-output``) were produced by
``make notebooks-refresh`` (``run_headless.py --write``) on the simulated ``busy-gpu0``
fleet in a clean launch environment. nbval's kernel inherits this process's
environment, so set or remove what would change those outputs:

- ``NBGPU_SIMULATE=busy-gpu0``: the tutorials switch the simulation on by themselves
  only when no GPU is found; naming the fleet here makes the comparison the same on a
  machine with GPUs (a fleet chosen outside would not match the stored outputs either).
  ``make demo`` and ``tests/test_notebooks.py`` run the notebooks as a user would.
- ``CUDA_VISIBLE_DEVICES`` and the torchrun variables: ``%gpu_doctor`` reports them.
- ``COLUMNS``: ``-h`` help is wrapped to the terminal width; pin it to 80.
- ``NBGPU_RUNS_DIR``: a fresh directory, so the outputs do not depend on this machine's
  earlier runs (the retention policy announces what it prunes).

This module only sets up the environment; it has no tests.
"""

from __future__ import annotations

import os
import tempfile

from nbgpu.devices.doctor import DIST_VARS

for _name in (
    "NBGPU_SIMULATE",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "GROUP_RANK",
    *DIST_VARS,
):
    os.environ.pop(_name, None)
os.environ["NBGPU_SIMULATE"] = "busy-gpu0"
os.environ["COLUMNS"] = "80"
os.environ["NBGPU_RUNS_DIR"] = tempfile.mkdtemp(prefix="nbgpu-nbval-runs-")
