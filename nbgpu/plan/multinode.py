"""Planning one training job across several nodes: which nodes, which GPUs on each.

torchrun starts the same number of ranks on every node (``--nproc-per-node P``), so a
node is usable for a job of *P* ranks per node when it has *P* usable GPUs. The planner
takes each node's :class:`~nbgpu.plan.placement.Candidate` GPUs (the same sorting of
findings as on one box), keeps the nodes that can hold *P* ranks (clean ones first), and
checks the batch and the memory for the whole world of ``nodes × P`` ranks: ZeRO and
FSDP shard over all of them, and every rank holds the same micro batch, so the smallest
free GPU of any chosen node decides what fits.

Defaults: without *P*, the largest number of ranks per node that still gives the most
ranks in total; without *nodes*, every node that can hold *P* ranks. When the job does
not fit, the plan names each node that falls short and why, and offers what does fit:
fewer nodes, fewer ranks per node, each with its batch checked again.

Ports are not planned here: the rendezvous port is chosen on the first node when the job
starts (a free port there, not here). Pure: never reads an inventory, files or sockets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from nbgpu.errors import UserInputError
from nbgpu.plan.batch import BatchCheck
from nbgpu.plan.job import Job, batch_problem, check_job_batch
from nbgpu.plan.memcheck import auto_max_micro, free_bytes, memory_check, memory_problems
from nbgpu.plan.nodesplan import NodeGpus, NodeLeftOut, NodesAlternative, NodesPlan
from nbgpu.plan.placement import Candidate, assign, excluded_gpus, order_pool
from nbgpu.plan.result import MemoryCheck, PlannedGpu, RolePlan
from nbgpu.problems import Problem

__all__ = ["build_nodes_plan", "default_shape"]


@dataclass(frozen=True)
class _Node:
    name: str
    candidates: tuple[Candidate, ...]
    pool: tuple[Candidate, ...]  # usable GPUs, in the order they are handed out

    @property
    def capacity(self) -> int:
        return len(self.pool)

    def cleanliness(self, count: int) -> tuple[int, int]:
        """(caveats among the *count* GPUs it would give, its unusable GPUs): (0, 0) is a
        node with nothing wrong. A node with a lost or held GPU comes after one without:
        what broke one GPU (a fault, a stuck job) can still touch its neighbours."""
        return sum(c.grade for c in self.pool[:count]), len(self.candidates) - self.capacity


def default_shape(capacities: Sequence[int], nodes: int | None) -> tuple[int, int]:
    """(nodes, ranks per node) when the user left one or both out.

    With *nodes* given: the most ranks per node that many nodes can all hold. Without:
    the ranks per node that give the largest world, the larger per-node count on a tie
    (fewer nodes, less traffic between them).
    """
    ordered = sorted(capacities, reverse=True)
    if nodes is not None:
        return nodes, ordered[nodes - 1] if nodes <= len(ordered) else 0
    best = (0, 0)
    for per_node in sorted(set(ordered), reverse=True):
        if per_node == 0:
            continue
        count = sum(1 for c in ordered if c >= per_node)
        if count * per_node > best[0] * best[1]:
            best = (count, per_node)
    return best


def _shortfall(node: _Node, per_node: int) -> str:
    out = f"{node.capacity} of {len(node.candidates)} GPUs usable, {per_node} needed"
    bad = [f"GPU {c.nvml_index}: {c.health}" for c in node.candidates if not c.usable]
    return out + (f" ({'; '.join(bad)})" if bad else "")


def _chosen_gpus(node: _Node, per_node: int) -> tuple[PlannedGpu, ...]:
    groups = assign(list(node.pool), [per_node], keep_order=False)
    members = groups[0] if groups else list(node.pool[:per_node])
    return tuple(
        PlannedGpu(k, c.nvml_index, c.uuid, c.name, c.memory_total_bytes, c.memory_free_bytes)
        for k, c in enumerate(members)
    )


def _trainer(world: int, gpus: Sequence[PlannedGpu]) -> RolePlan:
    """The job as one data-parallel training role over every rank of every node."""
    return RolePlan("train", "train", None, world, 1, 1, tuple(gpus), None)


def _batch(job: Job, world: int) -> BatchCheck | None:
    if all(v is None for v in (job.global_batch, job.micro_batch, job.grad_accum)):
        return None
    return check_job_batch(job, world)


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

    def tightest(node: NodeGpus) -> int:
        known = [b for b in map(free_bytes, node.gpus) if b is not None]
        return min(known) if known else 2**63

    deciding = min(chosen, key=tightest)
    role = _trainer(world, deciding.gpus)
    job = auto_max_micro([role], job, warnings)
    check = memory_check(role, job, batch)
    found: list[Problem] = []
    memory_problems(check, role, job, found, warnings)
    node = f"node {deciding.node}"
    problems.extend(replace(p, subject=node, message=f"{node}: {p.message}") for p in found)
    return job, (check,), deciding.node


def _mixed_sizes(chosen: Sequence[NodeGpus]) -> Problem | None:
    sizes = {(n.node, g.memory_total_bytes) for n in chosen for g in n.gpus}
    if len({size for _, size in sizes}) < 2:
        return None
    return Problem(
        "warn",
        "mixed_gpus",
        "nodes",
        "the nodes' GPUs differ in size: every rank holds the same micro batch, so the "
        "smallest decides; the memory check uses it",
    )


def build_nodes_plan(
    node_candidates: Mapping[str, Sequence[Candidate]],
    job: Job,
    *,
    nodes: int | None,
    nproc_per_node: int | None,
    source: str,
    simulated: bool,
    alternatives: bool = True,
) -> NodesPlan:
    """Place one training job of *nodes* × *nproc_per_node* ranks on the nodes' GPUs."""
    if not node_candidates:
        raise UserInputError("the cluster has no node to plan on")
    for label, value in (("nodes", nodes), ("nproc_per_node", nproc_per_node)):
        if value is not None and (isinstance(value, bool) or value < 1):
            raise UserInputError(f"{label}={value!r}: expected a whole number >= 1")
    every = [
        _Node(name, tuple(cands), tuple(order_pool(cands)))
        for name, cands in node_candidates.items()
    ]
    if nodes is not None and nodes > len(every):
        raise UserInputError(
            f"nodes={nodes}: the cluster has {len(every)} node(s) "
            f"({', '.join(n.name for n in every)}); ask for at most {len(every)}"
        )
    asked_nodes, asked_per_node = nodes, nproc_per_node
    if nproc_per_node is None:
        shape_nodes, nproc_per_node = default_shape([n.capacity for n in every], nodes)
        nodes = nodes or shape_nodes or None
    if nodes is None:
        nodes = max(1, sum(1 for n in every if n.capacity >= nproc_per_node))
    per_node = max(1, nproc_per_node)
    fits = sorted(
        (n for n in every if n.capacity >= per_node),
        key=lambda n: (n.cleanliness(per_node), every.index(n)),
    )
    picked = {n.name for n in fits[:nodes]}
    chosen = tuple(
        NodeGpus(n.name, _chosen_gpus(n, per_node), excluded_gpus(n.candidates))
        for n in every
        if n.name in picked
    )
    left_out = tuple(
        NodeLeftOut(n.name, _shortfall(n, per_node))
        if n.capacity < per_node
        else NodeLeftOut(n.name, f"not needed: {nodes} node(s) asked for")
        for n in every
        if n.name not in picked
    )
    problems: list[Problem] = []
    warnings: list[Problem] = []
    if len(chosen) < nodes or nproc_per_node < 1:
        short = [f"{n.node}: {n.reason}" for n in left_out if not n.reason.startswith("not ")]
        fixes = [
            f"on {n.name}: {c.problems[0].fixes[0]}"
            for n in every
            for c in n.candidates
            if not c.usable and c.recoverable and c.problems and c.problems[0].fixes
        ]
        problems.append(
            Problem(
                "bad",
                "not_enough_nodes",
                f"{nodes} node(s) × {per_node} GPUs",
                f"{nodes} node(s) × {per_node} GPUs needs {nodes} node(s) with {per_node} usable "
                f"GPUs each; {len(fits)} of the {len(every)} node(s) do"
                + (f" ({'; '.join(short)})" if short else ""),
                tuple(dict.fromkeys(fixes)),
            )
        )
    world = nodes * per_node
    by_name = {n.name: n for n in every}
    for node in chosen:
        given = {g.nvml_index for g in node.gpus}
        warnings.extend(
            Problem("warn", "gpu_caveat", f"node {node.node}", f"node {node.node}: {p.message}")
            for c in by_name[node.node].pool
            if c.nvml_index in given and c.grade > 0
            for p in c.problems
        )
    mixed = _mixed_sizes(chosen)
    if mixed is not None:
        warnings.append(mixed)
    batch = _batch(job, world)
    if batch is not None and not batch.ok:
        problems.append(batch_problem(batch, f"{world} ranks"))
    job, memory, memory_node = _memory(
        chosen, job, world, batch, problems=problems, warnings=warnings
    )
    plan = NodesPlan(
        nodes=chosen,
        left_out=left_out,
        job_nodes=nodes,
        nproc_per_node=per_node,
        problems=tuple(problems),
        warnings=tuple(warnings),
        batch=batch,
        memory=memory,
        memory_node=memory_node,
        alternatives=(),
        source=source,
        simulated=simulated,
        asked_nodes=asked_nodes,
        asked_nproc_per_node=asked_per_node,
    )
    if alternatives and problems:
        plan = replace(
            plan,
            alternatives=_alternatives(
                node_candidates,
                job,
                plan,
                capacities=[n.capacity for n in every],
                source=source,
                simulated=simulated,
            ),
        )
    return plan


