"""Facts from outside the logs, added to the root cause: this machine's GPUs, the run's
own records of its GPUs and memory, the node a rank ran on.

With an ``Inventory`` (``nbgpu.status()``, live or simulated) a found cause can say
"rank 0 -> cuda:0 -> physical GPU 0, exclusive-process, held by dead pid 4242" and give
the exact fix (``nbgpu clean``, ``%%torchrun --gpus 1,2,3``). A rank's GPU comes from
run.json (``gpus``, else ``cuda_visible_devices``, mapped exactly as CUDA maps it by
``nbgpu.devices.visible``), else from the inventory's own CUDA_VISIBLE_DEVICES view.
For a ``host_oom`` or ``cuda_oom`` root cause in a run directory with
``mem-rank*.jsonl``: the phase each failed rank died in, the node's ``MemAvailable``
at the last sample, and the measured case for ``--serial-imports`` when every rank
was importing at the node's peak (``nbgpu.profile.timeline.import_storm``).

The inventory is used through its attributes only: importing ``nbgpu.devices.inventory``
would pull psutil into the diagnose layer. Imports the standard library, the pure
``nbgpu.devices.visible`` and profile's reading side; never pynvml, psutil, torch or
IPython. Never raises on bad memory records: a diagnosis must not fail on its extras.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbgpu.devices.visible import VisibleMap, gpu_identities, resolve_visible
from nbgpu.diagnose.report import FoundCause
from nbgpu.diagnose.sources import RunInfo
from nbgpu.profile.report import memory_report
from nbgpu.profile.timeline import MemoryTimeline, import_storm

if TYPE_CHECKING:
    from nbgpu.devices.inventory import Inventory
    from nbgpu.devices.model import Gpu
    from nbgpu.problems import Problem

__all__ = ["add_facts", "describe_inventory", "gpu_for_rank", "memory_details"]

_GPU_CAUSES = ("cuda_busy", "cuda_oom", "illegal_access", "device_assert", "gpu_lost")
_OOM = ("host_oom", "cuda_oom")
_HOLDER_CODES = (
    "exclusive_dead_holder",
    "zombie_holder",
    "exclusive_busy",
    "prohibited",
    "other_namespace_holder",
    "dead_holder",
)
_MODES = {
    "exclusive_process": "exclusive-process",
    "exclusive_thread": "exclusive-thread",
    "prohibited": "prohibited",
    "default": "default mode",
}
_GIB = 1024**3
# Commands a concrete fix names with this machine's values; the generic fix naming the
# same command with placeholder values is then dropped.
_REFINED = ("nbgpu clean", "--gpus")


def describe_inventory(inventory: Inventory) -> str:
    """How the report names the inventory it used."""
    if inventory.simulated:
        return f"simulated fleet '{inventory.fleet_name or '?'}'"
    return f"host {inventory.hostname}"


def _visible_map(inventory: Inventory, run: RunInfo | None) -> VisibleMap | None:
    gpus = [g for g in inventory.gpus if g.error is None]
    if run is not None and run.cuda_visible_devices is not None and gpus:
        identities = gpu_identities(gpus)
        return resolve_visible(identities, {"CUDA_VISIBLE_DEVICES": run.cuda_visible_devices})
    visible = inventory.visible
    return visible if isinstance(visible, VisibleMap) else None


def _local_rank(rank: int, run: RunInfo | None) -> int:
    if run is not None:
        for r in run.ranks:
            if r.rank == rank and r.local_rank is not None:
                return r.local_rank
        if run.nproc:
            return rank % run.nproc
    return rank


def gpu_for_rank(
    rank: int, run: RunInfo | None, inventory: Inventory | None
) -> tuple[int, int] | None:
    """``(cuda ordinal, physical NVML index)`` of ``rank``'s GPU, when it can be known."""
    local = _local_rank(rank, run)
    if run is not None and run.gpus is not None:
        return (local, run.gpus[local]) if local < len(run.gpus) else None
    if inventory is not None:
        vmap = _visible_map(inventory, run)
        if vmap is not None:
            dev = vmap.physical(local)
            return (local, dev.nvml_index) if dev is not None else None
    return None


def _gpu(inventory: Inventory, index: int) -> tuple[Gpu | None, tuple[Problem, ...]]:
    for gpu, findings in zip(inventory.gpus, inventory.findings, strict=False):
        if gpu.nvml_index == index:
            return gpu, tuple(findings)
    return None, ()


