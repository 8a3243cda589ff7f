"""A Run: one torchrun job's life in the kernel, from start to collected outcomes and a failed
run's diagnosis (how it reads is ``RunView``). A started run is in :data:`RUNS`, stopped when
the process exits; one follow loop serves a cold run and each cell of a warm job (``run.warm``,
watched between cells by the idle watchdog); ``stop()`` ends the tree on one deadline.
"""

from __future__ import annotations

import atexit
import contextlib
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from nbgpu._render import span
from nbgpu.errors import UserInputError
from nbgpu.launch.config import CellRequest, LaunchConfig
from nbgpu.launch.debug import Console
from nbgpu.launch.outcomes import (
    StallWatch,
    collect_pulled,
    diagnose_failure,
    rank_outcomes,
    read_agent_result,
)
from nbgpu.launch.procs import (
    StopReport,
    agent_env,
    free_port,
    run_processes,
    start_agent,
    stop_processes,
)
from nbgpu.launch.relay import CellServer, NodeChannel
from nbgpu.launch.run_view import RunFailed, RunView
from nbgpu.launch.rundirs import (
    FINAL_STATES,
    make_run_dir,
    prune_before_run,
    rank_log,
    write_bootstrap,
    write_meta,
)
from nbgpu.launch.slurm import QueueWatch, cancel, srun_error
from nbgpu.launch.spare import early_run_id
from nbgpu.launch.streams import LineSink, RankLogs, ScreenWriter
from nbgpu.launch.warm import CELL_MARK, WATCH_S, Cell, CellResult, WarmState

if TYPE_CHECKING:
    from nbgpu.profile.live import MemoryFollower

__all__ = ["RUNS", "Run", "RunFailed", "leftover_processes", "ports_in_use"]

POLL_S = 0.05  # how often the follow loop reads the logs
FLUSH_S = 0.1  # how often it writes them (Jupyter drops output sent faster)
#: Runs started by this process (this kernel), by name.
RUNS: dict[str, Run] = {}
_EXIT_HOOK: list[bool] = []


