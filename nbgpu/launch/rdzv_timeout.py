"""What a rendezvous that timed out says: how long the nodes waited, and who never came.

torchrun's own ``RendezvousTimeoutError`` carries no message. Over SLURM every node that
got as far as its agent left ``node{N}.started`` in the run directory and the first node
listed the step's nodes in ``rdzv.json``, so the nodes that never started their agent
can be named. Started by hand (``--rdzv-endpoint``), the other nodes are cells someone
has to run: the words say which command, with the same name (the rendezvous id).
Reads small files of the run directory; never starts a process.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from nbgpu.launch.config import LaunchConfig

__all__ = ["rendezvous_timeout_words"]


def _started(run_dir: Path) -> list[str]:
    names = []
    for path in sorted(run_dir.glob("node*.started")):
        with contextlib.suppress(OSError):
            names.append(path.read_text(encoding="utf-8").strip())
    return names


def _step_nodes(run_dir: Path) -> list[str]:
    with contextlib.suppress(OSError, ValueError):
        names = json.loads((run_dir / "rdzv.json").read_text(encoding="utf-8")).get("node_names")
        if isinstance(names, list):
            return [str(n) for n in names]
    return []


def rendezvous_timeout_words(run_dir: Path, config: LaunchConfig, waited_s: float) -> str:
    """One clause for the failure summary, e.g. "node n2 never started its agent ..."."""
    within = f"the {config.nnodes} nodes did not meet within {waited_s:g} s (--rdzv-timeout)"
    if config.slurm is not None:
        started = _started(run_dir)
        missing = [n for n in _step_nodes(run_dir) if n not in started]
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
        ranks = f" and --node-rank {others[0]}" if len(others) == 1 else (
            f" and --node-rank {others[0]}..{others[-1]} (not {config.node_rank})"
        )  # fmt: skip
    return (
        f"{within}: the other nodes never joined at {config.rdzv_endpoint}; run the same cell on "
        f"each of them with --nodes {config.nnodes} --rdzv-endpoint {config.rdzv_endpoint} "
        f"--name {config.name}{ranks} (the name is the rendezvous id)"
    )
