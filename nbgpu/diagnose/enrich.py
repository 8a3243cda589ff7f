"""What the logs do not say, added to the root cause (:func:`add_facts`).

With an ``Inventory`` it names "rank 0 -> cuda:0 -> physical GPU 0, exclusive-process, held
by dead pid 4242" and the exact fix; a rank's GPU comes from run.json (``gpus``, else
``cuda_visible_devices`` mapped as CUDA maps it), else from the inventory's own view. An OOM
with memory records adds the phase each rank died in, the node's ``MemAvailable`` at the
last sample and the measured case for ``--serial-imports``. The inventory is used through
its attributes only (importing ``nbgpu.devices.inventory`` would pull psutil in).
"""

from __future__ import annotations

import ast
import re
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from nbgpu.devices.visible import VisibleMap, gpu_identities, resolve_visible
from nbgpu.diagnose.report import FoundCause
from nbgpu.diagnose.sources import RunInfo
from nbgpu.diagnose.specifics import nearest
from nbgpu.profile.records import gib, import_storm
from nbgpu.profile.report import memory_report

if TYPE_CHECKING:
    from nbgpu.devices.inventory import Inventory
    from nbgpu.devices.model import Gpu
    from nbgpu.problems import Problem

__all__ = ["add_facts", "describe_inventory", "memory_details"]

# -- this machine's GPUs ---------------------------------------------------------------

_GPU_CAUSES = ("cuda_busy", "cuda_oom", "illegal_access", "device_assert", "gpu_lost")
_STALE = {"exclusive_dead_holder", "zombie_holder", "dead_holder"}
_BLOCKED = {*_STALE, "exclusive_busy", "prohibited", "other_namespace_holder"}
_MODES = {"exclusive_process": "exclusive-process", "exclusive_thread": "exclusive-thread",
          "prohibited": "prohibited", "default": "default mode"}  # fmt: skip
_STATE_WORDS = {"alive": "running", "other_namespace": "in another PID namespace"}
# Commands a concrete fix names with this machine's values; the generic fix naming the
# same command with placeholder values is then dropped.
_REFINED = ("nbgpu clean", "--gpus")
Facts = tuple[list[str], list[str]]  # (details, fixes)


def describe_inventory(inventory: Inventory) -> str:
    if inventory.simulated:
        return f"simulated fleet '{inventory.fleet_name or '?'}'"
    return f"host {inventory.hostname}"


def _visible_map(inventory: Inventory, run: RunInfo | None) -> VisibleMap | None:
    gpus = [g for g in inventory.gpus if g.error is None]
    if run is not None and run.cuda_visible_devices is not None and gpus:
        visible = {"CUDA_VISIBLE_DEVICES": run.cuda_visible_devices}
        return resolve_visible(gpu_identities(gpus), visible)
    return inventory.visible if isinstance(inventory.visible, VisibleMap) else None


def _gpu_for_rank(
    rank: int, run: RunInfo | None, inventory: Inventory | None
) -> tuple[int, int] | None:
    """``(cuda ordinal, physical NVML index)`` of ``rank``'s GPU, when it can be known."""
    local = rank
    if run is not None:
        local = next(
            (r.local_rank for r in run.ranks if r.rank == rank and r.local_rank is not None),
            rank % run.nproc if run.nproc else rank,
        )
        if run.gpus is not None:
            return (local, run.gpus[local]) if local < len(run.gpus) else None
    vmap = _visible_map(inventory, run) if inventory is not None else None
    dev = vmap.physical(local) if vmap is not None else None
    return (local, dev.nvml_index) if dev is not None else None


def _gpu(inventory: Inventory, index: int) -> tuple[Gpu | None, tuple[Problem, ...]]:
    for gpu, findings in zip(inventory.gpus, inventory.findings, strict=False):
        if gpu.nvml_index == index:
            return gpu, tuple(findings)
    return None, ()


def _mode(gpu: Gpu) -> str:
    return _MODES.get(gpu.compute_mode or "", "unknown mode")


def _holder(gpu: Gpu) -> str:
    """``, held by dead pid 4242 (user ana)``, or nothing without a process."""
    if not gpu.processes:
        return ""
    proc = gpu.processes[0]
    user = f" (user {proc.holder.user})" if proc.holder is not None and proc.holder.user else ""
    return f", held by {_STATE_WORDS.get(proc.state, proc.state)} pid {proc.pid}{user}"


def _gpus_but(inventory: Inventory, bad: set[int]) -> str:
    return ",".join(str(i) for i in inventory.healthy_indices if i not in bad)


