"""The doctor: one report with each GPU's health, the findings and their fixes.

An inventory (probed unless told not to), plus what no single GPU shows: NVML/driver
failures, what the probe confirmed, the launch environment (:data:`DIST_VARS`,
``CUDA_VISIBLE_DEVICES``) against the visible, healthy GPUs, and how many ranks to launch
on which GPUs. Pure logic over the inventory, and one socket bind to test a port.
"""

import errno
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nbgpu._render import Blank, Block, Line, Problems, Result, Title
from nbgpu.devices.inventory import Inventory, take_inventory
from nbgpu.faces import launch_hint
from nbgpu.problems import SEVERITY_ORDER, Problem, worst

__all__ = ["DIST_VARS", "DoctorReport", "run_doctor"]

#: The distributed-launch variables the doctor reports (set or unset).
DIST_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "NPROC_PER_NODE",
)  # fmt: skip

_NVML_FIXES: Mapping[int, tuple[str, tuple[str, ...]]] = {
    12: (
        "No NVIDIA driver library (libnvidia-ml.so.1) on this machine: CUDA is not available.",
        (
            "on a GPU machine install the NVIDIA driver (e.g. `sudo apt install nvidia-driver-550`)",
            "in Docker, start the container with the NVIDIA runtime: `docker run --gpus all ...`",
            "no GPU here? try nbgpu on a simulated fleet: `NBGPU_SIMULATE=4xA40 nbgpu doctor`",
        ),
    ),
    9: (
        "The NVIDIA kernel driver is not loaded: CUDA is not available.",
        (
            "load it: `sudo modprobe nvidia` (check with `lsmod | grep nvidia`)",
            "after a kernel update, rebuild the module: `sudo dkms autoinstall`, then reboot",
            "make sure nouveau is blacklisted if it holds the card",
        ),
    ),
    18: (
        (
            "Driver/library version mismatch: the NVIDIA userspace library was upgraded but the "
            "running kernel module is older (nvidia-smi: 'Failed to initialize NVML: Driver/library "
            "version mismatch')."
        ),
        (
            (
                "reboot, or reload the module when no process uses the GPUs: "
                "`sudo rmmod nvidia_uvm nvidia_drm nvidia_modeset nvidia && sudo modprobe nvidia`"
            ),
        ),
    ),
    4: (
        "NVML refused access (Insufficient Permissions).",
        (
            "check the permissions of /dev/nvidia* (`ls -l /dev/nvidia*`)",
            "in a container or SLURM job, request the GPUs (--gpus all, --gres=gpu:N)",
        ),
    ),
}


