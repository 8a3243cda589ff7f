"""A GPU as nbgpu knows it, and what is wrong with it.

The inventory's data types (``None``: not reported). A capture (``nbgpu status --json``)
is in the simulator's fleet format, so the records it shares with a fleet are defined here
once; several nodes' captures make a cluster file. Then the doctor's findings on one GPU
(:func:`assess_gpu`), condensed to one health word by :func:`gpu_health`. No I/O and light
imports only (a simulated probe's child imports this).
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from nbgpu.errors import FleetSpecError
from nbgpu.problems import SEVERITY_ORDER, Problem
from nbgpu.sizes import fmt_bytes

if TYPE_CHECKING:  # holders imports psutil; the types module stays light
    from nbgpu.devices.holders import HolderInfo

__all__ = [
    "FLEET_FORMAT", "GPU_FAULTS", "INIT_ERRORS", "OBSERVED_STATES", "Gpu", "GpuFault",
    "GpuProcess", "InitError", "MigDevice", "ObservedProcess", "ProcessRecord", "ProcessState",
    "RemappedRows", "assess_gpu", "cluster_nodes", "gpu_health", "is_cluster",
]  # fmt: skip

#: The version of the capture / fleet file format (its ``nbgpu_fleet`` key).
FLEET_FORMAT = 1

InitError = Literal[
    "no_permission", "driver_not_loaded", "library_not_found", "lib_rm_version_mismatch", "unknown"
]
#: How NVML initialisation can fail, by name (a capture's ``init_error``), with NVML's code.
INIT_ERRORS: dict[str, int] = dict(
    zip(typing.get_args(InitError), (4, 9, 12, 18, 999), strict=True)
)
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
        """The holder's state (``HolderInfo.state``), ``unknown`` when not looked up."""
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
    # Capabilities NVML answered NotSupported / FunctionNotFound, older APIs used: "N/A" said.
    unsupported: tuple[str, ...] = ()
    fallbacks: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ghost_bytes(self) -> int | None:
        """Used memory no listed process accounts for (another namespace, a leak)."""
        attributed = [p.used_bytes for p in self.processes]
        if self.memory_used_bytes is None or None in attributed:
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
    """A process on a GPU as a capture or a fleet file records it; without ``observed``
    a simulated one is *live* (see :mod:`nbgpu.devices.sim.fleet`)."""

    pid: int
    used_bytes: int | None = None  # None: NVML cannot tell (MIG without privileges, WDDM)
    kind: Literal["compute", "graphics"] = "compute"
    observed: ObservedProcess | None = None

    def __post_init__(self) -> None:
        if isinstance(self.pid, bool) or self.pid <= 0:
            raise ValueError(f"pid = {self.pid}; expected a positive pid")


def is_cluster(data: object) -> bool:
    """Whether a decoded JSON document is a cluster file (``nbgpu status --slurm --json``)."""
    return (
        isinstance(data, dict) and "nbgpu_fleet" not in data and isinstance(data.get("nodes"), list)
    )


