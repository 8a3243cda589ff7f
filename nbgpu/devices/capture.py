"""The capture file: an inventory as the JSON document ``nbgpu status --json`` writes.

A capture is the simulator's fleet file (so ``NBGPU_SIMULATE=pod.json`` replays the box)
plus what was observed where it was taken: findings, the CUDA mapping, ``/dev/nvidia*``
files, the probe, the container. Both directions work on an inventory's fields, not on the
``Inventory`` class, which calls them; read back, a capture is as it was taken (no simulator).
"""

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, cast

from nbgpu._serial import from_data, to_data
from nbgpu.devices.holders import ContainerInfo, HolderInfo, recorded_holder
from nbgpu.devices.model import (
    FLEET_FORMAT,
    GPU_FAULTS,
    INIT_ERRORS,
    OBSERVED_STATES,
    Gpu,
    GpuProcess,
    ObservedProcess,
    ProcessRecord,
    ProcessState,
    assess_gpu,
)
from nbgpu.devices.visible import FASTEST_FIRST, VisibleMap
from nbgpu.errors import UserInputError
from nbgpu.problems import Problem

__all__ = ["is_capture", "observed_holder", "read_capture", "write_capture"]

_INIT_ERROR_NAMES = {code: name for name, code in INIT_ERRORS.items()}
# Written as the inventory holds them.
_COPIED = (
    "hostname", "taken_at", "simulated", "driver_version", "cuda_driver_version", "nvml_version",
)  # fmt: skip


def is_capture(data: object) -> bool:
    """Whether a decoded JSON document is an inventory's capture (not a fleet by hand)."""
    return isinstance(data, dict) and "taken_at" in data


def observed_holder(pid: int, o: ObservedProcess) -> HolderInfo:
    """The holder a capture (or a fleet file) recorded: never looked up on this machine."""
    return recorded_holder(pid, o.state, o.user, o.command, o.visible_devices, o.start_time)


def write_capture(inv: Mapping[str, Any]) -> dict[str, Any]:
    """The capture of an inventory given by its fields (``Inventory.to_dict``)."""
    init_error = _INIT_ERROR_NAMES.get(inv["nvml_error_code"] or -1) if inv["nvml_error"] else None
    visible = None
    if (v := inv["visible"]) is not None:
        seen = {k: to_data(getattr(v, k)) for k in ("order", "devices", "stopped_at", "problems")}
        visible = {"value": v.raw, "override": inv["visible_is_override"], **seen}
    holders = inv["device_file_holders"]
    return {
        "nbgpu_fleet": FLEET_FORMAT,
        "name": inv["fleet_name"] if inv["simulated"] else inv["hostname"],
        "description": inv["fleet_description"] or f"captured on {inv['hostname']}",
        **{k: inv[k] for k in _COPIED},
        "init_error": init_error,
        "nvml_error": inv["nvml_error"],
        "container": to_data(inv["container"]),
        "visible_devices": visible,
        "gpus": [
            {**_gpu_document(g), "findings": to_data(fs)}
            for g, fs in zip(inv["gpus"], inv["findings"], strict=True)
        ],
        "device_files": [
            {"pid": pid, "paths": list(paths), "observed": to_data(_observed(holders.get(pid)))}
            for pid, paths in sorted(inv["device_files"].items())
        ],
        "probe": None if inv["probe"] is None else inv["probe"].to_dict(),
    }