@dataclass(frozen=True)
class DoctorReport(Result):
    """What ``nbgpu.doctor()`` returns."""

    FRAME_COLUMNS = ("severity", "code", "subject", "message", "fixes")

    inventory: Inventory
    findings: tuple[Problem, ...]  # machine-wide and per-GPU, worst first
    environment: Mapping[str, str | None]
    recommendation: str | None

    @property
    def ok(self) -> bool:
        return not any(f.severity == "bad" for f in self.findings)

    def simulated_fleet(self) -> str | None:
        return self.inventory.simulated_fleet()

    @property
    def worst(self) -> str:
        return worst(self.findings)

    def _summary(self) -> str:
        inv = self.inventory
        if inv.nvml_error:
            return "CUDA available: no (NVML unusable)"
        probe, probe_text = inv.probe, ""
        if probe is not None and probe.init_error:
            probe_text = f"; probe: {probe.init_error}"
        elif probe is not None:
            good = sum(r.ok for r in probe.results)
            probe_text = f"; probe: {good} of {len(probe.results)} contexts created"
        visible = len(inv.visible.devices) if inv.visible is not None else len(inv.gpus)
        healthy = len(inv.healthy_indices)
        line = (
            f"CUDA available: {'yes' if healthy else 'no usable GPU'} "
            f"({len(inv.gpus)} GPUs, {visible} visible, {healthy} healthy{probe_text})"
        )
        if len(line) > 80:  # the probe summary goes on its own line
            line = line.replace("; probe: ", ")\n  probe: ").removesuffix(")")
        return line

    def _env_line(self) -> str:
        set_vars = " ".join(f"{k}={v}" for k, v in self.environment.items() if v is not None)
        unset = " ".join(k for k, v in self.environment.items() if v is None)
        unset = f"{'unset' if set_vars else 'all unset'}: {unset}" if unset else ""
        return "; ".join(part for part in (set_vars, unset) if part)

    def content(self) -> list[Block]:
        inv = self.inventory
        blocks: list[Block] = [
            Title(inv.headline("nbgpu doctor"), simulated=inv.simulated),
            Line(self._summary(), wrap=False),
            Blank(),
        ]
        if inv.gpus:
            blocks += [inv.gpu_table(), *inv.details(), Blank()]
        blocks.append(Line(self._env_line(), label="Distributed environment"))
        blocks += [Blank(), Problems(self.findings, title="Findings:")]
        if self.recommendation:
            blocks += [Blank(), Line(self.recommendation, label="Recommendation")]
        return blocks

    def records(self) -> list[dict[str, Any]]:
        return [f.to_dict() for f in self.findings]

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "worst": self.worst,
            "findings": [f.to_dict() for f in self.findings],
            "environment": dict(self.environment),
            "recommendation": self.recommendation,
            "inventory": self.inventory.to_dict(),
        }


def _nvml_finding(inventory: Inventory) -> Problem:
    code = inventory.nvml_error_code
    if code is not None and code in _NVML_FIXES:
        message, fixes = _NVML_FIXES[code]
    elif code == 999 and inventory.container.in_container:
        message = (
            "NVML failed with 'Unknown Error' inside a container: the container has most likely "
            "lost access to /dev/nvidia* (systemd rewrote its cgroup device rules after a "
            "daemon-reload; nvidia-container-toolkit issue 48)."
        )
        fixes = ("recreate the container", "on the host, check `nvidia-smi` works")
    else:
        message = f"NVML is unusable: {inventory.nvml_error}"
        fixes = ("check `nvidia-smi` and `sudo dmesg | grep -i nvrm` for driver errors",)
    return Problem("bad", "nvml_unavailable", "driver", message, fixes)


def _probe_findings(inventory: Inventory) -> list[Problem]:
    probe = inventory.probe
    if probe is None:
        return []
    out: list[Problem] = []
    if probe.timed_out:
        message = "The CUDA probe did not finish in time: a GPU or the driver may be hung."
        hung = ("look for Xid errors: `sudo dmesg | grep -i xid`", "reset the GPU or reboot")
        out.append(Problem("bad", "probe_timeout", "driver", message, hung))
    elif probe.init_error and not inventory.nvml_error:
        message = f"CUDA could not initialise: {probe.init_error}"
        out.append(Problem("bad", "cuda_init", "driver", message))
    # A GPU with a bad finding of its own already explains why CUDA refuses it.
    explained = {
        g.nvml_index
        for g, fs in zip(inventory.gpus, inventory.findings, strict=True)
        if any(f.severity == "bad" for f in fs)
    }
    for r in (r for r in probe.results if not r.ok):
        where = f"GPU {r.nvml_index}" if r.nvml_index is not None else f"cuda:{r.cuda_index}"
        fails = f"{where} (cuda:{r.cuda_index}) fails with {r.message} "
        fails += f"({r.error_name or 'CUDA error'} {r.cuda_error})"
        fixes: tuple[str, ...] = ()
        if r.nvml_index in explained:
            message = f"The probe confirms it: a CUDA context on {fails}."
        else:
            message = (
                f"Creating a CUDA context on {fails}, and NVML shows nothing that explains it: "
                "a holder in another container, or a bad driver state."
            )
            fixes = (
                f"`sudo fuser -v /dev/nvidia{r.nvml_index}` on the host names the holder"
                if r.nvml_index is not None
                else "run `nvidia-smi` on the host",
                "reset the GPU when idle (`sudo nvidia-smi --gpu-reset -i N`) or reboot",
            )
        out.append(Problem("bad", f"probe_{r.outcome}", where, message, fixes))
    return out


