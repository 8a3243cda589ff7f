"""Fleets: what ``NBGPU_SIMULATE`` names, as a GPU box described as data (``box.py``).

A fleet is what ``nbgpu status --json`` writes on a real machine; ``NBGPU_SIMULATE``
names one as a JSON file, a named fleet (``busy-gpu0``: a file of ``fleets/`` in the same
format), a cluster file (one fleet per node under ``"nodes"``, as ``nbgpu status --slurm
--json`` writes; a process plays the node :func:`nbgpu.devices.sim.simulated_node` names)
or a short spec: a count and a GPU model from real captures, then options that inject
each failure mode the simulator knows (``8xH100,busy=0,load=60``; a named fleet takes the
same options: ``busy-gpu0,procs=8``). A process on a simulated GPU is *live* (looked up
on this machine: tests stand real processes in as holders) or *recorded* (its
``observed`` record says what was seen where the fleet was captured). Reads the one file
named; imports neither pynvml nor psutil.
"""

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, cast

from nbgpu._serial import from_data
from nbgpu.devices.model import (
    FLEET_FORMAT,
    INIT_ERRORS,
    InitError,
    MigDevice,
    ObservedProcess,
    ProcessRecord,
    ProcessState,
    RemappedRows,
    cluster_nodes,
    is_cluster,
)
from nbgpu.devices.sim.box import Fleet, SimGpu
from nbgpu.errors import FleetSpecError, UserInputError, user_path
from nbgpu.sizes import parse_size

__all__ = ["FICTIONAL_PID_BASE", "MODELS", "SCENARIOS", "fleet_from_dict", "load_fleet",
           "parse_spec"]  # fmt: skip

MIB = 1024 * 1024


@dataclass(frozen=True)
class _GpuModel:
    """An idle board of one GPU model, from real captures (reference/nvidia.md §9.1)."""

    name: str
    memory_total_bytes: int
    memory_reserved_bytes: int
    power_limit_w: float
    power_w: float
    temperature_c: int
    compute_capability: tuple[int, int]
    pci_device_id: int
    datacenter: bool = False  # Ampere datacenter and newer: MIG and row remapping

    def gpu(self, key: str, index: int) -> SimGpu:
        """GPU *index* of a spec's box of this model (*key* in :data:`MODELS`)."""
        facts = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "datacenter"}
        dc = self.datacenter
        return SimGpu(
            index=index,
            uuid=_uuid_for(f"{key}/{index}"),
            pci_bus_id=_bus_id_for(index),
            **facts,
            mig_enabled=False if dc else None,
            remapped_rows=RemappedRows(0, 0, pending=False, failure=False) if dc else None,
            retired_pages_pending=None if dc else False,
        )


MODELS: Mapping[str, _GpuModel] = {
    "A40": _GpuModel("NVIDIA A40", 46068 * MIB, 0, 300.0, 31.0, 38, (8, 6), 0x223510DE),
    "A100": _GpuModel("NVIDIA A100-SXM4-40GB", 40960 * MIB, 518 * MIB, 400.0, 49.7, 33, (8, 0), 0x20B010DE, datacenter=True),
    "A100-80GB": _GpuModel("NVIDIA A100-SXM4-80GB", 81920 * MIB, 518 * MIB, 400.0, 52.0, 34, (8, 0), 0x20B210DE, datacenter=True),
    "H100": _GpuModel("NVIDIA H100 80GB HBM3", 81559 * MIB, 480 * MIB, 700.0, 68.9, 29, (9, 0), 0x233010DE, datacenter=True),
    "H200": _GpuModel("NVIDIA H200", 143771 * MIB, 480 * MIB, 700.0, 75.0, 30, (9, 0), 0x233510DE, datacenter=True),
    "L40S": _GpuModel("NVIDIA L40S", 46068 * MIB, 0, 350.0, 28.0, 33, (8, 9), 0x26B910DE),
    "T4": _GpuModel("Tesla T4", 15360 * MIB, 0, 70.0, 10.0, 37, (7, 5), 0x1EB810DE),
    "A10G": _GpuModel("NVIDIA A10G", 23028 * MIB, 0, 300.0, 25.0, 30, (8, 6), 0x223710DE),
    "RTX4090": _GpuModel("NVIDIA GeForce RTX 4090", 24564 * MIB, 0, 450.0, 21.5, 35, (8, 9), 0x268410DE),
    "V100": _GpuModel("Tesla V100-SXM2-16GB", 16152 * MIB, 0, 300.0, 40.0, 35, (7, 0), 0x1DB110DE),
}  # fmt: skip

