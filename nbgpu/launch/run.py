"""A Run: one torchrun job's processes, from start to collected outcomes.

``Run.start()`` writes the run directory (cell, bootstrap spec, pushed values),
picks a free port, and starts the wrapped torchrun agent (``nbgpu.rank.agent``) in its own
session with the workers' environment; ``poll_lines()`` reads what the ranks wrote
(``follow.py`` loops over it); ``stop()`` ends the whole process tree against one
deadline; ``finish()`` collects per-rank outcomes (``outcomes.py``) and, for a failed
run, the diagnosis. How a run reads is ``run_view.py``; this process's runs are
``registry.py``.

Owns processes; never imports IPython, ipywidgets or matplotlib (faces render).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbgpu._lineage import set_parent_death_signal, with_package_importable
from nbgpu.errors import NbgpuError
from nbgpu.launch import rundir
from nbgpu.launch.agent_command import agent_argv
from nbgpu.launch.config import LaunchConfig
from nbgpu.launch.notices import RunNotices
from nbgpu.launch.outcomes import (
    RankOutcome,
    collect_pulled,
    first_failure_without_diagnosis,
    rank_outcomes,
    read_agent_result,
)
from nbgpu.launch.procs import RUN_ID_ENV, StopReport, run_processes, stop_processes
from nbgpu.launch.registry import ports_in_use, register
from nbgpu.launch.run_view import RunView
from nbgpu.launch.slurm_queue import QueueWatch
from nbgpu.launch.streams import MAX_LOGS_PER_POLL, LineSink, LogTail, ScreenWriter, in_turn

if TYPE_CHECKING:
    from nbgpu.diagnose.report import Diagnosis
    from nbgpu.launch.warm import WarmState
    from nbgpu.profile.live import MemoryFollower
    from nbgpu.profile.report import MemoryReport

__all__ = ["Run", "RunFailed", "free_port", "leftover_processes"]

TERMINAL_STATES = ("succeeded", "failed", "stopped", "timed_out", "interrupted")


class RunFailed(NbgpuError):
    """A run ended without success; ``.run`` has every detail (ranks, logs, root cause).

    ``output_shown``: the ranks' output was streamed where this failure is shown, so the
    report does not repeat the traceback.
    """

    def __init__(self, run: Run, *, output_shown: bool = False) -> None:
        super().__init__(run.failure_summary())
        self.run = run
        self.output_shown = output_shown

    def _render_traceback_(self) -> list[str]:
        # A short, readable failure in the notebook instead of a chained traceback wall.
        return self.run.failure_lines(output_shown=self.output_shown)


def free_port(taken: set[int] | None = None) -> int:
    """A TCP port nobody listens on now (the kernel picks; we skip ports our runs hold)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if not taken or port not in taken:
            return port
    raise NbgpuError("no free TCP port found for the rendezvous")


