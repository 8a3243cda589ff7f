"""A Run: one torchrun job from start to its result, and the registry of this process's runs.

``Run.start()`` writes the run directory (cell, bootstrap spec, pushed values),
picks a free port, and starts the wrapped torchrun agent (``agent.py``) in its own
session with the workers' environment. ``follow()`` streams every rank's log to a
``ScreenWriter`` until the agent exits, a timeout passes or the caller interrupts;
``stop()`` ends the whole process tree against one deadline; ``finish()`` reads
the agent's result, the error files and pulled values into per-rank outcomes.

Owns processes; never imports IPython, ipywidgets or matplotlib (faces render).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import pickle
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

from nbgpu._lineage import with_package_importable
from nbgpu._render import Result, Table, fix_html, simulated_label
from nbgpu.errors import NbgpuError, UserInputError
from nbgpu.launch import rundir
from nbgpu.launch.config import LaunchConfig
from nbgpu.launch.procs import RUN_ID_ENV, StopReport, run_processes, stop_processes
from nbgpu.launch.streams import LineSink, LogTail, ScreenWriter

__all__ = [
    "RUNS",
    "RankOutcome",
    "Run",
    "RunFailed",
    "check_name_free",
    "follow",
    "free_port",
    "leftover_processes",
]

DISK_FULL_BELOW_BYTES = 64 * 1024  # less free space than this under the run dir: full
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


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    exit_code: int | None  # None: unknown (the agent was killed before reporting)
    signal: str | None
    pid: int | None
    log: Path
    error: str | None  # the exception line from the error file
    traceback: str | None
    failed_at: float | None


def free_port(taken: set[int] | None = None) -> int:
    """A TCP port nobody listens on now (the kernel picks; we skip ports our runs hold)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if not taken or port not in taken:
            return port
    raise NbgpuError("no free TCP port found for the rendezvous")


