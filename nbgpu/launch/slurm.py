"""SLURM from the kernel. ``srun`` starts one ``nbgpu.rank.slurm_node`` per node (the c10d
rendezvous, then torchrun's agent), as a step of the kernel's allocation (``SLURM_JOB_ID``) or
in one requested for the run. What SLURM would refuse or queue forever is refused first, in
one line (in SLURM's words where it gave some). While the job is pending, :class:`QueueWatch`
says why, and cancels a job the partition will never start.

``status --slurm`` runs this module once per node: each prints its inventory as ``nbgpu
status --json`` writes it, its name and each GPU's health; the kernel merges them.
"""

import base64
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbgpu._render import Block, Line, Result, Table, Title, fmt_used_total, to_text
from nbgpu._serial import read_json_object
from nbgpu.errors import UserInputError
from nbgpu.launch.config import LaunchConfig, SlurmOptions

__all__ = [
    "ClusterStatus", "QueueWatch", "cancel", "check_request", "cluster_status", "nodes_up",
    "request_args", "srun_argv", "srun_error",
]  # fmt: skip

JOIN_TIMEOUT_S = 120  # how long the nodes wait for each other at the rendezvous


def _run(argv: Sequence[str], environ: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            list(argv), env=dict(environ), capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise UserInputError(f"SLURM: {argv[0]} failed to run ({exc})") from None


# Node states (sinfo %t, without its flag suffixes) in which a node will not take a job.
_UNUSABLE = ("down", "drain", "drng", "fail", "failg", "maint", "boot", "futr", "inval", "unk")


def _nodes_in_partition(partition: str | None, environ: Mapping[str, str]) -> tuple[int, int]:
    """(nodes that can run a job, nodes that cannot: down, drained, failed...)."""
    argv = ["sinfo", "-h", "-o", "%D %P %t"]
    if partition:
        argv += ["-p", partition]
    done = _run(argv, environ)
    if done.returncode != 0:
        words = (done.stderr.strip().splitlines() or ["no answer"])[-1]
        raise UserInputError(f"SLURM is not reachable here: sinfo says {words!r}")
    usable: dict[str, int] = {}
    unusable: dict[str, int] = {}
    for line in done.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0].isdigit():
            state = parts[2].rstrip("*~#!%$@^-+")  # flags: not responding, powered down...
            bucket = unusable if state in _UNUSABLE or parts[2].endswith("*") else usable
            bucket[parts[1]] = bucket.get(parts[1], 0) + int(parts[0])
    # Without --partition SLURM uses the default one, which sinfo marks with "*".
    names = set(usable) | set(unusable)
    default = {p for p in names if p.endswith("*")}
    chosen = default if not partition and default else names
    total = sum(usable.get(p, 0) for p in chosen)
    down = sum(unusable.get(p, 0) for p in chosen)
    if partition and total + down == 0:
        raise UserInputError(
            f"--partition {partition!r}: SLURM knows no such partition (sinfo -p lists none)"
        )
    return total, down


def nodes_up(partition: str | None, environ: Mapping[str, str]) -> int:
    """How many nodes of *partition* (default: the default one) can take a job (sinfo)."""
    return _nodes_in_partition(partition, environ)[0]


def check_request(nodes: int, options: SlurmOptions, environ: Mapping[str, str]) -> list[str]:
    """Refuse what SLURM would refuse or queue forever; the notes to announce."""
    if shutil.which("srun", path=environ.get("PATH")) is None:
        raise UserInputError(
            "--slurm: SLURM is not installed here (no srun on PATH); run on a cluster's login "
            "node, or drop --slurm"
        )
    job = environ.get("SLURM_JOB_ID")
    if job:
        have = int(environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or 1)
        if nodes > have:
            raise UserInputError(
                f"--nodes {nodes}: the allocation {job} holds {have} node(s); ask for at most "
                f"{have}, or start the notebook outside the allocation"
            )
        return [f"SLURM: a step of allocation {job} on {nodes} of its {have} node(s)"]
    total, down = _nodes_in_partition(options.partition, environ)
    where = f"partition {options.partition!r}" if options.partition else "the cluster"
    if nodes > total + down:
        raise UserInputError(
            f"--nodes {nodes}: {where} has {total + down} node(s) (sinfo); SLURM would queue "
            "this job forever"
        )
    if nodes > total:
        raise UserInputError(
            f"--nodes {nodes}: {where} has {total} node(s) up and {down} down or drained "
            "(sinfo); SLURM would queue this job until they return"
        )
    return [f"SLURM: requesting {nodes} node(s) from {where} for this run"]


