"""The command that starts a run's agents: one local torchrun, or one per node.

- One node: nbgpu's wrapped torchrun (``nbgpu.rank.agent``) with a static rendezvous on
  loopback and a port nobody holds.
- Several nodes without SLURM (``--nnodes N --rdzv-endpoint HOST:PORT [--node-rank R]``):
  the same agent with torchrun's c10d rendezvous; the user starts the same cell on every
  node, and each run's ranks meet at the endpoint.
- SLURM (``--slurm --nodes N``): ``srun`` with one task per node, each task finding the
  c10d rendezvous on the step's first node (``nbgpu.rank.slurm_node``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from nbgpu.launch.config import LaunchConfig

__all__ = ["MANUAL_JOIN_TIMEOUT_S", "agent_argv"]

# Nodes started by hand (a cell on each) can take minutes to all arrive: torchrun's default.
MANUAL_JOIN_TIMEOUT_S = 600.0


def agent_argv(config: LaunchConfig, run_dir: Path, run_id: str, port: int) -> list[str]:
    """The argv of the process ``Run.start()`` launches (the agent, or ``srun``)."""
    if config.slurm is not None:
        from nbgpu.launch.slurm import srun_argv  # noqa: PLC0415  (SLURM runs only)

        return srun_argv(
            nodes=config.nnodes,
            nproc=config.nproc,
            run_dir=run_dir,
            run_id=run_id,
            name=config.name,
            python=sys.executable,
            options=config.slurm,
            join_timeout_s=config.rdzv_timeout_s,
        )
    argv = [sys.executable, "-m", "nbgpu.rank.agent", str(run_dir / "result.json"), "--"]
    if config.nnodes == 1:
        rendezvous = [
            "--nnodes", "1", "--node-rank", "0",
            "--master-addr", "127.0.0.1", "--master-port", str(port),
        ]  # fmt: skip
    else:
        rendezvous = [
            "--nnodes", str(config.nnodes),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", str(config.rdzv_endpoint),
            # Every node's cell must use the same id: the run's name is what they share.
            "--rdzv-id", f"nbgpu-{config.name}",
            "--rdzv-conf", f"join_timeout={config.rdzv_timeout_s or MANUAL_JOIN_TIMEOUT_S:g}",
        ]  # fmt: skip
        if config.node_rank is not None:
            rendezvous += ["--node-rank", str(config.node_rank)]
    return [
        *argv,
        *rendezvous,
        "--nproc-per-node", str(config.nproc),
        "--max-restarts", "0",
        "--log-dir", str(run_dir / "torchelastic"),
        "--module", "nbgpu.rank.worker",
    ]  # fmt: skip