class Run(Result):
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
        self.diagnosis: Any = None  # nbgpu.diagnose's verdict when the run did not succeed
        self.diagnosis_error: str | None = None  # why the diagnosis itself failed, if it did
        self.stop_reason: str | None = None
        self.agent_result: dict[str, Any] = {}
        self.writer: LineSink | None = None
        self._tails: dict[int, LogTail] = {}
        self._memory: Any = None  # nbgpu.profile.live.MemoryFollower, made on first use
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._guarantee_announced = False
        self.notices: list[str] = []  # one-line messages for the screen, shown once
        self.disk_full_since: float | None = None  # when the run directory's disk filled
        self.thread: threading.Thread | None = None

    # -- start -------------------------------------------------------------------

    def start(self) -> Run:
        cfg = self.config
        self._apply_retention()
        self.dir = rundir.make_run_dir(cfg.name, self.environ)
        spec: dict[str, Any] = {
            "serial_imports": cfg.serial_imports,
            "mem_limit_bytes": cfg.mem_limit_bytes,
            "mem_sample_s": cfg.mem_sample_s,
            "pull": list(cfg.pull),
            "pull_all_ranks": cfg.pull_all_ranks,
            "script_args": list(cfg.script_args),
        }
        if cfg.code is not None:
            cell = self.dir / "cell.py"
            cell.write_text(cfg.code, encoding="utf-8")
            spec["cell"] = str(cell)
        elif cfg.script is not None:
            spec["script"] = str(cfg.script.resolve())
        (self.dir / "bootstrap.json").write_text(json.dumps(spec, indent=2), encoding="utf-8")
        if cfg.push:
            (self.dir / "push.pkl").write_bytes(pickle.dumps(dict(cfg.push)))
        taken = {r.port for r in RUNS.values() if r.port is not None and r.state == "running"}
        self.port = cfg.master_port or free_port(taken)
        self._write_meta()
        argv = [
            sys.executable, "-m", "nbgpu.launch.agent", str(self.dir / "result.json"), "--",
            "--nnodes", "1", "--node-rank", "0",
            "--nproc-per-node", str(cfg.nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(self.port),
            "--max-restarts", "0",
            "--log-dir", str(self.dir / "torchelastic"),
            "--module", "nbgpu.launch.worker",
        ]  # fmt: skip
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
            )
        self.state = "running"
        self._tails = {r: LogTail(rundir.rank_log(self.dir, r)) for r in range(cfg.nproc)}
        RUNS[self.name] = self
        _stop_all_at_exit_once()
        return self

    def _apply_retention(self) -> None:
        """Prune old run directories before adding one; never blocks a launch."""
        from nbgpu.launch import retention  # noqa: PLC0415

        try:
            report = retention.prune(self.environ, keep_newest_extra=1)
        except (UserInputError, OSError) as exc:
            self.notices.append(f"old runs not pruned: {exc}")
            return
        if report.removed and not _RETENTION_ANNOUNCED:
            _RETENTION_ANNOUNCED.append(True)
            self.notices.append(
                f"removed {len(report.removed)} old run directories "
                f"({report.freed_bytes / 1e6:.0f} MB) from {report.root}: keeping "
                f"{report.policy.describe()}; %gpu_runs --prune / nbgpu runs --prune"
            )

    def take_notices(self) -> list[str]:
        """Messages not shown yet: retention, a lost parent-death guarantee, a full disk."""
        out, self.notices = self.notices, []
        for notice in (self.guarantee_notice(), self.disk_full_notice()):
            if notice is not None:
                out.append(notice)
        return out

    def disk_full_notice(self) -> str | None:
        """One line, the first time the disk under the run directory is found full.

        Ranks drop their output instead of failing (``worker.py``); this says which
        logs are incomplete and from when. A rank's own marker gives its exact time;
        the disk's free space, checked each tick, catches a disk too full for markers.
        """
        if self.disk_full_since is not None or not self.dir.name:
            return None
        stamps = []
        for path in self.dir.glob("logfull-rank*.txt"):
            with contextlib.suppress(OSError, ValueError):
                stamps.append(float(path.read_text(encoding="utf-8")))
        try:
            st = os.statvfs(self.dir)
            full = st.f_bavail * st.f_frsize < DISK_FULL_BELOW_BYTES
        except OSError:
            full = False
        if not stamps and not full:
            return None
        self.disk_full_since = min(stamps) if stamps else time.time()
        when = time.strftime("%H:%M:%S", time.localtime(self.disk_full_since))
        return (
            f"the disk under {self.dir} is full: rank logs (rank0..rank{self.config.nproc - 1}"
            f".log) and the output shown here are incomplete from {when} on; the ranks keep "
            "running (free space, or set NBGPU_RUNS_DIR elsewhere for the next run)"
        )

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
            "nnodes": 1,
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
            "parent_death_signal": self._guarantee_record(),
        }
        try:
            (self.dir / "run.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
        except OSError as exc:
            # A full disk must not turn a finished run into a crash of the launcher.
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise

    def lost_guarantees(self) -> dict[str, str]:
        """Processes (agent, rankN) whose parent-death signal the kernel refused, and why."""
        out: dict[str, str] = {}
        if not self.dir.name:
            return out
        for path in sorted(self.dir.glob("pdeathsig-*.txt")):
            with contextlib.suppress(OSError):
                out[path.stem.removeprefix("pdeathsig-")] = path.read_text("utf-8").strip()
        return out

    def _guarantee_record(self) -> dict[str, Any]:
        lost = self.lost_guarantees()
        return {"ok": not lost, "lost": lost}

    def guarantee_notice(self) -> str | None:
        """One line, the first time a process of the run reports the guarantee lost."""
        if self._guarantee_announced:
            return None
        lost = self.lost_guarantees()
        if not lost:
            return None
        self._guarantee_announced = True
        with contextlib.suppress(OSError):
            self._write_meta()
        reason = next(iter(lost.values()))
        return (
            f"no parent-death signal for {', '.join(lost)} ({reason}): if this process is "
            "killed, the run's processes keep running; stop them with %gpu_stop / nbgpu clean"
        )

    # -- while running -------------------------------------------------------------

    def poll_lines(self) -> list[tuple[str, list[str]]]:
        out = []
        for rank, tail in self._tails.items():
            lines = tail.poll()
            if lines:
                if self.first_output_at is None:
                    self.first_output_at = time.time()
                out.append((f"rank{rank}", lines))
        return out

    @property
    def memory(self) -> Any:
        """Memory by phase and rank (a report: ``.to_frame()``, ``.figure()``); also live."""
        from nbgpu.profile.report import memory_report  # noqa: PLC0415

        return memory_report(self.dir, label=f"run '{self.name}'")

    def memory_status(self) -> str | None:
        """The node's memory in one line, at most once a second (None in between)."""
        if self.config.mem_sample_s == 0 and self._memory is None:
            return None
        if self._memory is None:
            from nbgpu.profile.live import MemoryFollower  # noqa: PLC0415

            self._memory = MemoryFollower(self.dir, self.config.nproc)
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

    @property
    def duration_s(self) -> float | None:
        if self.started_at is None:
            return None
        return (self.ended_at or time.time()) - self.started_at

    def stop(
        self, reason: str = "stopped", *, first_signal: int = signal.SIGTERM, grace_s: float = 3.0
    ) -> StopReport:
        """End every process of the run (agent, ranks, orphans) against one deadline."""
        with self._lock:
            if self.stop_reason is None:
                self.stop_reason = reason
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
        self.notices.append(
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
                out.append((f"rank{rank}", lines))
        return out

    def finish(self) -> None:
        """Collect outcomes once the agent has exited (or was stopped)."""
        if self.done:
            return
        if self.agent is not None and self.agent.poll() is None:
            self.agent.wait()
        self.ended_at = time.time()
        result_path = self.dir / "result.json"
        if result_path.exists():
            with contextlib.suppress(ValueError, OSError):
                self.agent_result = json.loads(result_path.read_text(encoding="utf-8"))
        failures = {f["rank"]: f for f in self.agent_result.get("failures", [])}
        outcomes = []
        for rank in range(self.config.nproc):
            f = failures.get(rank)
            error, tb, failed_at = self._error_details(rank, f)
            if f is not None:
                code, sig, pid = f["exit_code"], f["signal"], f["pid"]
            elif (
                self.agent_result
                and not self.agent_result.get("signal")
                and self.agent_result.get("agent_exit_code") == 0
            ) or (not self.agent_result and self.agent is not None and self.agent.returncode == 0):
                # torchrun exits 0 only when every rank did (also when a full disk kept
                # the agent from writing result.json).
                code, sig, pid = 0, None, None
            else:
                code, sig, pid = None, None, None
            outcomes.append(
                RankOutcome(
                    rank, code, sig, pid, rundir.rank_log(self.dir, rank), error, tb, failed_at
                )
            )
        self.ranks = tuple(outcomes)
        self._collect_pulled()
        agent_code = self.agent.returncode if self.agent else None
        if self.stop_reason in ("timed_out", "interrupted", "stopped"):
            self.state = self.stop_reason
        elif agent_code == 0 and all(r.exit_code == 0 for r in self.ranks):
            self.state = "succeeded"
        else:
            self.state = "failed"
        self._write_meta()
        if self.state == "failed":
            self.diagnosis = self._diagnose()
            self.root_cause = self._root_cause()
        self._finished.set()

    def _diagnose(self) -> Any:
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
        """The rank that failed first: the diagnosis decides (one answer everywhere).

        Only when the diagnosis itself failed does the run fall back on what the exit
        codes and error-file clocks say, and the summary says that it did.
        """
        failed = [r for r in self.ranks if r.exit_code not in (0, None)]
        rank = getattr(self.diagnosis, "failed_rank", None)
        if rank is not None:
            return next((r for r in self.ranks if r.rank == rank), None)
        if self.diagnosis is not None or not failed:
            return None

        def weight(r: RankOutcome) -> tuple[int, float, int]:
            # Ranks the agent stopped (SIGTERM/SIGINT) after another failed come last.
            stopped = r.signal in ("SIGTERM", "SIGINT") and r.error is None
            return (int(stopped), r.failed_at or float("inf"), r.rank)

        return min(failed, key=weight)

    def _error_details(
        self, rank: int, failure: dict[str, Any] | None
    ) -> tuple[str | None, str | None, float | None]:
        candidates = []
        if failure and failure.get("error_file"):
            candidates.append(Path(failure["error_file"]))
        candidates.append(rundir.error_file(self.dir, rank))
        candidates.extend(
            sorted((self.dir / "torchelastic").glob(f"*/attempt_*/{rank}/error.json"))
        )
        for path in candidates:
            if not path.is_file():
                continue
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                message = data["message"]
                info = message.get("extraInfo", {})
                stamp = float(info.get("nbgpu_time") or info.get("timestamp") or 0) or None
                target = rundir.error_file(self.dir, rank)
                if path != target:
                    with contextlib.suppress(OSError):
                        shutil.move(path, target)  # one copy, next to the logs, for diagnosis
                return str(message.get("message")), info.get("py_callstack"), stamp
            except (ValueError, KeyError, TypeError, OSError, AttributeError):
                continue
        # No error file: the rank died by a signal or exited without raising; the exit
        # code and signal tell that story, not a message.
        return None, None, None

    def _collect_pulled(self) -> None:
        if not self.config.pull:
            return
        for r in range(self.config.nproc):
            path = self.dir / f"pull-rank{r}.pkl"
            if not path.exists():
                continue
            payload = pickle.loads(path.read_bytes())  # noqa: S301  (written by our own ranks)
            values = {k: pickle.loads(v) for k, v in payload["values"].items()}  # noqa: S301
            if r == 0:
                self.pulled = values
                self.pull_problems.extend(
                    f"--pull {name}: rank 0 never set {name!r}" for name in payload["missing"]
                )
                self.pull_problems.extend(
                    f"--pull {name}: {why}" for name, why in payload["errors"].items()
                )
            self.pulled_all.append(values)

    # -- presentation ---------------------------------------------------------------

    @property
    def logs(self) -> dict[str, Path]:
        out = {f"rank{r}": rundir.rank_log(self.dir, r) for r in range(self.config.nproc)}
        out["agent"] = rundir.agent_log(self.dir)
        return out

    def _rank_state(self, r: RankOutcome) -> str:
        if r.exit_code == 0:
            return "ok"
        if r.signal:
            return f"killed ({r.signal})"
        if r.exit_code is None:
            return "stopped" if self.stop_reason else "unknown"
        return f"exit {r.exit_code}"

    def failure_summary(self) -> str:
        head = f"run '{self.name}' {self.state.replace('_', ' ')}"
        if self.stop_reason == "timed_out":
            head += f" after {self.config.timeout_s:g} s (--timeout)"
        rc = self.root_cause
        if rc is not None:
            head += f": rank {rc.rank} failed first ({self._rank_state(rc)})"
            if rc.error:
                head += f": {rc.error.splitlines()[0][:300]}"
        elif self.state == "failed" and self.agent_result.get("error"):
            head += f": torchrun failed: {self.agent_result['error']}"
        return head

    def failure_lines(self, *, output_shown: bool = False) -> list[str]:
        """The failure, each thing said once: summary, cause, fixes, then the traceback.

        ``output_shown``: the ranks' output was already streamed into this cell, so the
        root rank's traceback is there (and in its log) and is not printed a second time.
        Lines are never hard-wrapped: a notebook wraps them to its own width.
        """
        lines = [f"RunFailed: {self.failure_summary()}"]
        if self.diagnosis_error is not None:
            how = "exit codes and error files" if self.root_cause is not None else "nothing"
            lines.append(
                f"diagnosis failed: {self.diagnosis_error} (the first failing rank above comes "
                f"from {how} alone; `nbgpu diagnose {self.dir}` retries)"
            )
        root = getattr(self.diagnosis, "root", None)
        if root is not None and getattr(self.diagnosis, "cause", "unknown") != "unknown":
            # The diagnosis leads: the cause in plain words, then the fixes it did not
            # already name in its headline.
            headline = self.diagnosis.headline
            lines.append(f"cause: {headline}")
            lines.extend(f"  fix: {fix}" for fix in root.fixes[:3] if fix not in headline)
        rc = self.root_cause
        if rc is not None and rc.traceback:
            if output_shown:
                lines.append(f"rank {rc.rank} traceback: above, and in {rc.log}")
            else:
                tb = [line for line in rc.traceback.rstrip().splitlines() if line.strip()]
                lines.append(f"rank {rc.rank} traceback (last lines):")
                lines.extend("  " + line for line in tb[-8:])
        lines.append(f"logs: {self.dir}  (details: the exception's .run attribute)")
        return lines

    def _table(self) -> Table:
        table = Table(["rank", "state", "pid", "error", "log"])
        for r in self.ranks:
            level = "ok" if r.exit_code == 0 else "bad"
            if self.root_cause is r:
                level = "bad"
            table.add(
                r.rank,
                self._rank_state(r) + (" (root cause)" if self.root_cause is r else ""),
                r.pid or "-",
                (r.error or "-").splitlines()[0][:60],
                r.log.name,
                level=level,
            )
        return table

    def _headline(self) -> str:
        dur = self.duration_s
        gpus = self.config.cuda_visible_devices
        parts = [
            f"run '{self.name}'",
            self.state.replace("_", " "),
            f"{self.config.nproc} ranks",
        ]
        if gpus is not None:
            parts.append(self.gpu_assignment() if gpus else "no GPU")
        if self.port:
            parts.append(f"port {self.port}")
        if dur is not None:
            parts.append(f"{dur:.1f} s")
        fleet = self.simulated_fleet()
        if fleet:
            parts.append(simulated_label(fleet))
        return " · ".join(parts)

    def rank_gpu(self, rank: int) -> str | None:
        """The GPU rank *rank* uses (``cuda:LOCAL_RANK``), as CUDA_VISIBLE_DEVICES names it."""
        gpus = self.config.cuda_visible_devices
        if not gpus:
            return None
        visible = gpus.split(",")
        local = rank % self.config.nproc
        return visible[local] if local < len(visible) else None

    def gpu_assignment(self) -> str:
        """Which GPU each rank got: 'rank0→GPU 1, rank1→GPU 2 (GPU 3 unused)'."""
        visible = (self.config.cuda_visible_devices or "").split(",")
        pairs = [f"rank{r}→GPU {self.rank_gpu(r) or 'none'}" for r in range(self.config.nproc)]
        if len(pairs) > 4:
            pairs = [*pairs[:2], "…", pairs[-1]]
        text = ", ".join(pairs)
        unused = visible[self.config.nproc :]
        if unused:
            text += f" (GPU{'s' if len(unused) > 1 else ''} {','.join(unused)} unused)"
        return text

    def simulated_fleet(self) -> str | None:
        return self.environ.get("NBGPU_SIMULATE") or None

    def text(self) -> str:
        lines = [self._headline()]
        if self.ranks:
            lines.append(self._table().text())
        if self.state not in ("succeeded", "running", "created"):
            lines.append(self.failure_summary())
        if self.diagnosis_error is not None:
            lines.append(f"diagnosis failed: {self.diagnosis_error}")
        lines.extend(f"! {p}" for p in self.pull_problems)
        if self.diagnosis is not None and getattr(self.diagnosis, "cause", "") not in (
            "unknown",
            "none",
        ):
            lines.append(f"cause: {self.diagnosis.headline}")
        lines.append(f"logs: {self.dir}")
        return "\n".join(lines)

    def html_body(self) -> str:
        parts = [f"<b>{escape(self._headline())}</b>"]
        if self.ranks:
            parts.append(self._table().html())
        if self.state not in ("succeeded", "running", "created"):
            parts.append(f"<p>{fix_html(self.failure_summary())}</p>")
        if self.diagnosis_error is not None:
            parts.append(f'<p class="warn">diagnosis failed: {escape(self.diagnosis_error)}</p>')
        parts.extend(f'<p class="warn">{escape(p)}</p>' for p in self.pull_problems)
        if self.diagnosis is not None:
            parts.append(self.diagnosis.html_body())
        parts.append(f"<div>logs: <code>{escape(str(self.dir))}</code></div>")
        return "".join(parts)

    def records(self) -> list[dict[str, Any]]:
        return [
            {
                "rank": r.rank,
                "exit_code": r.exit_code,
                "signal": r.signal,
                "pid": r.pid,
                "error": r.error,
                "log": str(r.log),
                "root_cause": self.root_cause is r,
            }
            for r in self.ranks
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state,
            "run_dir": str(self.dir),
            "nproc": self.config.nproc,
            "cuda_visible_devices": self.config.cuda_visible_devices,
            "master_port": self.port,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "duration_s": self.duration_s,
            "stop_reason": self.stop_reason,
            "root_cause_rank": None if self.root_cause is None else self.root_cause.rank,
            "ranks": self.records(),
            "pulled": sorted(self.pulled),
        }

    def wait(self, timeout_s: float | None = None) -> Run:
        """Block until a background run has finished (or *timeout_s* passes)."""
        if self.thread is not None:
            self._finished.wait(timeout_s)
        elif not self.done:
            follow(self, ScreenWriter(lambda _text: None))
        return self


#: Runs started by this process (this kernel), by name.
RUNS: dict[str, Run] = {}


def follow(
    run: Run,
    writer: LineSink,
    *,
    poll_s: float = 0.05,
    flush_s: float = 0.1,
    on_tick: Callable[[Run], None] | None = None,
) -> Run:
    """Stream a started run to *writer* until it ends; stop it on timeout or interrupt."""
    run.writer = writer
    timeout = run.config.timeout_s
    last_flush = 0.0
    try:
        while True:
            for label, lines in run.poll_lines():
                writer.add(label, lines)
            now = time.monotonic()
            if now - last_flush >= flush_s:
                if isinstance(writer, ScreenWriter) and writer.live_status:
                    writer.status(run.memory_status())
                notices = run.take_notices()
                if notices:
                    writer.add("nbgpu", notices)
                writer.flush()
                if on_tick is not None:
                    on_tick(run)
                last_flush = now
            if run.agent_done:
                break
            if run.stop_reason is not None and not run.agent_done:
                # Stopped from elsewhere (%gpu_stop): wait for the stopper to finish.
                time.sleep(poll_s)
                continue
            if (
                timeout is not None
                and run.started_at is not None
                and (time.time() - run.started_at > timeout)
            ):
                run.stop("timed_out", first_signal=signal.SIGTERM)
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        # The notebook's stop button: SIGINT to torchrun (it forwards and shuts down),
        # then SIGTERM/SIGKILL of whatever remains, on one short deadline.
        try:
            run.stop("interrupted", first_signal=signal.SIGINT)
        except KeyboardInterrupt:
            run.stop("interrupted", first_signal=signal.SIGKILL, grace_s=0.5)
    finally:
        if not run.agent_done:
            run.stop(run.stop_reason or "stopped")
        run.sweep_orphans()
        for label, lines in run.poll_lines() + run.drain():
            writer.add(label, lines)
        notices = run.take_notices()
        if notices:
            writer.add("nbgpu", notices)
        writer.finish(str(run.dir))
        run.finish()
        if on_tick is not None:
            on_tick(run)
    return run


_EXIT_HOOK: list[bool] = []
_RETENTION_ANNOUNCED: list[bool] = []  # the policy is told once per process


def _stop_all_at_exit_once() -> None:
    # A kernel that shuts down cleanly (or a script that returns) stops its runs in
    # order; parent-death signals cover the unclean exits.
    if not _EXIT_HOOK:
        _EXIT_HOOK.append(True)
        atexit.register(_stop_running, "kernel shutdown")


def _stop_running(reason: str) -> None:
    for run in list(RUNS.values()):
        if not run.done and not run.agent_done:
            with contextlib.suppress(Exception):
                run.stop(reason, grace_s=2.0)


def leftover_processes(run: Run) -> list[int]:
    """Pids of the run still alive (for tests and %gpu_runs)."""
    return [p.pid for p in run_processes(run.run_id, run.agent.pid if run.agent else None)]


def check_name_free(name: str) -> str:
    existing = RUNS.get(name)
    if existing is not None and not existing.done:
        raise UserInputError(
            f"--name {name!r}: a run with this name is still running (%gpu_stop {name})"
        )
    return name
