"""What to launch: a checked description of one torchrun job (or one more cell of a warm
job), and what the launcher reads from a plan (launch never imports plan/). Every value a
user gives is checked here, before anything starts: a mistake is one line naming the value
and the accepted form, and no process is spawned for it. Outside facts come in as arguments.
"""

import json
import pickle
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TypeGuard

from nbgpu._backends import BACKENDS
from nbgpu.errors import UserInputError
from nbgpu.profile.phases import parse_sample_interval
from nbgpu.sizes import parse_size as _parse_size

__all__ = [
    "BACKENDS", "CELL_OPTIONS", "HANG_AFTER_S", "NODE_GPUS_ENV", "ON_HANG", "CellRequest",
    "LaunchConfig", "LaunchPlan", "NodesLaunchPlan", "Prepared", "SlurmOptions",
    "is_nodes_plan", "parse_env_pairs", "parse_gpu_list", "parse_nproc", "parse_ranks",
    "parse_size", "pickle_pushed", "ranks_text", "start_only", "take_nodes_plan",
]  # fmt: skip

_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# A job with a collective pending this long and no output is stalled (launch/outcomes.py).
# NCCL's own watchdog gives up after 10 min; a look at 2 min leaves time to act.
HANG_AFTER_S = 120.0
ON_HANG = ("report", "stop")
_SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d+){0,2}$|^(UNLIMITED|INFINITE)$", re.IGNORECASE)


def parse_size(value: str | int) -> int:
    """Bytes from ``--mem-limit`` as written: the ranks' own reading, so both agree."""
    return _parse_size(value, "--mem-limit ")


@dataclass(frozen=True)
class SlurmOptions:
    """What to ask SLURM for (None: SLURM's or the allocation's default)."""

    partition: str | None = None
    time: str | None = None  # SLURM's forms: "30", "1:00:00", "1-12"
    account: str | None = None
    gpus_per_node: int | None = None
    extra: tuple[str, ...] = ()  # --slurm-arg, passed to srun as written
    nodelist: str | None = None  # the nodes a plan chose ("n1,n2"): srun --nodelist

    def __post_init__(self) -> None:
        if self.time is not None and not _SLURM_TIME.match(self.time):
            raise UserInputError(
                f"--time {self.time!r}: expected SLURM's forms MINUTES, HH:MM:SS or D-HH "
                "(e.g. --time 30 or --time 1:00:00)"
            )
        if self.gpus_per_node is not None and self.gpus_per_node < 0:
            raise UserInputError(f"--gpus-per-node {self.gpus_per_node}: expected a number >= 0")


def _check_cell(code: str | None, timeout_s: float | None) -> None:
    if code is not None and not code.strip():
        raise UserInputError(
            "the cell is empty: write the code each rank should run below %%torchrun"
        )
    if timeout_s is not None and not timeout_s > 0:
        raise UserInputError(f"--timeout {timeout_s}: expected seconds > 0")


