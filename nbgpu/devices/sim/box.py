"""A simulated GPU box as data: its GPUs as NVML would describe them, and the driver facts.

What a fleet file holds (the format ``nbgpu status --json`` writes), read by these types.
Also what the fake NVML and CUDA libraries share: a :class:`Device` (a GPU or one MIG
instance), ctypes argument helpers, and :func:`ranks_on_gpus`, the live ranks on a
simulated fleet, which the fake NVML library lists as the GPUs' processes (psutil only
there). Here, not in the CUDA fake, so that a simulated ``nbgpu status`` loads no CUDA or
``CUDA_VISIBLE_DEVICES`` code.
"""

import ctypes
import json
import time
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from nbgpu._serial import to_data
from nbgpu.devices.model import (
    FLEET_FORMAT,
    GpuFault,
    InitError,
    MigDevice,
    ProcessRecord,
    RemappedRows,
)
from nbgpu.devices.sim import simulation_source

__all__ = [
    "COMPUTE_MODES", "ComputeMode", "Device", "Fleet", "RankProcess", "SimGpu", "deref", "int_arg",
    "ranks_on_gpus",
]  # fmt: skip

#: The words a fleet file may use for a compute mode (read by their type: ``_serial.py``),
#: in the order of NVML's constants: ``COMPUTE_MODES`` maps each to its NVML value.
ComputeMode = Literal["default", "exclusive_thread", "prohibited", "exclusive_process"]
COMPUTE_MODES: Mapping[str, int] = {name: i for i, name in enumerate(typing.get_args(ComputeMode))}


@dataclass(frozen=True)
class SimGpu:
    """One physical GPU as NVML would describe it."""

    index: int
    name: str
    uuid: str
    pci_bus_id: str  # NVML form: 00000000:06:00.0
    memory_total_bytes: int
    memory_reserved_bytes: int = 0
    memory_used_bytes: int | None = None  # None: reserved + sum of process memory
    utilization_gpu_pct: int = 0
    utilization_memory_pct: int = 0
    temperature_c: int = 35
    power_w: float = 30.0
    power_limit_w: float = 300.0
    compute_mode: ComputeMode = "default"
    persistence_mode: bool = True
    mig_enabled: bool | None = None  # None: the GPU does not support MIG
    mig_devices: tuple[MigDevice, ...] = ()
    ecc_uncorrected_volatile: int | None = 0  # None: ECC not supported / disabled
    remapped_rows: RemappedRows | None = None  # None: not supported on this model
    retired_pages_pending: bool | None = None
    compute_capability: tuple[int, int] = (8, 0)
    pci_device_id: int = 0
    fault: GpuFault | None = None  # NVML fails on this handle
    processes: tuple[ProcessRecord, ...] = ()
    # A context's CUDA error here; None: derived (busy when exclusive and held, or prohibited).
    cuda_error: int | None = None

    @property
    def effective_used_bytes(self) -> int:
        if self.memory_used_bytes is not None:
            return self.memory_used_bytes
        return self.memory_reserved_bytes + sum(p.used_bytes or 0 for p in self.processes)

    @property
    def effective_cuda_error(self) -> int:
        """The CUDA error a context creation on this GPU would give (0: success)."""
        if self.cuda_error is not None:
            return self.cuda_error
        if self.fault == "lost":
            return 999
        if self.compute_mode == "prohibited":
            return 46
        if self.compute_mode in ("exclusive_process", "exclusive_thread") and self.processes:
            return 46
        return 0


@dataclass(frozen=True)
class Fleet:
    gpus: tuple[SimGpu, ...]
    name: str = "custom"
    description: str = ""
    driver_version: str = "550.163.01"
    cuda_driver_version: int = 12040
    nvml_version: str = "12.550.163.01"
    init_error: InitError | None = None  # a key of INIT_ERRORS
    missing_functions: frozenset[str] = field(default_factory=frozenset)
    hostname: str | None = None
    # A load that changes over time (seconds per cycle): each GPU's utilisation and
    # memory follow a slow wave, offset per GPU, so live views have something to show.
    load_period_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"nbgpu_fleet": FLEET_FORMAT, **to_data(self)}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


@dataclass(frozen=True)
class Device:
    """What a driver call addresses (a CUDA device, an NVML handle): a GPU or a MIG instance."""

    gpu: SimGpu
    mig: MigDevice | None

    @property
    def name(self) -> str:
        return self.mig.name if self.mig else self.gpu.name

    @property
    def uuid(self) -> str:
        return self.mig.uuid if self.mig else self.gpu.uuid


def deref(ref: Any) -> Any:
    """The ctypes object behind ``byref(obj)`` / ``pointer(obj)``, or the object itself."""
    if hasattr(ref, "_obj"):  # byref() gives a CArgObject holding the original object
        return ref._obj
    if isinstance(ref, ctypes._Pointer):  # ctypes exposes no public pointer base class
        return ref.contents
    return ref


def int_arg(value: Any) -> int:
    """A C int argument: ``c_int(3)`` or plain ``3`` (CDLL accepts both)."""
    return int(getattr(value, "value", value))


class RankProcess(NamedTuple):
    pid: int
    rss_bytes: int


_CACHE_S = 1.0  # NVML asks per GPU and per call
_cache: dict[str, tuple[float, dict[int, list[RankProcess]]]] = {}


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
    """{physical GPU index: live ranks} launched on the simulated ``fleet_spec``, by the GPU
    their LOCAL_RANK maps to, with their host memory (RSS): else a simulated board looks
    empty while nbgpu's ranks run "on" it."""
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