# A100-40GB 1g.5gb profile: 4864 MiB each, at most 7 (NVIDIA MIG user guide, table 12).
_MIG_1G_BYTES = 4864 * MIB

# What ``old`` makes of a fleet: a driver before R470-ish, without the versioned NVML
# symbols (pynvml then raises FunctionNotFound and nbgpu falls back to the old calls).
_OLD_DRIVER: Mapping[str, Any] = {
    "driver_version": "450.80.02",
    "cuda_driver_version": 11000,
    "nvml_version": "11.450.80.02",
    "missing_functions": frozenset({
        "nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlDeviceGetGraphicsRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v2",
        "nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetMigMode",
    }),
}  # fmt: skip


def _uuid5(name: str) -> str:
    # Deterministic UUIDs: the same spec always gives the same fleet, so tests and
    # notebooks can name GPUs by UUID. Imported here: a fleet file that names its GPUs'
    # UUIDs (every capture) never needs the module (a few ms of `nbgpu status`).
    import uuid  # noqa: PLC0415

    return str(uuid.uuid5(uuid.NAMESPACE_URL, name))


def _uuid_for(key: str) -> str:
    return f"GPU-{_uuid5('nbgpu:' + key)}"


def _bus_id_for(index: int) -> str:
    # Spread over buses like a real 8-GPU board; NVML's 8-hex-digit domain form.
    return f"00000000:{0x18 + 0x10 * index:02X}:00.0"


def fleet_from_dict(data: Any, *, default_name: str = "fleet.json") -> Fleet:
    """A decoded fleet JSON document as a Fleet, read by the model's own types (a GPU's
    index, UUID and bus id default from its position); errors name the field."""
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
        # What a capture could not read is null (a lost GPU's UUID, name and size).
        data = {**data, "gpus": [_with_position_defaults(g, i) for i, g in enumerate(gpus)]}
    return from_data(
        Fleet, {"name": default_name, **data}, prefix="fleet JSON", error=FleetSpecError
    )


def _with_position_defaults(gpu: Any, position: int) -> Any:
    if not isinstance(gpu, dict):
        return gpu  # from_data names what is wrong with it
    defaults: dict[str, Callable[[], object]] = {
        "index": lambda: position,
        "uuid": lambda: _uuid_for(f"json/{position}"),
        "pci_bus_id": lambda: _bus_id_for(position),
    }
    unread = {"name": "Unknown GPU", "memory_total_bytes": 0}
    filled = {k: make() for k, make in defaults.items() if gpu.get(k) is None}
    filled |= {k: v for k, v in unread.items() if k in gpu and gpu[k] is None}
    return {**gpu, **filled}


_FLEETS_DIR = Path(__file__).with_name("fleets")

#: The named fleets, from the files (their descriptions are read with the fleet).
SCENARIOS: tuple[str, ...] = tuple(sorted(p.stem for p in _FLEETS_DIR.glob("*.json")))


def load_fleet(source: str, *, node: str | None = None) -> Fleet:
    """Resolve ``NBGPU_SIMULATE``: a scenario name, a ``.json`` path, or a spec (*node*: the
    node this process plays, for a cluster file)."""
    text = source.strip()
    head, comma, extra = text.partition(",")
    if head in SCENARIOS:
        path = _FLEETS_DIR / f"{head}.json"
        fleet = fleet_from_dict(json.loads(path.read_text(encoding="utf-8")), default_name=head)
        if not comma:
            return fleet
        options = [part.strip() for part in extra.split(",")]
        return replace(apply_options(fleet, options, spec=text), name=text)
    path = user_path(text)
    try:
        is_file = path.is_file()
    except OSError:  # a long spec is not a valid file name (ENAMETOOLONG)
        is_file = False
    if text.endswith(".json") or is_file:
        return _fleet_file(path, text, node)
    try:
        return parse_spec(text)
    except FleetSpecError as exc:
        if "," not in text and "x" not in text.lower():
            raise FleetSpecError(
                f"NBGPU_SIMULATE={text!r} is not a scenario, a fleet file or a spec; scenarios: "
                f"{', '.join(SCENARIOS)}"
            ) from None
        raise exc from None


