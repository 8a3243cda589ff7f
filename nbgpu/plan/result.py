"""What a plan is: roles on physical GPUs, with ports, problems, warnings and alternatives.

A :class:`Plan` is frozen data, JSON round-trippable (``nbgpu plan --json`` writes plan files
for ``nbgpu run --plan``), rendered by the ``Result`` mixin. Launchers read the fields
documented on :class:`Plan` and :class:`RolePlan`; the rest is for people. Pure: never
imports the inventory, sockets or files.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from nbgpu._render import (
    Blank,
    Block,
    Bullets,
    Line,
    Problems,
    Result,
    Section,
    Table,
    Title,
    fmt_bytes,
    simulated_label,
)
from nbgpu._serial import to_data
from nbgpu.plan.allocation import RoleSpec
from nbgpu.plan.job import BatchCheck
from nbgpu.problems import Problem

__all__ = ["PLAN_FILE_FORMAT", "Alternative", "ExcludedGpu", "MemoryCheck", "MemoryLine", "Plan",
           "PlannedGpu", "RolePlan", "alternative_blocks", "check_lines", "memory_table",
           "plan_title", "problem_blocks"]  # fmt: skip

#: The address every role's rendezvous uses: plans are for one node.
MASTER_ADDR = "127.0.0.1"
# Model states above this share of a GPU leave too little for activations and overheads.
TIGHT_SHARE = 0.8
_ROLE_KEYS = ("kind", "degrees", "nproc_per_node", "master_port", "cuda_visible_devices")
#: The format of plan files (``nbgpu_plan``, ``nbgpu_sweep``, ``nbgpu_nodes_plan``).
PLAN_FILE_FORMAT = 1
_PCI_ORDER = Line("GPU numbers are nvidia-smi's: each role's env sets PCI_BUS_ID order.")


@dataclass(frozen=True)
class ExcludedGpu:
    """A GPU the plan does not use, and why: the doctor's problems with it, and their fixes."""

    nvml_index: int
    uuid: str | None
    health: str  # short, as in the status table: "BUSY: dead holder", "excluded"
    problems: tuple[Problem, ...] = ()
    recoverable: bool = False  # usable again once its holder is freed or it is reset

    # Plan files before the problems had these two keys; scripts may still read them.
    JSON_EXTRAS: ClassVar[tuple[str, ...]] = ("reasons", "fixes")

    @property
    def reasons(self) -> tuple[str, ...]:
        return tuple(p.message for p in self.problems)

    @property
    def fixes(self) -> tuple[str, ...]:
        return tuple(fix for p in self.problems for fix in p.fixes)


@dataclass(frozen=True)
class PlannedGpu:
    """One physical GPU of a role, at logical ordinal ``cuda_index`` inside that role."""

    cuda_index: int
    nvml_index: int
    uuid: str | None
    name: str | None
    memory_total_bytes: int | None
    memory_free_bytes: int | None


@dataclass(frozen=True)
class RolePlan(RoleSpec):
    """One role placed: which physical GPUs in which order, how many processes, which port.

    ``gpus[k]`` is ``cuda:k`` inside the role's processes; ``cuda_visible_devices`` lists
    their NVML indices (nvidia-smi's numbers) in that order, meaning those GPUs only with
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, which ``env`` sets (``cuda_visible_devices_uuids``: the
    order-independent form). ``nproc_per_node``: d × t × p × c. ``master_port``: a free port
    for the role's rendezvous (torchrun's MASTER_PORT; a server may use it for its own
    process group), distinct across the plan.
    """

    JSON_EXTRAS: ClassVar[tuple[str, ...]] = (
        "nproc_per_node",
        "cuda_visible_devices",
        "cuda_visible_devices_uuids",
        "nvml_indices",
        "env",
    )

    gpus: tuple[PlannedGpu, ...] = ()  # empty when the role could not be placed
    master_port: int | None = None

    @property
    def nproc_per_node(self) -> int:
        return self.world_size

    @property
    def nvml_indices(self) -> tuple[int, ...]:
        return tuple(g.nvml_index for g in self.gpus)

    @property
    def uuids(self) -> tuple[str | None, ...]:
        return tuple(g.uuid for g in self.gpus)

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(str(i) for i in self.nvml_indices)

    @property
    def cuda_visible_devices_uuids(self) -> str:
        return ",".join(g.uuid or str(g.nvml_index) for g in self.gpus)

    @property
    def env(self) -> dict[str, str]:
        """The environment a launcher sets for this role's processes."""
        if not self.gpus:
            return {}
        env = {
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": self.cuda_visible_devices,
            "NPROC_PER_NODE": str(self.nproc_per_node),
        }
        if self.master_port is not None:
            env |= {"MASTER_ADDR": MASTER_ADDR, "MASTER_PORT": str(self.master_port)}
        return env


@dataclass(frozen=True)
class MemoryLine:
    component: str  # "weights", "gradients", "optimizer states", "activations", ...
    bytes_per_gpu: int
    formula: str
    source: str = ""  # where the formula comes from (paper, docs, measurement)


