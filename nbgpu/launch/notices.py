"""One-line messages a run shows once, between its ranks' lines.

Old run directories pruned before the run (the policy is told once per process), a
process of the run whose parent-death signal the kernel refused, and the disk under
the run directory filling up. The follow loop takes them each tick.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from nbgpu.errors import UserInputError

__all__ = ["DISK_FULL_BELOW_BYTES", "RunNotices"]

DISK_FULL_BELOW_BYTES = 64 * 1024  # less free space than this under the run dir: full
_RETENTION_ANNOUNCED: list[bool] = []  # the policy is told once per process


class RunNotices:
    """The notices of one run; ``run_dir`` is set once the run directory exists."""

    def __init__(self, nproc: int) -> None:
        self.nproc = nproc
        self.run_dir: Path | None = None
        self.pending: list[str] = []
        self.disk_full_since: float | None = None  # when the run directory's disk filled
        self._guarantee_announced = False

    def add(self, text: str) -> None:
        self.pending.append(text)

    def prune_old_runs(self, environ: Mapping[str, str]) -> None:
        """Prune old run directories before adding one; never blocks a launch."""
        from nbgpu.launch import retention  # noqa: PLC0415

        try:
            report = retention.prune(environ, keep_newest_extra=1)
        except (UserInputError, OSError) as exc:
            self.add(f"old runs not pruned: {exc}")
            return
        if report.removed and not _RETENTION_ANNOUNCED:
            _RETENTION_ANNOUNCED.append(True)
            self.add(
                f"removed {len(report.removed)} old run directories "
                f"({report.freed_bytes / 1e6:.0f} MB) from {report.root}: keeping "
                f"{report.policy.describe()}; %gpu_runs --prune / nbgpu runs --prune"
            )

    def take(self, on_guarantee_lost: Callable[[], object]) -> list[str]:
        """Messages not shown yet. *on_guarantee_lost* runs once, when one is first seen."""
        out, self.pending = self.pending, []
        guarantee = self._guarantee_notice()
        if guarantee is not None:
            with contextlib.suppress(OSError):
                on_guarantee_lost()
            out.append(guarantee)
        disk = self._disk_full_notice()
        if disk is not None:
            out.append(disk)
        return out

    def lost_guarantees(self) -> dict[str, str]:
        """Processes (agent, rankN) whose parent-death signal the kernel refused, and why."""
        out: dict[str, str] = {}
        if self.run_dir is None:
            return out
        for path in sorted(self.run_dir.glob("pdeathsig-*.txt")):
            with contextlib.suppress(OSError):
                out[path.stem.removeprefix("pdeathsig-")] = path.read_text("utf-8").strip()
        return out

    def guarantee_record(self) -> dict[str, Any]:
        lost = self.lost_guarantees()
        return {"ok": not lost, "lost": lost}

    def _guarantee_notice(self) -> str | None:
        if self._guarantee_announced:
            return None
        lost = self.lost_guarantees()
        if not lost:
            return None
        self._guarantee_announced = True
        reason = next(iter(lost.values()))
        return (
            f"no parent-death signal for {', '.join(lost)} ({reason}): if this process is "
            "killed, the run's processes keep running; stop them with %gpu_stop / nbgpu clean"
        )

    def _disk_full_notice(self) -> str | None:
        """One line, the first time the disk under the run directory is found full.

        Ranks drop their output instead of failing (``nbgpu.rank.worker``); this says which
        logs are incomplete and from when. A rank's own marker gives its exact time;
        the disk's free space, checked each tick, catches a disk too full for markers.
        """
        if self.disk_full_since is not None or self.run_dir is None:
            return None
        stamps = []
        for path in self.run_dir.glob("logfull-rank*.txt"):
            with contextlib.suppress(OSError, ValueError):
                stamps.append(float(path.read_text(encoding="utf-8")))
        try:
            st = os.statvfs(self.run_dir)
            full = st.f_bavail * st.f_frsize < DISK_FULL_BELOW_BYTES
        except OSError:
            full = False
        if not stamps and not full:
            return None
        self.disk_full_since = min(stamps) if stamps else time.time()
        when = time.strftime("%H:%M:%S", time.localtime(self.disk_full_since))
        return (
            f"the disk under {self.run_dir} is full: rank logs (rank0..rank{self.nproc - 1}"
            f".log) and the output shown here are incomplete from {when} on; the ranks keep "
            "running (free space, or set NBGPU_RUNS_DIR elsewhere for the next run)"
        )