def _busy(found: FoundCause, run: RunInfo | None, inventory: Inventory) -> Facts:
    details: list[str] = []
    bad: set[int] = set()
    stale = False
    for rank in found.ranks:  # the first failing rank's among them
        where = _gpu_for_rank(rank, run, inventory)
        gpu, findings = _gpu(inventory, where[1]) if where is not None else (None, ())
        if where is None or gpu is None:
            continue
        bad.add(where[1])
        details.append(
            f"rank {rank} -> cuda:{where[0]} -> physical GPU {where[1]} ({_mode(gpu)}){_holder(gpu)}"
        )
        stale = stale or any(f.code in _STALE for f in findings)
    if not details:
        # No rank mapping: name the GPUs the inventory itself finds blocked.
        for gpu, findings in zip(inventory.gpus, inventory.findings, strict=False):
            codes = {f.code for f in findings}
            if codes & _BLOCKED:
                bad.add(gpu.nvml_index)
                details.append(f"GPU {gpu.nvml_index} ({_mode(gpu)}) is blocked{_holder(gpu)}")
                stale = stale or bool(codes & _STALE)
    fixes: list[str] = []
    if bad:
        listed = ",".join(map(str, sorted(bad)))
        if stale:
            fixes.append(
                f"free GPU {listed}: `nbgpu clean` (`%gpu_clean`) stops your stale holder; "
                f"if it is not yours, `sudo nvidia-smi --gpu-reset -i {listed}` once idle"
            )
        if others := _gpus_but(inventory, bad):
            fixes.append(
                f"or exclude it: `%%torchrun --gpus {others}` (`nbgpu run --gpus {others}`)"
            )
    return details, fixes


def _ordinal(_found: FoundCause, run: RunInfo | None, inventory: Inventory) -> Facts:
    vmap = _visible_map(inventory, run)
    if vmap is None:
        return [], []
    count = len(vmap.devices)
    setting = "unset" if vmap.raw is None else repr(vmap.raw)
    world = f", but the run started {run.nproc} ranks per node" if run and run.nproc else ""
    sees = f"CUDA sees {count} GPU{'s' if count != 1 else ''} here (CUDA_VISIBLE_DEVICES {setting})"
    healthy = _gpus_but(inventory, set())
    pick = f" or `%%torchrun --gpus {healthy}`" if healthy else ""
    fixes = [f"start at most {count} ranks per node: `%%torchrun {count}`{pick}"] if count else []
    return [sees + world], fixes


def _oom(found: FoundCause, run: RunInfo | None, inventory: Inventory) -> Facts:
    rank = found.first_rank
    where = _gpu_for_rank(rank, run, inventory) if rank is not None else None
    gpu = _gpu(inventory, where[1])[0] if where is not None else None
    if where is None or gpu is None:
        return [], []
    index = where[1]
    details = []
    if gpu.memory_total_bytes:
        details.append(
            f"rank {rank} ran on GPU {index} with {gpu.memory_total_bytes / 2**30:.1f} GiB"
        )
    details += [
        f"GPU {index} now holds {proc.used_bytes / 2**30:.1f} GiB for pid {proc.pid} "
        f"({proc.state}): memory this run could not use"
        for proc in gpu.processes
        if proc.used_bytes
    ]
    return details, []


def _lost(_found: FoundCause, _run: RunInfo | None, inventory: Inventory) -> Facts:
    lost = [g.nvml_index for g in inventory.gpus if g.error == "lost"]
    if not lost:
        return [], []
    others = _gpus_but(inventory, set(lost))
    fixes = (
        [f"leave it out until the node is rebooted: `%%torchrun --gpus {others}`"] if others else []
    )
    return [f"NVML reports GPU {', '.join(map(str, lost))} lost on this machine"], fixes


def _driver(_found: FoundCause, _run: RunInfo | None, inventory: Inventory) -> Facts:
    error = inventory.nvml_error
    return ([f"NVML on this machine: {error}"], []) if error else ([], [])


_ENRICHERS = {
    "cuda_busy": _busy,
    "invalid_ordinal": _ordinal,
    "cuda_oom": _oom,
    "gpu_lost": _lost,
    "driver": _driver,
}


# -- the script's own source ------------------------------------------------------------

_FRAME = re.compile(r'File "([^"<>]+\.py)", line (\d+)')
_ASSERTED = re.compile(r"assert\s+\(?\s*(\w+)\s*%")
_SCRIPT_BYTES = 1024 * 1024
_OPS = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__,
        ast.FloorDiv: int.__floordiv__}  # fmt: skip


