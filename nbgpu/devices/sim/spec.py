"""What ``NBGPU_SIMULATE`` names, as a fleet: a spec, a named fleet, a fleet or cluster file.

The compact spec (``4xA40``, ``8xH100,busy=0,load=60``, ``1xA100,mig=0``) is a count and a
GPU model from the table of real captures (memory, power, compute capability), then
options that inject each failure mode the simulator knows; a named fleet takes the same
options (``busy-gpu0,procs=8``). A cluster file (what ``nbgpu status --slurm --json``
writes: one fleet per node under ``"nodes"``) is a fleet per node: each process plays the
node it is told it is on (``node``, from :func:`nbgpu.devices.sim.simulated_node`), so
every SLURM node of a test cluster on one machine sees its own GPUs.

Each mistake is one ``FleetSpecError`` line naming the value and what is accepted. Reads
the one file named; never touches NVML or processes.
"""

from __future__ import annotations

import json
import re
import uuid as uuidlib
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import cast

from nbgpu.devices.model import (
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
from nbgpu.devices.sim.fleet import (
    MIB,
    MIG_1G_BYTES,
    MODELS,
    OLD_DRIVER_MISSING,
    SCENARIOS,
    ComputeMode,
    Fleet,
    GpuModel,
    SimGpu,
    bus_id_for,
    fleet_from_dict,
    scenario,
    scenario_key,
    uuid_for,
)
from nbgpu.errors import FleetSpecError, UserInputError
from nbgpu.sizes import parse_size

__all__ = ["FICTIONAL_PID_BASE", "apply_options", "load_fleet", "parse_spec"]


def load_fleet(source: str, *, cwd: Path | None = None, node: str | None = None) -> Fleet:
    """Resolve ``NBGPU_SIMULATE``: a scenario name, a ``.json`` path, or a spec.

    *node*: the node this process plays, for a cluster file (one fleet per node).
    """
    text = source.strip()
    if scenario_key(text) is not None:
        return scenario(text)
    head, _, extra = text.partition(",")
    key = scenario_key(head)
    if key is not None:
        # A scenario with more options: "busy-gpu0,procs=8" adds them to the scenario.
        options = [part.strip() for part in extra.split(",")]
        return replace(apply_options(scenario(key), options, spec=text), name=text)
    path = Path(text).expanduser()
    if cwd is not None and not path.is_absolute():
        path = cwd / path
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
    if not is_cluster(data):
        return fleet_from_dict(data, default_name=path.name)
    nodes = cluster_nodes(data, f"fleet file {text!r}")
    if node not in nodes:
        raise FleetSpecError(
            f"fleet file {text!r} describes nodes {', '.join(nodes)}; this process is on "
            f"{node!r} (SLURMD_NODENAME, NBGPU_NODE or the host name)"
        )
    return fleet_from_dict(nodes[node], default_name=f"{path.name}:{node}")


def _make_gpu(model_key: str, model: GpuModel, index: int) -> SimGpu:
    return SimGpu(
        index=index,
        name=model.name,
        uuid=uuid_for(f"{model_key}/{index}"),
        pci_bus_id=bus_id_for(index),
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
    return apply_options(fleet, options, spec=text)


def apply_options(fleet: Fleet, options: Sequence[str], *, spec: str) -> Fleet:  # noqa: PLR0915
    """*fleet* with the spec's options applied (``busy=0``, ``lost=3``...); see parse_spec.

    Also how a named scenario takes extra options: ``busy-gpu0,procs=8``. Processes added
    here get fictional pids above every pid the fleet already holds.
    """
    count = len(fleet.gpus)
    held = [p.pid for gpu in fleet.gpus for p in gpu.processes]
    next_pid = max([FICTIONAL_PID_BASE - 1, *held]) + 1
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
                holder = ProcessRecord(
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
                proc = ProcessRecord(pid=int(pid_text), used_bytes=1024 * MIB)
                gpus[idx] = replace(gpus[idx], processes=(*gpus[idx].processes, proc))
        elif key == "lost":
            for idx in _indices(key, value, count):
                gpus[idx] = replace(gpus[idx], fault="lost")
        elif key == "noperm":
            for idx in _indices(key, value, count):
                gpus[idx] = replace(gpus[idx], fault="no_permission")
        elif key == "mig":
            for idx in _indices(key, value, count):
                if not any(m.mig_capable and m.name == gpus[idx].name for m in MODELS.values()):
                    raise FleetSpecError(
                        f"fleet spec: mig={idx} but {gpus[idx].name} does not support MIG "
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
                proc = ProcessRecord(
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