@dataclass(frozen=True)
class LaunchConfig:
    """One job: the cell or script, how many ranks, where, and what to pass in/out."""

    nproc: int
    code: str | None = None  # a notebook cell's source
    script: Path | None = None  # or a script path (nbgpu run)
    script_args: tuple[str, ...] = ()
    name: str = "run"
    cuda_visible_devices: str | None = None  # None: inherit the environment's
    gpus: tuple[int, ...] | None = None  # physical GPUs chosen with --gpus
    timeout_s: float | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    push: Mapping[str, bytes] = field(default_factory=dict)  # name -> pickled value
    pull: tuple[str, ...] = ()
    pull_all_ranks: bool = False
    serial_imports: bool = False
    mem_limit_bytes: int | None = None
    mem_sample_s: float = 0.1  # memory sampling interval in every rank; 0: phases only
    backend: str | None = None
    master_port: int | None = None  # None: pick a free one at start
    quiet: bool = False
    strict: bool = False  # refuse to start when the code asks for CUDA the ranks lack
    keep: bool = False  # a warm job: the ranks stay up for more cells (--keep)
    idle_timeout_s: float | None = None  # a warm job ends after this long without a cell
    nnodes: int = 1
    slurm: SlurmOptions | None = None  # through SLURM: one agent per node, started by srun
    node_rank: int | None = None  # without SLURM: this node's rank (--node-rank)
    rdzv_endpoint: str | None = None  # without SLURM: HOST:PORT every node meets at
    rdzv_timeout_s: float | None = None  # several nodes: how long they wait for each other
    hang_after_s: float = HANG_AFTER_S  # stalled: no output and a collective pending this long
    on_hang: str = "report"  # or "stop": end the job once the stall is reported

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    def __post_init__(self) -> None:
        if (self.code is None) == (self.script is None):
            raise UserInputError("give either a cell (code) or a script path, not both or neither")
        _check_cell(self.code, self.timeout_s)
        if self.script is not None and not self.script.is_file():
            raise UserInputError(f"script {str(self.script)!r} does not exist or is not a file")
        if self.nproc < 1:
            raise UserInputError(f"nproc {self.nproc}: expected a whole number >= 1")
        if self.backend is not None and self.backend not in BACKENDS:
            raise UserInputError(
                f"--backend {self.backend!r}: expected one of {', '.join(BACKENDS)}"
            )
        parse_sample_interval(self.mem_sample_s)
        if self.master_port is not None and not 1024 <= self.master_port <= 65535:
            raise UserInputError(f"master port {self.master_port}: expected 1024-65535")
        if self.idle_timeout_s is not None:
            if not self.keep:
                raise UserInputError(
                    "--idle-timeout ends a warm job: give it with --keep (a cold run ends with "
                    "its cell; see --timeout)"
                )
            if not self.idle_timeout_s > 0:
                raise UserInputError(
                    f"--idle-timeout {self.idle_timeout_s!r}: expected seconds > 0 (e.g. 3600)"
                )
        if self.hang_after_s != 0 and not 1 <= self.hang_after_s <= 86400:
            raise UserInputError(
                f"--hang-after {self.hang_after_s!r}: expected seconds from 1 to 86400 "
                "(e.g. 300), or 0 to never look for a stall"
            )
        if self.on_hang not in ON_HANG:
            raise UserInputError(f"--on-hang {self.on_hang!r}: expected {' or '.join(ON_HANG)}")
        self._check_nodes()
        if self.keep and self.script is not None:
            raise UserInputError(
                "--keep keeps a notebook cell's ranks warm; a script runs once (drop --keep)"
            )

    def _check_nodes(self) -> None:
        if self.nnodes < 1:
            raise UserInputError(f"--nodes {self.nnodes}: expected a whole number >= 1")
        if self.rdzv_timeout_s is not None:
            if self.nnodes == 1:
                raise UserInputError(
                    "--rdzv-timeout is how long several nodes wait for each other: give "
                    "--nodes N too"
                )
            if not self.rdzv_timeout_s >= 1:
                raise UserInputError(
                    f"--rdzv-timeout {self.rdzv_timeout_s!r}: expected seconds >= 1 (e.g. 300)"
                )
        if self.keep and self.nnodes > 1 and self.slurm is None:
            raise UserInputError(
                "--keep with several nodes needs --slurm: the kernel then starts every node's "
                "ranks and carries their cells (or drop --keep)"
            )
        if self.slurm is not None:
            if self.node_rank is not None or self.rdzv_endpoint is not None:
                raise UserInputError(
                    "--slurm chooses node ranks and the rendezvous itself: drop --node-rank and "
                    "--rdzv-endpoint"
                )
            return
        if self.nnodes == 1:
            if self.node_rank not in (None, 0) or self.rdzv_endpoint is not None:
                raise UserInputError(
                    "--node-rank and --rdzv-endpoint are for runs over several nodes: give "
                    "--nodes N too"
                )
            return
        if self.rdzv_endpoint is None or not re.match(r"^[^:\s]+:\d{2,5}$", self.rdzv_endpoint):
            raise UserInputError(
                f"--nodes {self.nnodes} without --slurm: give --rdzv-endpoint HOST:PORT (the "
                f"address every node reaches, e.g. node1:29400), not {self.rdzv_endpoint!r}"
            )
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise UserInputError(
                f"--node-rank {self.node_rank}: expected 0 to {self.nnodes - 1} for --nodes "
                f"{self.nnodes}"
            )


