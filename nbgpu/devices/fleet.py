"""Fleets: a GPU box described as data, for the simulator and for offline planning.

A fleet is what ``nbgpu status --json`` writes on a real machine, and what
``NBGPU_SIMULATE`` accepts: a JSON file, a named scenario (``busy-gpu0``), or a short
spec such as ``4xA40,busy=0``. The simulated NVML library (``simulate.py``) serves a
fleet through the real pynvml wrappers.

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
from typing import Any, Literal

from nbgpu._serial import from_data, to_data
from nbgpu.devices.model import MigDevice, RemappedRows
from nbgpu.errors import FleetSpecError

__all__ = [
    "COMPUTE_MODES",
    "FLEET_FORMAT",
    "INIT_ERRORS",
    "ComputeMode",
    "Fleet",
    "GpuFault",
    "InitError",
    "MigDevice",
    "ObservedProcess",
    "ProcessState",
    "RemappedRows",
    "SimGpu",
    "SimProcess",
    "bus_id_for",
    "fleet_from_dict",
    "uuid_for",
]

FLEET_FORMAT = 1
MIB = 1024 * 1024

#: NVML compute modes, by the names nbgpu uses everywhere (value = NVML constant).
COMPUTE_MODES: Mapping[str, int] = {
    "default": 0,
    "exclusive_thread": 1,
    "prohibited": 2,
    "exclusive_process": 3,
}

#: How NVML initialisation can fail, by name, with NVML's return code.
INIT_ERRORS: Mapping[str, int] = {
    "no_permission": 4,
    "driver_not_loaded": 9,
    "library_not_found": 12,
    "lib_rm_version_mismatch": 18,
    "unknown": 999,
}

#: The words a fleet file may use for each of these (read by their type: ``_serial.py``).
ComputeMode = Literal["default", "exclusive_thread", "prohibited", "exclusive_process"]
GpuFault = Literal["lost", "no_permission"]
InitError = Literal[
    "no_permission", "driver_not_loaded", "library_not_found", "lib_rm_version_mismatch", "unknown"
]
ProcessState = Literal[
    "running", "sleeping", "disk-sleep", "stopped", "zombie", "dead", "other_namespace"
]

#: Process states an ``observed`` record may carry.
OBSERVED_STATES = frozenset(
    {"running", "sleeping", "disk-sleep", "stopped", "zombie", "dead", "other_namespace"}
)

GPU_FAULTS = frozenset({"lost", "no_permission"})


@dataclass(frozen=True)
class ObservedProcess:
    """What was seen of a process where the fleet was captured (not looked up here)."""

    state: ProcessState
    user: str | None = None
    command: str | None = None
    visible_devices: str | None = None  # its CUDA_VISIBLE_DEVICES, if it was readable
    start_time: float | None = None  # seconds since the epoch


@dataclass(frozen=True)
class SimProcess:
    """A process that NVML reports on a GPU."""

    pid: int
    used_bytes: int | None = None  # None: NVML cannot tell (MIG without privileges, WDDM)
    kind: Literal["compute", "graphics"] = "compute"
    observed: ObservedProcess | None = None

    def __post_init__(self) -> None:
        if isinstance(self.pid, bool) or self.pid <= 0:
            raise ValueError(f"pid = {self.pid}; expected a positive pid")


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
    processes: tuple[SimProcess, ...] = ()
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
    return {**gpu, **{k: v for k, v in defaults.items() if gpu.get(k) is None}}


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
