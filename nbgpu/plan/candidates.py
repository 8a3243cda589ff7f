"""Which GPUs of an inventory a plan may use, and why the others are left out.

A :class:`Candidate` is one GPU seen from the planner: usable or not, a *grade* (0: idle
and clean; 1: usable with caveats, for example shared with another process), the reasons
and the fixes the doctor gave. The finding rules stay in ``devices/findings.py``; this
module only sorts their findings into "may be given a role" and "may not":

- never usable: NVML cannot read the GPU (lost, no permission), a *bad* finding (busy with a
  dead holder in exclusive mode, prohibited, reset required ...), an exclusive-mode GPU
  held by a live process (CUDA refuses a second context), a failed CUDA probe, MIG mode
  (a process sees one instance, not the GPU);
- usable with caveats: every *warn* finding, and other processes sharing the GPU.

Pure: reads an ``Inventory`` snapshot, imports its type only for checking; never pynvml,
psutil, sockets or files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from nbgpu._render import fmt_bytes
from nbgpu.devices.findings import gpu_health

if TYPE_CHECKING:  # the inventory module pulls in psutil; planning only reads its data
    from nbgpu.devices.inventory import Inventory

__all__ = ["Candidate", "candidates_from_inventory"]

# A warn-level finding that still makes context creation fail: exclusive mode, live holder.
_BLOCKING_WARNINGS = frozenset({"exclusive_busy"})
# Unusable because of a holder or a mode: freeing the holder or a reset brings it back.
# Holders that keep memory but run nothing: not another job at work on the GPU.
_NOT_RUNNING = frozenset({"zombie", "dead"})
_RECOVERABLE = frozenset(
    {"exclusive_dead_holder", "zombie_holder", "exclusive_busy", "prohibited", "reset_required"}
)


@dataclass(frozen=True)
class Candidate:
    """One GPU as the planner sees it."""

    nvml_index: int
    uuid: str | None
    name: str | None
    memory_total_bytes: int | None
    memory_free_bytes: int | None
    usable: bool
    grade: int  # 0 clean, 1 usable with caveats, 2 unusable
    health: str  # the GPU's health, as the status table says it: "ok", "BUSY: dead holder"
    reasons: tuple[str, ...] = ()  # why unusable, or the caveats of a usable GPU
    fixes: tuple[str, ...] = ()
    recoverable: bool = False  # unusable only until a holder is freed or the GPU reset
    other_processes: int = 0  # processes of other jobs running on it now
    utilization_pct: int | None = None  # GPU utilisation when the snapshot was taken

    @property
    def in_use(self) -> bool:
        """Other jobs run on it: a run placed here shares its compute and memory."""
        return self.other_processes > 0

    @property
    def available_bytes(self) -> int | None:
        """Memory a new process can have: free if known, else total."""
        if self.memory_free_bytes is not None:
            return self.memory_free_bytes
        return self.memory_total_bytes

    @property
    def label(self) -> str:
        name = (self.name or "GPU").replace("NVIDIA ", "")
        return f"GPU {self.nvml_index} ({name}, {fmt_bytes(self.memory_total_bytes)})"


def candidates_from_inventory(inventory: Inventory) -> tuple[Candidate, ...]:
    """Every GPU of the snapshot, in NVML order, sorted into usable or not."""
    failed_probe = {}
    if inventory.probe is not None:
        failed_probe = {
            r.nvml_index: r
            for r in inventory.probe.results
            if r.outcome != "ok" and r.nvml_index is not None
        }
    out = []
    for gpu, findings in zip(inventory.gpus, inventory.findings, strict=True):
        health, _ = gpu_health(gpu, findings)
        blocking = [f for f in findings if f.severity == "bad" or f.code in _BLOCKING_WARNINGS]
        probe = failed_probe.get(gpu.nvml_index)
        usable, recoverable = False, False
        fixes: tuple[str, ...] = ()
        if blocking or not gpu.ok:
            reasons = tuple(f.message for f in blocking) or (f"NVML error: {gpu.error}",)
            fixes = tuple(fix for f in blocking for fix in f.fixes)
            recoverable = gpu.ok and all(f.code in _RECOVERABLE for f in blocking)
        elif probe is not None:
            health = f"probe: {probe.outcome}"
            reasons = (
                f"GPU {gpu.nvml_index} failed the CUDA probe ({probe.outcome}): {probe.message}",
            )
            fixes = ("`nbgpu doctor` names the holder and the fix",)
            recoverable = probe.outcome == "busy"
        elif gpu.mig_enabled:
            health = "MIG mode"
            why = (
                f"GPU {gpu.nvml_index} is in MIG mode: a process sees one MIG instance, not the "
                "whole GPU, and plans assign whole GPUs"
            )
            reasons = (why,)
            fixes = (f"`sudo nvidia-smi -i {gpu.nvml_index} -mig 0` when it is idle",)
        else:
            usable = True
            caveats = [f.message for f in findings if f.severity == "warn"]
            if gpu.processes and not caveats:
                used = sum(p.used_bytes or 0 for p in gpu.processes)
                caveats.append(
                    f"GPU {gpu.nvml_index} is shared with {len(gpu.processes)} other "
                    f"process(es) using {fmt_bytes(used)}"
                )
            reasons = tuple(caveats)
        out.append(
            Candidate(
                nvml_index=gpu.nvml_index,
                uuid=gpu.uuid,
                name=gpu.name,
                memory_total_bytes=gpu.memory_total_bytes,
                memory_free_bytes=gpu.memory_free_bytes,
                usable=usable,
                grade=(1 if reasons else 0) if usable else 2,
                health=health,
                reasons=reasons,
                fixes=fixes,
                recoverable=recoverable,
                other_processes=sum(1 for p in gpu.processes if p.state not in _NOT_RUNNING),
                utilization_pct=gpu.utilization_gpu_pct,
            )
        )
    return tuple(out)
