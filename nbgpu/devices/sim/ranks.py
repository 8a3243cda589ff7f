"""nbgpu's ranks on a simulated fleet: the GPUs' processes, and what CUDA answers them.

A real GPU lists the processes that hold a context on it; a simulated one would show an
empty board while nbgpu's own ranks run "on" it. :func:`ranks_on_gpus` finds the live
rank processes of this machine that run on the same simulated fleet (their environment
carries nbgpu's run id and the same ``NBGPU_SIMULATE``), maps each rank's ``LOCAL_RANK``
through its ``CUDA_VISIBLE_DEVICES`` to a physical GPU index, and reports the host memory
the rank really uses (RSS) as its memory on that GPU (the fake NVML library lists them).
Results are cached for a second: NVML is asked per GPU and per call, the process table
once.

``nbgpu.rank.device()`` asks :func:`simulated_device` once per rank when
``NBGPU_SIMULATE`` is set. The rank's ``LOCAL_RANK`` and ``CUDA_VISIBLE_DEVICES`` go
through the simulated driver (``cuda.py``) exactly as torch's first CUDA call would go
through the real one: an ordinal past the visible devices, a busy, lost or prohibited GPU
each give CUDA's own code, plus one ``[nbgpu]`` line that names the physical GPU and why
it refused. The rank then raises torch's error for that code (``nbgpu.rank`` owns torch);
otherwise it computes on the CPU under a label said once.

Only simulated processes import this module; never torch, pynvml or IPython (psutil only
when the fake NVML library lists processes).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nbgpu.devices.cuda_driver import CudaCallError, CudaDriver
from nbgpu.devices.cuda_errors import (
    CUDA_ERROR_DEVICE_UNAVAILABLE,
    CUDA_ERROR_INVALID_DEVICE,
    CUDA_ERROR_UNKNOWN,
    error_name,
    ordinal_hint,
)
from nbgpu.devices.sim import simulation_source
from nbgpu.devices.sim.cuda import load_simulated_cuda
from nbgpu.devices.sim.fleet import SimGpu

__all__ = ["RankProcess", "SimulatedDevice", "ranks_on_gpus", "simulated_device"]

_CACHE_S = 1.0
_cache: dict[str, tuple[float, dict[int, list[RankProcess]]]] = {}


class RankProcess:
    __slots__ = ("pid", "rss_bytes")

    def __init__(self, pid: int, rss_bytes: int) -> None:
        self.pid = pid
        self.rss_bytes = rss_bytes


def _physical_index(env: dict[str, str]) -> int | None:
    try:
        local = int(env.get("LOCAL_RANK", ""))
    except ValueError:
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return local
    items = [v.strip() for v in visible.split(",") if v.strip()]
    if local >= len(items) or not items[local].isdigit():
        return None  # no GPU for this rank, or named by UUID: not placed
    return int(items[local])


def _running(psutil: Any, pid: int) -> bool:
    """Alive and not a zombie (an ended rank its parent has not reaped yet)."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def ranks_on_gpus(fleet_spec: str) -> dict[int, list[RankProcess]]:
    """{physical GPU index: live ranks}, for ranks launched on the simulated ``fleet_spec``."""
    import psutil  # noqa: PLC0415  (only when a simulated fleet is asked for processes)

    now = time.monotonic()
    hit = _cache.get(fleet_spec)
    if hit is not None and now - hit[0] < _CACHE_S:
        # A rank that ended since the scan must not be listed as a GPU's process: that
        # would read as a dead holder (one read of /proc/PID/stat each).
        return {gpu: [r for r in v if _running(psutil, r.pid)] for gpu, v in hit[1].items()}
    found: dict[int, list[RankProcess]] = {}
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if "NBGPU_RUN_ID" not in env or simulation_source(env) != fleet_spec:
                continue
            index = _physical_index(env)
            if index is None:
                continue
            rss = proc.memory_info().rss
        except (psutil.Error, OSError):
            continue
        found.setdefault(index, []).append(RankProcess(proc.pid, rss))
    _cache[fleet_spec] = (now, found)
    return found


# -- what CUDA answers a simulated rank ----------------------------------------


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
