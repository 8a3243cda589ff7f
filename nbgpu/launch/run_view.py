"""A run's state and how it reads: headline, per-rank table, failure report, JSON and
``run.json``; no processes (its life is :class:`~nbgpu.launch.run.Run`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbgpu._render import Block, Bullets, Line, Result, Table, Title, simulated_label, to_text
from nbgpu._serial import read_json_object
from nbgpu.errors import NbgpuError
from nbgpu.launch.config import LaunchConfig
from nbgpu.launch.outcomes import RankOutcome, RunNotices
from nbgpu.launch.procs import agent_log
from nbgpu.launch.rundirs import rank_log
from nbgpu.launch.warm import WarmState
from nbgpu.profile.records import read_node

if TYPE_CHECKING:
    from nbgpu.diagnose.report import Diagnosis
    from nbgpu.profile.report import MemoryReport

__all__ = ["RunFailed", "RunView", "rendezvous_timeout_words"]


class RunView(Result):
    def __init__(self, config: LaunchConfig, *, environ: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.environ = dict(os.environ if environ is None else environ)
        self.name = config.name
        self.run_id = secrets.token_hex(8)
        self.state = "created"
        self.dir = Path()  # its own directory from start()
        self.port: int | None = config.master_port
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self.stop_reason: str | None = None
        self.stall_lines: list[str] = []  # the last stall found (--hang-after), as said
        self.agent: subprocess.Popen[bytes] | None = None
        self.agent_result: dict[str, Any] = {}
        self.ranks: tuple[RankOutcome, ...] = ()
        self.root_cause: RankOutcome | None = None
        self.diagnosis: Diagnosis | None = None  # why the run did not succeed, if it did not
        self.diagnosis_error: str | None = None  # why the diagnosis itself failed, if it did
        self.pulled: dict[str, Any] = {}
        self.pulled_all: list[dict[str, Any]] = []
        self.pull_problems: list[str] = []
        self.notices = RunNotices(config.world_size)  # one-line messages, each shown once
        self.warm: WarmState | None = None  # a warm job's ranks between cells (--keep)
        self._nodes: dict[int, str] = {}  # rank -> its node's name (several nodes only)

    @property
    def duration_s(self) -> float | None:
        return None if self.started_at is None else (self.ended_at or time.time()) - self.started_at

    @property
    def logs(self) -> dict[str, Path]:
        ranks = {f"rank{r}": rank_log(self.dir, r) for r in range(self.config.world_size)}
        return {**ranks, "agent": agent_log(self.dir)}

    @property
    def memory(self) -> MemoryReport:
        """Memory by phase and rank (a report: ``.to_frame()``, ``.figure()``); also live."""
        from nbgpu.profile.report import memory_report  # noqa: PLC0415

        return memory_report(self.dir, label=f"run '{self.name}'")

    def meta(self) -> dict[str, Any]:
        """What ``run.json`` says of the run (retention, stacks and diagnose read it)."""
        cfg = self.config
        return {
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
            # The agent runs this interpreter and torchrun starts the ranks with the agent's:
            # a diagnosis names it when a rank cannot import a module.
            "python": sys.executable,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "state": self.state,
            "stop_reason": self.stop_reason,
            "hang_after_s": cfg.hang_after_s,
            "stall": self.stall_lines or None,
            "ranks": [
                {
                    "rank": r.rank,
                    "local_rank": r.rank % cfg.nproc,  # ranks fill a node before the next
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

    def _rank_state(self, r: RankOutcome) -> str:
        if r.exit_code == 0:
            return "ok"
        if r.signal:
            return f"killed ({r.signal})"
        if r.exit_code is None:
            return "stopped" if self.stop_reason else "unknown"
        return f"exit {r.exit_code}"

    def rank_label(self, rank: int) -> str:
        """``rank3``, or ``n2/rank3`` over several nodes (each rank names its node)."""
        if self.config.nnodes == 1:
            return f"rank{rank}"
        if rank not in self._nodes and (node := read_node(self.dir, rank)) is not None:
            self._nodes[rank] = node
        return f"{self._nodes.get(rank) or '?'}/rank{rank}"

    def failure_summary(self) -> str:
        head = f"run '{self.name}' {self.state.replace('_', ' ')}"
        if self.stop_reason == "timed_out":
            head += f" after {self.config.timeout_s:g} s (--timeout)"
        if self.stop_reason == "hung" and self.stall_lines:
            return f"{head} (--on-hang stop): " + "; ".join(self.stall_lines)
        rc = self.root_cause
        if rc is not None:
            who = f"rank {rc.rank}"
            if self.config.nnodes > 1:
                who += f" on node {self.rank_label(rc.rank).split('/')[0]}"
            head += f": {who} failed first ({self._rank_state(rc)})"
            if rc.error:
                head += f": {rc.error.splitlines()[0][:300]}"
        elif self.state == "failed" and self.agent_result.get("rendezvous_timeout_s"):
            waited = float(self.agent_result["rendezvous_timeout_s"])
            head += f": {rendezvous_timeout_words(self.dir, self.config, waited)}"
            if self.agent_result.get("slurm_error"):
                head += f"; SLURM says {self.agent_result['slurm_error']}"
        elif self.state == "failed" and self.agent_result.get("slurm_error"):
            head += f": SLURM says {self.agent_result['slurm_error']}"
        elif self.state == "failed" and self.agent_result.get("error"):
            head += f": torchrun failed: {self.agent_result['error']}"
        return head

    def failure_lines(self, *, output_shown: bool = False) -> list[str]:
        """The failure, each thing said once: summary (the rank that failed first, as the
        diagnosis decided), cause, fixes, then the traceback (not repeated when
        ``output_shown``: it is above). Never hard-wrapped: a notebook wraps to its width."""
        lines = [f"RunFailed: {self.failure_summary()}"]
        if self.diagnosis_error is not None:
            how = "exit codes and error files" if self.root_cause is not None else "nothing"
            lines.append(
                f"diagnosis failed: {self.diagnosis_error} (the first failing rank above comes "
                f"from {how} alone; `nbgpu diagnose {self.dir}` retries)"
            )
        lines.extend(to_text(self._cause(), width=sys.maxsize).splitlines())
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

    def _cause(self) -> list[Block]:
        """The diagnosis in plain words, then the fixes its headline does not name already."""
        diagnosis = self.diagnosis
        if diagnosis is None or diagnosis.root is None or diagnosis.cause in ("unknown", "none"):
            return []
        headline = diagnosis.headline
        fixes = [fix for fix in diagnosis.root.fixes[:3] if fix not in headline]
        return [
            Line(headline, label="cause", level="bad"),
            *(Line(fix, label="fix", indent="  ") for fix in fixes),
        ]

    def _table(self) -> Table:
        table = Table(["rank", "state", "pid", "error", "log"])
        for r in self.ranks:
            table.add(
                r.rank,
                self._rank_state(r) + (" (root cause)" if self.root_cause is r else ""),
                r.pid or "-",
                (r.error or "-").splitlines()[0][:60],
                r.log.name,
                level="ok" if r.exit_code == 0 and self.root_cause is not r else "bad",
            )
        return table

    def _headline(self) -> str:
        dur = self.duration_s
        gpus = self.config.cuda_visible_devices
        parts = [
            f"run '{self.name}'",
            self.state.replace("_", " "),
            f"{self.config.world_size} ranks"
            + (f" on {self.config.nnodes} nodes" if self.config.nnodes > 1 else ""),
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

    def content(self) -> list[Block]:
        title = Title(self._headline(), simulated=bool(self.simulated_fleet()))
        return [title, *self.summary_blocks()]

    def summary_blocks(self) -> list[Block]:
        """Everything below the headline (a saved record opens with its own headline)."""
        blocks: list[Block] = [self._table()] if self.ranks else []
        if self.state not in ("succeeded", "running", "created"):
            level = "bad" if self.state in ("failed", "timed_out", "hung") else "warn"
            blocks.append(Line(self.failure_summary(), level=level, wrap=False))
        if self.diagnosis_error is not None:
            blocks.append(
                Line(f"diagnosis failed: {self.diagnosis_error}", level="warn", wrap=False)
            )
        if self.pull_problems:
            blocks.append(Bullets(self.pull_problems, marker="! ", level="warn"))
        blocks += self._cause()
        blocks.append(Line(str(self.dir), label="logs", wrap=False))
        return blocks

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
            "stall": self.stall_lines or None,
            "root_cause_rank": None if self.root_cause is None else self.root_cause.rank,
            "ranks": self.records(),
            "pulled": sorted(self.pulled),
            "warm": None
            if self.warm is None
            else {
                "cells": self.warm.cells,
                "idle_s": self.warm.idle_s,
                "in_cell": bool(self.warm.busy),
                "idle_timeout_s": self.warm.idle_timeout_s,
                "ended_reason": self.warm.ended_reason,
            },
        }


class RunFailed(NbgpuError):
    """A run ended without success; ``.run`` has every detail (ranks, logs, root cause)."""

    def __init__(self, run: RunView, *, output_shown: bool = False) -> None:
        super().__init__(run.failure_summary())
        self.run = run
        self.output_shown = output_shown

    def _render_traceback_(self) -> list[str]:
        # A short, readable failure in the notebook instead of a chained traceback wall.
        return self.run.failure_lines(output_shown=self.output_shown)


def rendezvous_timeout_words(run_dir: Path, config: LaunchConfig, waited_s: float) -> str:
    """Who never came, for the failure summary: through SLURM the step's nodes
    (``rdzv.json``) that left no ``node{N}.started``; by hand, the command for the others."""
    within = f"the {config.nnodes} nodes did not meet within {waited_s:g} s (--rdzv-timeout)"
    if config.slurm is not None:
        started = []
        for path in sorted(run_dir.glob("node*.started")):
            with contextlib.suppress(OSError):
                started.append(path.read_text(encoding="utf-8").strip())
        named = read_json_object(run_dir / "rdzv.json").get("node_names")  # SLURM gave the step
        step_nodes = [str(n) for n in named] if isinstance(named, list) else []
        missing = [n for n in step_nodes if n not in started]
        if missing:
            which = "node " + missing[0] if len(missing) == 1 else "nodes " + ", ".join(missing)
            verb = "its" if len(missing) == 1 else "their"
            return (
                f"{within}: SLURM gave the job {which} but it never started {verb} agent "
                f"(started: {', '.join(started) or 'none'}); check it with `scontrol show node` "
                "and its slurmd log, or exclude it (--slurm-arg=--exclude=NODE)"
            )
        return f"{within}: {len(started)} of {config.nnodes} nodes started their agent"
    ranks = ""
    if config.node_rank is not None:
        others = [str(r) for r in range(config.nnodes) if r != config.node_rank]
        ranks = f" and --node-rank {others[0]}"
        if len(others) > 1:
            ranks += f"..{others[-1]} (not {config.node_rank})"
    return (
        f"{within}: the other nodes never joined at {config.rdzv_endpoint}; run the same cell on "
        f"each of them with --nodes {config.nnodes} --rdzv-endpoint {config.rdzv_endpoint} "
        f"--name {config.name}{ranks} (the name is the rendezvous id)"
    )
