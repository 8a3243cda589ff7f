"""A run's processes: the first one it starts, and all of them found and stopped.

The first process (:func:`start_agent`, in its own session, output in ``agent.log``) is
nbgpu's wrapped torchrun (``nbgpu.rank.agent``): on one node with a static rendezvous on
a free loopback port; over several nodes started by hand (``--rdzv-endpoint``) with
torchrun's c10d rendezvous, the same cell run on every node; through SLURM it is
``srun``, one task per node (``slurm.srun_argv``).

torchrun puts each worker in its own session, so killing the agent's process group does
not reach them, and a SIGKILLed agent orphans them. nbgpu therefore finds a run's
processes two ways (the agent's descendants, and any process of this user whose
environment carries the run's ``NBGPU_RUN_ID``) and stops them with a ladder: a first
signal (SIGINT or SIGTERM), SIGTERM, then SIGKILL, sharing one deadline. Never IPython.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from nbgpu._deadline import wait_gone
from nbgpu._lineage import set_parent_death_signal, with_package_importable
from nbgpu.errors import NbgpuError
from nbgpu.launch.config import LaunchConfig
from nbgpu.launch.slurm import srun_argv

__all__ = ["RUN_ID_ENV", "StopReport", "free_port", "run_processes", "stop_processes"]

RUN_ID_ENV = "NBGPU_RUN_ID"
# Nodes started by hand (a cell on each) can take minutes to all arrive: torchrun's default.
MANUAL_JOIN_TIMEOUT_S = 600.0


def agent_log(run_dir: Path) -> Path:
    return run_dir / "agent.log"


def free_port(taken: set[int] | None = None) -> int:
    """A TCP port nobody listens on now (the kernel picks; we skip ports our runs hold)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if not taken or port not in taken:
            return port
    raise NbgpuError("no free TCP port found for the rendezvous")


def agent_argv(config: LaunchConfig, run_dir: Path, run_id: str, port: int) -> list[str]:
    """The argv of the process a run starts (the agent, or ``srun``)."""
    if config.slurm is not None:
        return srun_argv(config, run_dir, run_id)
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


def _environ(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


def carries_run_id(pid: int, run_id: str | None) -> bool:
    """Whether process *pid* is one of run *run_id*'s (a reused pid is not)."""
    return run_id is not None and f"{RUN_ID_ENV}={run_id}".encode() in _environ(pid)


def _user_processes() -> list[psutil.Process]:
    uid = os.getuid()
    out = []
    for proc in psutil.process_iter(["uids"]):
        with contextlib.suppress(psutil.Error, AttributeError, TypeError):
            if proc.info["uids"].real == uid:
                out.append(proc)
    return out


def live_run_ids() -> set[str]:
    """Run ids carried by any live process of this user (every process, not a tree)."""
    prefix = f"{RUN_ID_ENV}=".encode()
    return {
        item[len(prefix) :].decode(errors="replace")
        for proc in _user_processes()
        for item in _environ(proc.pid)
        if item.startswith(prefix)
    }


def run_processes(run_id: str, root_pid: int | None = None) -> list[psutil.Process]:
    """Every live process of the run: the root's tree plus orphans carrying its id."""
    found: dict[int, psutil.Process] = {}
    if root_pid is not None:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(root_pid)
            found[root.pid] = root
            for child in root.children(recursive=True):
                found[child.pid] = child
    me = os.getpid()
    for proc in _user_processes():
        if proc.pid != me and proc.pid not in found and carries_run_id(proc.pid, run_id):
            found[proc.pid] = proc
    return [p for p in found.values() if _alive(p)]


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@dataclass(frozen=True)
class StopReport:
    signalled: int  # processes that were alive when stopping began
    escalated_to_kill: int  # how many needed SIGKILL
    survivors: tuple[int, ...]  # pids still alive after the deadline (should be empty)


def _signal_and_wait(procs: list[psutil.Process], sig: int, until: float) -> list[psutil.Process]:
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)
    return wait_gone(procs, lambda p: not _alive(p), until)


def stop_processes(
    run_id: str,
    root_pid: int | None,
    *,
    first_signal: int = signal.SIGTERM,
    grace_s: float = 3.0,
    kill_wait_s: float = 2.0,
) -> StopReport:
    """Signal the whole run, escalate within one deadline, and report survivors: the first
    signal to the agent only (torchrun forwards it and shuts its workers down in order),
    SIGTERM to all at half the grace period, SIGKILL at the deadline.
    """
    started = time.monotonic()
    procs = run_processes(run_id, root_pid)
    if not procs:
        return StopReport(0, 0, ())
    root = [p for p in procs if p.pid == root_pid]
    for proc in root or procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(first_signal)
    alive = wait_gone(procs, lambda p: not _alive(p), started + grace_s / 2)
    if alive:
        # Refresh: the agent may have spawned or orphaned processes meanwhile.
        alive = _signal_and_wait(
            run_processes(run_id, root_pid) or alive, signal.SIGTERM, started + grace_s
        )
    killed = 0
    if alive:
        alive = run_processes(run_id, root_pid) or alive
        killed = len(alive)
        alive = _signal_and_wait(alive, signal.SIGKILL, time.monotonic() + kill_wait_s)
    return StopReport(len(procs), killed, tuple(p.pid for p in alive))
