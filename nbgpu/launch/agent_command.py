"""The process that starts a run's agents (one local torchrun, or one per node), and how.

- One node: nbgpu's wrapped torchrun (``nbgpu.rank.agent``) with a static rendezvous on
  loopback and a port nobody holds.
- Several nodes without SLURM (``--nnodes N --rdzv-endpoint HOST:PORT [--node-rank R]``):
  the same agent with torchrun's c10d rendezvous; the user starts the same cell on every
  node, and each run's ranks meet at the endpoint.
- SLURM (``--slurm --nodes N``): ``srun`` with one task per node, each task finding the
  c10d rendezvous on the step's first node (``nbgpu.rank.slurm_node``).

:func:`start_agent` starts it in its own session with the workers' environment
(:func:`agent_env`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from nbgpu._lineage import set_parent_death_signal, with_package_importable
from nbgpu.launch.config import LaunchConfig
from nbgpu.launch.procs import RUN_ID_ENV
from nbgpu.launch.rundir import agent_log

__all__ = ["MANUAL_JOIN_TIMEOUT_S", "agent_argv", "agent_env", "start_agent"]

# Nodes started by hand (a cell on each) can take minutes to all arrive: torchrun's default.
MANUAL_JOIN_TIMEOUT_S = 600.0


def agent_argv(config: LaunchConfig, run_dir: Path, run_id: str, port: int) -> list[str]:
    """The argv of the process a run starts (the agent, or ``srun``)."""
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


def agent_env(
    config: LaunchConfig, environ: Mapping[str, str], run_dir: Path, run_id: str
) -> dict[str, str]:
    """The environment of the agent and, through it, of every rank."""
    env = with_package_importable({**environ, **config.env})
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets anyway, minus its banner
    env["NBGPU_RUN_DIR"] = str(run_dir)
    env[RUN_ID_ENV] = run_id
    env["NBGPU_RUN_NAME"] = config.name
    env["NBGPU_LAUNCHER_PID"] = str(os.getpid())
    # torchrun's agent-level error file (each rank gets its own from torchrun).
    env["TORCHELASTIC_ERROR_FILE"] = str(run_dir / "agent-error.json")
    if config.backend:
        env["NBGPU_BACKEND"] = config.backend
    if config.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = config.cuda_visible_devices
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # so indices mean nvidia-smi's
    # ipykernel turns fd capture off under pytest; nothing in ranks should care.
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def start_agent(
    config: LaunchConfig, run_dir: Path, run_id: str, port: int, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    """Start the run's first process, its output in ``agent.log``."""
    with agent_log(run_dir).open("wb") as log:
        return subprocess.Popen(
            agent_argv(config, run_dir, run_id, port),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            # cwd is inherited: ranks start where the notebook runs, so relative paths
            # in a cell mean the same thing as in the kernel.
            # Own session: the notebook's interrupt reaches the kernel only; nbgpu then
            # stops the job deliberately (SIGINT, SIGTERM, SIGKILL on one deadline).
            start_new_session=True,
            # srun is not ours to change: the kernel sets its parent-death signal (a
            # killed srun ends its step on every node). Our agent sets its own.
            preexec_fn=_die_with_launcher if config.slurm is not None else None,  # noqa: PLW1509  (prctl only, no locks)
        )


def _die_with_launcher() -> None:
    set_parent_death_signal(signal.SIGTERM)
