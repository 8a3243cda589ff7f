"""A job across several nodes: which nodes, which GPUs on each, for which role, checked.

torchrun starts the same number of ranks on every node, so a role takes *k* usable GPUs on
each of its nodes, clean ones first, in order (small roles share a node). A job of N × P
ranks is one role; an allocation's parts are placed in order, ranks node by node, each
instance (t × p × c GPUs: a server, a replica) inside a node, or over whole nodes with its
tensor groups inside each when it is larger (AReaL's SLURM launcher does the same). Batch
and memory are checked for the role torchrun starts. What does not fit names each node that
falls short; alternatives offer fewer nodes or ranks. Pure: never reads inventories, files.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, ClassVar

from nbgpu._render import Block, Line, Result, Table, Title, to_text
from nbgpu._serial import to_data
from nbgpu.errors import UserInputError
from nbgpu.plan.allocation import Allocation, RoleSpec, parse_allocation
from nbgpu.plan.job import BatchCheck, Job, nearest_batch
from nbgpu.plan.memcheck import auto_max_micro, memory_check, memory_problems, smallest_free
from nbgpu.plan.placement import Candidate, assign, excluded_gpus, order_pool, planned_gpus
from nbgpu.plan.planner import batch_problem, caveats, trainer_batch
from nbgpu.plan.result import (
    PLAN_FILE_FORMAT,
    ExcludedGpu,
    MemoryCheck,
    PlannedGpu,
    RolePlan,
    alternative_blocks,
    check_lines,
    memory_table,
    problem_blocks,
)
from nbgpu.problems import Problem
from nbgpu.scale import ScalePlan

__all__ = ["NodeGpus", "NodeLeftOut", "NodesAlternative", "NodesPlan", "build_nodes_plan",
           "default_shape", "short_nodes"]  # fmt: skip


@dataclass(frozen=True)
class NodeGpus:
    """One node's GPUs for one role's ranks (in ``cuda:k`` order), and the node's left out."""

    JSON_EXTRAS: ClassVar[tuple[str, ...]] = ("cuda_visible_devices",)

    node: str
    gpus: tuple[PlannedGpu, ...]
    excluded: tuple[ExcludedGpu, ...] = ()
    role: str = "train"  # an allocation's role; a colocated pair has a row each

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
    plan: "NodesPlan"

    @property
    def status(self) -> str:
        return " — ready" if self.plan.ok else f" — also blocked ({self.plan.problems[0].message})"


