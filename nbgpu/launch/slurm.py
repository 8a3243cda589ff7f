"""Multi-node runs through SLURM: the ``srun`` command, the checks before it, ``scancel``.

A run with ``--slurm`` starts ``srun`` where a single-node run starts its agent: one task
per node (``--ntasks-per-node 1``), each running ``nbgpu.rank.slurm_node``, which finds the c10d
rendezvous and becomes torchrun's agent on its node. Inside an allocation (the kernel's
environment has ``SLURM_JOB_ID``) ``srun`` starts a step in it; otherwise it requests an
allocation for the run (named ``nbgpu-<run>``) that ends with the step, so nothing stays
queued. Stopping a run cancels the step, or the allocation nbgpu requested, with
``scancel``; SLURM then ends the tasks on every node.

Checked before anything is queued, each as one line with SLURM's own words where it gave
some: SLURM not installed, an unknown partition, more nodes than the partition (or the
allocation) holds, a malformed ``--time``.

A plan across nodes (``nbgpu.plan.nodes``) chose the nodes and each node's GPUs: the run
asks SLURM for exactly those nodes (``srun --nodelist``) and each node's agent takes its
own GPUs from ``NBGPU_NODE_GPUS`` before torchrun starts the ranks
(``nbgpu.rank.slurm_node``). What the user also typed must agree with the plan; each
disagreement is one line. Launch never imports ``plan/``: the plan is read through
:class:`NodesLaunchPlan`.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Protocol, TypeGuard

from nbgpu.errors import UserInputError
from nbgpu.launch.config import SlurmOptions
from nbgpu.launch.slurm_queue import refusal

__all__ = [
    "JOIN_TIMEOUT_S",
    "NODE_GPUS_ENV",
    "NodesLaunchPlan",
    "cancel",
    "check_request",
    "is_nodes_plan",
    "nodes_up",
    "request_args",
    "srun_argv",
    "srun_error",
    "take_nodes_plan",
]

JOIN_TIMEOUT_S = 120  # how long the nodes wait for each other at the rendezvous


def _run(argv: Sequence[str], environ: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            list(argv), env=dict(environ), capture_output=True, text=True, timeout=30,
            check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        raise UserInputError(f"SLURM: {argv[0]} failed to run ({exc})") from None


# Node states (sinfo %t, without its flag suffixes) in which a node will not take a job.
_UNUSABLE = ("down", "drain", "drng", "fail", "failg", "maint", "boot", "futr", "inval", "unk")


def _nodes_in_partition(partition: str | None, environ: Mapping[str, str]) -> tuple[int, int]:
    """(nodes that can run a job, nodes that cannot: down, drained, failed...)."""
    argv = ["sinfo", "-h", "-o", "%D %P %t"]
    if partition:
        argv += ["-p", partition]
    done = _run(argv, environ)
    if done.returncode != 0:
        words = (done.stderr.strip().splitlines() or ["no answer"])[-1]
        raise UserInputError(f"SLURM is not reachable here: sinfo says {words!r}")
    usable: dict[str, int] = {}
    unusable: dict[str, int] = {}
    for line in done.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0].isdigit():
            state = parts[2].rstrip("*~#!%$@^-+")  # flags: not responding, powered down...
            bucket = unusable if state in _UNUSABLE or parts[2].endswith("*") else usable
            bucket[parts[1]] = bucket.get(parts[1], 0) + int(parts[0])
    # Without --partition SLURM uses the default one, which sinfo marks with "*".
    names = set(usable) | set(unusable)
    default = {p for p in names if p.endswith("*")}
    chosen = default if not partition and default else names
    total = sum(usable.get(p, 0) for p in chosen)
    down = sum(unusable.get(p, 0) for p in chosen)
    if partition and total + down == 0:
        raise UserInputError(
            f"--partition {partition!r}: SLURM knows no such partition (sinfo -p lists none)"
        )
    return total, down


def nodes_up(partition: str | None, environ: Mapping[str, str]) -> int:
    """How many nodes of *partition* (default: the default one) can take a job (sinfo)."""
    return _nodes_in_partition(partition, environ)[0]


def check_request(nodes: int, options: SlurmOptions, environ: Mapping[str, str]) -> list[str]:
    """Refuse what SLURM would refuse or queue forever; the notes to announce."""
    if shutil.which("srun", path=environ.get("PATH")) is None:
        raise UserInputError(
            "--slurm: SLURM is not installed here (no srun on PATH); run on a cluster's login "
            "node, or drop --slurm"
        )
    job = environ.get("SLURM_JOB_ID")
    if job:
        have = int(environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or 1)
        if nodes > have:
            raise UserInputError(
                f"--nodes {nodes}: the allocation {job} holds {have} node(s); ask for at most "
                f"{have}, or start the notebook outside the allocation"
            )
        return [f"SLURM: a step of allocation {job} on {nodes} of its {have} node(s)"]
    total, down = _nodes_in_partition(options.partition, environ)
    where = f"partition {options.partition!r}" if options.partition else "the cluster"
    if nodes > total + down:
        raise UserInputError(
            f"--nodes {nodes}: {where} has {total + down} node(s) (sinfo); SLURM would queue "
            "this job forever"
        )
    if nodes > total:
        raise UserInputError(
            f"--nodes {nodes}: {where} has {total} node(s) up and {down} down or drained "
            "(sinfo); SLURM would queue this job until they return"
        )
    return [f"SLURM: requesting {nodes} node(s) from {where} for this run"]


def srun_argv(
    *,
    nodes: int,
    nproc: int,
    run_dir: Path,
    run_id: str,
    name: str,
    python: str,
    options: SlurmOptions,
    join_timeout_s: float | None = None,
) -> list[str]:
    """The ``srun`` command that starts one agent per node."""
    argv = [
        "srun", "--nodes", str(nodes), "--ntasks-per-node", "1",
        "--job-name", f"nbgpu-{name}",
        "--kill-on-bad-exit=1",  # one node's agent failing ends every node's
        "--label",  # agent.log lines start with the node's task number
        "--unbuffered",
    ]  # fmt: skip
    argv += request_args(options)
    argv += [
        python, "-m", "nbgpu.rank.slurm_node", str(run_dir), str(nodes), str(nproc),
        run_id, f"{join_timeout_s or JOIN_TIMEOUT_S:g}",
    ]  # fmt: skip
    return argv


def request_args(options: SlurmOptions) -> list[str]:
    """The ``srun`` options that say what to request (partition, time, account, GPUs)."""
    argv = []
    if options.partition:
        argv += ["--partition", options.partition]
    if options.time:
        argv += ["--time", options.time]
    if options.account:
        argv += ["--account", options.account]
    if options.gpus_per_node is not None:
        argv += [f"--gpus-per-node={options.gpus_per_node}"]
    if options.nodelist:
        argv += ["--nodelist", options.nodelist]
    return [*argv, *options.extra]


def srun_error(run_dir: Path) -> str | None:
    """SLURM's own reason when ``srun`` refused or lost the job (its last error line)."""
    refused = refusal(run_dir)  # a job cancelled because it would never leave the queue
    if refused is not None:
        return refused
    try:
        with (run_dir / "agent.log").open("rb") as log:
            log.seek(0, 2)
            log.seek(max(0, log.tell() - 65536))
            tail = log.read().decode("utf-8", "replace")
    except OSError:
        return None
    errors = [line.strip() for line in tail.splitlines() if line.startswith("srun: error:")]
    return errors[-1].removeprefix("srun: error:").strip() if errors else None


