"""What a plan is: roles on physical GPUs, with ports, problems, warnings and alternatives.

A :class:`Plan` is data, frozen, JSON round-trippable (:func:`plan_from_dict`), and renders
as text, HTML and a pandas frame through the ``Result`` mixin. Launchers read the fields
documented on :class:`Plan` and :class:`RolePlan`; everything else is for people.

Pure: imports the result helpers of ``nbgpu._render``, ``serial`` and ``batch``; never the
inventory, sockets or files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from nbgpu._render import fix_html, fixes_html, wrap
from nbgpu.plan.allocation import degrees_text

__all__ = [
    "ExcludedGpu",
    "Issue",
    "MemoryCheck",
    "MemoryLine",
    "PlannedGpu",
    "RolePlan",
    "fit_title",
    "notes_html",
    "notes_text",
]

#: The address every role's rendezvous uses: plans are for one node.
MASTER_ADDR = "127.0.0.1"
# Model states above this share of a GPU leave too little for activations and overheads.
TIGHT_SHARE = 0.8


@dataclass(frozen=True)
class Issue:
    """A problem (blocks the plan) or a warning, with its reason and what to do."""

    code: str  # stable id: "not_enough_gpus", "batch", "memory", "gpu_unusable", ...
    message: str  # the reason, one sentence naming the values involved
    fixes: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExcludedGpu:
    """A GPU the plan does not use, and why."""

    nvml_index: int
    uuid: str | None
    health: str  # short, as in the status table: "BUSY: dead holder", "excluded"
    reasons: tuple[str, ...]
    fixes: tuple[str, ...] = ()
    recoverable: bool = False  # usable again once its holder is freed or it is reset


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
class RolePlan:
    """One role: which physical GPUs in which order, how many processes, which port.

    ``gpus`` is in logical order: ``gpus[k]`` is ``cuda:k`` inside the role's processes.
    ``cuda_visible_devices`` lists their NVML indices (nvidia-smi's numbers) in that order;
    they mean those GPUs only with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, which ``env`` sets
    (``cuda_visible_devices_uuids`` is the order-independent UUID form).
    ``nproc_per_node`` is the number of processes to start: data × tensor × pipeline ×
    context. A role ``colocated_with`` another runs on that role's GPUs (AReaL's ``|``).
    ``master_port`` is a free port for the role's rendezvous (torchrun's MASTER_PORT; a
    server may use it for its own process group), distinct across the plan.
    """

    JSON_EXTRAS: ClassVar[tuple[str, ...]] = (
        "nproc_per_node",
        "cuda_visible_devices",
        "cuda_visible_devices_uuids",
        "nvml_indices",
        "env",
    )

    name: str
    kind: str  # "inference" | "train"
    backend: str | None
    data_parallel: int
    tensor_parallel: int
    pipeline_parallel: int
    gpus: tuple[PlannedGpu, ...]  # empty when the role could not be placed
    master_port: int | None
    context_parallel: int = 1
    expert_parallel: int = 1  # within the same GPUs: not in nproc_per_node
    colocated_with: str | None = None

    @property
    def nproc_per_node(self) -> int:
        return (
            self.data_parallel
            * self.tensor_parallel
            * self.pipeline_parallel
            * self.context_parallel
        )

    @property
    def degrees(self) -> str:
        return degrees_text(
            self.data_parallel,
            self.tensor_parallel,
            self.pipeline_parallel,
            self.context_parallel,
            self.expert_parallel,
        )

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
            env["MASTER_ADDR"] = MASTER_ADDR
            env["MASTER_PORT"] = str(self.master_port)
        return env


@dataclass(frozen=True)
class MemoryLine:
    """One component of per-GPU memory: bytes on each GPU of the role, and how computed."""

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
        if self.available_bytes is None:
            return None
        return self.needed_bytes <= self.available_bytes

    @property
    def tight(self) -> bool:
        return bool(self.available_bytes) and (
            self.needed_bytes > TIGHT_SHARE * (self.available_bytes or 0)
        )


def fit_title(title: str) -> str:
    """A title for 80 columns: a long fleet spec goes on its own line."""
    if len(title) <= 80 or " on " not in title:
        return title
    head, _, tail = title.partition(" on ")
    return f"{head}\n  on {tail}"


def notes_text(problems: tuple[Issue, ...], warnings: tuple[Issue, ...]) -> list[str]:
    lines = []
    for mark, issues in (("!! ", problems), ("!  ", warnings)):
        for issue in issues:
            lines.append(wrap(issue.message, mark))
            lines.extend(wrap(fix, "     fix: ") for fix in issue.fixes)
    return lines


def notes_html(problems: tuple[Issue, ...], warnings: tuple[Issue, ...]) -> str:
    """Problems and warnings as one list, each issue's fixes a sub-list under it."""
    items = []
    for level, issues in (("bad", problems), ("warn", warnings)):
        for issue in issues:
            sub = fixes_html(issue.fixes)
            items.append(f'<li class="{level}">{fix_html(issue.message)}{sub}</li>')
    return f"<ul>{''.join(items)}</ul>" if items else ""
