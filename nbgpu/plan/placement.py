"""Which GPUs a plan may use, which ones each role gets, and which ports.

**Assignment** (:func:`assign`): only usable candidates are given out; required GPUs come
first, in the order given (a hand workaround such as ``3,2,1,0``); then clean GPUs before ones
with caveats, then NVML order (the first role owns logical device 0); a role gets GPUs of one
model and size when the box allows (data-parallel ranks share one micro batch: on a mixed set
the smallest decides). Colocated roles share their anchor's GPUs (:func:`shared_groups`).

**Ports** (:func:`pick_ports`): distinct free TCP ports from an injected ``port_is_free``, so
plans are deterministic under test; :func:`port_is_free`, the one system call of ``plan/``,
binds a socket and lets it go. A port free now can be taken before the job starts
(hand-started sweep runs often all use 12345): distinct ports per plan stop *our* runs
colliding; the launcher re-checks at start. Never imports pynvml, psutil or files.
"""

import errno
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING

from nbgpu._render import fmt_bytes
from nbgpu.devices.model import gpu_health
from nbgpu.plan.allocation import Allocation
from nbgpu.plan.job import DEFAULT_BASE_PORT, MAX_PORT
from nbgpu.plan.result import ExcludedGpu, PlannedGpu
from nbgpu.problems import Problem

if TYPE_CHECKING:  # the inventory module pulls in psutil; planning only reads its data
    from nbgpu.devices.inventory import Inventory

__all__ = ["Candidate", "PortChecker", "assign", "candidates_from_inventory", "excluded_gpus",
           "order_pool", "pick_ports", "planned_gpus", "port_is_free", "shared_groups"]  # fmt: skip

_FROM_GPU = ("nvml_index", "uuid", "name", "memory_total_bytes", "memory_free_bytes")
# A warn-level finding that still makes context creation fail: exclusive mode, live holder.
_BLOCKING_WARNINGS = frozenset({"exclusive_busy"})
# Holders that keep memory but run nothing: not another job at work on the GPU.
_NOT_RUNNING = frozenset({"zombie", "dead"})
# Unusable because of a holder or a mode: freeing the holder or a reset brings it back.
_RECOVERABLE = frozenset(
    {"exclusive_dead_holder", "zombie_holder", "exclusive_busy", "prohibited", "reset_required"}
)
# How far past the base port to look before giving up: a box with a thousand ports taken
# in a row has a problem a plan cannot solve.
SCAN_LIMIT = 1000
PortChecker = Callable[[int], bool]


@dataclass(frozen=True)
class Candidate:
    nvml_index: int
    uuid: str | None
    name: str | None
    memory_total_bytes: int | None
    memory_free_bytes: int | None
    usable: bool
    grade: int  # 0 clean, 1 usable with caveats, 2 unusable
    health: str  # the GPU's health, as the status table says it: "ok", "BUSY: dead holder"
    problems: tuple[Problem, ...] = ()  # why unusable, or the caveats of a usable GPU
    recoverable: bool = False  # unusable only until a holder is freed or the GPU reset
    other_processes: int = 0  # processes of other jobs running on it now
    utilization_pct: int | None = None  # GPU utilisation when the snapshot was taken

    @property
    def in_use(self) -> bool:
        """Other jobs run on it: a run placed here shares its compute and memory."""
        return self.other_processes > 0


def candidates_from_inventory(inventory: "Inventory") -> tuple[Candidate, ...]:
    """Every GPU of the snapshot, in NVML order, sorted into usable or not."""
    results = inventory.probe.results if inventory.probe is not None else ()
    failed_probe = {
        r.nvml_index: r for r in results if r.outcome != "ok" and r.nvml_index is not None
    }
    out = []
    for gpu, findings in zip(inventory.gpus, inventory.findings, strict=True):
        health, _ = gpu_health(gpu, findings)
        blocking = [f for f in findings if f.severity == "bad" or f.code in _BLOCKING_WARNINGS]
        probe = failed_probe.get(gpu.nvml_index)
        usable, recoverable = False, False
        where = f"GPU {gpu.nvml_index}"
        problems: tuple[Problem, ...]
        if blocking or not gpu.ok:
            unread = Problem("bad", "nvml_error", where, f"NVML error: {gpu.error}")
            problems = tuple(blocking) or (unread,)
            recoverable = gpu.ok and all(f.code in _RECOVERABLE for f in blocking)
        elif probe is not None:
            health = f"probe: {probe.outcome}"
            message = f"{where} failed the CUDA probe ({probe.outcome}): {probe.message}"
            fix = "`nbgpu doctor` names the holder and the fix"
            problems = (Problem("bad", f"probe_{probe.outcome}", where, message, (fix,)),)
            recoverable = probe.outcome == "busy"
        elif gpu.mig_enabled:
            health = "MIG mode"
            message = (
                f"{where} is in MIG mode: a process sees one MIG instance, not the whole GPU, "
                "and plans assign whole GPUs"
            )
            fix = f"`sudo nvidia-smi -i {gpu.nvml_index} -mig 0` when it is idle"
            problems = (Problem("bad", "mig_mode", where, message, (fix,)),)
        else:
            usable = True
            problems = tuple(f for f in findings if f.severity == "warn")
            if gpu.processes and not problems:
                used = sum(p.used_bytes or 0 for p in gpu.processes)
                message = (
                    f"{where} is shared with {len(gpu.processes)} other process(es) using "
                    f"{fmt_bytes(used)}"
                )
                problems = (Problem("warn", "shared", where, message),)
        out.append(
            Candidate(
                **{k: getattr(gpu, k) for k in _FROM_GPU},
                usable=usable,
                grade=(1 if problems else 0) if usable else 2,
                health=health,
                problems=problems,
                recoverable=recoverable,
                utilization_pct=gpu.utilization_gpu_pct,
                other_processes=sum(1 for p in gpu.processes if p.state not in _NOT_RUNNING),
            )
        )
    return tuple(out)


