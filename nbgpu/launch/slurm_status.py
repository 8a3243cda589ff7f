"""``nbgpu status --slurm``: every node's GPUs, from the nodes themselves.

``srun`` runs ``python -m nbgpu.launch.slurm_status`` once per node (in the kernel's
allocation, or one requested for the look); each prints its inventory (``--probe``: with
the CUDA probe) as ``nbgpu status --json`` writes it, plus its name and each GPU's
health; the kernel merges them into one table.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nbgpu._render import Block, Line, Result, Table, Title, fmt_used_total, to_text
from nbgpu.errors import UserInputError
from nbgpu.launch.config import SlurmOptions

__all__ = ["ClusterStatus", "cluster_status"]


@dataclass(frozen=True)
class NodeStatus:
    node: str
    document: dict[str, Any]  # the node's `nbgpu status --json`
    health: tuple[str, ...]  # each GPU's health word, in NVML order


@dataclass(frozen=True)
class ClusterStatus(Result):
    """Each node's GPUs, as the node itself saw them."""

    nodes: tuple[NodeStatus, ...]
    source: str  # "allocation 1234" or "a look at partition debug"

    def records(self) -> list[dict[str, Any]]:
        return [
            {
                "node": node.node,
                "gpu": gpu.get("index"),
                "name": gpu.get("name"),
                "memory_used_bytes": gpu.get("memory_used_bytes"),
                "memory_total_bytes": gpu.get("memory_total_bytes"),
                "health": health,
                "processes": len(gpu.get("processes") or []),
            }
            for node in self.nodes
            for gpu, health in zip(node.document.get("gpus", []), node.health, strict=False)
        ]

    def content(self) -> list[Block]:
        table = Table(["node", "GPU", "name", "memory", "health", "processes"])
        for row in self.records():
            table.add(
                row["node"], row["gpu"], row["name"] or "?",
                fmt_used_total(row["memory_used_bytes"], row["memory_total_bytes"]),
                row["health"], row["processes"],
                level="" if row["health"] in ("ok", "in use") else "bad",
            )  # fmt: skip
        gpus = sum(len(n.health) for n in self.nodes)
        head = f"nbgpu status --slurm · {len(self.nodes)} nodes · {gpus} GPUs · {self.source}"
        notes = [
            Line(f"{n.node}: {n.document['nvml_error']}", level="bad", wrap=False)
            for n in self.nodes
            if n.document.get("nvml_error")
        ]
        return [Title(head), table, *notes]

    def text(self) -> str:
        return to_text(self.content(), width=120)  # a row per GPU: wider than 80 columns

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "nodes": [{"node": n.node, "health": list(n.health), **n.document} for n in self.nodes],
        }


def cluster_status(
    *,
    nodes: int | None,
    options: SlurmOptions,
    environ: Mapping[str, str],
    probe: bool = False,
    wait_s: int = 60,
) -> ClusterStatus:
    """Ask every node of the allocation (or *nodes* nodes of a fresh one) for its GPUs;
    outside an allocation, wait at most *wait_s* for nodes (``srun --immediate``).
    """
    from nbgpu.launch.slurm import check_request, request_args  # noqa: PLC0415

    job = environ.get("SLURM_JOB_ID")
    count = nodes or int(environ.get("SLURM_JOB_NUM_NODES") or 0) or 1
    check_request(count, options, environ)
    argv = ["srun", "--nodes", str(count), "--ntasks-per-node", "1", "--job-name", "nbgpu-status"]
    if not job:
        argv += [f"--immediate={wait_s}"]
    argv += [*request_args(options), sys.executable, "-m", "nbgpu.launch.slurm_status"]
    argv += ["--probe"] if probe else []
    try:
        done = subprocess.run(
            argv, env=dict(environ), capture_output=True, text=True, timeout=300, check=False
        )
    except subprocess.TimeoutExpired:
        raise UserInputError("--slurm: the nodes did not answer within 300 s") from None
    found = [NodeStatus(d["node"], d["status"], tuple(d["health"])) for d in _reports(done.stdout)]
    if done.returncode != 0 or len(found) != count:
        words = (done.stderr.strip().splitlines() or ["no answer"])[-1]
        raise UserInputError(
            f"--slurm: {len(found)} of {count} nodes answered; srun says {words!r}"
        )
    source = f"allocation {job}" if job else f"{count} node(s) requested for the look"
    return ClusterStatus(tuple(sorted(found, key=lambda n: n.node)), source)


def _node_report(probe: bool) -> dict[str, Any]:
    from nbgpu.devices.findings import gpu_health  # noqa: PLC0415
    from nbgpu.devices.inventory import take_inventory  # noqa: PLC0415

    inventory = take_inventory(probe=probe)
    return {
        "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        "status": inventory.to_dict(),
        "health": [
            gpu_health(g, f)[0] for g, f in zip(inventory.gpus, inventory.findings, strict=True)
        ],
    }


# srun forwards each task's output in pieces of about 1 KiB, and the nodes' pieces
# interleave: each node sends its report as numbered short lines that are put back
# together here, instead of one long line.
_MARK = "NBGPU-STATUS"
_PIECE = 800


def _send(report: dict[str, Any]) -> None:
    blob = base64.b64encode(zlib.compress(json.dumps(report).encode())).decode()
    pieces = [blob[i : i + _PIECE] for i in range(0, len(blob), _PIECE)] or [""]
    node = report["node"]
    for i, piece in enumerate(pieces):
        print(f"{_MARK} {node} {i} {len(pieces)} {piece}", flush=True)


def _reports(stdout: str) -> list[dict[str, Any]]:
    pieces: dict[str, dict[int, str]] = {}
    counts: dict[str, int] = {}
    for line in stdout.splitlines():
        parts = line.split(" ")
        if len(parts) == 5 and parts[0] == _MARK:
            node, index, count, piece = parts[1], int(parts[2]), int(parts[3]), parts[4]
            pieces.setdefault(node, {})[index] = piece
            counts[node] = count
    out = []
    for node, got in pieces.items():
        if len(got) == counts[node]:
            blob = "".join(got[i] for i in range(counts[node]))
            out.append(json.loads(zlib.decompress(base64.b64decode(blob))))
    return out


if __name__ == "__main__":
    _send(_node_report("--probe" in sys.argv[1:]))
