"""What a found cause's ``details`` say beyond the catalog's generic text.

:func:`specifics`: the numbers the log gives, turned into advice (the nearest batch sizes
that divide, the collective and its timeout, the failed allocation, the taken port).
:func:`add_facts`: what the logs do not say. With an ``Inventory`` the root cause names
"rank 0 -> cuda:0 -> physical GPU 0, exclusive-process, held by dead pid 4242" and the exact
fix; a rank's GPU comes from run.json (``gpus``, else ``cuda_visible_devices`` mapped as CUDA
maps it), else from the inventory's own view. An OOM with memory records adds the phase each
rank died in, the node's ``MemAvailable`` at the last sample and the measured case for
``--serial-imports``.

The inventory is used through its attributes only (importing ``nbgpu.devices.inventory``
would pull psutil in); never raises on bad memory records.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from nbgpu.devices.visible import VisibleMap, gpu_identities, resolve_visible
from nbgpu.diagnose.report import FoundCause
from nbgpu.diagnose.sources import RunInfo
from nbgpu.profile.records import gib, import_storm
from nbgpu.profile.report import memory_report

if TYPE_CHECKING:
    from nbgpu.devices.inventory import Inventory
    from nbgpu.devices.model import Gpu
    from nbgpu.problems import Problem

__all__ = ["add_facts", "describe_inventory", "memory_details", "specifics"]

# -- numbers from the log ---------------------------------------------------------------

_NUM = r"\(?(\d+)\)?"
_BATCH_WORLD = re.compile(
    rf"batch[ _]?size\s*{_NUM}\s*(?:must|should) be divisible by\s*[\w ]*?{_NUM}", re.IGNORECASE
)
_DEEPSPEED = re.compile(r"world_size\s*(\d+)\s*!=\s*(\d+)\s*\*\s*(\d+)\s*\*\s*(\d+)")
_CHUNK = re.compile(r"size of DataProto (\d+) and chunk (\d+)")
_MEGATRON = re.compile(
    rf"global batch size\s*{_NUM}\s*is not divisible by micro batch size\s*{_NUM}\s*times data "
    rf"parallel size\s*{_NUM}",
    re.IGNORECASE,
)
_GENERIC_DIV = re.compile(r"(\d+)\s*(?:is not|must be|should be) (?:evenly )?divisible by\s*(\d+)")
_OP = re.compile(r"OpType=(\w+)")
_TIMEOUT = re.compile(r"Timeout\(ms\)=(\d+)\) ran for (\d+) milliseconds")
_ALLOC = re.compile(r"Tried to allocate ([\d.]+ ?[KMGT]?i?B)")
_GPU_TOTAL = re.compile(r"GPU (\d+)?\s*(?:has a total capac\w* of|;)\s*([\d.]+ ?[KMGT]i?B)")
_FREE = re.compile(r"of which ([\d.]+ ?[KMGT]?i?B) is free|([\d.]+ ?[KMGT]?i?B) free")
_PORT = re.compile(r"(?:\[::\]|0\.0\.0\.0|port)\s*:?\s*(\d{2,5})\b")
_ENDPOINT = re.compile(r"connect to \(?([\w.\-]+)[, :]+(\d{2,5})\)?")
_ASSERTION = re.compile(r"Assertion `(.+?)` failed")
_DRIVER_VERSION = re.compile(r"found version (\d+)")


def _near(value: int, divisor: int) -> str:
    """The multiples of ``divisor`` just below and above ``value`` (positive only)."""
    low = (value // divisor) * divisor if divisor > 0 else 0
    near = (low, low + divisor) if divisor > 0 else ()
    return " or ".join(str(v) for v in near if v > 0 and v != value)


def _deepspeed(m: re.Match[str], world_size: int | None) -> list[str]:
    train, micro, gas, world = (int(g) for g in m.groups())
    sizes = f"micro_batch_per_gpu x gradient_accumulation x world_size = {micro} x {gas} x {world}"
    out = [f"DeepSpeed needs train_batch_size = {sizes} = {micro * gas * world}, but it is {train}"]
    if world_size and world == 1 < world_size:
        out.append(
            f"DeepSpeed counted world_size 1 while {world_size} ranks ran: the ranks did "
            "not join one process group (launch through torchrun/deepspeed, not python)"
        )
    step = micro * world
    if train % step == 0:
        out.append(f"keep {train} with gradient_accumulation_steps = {train // step}")
    else:
        low = (train // step) * step
        near = [n for n in (low, low + step) if n > 0 and n != train]
        options = ", ".join(f"{n} (gradient accumulation {n // step})" for n in near)
        out.append(f"valid train_batch_size values near {train}: {options}")
    return out


def _batch(text: str, world_size: int | None) -> str | None:
    if m := _MEGATRON.search(text):
        batch, micro, dp = (int(g) for g in m.groups())
        return (
            f"global batch {batch} must be a multiple of micro batch x data-parallel size "
            f"= {micro} x {dp}; nearest valid: {_near(batch, micro * dp)}"
        )
    if m := _CHUNK.search(text):
        batch, parts = int(m.group(1)), int(m.group(2))
        return (
            f"a batch of {batch} cannot be split into {parts} equal parts (one per rank); "
            f"use a multiple of {parts}: {_near(batch, parts) or parts}"
        )
    if m := _BATCH_WORLD.search(text):
        batch, world = int(m.group(1)), int(m.group(2))
        return (
            f"batch size {batch} is not divisible by world size {world}; nearest valid "
            f"batch sizes: {_near(batch, world)}, or use a number of ranks that divides {batch}"
        )
    if m := _GENERIC_DIV.search(text):
        value, divisor = int(m.group(1)), int(m.group(2))
        return f"{value} is not divisible by {divisor}; nearest multiples: {_near(value, divisor)}"
    if world_size:
        return (
            f"the job ran with world size {world_size}: sizes split across ranks must be "
            f"multiples of {world_size}"
        )
    return None


def _timeout(text: str) -> str | None:
    op, t = _OP.search(text), _TIMEOUT.search(text)
    what = op.group(1) if op else "a collective"
    if t:
        waited, limit = int(t.group(2)) / 1000, int(t.group(1)) / 1000
        return (
            f"{what} waited {waited:.0f} s (timeout {limit:.0f} s) for a rank that never joined it"
        )
    return f"{what} timed out waiting for a rank that never joined it" if op else None


def _oom_numbers(text: str) -> str | None:
    alloc, total, free = _ALLOC.search(text), _GPU_TOTAL.search(text), _FREE.search(text)
    if not alloc:
        return None
    sentence = f"tried to allocate {alloc.group(1)}"
    if total:
        gpu = f"GPU {total.group(1)} " if total.group(1) else "a GPU "
        sentence += f" on {gpu}of {total.group(2)}"
    if free:
        sentence += f" with {free.group(1) or free.group(2)} free"
    return sentence


def _port(text: str) -> str | None:
    if not (m := _PORT.search(text)):
        return None
    port = int(m.group(1))
    if port < 1024:
        return f"port {port} is privileged (< 1024): use a port above 1024"
    shared = " (torchrun's default, shared by every job that keeps it)" if port == 29500 else ""
    return f"port {port} was already taken{shared}"


def _no_gpu_ranks(ranks: Sequence[int], world_size: int | None) -> str | None:
    first = min(ranks, default=0)
    if first > 0 and (world_size is None or max(ranks) == world_size - 1):
        s = "s" if first != 1 else ""
        return (
            f"ranks {first} and up found no GPU while ranks below {first} did: the job sees "
            f"{first} GPU{s}, so start {first} rank{s} per node (`%%torchrun {first}`)"
        )
    return None


def _driver_version(text: str) -> str | None:
    if not (m := _DRIVER_VERSION.search(text)):
        return None
    v = int(m.group(1))
    return (
        f"the driver supports CUDA up to {v // 1000}.{(v % 1000) // 10} (found version {v}); "
        "the installed torch needs a newer one"
    )


def specifics(
    cause_id: str, texts: Sequence[str], ranks: Sequence[int], world_size: int | None
) -> tuple[str, ...]:
    """Sentences with the numbers the evidence gives for ``cause_id``."""
    text = " ".join(texts)
    found: str | None = None
    if cause_id == "batch_divisibility":
        if m := _DEEPSPEED.search(text):
            return tuple(_deepspeed(m, world_size))
        found = _batch(text, world_size)
    elif cause_id == "invalid_ordinal":
        found = _no_gpu_ranks(ranks, world_size)
    elif cause_id == "rendezvous" and (m := _ENDPOINT.search(text)):
        found = f"could not reach the rendezvous store at {m.group(1)}:{m.group(2)}"
    elif cause_id == "device_assert" and (m := _ASSERTION.search(text)):
        found = f"the failed kernel assertion: {m.group(1)}"
    else:
        by_text = {
            "nccl_timeout": _timeout,
            "cuda_oom": _oom_numbers,
            "port_in_use": _port,
            "driver": _driver_version,
        }
        found = by_text[cause_id](text) if cause_id in by_text else None
    return (found,) if found else ()


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
    """How the report names the inventory it used."""
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
    who = f"pid {proc.pid}"
    if proc.holder is not None and proc.holder.user:
        who += f" (user {proc.holder.user})"
    state = _STATE_WORDS.get(proc.state, proc.state)
    return f", held by {state} {who}"


def _gpus_but(inventory: Inventory, bad: set[int]) -> str:
    return ",".join(str(i) for i in inventory.healthy_indices if i not in bad)


def _busy(found: FoundCause, run: RunInfo | None, inventory: Inventory) -> Facts:
    details: list[str] = []
    bad: set[int] = set()
    stale = False
    for rank in found.ranks or ((found.first_rank,) if found.first_rank is not None else ()):
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
    details = [
        f"CUDA sees {count} GPU{'s' if count != 1 else ''} here (CUDA_VISIBLE_DEVICES {setting})"
        + world
    ]
    healthy = _gpus_but(inventory, set())
    pick = f" or `%%torchrun --gpus {healthy}`" if healthy else ""
    fixes = [f"start at most {count} ranks per node: `%%torchrun {count}`{pick}"] if count else []
    return details, fixes


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
    """The causes found, with what the logs do not say added to the root cause."""
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