@dataclass(frozen=True)
class NodesPlan(Result):
    """What launchers read, for the role torchrun starts (``launched``: the job or an
    allocation's first trainer): ``ok``, ``nodelist`` (``srun --nodelist``), ``nproc_per_node``,
    ``node_gpus`` (node → ``CUDA_VISIBLE_DEVICES``); ``nodes`` has every role's GPUs per node.
    ``batch`` and ``memory`` are that role's, checked on ``memory_node`` (its smallest GPU)."""

    JSON_EXTRAS: ClassVar[tuple[str, ...]] = ("ok", "nodelist", "world_size", "node_gpus")
    FRAME_COLUMNS = ("node", "role", "cuda_index", "nvml_index", "uuid")

    nodes: tuple[NodeGpus, ...]  # the nodes placed (fewer than job_nodes when not ready)
    left_out: tuple[NodeLeftOut, ...]
    job_nodes: int  # the nodes the launched role runs on
    nproc_per_node: int
    problems: tuple[Problem, ...]
    warnings: tuple[Problem, ...]
    batch: BatchCheck | None
    memory: tuple[MemoryCheck, ...]
    memory_node: str | None
    alternatives: tuple[NodesAlternative, ...]
    source: str  # where the nodes' inventories came from: "allocation 17", a file
    simulated: bool
    allocation: str | None = None  # canonical, when the job has roles

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def world_size(self) -> int:
        return self.job_nodes * self.nproc_per_node

    @property
    def launched(self) -> str | None:
        if self.allocation is None:
            return "train"
        return next((r.name for r in parse_allocation(self.allocation).train_roles), None)

    @property
    def nodelist(self) -> str:
        return ",".join(self.node_gpus)

    @property
    def node_gpus(self) -> dict[str, str]:
        return {n.node: n.cuda_visible_devices for n in self.nodes if n.role == self.launched}

    def simulated_fleet(self) -> str | None:
        return self.source if self.simulated else None

    def _table(self) -> Table:
        table = Table(["node", "role", "GPUs (CUDA_VISIBLE_DEVICES)", "ranks", "GPU", "left out"])
        for n in self.nodes:
            names = "/".join(sorted({(g.name or "?").replace("NVIDIA ", "") for g in n.gpus}))
            out = "; ".join(f"GPU {e.nvml_index}: {e.health}" for e in n.excluded) or "-"
            table.add(n.node, n.role, n.cuda_visible_devices, len(n.gpus), names, out)
        for left in self.left_out:
            table.add(left.node, "-", "-", 0, "-", left.reason, level="warn")
        return table

    def _footer(self) -> list[Block]:
        world = f"{self.world_size} ranks ({self.job_nodes} × {self.nproc_per_node})"
        lines: list[Block] = [] if self.allocation else [Line(world, label="world")]
        for role in parse_allocation(self.allocation).roles if self.allocation else ():
            # Where its instances (t × p × c GPUs: a server, a replica) lie.
            mine = [n for n in self.nodes if n.role == role.name]
            per_node, unit = len(mine[0].gpus) if mine else 1, role.instance_gpus
            where = f"over {-(-unit // per_node)} nodes" if per_node < unit else "within a node"
            shape = f"{len(mine)} node(s) × {per_node} GPUs"
            text = f"{shape}; {role.data_parallel} instance(s) of {unit} GPUs, each {where}"
            text = text if mine else "not placed"
            lines.append(Line(f"{role.degrees}: {text}", label=f"role {role.name}"))
        lines += check_lines(self.batch, self.memory, bool(self.node_gpus))
        launch = (
            f"%%torchrun --plan p or nbgpu run --plan FILE (srun --nodelist {self.nodelist}; "
            "each node sets its own CUDA_VISIBLE_DEVICES); the rendezvous port is picked on "
            "the first node when the job starts"
        )
        other = "not started by --plan: start it on its nodes with their CUDA_VISIBLE_DEVICES"
        for name in dict.fromkeys(n.role for n in self.nodes) if self.ok else ():
            text = launch if name == self.launched else other
            lines.append(Line(f"role {name}: {text}", label="launch"))
        return lines

    def text(self) -> str:
        return to_text(self.content(), width=120)  # the table's "left out" reasons are long

    def content(self) -> list[Block]:
        shape = f"{self.job_nodes} node(s) × {self.nproc_per_node} GPUs"
        if self.allocation is not None:
            shape = f"{self.allocation} over {len({n.node for n in self.nodes})} node(s)"
        sim = "SIMULATED " if self.simulated else ""
        verdict = "ready" if self.ok else "NOT READY"
        title = f"nbgpu plan — {shape} on {sim}{self.source} · {verdict}"
        blocks: list[Block] = [Title(title, simulated=self.simulated), self._table()]
        blocks += self._footer() + ([memory_table(self.memory)] if self.memory else [])
        blocks += problem_blocks(self.problems, self.warnings)
        return blocks + alternative_blocks(
            [(f"{a.title}{a.status}: {a.reason}", ()) for a in self.alternatives]
        )

    def records(self) -> list[dict[str, Any]]:
        rows = []
        for n in self.nodes:
            after = {"cuda_visible_devices": n.cuda_visible_devices, "ok": self.ok}
            rows += [{"node": n.node, "role": n.role, **to_data(g), **after} for g in n.gpus]
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


def _per_node(role: RoleSpec, most: int) -> list[int]:
    """The ranks per node a role may take, best first: whole instances on each node, or an
    instance larger than *most* over whole nodes, its tensor-parallel groups inside each."""
    unit, ks = role.instance_gpus, range(most, 0, -1)
    if unit <= most:
        return [k for k in ks if role.world_size % k == 0 and k % unit == 0]
    inside = [k for k in ks if unit % k == 0 and k % role.tensor_parallel == 0]
    return inside or [k for k in ks if unit % k == 0]