@dataclass(frozen=True)
class MemoryCheck:
    """Per-GPU memory a role needs versus what its smallest GPU has free."""

    role: str
    lines: tuple[MemoryLine, ...]
    accounting: str  # the stated byte accounting, e.g. "bf16 params 2 B + grads 2 B + ..."
    available_bytes: int | None  # free memory of the GPU that decides (the smallest)
    deciding_gpu: int | None  # its NVML index
    not_estimated: tuple[str, ...] = ()  # terms the input cannot give (no shape, no seq_len)
    gpu_free: tuple[tuple[int, int | None], ...] = ()  # (NVML index, free bytes) per GPU
    micro_batch: int | None = None  # the micro batch the activations are counted for
    max_micro_batch: int | None = None  # the largest that fits the deciding GPU (computed)

    @property
    def needed_bytes(self) -> int:
        return sum(line.bytes_per_gpu for line in self.lines)

    @property
    def fits(self) -> bool | None:
        return None if self.available_bytes is None else self.needed_bytes <= self.available_bytes

    @property
    def verdict(self) -> str:
        return {True: "fits", False: "does NOT fit", None: "not compared"}[self.fits]

    @property
    def tight(self) -> bool:
        available = self.available_bytes or 0
        return bool(available) and self.needed_bytes > TIGHT_SHARE * available


def plan_title(kind: str, what: str, fleet: str, *, simulated: bool, ok: bool) -> Title:
    """Every plan's headline; past 80 columns the fleet goes on its own line."""
    source = simulated_label(fleet) if simulated else f"host {fleet}"
    title = f"nbgpu {kind} — {what} on {source} · {'ready' if ok else 'NOT READY'}"
    if len(title) > 80:
        head, _, tail = title.partition(" on ")
        title = f"{head}\n  on {tail}"
    return Title(title, simulated=simulated)


def problem_blocks(*problems: Sequence[Problem]) -> list[Block]:
    every = [p for group in problems for p in group]
    return [Blank(), Problems(every)] if every else []


def alternative_blocks(alternatives: Sequence[tuple[str, Sequence[str]]]) -> list[Block]:
    if not alternatives:
        return []
    return [
        Line("alternatives:"),
        *(
            Section([Line(f"{n}. {head}", indent="  "), Bullets(steps, marker="       ")])
            for n, (head, steps) in enumerate(alternatives, 1)
        ),
    ]


def memory_table(memory: Sequence[MemoryCheck]) -> Table:
    table = Table(["role", "term", "per GPU", "formula"], flex=3)
    for m in memory:
        for line in m.lines:
            table.add(m.role, line.component, fmt_bytes(line.bytes_per_gpu), line.formula)
        for missing in m.not_estimated:
            name, _, why = missing.partition(" (")
            table.add(m.role, name, "?", why.rstrip(")"), level="warn")
        free = f"free {fmt_bytes(m.available_bytes)} on GPU {m.deciding_gpu}"
        free = "free: ?" if m.available_bytes is None else free
        level = "bad" if m.fits is False else ("warn" if m.tight else "")
        needed = fmt_bytes(m.needed_bytes)
        table.add(m.role, "total", needed, f"{m.verdict}: {free}", level=level)
    return table


def check_lines(
    batch: BatchCheck | None, memory: Sequence[MemoryCheck], placed: bool
) -> list[Block]:
    """A plan's batch and memory lines; memory is said unchecked only where GPUs were placed."""
    lines: list[Block] = [Line(batch.summary, label="batch")] if batch and batch.ok else []
    if not memory:
        return lines + [Line("not checked (pass model= or --model)", label="memory")] * placed
    lines += [Line(m.accounting, label=f"memory {m.role}") for m in memory]
    for m in memory:
        if len(m.gpu_free) > 1:
            each = ", ".join(f"GPU {i} {fmt_bytes(b)}" for i, b in m.gpu_free)
            lines.append(Line(f"{each} (the smallest decides)", label=f"free memory {m.role}"))
        if m.max_micro_batch is not None:
            largest = (
                f"{m.max_micro_batch} within GPU {m.deciding_gpu}'s free memory (computed "
                "from the estimate, no trials)"
            )
            lines.append(Line(largest, label=f"largest micro batch {m.role}"))
    if any(m.not_estimated for m in memory):
        shape = (
            "memory terms marked ? need the model's shape (a name such as "
            "'Qwen/Qwen2.5-7B-Instruct' or an HF config.json) and seq_len"
        )
        lines.append(Line(shape, indent="  "))
    return lines


@dataclass(frozen=True)
class Alternative:
    """Another way to run the job when this plan cannot: a ready plan, or steps first."""

    title: str
    reason: str
    fixes: tuple[str, ...] = ()
    plan: "Plan | None" = None

    @property
    def status(self) -> str:
        return "" if self.plan is None else (" — ready" if self.plan.ok else " — also blocked")


