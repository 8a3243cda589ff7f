"""The inventory's data types, and the file a capture of them is (``nbgpu status --json``).

What nbgpu knows about GPUs and who holds them: frozen dataclasses with units in field
names; ``None`` means "not reported" (NVML said NotSupported, or the capability does not
exist on this model) — never a magic string. ``nvml.py`` fills the hardware fields,
``inventory.py`` adds holders and findings.

A capture of an inventory (``capture.py``) is written in the simulator's fleet format,
so ``NBGPU_SIMULATE=pod.json`` replays the box: the words and records the capture shares
with a fleet (``sim/fleet.py``) are defined here, once (a process as a
:class:`ProcessRecord`, what was seen of its holder as an :class:`ObservedProcess`).
Several nodes' captures make a cluster file (:func:`cluster_nodes`).

Imports only the standard library and ``nbgpu.errors``; ``holders``' types for mypy only.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from nbgpu.errors import FleetSpecError

if TYPE_CHECKING:  # holders imports psutil; the types module stays light
    from nbgpu.devices.holders import HolderInfo

__all__ = [
    "FLEET_FORMAT",
    "GPU_FAULTS",
    "INIT_ERRORS",
    "OBSERVED_STATES",
    "Gpu",
    "GpuFault",
    "GpuProcess",
    "InitError",
    "MigDevice",
    "ObservedProcess",
    "ProcessRecord",
    "ProcessState",
    "RemappedRows",
    "cluster_nodes",
    "is_cluster",
]

#: The version of the capture / fleet file format (its ``nbgpu_fleet`` key).
FLEET_FORMAT = 1

#: How NVML initialisation can fail, by name (a capture's ``init_error``), with NVML's code.
INIT_ERRORS: dict[str, int] = {
    "no_permission": 4,
    "driver_not_loaded": 9,
    "library_not_found": 12,
    "lib_rm_version_mismatch": 18,
    "unknown": 999,
}
InitError = Literal[
    "no_permission", "driver_not_loaded", "library_not_found", "lib_rm_version_mismatch", "unknown"
]
#: A GPU NVML cannot read (its ``Gpu.error``; a fleet GPU's ``fault``).
GpuFault = Literal["lost", "no_permission"]
GPU_FAULTS = frozenset(typing.get_args(GpuFault))
#: What was seen of a GPU's process where it was captured: a psutil status or a holder state.
ProcessState = Literal[
    "running", "sleeping", "disk-sleep", "stopped", "zombie", "dead", "other_namespace"
]
OBSERVED_STATES = frozenset(typing.get_args(ProcessState))


@dataclass(frozen=True)
class RemappedRows:
    """NVML's row-remapping counters (Ampere datacenter GPUs and newer)."""

    correctable: int
    uncorrectable: int
    pending: bool
    failure: bool


@dataclass(frozen=True)
class MigDevice:
    """One MIG instance of a GPU, as NVML lists it (None: NVML did not say)."""

    uuid: str
    name: str
    memory_total_bytes: int | None
    gpu_instance_id: int | None = 0
    compute_instance_id: int | None = 0


@dataclass(frozen=True)
class GpuProcess:
    """A process NVML reports on a GPU, with what the OS says about it."""

    pid: int
    used_bytes: int | None  # None: NVML cannot attribute memory (MIG without privileges)
    kind: str  # "compute" | "graphics"
    holder: HolderInfo | None = None

    @property
    def state(self) -> str:
        """The holder's state (``holders.HOLDER_STATES``), ``unknown`` when not looked up."""
        return self.holder.state if self.holder else "unknown"


@dataclass(frozen=True)
class Gpu:
    """One physical GPU by NVML index. ``error`` set means NVML could not read it."""

    nvml_index: int
    error: str | None = None  # "lost", "no_permission", or NVML's own words
    name: str | None = None
    uuid: str | None = None
    pci_bus_id: str | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    memory_reserved_bytes: int | None = None
    utilization_gpu_pct: int | None = None
    utilization_memory_pct: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    compute_mode: str | None = None  # default | exclusive_process | prohibited | exclusive_thread
    persistence_mode: bool | None = None
    mig_enabled: bool | None = None  # None: MIG not supported
    mig_devices: tuple[MigDevice, ...] = ()
    ecc_uncorrected_volatile: int | None = None
    remapped_rows: RemappedRows | None = None
    retired_pages_pending: bool | None = None
    compute_capability: tuple[int, int] | None = None
    processes: tuple[GpuProcess, ...] = ()
    # Capabilities NVML answered NotSupported / FunctionNotFound for, and the older
    # API used instead: shown so "N/A" is never a mystery.
    unsupported: tuple[str, ...] = ()
    fallbacks: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ghost_bytes(self) -> int | None:
        """Used memory no listed process accounts for (another namespace, a leak)."""
        if self.memory_used_bytes is None:
            return None
        attributed = [p.used_bytes for p in self.processes]
        if any(b is None for b in attributed):
            return None
        return max(0, self.memory_used_bytes - sum(b or 0 for b in attributed))


@dataclass(frozen=True)
class ObservedProcess:
    """What was seen of a process where the capture was taken (not looked up here)."""

    state: ProcessState
    user: str | None = None
    command: str | None = None
    visible_devices: str | None = None  # its CUDA_VISIBLE_DEVICES, if it was readable
    start_time: float | None = None  # seconds since the epoch


@dataclass(frozen=True)
class ProcessRecord:
    """A process on a GPU as a capture or a fleet file records it.

    Without an ``observed`` record a simulated fleet's process is *live*: its pid is
    looked up on this machine (tests stand real processes in as holders).
    """

    pid: int
    used_bytes: int | None = None  # None: NVML cannot tell (MIG without privileges, WDDM)
    kind: Literal["compute", "graphics"] = "compute"
    observed: ObservedProcess | None = None

    def __post_init__(self) -> None:
        if isinstance(self.pid, bool) or self.pid <= 0:
            raise ValueError(f"pid = {self.pid}; expected a positive pid")


def is_cluster(data: object) -> bool:
    """Whether a decoded JSON document is a cluster file (one capture per node, under
    ``"nodes"``: what ``nbgpu status --slurm --json`` writes)."""
    return (
        isinstance(data, dict) and "nbgpu_fleet" not in data and isinstance(data.get("nodes"), list)
    )


def cluster_nodes(data: object, where: str) -> dict[str, dict[str, object]]:
    """A cluster file's documents by node name, in the file's order."""
    if not is_cluster(data):
        raise FleetSpecError(
            f"{where} is not a cluster file (write one with `nbgpu status --slurm --json`)"
        )
    out: dict[str, dict[str, object]] = {}
    for i, entry in enumerate(data["nodes"]):  # type: ignore[index]
        if not isinstance(entry, dict) or not isinstance(entry.get("node"), str):
            raise FleetSpecError(f"{where}: nodes[{i}] has no node name")
        out[entry["node"]] = entry
    if not out:
        raise FleetSpecError(f"{where}: the cluster file lists no node")
    return out
