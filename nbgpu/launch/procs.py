"""A run's processes: the first one it starts, all of them found and stopped, and every
rank's Python stack on request. The first process (:func:`start_agent`: nbgpu's wrapped
torchrun, or ``srun``) has its own session. torchrun puts each worker in its own session too,
so killing the agent's process group does not reach them, and a SIGKILLed agent orphans them:
a run's processes are the agent's descendants and this user's processes carrying its run id.

For runs that hang, each rank registers ``faulthandler`` on ``STACKS_SIGNAL`` before any
user code (``nbgpu.rank.worker``): its dumps go to ``stacks-rank{N}.txt``, its pid to
``stacks-rank{N}.pid``. No ptrace: a rank blocked in C code (a collective) still answers,
one stopped with SIGSTOP is named as such; native frames come from py-spy.
"""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import psutil

from nbgpu._children import set_parent_death_signal, wait_gone
from nbgpu._render import Block, Line, Pre, Result, Title
from nbgpu._serial import read_json_object, to_data
from nbgpu.errors import NbgpuError
from nbgpu.launch.config import LaunchConfig
from nbgpu.launch.slurm import srun_argv
from nbgpu.launch.spare import FR_BUFFER, RUN_ID_ENV, base_agent_env, take_spare

__all__ = [
    "FR_BUFFER", "STACKS_SIGNAL", "RunStacks", "StopReport", "free_port", "rank_stacks",
    "run_processes", "stop_processes", "wait_for_dump",
]  # fmt: skip

KILL_WAIT_S = 2.0  # after SIGKILL: how long to wait for the processes to go
# Nodes started by hand (a cell on each) can take minutes to all arrive: torchrun's default.
MANUAL_JOIN_TIMEOUT_S = 600.0


def agent_log(run_dir: Path) -> Path:
    return run_dir / "agent.log"


def free_port(taken: set[int] | None = None) -> int:
    """A port the kernel picks, not one of *taken* (the rendezvous ports our runs hold)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if not taken or port not in taken:
            return port
    raise NbgpuError("no free TCP port found for the rendezvous")


def agent_args(config: LaunchConfig, run_dir: Path, port: int) -> list[str]:
    """What ``python -m nbgpu.rank.agent`` is given: ``RESULT.json -- <torchrun args>``."""
    argv = [str(run_dir / "result.json"), "--"]
    if config.nnodes == 1:
        argv += ["--nnodes", "1", "--master-port", str(port)]  # the agent sets the address
    else:
        argv += ["--nnodes", str(config.nnodes), "--rdzv-backend", "c10d"]
        argv += ["--rdzv-endpoint", str(config.rdzv_endpoint)]
        # Every node's cell must use the same id: the run's name is what they share.
        argv += ["--rdzv-id", f"nbgpu-{config.name}"]
        argv += ["--rdzv-conf", f"join_timeout={config.rdzv_timeout_s or MANUAL_JOIN_TIMEOUT_S:g}"]
        if config.node_rank is not None:
            argv += ["--node-rank", str(config.node_rank)]
    argv += ["--nproc-per-node", str(config.nproc), "--max-restarts", "0"]
    return [*argv, "--log-dir", str(run_dir / "torchelastic"), "--module", "nbgpu.rank.worker"]


def agent_env(
    config: LaunchConfig, environ: Mapping[str, str], run_dir: Path, run_id: str
) -> dict[str, str]:
    env = base_agent_env({**environ, **config.env}, run_id)
    env["NBGPU_RUN_DIR"] = str(run_dir)
    env["NBGPU_RUN_NAME"] = config.name
    # torchrun's agent-level error file (each rank gets its own from torchrun).
    env["TORCHELASTIC_ERROR_FILE"] = str(run_dir / "agent-error.json")
    # On GPUs NCCL also dumps the flight records when its watchdog times out, here where
    # `nbgpu diagnose RUN_DIR` reads them.
    env.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(run_dir / "nccl_trace_rank_"))
    if config.backend:
        env["NBGPU_BACKEND"] = config.backend
    if config.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = config.cuda_visible_devices
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # so indices mean nvidia-smi's
    return env


def start_agent(
    config: LaunchConfig, run_dir: Path, run_id: str, port: int, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    """The run's agent: the one started early for it when there is one (``spare``)."""
    if config.slurm is not None:
        # srun is not ours to change: the kernel sets its parent-death signal (a killed
        # srun ends its step on every node). Our agent on each node sets its own.
        argv = srun_argv(config, run_dir, run_id)
        dies = partial(set_parent_death_signal, signal.SIGTERM)
    else:
        args = agent_args(config, run_dir, port)
        spare = take_spare()
        if spare is not None and spare.run_id != run_id:
            spare.cancel()  # it carries another run's id; taken, so no block would end it
        elif spare is not None and (agent := spare.start(args, env, agent_log(run_dir))):
            return agent
        argv, dies = [sys.executable, "-m", "nbgpu.rank.agent", *args], None
    with agent_log(run_dir).open("wb") as log:
        return subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            # cwd is inherited: ranks start where the notebook runs, so relative paths
            # in a cell mean the same thing as in the kernel.
            # Own session: the notebook's interrupt reaches the kernel only; nbgpu then
            # stops the job deliberately (SIGINT, SIGTERM, SIGKILL on one deadline).
            start_new_session=True,
            preexec_fn=dies,  # noqa: PLW1509  (prctl only, no locks)
        )


