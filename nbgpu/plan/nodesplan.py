"""What a plan across nodes is: the nodes, each node's GPUs, and the checks of the world.

A :class:`NodesPlan` is data, frozen and JSON round-trippable
(:func:`nodes_plan_from_dict`); it renders as text, HTML and a pandas frame. Launchers
read ``ok``, ``nodelist``, ``nproc_per_node`` and ``node_gpus`` (``%%torchrun --plan p``
and ``nbgpu run --slurm --plan FILE`` start the job on exactly these nodes, with each
node's ``CUDA_VISIBLE_DEVICES``). Pure data; never reads an inventory or a file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from nbgpu._render import Block, Line, Result, Table, Title, fmt_bytes, to_text
from nbgpu._serial import from_data, to_data
from nbgpu.errors import UserInputError
from nbgpu.plan.batch import BatchCheck
from nbgpu.plan.result import (
    ExcludedGpu,
    MemoryCheck,
    PlannedGpu,
    alternative_blocks,
    problem_blocks,
    upgrade_plan_data,
)
from nbgpu.problems import Problem

__all__ = [
    "NODES_PLAN_FORMAT",
    "NodeGpus",
    "NodeLeftOut",
    "NodesAlternative",
    "NodesPlan",
    "nodes_plan_from_dict",
]

NODES_PLAN_FORMAT = 1


@dataclass(frozen=True)
class NodeGpus:
    """One node of the job: the GPUs its ranks get (in ``cuda:k`` order), those left out."""

    JSON_EXTRAS: ClassVar[tuple[str, ...]] = ("cuda_visible_devices",)

    node: str
    gpus: tuple[PlannedGpu, ...]
    excluded: tuple[ExcludedGpu, ...] = ()

    @property
    def cuda_visible_devices(self) -> str:
        """NVML indices in order (valid with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``)."""
        return ",".join(str(g.nvml_index) for g in self.gpus)


@dataclass(frozen=True)
class NodeLeftOut:
    """A node the job does not use, and why."""

    node: str
    reason: str


@dataclass(frozen=True)
class NodesAlternative:
    """Another shape that fits when this plan cannot run."""

    title: str
    reason: str
    plan: NodesPlan | None = None

    @property
    def status(self) -> str:
        if self.plan is None:
            return ""
        if self.plan.ok:
            return " — ready"
        first = self.plan.problems[0].message if self.plan.problems else "not ready"
        return f" — also blocked ({first})"


@dataclass(frozen=True)
class NodesPlan(Result):
    """One training job on several nodes: which nodes, which GPUs on each, checked.

    What launchers read: ``ok``; ``nodelist`` (the nodes, for ``srun --nodelist``);
    ``nproc_per_node``; ``node_gpus`` (node → ``CUDA_VISIBLE_DEVICES``). Also
    ``world_size``, ``left_out`` (nodes not used, and why), ``batch`` (checked for every
    rank of every node), ``memory`` (on ``memory_node``, whose smallest free GPU is the
    smallest of the job), ``problems``, ``warnings`` and ``alternatives``.
    """

    JSON_EXTRAS: ClassVar[tuple[str, ...]] = ("ok", "nodelist", "world_size", "node_gpus")
    FRAME_COLUMNS = ("node", "cuda_index", "nvml_index", "uuid")

    nodes: tuple[NodeGpus, ...]  # the nodes placed (fewer than job_nodes when not ready)
    left_out: tuple[NodeLeftOut, ...]
    job_nodes: int  # the nodes the job runs on
    nproc_per_node: int
    problems: tuple[Problem, ...]
    warnings: tuple[Problem, ...]
    batch: BatchCheck | None
    memory: tuple[MemoryCheck, ...]
    memory_node: str | None
    alternatives: tuple[NodesAlternative, ...]
    source: str  # where the nodes' inventories came from: "allocation 17", a file
    simulated: bool
    asked_nodes: int | None = None
    asked_nproc_per_node: int | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def world_size(self) -> int:
        return self.job_nodes * self.nproc_per_node

    @property
    def nodelist(self) -> str:
        return ",".join(n.node for n in self.nodes)

    @property
    def node_gpus(self) -> dict[str, str]:
        return {n.node: n.cuda_visible_devices for n in self.nodes}

    def simulated_fleet(self) -> str | None:
        return self.source if self.simulated else None

    # -- rendering ---------------------------------------------------------------

    def _table(self) -> Table:
        table = Table(["node", "GPUs (CUDA_VISIBLE_DEVICES)", "ranks", "GPU", "left out"])
        for n in self.nodes:
            names = sorted({(g.name or "?").replace("NVIDIA ", "") for g in n.gpus})
            out = "; ".join(f"GPU {e.nvml_index}: {e.health}" for e in n.excluded)
            table.add(n.node, n.cuda_visible_devices, len(n.gpus), "/".join(names), out or "-")
        for left in self.left_out:
            table.add(left.node, "-", 0, "-", left.reason, level="warn")
        return table

    def _footer(self) -> list[Block]:
        lines: list[Block] = [
            Line(
                f"{self.world_size} ranks ({self.job_nodes} × {self.nproc_per_node})", label="world"
            )
        ]
        if self.batch is not None and self.batch.ok:
            lines.append(Line(self.batch.summary, label="batch"))
        for m in self.memory:
            fits = {True: "fits", False: "does NOT fit", None: "not compared"}[m.fits]
            free = "" if m.available_bytes is None else f" free {fmt_bytes(m.available_bytes)}"
            lines.append(
                Line(
                    f"{fmt_bytes(m.needed_bytes)}, {fits} on node {self.memory_node} GPU "
                    f"{m.deciding_gpu}{free} (the smallest of the job)",
                    label="memory per GPU",
                )
            )
            lines.append(Line(m.accounting, indent="  "))
            if m.max_micro_batch is not None:
                lines.append(Line(f"{m.max_micro_batch} (computed, no trials)",
                                  label="largest micro batch"))  # fmt: skip
        if not self.memory and self.nodes:
            lines.append(Line("not checked (pass model= to compare with free memory)",
                              label="memory"))  # fmt: skip
        if self.ok:
            lines.append(
                Line(
                    f"%%torchrun --plan p or nbgpu run --plan FILE (srun --nodelist "
                    f"{self.nodelist}; each node sets its own CUDA_VISIBLE_DEVICES); the "
                    "rendezvous port is picked on the first node when the job starts",
                    label="launch",
                )
            )
        return lines

    def text(self) -> str:
        return to_text(self.content(), width=120)  # the table's "left out" reasons are long

    def content(self) -> list[Block]:
        shape = f"{self.job_nodes} node(s) × {self.nproc_per_node} GPUs"
        sim = "SIMULATED " if self.simulated else ""
        verdict = "ready" if self.ok else "NOT READY"
        title = f"nbgpu plan — {shape} on {sim}{self.source} · {verdict}"
        blocks: list[Block] = [Title(title, simulated=self.simulated), self._table(),
                               *self._footer()]  # fmt: skip
        blocks += problem_blocks(self.problems, self.warnings)
        return blocks + alternative_blocks([(f"{a.title}{a.status}: {a.reason}", ())
                                            for a in self.alternatives])  # fmt: skip

    # -- data --------------------------------------------------------------------

    def records(self) -> list[dict[str, Any]]:
        return [
            {
                "node": n.node,
                "cuda_index": g.cuda_index,
                "nvml_index": g.nvml_index,
                "uuid": g.uuid,
                "name": g.name,
                "memory_total_bytes": g.memory_total_bytes,
                "memory_free_bytes": g.memory_free_bytes,
                "cuda_visible_devices": n.cuda_visible_devices,
                "ok": self.ok,
            }
            for n in self.nodes
            for g in n.gpus
        ]

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = to_data(self)
        return {"nbgpu_nodes_plan": NODES_PLAN_FORMAT, **data}


def nodes_plan_from_dict(data: Any) -> NodesPlan:
    """Rebuild a :class:`NodesPlan` from ``NodesPlan.to_dict()`` (or its JSON, decoded)."""
    if not isinstance(data, dict) or data.get("nbgpu_nodes_plan") != NODES_PLAN_FORMAT:
        got = data.get("nbgpu_nodes_plan") if isinstance(data, dict) else None
        raise UserInputError(
            f"plan JSON: nbgpu_nodes_plan = {json.dumps(got)}; expected {NODES_PLAN_FORMAT} "
            "(write one with `nbgpu plan --slurm ... --json > plan.json`)"
        )
    return from_data(NodesPlan, upgrade_plan_data(data), prefix="plan JSON")
