"""One training job across several nodes: which nodes, which GPUs on each, checked.

torchrun starts the same number of ranks *P* on every node, so a node can take the job when
it has *P* usable GPUs. Such nodes are kept, clean ones first; batch and memory are checked
for the whole world of ``nodes × P`` ranks (ZeRO and FSDP shard over all of them; the
smallest free GPU of any chosen node decides what fits). A job that does not fit names each
node that falls short and offers fewer nodes or fewer ranks per node. The rendezvous port is
picked on the first node at launch. Pure: never reads an inventory, files or sockets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from nbgpu._render import Block, Line, Result, Table, Title, fmt_bytes, to_text
from nbgpu._serial import to_data
from nbgpu.errors import UserInputError
from nbgpu.plan.job import BatchCheck, Job, check_job_batch, nearest_batch, whole_number
from nbgpu.plan.memcheck import auto_max_micro, memory_check, memory_problems, smallest_free
from nbgpu.plan.placement import Candidate, assign, excluded_gpus, order_pool, planned_gpus
from nbgpu.plan.planner import batch_problem, caveats
from nbgpu.plan.result import (
    MEMORY_NOT_CHECKED,
    PLAN_FILE_FORMAT,
    ExcludedGpu,
    MemoryCheck,
    PlannedGpu,
    RolePlan,
    alternative_blocks,
    problem_blocks,
)
from nbgpu.problems import Problem

__all__ = ["NodeGpus", "NodeLeftOut", "NodesAlternative", "NodesPlan", "build_nodes_plan",
           "default_shape"]  # fmt: skip


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
    node: str
    reason: str


@dataclass(frozen=True)
class NodesAlternative:
    title: str
    reason: str
    plan: NodesPlan | None = None

    @property
    def status(self) -> str:
        if self.plan is None:
            return ""
        if self.plan.ok:
            return " — ready"
        return f" — also blocked ({self.plan.problems[0].message})"  # not ok: it has problems


@dataclass(frozen=True)
class NodesPlan(Result):
    """What launchers read: ``ok``, ``nodelist`` (for ``srun --nodelist``), ``nproc_per_node``,
    ``node_gpus`` (node → ``CUDA_VISIBLE_DEVICES``). ``memory`` is checked on ``memory_node``,
    whose smallest free GPU is the smallest of the job; ``batch`` for every rank."""

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
        world = f"{self.world_size} ranks ({self.job_nodes} × {self.nproc_per_node})"
        lines: list[Block] = [Line(world, label="world")]
        if self.batch is not None and self.batch.ok:
            lines.append(Line(self.batch.summary, label="batch"))
        for m in self.memory:
            free = "" if m.available_bytes is None else f" free {fmt_bytes(m.available_bytes)}"
            where = f"{m.verdict} on node {self.memory_node} GPU {m.deciding_gpu}{free}"
            needed = f"{fmt_bytes(m.needed_bytes)}, {where} (the smallest of the job)"
            lines += [Line(needed, label="memory per GPU"), Line(m.accounting, indent="  ")]
            if m.max_micro_batch is not None:
                largest = f"{m.max_micro_batch} (computed, no trials)"
                lines.append(Line(largest, label="largest micro batch"))
        if not self.memory and self.nodes:
            lines.append(MEMORY_NOT_CHECKED)
        if self.ok:
            launch = (
                f"%%torchrun --plan p or nbgpu run --plan FILE (srun --nodelist {self.nodelist}; "
                "each node sets its own CUDA_VISIBLE_DEVICES); the rendezvous port is picked on "
                "the first node when the job starts"
            )
            lines.append(Line(launch, label="launch"))
        return lines

    def text(self) -> str:
        return to_text(self.content(), width=120)  # the table's "left out" reasons are long

    def content(self) -> list[Block]:
        shape = f"{self.job_nodes} node(s) × {self.nproc_per_node} GPUs"
        sim = "SIMULATED " if self.simulated else ""
        verdict = "ready" if self.ok else "NOT READY"
        title = f"nbgpu plan — {shape} on {sim}{self.source} · {verdict}"
        blocks: list[Block] = [Title(title, simulated=self.simulated), self._table()]
        blocks += self._footer() + problem_blocks(self.problems, self.warnings)
        return blocks + alternative_blocks(
            [(f"{a.title}{a.status}: {a.reason}", ()) for a in self.alternatives]
        )

    def records(self) -> list[dict[str, Any]]:
        rows = []
        for n in self.nodes:
            after = {"cuda_visible_devices": n.cuda_visible_devices, "ok": self.ok}
            rows += [{"node": n.node, **to_data(g), **after} for g in n.gpus]
        return rows

    def to_dict(self) -> dict[str, Any]:
        return {"nbgpu_nodes_plan": PLAN_FILE_FORMAT, **to_data(self)}


@dataclass(frozen=True)
class _Node:
    name: str
    candidates: tuple[Candidate, ...]
    pool: tuple[Candidate, ...]  # usable GPUs, in the order they are handed out

    @property
    def capacity(self) -> int:
        return len(self.pool)

    def cleanliness(self, count: int) -> tuple[int, int]:
        """(caveats among the *count* GPUs it would give, its unusable GPUs): a node with a
        lost or held GPU comes after one without, since what broke one GPU (a fault, a stuck
        job) can still touch its neighbours."""
        return sum(c.grade for c in self.pool[:count]), len(self.candidates) - self.capacity

    def shortfall(self, per_node: int) -> str:
        out = f"{self.capacity} of {len(self.candidates)} GPUs usable, {per_node} needed"
        bad = [f"GPU {c.nvml_index}: {c.health}" for c in self.candidates if not c.usable]
        return out + (f" ({'; '.join(bad)})" if bad else "")


def default_shape(capacities: Sequence[int], nodes: int | None) -> tuple[int, int]:
    """(nodes, ranks per node) when the user left one or both out. With *nodes*: the most
    ranks per node that many nodes can all hold; without: the largest world, the larger
    per-node count on a tie (fewer nodes, less traffic between them)."""
    ordered = sorted(capacities, reverse=True)
    if nodes is not None:
        return nodes, ordered[nodes - 1] if nodes <= len(ordered) else 0
    shapes = [
        (sum(1 for c in ordered if c >= per_node), per_node) for per_node in set(ordered) - {0}
    ]
    return max(shapes, key=lambda shape: (shape[0] * shape[1], shape[1]), default=(0, 0))


def _memory(
    chosen: Sequence[NodeGpus],
    job: Job,
    world: int,
    batch: BatchCheck | None,
    *,
    problems: list[Problem],
    warnings: list[Problem],
) -> tuple[Job, tuple[MemoryCheck, ...], str | None]:
    """The memory check on the node whose smallest free GPU is the smallest of all."""
    if job.model is None or not chosen:
        return job, (), None
    smallest = smallest_free([g for node in chosen for g in node.gpus])
    deciding = next((node for node in chosen if smallest in node.gpus), chosen[0])
    # The job as one data-parallel training role over every rank of every node.
    role = RolePlan("train", "train", None, world, gpus=deciding.gpus)
    job = auto_max_micro([role], job, warnings)
    check = memory_check(role, job, batch)
    found: list[Problem] = []
    memory_problems(check, role, job, found, warnings)
    node = f"node {deciding.node}"
    problems.extend(replace(p, subject=node, message=f"{node}: {p.message}") for p in found)
    return job, (check,), deciding.node


def build_nodes_plan(
    node_candidates: Mapping[str, Sequence[Candidate]],
    source: str,
    simulated: bool,
    job: Job,
    *,
    nodes: int | None,
    nproc_per_node: int | None,
    alternatives: bool = True,
) -> NodesPlan:
    if not node_candidates:
        raise UserInputError("the cluster has no node to plan on")
    asked_nodes = whole_number("nodes", nodes)
    asked_per_node = whole_number("nproc_per_node", nproc_per_node)
    every = [_Node(name, tuple(c), tuple(order_pool(c))) for name, c in node_candidates.items()]
    if nodes is not None and nodes > len(every):
        raise UserInputError(
            f"nodes={nodes}: the cluster has {len(every)} node(s) "
            f"({', '.join(n.name for n in every)}); ask for at most {len(every)}"
        )
    capacities = [n.capacity for n in every]
    if nproc_per_node is None:
        shape_nodes, nproc_per_node = default_shape(capacities, nodes)
        nodes = nodes or shape_nodes or None
    if nodes is None:
        nodes = max(1, sum(1 for c in capacities if c >= nproc_per_node))
    per_node = max(1, nproc_per_node)
    fits = sorted(
        (n for n in every if n.capacity >= per_node),
        key=lambda n: (n.cleanliness(per_node), every.index(n)),
    )
    picked = {n.name for n in fits[:nodes]}
    chosen, left_out, warnings = [], [], []
    for n in every:
        if n.name not in picked:
            why = f"not needed: {nodes} node(s) asked for"
            if n.capacity < per_node:
                why = n.shortfall(per_node)
            left_out.append(NodeLeftOut(n.name, why))
            continue
        given = (assign(list(n.pool), [per_node]) or [list(n.pool[:per_node])])[0]
        chosen.append(NodeGpus(n.name, planned_gpus(given), excluded_gpus(n.candidates)))
        warnings += caveats(f"node {n.name}", given)
    problems: list[Problem] = []
    if len(chosen) < nodes or nproc_per_node < 1:
        short = [f"{n.node}: {n.reason}" for n in left_out if not n.reason.startswith("not ")]
        fixes = dict.fromkeys(
            f"on {n.name}: {c.problems[0].fixes[0]}"
            for n in every
            for c in n.candidates
            if not c.usable and c.recoverable and c.problems and c.problems[0].fixes
        )
        shape = f"{nodes} node(s) × {per_node} GPUs"
        message = (
            f"{shape} needs {nodes} node(s) with {per_node} usable GPUs each; {len(fits)} of "
            f"the {len(every)} node(s) do" + (f" ({'; '.join(short)})" if short else "")
        )
        problems.append(Problem("bad", "not_enough_nodes", shape, message, tuple(fixes)))
    world = nodes * per_node
    if len({g.memory_total_bytes for n in chosen for g in n.gpus}) > 1:
        why = "every rank holds the same micro batch, so the smallest decides"
        message = f"the nodes' GPUs differ in size: {why}; the memory check uses it"
        warnings.append(Problem("warn", "mixed_gpus", "nodes", message))
    batch = check_job_batch(job, world)
    if batch is not None and not batch.ok:
        problems.append(batch_problem(batch, f"{world} ranks"))
    job, memory, memory_node = _memory(
        chosen, job, world, batch, problems=problems, warnings=warnings
    )
    plan = NodesPlan(
        tuple(chosen),
        tuple(left_out),
        nodes,
        per_node,
        tuple(problems),
        tuple(warnings),
        batch,
        memory,
        memory_node,
        (),
        source,
        simulated,
        asked_nodes,
        asked_per_node,
    )
    if alternatives and problems:
        plan = replace(plan, alternatives=_alternatives(node_candidates, job, plan))
    return plan


def _alternatives(
    node_candidates: Mapping[str, Sequence[Candidate]], job: Job, plan: NodesPlan
) -> tuple[NodesAlternative, ...]:
    """Shapes that fit the usable GPUs: fewer nodes, or fewer ranks on each."""
    capacities = [len(order_pool(c)) for c in node_candidates.values()]
    wanted_nodes, per_node = plan.job_nodes, plan.nproc_per_node
    shapes = []
    full = sum(1 for c in capacities if c >= per_node)
    if 0 < full < wanted_nodes:
        shapes.append((full, per_node, f"the {full} node(s) with {per_node} usable GPUs"))
    fewer = default_shape(capacities, wanted_nodes)[1] if wanted_nodes <= len(capacities) else 0
    if 0 < fewer < per_node:
        shapes.append((wanted_nodes, fewer, f"{fewer} rank(s) on each of {wanted_nodes} nodes"))
    out = []
    for count, ranks, reason in shapes:
        alt_job, note = nearest_batch(job, count * ranks)
        alt = build_nodes_plan(
            node_candidates,
            plan.source,
            plan.simulated,
            alt_job,
            nodes=count,
            nproc_per_node=ranks,
            alternatives=False,
        )
        title = f"{count} node(s) × {ranks} GPUs ({', '.join(n.node for n in alt.nodes)}){note}"
        out.append(NodesAlternative(title, f"fits {reason}", plan=alt))
    return tuple(out)
