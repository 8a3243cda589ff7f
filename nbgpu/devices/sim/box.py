"""A simulated GPU box as data: its GPUs as NVML would describe them, and the driver facts.

What a fleet file holds (the format ``nbgpu status --json`` writes, :data:`FLEET_FORMAT`),
read by these types; :mod:`nbgpu.devices.sim.fleet` builds one from what
``NBGPU_SIMULATE`` names, and the fake NVML and CUDA libraries serve it.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from nbgpu._serial import to_data
from nbgpu.devices.model import (
    FLEET_FORMAT,
    GpuFault,
    InitError,
    MigDevice,
    ProcessRecord,
    RemappedRows,
)

__all__ = ["COMPUTE_MODES", "ComputeMode", "Fleet", "SimGpu"]

#: The words a fleet file may use for a compute mode (read by their type: ``_serial.py``),
#: in the order of NVML's constants.
ComputeMode = Literal["default", "exclusive_thread", "prohibited", "exclusive_process"]
#: NVML compute modes, by the names nbgpu uses everywhere (value = NVML constant).
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
    # What creating a CUDA context on this GPU returns (CUDA driver error code).
    # None means "derive it": busy (46) when exclusive and held, or prohibited.
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
    """A whole box: driver facts plus its GPUs."""

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
