"""Fleets: a GPU box described as data, for the simulator and for offline planning.

A fleet is what ``nbgpu status --json`` writes on a real machine, and what
``NBGPU_SIMULATE`` accepts: a JSON file, a named fleet (``busy-gpu0``: one file each in
``fleets/``, the same format, read by the same reader), or a short spec such as
``4xA40,busy=0`` (``spec.py``, built from the GPU models here: facts from real captures).
The fake NVML library (``nvml.py``) serves a fleet through the real pynvml wrappers.

A process listed on a simulated GPU is either *live* (no ``observed`` record: its pid
is looked up on this machine, so tests can stand real processes in as holders) or
*recorded* (an ``observed`` record says what was seen where the fleet was captured:
its user, command, and state such as ``dead`` or ``zombie``).

This module is pure data: it imports neither pynvml nor psutil.
"""

from __future__ import annotations

import json
import uuid as uuidlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from nbgpu._serial import from_data, to_data
from nbgpu.devices.model import (
    FLEET_FORMAT,
    GpuFault,
    InitError,
    MigDevice,
    ProcessRecord,
    RemappedRows,
)
from nbgpu.errors import FleetSpecError

__all__ = [
    "COMPUTE_MODES",
    "FLEETS_DIR",
    "MIG_1G_BYTES",
    "MODELS",
    "OLD_DRIVER_MISSING",
    "SCENARIOS",
    "ComputeMode",
    "Fleet",
    "GpuModel",
    "SimGpu",
    "bus_id_for",
    "fleet_from_dict",
    "scenario",
    "scenario_key",
    "uuid_for",
]

MIB = 1024 * 1024

#: NVML compute modes, by the names nbgpu uses everywhere (value = NVML constant).
COMPUTE_MODES: Mapping[str, int] = {
    "default": 0,
    "exclusive_thread": 1,
    "prohibited": 2,
    "exclusive_process": 3,
}

#: The words a fleet file may use for a compute mode (read by their type: ``_serial.py``).
ComputeMode = Literal["default", "exclusive_thread", "prohibited", "exclusive_process"]


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


# --------------------------------------------------------------------------- GPU models

# NVML symbols that drivers before R470-ish do not export; pynvml then raises
# FunctionNotFound and nbgpu must fall back to the unversioned calls.
OLD_DRIVER_MISSING = (
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetGraphicsRunningProcesses_v3",
    "nvmlDeviceGetGraphicsRunningProcesses_v2",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetPciInfo_v3",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetMigMode",
)


@dataclass(frozen=True)
class GpuModel:
    """Facts about one GPU model, from real captures (reference/nvidia.md §9.1)."""

    name: str
    memory_total_bytes: int
    memory_reserved_bytes: int
    power_limit_w: float
    idle_power_w: float
    idle_temperature_c: int
    compute_capability: tuple[int, int]
    pci_device_id: int
    mig_capable: bool = False
    remapped_rows: bool = False  # Ampere datacenter and newer report row remapping


MODELS: Mapping[str, GpuModel] = {
    "A40": GpuModel("NVIDIA A40", 46068 * MIB, 0, 300.0, 31.0, 38, (8, 6), 0x223510DE),
    "A100": GpuModel(
        "NVIDIA A100-SXM4-40GB",
        40960 * MIB,
        518 * MIB,
        400.0,
        49.7,
        33,
        (8, 0),
        0x20B010DE,
        mig_capable=True,
        remapped_rows=True,
    ),
    "A100-80GB": GpuModel(
        "NVIDIA A100-SXM4-80GB",
        81920 * MIB,
        518 * MIB,
        400.0,
        52.0,
        34,
        (8, 0),
        0x20B210DE,
        mig_capable=True,
        remapped_rows=True,
    ),
    "H100": GpuModel(
        "NVIDIA H100 80GB HBM3",
        81559 * MIB,
        480 * MIB,
        700.0,
        68.9,
        29,
        (9, 0),
        0x233010DE,
        mig_capable=True,
        remapped_rows=True,
    ),
    "H200": GpuModel(
        "NVIDIA H200",
        143771 * MIB,
        480 * MIB,
        700.0,
        75.0,
        30,
        (9, 0),
        0x233510DE,
        mig_capable=True,
        remapped_rows=True,
    ),
    "L40S": GpuModel("NVIDIA L40S", 46068 * MIB, 0, 350.0, 28.0, 33, (8, 9), 0x26B910DE),
    "T4": GpuModel("Tesla T4", 15360 * MIB, 0, 70.0, 10.0, 37, (7, 5), 0x1EB810DE),
    "A10G": GpuModel("NVIDIA A10G", 23028 * MIB, 0, 300.0, 25.0, 30, (8, 6), 0x223710DE),
    "RTX4090": GpuModel(
        "NVIDIA GeForce RTX 4090", 24564 * MIB, 0, 450.0, 21.5, 35, (8, 9), 0x268410DE
    ),
    "V100": GpuModel("Tesla V100-SXM2-16GB", 16152 * MIB, 0, 300.0, 40.0, 35, (7, 0), 0x1DB110DE),
}


