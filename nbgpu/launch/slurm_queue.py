"""A SLURM run that waits in the queue: say why, and cancel what SLURM will never start.

``srun`` blocks while its job is pending and says little ("queued and waiting for
resources"). While a run's job has not started, this watch reads ``srun``'s words from
``agent.log`` and asks ``squeue`` for the job's state and reason every few seconds: a
cell then shows ``SLURM: job 12 is queued: Resources`` instead of nothing, and a new
line each time the reason changes. A job that asks for what the partition's
configuration does not allow (an account it does not accept, more nodes or time than
it permits: SLURM's ``PartitionConfig`` and the policy reasons below) is never going to
start on its own; the watch cancels it and keeps SLURM's words, which the failure
summary shows. Nothing stays queued.

Runs ``squeue``/``scancel`` only while a job is pending; never reads rank logs.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

__all__ = ["QueueWatch", "refusal"]

REFUSED_FILE = "slurm-refused.txt"
_CHECK_EVERY_S = 2.0
_QUEUED = re.compile(r"srun: job (\d+) queued and waiting for resources")
_GRANTED = re.compile(r"srun: job (\d+) has been allocated resources")
# srun's words for a pending reason that only a change of configuration ends.
_NEVER_SRUN = ("Requested partition configuration not available now",)
# squeue's reason codes of the same kind (SLURM's "Job Reason Codes").
_NEVER_CODES = frozenset({
    "AccountNotAllowed", "BadConstraints", "DependencyNeverSatisfied", "InvalidAccount",
    "InvalidQOS", "PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit",
    "QOSNotAllowed",
})  # fmt: skip


def _never_starts(reason: str, srun_words: list[str]) -> bool:
    code = reason.split(maxsplit=1)[0] if reason else ""
    return (
        code in _NEVER_CODES
        or code.endswith("PerJobLimit")  # a per-job limit: this job exceeds it forever
        or any(words in _NEVER_SRUN for words in srun_words)
    )


def refusal(run_dir: Path) -> str | None:
    """SLURM's words for a job the watch cancelled because it would never start."""
    with contextlib.suppress(OSError):
        return (run_dir / REFUSED_FILE).read_text(encoding="utf-8").strip() or None
    return None


class QueueWatch:
    """Follows one SLURM run's job while it is pending (``poll`` from the follow loop)."""

    def __init__(self, run_dir: Path, environ: Mapping[str, str]) -> None:
        self.run_dir = run_dir
        self.environ = dict(environ)
        self.job: str | None = None
        self.done = False  # started, refused, or ended: nothing more to watch
        self._offset = 0
        self._srun_words: list[str] = []
        self._reason: str | None = None
        self._next_check = 0.0

    def poll(self) -> list[str]:
        """Notices to show (the job is queued, and why); cancels a job that never starts."""
        if self.done:
            return []
        self._read_srun()
        if (self.run_dir / "rdzv.json").exists():  # the first node runs: the job started
            self.done = True
        if self.done or self.job is None:
            return []
        now = time.monotonic()
        if now < self._next_check:
            return []
        self._next_check = now + _CHECK_EVERY_S
        state, reason = self._squeue()
        if state != "PENDING":
            return []
        notices = []
        if reason != self._reason:
            self._reason = reason
            notices.append(f"SLURM: job {self.job} is queued: {reason}")
        if _never_starts(reason, self._srun_words):
            words = f"it will not start job {self.job}: {reason}"
            (self.run_dir / REFUSED_FILE).write_text(words, encoding="utf-8")
            self._run(["scancel", self.job])
            self.done = True
            notices.append(f"SLURM {words}; cancelled it, nothing is queued")
        return notices

    def _read_srun(self) -> None:
        try:
            with (self.run_dir / "agent.log").open("rb") as log:
                log.seek(self._offset)
                chunk = log.read(65536)
        except OSError:
            return
        # Whole lines only: a line srun is still writing is read next time.
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        for line in complete.decode("utf-8", "replace").splitlines():
            queued, granted = _QUEUED.search(line), _GRANTED.search(line)
            if queued:
                self.job = queued.group(1)
            elif granted:
                self.done = True
            elif line.startswith("srun: ") and self.job is None:
                self._srun_words.append(line.removeprefix("srun: ").strip())

    def _squeue(self) -> tuple[str, str]:
        done = self._run(["squeue", "-h", "-j", str(self.job), "-o", "%T|%r"])
        state, _, reason = (done.strip().splitlines() or [""])[0].partition("|")
        return state.strip(), reason.strip()

    def _run(self, argv: list[str]) -> str:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            return subprocess.run(
                argv, env=self.environ, capture_output=True, text=True, timeout=20, check=False
            ).stdout
        return ""