def _place(
    every: Sequence[_Node], allocation: Allocation, most: int, *, exact: bool
) -> tuple[list[NodeGpus], dict[str, tuple[int, int]], list[Problem], list[Problem]]:
    """Each role's GPUs per node, its shape (nodes, ranks per node), problems and warnings;
    without an allocation the job takes exactly *most* ranks per node."""
    free = {n.name: list(n.pool) for n in every}
    # What broke one GPU (a fault, a stuck job) can still touch its neighbours: such last.
    rank = {n.name: (len(n.candidates) - n.capacity, i) for i, n in enumerate(every)}
    placed: dict[str, list[NodeGpus]] = {}
    shapes: dict[str, tuple[int, int]] = {}
    problems: list[Problem] = []
    warnings: list[Problem] = []

    def fits(k: int) -> list[_Node]:  # clean first; in order, so small roles share a node
        have = (n for n in every if len(free[n.name]) >= k)
        return sorted(have, key=lambda n: (sum(c.grade for c in free[n.name][:k]), *rank[n.name]))

    for role in allocation.roles:
        if role.colocated_with is not None:
            placed[role.name] = [replace(g, role=role.name) for g in placed[role.colocated_with]]
            shapes[role.name] = shapes[role.colocated_with]
            continue
        ks = (_per_node(role, most) or [1])[: 1 if exact else None]
        per_node = next((k for k in ks if len(fits(k)) * k >= role.world_size), ks[0])
        count, found = role.world_size // per_node, fits(per_node)
        shapes[role.name], placed[role.name] = (count, per_node), []
        for n in sorted(found[:count], key=lambda n: rank[n.name][1]):
            given = (assign(free[n.name], [per_node]) or [free[n.name][:per_node]])[0]
            free[n.name] = [c for c in free[n.name] if c not in given]
            gpus = planned_gpus(given)
            placed[role.name].append(NodeGpus(n.name, gpus, excluded_gpus(n.candidates), role.name))
            warnings += caveats(f"node {n.name}", given)
        label = f"role {role.name}: " if len(allocation.roles) > 1 else ""
        if len(found) < count:
            short = [f"{n.name}: {n.shortfall(per_node)}" for n in every if n.capacity < per_node]
            fixes = dict.fromkeys(
                f"on {n.name}: {c.problems[0].fixes[0]}"
                for n in every
                for c in n.candidates
                if not c.usable and c.recoverable and c.problems and c.problems[0].fixes
            )
            shape = f"{count} node(s) × {per_node} GPUs"
            message = (
                f"{label}{shape} needs {count} node(s) with {per_node} usable GPUs each; "
                f"{len(found)} of the {len(every)} node(s) {'have them left' if label else 'do'}"
            ) + (f" ({'; '.join(short)})" if short else "")
            subject = label[:-2] or shape
            problems.append(Problem("bad", "not_enough_nodes", subject, message, tuple(fixes)))
        if role.tensor_parallel > per_node:
            why = f"t{role.tensor_parallel} spans nodes of {per_node} GPUs: all-reduces cross them"
            warnings.append(Problem("warn", "tensor_across_nodes", f"role {role.name}", why))
    return [g for gpus in placed.values() for g in gpus], shapes, problems, warnings


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
    every = [_Node(name, tuple(c), tuple(order_pool(c))) for name, c in node_candidates.items()]
    if nodes is not None and nodes > len(every):
        raise UserInputError(
            f"nodes={nodes}: the cluster has {len(every)} node(s) "
            f"({', '.join(n.name for n in every[:8])}{', ...' * (len(every) > 8)}); "
            f"ask for at most {len(every)}"
        )
    capacities = [n.capacity for n in every]
    allocation = job.allocation
    if allocation is None:  # one training role of nodes × ranks per node
        if nproc_per_node is None:
            shape_nodes, nproc_per_node = default_shape(capacities, nodes)
            nodes = nodes or shape_nodes or None
        if nodes is None:
            nodes = max(1, sum(1 for c in capacities if c >= nproc_per_node))
        most = max(1, nproc_per_node)
        allocation = Allocation((RoleSpec("train", "train", None, nodes * most),))
    else:  # an instance no larger than a node's GPUs stays in one, usable or not
        most = min(nproc_per_node or 1 << 30, max(len(n.candidates) for n in every))
    chosen, shapes, problems, warnings = _place(every, allocation, most, exact=not job.allocation)
    used = dict.fromkeys(n.node for n in chosen)
    if job.allocation is not None and nodes is not None and len(used) > nodes:
        message = f"{allocation.text} takes {len(used)} node(s); nodes={nodes} asked for"
        problems.append(Problem("bad", "not_enough_nodes", "nodes", message))
    need = min(k for _, k in shapes.values())
    why = f"{nodes} node(s) asked for" if job.allocation is None else f"{len(used)} node(s) do"
    left_out = [
        NodeLeftOut(n.name, n.shortfall(need) if n.capacity < need else f"not needed: {why}")
        for n in every
        if n.name not in used
    ]
    launched = next(iter(allocation.train_roles), None)
    job_nodes, ranks = shapes[launched.name] if launched else (0, 0)
    mine = [n for n in chosen if launched and n.role == launched.name]
    if len({g.memory_total_bytes for n in mine for g in n.gpus}) > 1:
        why = "every rank holds the same micro batch, so the smallest decides"
        message = f"the nodes' GPUs differ in size: {why}; the memory check uses it"
        warnings.append(Problem("warn", "mixed_gpus", "nodes", message))
    batch = trainer_batch(allocation, job, warnings)
    if batch is not None and not batch.ok and launched is not None:
        world = f"{job_nodes * ranks} ranks" if job.allocation is None else ""
        problems.append(batch_problem(batch, world or f"role {launched.name}"))
    memory: tuple[MemoryCheck, ...] = ()
    memory_node = None
    if job.model is not None and mine and launched is not None:
        # Checked on the node whose smallest free GPU is the smallest of the role; the role's
        # name there says which node, in the checks and the memory table.
        smallest = smallest_free([g for n in mine for g in n.gpus])
        deciding = next((n for n in mine if smallest in n.gpus), mine[0])
        name, memory_node = f"{launched.name} on {deciding.node}", deciding.node
        role = RolePlan(**{**vars(launched), "name": name}, gpus=deciding.gpus)
        job = auto_max_micro([role], job, warnings)
        memory = (memory_check(role, job, batch),)
        memory_problems(memory[0], role, job, problems, warnings)
    plan = NodesPlan(
        tuple(chosen),
        tuple(left_out),
        job_nodes,
        ranks,
        tuple(problems),
        tuple(warnings),
        batch,
        memory,
        memory_node,
        (),
        source,
        simulated,
        job.allocation.text if job.allocation else None,
    )
    if alternatives and problems and job.allocation is None:
        again = partial(build_nodes_plan, node_candidates, source, simulated, alternatives=False)
        plan = replace(plan, alternatives=_alternatives(again, capacities, job, plan))
    return plan


