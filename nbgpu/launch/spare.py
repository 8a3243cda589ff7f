"""The agent, started before its run is prepared (``with agent_started_early():``).

Most of a launch is the agent importing torch (1.5-2 s on 2 cores); what nbgpu does first
(parsing, the inventory, the run directory, the rank bootstrap) took 0.1-0.3 s more, in
series. So a face starts the agent first: it imports torch while nbgpu prepares, then
takes its run on stdin (``python -m nbgpu.rank.agent --wait``: argv, environment, working
directory) and is the run's agent from then on. A spare that no run takes (bad input, a
warm job's next cell, a SLURM run, whose agent is srun) is killed when the block ends.
Standard library only: the CLI starts one before it imports anything else of nbgpu.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, cast

from nbgpu._children import with_package_importable

__all__ = [
    "FR_BUFFER", "RUN_ID_ENV", "Spare", "agent_started_early", "base_agent_env", "early_run_id",
    "take_spare",
]  # fmt: skip

RUN_ID_ENV = "NBGPU_RUN_ID"
# Entries each rank's flight recorder keeps. Recording costs no measurable time a step; what
# grows with it is the dump a stall look asks of each rank (2,000: 28 ms, 1 MB; bench_flight).
FR_BUFFER = 2000

_SPARE: contextvars.ContextVar[Spare | None] = contextvars.ContextVar("nbgpu_spare", default=None)


def base_agent_env(environ: Mapping[str, str], run_id: str) -> dict[str, str]:
    """The agent's environment before its run is known (the run adds its own keys)."""
    env = with_package_importable(environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets anyway, minus its banner
    env[RUN_ID_ENV] = run_id  # from the start: a run's processes are found by it
    env["NBGPU_LAUNCHER_PID"] = str(os.getpid())
    # Every rank keeps its last collectives (PyTorch's flight recorder): how a stalled job
    # names the rank that never joined (launch/outcomes.py).
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env:
        env.setdefault("TORCH_FR_BUFFER_SIZE", str(FR_BUFFER))
    env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    # ipykernel turns fd capture off under pytest; nothing in ranks should care.
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


class Spare:
    """An agent process importing torch, waiting for its run."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.run_id = secrets.token_hex(8)
        # What it prints before it has a run (an import warning) is kept and goes first
        # into its log; a file, not a pipe, so nothing blocks on a reader.
        with tempfile.TemporaryFile() as early:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "nbgpu.rank.agent", "--wait"],
                env=base_agent_env(environ, self.run_id),
                stdin=subprocess.PIPE,
                stdout=early,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # as start_agent: nbgpu stops it deliberately
            )

    def start(
        self, args: Sequence[str], env: Mapping[str, str], log: Path
    ) -> subprocess.Popen[bytes] | None:
        """Hand the agent its run (``RESULT.json -- <torchrun args>``); None if it died."""
        job = {"argv": list(args), "env": dict(env), "cwd": str(Path.cwd()), "log": str(log)}
        try:
            stdin = cast(IO[bytes], self.proc.stdin)  # a pipe: Popen(stdin=PIPE)
            stdin.write(json.dumps(job).encode() + b"\n")
            stdin.close()
        except OSError:  # it died while importing torch: the caller starts another
            self.cancel()
            return None
        return self.proc

    def cancel(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.send_signal(signal.SIGKILL)  # no children yet, no user code
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        self.proc.wait()


def early_run_id() -> str | None:
    """The run id of the agent started early, which the run being started adopts."""
    spare = _SPARE.get()
    return None if spare is None else spare.run_id


def take_spare() -> Spare | None:
    """The agent started early for the run being started now, if any (once)."""
    spare = _SPARE.get()
    _SPARE.set(None)
    return spare


@contextlib.contextmanager
def agent_started_early(
    environ: Mapping[str, str] | None = None, *, enabled: bool = True
) -> Iterator[None]:
    """Start an agent now for the run this block starts; kill it if no run takes it."""
    if not enabled or _SPARE.get() is not None:
        yield
        return
    spare = Spare(os.environ if environ is None else environ)
    token = _SPARE.set(spare)
    try:
        yield
    finally:
        if _SPARE.get() is spare:  # not taken
            spare.cancel()
        _SPARE.reset(token)
