"""The active health probe: one CUDA context per visible GPU, in a short-lived subprocess.

NVML can predict, but only creating a CUDA context *reveals*, "CUDA-capable device(s) is/are
busy or unavailable" (error 46), a lost GPU, a stub or mismatched driver. This package owns
that opt-in probe (``%gpu_status --probe``, ``nbgpu status --probe``, ``nbgpu doctor``):
``probe`` (the parent: start the child against a deadline, read its answer), ``child``
(``python -m nbgpu.devices.health.child``: load the driver, one context per device, one
JSON line) and ``report`` (:class:`ProbeReport`: CUDA's codes as outcomes, rendering).

Never in the Jupyter kernel: a context there would itself hold the GPU (and, in exclusive
mode, lock the user's own training job out). Never imports torch, pynvml, psutil or
IPython, and the parent side never loads libcuda.
"""

from __future__ import annotations

from nbgpu.devices.health.probe import probe_devices
from nbgpu.devices.health.report import ProbeReport, ProbeResult

__all__ = ["ProbeReport", "ProbeResult", "probe_devices"]