def _environ(pid: int) -> list[bytes]:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return []


def carries_run_id(pid: int, run_id: str | None) -> bool:
    """Whether process *pid* is one of run *run_id*'s (a reused pid is not)."""
    return run_id is not None and f"{RUN_ID_ENV}={run_id}".encode() in _environ(pid)


def _user_processes() -> list[psutil.Process]:
    uid = os.getuid()  # (a process we may not read has uids None: not ours)
    return [p for p in psutil.process_iter(["uids"]) if getattr(p.info["uids"], "real", -1) == uid]


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
            found.update((p.pid, p) for p in [root, *root.children(recursive=True)])
    me = os.getpid()
    for proc in _user_processes():
        if proc.pid != me and proc.pid not in found and carries_run_id(proc.pid, run_id):
            found[proc.pid] = proc
    return [p for p in found.values() if _alive(p)]


def _alive(proc: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    return False


@dataclass(frozen=True)
class StopReport:
    signalled: int  # processes that were alive when stopping began
    escalated_to_kill: int  # how many needed SIGKILL
    survivors: tuple[int, ...]  # pids still alive after the deadline (should be empty)


def _signal_and_wait(
    procs: list[psutil.Process], sig: int, until: float, only: list[psutil.Process] | None = None
) -> list[psutil.Process]:
    for proc in only or procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)
    return wait_gone(procs, lambda p: not _alive(p), until)


def stop_processes(
    run_id: str, root_pid: int | None, *, first_signal: int = signal.SIGTERM, grace_s: float = 3.0
) -> StopReport:
    """Signal the whole run, escalate within one deadline, and report survivors: the first
    signal to the agent only (torchrun forwards it and shuts its workers down in order),
    SIGTERM to all at half the grace period, SIGKILL at the deadline."""
    started = time.monotonic()
    procs = run_processes(run_id, root_pid)
    if not procs:
        return StopReport(0, 0, ())
    root = [p for p in procs if p.pid == root_pid]
    alive = _signal_and_wait(procs, first_signal, started + grace_s / 2, only=root)
    if alive:
        # Refresh: the agent may have spawned or orphaned processes meanwhile.
        alive = _signal_and_wait(
            run_processes(run_id, root_pid) or alive, signal.SIGTERM, started + grace_s
        )
    killed = 0
    if alive:
        alive = run_processes(run_id, root_pid) or alive
        killed = len(alive)
        alive = _signal_and_wait(alive, signal.SIGKILL, time.monotonic() + KILL_WAIT_S)
    return StopReport(len(procs), killed, tuple(p.pid for p in alive))


# A real-time signal: nothing in Python, torch or common launchers uses it, unlike
# SIGUSR1 (Lightning, Slurm preemption) and SIGUSR2.
STACKS_SIGNAL = signal.SIGRTMIN + 3  # type: ignore[attr-defined,unused-ignore]
_SETTLE_S = 0.2  # a dump is complete when its file stops growing this long


@dataclass(frozen=True)
class RankStack:
    rank: int
    pid: int | None
    state: str  # "dumped", "stopped (SIGSTOP)", "exited", "no answer", "not started"
    python: str  # faulthandler's dump ("" if none)
    native: str  # py-spy's dump, or why there is none