def srun_argv(config: LaunchConfig, run_dir: Path, run_id: str) -> list[str]:
    argv = ["srun", "--nodes", str(config.nnodes), "--ntasks-per-node", "1"]
    argv += ["--job-name", f"nbgpu-{config.name}"]
    argv.append("--kill-on-bad-exit=1")  # one node's agent failing ends every node's
    argv += ["--label", "--unbuffered"]  # --label: each agent.log line names its node's task
    argv += request_args(config.slurm or SlurmOptions())
    join_s = f"{config.rdzv_timeout_s or JOIN_TIMEOUT_S:g}"
    node = [sys.executable, "-m", "nbgpu.rank.slurm_node", str(run_dir), str(config.nnodes)]
    return [*argv, *node, str(config.nproc), run_id, join_s]


def request_args(options: SlurmOptions) -> list[str]:
    argv = []
    if options.partition:
        argv += ["--partition", options.partition]
    if options.time:
        argv += ["--time", options.time]
    if options.account:
        argv += ["--account", options.account]
    if options.gpus_per_node is not None:
        argv += [f"--gpus-per-node={options.gpus_per_node}"]
    if options.nodelist:
        argv += ["--nodelist", options.nodelist]
    return [*argv, *options.extra]


def srun_error(run_dir: Path) -> str | None:
    """SLURM's own reason when ``srun`` refused or lost the job (its last error line), or
    its words for a job :class:`QueueWatch` cancelled because it would never start."""
    with contextlib.suppress(OSError):
        refused = (run_dir / REFUSED_FILE).read_text(encoding="utf-8").strip()
        if refused:
            return refused
    try:
        with (run_dir / "agent.log").open("rb") as log:
            log.seek(0, 2)
            log.seek(max(0, log.tell() - 65536))
            tail = log.read().decode("utf-8", "replace")
    except OSError:
        return None
    errors = [line.strip() for line in tail.splitlines() if line.startswith("srun: error:")]
    return errors[-1].removeprefix("srun: error:").strip() if errors else None


def cancel(run_dir: Path, environ: Mapping[str, str], *, requested: bool) -> str | None:
    """``scancel`` the run's step (or the allocation it requested); what was cancelled."""
    rdzv = read_json_object(run_dir / "rdzv.json")
    job, step = rdzv.get("job_id"), rdzv.get("step_id")
    if not job:
        return None  # no node started yet: stopping srun withdraws the request itself
    target = str(job) if requested or step is None else f"{job}.{step}"
    with contextlib.suppress(UserInputError):
        _run(["scancel", target], environ)
    return target


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
            with contextlib.suppress(UserInputError):
                _run(["scancel", self.job], self.environ)
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
        with contextlib.suppress(UserInputError):  # no answer: asked again next time
            out = _run(["squeue", "-h", "-j", str(self.job), "-o", "%T|%r"], self.environ)
            state, _, reason = (out.stdout.strip().splitlines() or [""])[0].partition("|")
            return state.strip(), reason.strip()
        return "", ""


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
                row["node"],
                row["gpu"],
                row["name"] or "?",
                fmt_used_total(row["memory_used_bytes"], row["memory_total_bytes"]),
                row["health"],
                row["processes"],
                level="" if row["health"] in ("ok", "in use") else "bad",
            )
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
    outside an allocation, wait at most *wait_s* for nodes (``srun --immediate``)."""
    job = environ.get("SLURM_JOB_ID")
    count = nodes or int(environ.get("SLURM_JOB_NUM_NODES") or 0) or 1
    check_request(count, options, environ)
    argv = ["srun", "--nodes", str(count), "--ntasks-per-node", "1", "--job-name", "nbgpu-status"]
    if not job:
        argv += [f"--immediate={wait_s}"]
    argv += [*request_args(options), sys.executable, "-m", "nbgpu.launch.slurm"]
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
    from nbgpu.devices.inventory import take_inventory  # noqa: PLC0415
    from nbgpu.devices.model import gpu_health  # noqa: PLC0415

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
    for i, piece in enumerate(pieces):
        print(f"{_MARK} {report['node']} {i} {len(pieces)} {piece}", flush=True)


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
