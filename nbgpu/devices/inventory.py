"""The inventory: one snapshot of every GPU, who holds it, and what CUDA will see.

``take_inventory()`` joins NVML's view (``nvml.py``), the OS's view of each holder pid
(``holders.py``), the ``CUDA_VISIBLE_DEVICES`` mapping (``visible.py``), per-GPU findings
(``model.py``) and, opt-in, the CUDA probe (``health.py``). It serialises itself as a
*capture* (``nbgpu status --json``, by ``capture.py``); pandas only in ``to_frame``.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from nbgpu._render import (
    Blank,
    Block,
    Cell,
    Line,
    Pre,
    Result,
    Table,
    Title,
    fmt_bytes,
    fmt_opt,
    fmt_used_total,
)
from nbgpu._serial import read_json_object
from nbgpu.devices import holders as holders_mod
from nbgpu.devices import nvml
from nbgpu.devices.cuda_errors import cuda_version
from nbgpu.devices.holders import ContainerInfo, HolderInfo, recorded_holder
from nbgpu.devices.model import Gpu, GpuProcess, assess_gpu, gpu_health
from nbgpu.devices.visible import VisibleMap, gpu_identities, resolve_visible
from nbgpu.errors import NvmlError, user_path
from nbgpu.problems import Problem

if TYPE_CHECKING:  # the probe module loads only for --probe
    from nbgpu.devices.health import ProbeReport

__all__ = ["Inventory", "saved_inventory", "take_inventory"]


@dataclass(frozen=True)
class Inventory(Result):
    """What ``nbgpu.status()`` returns."""

    FRAME_COLUMNS = (
        "nvml_index", "name", "uuid", "pci_bus_id", "memory_total_bytes", "memory_used_bytes",
        "memory_free_bytes", "utilization_gpu_pct", "temperature_c", "power_w", "power_limit_w",
        "compute_mode", "processes", "health", "error", "simulated",
    )  # fmt: skip

    taken_at: float
    hostname: str
    simulated: bool
    fleet_name: str | None
    fleet_description: str | None
    container: ContainerInfo
    driver_version: str | None = None
    cuda_driver_version: int | None = None  # NVML's integer, 12040 = CUDA 12.4
    nvml_version: str | None = None
    nvml_error: str | None = None  # set when NVML is unusable; then gpus is empty
    nvml_error_code: int | None = None
    gpus: tuple[Gpu, ...] = ()
    findings: tuple[tuple[Problem, ...], ...] = ()  # per GPU, same order as gpus
    visible: VisibleMap | None = None
    visible_is_override: bool = False  # True when the user passed --env, not the environment
    device_files: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    # Who those /dev/nvidia* holders are, looked up when the snapshot was taken.
    device_file_holders: Mapping[int, HolderInfo] = field(default_factory=dict)
    probe: ProbeReport | None = None
    elapsed_ms: float = 0.0

    @property
    def healthy_indices(self) -> tuple[int, ...]:
        """NVML indices of GPUs with no bad finding (and a passing probe if probed)."""
        probed = self.probe.results if self.probe is not None else ()
        failed_probe = {r.nvml_index for r in probed if r.outcome != "ok"}
        return tuple(
            g.nvml_index
            for g, fs in zip(self.gpus, self.findings, strict=True)
            if g.ok
            and not any(f.severity == "bad" for f in fs)
            and g.nvml_index not in failed_probe
        )

    def simulated_fleet(self) -> str | None:
        return (self.fleet_name or "simulated") if self.simulated else None

    def headline(self, command: str = "nbgpu status") -> str:
        source = (
            f"SIMULATED fleet '{self.fleet_name}'" if self.simulated else f"host {self.hostname}"
        )
        parts = [f"{command} — {source}"]
        if self.driver_version:
            parts.append(f"driver {self.driver_version}")
        if self.cuda_driver_version is not None:
            parts.append(f"CUDA {cuda_version(self.cuda_driver_version)}")
        line = " · ".join(parts)
        if len(line) > 80:  # a long fleet spec: driver facts go on their own line
            line = parts[0] + "\n  " + " · ".join(parts[1:])
        return line

    def gpu_table(self) -> Table:
        table = Table(["GPU", "name", "memory", "util", "temp", "power", "mode", "health"])
        for gpu, findings in zip(self.gpus, self.findings, strict=True):
            health, level = gpu_health(gpu, findings)
            if self.probe is not None:
                probe = self.probe.for_nvml_index(gpu.nvml_index)
                if probe is not None and probe.outcome != "ok":
                    health, level = f"probe: {probe.outcome}", "bad"
            if not gpu.ok:
                table.add(gpu.nvml_index, "-", "-", "-", "-", "-", "-", health, level=level)
                continue
            name = (gpu.name or "?").replace("NVIDIA ", "")
            mem = fmt_used_total(gpu.memory_used_bytes, gpu.memory_total_bytes)
            power = fmt_opt(gpu.power_w, " W")
            if gpu.power_w is not None and gpu.power_limit_w is not None:
                power = f"{gpu.power_w:.0f}/{gpu.power_limit_w:.0f} W"
            mode = _MODES.get(gpu.compute_mode or "", fmt_opt(gpu.compute_mode))
            if gpu.mig_enabled:
                mode += " MIG"
            table.add(
                gpu.nvml_index,
                name,
                Cell(mem, bar=(gpu.memory_used_bytes, gpu.memory_total_bytes)),
                fmt_opt(gpu.utilization_gpu_pct, "%"),
                fmt_opt(gpu.temperature_c, "C"),
                power,
                mode,
                health,
                level=level,
            )
        return table

    def process_table(self) -> Table:
        table = Table(
            ["GPU", "pid", "user", "state", "up", "GPU mem", "its CUDA_VISIBLE_DEVICES", "command"],
            flex=7,
        )
        for gpu in self.gpus:
            for proc in gpu.processes:
                h = proc.holder
                state = proc.state + (" (recorded)" if h and h.recorded else "")
                table.add(
                    gpu.nvml_index,
                    proc.pid,
                    fmt_opt(h.user if h else None),
                    state,
                    _age(h.start_time if h else None, self.taken_at),
                    fmt_bytes(proc.used_bytes),
                    fmt_opt(h.visible_devices if h else None),
                    fmt_opt(h.command if h else None),
                    level=_STATE_LEVELS.get(proc.state, ""),
                )
        for pid, paths in sorted(self.device_files.items()):
            h = self.device_file_holders.get(pid) or recorded_holder(pid, "dead")
            table.add(
                "fd",
                pid,
                fmt_opt(h.user),
                "open " + ",".join(p.rsplit("/", 1)[-1] for p in paths),
                _age(h.start_time, self.taken_at),
                "-",
                fmt_opt(h.visible_devices),
                fmt_opt(h.command),
                level="warn",
            )
        return table

    def visible_lines(self) -> list[str]:
        if self.visible is None:
            return []
        origin = "--env" if self.visible_is_override else "this environment"
        raw = "unset" if self.visible.raw is None else repr(self.visible.raw)
        lines = [f"CUDA_VISIBLE_DEVICES={raw} ({origin}):"]
        if not self.visible.devices:
            lines.append("  no GPU is visible to CUDA")
        for dev in self.visible.devices:
            mig = f" MIG {dev.mig_uuid}" if dev.mig_uuid else ""
            lines.append(f"  cuda:{dev.cuda_index} -> GPU {dev.nvml_index} ({dev.uuid[:12]}){mig}")
        lines.extend(f"  ! {p}" for p in self.visible.problems)
        return lines

    def _notes(self) -> list[tuple[str, str]]:
        notes: list[tuple[str, str]] = []
        for gpu, findings in zip(self.gpus, self.findings, strict=True):
            notes.extend((f.severity, f.message) for f in findings if f.severity in ("bad", "warn"))
            if gpu.fallbacks:
                fallbacks = "; ".join(gpu.fallbacks)
                notes.append(("info", f"GPU {gpu.nvml_index}: old driver fallbacks: {fallbacks}"))
        if self.container.in_container and not self.container.host_pid_namespace:
            note = "inside a container without the host PID namespace: GPU pids are host pids"
            notes.append(("info", note))
        if self.probe is not None and self.probe.init_error:
            notes.append(("bad", f"probe: {self.probe.init_error}"))
        return notes

    def details(self) -> list[Block]:
        """What follows the GPU table: holders, the CUDA mapping (the doctor shows them too)."""
        blocks: list[Block] = []
        procs = self.process_table()
        if procs.rows:
            blocks += [Blank(), procs]
        visible = self.visible_lines()
        if visible:
            blocks += [Blank(), Pre("\n".join(visible))]
        return blocks

    def content(self) -> list[Block]:
        blocks: list[Block] = [Title(self.headline(), simulated=self.simulated)]
        if self.simulated and self.fleet_description:
            blocks.append(Line(f"({self.fleet_description})", indent="  "))
        if self.nvml_error:
            blocks.append(Line(f"NVML unavailable: {self.nvml_error}", level="bad"))
            blocks.append(Line("Run `nbgpu doctor` (`%gpu_doctor` in a notebook) for what to do."))
            return blocks
        blocks.append(self.gpu_table() if self.gpus else Line("No GPU found."))
        blocks += self.details()
        notes = self._notes()
        if notes:
            marks = {"bad": "!! ", "warn": "!  ", "info": "-  "}
            blocks.append(Blank())
            blocks += [Line(msg, indent=marks.get(sev, "-  "), level=sev) for sev, msg in notes]
        return blocks

    def records(self) -> list[dict[str, Any]]:
        return [
            {
                **{c: getattr(gpu, c) for c in _GPU_COLUMNS},
                "processes": len(gpu.processes),
                "health": gpu_health(gpu, findings)[0],
                "error": gpu.error,
                "simulated": self.simulated,
            }
            for gpu, findings in zip(self.gpus, self.findings, strict=True)
        ]

    def to_dict(self) -> dict[str, Any]:
        """The capture: a fleet file the simulator replays, plus what was observed here."""
        from nbgpu.devices.capture import write_capture  # noqa: PLC0415

        return write_capture({f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "inventory JSON") -> Inventory:
        """The capture :meth:`to_dict` wrote, as it was taken (no simulator)."""
        from nbgpu.devices.capture import read_capture  # noqa: PLC0415

        return cls(**read_capture(data, where))


_GPU_COLUMNS = Inventory.FRAME_COLUMNS[:12]
_STATE_LEVELS = {"dead": "bad", "zombie": "bad", "other_namespace": "warn"}
# nvidia-smi's words for the compute modes.
_MODES = {
    "exclusive_process": "E.Process",
    "exclusive_thread": "E.Thread",
    "prohibited": "Prohibited",
}


def _age(start_time: float | None, now: float) -> str:
    """How long a process has run: '45s', '12m', '3h', '2d' (its start time is in JSON)."""
    if start_time is None:
        return "-"
    seconds = max(0.0, now - start_time)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def saved_inventory(source: str) -> Inventory | None:
    """The inventory a ``nbgpu status --json`` file holds; None for any other *source* (a
    spec, a named fleet, a hand-written fleet file, a missing file: the simulator's to judge)."""
    path = source.strip()
    if not path.endswith(".json"):
        return None
    data = read_json_object(user_path(path))
    from nbgpu.devices.capture import is_capture  # noqa: PLC0415

    return Inventory.from_dict(data, where=f"inventory file {path!r}") if is_capture(data) else None


def probe_gpus(env: Mapping[str, str], gpus: Sequence[Gpu], timeout_s: float) -> ProbeReport:
    """The CUDA probe in *env*, tied back to *gpus* by GPU or MIG UUID (CUDA numbers its own)."""
    by_uuid = {g.uuid: g.nvml_index for g in gpus if g.uuid}
    by_uuid.update({m.uuid: g.nvml_index for g in gpus for m in g.mig_devices})
    from nbgpu.devices.health import probe_devices  # noqa: PLC0415

    return probe_devices(environ=env, timeout_s=timeout_s, nvml_index_by_uuid=by_uuid)


def take_inventory(
    environ: Mapping[str, str] | None = None,
    *,
    visible_devices: str | None = None,
    probe: bool = False,
    probe_timeout_s: float = 30.0,
    scan_device_files: bool = True,
) -> Inventory:
    """Snapshot the GPUs as *environ* (default ``os.environ``) sees them, cuda:N mapped for
    ``visible_devices`` if given (a ``CUDA_VISIBLE_DEVICES`` value), probed if asked."""
    started = time.perf_counter()
    env = dict(os.environ) if environ is None else dict(environ)
    container = holders_mod.detect_container()

    def taken(backend: nvml.Backend, gpus: list[Gpu], **facts: Any) -> Inventory:
        return Inventory(
            taken_at=time.time(),
            hostname=socket.gethostname(),
            simulated=backend.simulated,
            fleet_name=backend.fleet.name if backend.fleet else None,
            fleet_description=backend.fleet.description if backend.fleet else None,
            container=container,
            gpus=tuple(gpus),
            **facts,
            probe=probe_gpus(env, gpus, probe_timeout_s) if probe else None,
            elapsed_ms=(time.perf_counter() - started) * 1000,
        )

    try:
        snap = nvml.read_system(env)
    except NvmlError as exc:
        # Which fleet failed to initialise is the point of a simulated failure scenario.
        return taken(nvml.backend_for(env), [], nvml_error=str(exc), nvml_error_code=exc.code)
    parents: dict[int, holders_mod.ParentFacts] = {}
    gpus = [
        replace(
            g,
            processes=tuple(_with_holder(p, snap.backend, container, parents) for p in g.processes),
        )
        for g in snap.gpus
    ]
    cvd_env = env if visible_devices is None else {**env, "CUDA_VISIBLE_DEVICES": visible_devices}
    listed = {p.pid for g in gpus for p in g.processes} | {os.getpid()}
    scanned = holders_mod.device_file_holders() if scan_device_files else {}
    device_files = {pid: paths for pid, paths in scanned.items() if pid not in listed}
    return taken(
        snap.backend,
        gpus,
        driver_version=snap.driver_version,
        cuda_driver_version=snap.cuda_driver_version,
        nvml_version=snap.nvml_version,
        findings=tuple(assess_gpu(g, snap.device_count) for g in gpus),
        visible=resolve_visible(gpu_identities([g for g in gpus if g.ok]), cvd_env),
        visible_is_override=visible_devices is not None,
        device_files=device_files,
        device_file_holders={
            pid: holders_mod.describe_pid(pid, container=container, parents=parents)
            for pid in device_files
        },
    )


def _with_holder(
    proc: GpuProcess,
    backend: nvml.Backend,
    container: ContainerInfo,
    parents: dict[int, holders_mod.ParentFacts],
) -> GpuProcess:
    observed = backend.recorded_process(proc.pid)
    if observed is None:
        holder = holders_mod.describe_pid(proc.pid, container=container, parents=parents)
        return replace(proc, holder=holder)
    from nbgpu.devices.capture import observed_holder  # noqa: PLC0415

    return replace(proc, holder=observed_holder(proc.pid, observed))
