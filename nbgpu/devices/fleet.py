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
import re
import uuid as uuidlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, cast

from nbgpu._serial import from_data, to_data
from nbgpu.errors import FleetSpecError

__all__ = [
    "COMPUTE_MODES",
    "FLEET_FORMAT",
    "INIT_ERRORS",
    "MODELS",
    "SCENARIOS",
    "Fleet",
    "GpuModel",
    "MigDevice",
    "ObservedProcess",
    "RemappedRows",
    "SimGpu",
    "SimProcess",
    "fleet_from_dict",
    "load_fleet",
    "parse_spec",
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
class MigDevice:
    uuid: str
    name: str
    memory_total_bytes: int
    gpu_instance_id: int = 0
    compute_instance_id: int = 0


@dataclass(frozen=True)
class RemappedRows:
    correctable: int
    uncorrectable: int
    pending: bool
    failure: bool


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


def _uuid_for(key: str) -> str:
    # Deterministic UUIDs: the same spec always gives the same fleet, so tests and
    # notebooks can name GPUs by UUID.
    u = uuidlib.uuid5(uuidlib.NAMESPACE_URL, "nbgpu:" + key)
    return f"GPU-{u}"


def _bus_id(index: int) -> str:
    # Spread over buses like a real 8-GPU board; NVML's 8-hex-digit domain form.
    return f"00000000:{0x18 + 0x10 * index:02X}:00.0"


def _make_gpu(model_key: str, model: GpuModel, index: int) -> SimGpu:
    return SimGpu(
        index=index,
        name=model.name,
        uuid=_uuid_for(f"{model_key}/{index}"),
        pci_bus_id=_bus_id(index),
        memory_total_bytes=model.memory_total_bytes,
        memory_reserved_bytes=model.memory_reserved_bytes,
        temperature_c=model.idle_temperature_c,
        power_w=model.idle_power_w,
        power_limit_w=model.power_limit_w,
        mig_enabled=False if model.mig_capable else None,
        remapped_rows=RemappedRows(0, 0, pending=False, failure=False)
        if model.remapped_rows
        else None,
        retired_pages_pending=None if model.remapped_rows else False,
        compute_capability=model.compute_capability,
        pci_device_id=model.pci_device_id,
    )


_SPEC_HEAD = re.compile(
    r"^(?:(\d+)\s*[xX\u00d7]\s*)?([A-Za-z0-9-]+)$"
)  # 4xA40, also with the multiplication sign
_SPEC_HELP = (
    "expected NxMODEL[,key=value...] such as '4xA40' or '8xH100,busy=0', "
    "or a scenario name, or a path to a fleet .json file"
)
# Synthetic pid base for fictional holders: above Linux's PID_MAX_LIMIT (2**22),
# so no real process on any machine can have it.
FICTIONAL_PID_BASE = 4_200_000


def _indices(key: str, value: str, count: int) -> list[int]:
    out = []
    for part in value.replace("+", ";").replace(" ", "").split(";"):
        if not part.isdigit():
            raise FleetSpecError(
                f"fleet spec: {key}={value!r} is not a GPU index; expected e.g. {key}=0 or {key}=0+2"
            )
        idx = int(part)
        if idx >= count:
            raise FleetSpecError(
                f"fleet spec: {key}={idx} but the fleet has {count} GPUs (indices 0..{count - 1})"
            )
        out.append(idx)
    return out


def _size_bytes(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?", text.strip(), re.IGNORECASE)
    if not m:
        raise FleetSpecError(f"fleet spec: {text!r} is not a size; expected e.g. 29000MiB or 28GiB")
    number = float(m.group(1))
    unit = (m.group(2) or "B").upper().rstrip("B").rstrip("I")
    scale = {"": 1, "K": 1024, "M": MIB, "G": 1024 * MIB, "T": 1024 * 1024 * MIB}[unit]
    return int(number * scale)


def parse_spec(spec: str) -> Fleet:  # noqa: PLR0915  (one flat branch per spec key reads best)
    """Build a fleet from a short spec such as ``4xA40,busy=0``.

    Keys (GPU lists use ``+``: ``lost=1+3``):
      busy=I        exclusive-process mode, held by a dead process (a crashed server)
      exclusive=I   exclusive-process mode, no holder
      prohibited=I  compute mode prohibited
      zombie=I      held by a zombie (defunct) process
      otherns=I     held by a process in another PID namespace (container)
      holder=I:PID  a compute process with this real pid (looked up live)
      lost=I        GPU fell off the bus
      noperm=I      NVML handle refused (cgroup-restricted)
      mig=I         MIG enabled with seven 1g.5gb instances
      remap=I       a pending row remap (reset required)
      wedged=I      utilisation stuck at 100 % with nothing running
      procs=N       N running processes (recorded) spread round-robin (benchmarks)
      load=S        utilisation and memory follow a wave of S seconds (live views)
      used=I:SIZE   memory used on GPU I, e.g. used=0:20GiB
      driver=X.Y.Z  driver version;  cuda=12.4  CUDA driver version
      init=NAME     NVML init fails: one of INIT_ERRORS
      old           driver too old for the _v2/_v3 NVML symbols
    """
    text = spec.strip()
    if not text:
        raise FleetSpecError(f"fleet spec is empty; {_SPEC_HELP}")
    head, *options = [part.strip() for part in text.split(",")]
    m = _SPEC_HEAD.match(head)
    if not m:
        raise FleetSpecError(f"fleet spec {spec!r}: cannot read {head!r}; {_SPEC_HELP}")
    count = int(m.group(1) or 1)
    model_key = _model_key(m.group(2), spec)
    if not 1 <= count <= 64:
        raise FleetSpecError(f"fleet spec {spec!r}: {count} GPUs; expected 1 to 64")
    model = MODELS[model_key]
    gpus = [_make_gpu(model_key, model, i) for i in range(count)]
    fleet = Fleet(gpus=tuple(gpus), name=text, description=f"simulated {count}x {model.name}")
    next_pid = FICTIONAL_PID_BASE
    for option in options:
        key, sep, value = option.partition("=")
        key = key.strip().lower()
        value = value.strip()
        if key == "old" and not sep:
            fleet = replace(
                fleet,
                driver_version="450.80.02",
                cuda_driver_version=11000,
                nvml_version="11.450.80.02",
                missing_functions=frozenset(OLD_DRIVER_MISSING),
            )
            continue
        if not sep or not value:
            raise FleetSpecError(f"fleet spec {spec!r}: option {option!r} needs key=value")
        gpus = list(fleet.gpus)
        if key in ("busy", "zombie", "otherns"):
            states: dict[str, ProcessState] = {
                "busy": "dead",
                "zombie": "zombie",
                "otherns": "other_namespace",
            }
            state = states[key]
            for idx in _indices(key, value, count):
                holder = SimProcess(
                    pid=next_pid,
                    used_bytes=min(29000 * MIB, gpus[idx].memory_total_bytes // 2),
                    observed=ObservedProcess(
                        state=state, user=None, command="python -m sglang.launch_server"
                    )
                    if state != "dead"
                    else ObservedProcess(state="dead"),
                )
                next_pid += 1
                gpus[idx] = replace(
                    gpus[idx],
                    compute_mode="exclusive_process" if key == "busy" else gpus[idx].compute_mode,
                    processes=(*gpus[idx].processes, holder),
                )
        elif key in ("exclusive", "prohibited"):
            mode: ComputeMode = "exclusive_process" if key == "exclusive" else "prohibited"
            for idx in _indices(key, value, count):
                gpus[idx] = replace(gpus[idx], compute_mode=mode)
        elif key == "holder":
            for item in value.split("+"):
                gpu_text, _, pid_text = item.partition(":")
                if not pid_text.isdigit():
                    raise FleetSpecError(
                        f"fleet spec: holder={item!r}; expected holder=GPU:PID such as holder=0:1234"
                    )
                (idx,) = _indices("holder", gpu_text, count)
                proc = SimProcess(pid=int(pid_text), used_bytes=1024 * MIB)
                gpus[idx] = replace(gpus[idx], processes=(*gpus[idx].processes, proc))
        elif key == "lost":
            for idx in _indices(key, value, count):
                gpus[idx] = replace(gpus[idx], fault="lost")
        elif key == "noperm":
            for idx in _indices(key, value, count):
                gpus[idx] = replace(gpus[idx], fault="no_permission")
        elif key == "mig":
            for idx in _indices(key, value, count):
                if not model.mig_capable:
                    raise FleetSpecError(
                        f"fleet spec: mig={idx} but {model.name} does not support MIG "
                        "(use A100, A100-80GB, H100 or H200)"
                    )
                gpus[idx] = _with_mig(gpus[idx])
        elif key == "remap":
            for idx in _indices(key, value, count):
                gpus[idx] = replace(
                    gpus[idx], remapped_rows=RemappedRows(0, 1, pending=True, failure=False)
                )
        elif key == "wedged":
            for idx in _indices(key, value, count):
                gpus[idx] = replace(
                    gpus[idx], utilization_gpu_pct=100, memory_used_bytes=0, processes=()
                )
        elif key == "procs":
            if not value.isdigit():
                raise FleetSpecError(f"fleet spec: procs={value!r}; expected a whole number")
            for n in range(int(value)):
                idx = n % count
                proc = SimProcess(
                    pid=next_pid,
                    used_bytes=(512 + 64 * n) * MIB,
                    observed=ObservedProcess(
                        state="running", user="sim", command=f"python train.py --job {n}"
                    ),
                )
                next_pid += 1
                gpus[idx] = replace(gpus[idx], processes=(*gpus[idx].processes, proc))
        elif key == "used":
            gpu_text, _, size_text = value.partition(":")
            (idx,) = _indices("used", gpu_text, count)
            gpus[idx] = replace(gpus[idx], memory_used_bytes=_size_bytes(size_text))
        elif key == "driver":
            if not re.fullmatch(r"\d+\.\d+(\.\d+)?", value):
                raise FleetSpecError(f"fleet spec: driver={value!r}; expected e.g. 550.163.01")
            fleet = replace(fleet, driver_version=value, nvml_version=f"12.{value}")
        elif key == "cuda":
            cm = re.fullmatch(r"(\d+)\.(\d+)", value)
            if not cm:
                raise FleetSpecError(f"fleet spec: cuda={value!r}; expected e.g. 12.4")
            fleet = replace(
                fleet, cuda_driver_version=int(cm.group(1)) * 1000 + int(cm.group(2)) * 10
            )
        elif key == "load":
            try:
                period = float(value)
            except ValueError:
                period = 0.0
            if not 1.0 <= period <= 86400.0:
                raise FleetSpecError(
                    f"fleet spec: load={value!r}; expected the seconds of one load cycle, "
                    "1 to 86400 (e.g. load=60)"
                )
            fleet = replace(fleet, load_period_s=period)
        elif key == "init":
            if value not in INIT_ERRORS:
                raise FleetSpecError(
                    f"fleet spec: init={value!r}; expected one of {', '.join(INIT_ERRORS)}"
                )
            fleet = replace(fleet, init_error=cast("InitError", value))  # checked just above
        else:
            raise FleetSpecError(
                f"fleet spec {spec!r}: unknown option {key!r}; expected one of busy, exclusive, "
                "prohibited, zombie, otherns, holder, lost, noperm, mig, remap, wedged, procs, "
                "used, load, driver, cuda, init, old"
            )
        fleet = replace(fleet, gpus=tuple(gpus))
    return fleet


def _model_key(text: str, spec: str) -> str:
    wanted = text.upper().replace("_", "-")
    for key in MODELS:
        if key.upper() == wanted:
            return key
    raise FleetSpecError(
        f"fleet spec {spec!r}: unknown GPU model {text!r}; expected one of {', '.join(MODELS)}"
    )


def _with_mig(gpu: SimGpu) -> SimGpu:
    children = tuple(
        MigDevice(
            uuid="MIG-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"{gpu.uuid}/mig/{i}")),
            name=f"{gpu.name} MIG 1g.5gb",
            memory_total_bytes=MIG_1G_BYTES,
            gpu_instance_id=7 + i,
            compute_instance_id=0,
        )
        for i in range(7)
    )
    # Without privileges NVML cannot attribute memory per process under MIG.
    procs = tuple(replace(p, used_bytes=None) for p in gpu.processes)
    return replace(gpu, mig_enabled=True, mig_devices=children, processes=procs)


# ------------------------------------------------------------------------ scenarios

#: Named fleets: the situations nbgpu was built to explain, and one per failure mode.
SCENARIOS: Mapping[str, tuple[str, str]] = {
    "healthy": ("4xA40", "4x A40, all idle and healthy"),
    "busy-gpu0": (
        "4xA40,busy=0",
        "4x A40, GPU 0 in exclusive-process mode held by a process that is gone",
    ),
    "nproc-mismatch": (
        "4xH100,zombie=0+1",
        (
            "a 4-GPU box where the script hard-codes 7 ranks, and GPUs 0-1 are still "
            "held by defunct ranks of a previous run"
        ),
    ),
    "shared-sweeps": (
        "8xH100",
        (
            "an 8x H100 node shared by concurrent sweep runs (run1 on GPUs 0-1, "
            "run2 on 2-3, each rank with its own CUDA_VISIBLE_DEVICES); GPUs 4-7 free"
        ),
    ),
    "import-storm": ("8xH100", "an 8x H100 node where 8 ranks import heavy libraries at once"),
    "rescale-2-to-4": ("4xA40", "a 4x A40 pod to which a 2-GPU training config is rescaled"),
    "exclusive-dead": ("4xA40,busy=0", "exclusive-process GPU 0 held by a dead process"),
    "zombie-holder": ("4xA40,exclusive=1,zombie=1", "GPU 1 held by a zombie (defunct) process"),
    "other-namespace": (
        "4xA40,otherns=0",
        "GPU 0 held by a process in another PID namespace (a container sees host pids)",
    ),
    "gpu-lost": ("4xA40,lost=2", "GPU 2 has fallen off the bus (Xid 79)"),
    "no-driver": ("4xA40,init=driver_not_loaded", "the NVIDIA kernel driver is not loaded"),
    "no-library": ("4xA40,init=library_not_found", "libnvidia-ml.so.1 is not installed"),
    "lib-mismatch": (
        "4xA40,init=lib_rm_version_mismatch",
        "driver/library version mismatch (userspace upgraded, kernel module not reloaded)",
    ),
    "no-permission": (
        "4xA40,noperm=1+2+3",
        "cgroup-restricted: 4 GPUs counted, only GPU 0 accessible",
    ),
    "mig": ("1xA100,mig=0", "an A100 split into seven 1g.5gb MIG instances"),
    "old-driver": ("2xV100,old", "an old driver without the _v2/_v3 NVML symbols"),
    "pending-remap": ("4xA100-80GB,remap=3", "GPU 3 has a pending row remap: reset required"),
    "wedged": ("4xA40,wedged=1", "GPU 1 reports 100 % utilisation with nothing running"),
}


def _canonical(name: str) -> str | None:
    """The scenario a name means, or None."""
    return name if name in SCENARIOS else None


def scenario(name: str) -> Fleet:
    """The named scenario's fleet."""
    key = _canonical(name)
    if key is None:
        raise FleetSpecError(f"{name!r} is not a scenario; scenarios: {', '.join(SCENARIOS)}")
    spec, description = SCENARIOS[key]
    fleet = replace(parse_spec(spec), name=name, description=description)
    if key == "shared-sweeps":
        fleet = _with_sweep_runs(fleet)
    return fleet


def _with_sweep_runs(fleet: Fleet) -> Fleet:
    """A box shared by two sweep runs, each rank seeing its own CUDA_VISIBLE_DEVICES."""
    gpus = list(fleet.gpus)
    runs = (("my_sweep.run1", "0,1", (0, 1)), ("my_sweep.run2", "2,3", (2, 3)))
    pid = FICTIONAL_PID_BASE + 100
    for run_name, cvd, indices in runs:
        for local_rank, index in enumerate(indices):
            observed = ObservedProcess(
                state="running",
                user="sweep",
                command=f"python tools/train.py run={run_name} local_rank={local_rank}",
                visible_devices=cvd,
            )
            proc = SimProcess(pid=pid, used_bytes=31 * 1024 * MIB, observed=observed)
            gpus[index] = replace(
                gpus[index],
                processes=(proc,),
                utilization_gpu_pct=97,
                power_w=610.0,
                temperature_c=71,
            )
            pid += 1
    return replace(fleet, gpus=tuple(gpus))


# --------------------------------------------------------------------------- JSON


def _with_position_defaults(gpu: dict[str, Any], position: int) -> dict[str, Any]:
    defaults = {
        "index": position,
        "uuid": _uuid_for(f"json/{position}"),
        "pci_bus_id": _bus_id(position),
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


def load_fleet(source: str, *, cwd: Path | None = None) -> Fleet:
    """Resolve ``NBGPU_SIMULATE``: a scenario name, a ``.json`` path, or a spec."""
    text = source.strip()
    if _canonical(text) is not None:
        return scenario(text)
    head, _, extra = text.partition(",")
    key = _canonical(head)
    if key is not None:
        # A scenario with more options: "busy-gpu0,procs=8" extends the scenario's spec.
        spec, description = SCENARIOS[key]
        return replace(parse_spec(f"{spec},{extra}"), name=text, description=description)
    path = Path(text).expanduser()
    if cwd is not None and not path.is_absolute():
        path = cwd / path
    try:
        is_file = path.is_file()
    except OSError:  # a long spec is not a valid file name (ENAMETOOLONG)
        is_file = False
    if text.endswith(".json") or is_file:
        try:
            raw = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise FleetSpecError(f"fleet file {text!r} does not exist") from None
        except OSError as exc:
            raise FleetSpecError(f"fleet file {text!r} cannot be read: {exc.strerror}") from None
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise FleetSpecError(
                f"fleet file {text!r} is not valid JSON (line {exc.lineno}, column {exc.colno}: "
                f"{exc.msg})"
            ) from None
        return fleet_from_dict(data, default_name=path.name)
    try:
        return parse_spec(text)
    except FleetSpecError as exc:
        if "," not in text and "x" not in text.lower():
            raise FleetSpecError(
                f"NBGPU_SIMULATE={text!r} is not a scenario, a fleet file or a spec; scenarios: "
                f"{', '.join(SCENARIOS)}"
            ) from None
        raise exc from None
