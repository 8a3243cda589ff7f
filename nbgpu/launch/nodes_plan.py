"""A plan across nodes (``nbgpu.plan.nodes``), as a SLURM launch reads it.

The plan chose the nodes and each node's GPUs: the run asks SLURM for exactly those
nodes (``srun --nodelist``) and each node's agent takes its own GPUs from
``NBGPU_NODE_GPUS`` before torchrun starts the ranks (``nbgpu.rank.slurm_node``). What the user
also typed must agree with the plan; each disagreement is one line. Launch never imports
``plan/``: the plan is read through the fields below.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Protocol, TypeGuard

from nbgpu.errors import UserInputError
from nbgpu.launch.config import SlurmOptions

__all__ = ["NODE_GPUS_ENV", "NodesLaunchPlan", "is_nodes_plan", "take_nodes_plan"]

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
