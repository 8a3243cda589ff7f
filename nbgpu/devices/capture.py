"""An inventory written as a fleet file (``nbgpu status --json > pod.json``).

The document is the simulator's own fleet format: each GPU is converted to the fleet
model (:func:`fleet_gpu`) and written by the model's type-driven writer, so ``fleet.py``
reads it back with the same types. Beyond the model it keeps what was observed here:
each holder's state, user, command and ``CUDA_VISIBLE_DEVICES`` (as the process's
``observed`` record), the findings, the probe, the container.
``NBGPU_SIMULATE=pod.json`` replays it. Pure data; never touches NVML.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from nbgpu._serial import to_data
from nbgpu.devices.model import Gpu, GpuProcess
from nbgpu.devices.sim.fleet import (
    FLEET_FORMAT,
    GPU_FAULTS,
    INIT_ERRORS,
    OBSERVED_STATES,
    ObservedProcess,
    SimGpu,
    SimProcess,
)
from nbgpu.problems import Problem

if TYPE_CHECKING:
    from nbgpu.devices.inventory import Inventory
    from nbgpu.devices.sim.fleet import GpuFault, ProcessState

__all__ = ["capture_document", "fleet_gpu"]

_CODE_TO_INIT_ERROR = {code: name for name, code in INIT_ERRORS.items()}


def capture_document(inventory: Inventory) -> dict[str, Any]:
    """An inventory as a fleet file: what NVML said here, and what was observed of each
    holder, so the simulator can replay this machine (``nbgpu status --json``)."""
    return {
        "nbgpu_fleet": FLEET_FORMAT,
        "name": inventory.fleet_name if inventory.simulated else inventory.hostname,
        "description": inventory.fleet_description or f"captured on {inventory.hostname}",
        "hostname": inventory.hostname,
        "taken_at": inventory.taken_at,
        "simulated": inventory.simulated,
        "driver_version": inventory.driver_version,
        "cuda_driver_version": inventory.cuda_driver_version,
        "nvml_version": inventory.nvml_version,
        "init_error": _CODE_TO_INIT_ERROR.get(inventory.nvml_error_code or -1)
        if inventory.nvml_error
        else None,
        "nvml_error": inventory.nvml_error,
        "container": {
            "in_container": inventory.container.in_container,
            "host_pid_namespace": inventory.container.host_pid_namespace,
            "reason": inventory.container.reason,
        },
        "visible_devices": None
        if inventory.visible is None
        else {
            "value": inventory.visible_value,
            "devices": [
                {"cuda_index": d.cuda_index, "nvml_index": d.nvml_index, "uuid": d.uuid}
                for d in inventory.visible.devices
            ],
            "problems": list(inventory.visible.problems),
        },
        "gpus": [
            _gpu_dict(g, fs) for g, fs in zip(inventory.gpus, inventory.findings, strict=True)
        ],
        "probe": None if inventory.probe is None else inventory.probe.to_dict(),
    }


# Fields the inventory and the fleet model share, by name. A nullable one means the same
# in both ("None: not supported"); the others are unread here when None, written null,
# and read back as the model's default.
_SHARED_NULLABLE = (
    "memory_used_bytes",
    "mig_enabled",
    "ecc_uncorrected_volatile",
    "remapped_rows",
    "retired_pages_pending",
)
_SHARED_DEFAULTED = (
    "memory_reserved_bytes",
    "utilization_gpu_pct",
    "utilization_memory_pct",
    "temperature_c",
    "power_w",
    "power_limit_w",
    "compute_mode",
    "persistence_mode",
    "compute_capability",
)
_NOT_READ_HERE = ("pci_device_id",)  # the inventory does not ask NVML for it


def fleet_gpu(gpu: Gpu) -> SimGpu:
    """An inventory GPU in the fleet model: what NVML answered, the model's defaults
    where it did not (``_gpu_dict`` writes those as null)."""
    answered = {name: getattr(gpu, name) for name in _SHARED_NULLABLE}
    answered.update(
        (name, getattr(gpu, name)) for name in _SHARED_DEFAULTED if getattr(gpu, name) is not None
    )
    return SimGpu(
        index=gpu.nvml_index,
        name=gpu.name or "Unknown GPU",
        uuid=gpu.uuid or "",
        pci_bus_id=gpu.pci_bus_id or "",
        memory_total_bytes=gpu.memory_total_bytes or 0,
        mig_devices=gpu.mig_devices,
        fault=cast("GpuFault", gpu.error) if gpu.error in GPU_FAULTS else None,
        processes=tuple(_fleet_process(p) for p in gpu.processes),
        **answered,
    )


def _gpu_dict(gpu: Gpu, findings: tuple[Problem, ...]) -> dict[str, Any]:
    data: dict[str, Any] = to_data(fleet_gpu(gpu))
    unread = [n for n in (*_SHARED_DEFAULTED, "uuid", "pci_bus_id") if getattr(gpu, n) is None]
    for name in (*unread, *_NOT_READ_HERE):
        data[name] = None  # not read here: the reader fills the default (or the position's)
    return {
        **data,
        # What the inventory saw beyond the model: kept for people reading the file.
        "memory_free_bytes": gpu.memory_free_bytes,
        "error": gpu.error,
        "unsupported": list(gpu.unsupported),
        "fallbacks": list(gpu.fallbacks),
        "findings": [f.to_dict() for f in findings],
    }


def _fleet_process(proc: GpuProcess) -> SimProcess:
    h = proc.holder
    observed = None
    if h is not None:
        state = h.state if h.state in ("dead", "zombie", "other_namespace") else h.status
        observed = ObservedProcess(
            state=cast("ProcessState", state if state in OBSERVED_STATES else "running"),
            user=h.user,
            command=h.command,
            visible_devices=h.visible_devices,
            start_time=h.start_time,
        )
    return SimProcess(
        pid=proc.pid,
        used_bytes=proc.used_bytes,
        kind="graphics" if proc.kind == "graphics" else "compute",
        observed=observed,
    )
