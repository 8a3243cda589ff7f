"""This process's memory and this node's, read from /proc; CUDA figures only where CUDA runs.

- ``process_memory()``: RSS, and from ``/proc/PID/smaps_rollup`` USS (private pages: what
  the process frees on exit) and PSS (shared pages divided among the sharers: the figure
  that sums across ranks without counting torch's libraries eight times).
- ``peak_rss()`` / ``reset_peak_rss()``: the kernel's high-water mark ``VmHWM`` and its
  reset through ``/proc/self/clear_refs`` (``5``), which some kernels and containers refuse:
  then the reason is returned, never a guess.
- ``node_memory()``: ``MemTotal`` and ``MemAvailable`` from ``/proc/meminfo``.
- ``cuda_memory()``: the caching allocator's figures, only when ``torch`` is already
  imported *and* CUDA is already initialised in this process: the profiler must never
  create a CUDA context (hundreds of MiB per GPU, and a busy GPU would fail).

Standard library only (this runs inside every rank, every 100 ms).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CudaMemory",
    "NodeMemory",
    "ProcessMemory",
    "cuda_memory",
    "node_memory",
    "peak_rss",
    "process_memory",
    "reset_peak_rss",
    "resident_bytes",
]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class ProcessMemory:
    rss_bytes: int | None
    uss_bytes: int | None  # None: no smaps_rollup (reason in `why`)
    pss_bytes: int | None
    why: str = ""


@dataclass(frozen=True)
class NodeMemory:
    total_bytes: int | None
    available_bytes: int | None


@dataclass(frozen=True)
class CudaMemory:
    device: int
    allocated_bytes: int
    reserved_bytes: int
    peak_allocated_bytes: int


def _kib_fields(text: str, wanted: tuple[str, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in wanted:
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * 1024
    return out


def _read(path: str) -> str | None:
    # One open and read per file: these run 10 times a second in every rank.
    try:
        with open(path, encoding="ascii", errors="replace") as handle:  # noqa: PTH123
            return handle.read()
    except OSError:
        return None


_ROLLUP = ("Rss", "Pss", "Private_Clean", "Private_Dirty", "Private_Hugetlb")


def process_memory(pid: int | str = "self") -> ProcessMemory:
    """RSS, USS and PSS of one process (``self`` by default)."""
    rollup = _read(f"/proc/{pid}/smaps_rollup")
    if rollup is not None:
        f = _kib_fields(rollup, _ROLLUP)
        if "Rss" in f and "Pss" in f:
            uss = f.get("Private_Clean", 0) + f.get("Private_Dirty", 0)
            uss += f.get("Private_Hugetlb", 0)
            return ProcessMemory(f["Rss"], uss, f["Pss"])
    statm = _read(f"/proc/{pid}/statm")
    if statm is not None and len(statm.split()) > 1:
        why = "no /proc/PID/smaps_rollup (Linux < 4.14 or not permitted): no USS/PSS"
        return ProcessMemory(int(statm.split()[1]) * _PAGE, None, None, why)
    return ProcessMemory(None, None, None, f"/proc/{pid} is not readable")


def resident_bytes(pid: int | str = "self") -> int | None:
    """RSS alone from ``/proc/PID/statm``: constant time, unlike smaps_rollup's page walk."""
    statm = _read(f"/proc/{pid}/statm")
    parts = statm.split() if statm else []
    return int(parts[1]) * _PAGE if len(parts) > 1 and parts[1].isdigit() else None


def peak_rss(pid: int | str = "self") -> int | None:
    """``VmHWM``: the most resident memory since start or the last reset."""
    status = _read(f"/proc/{pid}/status")
    if status is None:
        return None
    return _kib_fields(status, ("VmHWM",)).get("VmHWM")


def reset_peak_rss() -> str | None:
    """Reset this process's ``VmHWM``; None when done, else why it could not be."""
    try:
        fd = os.open("/proc/self/clear_refs", os.O_WRONLY)
    except OSError as exc:
        return (
            f"VmHWM cannot be reset here (/proc/self/clear_refs: {exc.strerror}): peak since start"
        )
    try:
        os.write(fd, b"5")
    except OSError as exc:
        return f"VmHWM cannot be reset here (clear_refs: {exc.strerror}): peak since start"
    finally:
        os.close(fd)
    return None


def node_memory() -> NodeMemory:
    meminfo = _read("/proc/meminfo")
    if meminfo is None:
        return NodeMemory(None, None)
    f = _kib_fields(meminfo, ("MemTotal", "MemAvailable"))
    return NodeMemory(f.get("MemTotal"), f.get("MemAvailable"))


def cuda_memory() -> tuple[CudaMemory | None, str]:
    """The current device's allocator figures, or None and why there are none.

    Reads only what exists: never imports torch, never initialises CUDA.
    """
    torch: Any = sys.modules.get("torch")
    if torch is None:
        return None, "torch not imported in this process"
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is None or not cuda.is_initialized():
            return None, "CUDA not initialised in this process"
        device = int(cuda.current_device())
        return (
            CudaMemory(
                device,
                int(cuda.memory_allocated(device)),
                int(cuda.memory_reserved(device)),
                int(cuda.max_memory_allocated(device)),
            ),
            "",
        )
    except Exception as exc:  # noqa: BLE001  (a broken CUDA must not break the rank)
        return None, f"CUDA figures unavailable ({type(exc).__name__})"