@dataclass(frozen=True)
class Plan(Result):
    """A launchable answer: which GPUs each role gets, in what order, on which port.

    What launchers read (``%%torchrun --plan p``, ``nbgpu run --plan FILE``): ``ok`` (no
    blocking problem: launch only then), ``roles`` (a :class:`RolePlan` each),
    ``cuda_visible_devices`` (all roles' GPUs in role order, for launchers that split one list
    by position, as AReaL: logical device 0 is the first role's), ``problems`` (blocking) and
    ``warnings``. Also: ``excluded`` (GPUs left out, and why), ``batch`` (divisibility, nearest
    valid values, splits), ``memory`` (per-GPU terms versus free memory), ``alternatives``
    (ready plans or steps when this one cannot run).
    """

    JSON_EXTRAS: ClassVar[tuple[str, ...]] = ("ok", "cuda_visible_devices")

    allocation: str  # canonical allocation: "sglang.d1t1p1+d3t1p1"
    roles: tuple[RolePlan, ...]
    problems: tuple[Problem, ...]
    warnings: tuple[Problem, ...]
    excluded: tuple[ExcludedGpu, ...]
    batch: BatchCheck | None
    memory: tuple[MemoryCheck, ...]
    alternatives: tuple[Alternative, ...]
    fleet: str  # where the inventory came from: host name or fleet name
    simulated: bool
    name: str | None = None  # a sweep's run name ("run0")

    @property
    def ok(self) -> bool:
        return not self.problems

    def simulated_fleet(self) -> str | None:
        return self.fleet if self.simulated else None

    @property
    def cuda_visible_devices(self) -> str:
        # A colocated role runs on GPUs already listed: each GPU appears once.
        return ",".join(
            r.cuda_visible_devices for r in self.roles if r.gpus and r.colocated_with is None
        )

    def role(self, name: str) -> RolePlan:
        for role in self.roles:
            if role.name == name:
                return role
        raise KeyError(f"{name!r}: roles are {', '.join(r.name for r in self.roles)}")

    def _role_table(self) -> Table:
        table = Table(["role", "kind", "degrees", "GPUs (CUDA_VISIBLE_DEVICES)", "nproc", "port"])
        for r in self.roles:
            port = "-" if r.master_port is None else r.master_port
            gpus = r.cuda_visible_devices or "-"
            level = "" if r.gpus else "bad"
            table.add(r.name, r.kind, r.degrees, gpus, r.nproc_per_node, port, level=level)
        return table

    def _gpu_table(self) -> Table:
        table = Table(["role", "cuda", "GPU", "name", "free", "UUID"], flex=5)
        for r in self.roles:
            for g in r.gpus:
                name = (g.name or "-").replace("NVIDIA ", "")
                free = fmt_bytes(g.memory_free_bytes)
                table.add(r.name, g.cuda_index, g.nvml_index, name, free, g.uuid or "-")
        return table

    def _footer(self) -> list[Block]:
        lines = check_lines(self.batch, self.memory, bool(self.roles and self.roles[0].gpus))
        if self.cuda_visible_devices and len(self.roles) > 1:
            first = self.roles[0]
            one_list = (
                f"CUDA_VISIBLE_DEVICES={self.cuda_visible_devices} (logical device 0 = GPU "
                f"{first.nvml_indices[0]}, role {first.name})"
            )
            lines.append(Line(one_list, label="one-list form"))
        if any(r.gpus for r in self.roles):
            lines.append(_PCI_ORDER)
        return lines

    def content(self) -> list[Block]:
        what = f"{self.name}: {self.allocation}" if self.name else self.allocation
        title = plan_title("plan", what, self.fleet, simulated=self.simulated, ok=self.ok)
        blocks: list[Block] = [title, self._role_table()]
        if any(r.gpus for r in self.roles):
            blocks.append(self._gpu_table())
        if self.excluded:
            left = [
                f"GPU {e.nvml_index} ({e.health}): {' '.join(e.reasons)}" for e in self.excluded
            ]
            blocks.append(Bullets(left, title="left out:", marker="  "))
        blocks += self._footer()
        if self.memory:
            blocks.append(memory_table(self.memory))
        blocks += problem_blocks(self.problems, self.warnings)
        return blocks + alternative_blocks(
            [(f"{a.title}{a.status}: {a.reason}", a.fixes) for a in self.alternatives]
        )

    def records(self) -> list[dict[str, Any]]:
        rows = []
        for r in self.roles:
            base = {"plan": self.name, "role": r.name, **{k: getattr(r, k) for k in _ROLE_KEYS}}
            base.update(ok=self.ok, simulated=self.simulated)
            if not r.gpus:
                rows.append({**base, "cuda_index": None, "nvml_index": None, "uuid": None})
            rows.extend({**base, **to_data(g)} for g in r.gpus)
        return rows

    def to_dict(self) -> dict[str, Any]:
        return {"nbgpu_plan": PLAN_FILE_FORMAT, **to_data(self)}
