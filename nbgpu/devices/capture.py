"""An inventory written as a fleet file (``nbgpu status --json > pod.json``).

The document is the simulator's own fleet format (``fleet.py`` reads it back with the
fleet model's types) plus what was observed here: each holder's state, user, command and
``CUDA_VISIBLE_DEVICES``, the probe, the container. ``NBGPU_SIMULATE=pod.json`` replays
it. Pure data; never touches NVML.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nbgpu.devices.findings import Finding
from nbgpu.devices.fleet import FLEET_FORMAT, INIT_ERRORS
from nbgpu.devices.model import Gpu, GpuProcess

if TYPE_CHECKING:
    from nbgpu.devices.inventory import Inventory

__all__ = ["capture_document"]

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


def _gpu_dict(gpu: Gpu, findings: tuple[Finding, ...]) -> dict[str, Any]:
    fault = gpu.error if gpu.error in ("lost", "no_permission") else None
    return {
        "index": gpu.nvml_index,
        "name": gpu.name or "Unknown GPU",
        "uuid": gpu.uuid,
        "pci_bus_id": gpu.pci_bus_id,
        "memory_total_bytes": gpu.memory_total_bytes or 0,
        "memory_reserved_bytes": gpu.memory_reserved_bytes,
        "memory_used_bytes": gpu.memory_used_bytes,
        "memory_free_bytes": gpu.memory_free_bytes,
        "utilization_gpu_pct": gpu.utilization_gpu_pct,
        "utilization_memory_pct": gpu.utilization_memory_pct,
        "temperature_c": gpu.temperature_c,
        "power_w": gpu.power_w,
        "power_limit_w": gpu.power_limit_w,
        "compute_mode": gpu.compute_mode,
        "persistence_mode": gpu.persistence_mode,
        "mig_enabled": gpu.mig_enabled,
        "mig_devices": [
            {
                "uuid": m.uuid,
                "name": m.name,
                "memory_total_bytes": m.memory_total_bytes or 0,
                "gpu_instance_id": m.gpu_instance_id,
                "compute_instance_id": m.compute_instance_id,
            }
            for m in gpu.mig_devices
        ],
        "ecc_uncorrected_volatile": gpu.ecc_uncorrected_volatile,
        "remapped_rows": None
        if gpu.remapped_rows is None
        else {
            "correctable": gpu.remapped_rows.correctable,
            "uncorrectable": gpu.remapped_rows.uncorrectable,
            "pending": gpu.remapped_rows.pending,
            "failure": gpu.remapped_rows.failure,
        },
        "retired_pages_pending": gpu.retired_pages_pending,
        "compute_capability": list(gpu.compute_capability) if gpu.compute_capability else None,
        "fault": fault,
        "error": gpu.error,
        "unsupported": list(gpu.unsupported),
        "fallbacks": list(gpu.fallbacks),
        "findings": [f.to_dict() for f in findings],
        "processes": [_process_dict(p) for p in gpu.processes],
    }


def _process_dict(proc: GpuProcess) -> dict[str, Any]:
    h = proc.holder
    observed = None
    if h is not None:
        observed = {
            "state": h.state
            if h.state in ("dead", "zombie", "other_namespace")
            else (h.status or h.state),
            "user": h.user,
            "command": h.command,
            "visible_devices": h.visible_devices,
            "start_time": h.start_time,
        }
    return {"pid": proc.pid, "used_bytes": proc.used_bytes, "kind": proc.kind, "observed": observed}