def _fleet_file(path: Path, text: str, node: str | None) -> Fleet:
    try:  # a byte that is not UTF-8 reads as U+FFFD: in a string it is kept, else named
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except FileNotFoundError:
        raise FleetSpecError(f"fleet file {text!r} does not exist") from None
    except OSError as exc:
        raise FleetSpecError(f"fleet file {text!r} cannot be read: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise FleetSpecError(
            f"fleet file {text!r} is not valid JSON (line {exc.lineno}, column {exc.colno}: "
            f"{exc.msg})"
        ) from None
    if not is_cluster(data):
        return fleet_from_dict(data, default_name=path.name)
    nodes = cluster_nodes(data, f"fleet file {text!r}")
    if node not in nodes:
        raise FleetSpecError(
            f"fleet file {text!r} describes nodes {', '.join(nodes)}; this process is on "
            f"{node!r} (SLURMD_NODENAME, NBGPU_NODE or the host name)"
        )
    return fleet_from_dict(nodes[node], default_name=f"{path.name}:{node}")


_SPEC_HEAD = re.compile(r"^(?:(\d+)\s*[xX\u00d7]\s*)?([A-Za-z0-9-]+)$")  # 4xA40, 4×A40
_SPEC_HELP = (
    "expected NxMODEL[,key=value...] such as '4xA40' or '8xH100,busy=0', "
    "or a scenario name, or a path to a fleet .json file"
)
# Synthetic pid base for fictional holders: above Linux's PID_MAX_LIMIT (2**22),
# so no real process on any machine can have it.
FICTIONAL_PID_BASE = 4_200_000

# Options that set fields of the GPUs they name.
_GPU_FIELDS: Mapping[str, Mapping[str, Any]] = {
    "exclusive": {"compute_mode": "exclusive_process"},
    "prohibited": {"compute_mode": "prohibited"},
    "lost": {"fault": "lost"},
    "noperm": {"fault": "no_permission"},
    "remap": {"remapped_rows": RemappedRows(0, 1, pending=True, failure=False)},
    "wedged": {"utilization_gpu_pct": 100, "memory_used_bytes": 0, "processes": ()},
}
# Options that add a recorded holder in this state to the GPUs they name.
_HOLDERS: Mapping[str, ProcessState] = {
    "busy": "dead",
    "zombie": "zombie",
    "otherns": "other_namespace",
}