@dataclass(frozen=True)
class CellRequest:
    """One more cell for a warm job: its code and what it sends and brings back."""

    code: str
    push: Mapping[str, bytes] = field(default_factory=dict)  # name -> pickled value
    pull: tuple[str, ...] = ()
    pull_all_ranks: bool = False
    script_args: tuple[str, ...] = ()
    timeout_s: float | None = None  # past it the cell is interrupted on every rank
    quiet: bool = False
    ranks: tuple[int, ...] | None = None  # --ranks: only these run it (None: every rank)

    def __post_init__(self) -> None:
        _check_cell(self.code, self.timeout_s)


#: What may differ from one cell of a warm job to the next (keyword -> its flag).
CELL_OPTIONS = {
    "push": "--push",
    "pull": "--pull",
    "pull_all_ranks": "--all-ranks",
    "script_args": "-- ARGS",
    "timeout_s": "--timeout",
    "quiet": "--quiet",
    "ranks": "--ranks",
}


def start_only(flag: str, name: str) -> UserInputError:
    """The one-line refusal of a flag that only applies when a job starts."""
    return UserInputError(
        f"{flag} with --on {name}: {flag} only applies when a job starts, and '{name}' is "
        f"already running; with --on a cell accepts only "
        f"{', '.join(sorted(set(CELL_OPTIONS.values())))} (or start a new job)"
    )


def ranks_text(ranks: Sequence[int]) -> str:
    """Ranks as a person writes them: ``0-3``, ``0,2``, ``0-2,5`` (sorted, runs joined)."""
    runs: list[list[int]] = []
    for rank in sorted(set(ranks)):
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def parse_ranks(value: object, world_size: int) -> tuple[int, ...]:
    """``--ranks 0`` / ``0,2`` / ``1-3`` (or a rank, or a list of them, from Python): the
    ranks of a warm job that run a cell, sorted; one line for anything else."""
    text = ",".join(map(str, value)) if isinstance(value, list | tuple | set) else str(value)
    accepted = f"expected ranks of the job (0-{world_size - 1}) such as 0, 0,2 or 1-3"
    if not text.strip():
        raise UserInputError(f"--ranks {text!r}: no rank given; {accepted}")
    chosen: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or (dash and int(high) < int(low)):
            raise UserInputError(f"--ranks {text!r}: {part!r} is not a rank or range; {accepted}")
        chosen.update(range(int(low), int(high or low) + 1))
    outside = sorted(chosen - set(range(world_size)))
    if outside:
        raise UserInputError(
            f"--ranks {text}: the job has ranks 0-{world_size - 1}, not {ranks_text(outside)}"
        )
    return tuple(sorted(chosen))