def _alternatives(
    node_candidates: Mapping[str, Sequence[Candidate]],
    job: Job,
    plan: NodesPlan,
    *,
    capacities: Sequence[int],
    source: str,
    simulated: bool,
) -> tuple[NodesAlternative, ...]:
    """Shapes that fit the usable GPUs: fewer nodes, or fewer ranks on each."""
    wanted_nodes = plan.job_nodes
    per_node = plan.nproc_per_node
    shapes = []
    full = sum(1 for c in capacities if c >= per_node)
    if 0 < full < wanted_nodes:
        shapes.append((full, per_node, f"the {full} node(s) with {per_node} usable GPUs"))
    fewer = default_shape(capacities, wanted_nodes)[1] if wanted_nodes <= len(capacities) else 0
    if 0 < fewer < per_node:
        shapes.append((wanted_nodes, fewer, f"{fewer} rank(s) on each of {wanted_nodes} nodes"))
    out = []
    for count, ranks, reason in shapes:
        note = ""
        alt_job = job
        batch = _batch(job, count * ranks)
        if batch is not None and not batch.ok and batch.nearest:
            new = min(batch.nearest, key=lambda o: abs(o.global_batch - (job.global_batch or 0)))
            alt_job = replace(job, global_batch=new.global_batch)
            note = f", global batch {new.global_batch} instead of {job.global_batch}"
        alt = build_nodes_plan(
            node_candidates, alt_job, nodes=count, nproc_per_node=ranks, source=source,
            simulated=simulated, alternatives=False,
        )  # fmt: skip
        title = f"{count} node(s) × {ranks} GPUs ({', '.join(n.node for n in alt.nodes)}){note}"
        out.append(NodesAlternative(title, f"fits {reason}", plan=alt))
    return tuple(out)