class Run(RunView):
    """A torchrun job started by nbgpu. Renders as text/HTML; see ``ranks``, ``logs``."""

    def __init__(self, config: LaunchConfig, *, environ: Mapping[str, str] | None = None) -> None:
        super().__init__(config, environ=environ)
        self.stop_report: StopReport | None = None
        self.writer: LineSink | None = None  # where follow() streams the lines now
        self.queue: QueueWatch | None = None  # a SLURM job while it waits in the queue
        self.thread: threading.Thread | None = None  # a background follower
        self._logs = RankLogs({})
        self._memory: MemoryFollower | None = None  # made on first use
        self.stalls: StallWatch | None = None  # --hang-after (0: none)
        self._lock = threading.Lock()
        self._finished = threading.Event()

    def start(self) -> Run:
        cfg = self.config
        self.run_id = early_run_id() or self.run_id  # an agent started early carries it
        pruned = prune_before_run(self.environ)
        if pruned is not None:
            self.notices.pending.append(pruned)
        self.dir = make_run_dir(cfg.name, self.environ)
        self.notices.run_dir = self.dir
        channel = None
        if cfg.keep:
            token = secrets.token_hex(16)
            server: CellServer | NodeChannel
            if cfg.slurm is None:
                server = CellServer(self.dir, token)
                channel = (str(server.path), token)
            else:  # on the nodes: each node's relay names its ranks' socket (NBGPU_CELLS)
                server = NodeChannel(self.dir, token, cfg.nnodes)
                channel = ("", token)
            self.warm = WarmState(server, cfg.world_size, cfg.idle_timeout_s)
        write_bootstrap(self.dir, cfg, channel)
        if cfg.slurm is None and cfg.nnodes == 1:
            self.port = cfg.master_port or free_port(ports_in_use())
        else:
            self.port = None  # the nodes meet at a c10d endpoint, not at a local port
        write_meta(self.dir, self.meta())
        env = agent_env(cfg, self.environ, self.dir, self.run_id)
        self.started_at = time.time()
        self.agent = start_agent(cfg, self.dir, self.run_id, self.port or 0, env)
        self.state = "running"
        if cfg.slurm is not None:
            self.queue = QueueWatch(self.dir, env)
        logs = {rank: rank_log(self.dir, rank) for rank in range(cfg.world_size)}
        self._logs = RankLogs(logs, skip=CELL_MARK if cfg.keep else None)
        if cfg.hang_after_s:
            self.stalls = StallWatch(self.dir, cfg.world_size, cfg.hang_after_s)
        RUNS[self.name] = self
        if not _EXIT_HOOK:
            _EXIT_HOOK.append(True)
            atexit.register(_stop_running, "kernel shutdown")
        if self.warm is not None:
            name = f"nbgpu-warm-{self.name}"
            threading.Thread(target=self._watch_idle, name=name, daemon=True).start()
        return self

    def follow(
        self,
        writer: LineSink,
        *,
        cell: CellRequest | None = None,
        on_tick: Callable[[Run], None] | None = None,
    ) -> CellResult | None:
        """Stream the run into *writer* until it ends; stop it on timeout or interrupt. With
        *cell* (a warm job), run it on every rank and return its result: an interrupt or its
        ``--timeout`` interrupts the cell and waits a bounded time for answers (a rank stuck in
        a collective is reported, not waited for), a second interrupt ends the job. A run that
        ended is stopped, swept of orphans and collected, its last lines shown (None)."""
        self.writer = writer
        flight = console = None
        if cell is not None:
            if self.warm is None:
                raise UserInputError(f"run '{self.name}' is not a warm job: it takes no cells")
            flight = Cell(self.warm, cell, self.dir, serial_imports=self.config.serial_imports)
            console = self._console(writer, self.warm.server)
            flight.on_debug = console.hear
        result = None
        try:
            with contextlib.nullcontext() if self.warm is None else self.warm.lock:
                try:
                    self._loop(writer, flight, on_tick, console)
                except KeyboardInterrupt:
                    # The notebook's stop button: SIGINT to torchrun (it forwards and shuts
                    # down), then SIGTERM/SIGKILL of whatever remains, on one short deadline.
                    try:
                        self.stop("interrupted", first_signal=signal.SIGINT)
                    except KeyboardInterrupt:
                        self.stop("interrupted", first_signal=signal.SIGKILL, grace_s=0.5)
                finally:
                    ended = flight is None or self.agent_done or self.stop_reason is not None
                    if ended:
                        self._end(writer)
                if flight is not None and self.warm is not None and not ended:
                    self._show(writer, self._logs.poll(every=True))
                    result = self.warm.last = flight.result(self.name)  # before the panel records
                    writer.finish(str(self.dir))
            if on_tick is not None:
                on_tick(self)
        finally:
            if self.done:  # after on_tick drew the record: wait() returns to a saved record
                self._finished.set()
        return result

    def _loop(
        self,
        writer: LineSink,
        flight: Cell | None,
        on_tick: Callable[[Run], None] | None,
        console: Console | None = None,
    ) -> None:
        timeout = self.config.timeout_s if flight is None else flight.request.timeout_s
        began = self.started_at if flight is None else flight.started
        last_flush = last_lines = 0.0
        unsent = False
        while True:
            try:
                if flight is not None:
                    flight.step(POLL_S)  # waits on the channel: an answer wakes us at once
                polled = self._logs.poll()
                self._show(writer, polled)
                unsent = unsent or bool(polled)
                now = time.monotonic()
                # Lines after a quiet spell go out at once, not at the next tick (up to FLUSH_S
                # later); a stream of them still goes out about once per FLUSH_S.
                due = now - last_flush >= FLUSH_S or (unsent and now - last_lines >= FLUSH_S)
                if due or (flight is not None and flight.all_answered):
                    self._tick(writer, on_tick)
                    last_flush = now
                    if unsent:
                        last_lines, unsent = now, False
                if self.agent_done or (flight is not None and flight.over()):
                    return
                if self._stalled(writer, began) and self.config.on_hang == "stop":
                    self.stop("hung", first_signal=signal.SIGTERM)
                    return
                if flight is not None and flight.ranks_died():
                    self.stop("failed")
                    return
                # A person's time at a breakpoint()'s prompt is not the cell's run time.
                ran = time.time() - (began or 0.0) - (console.asked_s if console else 0.0)
                late = began is not None and timeout is not None and ran > timeout
                if late and self.stop_reason is None:  # (stopped from elsewhere: wait for it)
                    if flight is None:
                        self.stop("timed_out", first_signal=signal.SIGTERM)
                        return
                    flight.interrupt()
                if flight is None:
                    time.sleep(POLL_S)
            except KeyboardInterrupt:  # noqa: PERF203  (the notebook's stop button, any time)
                if flight is None or not flight.sent or flight.interrupted_at is not None:
                    raise  # a run, a cell not sent yet, or a second interrupt: stop the job
                flight.interrupt()

    def _console(self, writer: LineSink, server: CellServer | NodeChannel) -> Console:
        """Where a rank stopped at ``breakpoint()`` gets its pdb commands (headless: ``c``)."""

        def catch_up() -> None:  # the ranks' lines so far first; an answer awaited is no stall
            self._show(writer, self._logs.poll(every=True))
            self._logs.last_output_at = time.time()

        note = "rank {rank} stopped at breakpoint(): no input() here (nbconvert, nbval): it goes on"
        return Console(server, writer, self.rank_label, unanswered="c", note=note, before=catch_up)

    def _stalled(self, writer: LineSink, began: float | None) -> bool:
        """Look for a stall (quiet since the run or cell began, or its last output); say
        what is found. True when a stall was just reported."""
        if self.stalls is None or began is None:
            return False
        lines = self.stalls.check(max(began, self._logs.last_output_at or 0.0))
        if not lines:
            return False
        self._show(writer, [], lines)
        if self.stalls.reported_at is None:  # progress again after a stall
            return False
        self.stall_lines = lines
        write_meta(self.dir, self.meta())
        return True

    def _show(
        self, writer: LineSink, polled: list[tuple[int, list[str]]], notices: Sequence[str] = ()
    ) -> None:
        for rank, lines in polled:
            writer.add(self.rank_label(rank), lines)
        if notices:
            writer.add("nbgpu", list(notices))

    def _tick(self, writer: LineSink, on_tick: Callable[[Run], None] | None) -> None:
        if isinstance(writer, ScreenWriter) and writer.live_status:
            writer.status(self.memory_status())
        self._show(writer, [], self._take_notices())
        writer.flush()
        if on_tick is not None:
            on_tick(self)

    def _take_notices(self) -> list[str]:
        """Retention, a lost parent-death guarantee, a full disk, a job in SLURM's queue."""
        if self.queue is not None:
            self.notices.pending += self.queue.poll()
        return self.notices.take(on_guarantee_lost=lambda: write_meta(self.dir, self.meta()))

    @property
    def first_output_at(self) -> float | None:
        return self._logs.first_output_at

    def memory_status(self) -> str | None:
        """The node's memory in one line, at most once a second (None in between)."""
        if self.config.mem_sample_s == 0 and self._memory is None:
            return None
        if self._memory is None:
            from nbgpu.profile.live import MemoryFollower  # noqa: PLC0415

            self._memory = MemoryFollower(
                self.dir, self.config.world_size, several_nodes=self.config.nnodes > 1
            )
        return self._memory.summary() if self._memory.due() else None

    @property
    def agent_done(self) -> bool:
        return self.agent is None or self.agent.poll() is not None

    @property
    def done(self) -> bool:
        return self.state in FINAL_STATES

    def _watch_idle(self) -> None:
        """A warm job between cells: one whose ranks died, or that sat idle too long, ends."""
        warm = self.warm
        while warm is not None and not self.done:
            time.sleep(WATCH_S)
            if not warm.lock.acquire(blocking=False):
                continue  # a cell is running: its follower watches
            try:
                if self.stop_reason is not None:
                    return  # being stopped (%gpu_stop, exit): the stop says why, not a death
                if self.agent_done:
                    warm.ended_reason = "a rank died while the job was idle"
                elif warm.idle_timeout_s is not None and (warm.idle_s or 0) >= warm.idle_timeout_s:
                    warm.ended_reason = f"idle for {span(warm.idle_s or 0.0)} (--idle-timeout)"
                    self.stop("idle_timeout")
                else:
                    continue
                self._end(None)
                return
            finally:
                warm.lock.release()

    def stop(
        self, reason: str = "stopped", *, first_signal: int = signal.SIGTERM, grace_s: float = 3.0
    ) -> StopReport:
        """End every process of the run against one deadline; an idle warm job's ranks are
        first asked to leave their loop and exit normally."""
        with self._lock:
            if self.stop_reason is None:
                self.stop_reason = reason
        if self.warm is not None and self.agent is not None and self.warm.ask_to_stop():
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.agent.wait(timeout=grace_s)
        if self.config.slurm is not None:
            # SLURM ends the tasks on every node; the local stop below ends srun itself.
            cancel(self.dir, self.environ, requested="SLURM_JOB_ID" not in self.environ)
        root = self.agent.pid if self.agent else None
        report = stop_processes(self.run_id, root, first_signal=first_signal, grace_s=grace_s)
        if self.agent is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.agent.wait(timeout=1.0)  # reap our child
        self.stop_report = report
        return report

    def end(self, reason: str = "stopped") -> StopReport:
        """Stop the run and collect its outcome, whoever follows it (``%gpu_stop``)."""
        report = self.stop(reason)
        if self.thread is not None:
            self.thread.join(timeout=10)  # the background follower collects the outcome
        else:
            self._end(None)
        return report

    def _end(self, writer: LineSink | None) -> None:
        if not self.agent_done:
            self.stop(self.stop_reason or "stopped")
        self._sweep_orphans()
        last = self._logs.poll() + self._logs.drain()
        notices = self._take_notices()
        if writer is not None:
            self._show(writer, last, notices)
            writer.finish(str(self.dir))
        self.finish()
        if writer is None:  # no follower to draw a record (%gpu_stop, the idle watchdog)
            self._finished.set()

    def _sweep_orphans(self) -> None:
        """Stop processes that outlived the agent and carry the run's id: a rank's own
        children (data loaders) have no parent-death signal and would keep holding GPUs."""
        leftovers = run_processes(self.run_id, None) if self.agent_done else []
        if not leftovers:
            return
        report = stop_processes(self.run_id, None, first_signal=signal.SIGTERM, grace_s=2.0)
        alive = f" (still alive: {', '.join(map(str, report.survivors))})"
        self.notices.pending.append(
            f"{len(leftovers)} processes started by the ranks outlived them; stopped"
            + (alive if report.survivors else "")
        )

    def finish(self) -> None:
        if self.done:
            return
        if self.agent is not None and self.agent.poll() is None:
            self.agent.wait()
        self.ended_at = time.time()
        self.agent_result = read_agent_result(self.dir)
        if self.config.slurm is not None:
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
        elif self.stop_reason in ("timed_out", "interrupted", "stopped", "hung"):
            self.state = self.stop_reason
        elif agent_code == 0 and all(r.exit_code == 0 for r in self.ranks):
            self.state = "succeeded"
        else:
            self.state = "failed"
        write_meta(self.dir, self.meta())
        if self.state == "failed":
            self.diagnosis, self.diagnosis_error, self.root_cause = diagnose_failure(
                self.dir, self.environ, self.name, self.ranks
            )
        if self.warm is not None:
            self.warm.server.close()

    def wait(self, timeout_s: float | None = None) -> Run:
        """Block until a background run or a warm job has finished (or *timeout_s* passes)."""
        if self.thread is not None or self.warm is not None:
            self._finished.wait(timeout_s)
        elif not self.done:
            self.follow(ScreenWriter(lambda _text: None))
        return self


def _stop_running(reason: str) -> None:
    for run in list(RUNS.values()):
        if not run.done and not run.agent_done:
            with contextlib.suppress(Exception):
                run.stop(reason, grace_s=2.0)


def ports_in_use() -> set[int]:
    """Rendezvous ports of this process's running runs (a new run must not take one)."""
    return {r.port for r in RUNS.values() if r.port is not None and r.state == "running"}


def leftover_processes(run: Run) -> list[int]:
    """Pids of the run still alive (for tests and %gpu_runs)."""
    return [p.pid for p in run_processes(run.run_id, run.agent.pid if run.agent else None)]