def excluded_gpus(
    candidates: Sequence[Candidate], exclude: Sequence[int] = ()
) -> tuple[ExcludedGpu, ...]:
    out = []
    for c in candidates:
        if c.nvml_index in exclude:
            request = Problem("info", "excluded", f"GPU {c.nvml_index}", "excluded by request")
            out.append(ExcludedGpu(c.nvml_index, c.uuid, "excluded", (request,)))
        elif not c.usable:
            out.append(ExcludedGpu(c.nvml_index, c.uuid, c.health, c.problems, c.recoverable))
    return tuple(out)


def planned_gpus(members: Sequence[Candidate]) -> tuple[PlannedGpu, ...]:
    return tuple(
        PlannedGpu(k, c.nvml_index, c.uuid, c.name, c.memory_total_bytes, c.memory_free_bytes)
        for k, c in enumerate(members)
    )


def order_pool(candidates: Sequence[Candidate], require: Sequence[int] = ()) -> list[Candidate]:
    usable = {c.nvml_index: c for c in candidates if c.usable}
    first = [usable[i] for i in require if i in usable]
    rest = sorted(
        (c for c in usable.values() if c.nvml_index not in require),
        key=lambda c: (c.grade, c.nvml_index),
    )
    return first + rest


def _pick(remaining: list[Candidate], count: int) -> list[Candidate]:
    groups: dict[tuple[int, str], list[Candidate]] = {}  # GPUs alike: same memory and model
    for c in remaining:
        groups.setdefault((c.memory_total_bytes or 0, c.name or ""), []).append(c)
    # Among classes that can hold the whole role, take the one whose best GPU comes first.
    whole = [members[:count] for members in groups.values() if len(members) >= count]
    if whole:
        return min(whole, key=lambda g: (g[0].grade, remaining.index(g[0])))
    return remaining[:count]


def assign(
    pool: Sequence[Candidate], counts: Sequence[int], *, keep_order: bool = False
) -> list[list[Candidate]] | None:
    """Disjoint GPU lists, one per count, or None if the pool is too small; ``keep_order``
    (required GPUs) hands them out in pool order, else each role prefers identical GPUs."""
    if sum(counts) > len(pool):
        return None
    remaining = list(pool)
    out = []
    for count in counts:
        chosen = remaining[:count] if keep_order else _pick(remaining, count)
        out.append(chosen)
        remaining = [c for c in remaining if c not in chosen]
    return out


def shared_groups(
    allocation: Allocation, groups: list[list[Candidate]] | None
) -> list[list[Candidate]] | None:
    """One GPU list per role: a colocated role gets the list of the role it shares with."""
    if groups is None:
        return None
    by_name: dict[str, list[Candidate]] = {}  # role names are unique: one list per role, in order
    own = iter(groups)
    for role in allocation.roles:
        by_name[role.name] = by_name[role.colocated_with] if role.colocated_with else next(own)
    return [list(members) for members in by_name.values()]


def port_is_free(port: int) -> bool:
    """True if a TCP socket can bind *port* on the loopback address right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            # EACCES (privileged port) is as unusable as EADDRINUSE for a job.
            return exc.errno not in (errno.EADDRINUSE, errno.EACCES)
    return True


def pick_ports(
    count: int,
    *,
    base_port: int = DEFAULT_BASE_PORT,
    taken: Iterable[int] = (),
    is_free: PortChecker = port_is_free,
) -> tuple[int, ...]:
    """*count* distinct ports from *base_port* upward that are free and not in *taken*; fewer
    when the scan limit or port 65535 is reached first (the caller says so)."""
    avoid = set(taken)
    scan = range(base_port, min(MAX_PORT, base_port + SCAN_LIMIT) + 1)
    return tuple(islice((port for port in scan if port not in avoid and is_free(port)), count))