def parse_nproc(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UserInputError(
            f"nproc {text!r} is not a number: expected a whole number of processes on this "
            "node, e.g. 4"
        ) from None
    if value < 1:
        raise UserInputError(f"nproc {value}: expected a whole number >= 1")
    return value


def parse_env_pairs(items: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise UserInputError(f"--env {item!r}: expected KEY=VALUE, e.g. --env NCCL_DEBUG=INFO")
        if not _ENV_KEY.match(key):
            raise UserInputError(f"--env {item!r}: {key!r} is not a valid variable name")
        out[key] = value
    return out


def parse_gpu_list(text: str, known: Sequence[int]) -> tuple[int, ...]:
    """'0,1,3' → (0, 1, 3), checked against the physical GPUs that exist."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise UserInputError(f"--gpus {text!r}: expected GPU indices such as 0,1,3")
    out = []
    for part in parts:
        if not part.isdigit():
            raise UserInputError(
                f"--gpus {text!r}: {part!r} is not a GPU index (e.g. --gpus 0,1,3)"
            )
        index = int(part)
        if index not in known:
            have = ",".join(str(k) for k in known) or "none"
            raise UserInputError(f"--gpus {text!r}: GPU {index} does not exist (GPUs here: {have})")
        if index in out:
            raise UserInputError(
                f"--gpus {text!r}: GPU {index} is listed twice (CUDA would then see no GPU)"
            )
        out.append(index)
    return tuple(out)


def pickle_pushed(names: Sequence[str], namespace: Mapping[str, Any]) -> dict[str, bytes]:
    """Pickle notebook variables for the ranks; one line per missing/unpicklable name."""
    out: dict[str, bytes] = {}
    for name in names:
        if name not in namespace:
            raise UserInputError(f"--push {name}: no variable {name!r} in the notebook")
        try:
            out[name] = pickle.dumps(namespace[name], protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001  (pickle raises many kinds; all mean "cannot send")
            raise UserInputError(
                f"--push {name}: {type(namespace[name]).__name__} cannot be pickled "
                f"({type(exc).__name__}: {exc}); send data (arrays, dicts, state_dicts), not live "
                "objects"
            ) from None
    return out


@dataclass(frozen=True)
class Prepared:
    """A checked job and the launcher's notes about it (GPUs left out, the plan's role)."""

    config: LaunchConfig
    notes: tuple[str, ...] = field(default=())


class PlanRole(Protocol):
    """One role of an ``nbgpu.plan`` result."""

    @property
    def name(self) -> str: ...
    @property
    def cuda_visible_devices(self) -> str: ...
    @property
    def nproc_per_node(self) -> int: ...
    @property
    def master_port(self) -> int | None: ...


class PlanProblem(Protocol):
    @property
    def message(self) -> str: ...


class _Plan(Protocol):
    @property
    def ok(self) -> bool: ...
    @property
    def problems(self) -> Sequence[PlanProblem]: ...


class LaunchPlan(_Plan, Protocol):
    """An ``nbgpu.plan`` result."""

    @property
    def roles(self) -> Sequence[PlanRole]: ...


class NodesLaunchPlan(_Plan, Protocol):
    """A plan across nodes (``nbgpu.plan.nodes``)."""

    @property
    def nodelist(self) -> str: ...
    @property
    def job_nodes(self) -> int: ...
    @property
    def nproc_per_node(self) -> int: ...
    @property
    def node_gpus(self) -> Mapping[str, str]: ...


#: A plan's GPUs per node as JSON; each node takes its own entry (``nbgpu.rank.slurm_node``).
NODE_GPUS_ENV = "NBGPU_NODE_GPUS"


def is_nodes_plan(plan: object) -> TypeGuard[NodesLaunchPlan]:
    return all(hasattr(plan, name) for name in ("nodelist", "node_gpus", "job_nodes"))


def take_nodes_plan(
    plan: NodesLaunchPlan,
    *,
    nproc: int | None,
    nnodes: int,
    slurm: SlurmOptions | None,
    gpus: object,
    role: str | None,
    env: Mapping[str, str],
    notes: list[str],
) -> tuple[int, int, SlurmOptions, dict[str, str]]:
    """(ranks per node, nodes, what to ask SLURM for, the run's environment) from *plan*."""
    if not plan.ok:
        first = plan.problems[0].message if plan.problems else "not ready"
        raise UserInputError(f"--plan: the plan is not ready: {first}")
    if not plan.job_nodes or not plan.nproc_per_node:
        raise UserInputError(
            "--plan: the plan has no training role to launch (an inference-only allocation "
            "places servers, which torchrun does not start)"
        )
    if gpus is not None:
        raise UserInputError(
            "--plan and --gpus both choose GPUs: give one of them (the plan chose each node's)"
        )
    if role is not None:
        raise UserInputError(f"--role {role!r}: a plan across nodes has one training role")
    if nnodes not in (1, plan.job_nodes):
        raise UserInputError(
            f"--nodes {nnodes}: the plan is for {plan.job_nodes} node(s) ({plan.nodelist}); "
            "drop --nodes or plan again"
        )
    if nproc is not None and nproc != plan.nproc_per_node:
        raise UserInputError(
            f"--nproc-per-node {nproc}: the plan gives {plan.nproc_per_node} rank(s) per node; "
            "drop it or plan again"
        )
    options = slurm or SlurmOptions()
    if options.nodelist or any(a.startswith(("--nodelist", "-w")) for a in options.extra):
        raise UserInputError("--plan chose the nodes: drop --nodelist/-w from --slurm-arg")
    options = replace(options, nodelist=plan.nodelist)
    out = dict(env)
    if options.gpus_per_node is None:
        out[NODE_GPUS_ENV] = json.dumps(dict(plan.node_gpus))
        each = "; ".join(f"{node}: GPUs {gpus}" for node, gpus in plan.node_gpus.items())
        notes.append(f"plan across nodes: {each}")
    else:
        notes.append(
            f"plan across nodes {plan.nodelist}: SLURM assigns each node's GPUs "
            f"(--gpus-per-node {options.gpus_per_node})"
        )
    return plan.nproc_per_node, plan.job_nodes, options, out