def _env_problem(severity: str, code: str, message: str, *fixes: str) -> Problem:
    return Problem(severity, code, "environment", message, fixes)


def _int_env(environ: Mapping[str, str], key: str, out: list[Problem]) -> int | None:
    raw = environ.get(key)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        fix = f"`unset {key}` or set it to a number"
        out.append(_env_problem("bad", "bad_env", f"{key}={raw!r} is not a whole number.", fix))
        return None
    if value < 0:
        out.append(_env_problem("bad", "bad_env", f"{key}={value} is negative."))
        return None
    return value


def _port_in_use(host: str, port: int) -> bool:
    # Binding is the only reliable test: connect() says nothing about TIME_WAIT etc.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host if host not in ("localhost", "") else "127.0.0.1", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def _environment_findings(
    inventory: Inventory, environ: Mapping[str, str], nproc: int | None, face: str
) -> list[Problem]:
    if inventory.nvml_error:
        return []
    visible = inventory.visible.devices if inventory.visible is not None else ()
    n_visible = len(visible)
    healthy = set(inventory.healthy_indices)
    n_healthy = len([d for d in visible if d.nvml_index in healthy])
    problems = inventory.visible.problems if inventory.visible is not None else ()
    out = [Problem("warn", "visible_devices", "CUDA_VISIBLE_DEVICES", p) for p in problems]
    if inventory.gpus and n_visible == 0:
        raw = inventory.visible.raw if inventory.visible is not None else None
        message = f"CUDA_VISIBLE_DEVICES={raw!r} hides every GPU: CUDA will report no device."
        fix = "`unset CUDA_VISIBLE_DEVICES`, or list GPUs by index or UUID (e.g. 0,1)"
        out.append(Problem("bad", "nothing_visible", "CUDA_VISIBLE_DEVICES", message, (fix,)))
    wanted = nproc if nproc is not None else _int_env(environ, "NPROC_PER_NODE", out)
    source = "nproc" if nproc is not None else "NPROC_PER_NODE"
    if wanted is not None and wanted > n_visible:
        usable = n_healthy or n_visible
        out.append(
            _env_problem(
                "bad",
                "nproc_exceeds_gpus",
                f"{source}={wanted} but {n_visible} GPUs are visible: ranks {n_visible}.."
                f"{wanted - 1} would fail with 'CUDA error: invalid device ordinal'.",
                f"launch {usable} ranks (`{launch_hint(face)}` sizes nproc from the healthy "
                "GPUs when you give no number)",
                f"or `export NPROC_PER_NODE={usable}`",
            )
        )
    elif wanted is not None and wanted > n_healthy:
        message = (
            f"{source}={wanted} but only {n_healthy} of the {n_visible} visible GPUs are healthy."
        )
        fix = "fix the GPUs flagged above, or launch fewer ranks on the healthy ones"
        out.append(_env_problem("warn", "nproc_exceeds_healthy", message, fix))
    local_rank = _int_env(environ, "LOCAL_RANK", out)
    if local_rank is not None and local_rank >= n_visible:
        message = (
            f"local_rank {local_rank} >= {n_visible} visible devices: "
            f"torch.cuda.set_device({local_rank}) fails with 'invalid device ordinal'."
        )
        fix = "launch at most one rank per visible GPU; check CUDA_VISIBLE_DEVICES per job"
        out.append(_env_problem("bad", "local_rank_exceeds_gpus", message, fix))
    rank = _int_env(environ, "RANK", out)
    world = _int_env(environ, "WORLD_SIZE", out)
    if rank is not None and world is not None and rank >= world:
        message = f"RANK={rank} but WORLD_SIZE={world}: ranks are 0..{world - 1}."
        out.append(_env_problem("bad", "rank_exceeds_world", message))
    port, host = environ.get("MASTER_PORT"), environ.get("MASTER_ADDR", "127.0.0.1")
    if port and (not port.isdigit() or not 0 < int(port) < 65536):
        message = f"MASTER_PORT={port!r} is not a port number (1-65535)."
        out.append(_env_problem("bad", "bad_env", message))
    elif port and rank in (None, 0) and _port_in_use(host, int(port)):
        message = (
            f"MASTER_PORT={port} is already in use on this machine: a new rendezvous "
            "there fails with 'address already in use' (another run on this box)."
        )
        fix = "unset MASTER_PORT and let nbgpu pick a free port, or choose another one"
        out.append(_env_problem("warn", "port_in_use", message, fix))
    return out


