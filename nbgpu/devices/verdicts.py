"""Per-GPU verdicts: from an inventory row to "what is wrong and what to do".

Each rule looks at one GPU (and who holds it) and yields :class:`Finding` objects
with a severity, a sentence that names the GPU, pid and mode involved, and concrete
fixes. ``doctor.py`` adds machine-wide findings; ``inventory.py`` shows the short
verdict in the status table. Pure functions over model types: no I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass

from nbgpu._render import fmt_bytes
from nbgpu.devices.model import Gpu, GpuProcess

__all__ = ["SEVERITY_ORDER", "Finding", "assess_gpu", "short_verdict"]

SEVERITY_ORDER = {"ok": 0, "info": 1, "warn": 2, "bad": 3}
MIB = 1024 * 1024
# Real drivers keep a few hundred MiB per context that no process is charged for;
# only a remainder well above that is worth a warning.
GHOST_THRESHOLD_BYTES = 1024 * MIB


@dataclass(frozen=True)
class Finding:
    """One thing the doctor wants the user to know."""

    severity: str  # ok | info | warn | bad
    code: str  # stable id, e.g. "exclusive_dead_holder"
    subject: str  # "GPU 0", "environment", "driver"
    message: str
    fixes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, object]:
        return {
            "severity": self.severity,
            "code": self.code,
            "subject": self.subject,
            "message": self.message,
            "fixes": list(self.fixes),
        }


def _who(proc: GpuProcess) -> str:
    h = proc.holder
    if h is None:
        return f"pid {proc.pid}"
    parts = [f"pid {proc.pid}"]
    if h.user:
        parts.append(f"user {h.user}")
    if h.command:
        parts.append(repr(h.command[:60]))
    return ", ".join(parts)


def _others(gpu: Gpu, total: int | None) -> str:
    if total is None or total <= 1:
        return ""
    return ",".join(str(i) for i in range(total) if i != gpu.nvml_index)


def assess_gpu(  # noqa: PLR0915  (one flat rule after another, in severity order)
    gpu: Gpu, gpu_count: int | None = None
) -> tuple[Finding, ...]:
    """All findings for one GPU, worst first."""
    i = gpu.nvml_index
    subject = f"GPU {i}"
    others = _others(gpu, gpu_count)
    exclude = (
        f"leave GPU {i} out of jobs (e.g. `%%torchrun --gpus {others}`; without --gpus, "
        "%%torchrun leaves unhealthy GPUs out by itself)"
        if others
        else "use another machine: this is the only GPU"
    )
    found: list[Finding] = []
    if gpu.error == "lost":
        found.append(
            Finding(
                "bad",
                "gpu_lost",
                subject,
                f"GPU {i} has fallen off the bus or is otherwise inaccessible (NVML: GPU is "
                "lost, typically Xid 79).",
                (
                    "look for Xid 79 in the kernel log: `sudo dmesg | grep -i xid`",
                    "reboot or power-cycle the node; if it recurs, drain it and ask for an RMA",
                    exclude,
                ),
            )
        )
        return tuple(found)
    if gpu.error == "no_permission":
        found.append(
            Finding(
                "bad",
                "no_permission",
                subject,
                f"GPU {i} is counted by the driver but this process may not open it "
                "(NVML: Insufficient Permissions) — typical of a container or SLURM job "
                "whose cgroup only grants some /dev/nvidia* devices.",
                (
                    (
                        "inside SLURM, request the GPUs with --gres=gpu:N; in Docker use --gpus all "
                        "(or --device /dev/nvidiaN)"
                    ),
                    exclude,
                ),
            )
        )
        return tuple(found)
    if gpu.error is not None:
        found.append(
            Finding("bad", "nvml_error", subject, f"NVML could not read GPU {i}: {gpu.error}")
        )
        return tuple(found)

    exclusive = gpu.compute_mode in ("exclusive_process", "exclusive_thread")
    mode_text = (
        "exclusive-process" if gpu.compute_mode == "exclusive_process" else "exclusive-thread"
    )
    for proc in gpu.processes:
        verdict = proc.verdict
        recorded = (
            " (as recorded in the fleet file)" if proc.holder and proc.holder.recorded else ""
        )
        if verdict == "dead":
            if exclusive:
                found.append(
                    Finding(
                        "bad",
                        "exclusive_dead_holder",
                        subject,
                        f"GPU {i} is in {mode_text} mode and held by pid {proc.pid}, which no "
                        f"longer exists{recorded}: every new CUDA context fails with "
                        "'CUDA-capable device(s) is/are busy or unavailable'.",
                        (
                            (
                                f"find the real holder: `sudo fuser -v /dev/nvidia{i}` (or `sudo lsof "
                                f"/dev/nvidia{i}`) and stop it; `nbgpu clean` does this for your own "
                                "processes"
                            ),
                            f"reset the GPU once nothing uses it: `sudo nvidia-smi --gpu-reset -i {i}`",
                            f"or allow sharing again: `sudo nvidia-smi -i {i} -c DEFAULT`",
                            exclude,
                        ),
                    )
                )
            else:
                found.append(
                    Finding(
                        "warn",
                        "dead_holder",
                        subject,
                        f"GPU {i} lists pid {proc.pid}, which no longer exists{recorded}; its "
                        f"{fmt_bytes(proc.used_bytes)} may stay allocated until the context is torn "
                        "down.",
                        (
                            f"`sudo fuser -v /dev/nvidia{i}` shows the process really holding it",
                            f"`sudo nvidia-smi --gpu-reset -i {i}` once the GPU is idle",
                        ),
                    )
                )
        elif verdict == "zombie":
            parent = proc.holder.ppid if proc.holder else None
            parent_text = f" (parent pid {parent})" if parent else ""
            found.append(
                Finding(
                    "bad" if exclusive else "warn",
                    "zombie_holder",
                    subject,
                    f"GPU {i} is held by zombie pid {proc.pid}{parent_text}{recorded}: the "
                    "process exited but was never reaped, so its GPU context may not be released.",
                    (
                        (
                            f"stop its parent{parent_text} so init reaps it; `nbgpu clean` lists it if "
                            "the parent is a stale job of yours"
                        ),
                        f"if the parent is init: `sudo nvidia-smi --gpu-reset -i {i}` or reboot",
                    )
                    + ((exclude,) if exclusive else ()),
                )
            )
        elif verdict == "other_namespace":
            found.append(
                Finding(
                    "warn",
                    "other_namespace_holder",
                    subject,
                    f"GPU {i} is used by pid {proc.pid}, which is not in this PID namespace"
                    f"{recorded}: we are inside a container and NVML reports host pids. It may be "
                    "alive on the host (another container or user).",
                    (
                        "check on the host: `nvidia-smi` there shows the owner of this pid",
                        "run the container with --pid=host to see host processes here",
                    )
                    + ((exclude,) if exclusive else ()),
                )
            )
        elif verdict in ("alive", "stopped", "no_access") and exclusive:
            found.append(
                Finding(
                    "warn",
                    "exclusive_busy",
                    subject,
                    f"GPU {i} is in {mode_text} mode and in use by {_who(proc)}: no other process "
                    "can create a CUDA context on it until that one exits.",
                    (
                        "wait for it, or stop it if it is yours (`%gpu_stop` for nbgpu runs)",
                        exclude,
                    ),
                )
            )
    if exclusive and not gpu.processes:
        found.append(
            Finding(
                "info",
                "exclusive_mode",
                subject,
                f"GPU {i} is in {mode_text} mode: one process at a time; give each rank its own GPU.",
            )
        )
    if gpu.compute_mode == "prohibited":
        found.append(
            Finding(
                "bad",
                "prohibited",
                subject,
                f"GPU {i} is in compute-prohibited mode: no CUDA context can be created on it.",
                (f"`sudo nvidia-smi -i {i} -c DEFAULT`", exclude),
            )
        )
    rows = gpu.remapped_rows
    if rows is not None and rows.failure:
        found.append(
            Finding(
                "bad",
                "remap_failure",
                subject,
                f"GPU {i} failed to remap a memory row: its memory is unreliable.",
                ("drain the node and contact your provider (RMA)", exclude),
            )
        )
    elif rows is not None and rows.pending:
        found.append(
            Finding(
                "bad",
                "reset_required",
                subject,
                f"GPU {i} has a pending row remap ({rows.uncorrectable} uncorrectable): it needs "
                "a reset before it is reliable (Xid 63).",
                (f"`sudo nvidia-smi --gpu-reset -i {i}` when idle, or reboot", exclude),
            )
        )
    if gpu.retired_pages_pending:
        found.append(
            Finding(
                "bad",
                "reset_required",
                subject,
                f"GPU {i} has retired memory pages pending: reset it to apply them.",
                (f"`sudo nvidia-smi --gpu-reset -i {i}` when idle, or reboot",),
            )
        )
    if gpu.ecc_uncorrected_volatile:
        found.append(
            Finding(
                "warn",
                "ecc_errors",
                subject,
                f"GPU {i} reported {gpu.ecc_uncorrected_volatile} uncorrected ECC errors since "
                "the driver loaded.",
                ("watch `nvidia-smi -q -d ECC`; if the count grows, drain the node",),
            )
        )
    ghost = gpu.ghost_bytes
    if (
        ghost is not None
        and ghost > GHOST_THRESHOLD_BYTES
        and not any(p.verdict == "other_namespace" for p in gpu.processes)
    ):
        found.append(
            Finding(
                "warn",
                "ghost_memory",
                subject,
                f"GPU {i} has {fmt_bytes(ghost)} in use that no listed process accounts for: a "
                "process in another PID namespace (container) or a leaked context.",
                (f"`sudo fuser -v /dev/nvidia{i}` on the host names the holder",),
            )
        )
    if gpu.utilization_gpu_pct == 100 and not gpu.processes and not gpu.memory_used_bytes:
        found.append(
            Finding(
                "warn",
                "wedged",
                subject,
                f"GPU {i} reports 100 % utilisation with no process and no memory in use: its "
                "counters may be frozen (a wedged GPU).",
                ("run `nbgpu status --probe`; if the probe fails, reset the GPU",),
            )
        )
    if gpu.mig_enabled:
        found.append(
            Finding(
                "info",
                "mig",
                subject,
                f"GPU {i} is in MIG mode with {len(gpu.mig_devices)} instances: a process sees "
                "one instance; select it by MIG UUID in CUDA_VISIBLE_DEVICES.",
            )
        )
    total, used = gpu.memory_total_bytes, gpu.memory_used_bytes
    if total and used is not None and used > 0.9 * total:
        found.append(
            Finding(
                "warn",
                "memory_full",
                subject,
                f"GPU {i} memory is {used / total:.0%} used ({fmt_bytes(used)} of {fmt_bytes(total)}).",
            )
        )
    found.sort(key=lambda f: -SEVERITY_ORDER[f.severity])
    return tuple(found)


_SHORT = {
    "gpu_lost": "LOST",
    "no_permission": "no access",
    "nvml_error": "NVML error",
    "exclusive_dead_holder": "BUSY: dead holder",
    "zombie_holder": "zombie holder",
    "other_namespace_holder": "held (other ns)",
    "exclusive_busy": "busy (exclusive)",
    "prohibited": "prohibited",
    "remap_failure": "remap failed",
    "reset_required": "reset required",
    "dead_holder": "dead holder",
    "ghost_memory": "ghost memory",
    "wedged": "wedged?",
    "ecc_errors": "ECC errors",
    "memory_full": "memory full",
}


def short_verdict(gpu: Gpu, findings: tuple[Finding, ...]) -> tuple[str, str]:
    """(short text, level) for the status table's health column."""
    for finding in findings:
        if finding.severity in ("bad", "warn") and finding.code in _SHORT:
            return _SHORT[finding.code], finding.severity
    if gpu.processes:
        return "in use", "ok"
    return "ok", "ok"