@dataclass(frozen=True)
class RunStacks(Result):
    run_dir: Path
    ranks: tuple[RankStack, ...]
    native_note: str

    @property
    def complete(self) -> bool:
        return bool(self.ranks) and all(r.state == "dumped" for r in self.ranks)

    def content(self) -> list[Block]:
        blocks: list[Block] = [Title(f"stacks of {self.run_dir.name} ({len(self.ranks)} ranks)")]
        for r in self.ranks:
            head = f"── rank {r.rank} (pid {r.pid or '-'}): {r.state}"
            blocks.append(Line(head, level="" if r.state == "dumped" else "warn", wrap=False))
            dump = [*r.python.rstrip().splitlines(), *r.native.rstrip().splitlines()]
            if dump:
                blocks.append(Pre("\n".join("   " + line for line in dump)))
        if self.native_note:
            blocks.append(Line(self.native_note, wrap=False))
        return blocks

    def records(self) -> list[dict[str, Any]]:
        return [to_data(r) for r in self.ranks]

    def to_dict(self) -> dict[str, Any]:
        return {"run_dir": str(self.run_dir), "ranks": self.records(), "native": self.native_note}


_STOPPED = "stopped (SIGSTOP): it answers only after SIGCONT"


def _stopped(pid: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    return False


def wait_for_dump(path: Path, start: int, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    last_size, last_change = start, time.monotonic()
    while time.monotonic() < deadline:
        size = path.stat().st_size if path.exists() else 0
        now = time.monotonic()
        if size != last_size:
            last_size, last_change = size, now
        elif size > start and now - last_change >= _SETTLE_S:
            break
        time.sleep(0.02)
    if last_size <= start:
        return ""
    with path.open("rb") as f:
        f.seek(start)
        return f.read().decode("utf-8", errors="replace")


def _py_spy(pid: int) -> str:
    exe = shutil.which("py-spy")
    if exe is None:
        return ""
    argv = [exe, "dump", "--native", "--pid", str(pid)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"py-spy: {exc}"
    if done.returncode != 0:
        first = (done.stderr.strip().splitlines() or ["failed"])[0]
        return f"py-spy could not attach: {first}"
    return done.stdout


def rank_stacks(run_dir: Path, *, timeout_s: float = 5.0, native: bool = False) -> RunStacks:
    """Ask every live rank of the run for its Python stack, all at once."""
    meta = read_json_object(run_dir / "run.json")
    nproc = int(meta.get("nproc") or 0)
    run_id = meta.get("run_id")
    asked: dict[int, tuple[int, int]] = {}  # rank -> (pid, offset before the signal)
    stacks: dict[int, RankStack] = {}  # the ranks that were not asked
    for rank in range(nproc):
        try:
            pid = int((run_dir / f"stacks-rank{rank}.pid").read_text().strip())
        except (OSError, ValueError):
            why = "not started (or started before stacks were registered)"
            stacks[rank] = RankStack(rank, None, why, "", "")
            continue
        if not carries_run_id(pid, run_id):
            stacks[rank] = RankStack(rank, pid, "exited", "", "")
            continue
        if _stopped(pid):
            stacks[rank] = RankStack(rank, pid, _STOPPED, "", "")
            continue
        path = run_dir / f"stacks-rank{rank}.txt"
        offset = path.stat().st_size if path.exists() else 0
        try:
            os.kill(pid, STACKS_SIGNAL)
        except OSError as exc:
            stacks[rank] = RankStack(rank, pid, f"could not signal: {exc.strerror}", "", "")
            continue
        asked[rank] = (pid, offset)
    deadline = time.monotonic() + timeout_s
    dumps: dict[int, str] = {}
    for rank, (_pid, offset) in asked.items():
        left = max(0.5, deadline - time.monotonic())
        dumps[rank] = wait_for_dump(run_dir / f"stacks-rank{rank}.txt", offset, left)
    for rank, (pid, _offset) in asked.items():
        state = "dumped" if dumps[rank] else f"no answer within {timeout_s:g} s"
        if not dumps[rank] and _stopped(pid):
            state = _STOPPED
        stacks[rank] = RankStack(rank, pid, state, dumps[rank], _py_spy(pid) if native else "")
    note = ""
    if native and shutil.which("py-spy") is None:
        note = "native frames: py-spy is not installed (pip install py-spy); Python stacks only"
    elif not native:
        note = "native frames: add --native (needs py-spy and permission to ptrace)"
    return RunStacks(run_dir, tuple(stacks[rank] for rank in range(nproc)), note)