class Run(RunView):
    """A torchrun job started by nbgpu. Renders as text/HTML; see ``ranks``, ``logs``."""

    def __init__(self, config: LaunchConfig, *, environ: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.environ = dict(os.environ if environ is None else environ)
        self.name = config.name
        self.run_id = secrets.token_hex(8)
        self.state = "created"
        self.dir: Path = Path()
        self.port: int | None = config.master_port
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self.first_output_at: float | None = None
        self.agent: subprocess.Popen[bytes] | None = None
        self.ranks: tuple[RankOutcome, ...] = ()
        self.root_cause: RankOutcome | None = None
        self.pulled: dict[str, Any] = {}
        self.pulled_all: list[dict[str, Any]] = []
        self.pull_problems: list[str] = []
        self.stop_report: StopReport | None = None
        self.diagnosis: Diagnosis | None = None  # why the run did not succeed, if it did not
        self.diagnosis_error: str | None = None  # why the diagnosis itself failed, if it did
        self.stop_reason: str | None = None
        self.agent_result: dict[str, Any] = {}
        self.writer: LineSink | None = None
        self._tails: dict[int, LogTail] = {}
        self._poll_cursor = 0  # where the next poll starts when the logs take turns
        self._nodes: dict[int, str] = {}  # rank -> its node's name (several nodes only)
        self._memory: MemoryFollower | None = None  # made on first use
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self.notices = RunNotices(config.world_size)  # one-line messages, each shown once
        self.queue: QueueWatch | None = None  # a SLURM job while it waits in the queue
        self.thread: threading.Thread | None = None
        self.warm: WarmState | None = None  # a warm job's ranks between cells (--keep)

    # -- start -------------------------------------------------------------------

    def start(self) -> Run:
        cfg = self.config
        self.notices.prune_old_runs(self.environ)
        self.dir = rundir.make_run_dir(cfg.name, self.environ)
        self.notices.run_dir = self.dir
        spec: dict[str, Any] = {
            "serial_imports": cfg.serial_imports,
            "mem_limit_bytes": cfg.mem_limit_bytes,
            "mem_sample_s": cfg.mem_sample_s,
            "pull": list(cfg.pull),
            "pull_all_ranks": cfg.pull_all_ranks,
            "script_args": list(cfg.script_args),
        }
        if cfg.keep:
            # A warm job: the ranks take every cell, the first one too, from the channel.
            from nbgpu.launch.channel import CellServer  # noqa: PLC0415
            from nbgpu.launch.warm import WarmState  # noqa: PLC0415

            token = secrets.token_hex(16)
            server = CellServer(self.dir, token)
            spec.update(keep=True, channel=str(server.path), token=token)
            self.warm = WarmState(self, server, cfg.idle_timeout_s)
        elif cfg.code is not None:
            cell = self.dir / "cell.py"
            cell.write_text(cfg.code, encoding="utf-8")
            spec["cell"] = str(cell)
        elif cfg.script is not None:
            spec["script"] = str(cfg.script.resolve())
        (self.dir / "bootstrap.json").write_text(json.dumps(spec, indent=2), encoding="utf-8")
        if cfg.push and not cfg.keep:
            (self.dir / "push.pkl").write_bytes(pickle.dumps(dict(cfg.push)))
        if cfg.slurm is None and cfg.nnodes == 1:
            self.port = cfg.master_port or free_port(ports_in_use())
        else:
            self.port = None  # the nodes meet at a c10d endpoint, not at a local port
        self._write_meta()
        argv = agent_argv(cfg, self.dir, self.run_id, self.port or 0)
        self.started_at = time.time()
        with rundir.agent_log(self.dir).open("wb") as agent_log:
            self.agent = subprocess.Popen(
                argv,
                env=self._agent_env(),
                stdin=subprocess.DEVNULL,
                stdout=agent_log,
                stderr=subprocess.STDOUT,
                # cwd is inherited: ranks start where the notebook runs, so relative paths
                # in a cell mean the same thing as in the kernel.
                # Own session: the notebook's interrupt reaches the kernel only; nbgpu then
                # stops the job deliberately (SIGINT, SIGTERM, SIGKILL on one deadline).
                start_new_session=True,
                # srun is not ours to change: the kernel sets its parent-death signal (a
                # killed srun ends its step on every node). Our agent sets its own.
                preexec_fn=_die_with_launcher if cfg.slurm is not None else None,  # noqa: PLW1509  (prctl only, no locks)
            )
        self.state = "running"
        if cfg.slurm is not None:
            self.queue = QueueWatch(self.dir, self._agent_env())
        world = range(cfg.world_size)
        few = cfg.world_size <= MAX_LOGS_PER_POLL  # many ranks: no descriptor held per rank
        self._tails = {r: LogTail(rundir.rank_log(self.dir, r), keep_open=few) for r in world}
        register(self)
        return self

    def _agent_env(self) -> dict[str, str]:
        env = with_package_importable({**self.environ, **self.config.env})
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets anyway, minus its banner
        env["NBGPU_RUN_DIR"] = str(self.dir)
        env[RUN_ID_ENV] = self.run_id
        env["NBGPU_RUN_NAME"] = self.name
        env["NBGPU_LAUNCHER_PID"] = str(os.getpid())
        # torchrun's agent-level error file (each rank gets its own from torchrun).
        env["TORCHELASTIC_ERROR_FILE"] = str(self.dir / "agent-error.json")
        if self.config.backend:
            env["NBGPU_BACKEND"] = self.config.backend
        if self.config.cuda_visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.config.cuda_visible_devices
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # so indices mean nvidia-smi's
        # ipykernel turns fd capture off under pytest; nothing in ranks should care.
        env.pop("PYTEST_CURRENT_TEST", None)
        return env

    def _write_meta(self) -> None:
        cfg = self.config
        meta = {
            "name": self.name,
            "run_id": self.run_id,
            "nproc": cfg.nproc,
            "nnodes": cfg.nnodes,
            "slurm": cfg.slurm is not None,
            "gpus": None if cfg.gpus is None else ",".join(str(g) for g in cfg.gpus),
            "cuda_visible_devices": cfg.cuda_visible_devices
            if cfg.cuda_visible_devices is not None
            else self.environ.get("CUDA_VISIBLE_DEVICES"),
            "master_port": self.port,
            "simulated": self.environ.get("NBGPU_SIMULATE"),
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "state": self.state,
            "stop_reason": self.stop_reason,
            "ranks": [
                {
                    "rank": r.rank,
                    "local_rank": r.rank,
                    "exit_code": r.exit_code,
                    "signal": r.signal,
                    "pid": r.pid,
                    "ended_at": r.failed_at,
                }
                for r in self.ranks
            ],
            "agent_exit_code": self.agent.returncode if self.agent else None,
            "parent_death_signal": self.notices.guarantee_record(),
            # A warm job: the cell it ended in and where that cell starts in each rank's
            # log, so a diagnosis reads that cell, not an earlier cell's caught error.
            "warm": None
            if self.warm is None
            else {"cell": self.warm.cells, "log_offsets": self.warm.log_offsets},
        }
        try:
            (self.dir / "run.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
        except OSError as exc:
            # A full disk must not turn a finished run into a crash of the launcher.
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise

    def take_notices(self) -> list[str]:
        """Messages not shown yet: retention, a lost parent-death guarantee, a full disk,
        a SLURM job waiting in the queue (and why)."""
        # A lost guarantee is also recorded in run.json.
        if self.queue is not None:
            for line in self.queue.poll():
                self.notices.add(line)
        return self.notices.take(on_guarantee_lost=self._write_meta)

    # -- while running -------------------------------------------------------------

    def poll_lines(self, *, every: bool = False) -> list[tuple[str, list[str]]]:
        """New lines of the ranks' logs; beyond 256 ranks the logs take turns (``every``:
        read them all, as before a cell's result)."""
        ranks = list(self._tails)
        turn: list[int]
        if every:
            turn = list(range(len(ranks)))
        else:
            turn, self._poll_cursor = in_turn(len(ranks), self._poll_cursor)
        out = []
        for index in turn:
            rank = ranks[index]
            tail = self._tails[rank]
            lines = tail.poll()
            if lines:
                if self.first_output_at is None:
                    self.first_output_at = time.time()
                out.append((self.rank_label(rank), lines))
        return out

    @property
    def memory(self) -> MemoryReport:
        """Memory by phase and rank (a report: ``.to_frame()``, ``.figure()``); also live."""
        from nbgpu.profile.report import memory_report  # noqa: PLC0415

        return memory_report(self.dir, label=f"run '{self.name}'")

    def memory_status(self) -> str | None:
        """The node's memory in one line, at most once a second (None in between)."""
        if self.config.mem_sample_s == 0 and self._memory is None:
            return None
        if self._memory is None:
            from nbgpu.profile.live import MemoryFollower  # noqa: PLC0415

            self._memory = MemoryFollower(
                self.dir, self.config.world_size, several_nodes=self.config.nnodes > 1
            )
        if not self._memory.due():
            return None
        line: str | None = self._memory.summary()
        return line

    def live_lines(self) -> dict[str, str]:
        """Each rank's unfinished line (a progress bar), for a live status display."""
        return {f"rank{r}": t.live for r, t in self._tails.items() if t.live}

    @property
    def agent_done(self) -> bool:
        return self.agent is None or self.agent.poll() is not None

    @property
    def done(self) -> bool:
        return self.state in TERMINAL_STATES

    def stop(
        self, reason: str = "stopped", *, first_signal: int = signal.SIGTERM, grace_s: float = 3.0
    ) -> StopReport:
        """End every process of the run (agent, ranks, orphans) against one deadline.

        An idle warm job is first asked to end: its ranks leave their loop and exit
        normally (finalizers, atexit, the process group's teardown) within *grace_s*.
        """
        with self._lock:
            if self.stop_reason is None:
                self.stop_reason = reason
        if self.warm is not None:
            self.warm.stop_gracefully(grace_s)
        if self.config.slurm is not None:
            from nbgpu.launch.slurm import cancel  # noqa: PLC0415  (SLURM runs only)

            # SLURM ends the tasks on every node; the local stop below ends srun itself.
            cancel(self.dir, self.environ, requested="SLURM_JOB_ID" not in self.environ)
        report = stop_processes(
            self.run_id,
            self.agent.pid if self.agent else None,
            first_signal=first_signal,
            grace_s=grace_s,
        )
        if self.agent is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.agent.wait(timeout=1.0)  # reap our child
        self.stop_report = report
        return report

    # -- after -----------------------------------------------------------------------

    def sweep_orphans(self) -> int:
        """Stop processes that outlived the agent and carry the run's id; how many.

        A rank's own children (data-loader workers, a shell) are not covered by the
        rank's parent-death signal: when the agent is SIGKILLed the ranks die, and
        their children would keep running (and holding GPUs) without this.
        """
        if not self.agent_done:
            return 0
        leftovers = run_processes(self.run_id, None)
        if not leftovers:
            return 0
        report = stop_processes(self.run_id, None, first_signal=signal.SIGTERM, grace_s=2.0)
        self.notices.add(
            f"{len(leftovers)} processes started by the ranks outlived them; stopped"
            + (
                f" (still alive: {', '.join(map(str, report.survivors))})"
                if report.survivors
                else ""
            )
        )
        return len(leftovers)

    def drain(self) -> list[tuple[str, list[str]]]:
        out = []
        for rank, tail in self._tails.items():
            lines = tail.close()
            if lines:
                out.append((self.rank_label(rank), lines))
        return out

    def finish(self) -> None:
        """Collect outcomes once the agent has exited (or was stopped)."""
        if self.done:
            return
        if self.agent is not None and self.agent.poll() is None:
            self.agent.wait()
        self.ended_at = time.time()
        self.agent_result = read_agent_result(self.dir)
        if self.config.slurm is not None:
            from nbgpu.launch.slurm import srun_error  # noqa: PLC0415  (SLURM runs only)

            self.agent_result["slurm_error"] = srun_error(self.dir)
        agent_code = self.agent.returncode if self.agent else None
        world = self.config.world_size
        self.ranks = rank_outcomes(self.dir, world, self.agent_result, agent_code)
        if self.config.pull:
            pulled = collect_pulled(self.dir, world)
            self.pulled, self.pulled_all = pulled.values, pulled.every_rank
            self.pull_problems.extend(pulled.problems)
        if self.stop_reason == "idle_timeout":
            self.state = "stopped"
        elif self.stop_reason in ("timed_out", "interrupted", "stopped"):
            self.state = self.stop_reason
        elif agent_code == 0 and all(r.exit_code == 0 for r in self.ranks):
            self.state = "succeeded"
        else:
            self.state = "failed"
        self._write_meta()
        if self.state == "failed":
            self.diagnosis = self._diagnose()
            self.root_cause = self._root_cause()
        if self.warm is not None:
            self.warm.close()
        self._finished.set()

    def end_warm(self) -> None:
        """A warm job is over (a rank died, it was stopped): sweep, collect, close."""
        if not self.agent_done:
            self.stop(self.stop_reason or "stopped")
        self.sweep_orphans()
        self.finish()

    def _diagnose(self) -> Diagnosis | None:
        """Name the cause from the logs, with this machine's GPUs as context."""
        try:
            from nbgpu.devices.inventory import take_inventory  # noqa: PLC0415
            from nbgpu.diagnose import diagnose  # noqa: PLC0415

            inventory = take_inventory(self.environ, scan_device_files=False)
            return diagnose(self.dir, inventory=inventory, name=self.name)
        except Exception as exc:  # noqa: BLE001  (a diagnosis must never hide the failure itself)
            # ...nor hide its own failure: the summary says it failed and why.
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            self.diagnosis_error = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
            return None

    def _root_cause(self) -> RankOutcome | None:
        """The rank that failed first: the diagnosis decides (one answer everywhere)."""
        if self.diagnosis is None:
            return first_failure_without_diagnosis(self.ranks)
        rank = self.diagnosis.failed_rank
        return next((r for r in self.ranks if r.rank == rank), None)

    def wait(self, timeout_s: float | None = None) -> Run:
        """Block until a background run or a warm job has finished (or *timeout_s* passes)."""
        if self.thread is not None or self.warm is not None:
            self._finished.wait(timeout_s)
        elif not self.done:
            from nbgpu.launch.follow import follow  # noqa: PLC0415  (follow types against Run)

            follow(self, ScreenWriter(lambda _text: None))
        return self


def _die_with_launcher() -> None:
    set_parent_death_signal(signal.SIGTERM)


def leftover_processes(run: Run) -> list[int]:
    """Pids of the run still alive (for tests and %gpu_runs)."""
    return [p.pid for p in run_processes(run.run_id, run.agent.pid if run.agent else None)]
