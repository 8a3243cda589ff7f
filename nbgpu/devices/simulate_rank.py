"""What CUDA would do for one rank on a simulated fleet: its device, or CUDA's refusal.

``nbgpu.rank.device()`` asks :func:`simulated_device` once per rank when
``NBGPU_SIMULATE`` is set. The rank's ``LOCAL_RANK`` and ``CUDA_VISIBLE_DEVICES`` go
through the simulated driver (``simulate_cuda.py``) exactly as torch's first CUDA call
would go through the real one: an ordinal past the visible devices, a busy, lost or
prohibited GPU each give CUDA's own code, plus one ``[nbgpu]`` line that names the
physical GPU and why it refused. The rank then raises torch's error for that code
(``nbgpu.rank`` owns torch); otherwise it computes on the CPU under a label said once.

Only simulated ranks import this module (it loads the fleet); never torch, pynvml,
psutil or IPython.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from nbgpu.devices.cuda_driver import CudaCallError, CudaDriver
from nbgpu.devices.cuda_errors import (
    CUDA_ERROR_DEVICE_UNAVAILABLE,
    CUDA_ERROR_INVALID_DEVICE,
    CUDA_ERROR_UNKNOWN,
    error_name,
    ordinal_hint,
)
from nbgpu.devices.fleet import SimGpu
from nbgpu.devices.simulate_cuda import load_simulated_cuda

__all__ = ["SimulatedDevice", "simulated_device"]


@dataclass(frozen=True)
class SimulatedDevice:
    """CUDA's answer for one rank: a refusal to raise, or a label for running on CPU."""

    cuda_error: int | None  # the CUresult torch would raise for; None: compute on CPU
    line: str  # the [nbgpu] line: under the error, or the label said once on stderr


def simulated_device(source: str, ordinal: int, environ: Mapping[str, str]) -> SimulatedDevice:
    """Create (and release) the context ``cuda:ordinal`` would get on fleet ``source``.

    Raises ``FleetSpecError`` for a malformed ``source``.
    """
    try:
        library = load_simulated_cuda(source, environ)
    except OSError as exc:
        # No libcuda: torch.cuda.is_available() is False and torch runs on the CPU.
        return _on_cpu(f"simulated fleet {source!r}: no CUDA driver ({exc})")
    fleet = library.fleet
    said = f"[nbgpu] simulated fleet {fleet.name!r}:"
    driver = CudaDriver(library)
    try:
        driver.init()
    except CudaCallError as exc:
        # cuInit failing makes torch.cuda.is_available() False: torch falls back to CPU.
        return _on_cpu(
            f"simulated fleet {fleet.name!r}: CUDA is unavailable "
            f"({error_name(exc.code) or exc.code})"
        )
    count = driver.device_count()
    if ordinal >= count:
        hint = ordinal_hint(ordinal, count, environ)
        return SimulatedDevice(CUDA_ERROR_INVALID_DEVICE, hint.replace("[nbgpu]", said, 1))
    target = library.devices[ordinal]
    try:
        driver.retain_primary_context(ordinal)
    except CudaCallError as exc:
        gpu = target.gpu
        what = f"cuda:{ordinal} is physical GPU {gpu.index} ({gpu.uuid})"
        if target.mig is not None:
            what += f" as MIG instance {target.mig.uuid}"
        return SimulatedDevice(
            exc.code, f"{said} {what}, {_refusal(gpu, exc.code)}: see %gpu_doctor"
        )
    driver.release_primary_context(ordinal)
    return _on_cpu(
        f"simulated fleet {fleet.name!r}: cuda:{ordinal} -> GPU {target.gpu.index} ({target.name})"
    )


def _on_cpu(what: str) -> SimulatedDevice:
    return SimulatedDevice(None, f"[nbgpu] {what}; computing on CPU")


def _refusal(gpu: SimGpu, code: int) -> str:
    """Why a simulated GPU refuses a context, in the words of nvidia-smi's columns."""
    if code == CUDA_ERROR_DEVICE_UNAVAILABLE and gpu.compute_mode == "prohibited":
        return "compute mode prohibited"
    if code == CUDA_ERROR_DEVICE_UNAVAILABLE and gpu.processes:
        holders = ", ".join(
            f"{p.pid} ({p.observed.state})" if p.observed else str(p.pid) for p in gpu.processes
        )
        mode = gpu.compute_mode.replace("_", "-")
        return f"{mode}, held by pid{'s' if len(gpu.processes) > 1 else ''} {holders}"
    if code == CUDA_ERROR_UNKNOWN and gpu.fault == "lost":
        return "which has fallen off the bus (Xid 79)"
    return f"which refuses a CUDA context (CUDA error {code})"