def _whole(node: ast.expr) -> int | None:
    """An expression of whole-number literals (``5 * 8``), evaluated; anything else None."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _whole(node.left), _whole(node.right)
        if left is not None and right is not None and (right or type(node.op) is not ast.FloorDiv):
            return _OPS[type(node.op)](left, right)
    return None


def _assigned(path: Path, name: str, before: int) -> tuple[int, int] | None:
    """``(value, line)`` of the last whole-number assignment to ``name`` above ``before``."""
    try:
        if path.stat().st_size > _SCRIPT_BYTES:
            return None
        tree = ast.parse(path.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return None
    found = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and node.lineno < before:
            named = any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
            value = _whole(node.value) if named else None
            if value is not None and (found is None or node.lineno > found[1]):
                found = (value, node.lineno)
    return found


def _divided(root: FoundCause, run: RunInfo | None) -> list[str]:
    """``assert x % world_size == 0`` failed: the assertion prints no numbers, but the
    script at the traceback's path says what ``x`` was (in whole-number arithmetic)."""
    world = run.world_size if run is not None else None
    world = world or (max(root.ranks) + 1 if root.ranks else None)
    for i, line in enumerate(root.traceback):
        asserted = _ASSERTED.search(line)
        frame = next((m for f in reversed(root.traceback[:i]) if (m := _FRAME.search(f))), None)
        if asserted is None or frame is None or world is None:
            continue
        found = _assigned(Path(frame.group(1)), asserted.group(1), int(frame.group(2)))
        if found is None:
            return []
        value, lineno = found
        dividing = ", ".join(str(n) for n in range(1, min(value, 64) + 1) if value % n == 0)
        where = f"{asserted.group(1)} = {value} ({Path(frame.group(1)).name} line {lineno})"
        near = nearest(value, world)
        return [
            f"{where}: valid for {world} ranks: {near}; or run {dividing} ranks (they divide it)"
        ]
    return []


# -- the run's memory records ------------------------------------------------------------


def memory_details(run_dir: Path) -> tuple[str, ...]:
    """Lines to add to an OOM cause (empty without memory records)."""
    try:
        report = memory_report(run_dir)
    except Exception:  # noqa: BLE001  (a diagnosis must never fail on its extras)
        return ()
    lines = [f"{label} died in phase '{path}' (memory records)" for label, path in report.deaths()]
    last = max(
        ((rank, points[-1]) for rank in report.ranks if (points := report.points(rank))),
        key=lambda item: item[1]["t"],
        default=None,
    )
    if last is not None and isinstance(avail := last[1].get("avail"), int):
        rank, sample = last
        total = f" of {gib(report.mem_total_bytes)}" if report.mem_total_bytes else ""
        phase = rank.phase_at(sample["t"])
        where = f", {rank.label} in '{phase}'" if phase else ""
        lines.append(f"node MemAvailable at the last sample: {gib(avail)}{total}{where}")
    if storm := import_storm(report):
        lines.append(storm)
    return tuple(lines)


def add_facts(
    causes: tuple[FoundCause, ...], run: RunInfo | None, inventory: Inventory | None
) -> tuple[FoundCause, ...]:
    root = causes[0] if causes and causes[0].root else None
    if root is None:
        return causes
    details: list[str] = []
    fixes: list[str] = []
    if inventory is not None and root.cause in _ENRICHERS:
        details, fixes = _ENRICHERS[root.cause](root, run, inventory)
    elif inventory is None and root.cause in _GPU_CAUSES and root.first_rank is not None:
        where = _gpu_for_rank(root.first_rank, run, None)
        if where is not None:
            details.append(
                f"rank {root.first_rank} ran on cuda:{where[0]} = physical GPU {where[1]} (run.json)"
            )
    if run is not None and root.cause in ("host_oom", "cuda_oom"):
        details.extend(memory_details(run.path))
    if root.cause == "batch_divisibility":
        details.extend(_divided(root, run))
    # A concrete fix ("exclude it: --gpus 1,2,3") replaces the generic one it refines.
    generic = [
        f for f in root.fixes if not any(m in f and any(m in c for c in fixes) for m in _REFINED)
    ]
    root = replace(root, details=(*root.details, *details), fixes=(*fixes, *generic))
    causes = (root, *causes[1:])
    if run is not None and run.nodes:
        # A run over several nodes: each cause names where its first rank ran.
        causes = tuple(
            replace(c, first_node=run.nodes.get(c.first_rank)) if c.first_rank is not None else c
            for c in causes
        )
    return causes