# A100-40GB 1g.5gb profile: 4864 MiB each, at most 7 (NVIDIA MIG user guide, table 12).
MIG_1G_BYTES = 4864 * MIB


# --------------------------------------------------------------------------- spec


def uuid_for(key: str) -> str:
    # Deterministic UUIDs: the same spec always gives the same fleet, so tests and
    # notebooks can name GPUs by UUID.
    u = uuidlib.uuid5(uuidlib.NAMESPACE_URL, "nbgpu:" + key)
    return f"GPU-{u}"


def bus_id_for(index: int) -> str:
    # Spread over buses like a real 8-GPU board; NVML's 8-hex-digit domain form.
    return f"00000000:{0x18 + 0x10 * index:02X}:00.0"


# --------------------------------------------------------------------------- JSON


def _with_position_defaults(gpu: dict[str, Any], position: int) -> dict[str, Any]:
    defaults = {
        "index": position,
        "uuid": uuid_for(f"json/{position}"),
        "pci_bus_id": bus_id_for(position),
    }
    # A capture writes null for what NVML could not read (a lost GPU's name and size).
    unread = {"name": "Unknown GPU", "memory_total_bytes": 0}
    return {
        **gpu,
        **{k: v for k, v in defaults.items() if gpu.get(k) is None},
        **{k: v for k, v in unread.items() if k in gpu and gpu[k] is None},
    }


def fleet_from_dict(data: Any, *, default_name: str = "fleet.json") -> Fleet:
    """A decoded fleet JSON document as a Fleet, read by the model's own types.

    A GPU's index, UUID and bus id default from its position; errors name the field.
    """
    if not isinstance(data, dict):
        raise FleetSpecError("fleet JSON: the top level is not an object")
    fmt = data.get("nbgpu_fleet")
    if fmt != FLEET_FORMAT:
        raise FleetSpecError(
            f"fleet JSON: nbgpu_fleet = {fmt!r}; expected {FLEET_FORMAT} "
            "(write one with `nbgpu status --json > pod.json`)"
        )
    gpus = data.get("gpus")
    if isinstance(gpus, list):
        # What a capture could not read (a lost GPU's UUID) is null: default it too.
        gpus = [
            _with_position_defaults(g, i) if isinstance(g, dict) else g for i, g in enumerate(gpus)
        ]
        data = {**data, "gpus": gpus}
    return from_data(
        Fleet, {"name": default_name, **data}, prefix="fleet JSON", error=FleetSpecError
    )


# --------------------------------------------------------------------------- named fleets

FLEETS_DIR = Path(__file__).with_name("fleets")

#: The named fleets, from the files (their descriptions are read with the fleet).
SCENARIOS: tuple[str, ...] = tuple(sorted(p.stem for p in FLEETS_DIR.glob("*.json")))


def scenario_key(name: str) -> str | None:
    """The named fleet a name means, or None."""
    return name if name in SCENARIOS else None


def scenario(name: str) -> Fleet:
    """The named fleet (a file of ``fleets/``)."""
    if scenario_key(name) is None:
        raise FleetSpecError(f"{name!r} is not a scenario; scenarios: {', '.join(SCENARIOS)}")
    path = FLEETS_DIR / f"{name}.json"
    return fleet_from_dict(json.loads(path.read_text(encoding="utf-8")), default_name=name)
