"""Ranks that nbgpu launched on a simulated fleet, as the simulated GPUs' processes.

A real GPU lists the processes that hold a context on it; a simulated one would show an
empty board while nbgpu's own ranks run "on" it. :func:`ranks_on_gpus` finds the live
rank processes of this machine that run on the same simulated fleet (their environment
carries nbgpu's run id and the same ``NBGPU_SIMULATE``), maps each rank's ``LOCAL_RANK``
through its ``CUDA_VISIBLE_DEVICES`` to a physical GPU index, and reports the host memory
the rank really uses (RSS) as its memory on that GPU. Results are cached for a second:
NVML is asked per GPU and per call, the process table once.

Hardware layer; imports psutil and the visible-devices parser only.
"""

from __future__ import annotations

import time
from typing import Any

from nbgpu.devices.simenv import simulation_source

__all__ = ["RankProcess", "ranks_on_gpus"]

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