def _recommend(inventory: Inventory, findings: list[Problem], face: str) -> str | None:
    if inventory.nvml_error or not inventory.gpus:
        return None
    visible = inventory.visible.devices if inventory.visible is not None else ()
    healthy = set(inventory.healthy_indices)
    use = [d.nvml_index for d in visible if d.nvml_index in healthy]
    if not use:
        return "no healthy visible GPU: fix the findings above before launching."
    if len(use) == len(inventory.gpus) and not any(f.severity == "bad" for f in findings):
        return (
            f"all {len(use)} GPUs are usable: launch {len(use)} ranks "
            f"(`{launch_hint(face, len(use))}`)."
        )
    gpus = ",".join(str(i) for i in use)
    return (
        f"launch {len(use)} ranks on GPUs {gpus}: `{launch_hint(face, len(use), gpus=gpus)}` or "
        f"`CUDA_VISIBLE_DEVICES={gpus} torchrun --nproc-per-node {len(use)} ...`"
    )


def run_doctor(
    environ: Mapping[str, str] | None = None,
    *,
    probe: bool = True,
    nproc: int | None = None,
    probe_timeout_s: float = 30.0,
    face: str = "notebook",
) -> DoctorReport:
    """Inventory + probe + environment checks → one report (``nbgpu.doctor()``)."""
    env = dict(os.environ) if environ is None else dict(environ)
    inventory = take_inventory(env, probe=probe, probe_timeout_s=probe_timeout_s)
    findings: list[Problem] = []
    if inventory.nvml_error:
        findings.append(_nvml_finding(inventory))
    elif not inventory.gpus:
        fix = "check `nvidia-smi -L`; in a container pass --gpus all"
        message = "The driver is loaded but reports no GPU."
        findings.append(Problem("bad", "no_gpu", "driver", message, (fix,)))
    findings.extend(f for gpu_findings in inventory.findings for f in gpu_findings)
    findings.extend(_probe_findings(inventory))
    findings.extend(_environment_findings(inventory, env, nproc, face))
    if inventory.container.in_container and not inventory.container.host_pid_namespace:
        message = (
            "Inside a container without the host PID namespace: the pids NVML reports are "
            "host pids, so a 'missing' pid is not necessarily dead."
        )
        fix = "run with --pid=host to see and manage host processes"
        findings.append(_env_problem("info", "container", message, fix))
    if not any(f.severity in ("bad", "warn") for f in findings):
        message = f"All {len(inventory.gpus)} GPUs look healthy."
        findings.append(Problem("ok", "healthy", "machine", message))
    findings.sort(key=lambda f: -SEVERITY_ORDER[f.severity])
    environment = {k: env.get(k) for k in DIST_VARS}
    recommendation = _recommend(inventory, findings, face)
    return DoctorReport(inventory, tuple(findings), environment, recommendation)