def read_capture(data: Any, where: str) -> dict[str, Any]:
    """The inventory's fields a capture holds (``Inventory.from_dict``); each mistake one
    ``UserInputError`` line naming *where* and the field (``gpus[1].processes[0].pid``)."""
    if not is_capture(data):
        raise UserInputError(f"{where}: not a capture (write one with `nbgpu status --json`)")
    doc = from_data(_Document, data, prefix=where)
    gpus = tuple(_gpu(g, f"gpus[{n}]", where) for n, g in enumerate(doc.gpus))
    findings = tuple(
        from_data(_Findings, g, where=f"gpus[{n}]", prefix=where).findings
        if "findings" in g
        else assess_gpu(gpu, len(gpus))  # a capture from before findings were written
        for n, (g, gpu) in enumerate(zip(doc.gpus, gpus, strict=True))
    )
    seen = doc.visible_devices
    if isinstance(seen, dict):  # older captures lack the order and where CUDA stopped
        seen = {"order": FASTEST_FIRST, "stopped_at": None, **seen, "raw": seen.get("value")}
    visible = None
    if seen is not None:
        visible = from_data(VisibleMap, seen, where="visible_devices", prefix=where)
    probe = None
    if doc.probe is not None:
        from nbgpu.devices.health import ProbeReport  # noqa: PLC0415  (a probed capture only)

        probe = ProbeReport.from_dict(doc.probe, where=where)
    return {
        **{k: getattr(doc, k) for k in (*_COPIED, "container", "nvml_error")},
        "fleet_name": doc.name if doc.simulated else None,
        "fleet_description": doc.description if doc.simulated else None,
        "nvml_error_code": INIT_ERRORS.get(doc.init_error or "") if doc.nvml_error else None,
        "gpus": gpus,
        "findings": findings,
        "visible": visible,
        "visible_is_override": isinstance(seen, dict) and seen.get("override") is True,
        "device_files": {f.pid: f.paths for f in doc.device_files},
        "device_file_holders": {
            f.pid: observed_holder(f.pid, f.observed)
            for f in doc.device_files
            if f.observed is not None
        },
        "probe": probe,
    }


def _observed(h: HolderInfo | None) -> ObservedProcess | None:
    """What a capture records of a holder: its state where it was taken, who, what."""
    if h is None:
        return None
    state = h.state if h.state in ("dead", "zombie", "other_namespace") else h.status
    state = state if state in OBSERVED_STATES else "running"
    return ObservedProcess(
        cast("ProcessState", state), h.user, h.command, h.visible_devices, h.start_time
    )


def _gpu_document(gpu: Gpu) -> dict[str, Any]:
    data = {f.name: to_data(getattr(gpu, f.name)) for f in fields(gpu)}
    data["index"] = data.pop("nvml_index")
    data["fault"] = gpu.error if gpu.error in GPU_FAULTS else None
    kinds: dict[str, Literal["compute", "graphics"]] = {"graphics": "graphics"}
    data["processes"] = [
        to_data(
            ProcessRecord(p.pid, p.used_bytes, kinds.get(p.kind, "compute"), _observed(p.holder))
        )
        for p in gpu.processes
    ]
    return data


def _gpu(data: Any, where: str, prefix: str) -> Gpu:
    if not isinstance(data, dict):
        raise UserInputError(f"{prefix}: {where} is not an object")
    error = data.get("error", data.get("fault"))
    facts = {**data, "nvml_index": data.get("index"), "error": error, "processes": []}
    gpu = from_data(Gpu, facts, where=where, prefix=prefix)
    listed = {"processes": data.get("processes") or []}
    records = from_data(_Processes, listed, where=where, prefix=prefix).processes
    holders = {r.pid: observed_holder(r.pid, r.observed) for r in records if r.observed}
    processes = tuple(GpuProcess(r.pid, r.used_bytes, r.kind, holders.get(r.pid)) for r in records)
    return replace(gpu, processes=processes)


@dataclass(frozen=True)
class _Processes:
    processes: tuple[ProcessRecord, ...]


@dataclass(frozen=True)
class _Findings:
    findings: tuple[Problem, ...]


@dataclass(frozen=True)
class _DeviceFile:
    pid: int
    paths: tuple[str, ...]
    observed: ObservedProcess | None = None


@dataclass(frozen=True)
class _Document:
    """A capture's top level, checked by its types."""

    taken_at: float
    hostname: str
    container: ContainerInfo
    name: str | None = None
    description: str | None = None
    simulated: bool = False
    driver_version: str | None = None
    cuda_driver_version: int | None = None
    nvml_version: str | None = None
    init_error: str | None = None
    nvml_error: str | None = None
    gpus: tuple[Any, ...] = ()  # each read by _gpu
    visible_devices: Any = None  # read as a VisibleMap
    device_files: tuple[_DeviceFile, ...] = ()
    probe: Any = None  # read by ProbeReport.from_dict