def parse_spec(spec: str) -> Fleet:
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
      old           driver too old for the _v2/_v3 NVML symbols"""
    text = spec.strip()
    if not text:
        raise FleetSpecError(f"fleet spec is empty; {_SPEC_HELP}")
    head, *options = [part.strip() for part in text.split(",")]
    m = _SPEC_HEAD.match(head)
    if not m:
        raise FleetSpecError(f"fleet spec {spec!r}: cannot read {head!r}; {_SPEC_HELP}")
    count = int(m.group(1) or 1)
    wanted = m.group(2).upper().replace("_", "-")
    model_key = next((key for key in MODELS if key.upper() == wanted), None)
    if model_key is None:
        raise FleetSpecError(
            f"fleet spec {spec!r}: unknown GPU model {m.group(2)!r}; expected one of "
            f"{', '.join(MODELS)}"
        )
    if not 1 <= count <= 64:
        raise FleetSpecError(f"fleet spec {spec!r}: {count} GPUs; expected 1 to 64")
    model = MODELS[model_key]
    gpus = tuple(model.gpu(model_key, i) for i in range(count))
    fleet = Fleet(gpus=gpus, name=text, description=f"simulated {count}x {model.name}")
    return apply_options(fleet, options, spec=text)


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


def apply_options(fleet: Fleet, options: Sequence[str], *, spec: str) -> Fleet:  # noqa: PLR0915
    """*fleet* with a spec's or a named scenario's options (see :func:`parse_spec`); added
    processes get fictional pids above every pid the fleet already holds."""
    count = len(fleet.gpus)
    held = [p.pid for gpu in fleet.gpus for p in gpu.processes]
    next_pid = max([FICTIONAL_PID_BASE - 1, *held]) + 1

    def add(idx: int, proc: ProcessRecord) -> None:
        gpus[idx] = replace(gpus[idx], processes=(*gpus[idx].processes, proc))

    for option in options:
        key, sep, value = option.partition("=")
        key, value = key.strip().lower(), value.strip()
        if key == "old" and not sep:
            fleet = replace(fleet, **_OLD_DRIVER)
            continue
        if not sep or not value:
            raise FleetSpecError(f"fleet spec {spec!r}: option {option!r} needs key=value")
        gpus = list(fleet.gpus)
        if key in _GPU_FIELDS:
            for idx in _indices(key, value, count):
                gpus[idx] = replace(gpus[idx], **_GPU_FIELDS[key])
        elif key in _HOLDERS:
            state = _HOLDERS[key]
            for idx in _indices(key, value, count):
                if key == "busy":
                    gpus[idx] = replace(gpus[idx], compute_mode="exclusive_process")
                command = None if state == "dead" else "python -m sglang.launch_server"
                observed = ObservedProcess(state, command=command)
                used = min(29000 * MIB, gpus[idx].memory_total_bytes // 2)
                add(idx, ProcessRecord(next_pid, used, observed=observed))
                next_pid += 1
        elif key == "holder":
            for item in value.split("+"):
                gpu_text, _, pid_text = item.partition(":")
                if not pid_text.isdigit():
                    raise FleetSpecError(
                        f"fleet spec: holder={item!r}; expected holder=GPU:PID such as holder=0:1234"
                    )
                (idx,) = _indices("holder", gpu_text, count)
                add(idx, ProcessRecord(pid=int(pid_text), used_bytes=1024 * MIB))
        elif key == "mig":
            for idx in _indices(key, value, count):
                if not any(m.datacenter and m.name == gpus[idx].name for m in MODELS.values()):
                    raise FleetSpecError(
                        f"fleet spec: mig={idx} but {gpus[idx].name} does not support MIG "
                        "(use A100, A100-80GB, H100 or H200)"
                    )
                gpus[idx] = _with_mig(gpus[idx])
        elif key == "procs":
            if not value.isdigit():
                raise FleetSpecError(f"fleet spec: procs={value!r}; expected a whole number")
            for n in range(int(value)):
                command = f"python train.py --job {n}"
                observed = ObservedProcess("running", user="sim", command=command)
                add(n % count, ProcessRecord(next_pid, (512 + 64 * n) * MIB, observed=observed))
                next_pid += 1
        elif key == "used":
            gpu_text, _, size_text = value.partition(":")
            (idx,) = _indices("used", gpu_text, count)
            try:  # nbgpu's one size parser: 20G and 20GiB are 20 GiB, 20GB is 20·10⁹
                used = parse_size(size_text, f"fleet spec: used={gpu_text}:")
            except UserInputError as exc:
                raise FleetSpecError(str(exc)) from None
            gpus[idx] = replace(gpus[idx], memory_used_bytes=used)
        elif key == "driver":
            if not re.fullmatch(r"\d+\.\d+(\.\d+)?", value):
                raise FleetSpecError(f"fleet spec: driver={value!r}; expected e.g. 550.163.01")
            fleet = replace(fleet, driver_version=value, nvml_version=f"12.{value}")
        elif key == "cuda":
            cm = re.fullmatch(r"(\d+)\.(\d+)", value)
            if not cm:
                raise FleetSpecError(f"fleet spec: cuda={value!r}; expected e.g. 12.4")
            version = int(cm.group(1)) * 1000 + int(cm.group(2)) * 10
            fleet = replace(fleet, cuda_driver_version=version)
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


def _with_mig(gpu: SimGpu) -> SimGpu:
    children = tuple(
        MigDevice(
            uuid="MIG-" + _uuid5(f"{gpu.uuid}/mig/{i}"),
            name=f"{gpu.name} MIG 1g.5gb",
            memory_total_bytes=_MIG_1G_BYTES,
            gpu_instance_id=7 + i,
            compute_instance_id=0,
        )
        for i in range(7)
    )
    # Without privileges NVML cannot attribute memory per process under MIG.
    procs = tuple(replace(p, used_bytes=None) for p in gpu.processes)
    return replace(gpu, mig_enabled=True, mig_devices=children, processes=procs)