def _holder_text(gpu: Gpu) -> str:
    for proc in gpu.processes:
        holder_state = proc.state
        holder = proc.holder
        who = f"pid {proc.pid}"
        if holder is not None and holder.user:
            who += f" (user {holder.user})"
        state = {"alive": "running", "other_namespace": "in another PID namespace"}.get(
            holder_state, holder_state
        )
        return f", held by {state} {who}"
    return ""


def _healthy_others(inventory: Inventory, bad: set[int]) -> list[int]:
    healthy = inventory.healthy_indices
    return [i for i in healthy if i not in bad]


def _busy(
    found: FoundCause, run: RunInfo | None, inventory: Inventory
) -> tuple[list[str], list[str]]:
    details: list[str] = []
    fixes: list[str] = []
    bad: set[int] = set()
    ranks = found.ranks or ((found.first_rank,) if found.first_rank is not None else ())
    stale = False
    for rank in ranks:
        where = gpu_for_rank(rank, run, inventory)
        if where is None:
            continue
        cuda, index = where
        gpu, findings = _gpu(inventory, index)
        if gpu is None:
            continue
        bad.add(index)
        mode = _MODES.get(gpu.compute_mode or "", "unknown mode")
        details.append(
            f"rank {rank} -> cuda:{cuda} -> physical GPU {index} ({mode}){_holder_text(gpu)}"
        )
        stale = stale or any(
            f.code in ("exclusive_dead_holder", "zombie_holder", "dead_holder") for f in findings
        )
    if not details:
        # No rank mapping: name the GPUs the inventory itself finds blocked.
        for gpu, findings in zip(inventory.gpus, inventory.findings, strict=False):
            codes = {f.code for f in findings}
            if codes & set(_HOLDER_CODES):
                bad.add(gpu.nvml_index)
                mode = _MODES.get(gpu.compute_mode or "", "unknown mode")
                details.append(f"GPU {gpu.nvml_index} ({mode}) is blocked{_holder_text(gpu)}")
                stale = stale or bool(
                    codes & {"exclusive_dead_holder", "zombie_holder", "dead_holder"}
                )
    if bad:
        listed = ",".join(map(str, sorted(bad)))
        if stale:
            fixes.append(
                f"free GPU {listed}: `nbgpu clean` (`%gpu_clean`) stops your stale holder; "
                f"if it is not yours, `sudo nvidia-smi --gpu-reset -i {listed}` once idle"
            )
        others = _healthy_others(inventory, bad)
        if others:
            fixes.append(
                f"or exclude it: `%%torchrun --gpus {','.join(map(str, others))}` "
                f"(`nbgpu run --gpus {','.join(map(str, others))}`)"
            )
    return details, fixes


def _ordinal(
    _found: FoundCause, run: RunInfo | None, inventory: Inventory
) -> tuple[list[str], list[str]]:
    vmap = _visible_map(inventory, run)
    if vmap is None:
        return [], []
    count = len(vmap.devices)
    setting = "unset" if vmap.raw is None else repr(vmap.raw)
    world = run.nproc if run is not None else None
    details = [
        f"CUDA sees {count} GPU{'s' if count != 1 else ''} here (CUDA_VISIBLE_DEVICES {setting})"
        + (f", but the run started {world} ranks per node" if world else "")
    ]
    healthy = list(inventory.healthy_indices)
    fixes = []
    if count:
        fixes.append(
            f"start at most {count} ranks per node: `%%torchrun {count}`"
            + (f" or `%%torchrun --gpus {','.join(map(str, healthy))}`" if healthy else "")
        )
    return details, fixes


def _oom(
    found: FoundCause, run: RunInfo | None, inventory: Inventory
) -> tuple[list[str], list[str]]:
    details = []
    rank = found.first_rank
    where = gpu_for_rank(rank, run, inventory) if rank is not None else None
    if where is None:
        return [], []
    _, index = where
    gpu, _ = _gpu(inventory, index)
    if gpu is None:
        return [], []
    total = gpu.memory_total_bytes
    if total:
        details.append(f"rank {rank} ran on GPU {index} with {total / _GIB:.1f} GiB")
    for proc in gpu.processes:
        used = proc.used_bytes
        if used:
            details.append(
                f"GPU {index} now holds {used / _GIB:.1f} GiB for pid {proc.pid} "
                f"({proc.state}): memory this run could not use"
            )
    return details, []