def cancel(run_dir: Path, environ: Mapping[str, str], *, requested: bool) -> str | None:
    """``scancel`` the run's step (or the allocation it requested); what was cancelled."""
    try:
        rdzv = json.loads((run_dir / "rdzv.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # no node started yet: stopping srun withdraws the request itself
    job, step = rdzv.get("job_id"), rdzv.get("step_id")
    if not job:
        return None
    target = str(job) if requested or step is None else f"{job}.{step}"
    with contextlib.suppress(UserInputError):
        _run(["scancel", target], environ)
    return target


# -- a plan across nodes ----------------------------------------------------------------

#: A plan's GPUs per node as JSON; each node takes its own entry (``nbgpu.rank.slurm_node``).
NODE_GPUS_ENV = "NBGPU_NODE_GPUS"


class _Problem(Protocol):
    @property
    def message(self) -> str: ...


class NodesLaunchPlan(Protocol):
    """What a launch takes from a plan across nodes."""

    @property
    def ok(self) -> bool: ...
    @property
    def problems(self) -> Sequence[_Problem]: ...
    @property
    def nodelist(self) -> str: ...
    @property
    def job_nodes(self) -> int: ...
    @property
    def nproc_per_node(self) -> int: ...
    @property
    def node_gpus(self) -> Mapping[str, str]: ...


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