def _alternatives(
    again: Callable[..., NodesPlan], capacities: Sequence[int], job: Job, plan: NodesPlan
) -> tuple[NodesAlternative, ...]:
    """Shapes that fit the usable GPUs (*again* plans one): fewer nodes, or fewer ranks on each."""
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
        alt = again(alt_job, nodes=count, nproc_per_node=ranks)
        title = f"{count} node(s) × {ranks} GPUs ({', '.join(n.node for n in alt.nodes)}){note}"
        out.append(NodesAlternative(title, f"fits {reason}", plan=alt))
    return tuple(out)


def short_nodes(plan: ScalePlan, gpus: Mapping[str, tuple[Candidate, ...]]) -> list[Problem]:
    """A rescaled config's problem when too few nodes have its GPUs per node usable (``""``:
    one fleet, which every node is taken to be like)."""
    per = plan.to_gpus // plan.nodes
    short = {n: k for n, g in gpus.items() if (k := sum(c.usable for c in g)) < per}
    if not short or ("" not in gpus and len(gpus) - len(short) >= plan.nodes):
        return []
    why = "; ".join(
        f"{f'{node}: ' if node else ''}{k} usable"
        + "".join(f" (GPU {c.nvml_index}: {c.health})" for c in gpus[node] if not c.usable)
        for node, k in short.items()
    )
    most, usable = len(gpus) if "" not in gpus else plan.to_gpus, min(short.values())
    fixes = [
        f"--nodes {n}"
        for n in range(plan.nodes, most + 1)
        if plan.to_gpus % n == 0 and plan.to_gpus // n <= usable
    ][:1] + [f"--to {plan.nodes * usable}"] * (usable > 0)
    message = f"{plan.nodes} node(s) × {per} GPUs, but the fleet has {why}"
    if "" not in gpus:
        fit = len(gpus) - len(short)
        message = f"{plan.nodes} node(s) × {per} GPUs: {fit} of the {len(gpus)} nodes have {per} usable GPUs ({why})"
    return [Problem("bad", "not_enough_gpus", "GPUs", message, tuple(fixes))]