def cluster_nodes(data: Mapping[str, Any], where: str) -> dict[str, dict[str, object]]:
    """The documents of a cluster file (:func:`is_cluster`) by node name, in its order."""
    out: dict[str, dict[str, object]] = {}
    for i, entry in enumerate(data["nodes"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("node"), str):
            raise FleetSpecError(f"{where}: nodes[{i}] has no node name")
        out[entry["node"]] = entry
    if not out:
        raise FleetSpecError(f"{where}: the cluster file lists no node")
    return out


# Real drivers keep a few hundred MiB per context that no process is charged for;
# only a remainder well above that is worth a warning.
GHOST_THRESHOLD_BYTES = 2**30


@dataclass(frozen=True)
class _Seen:
    """One GPU as the rules see it, with the words several rules share."""

    gpu: Gpu
    gpu_count: int | None

    @property
    def i(self) -> int:
        return self.gpu.nvml_index

    @property
    def exclusive(self) -> bool:
        return self.gpu.compute_mode in ("exclusive_process", "exclusive_thread")

    @property
    def mode_text(self) -> str:  # of an exclusive GPU
        return (self.gpu.compute_mode or "").replace("_", "-")

    @property
    def exclude(self) -> str:
        """The fix that works for any bad GPU: leave it out of jobs."""
        if self.gpu_count is None or self.gpu_count <= 1:
            return "use another machine: this is the only GPU"
        others = ",".join(str(i) for i in range(self.gpu_count) if i != self.i)
        return (
            f"leave GPU {self.i} out of jobs (e.g. `%%torchrun --gpus {others}`; without --gpus, "
            "%%torchrun leaves unhealthy GPUs out by itself)"
        )

    def finding(self, code: str, message: str, *fixes: str, severity: str | None = None) -> Problem:
        """A finding of kind *code* (its severity from :data:`_KINDS` unless given)."""
        return Problem(severity or _KINDS[code][0], code, f"GPU {self.i}", message, fixes)


def _who(proc: GpuProcess) -> str:
    h = proc.holder
    user = f", user {h.user}" if h and h.user else ""
    return f"pid {proc.pid}{user}" + (f", {h.command[:60]!r}" if h and h.command else "")


def _recorded(proc: GpuProcess) -> str:
    return " (as recorded in the fleet file)" if proc.holder and proc.holder.recorded else ""


def _unreadable(g: _Seen) -> Problem:
    """The one finding on a GPU NVML cannot read: nothing else about it is known."""
    if g.gpu.error == "lost":
        return g.finding(
            "gpu_lost",
            f"GPU {g.i} has fallen off the bus or is otherwise inaccessible (NVML: GPU is "
            "lost, typically Xid 79).",
            "look for Xid 79 in the kernel log: `sudo dmesg | grep -i xid`",
            "reboot or power-cycle the node; if it recurs, drain it and ask for an RMA",
            g.exclude,
        )
    if g.gpu.error == "no_permission":
        return g.finding(
            "no_permission",
            f"GPU {g.i} is counted by the driver but this process may not open it "
            "(NVML: Insufficient Permissions) — typical of a container or SLURM job "
            "whose cgroup only grants some /dev/nvidia* devices.",
            "inside SLURM, request the GPUs with --gres=gpu:N; in Docker use --gpus all "
            "(or --device /dev/nvidiaN)",
            g.exclude,
        )
    return g.finding("nvml_error", f"NVML could not read GPU {g.i}: {g.gpu.error}")


def _dead_holder(g: _Seen, proc: GpuProcess) -> Problem | None:
    if g.exclusive:
        return g.finding(
            "exclusive_dead_holder",
            f"GPU {g.i} is in {g.mode_text} mode and held by pid {proc.pid}, which no "
            f"longer exists{_recorded(proc)}: every new CUDA context fails with "
            "'CUDA-capable device(s) is/are busy or unavailable'.",
            f"find the real holder: `sudo fuser -v /dev/nvidia{g.i}` (or `sudo lsof "
            f"/dev/nvidia{g.i}`) and stop it; `nbgpu clean` does this for your own processes",
            f"reset the GPU once nothing uses it: `sudo nvidia-smi --gpu-reset -i {g.i}`",
            f"or allow sharing again: `sudo nvidia-smi -i {g.i} -c DEFAULT`",
            g.exclude,
        )
    return g.finding(
        "dead_holder",
        f"GPU {g.i} lists pid {proc.pid}, which no longer exists{_recorded(proc)}; its "
        f"{fmt_bytes(proc.used_bytes)} may stay allocated until the context is torn down.",
        f"`sudo fuser -v /dev/nvidia{g.i}` shows the process really holding it",
        f"`sudo nvidia-smi --gpu-reset -i {g.i}` once the GPU is idle",
    )


def _zombie_holder(g: _Seen, proc: GpuProcess) -> Problem | None:
    parent = proc.holder.ppid if proc.holder else None
    parent_text = f" (parent pid {parent})" if parent else ""
    return g.finding(
        "zombie_holder",
        f"GPU {g.i} is held by zombie pid {proc.pid}{parent_text}{_recorded(proc)}: the "
        "process exited but was never reaped, so its GPU context may not be released.",
        f"stop its parent{parent_text} so init reaps it; `nbgpu clean` lists it if "
        "the parent is a stale job of yours",
        f"if the parent is init: `sudo nvidia-smi --gpu-reset -i {g.i}` or reboot",
        *((g.exclude,) if g.exclusive else ()),
        severity="bad" if g.exclusive else None,
    )


def _other_namespace_holder(g: _Seen, proc: GpuProcess) -> Problem | None:
    return g.finding(
        "other_namespace_holder",
        f"GPU {g.i} is used by pid {proc.pid}, which is not in this PID namespace"
        f"{_recorded(proc)}: we are inside a container and NVML reports host pids. It may be "
        "alive on the host (another container or user).",
        "check on the host: `nvidia-smi` there shows the owner of this pid",
        "run the container with --pid=host to see host processes here",
        *((g.exclude,) if g.exclusive else ()),
    )


def _exclusive_busy(g: _Seen, proc: GpuProcess) -> Problem | None:
    if not g.exclusive:
        return None
    return g.finding(
        "exclusive_busy",
        f"GPU {g.i} is in {g.mode_text} mode and in use by {_who(proc)}: no other process "
        "can create a CUDA context on it until that one exits.",
        "wait for it, or stop it if it is yours (`%gpu_stop` for nbgpu runs)",
        g.exclude,
    )


_BY_HOLDER_STATE: dict[str, Callable[[_Seen, GpuProcess], Problem | None]] = {
    "dead": _dead_holder,
    "zombie": _zombie_holder,
    "other_namespace": _other_namespace_holder,
    "alive": _exclusive_busy,
    "stopped": _exclusive_busy,
    "no_access": _exclusive_busy,
}


def _facts(g: _Seen) -> Iterator[Problem]:
    """One rule per fact about the GPU itself, in this order (the sort keeps it)."""
    gpu, i = g.gpu, g.i
    held = (_BY_HOLDER_STATE[p.state](g, p) for p in gpu.processes if p.state in _BY_HOLDER_STATE)
    yield from filter(None, held)
    if g.exclusive and not gpu.processes:
        yield g.finding(
            "exclusive_mode",
            f"GPU {i} is in {g.mode_text} mode: one process at a time; give each rank its own GPU.",
        )
    if gpu.compute_mode == "prohibited":
        yield g.finding(
            "prohibited",
            f"GPU {i} is in compute-prohibited mode: no CUDA context can be created on it.",
            f"`sudo nvidia-smi -i {i} -c DEFAULT`",
            g.exclude,
        )
    rows = gpu.remapped_rows
    if rows is not None and rows.failure:
        yield g.finding(
            "remap_failure",
            f"GPU {i} failed to remap a memory row: its memory is unreliable.",
            "drain the node and contact your provider (RMA)",
            g.exclude,
        )
    elif rows is not None and rows.pending:
        yield g.finding(
            "reset_required",
            f"GPU {i} has a pending row remap ({rows.uncorrectable} uncorrectable): it needs "
            "a reset before it is reliable (Xid 63).",
            f"`sudo nvidia-smi --gpu-reset -i {i}` when idle, or reboot",
            g.exclude,
        )
    if gpu.retired_pages_pending:
        yield g.finding(
            "reset_required",
            f"GPU {i} has retired memory pages pending: reset it to apply them.",
            f"`sudo nvidia-smi --gpu-reset -i {i}` when idle, or reboot",
        )
    if gpu.ecc_uncorrected_volatile:
        yield g.finding(
            "ecc_errors",
            f"GPU {i} reported {gpu.ecc_uncorrected_volatile} uncorrected ECC errors since "
            "the driver loaded.",
            "watch `nvidia-smi -q -d ECC`; if the count grows, drain the node",
        )
    ghost = gpu.ghost_bytes or 0
    # A holder in another namespace already explains memory nobody here accounts for.
    explained = any(p.state == "other_namespace" for p in gpu.processes)
    if ghost > GHOST_THRESHOLD_BYTES and not explained:
        yield g.finding(
            "ghost_memory",
            f"GPU {i} has {fmt_bytes(ghost)} in use that no listed process accounts for: a "
            "process in another PID namespace (container) or a leaked context.",
            f"`sudo fuser -v /dev/nvidia{i}` on the host names the holder",
        )
    if gpu.utilization_gpu_pct == 100 and not gpu.processes and not gpu.memory_used_bytes:
        yield g.finding(
            "wedged",
            f"GPU {i} reports 100 % utilisation with no process and no memory in use: its "
            "counters may be frozen (a wedged GPU).",
            "run `nbgpu status --probe`; if the probe fails, reset the GPU",
        )
    if gpu.mig_enabled:
        yield g.finding(
            "mig",
            f"GPU {i} is in MIG mode with {len(gpu.mig_devices)} instances: a process sees "
            "one instance; select it by MIG UUID in CUDA_VISIBLE_DEVICES.",
        )
    total, used = gpu.memory_total_bytes, gpu.memory_used_bytes
    if total and used is not None and used > 0.9 * total:
        yield g.finding(
            "memory_full",
            f"GPU {i} memory is {used / total:.0%} used ({fmt_bytes(used)} of {fmt_bytes(total)}).",
        )


def assess_gpu(gpu: Gpu, gpu_count: int | None = None) -> tuple[Problem, ...]:
    """All findings for one GPU, worst first."""
    seen = _Seen(gpu, gpu_count)
    if gpu.error is not None:
        return (_unreadable(seen),)
    return tuple(sorted(_facts(seen), key=lambda f: -SEVERITY_ORDER[f.severity]))


# Each finding's severity, and its GPU's health word in the tables when worst (None: info).
_KINDS: dict[str, tuple[str, str | None]] = {
    "gpu_lost": ("bad", "LOST"),
    "no_permission": ("bad", "no access"),
    "nvml_error": ("bad", "NVML error"),
    "exclusive_dead_holder": ("bad", "BUSY: dead holder"),
    "zombie_holder": ("warn", "zombie holder"),
    "other_namespace_holder": ("warn", "held (other ns)"),
    "exclusive_busy": ("warn", "busy (exclusive)"),
    "prohibited": ("bad", "prohibited"),
    "remap_failure": ("bad", "remap failed"),
    "reset_required": ("bad", "reset required"),
    "dead_holder": ("warn", "dead holder"),
    "ghost_memory": ("warn", "ghost memory"),
    "wedged": ("warn", "wedged?"),
    "ecc_errors": ("warn", "ECC errors"),
    "memory_full": ("warn", "memory full"),
    "exclusive_mode": ("info", None),
    "mig": ("info", None),
}


def gpu_health(gpu: Gpu, findings: tuple[Problem, ...]) -> tuple[str, str]:
    """(health word, level) for the status and doctor tables: the worst finding's word."""
    for finding in findings:
        word = _KINDS.get(finding.code, ("", None))[1]
        if finding.severity in ("bad", "warn") and word:
            return word, finding.severity
    return ("in use" if gpu.processes else "ok"), "ok"
