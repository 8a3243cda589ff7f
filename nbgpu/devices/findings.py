"""The doctor's findings on one GPU, and the GPU's health word in the status table.

Each rule looks at one GPU (or one process holding it) and may give a :class:`Problem`:
a severity, a sentence that names the GPU, pid and mode involved, and concrete fixes.
:func:`assess_gpu` runs the table of rules; :func:`gpu_health` condenses the findings to
the short word of the status and doctor tables ("BUSY: dead holder", "in use", "ok").
``doctor.py`` adds machine-wide findings. Pure functions over model types: no I/O here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from nbgpu._render import fmt_bytes
from nbgpu.devices.model import Gpu, GpuProcess
from nbgpu.problems import SEVERITY_ORDER, Problem

__all__ = ["assess_gpu", "gpu_health"]
MIB = 1024 * 1024
# Real drivers keep a few hundred MiB per context that no process is charged for;
# only a remainder well above that is worth a warning.
GHOST_THRESHOLD_BYTES = 1024 * MIB


@dataclass(frozen=True)
class _Seen:
    """One GPU as the rules see it, with the words several rules share."""

    gpu: Gpu
    gpu_count: int | None

    @property
    def i(self) -> int:
        return self.gpu.nvml_index

    @property
    def subject(self) -> str:
        return f"GPU {self.i}"

    @property
    def exclusive(self) -> bool:
        return self.gpu.compute_mode in ("exclusive_process", "exclusive_thread")

    @property
    def mode_text(self) -> str:
        return (
            "exclusive-process"
            if self.gpu.compute_mode == "exclusive_process"
            else "exclusive-thread"
        )

    @property
    def exclude(self) -> str:
        """The fix that works for any bad GPU: leave it out of jobs."""
        total = self.gpu_count
        if total is None or total <= 1:
            return "use another machine: this is the only GPU"
        others = ",".join(str(i) for i in range(total) if i != self.i)
        return (
            f"leave GPU {self.i} out of jobs (e.g. `%%torchrun --gpus {others}`; without --gpus, "
            "%%torchrun leaves unhealthy GPUs out by itself)"
        )

    def finding(self, severity: str, code: str, message: str, *fixes: str) -> Problem:
        return Problem(severity, code, self.subject, message, fixes)


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


def _recorded(proc: GpuProcess) -> str:
    return " (as recorded in the fleet file)" if proc.holder and proc.holder.recorded else ""


# --------------------------------------------------------------- a GPU NVML cannot read
# The first rule that matches is the only finding: nothing else about the GPU is known.


def _lost(g: _Seen) -> Problem | None:
    if g.gpu.error != "lost":
        return None
    return g.finding(
        "bad",
        "gpu_lost",
        f"GPU {g.i} has fallen off the bus or is otherwise inaccessible (NVML: GPU is "
        "lost, typically Xid 79).",
        "look for Xid 79 in the kernel log: `sudo dmesg | grep -i xid`",
        "reboot or power-cycle the node; if it recurs, drain it and ask for an RMA",
        g.exclude,
    )


def _no_permission(g: _Seen) -> Problem | None:
    if g.gpu.error != "no_permission":
        return None
    return g.finding(
        "bad",
        "no_permission",
        f"GPU {g.i} is counted by the driver but this process may not open it "
        "(NVML: Insufficient Permissions) — typical of a container or SLURM job "
        "whose cgroup only grants some /dev/nvidia* devices.",
        "inside SLURM, request the GPUs with --gres=gpu:N; in Docker use --gpus all "
        "(or --device /dev/nvidiaN)",
        g.exclude,
    )


def _nvml_error(g: _Seen) -> Problem | None:
    if g.gpu.error is None:
        return None
    return g.finding("bad", "nvml_error", f"NVML could not read GPU {g.i}: {g.gpu.error}")


_UNREADABLE: tuple[Callable[[_Seen], Problem | None], ...] = (_lost, _no_permission, _nvml_error)


# ------------------------------------------------------- one rule per holder state


def _dead_holder(g: _Seen, proc: GpuProcess) -> Problem | None:
    i = g.i
    if g.exclusive:
        return g.finding(
            "bad",
            "exclusive_dead_holder",
            f"GPU {i} is in {g.mode_text} mode and held by pid {proc.pid}, which no "
            f"longer exists{_recorded(proc)}: every new CUDA context fails with "
            "'CUDA-capable device(s) is/are busy or unavailable'.",
            f"find the real holder: `sudo fuser -v /dev/nvidia{i}` (or `sudo lsof "
            f"/dev/nvidia{i}`) and stop it; `nbgpu clean` does this for your own "
            "processes",
            f"reset the GPU once nothing uses it: `sudo nvidia-smi --gpu-reset -i {i}`",
            f"or allow sharing again: `sudo nvidia-smi -i {i} -c DEFAULT`",
            g.exclude,
        )
    return g.finding(
        "warn",
        "dead_holder",
        f"GPU {i} lists pid {proc.pid}, which no longer exists{_recorded(proc)}; its "
        f"{fmt_bytes(proc.used_bytes)} may stay allocated until the context is torn "
        "down.",
        f"`sudo fuser -v /dev/nvidia{i}` shows the process really holding it",
        f"`sudo nvidia-smi --gpu-reset -i {i}` once the GPU is idle",
    )


def _zombie_holder(g: _Seen, proc: GpuProcess) -> Problem | None:
    parent = proc.holder.ppid if proc.holder else None
    parent_text = f" (parent pid {parent})" if parent else ""
    return g.finding(
        "bad" if g.exclusive else "warn",
        "zombie_holder",
        f"GPU {g.i} is held by zombie pid {proc.pid}{parent_text}{_recorded(proc)}: the "
        "process exited but was never reaped, so its GPU context may not be released.",
        f"stop its parent{parent_text} so init reaps it; `nbgpu clean` lists it if "
        "the parent is a stale job of yours",
        f"if the parent is init: `sudo nvidia-smi --gpu-reset -i {g.i}` or reboot",
        *((g.exclude,) if g.exclusive else ()),
    )


def _other_namespace_holder(g: _Seen, proc: GpuProcess) -> Problem | None:
    return g.finding(
        "warn",
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
        "warn",
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


def _holders(g: _Seen) -> Iterator[Problem]:
    for proc in g.gpu.processes:
        rule = _BY_HOLDER_STATE.get(proc.state)
        found = rule(g, proc) if rule else None
        if found is not None:
            yield found


# ------------------------------------------------------------- one rule per GPU fact


def _exclusive_mode(g: _Seen) -> Iterator[Problem]:
    if g.exclusive and not g.gpu.processes:
        yield g.finding(
            "info",
            "exclusive_mode",
            f"GPU {g.i} is in {g.mode_text} mode: one process at a time; give each rank its own "
            "GPU.",
        )


def _prohibited(g: _Seen) -> Iterator[Problem]:
    if g.gpu.compute_mode == "prohibited":
        yield g.finding(
            "bad",
            "prohibited",
            f"GPU {g.i} is in compute-prohibited mode: no CUDA context can be created on it.",
            f"`sudo nvidia-smi -i {g.i} -c DEFAULT`",
            g.exclude,
        )


def _remapped_rows(g: _Seen) -> Iterator[Problem]:
    rows = g.gpu.remapped_rows
    if rows is not None and rows.failure:
        yield g.finding(
            "bad",
            "remap_failure",
            f"GPU {g.i} failed to remap a memory row: its memory is unreliable.",
            "drain the node and contact your provider (RMA)",
            g.exclude,
        )
    elif rows is not None and rows.pending:
        yield g.finding(
            "bad",
            "reset_required",
            f"GPU {g.i} has a pending row remap ({rows.uncorrectable} uncorrectable): it needs "
            "a reset before it is reliable (Xid 63).",
            f"`sudo nvidia-smi --gpu-reset -i {g.i}` when idle, or reboot",
            g.exclude,
        )


def _retired_pages(g: _Seen) -> Iterator[Problem]:
    if g.gpu.retired_pages_pending:
        yield g.finding(
            "bad",
            "reset_required",
            f"GPU {g.i} has retired memory pages pending: reset it to apply them.",
            f"`sudo nvidia-smi --gpu-reset -i {g.i}` when idle, or reboot",
        )


def _ecc_errors(g: _Seen) -> Iterator[Problem]:
    if g.gpu.ecc_uncorrected_volatile:
        yield g.finding(
            "warn",
            "ecc_errors",
            f"GPU {g.i} reported {g.gpu.ecc_uncorrected_volatile} uncorrected ECC errors since "
            "the driver loaded.",
            "watch `nvidia-smi -q -d ECC`; if the count grows, drain the node",
        )


def _ghost_memory(g: _Seen) -> Iterator[Problem]:
    ghost = g.gpu.ghost_bytes
    if (
        ghost is not None
        and ghost > GHOST_THRESHOLD_BYTES
        # A holder in another namespace already explains memory nobody here accounts for.
        and not any(p.state == "other_namespace" for p in g.gpu.processes)
    ):
        yield g.finding(
            "warn",
            "ghost_memory",
            f"GPU {g.i} has {fmt_bytes(ghost)} in use that no listed process accounts for: a "
            "process in another PID namespace (container) or a leaked context.",
            f"`sudo fuser -v /dev/nvidia{g.i}` on the host names the holder",
        )


def _wedged(g: _Seen) -> Iterator[Problem]:
    gpu = g.gpu
    if gpu.utilization_gpu_pct == 100 and not gpu.processes and not gpu.memory_used_bytes:
        yield g.finding(
            "warn",
            "wedged",
            f"GPU {g.i} reports 100 % utilisation with no process and no memory in use: its "
            "counters may be frozen (a wedged GPU).",
            "run `nbgpu status --probe`; if the probe fails, reset the GPU",
        )


def _mig(g: _Seen) -> Iterator[Problem]:
    if g.gpu.mig_enabled:
        yield g.finding(
            "info",
            "mig",
            f"GPU {g.i} is in MIG mode with {len(g.gpu.mig_devices)} instances: a process sees "
            "one instance; select it by MIG UUID in CUDA_VISIBLE_DEVICES.",
        )


def _memory_full(g: _Seen) -> Iterator[Problem]:
    total, used = g.gpu.memory_total_bytes, g.gpu.memory_used_bytes
    if total and used is not None and used > 0.9 * total:
        yield g.finding(
            "warn",
            "memory_full",
            f"GPU {g.i} memory is {used / total:.0%} used ({fmt_bytes(used)} of "
            f"{fmt_bytes(total)}).",
        )


# In this order: findings of equal severity keep it (the sort below is stable).
_RULES: tuple[Callable[[_Seen], Iterator[Problem]], ...] = (
    _holders,
    _exclusive_mode,
    _prohibited,
    _remapped_rows,
    _retired_pages,
    _ecc_errors,
    _ghost_memory,
    _wedged,
    _mig,
    _memory_full,
)


def assess_gpu(gpu: Gpu, gpu_count: int | None = None) -> tuple[Problem, ...]:
    """All findings for one GPU, worst first."""
    seen = _Seen(gpu, gpu_count)
    for rule in _UNREADABLE:
        unreadable = rule(seen)
        if unreadable is not None:
            return (unreadable,)
    found = [finding for rule in _RULES for finding in rule(seen)]
    found.sort(key=lambda f: -SEVERITY_ORDER[f.severity])
    return tuple(found)


#: The health word a finding gives its GPU in the status and doctor tables.
_HEALTH = {
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


def gpu_health(gpu: Gpu, findings: tuple[Problem, ...]) -> tuple[str, str]:
    """(health word, level) for the status and doctor tables: the worst finding's word."""
    for finding in findings:
        if finding.severity in ("bad", "warn") and finding.code in _HEALTH:
            return _HEALTH[finding.code], finding.severity
    if gpu.processes:
        return "in use", "ok"
    return "ok", "ok"