def _lost(
    _found: FoundCause, _run: RunInfo | None, inventory: Inventory
) -> tuple[list[str], list[str]]:
    lost = [g.nvml_index for g in inventory.gpus if g.error == "lost"]
    if not lost:
        return [], []
    others = _healthy_others(inventory, set(lost))
    fixes = (
        [
            f"leave it out until the node is rebooted: `%%torchrun --gpus {','.join(map(str, others))}`"
        ]
        if others
        else []
    )
    return [f"NVML reports GPU {', '.join(map(str, lost))} lost on this machine"], fixes


def _driver(
    _found: FoundCause, _run: RunInfo | None, inventory: Inventory
) -> tuple[list[str], list[str]]:
    error = inventory.nvml_error
    return ([f"NVML on this machine: {error}"], []) if error else ([], [])


_ENRICHERS = {
    "cuda_busy": _busy,
    "invalid_ordinal": _ordinal,
    "cuda_oom": _oom,
    "gpu_lost": _lost,
    "driver": _driver,
}


def _inventory_facts(
    causes: Sequence[FoundCause], run: RunInfo | None, inventory: Inventory
) -> tuple[FoundCause, ...]:
    out = list(causes)
    if not out or not out[0].root:
        return tuple(out)
    enricher = _ENRICHERS.get(out[0].cause)
    if enricher is None:
        return tuple(out)
    details, fixes = enricher(out[0], run, inventory)
    if details or fixes:
        root = out[0]
        # A concrete fix ("exclude it: --gpus 1,2,3") replaces the generic one it refines.
        generic = tuple(
            f
            for f in root.fixes
            if not any(m in f and any(m in c for c in fixes) for m in _REFINED)
        )
        out[0] = replace(root, details=(*root.details, *details), fixes=(*fixes, *generic))
    return tuple(out)


def _gib(value: float) -> str:
    return f"{value / _GIB:.2f} GiB"


def memory_details(run_dir: Path) -> tuple[str, ...]:
    """Lines to add to an OOM cause (empty without memory records)."""
    try:
        report = memory_report(run_dir)
    except Exception:  # noqa: BLE001  (a diagnosis must never fail on its extras)
        return ()
    if not report.ranks:
        return ()
    lines = [f"{label} died in phase '{path}' (memory records)" for label, path in report.deaths()]
    last = _last_sample(report)
    if last is not None:
        label, sample = last
        avail = sample.get("avail")
        if isinstance(avail, int):
            total = f" of {_gib(report.mem_total_bytes)}" if report.mem_total_bytes else ""
            phase = next(r for r in report.ranks if r.label == label).phase_at(sample["t"])
            where = f", {label} in '{phase}'" if phase else ""
            lines.append(f"node MemAvailable at the last sample: {_gib(avail)}{total}{where}")
    storm = import_storm(report)
    if storm:
        lines.append(storm)
    return tuple(lines)


def _last_sample(report: MemoryTimeline) -> tuple[str, dict[str, Any]] | None:
    best: tuple[str, dict[str, Any]] | None = None
    for rank in report.ranks:
        for point in report.points(rank)[-1:]:
            if best is None or point["t"] > best[1]["t"]:
                best = (rank.label, point)
    return best


def add_facts(
    causes: tuple[FoundCause, ...], run: RunInfo | None, inventory: Inventory | None
) -> tuple[FoundCause, ...]:
    """The causes found, with what the logs do not say added to the root cause."""
    root = causes[0] if causes and causes[0].root else None
    if inventory is not None:
        causes = _inventory_facts(causes, run, inventory)
    elif root is not None and root.cause in _GPU_CAUSES and root.first_rank is not None:
        where = gpu_for_rank(root.first_rank, run, None)
        if where is not None:
            line = f"rank {root.first_rank} ran on cuda:{where[0]} = physical GPU {where[1]} (run.json)"
            causes = (replace(root, details=(*root.details, line)), *causes[1:])
    if run is not None and causes and causes[0].root and causes[0].cause in _OOM:
        extra = memory_details(run.path)
        if extra:
            causes = (replace(causes[0], details=(*causes[0].details, *extra)), *causes[1:])
    if run is not None and run.nodes:
        # A run over several nodes: each cause names where its first rank ran.
        causes = tuple(
            replace(c, first_node=run.nodes.get(c.first_rank)) if c.first_rank is not None else c
            for c in causes
        )
    return causes
