"""One node of a SLURM job: find the rendezvous, then become torchrun's agent.

``srun`` starts ``python -m nbgpu.rank.slurm_node RUN_DIR NNODES NPROC RUN_ID JOIN_S`` on each node.
The first node (``SLURM_NODEID`` 0) writes ``rdzv.json``: its address as SLURM knows it, a free
port, and the job and step ids the kernel cancels; the others wait for it on the shared run
directory. Each node takes its GPUs from a plan (``NBGPU_NODE_GPUS``) and runs nbgpu's agent in
this same process (SLURM's signals reach torchrun), torch imported by a thread meanwhile: the
rendezvous costs no time of its own. Standard library only until then.
"""

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

__all__ = ["main"]

_WAIT_FOR_FIRST_NODE_S = 120.0
#: A plan's GPUs per node as JSON, ``{"n1": "1,2", "n2": "0,1"}``: each node takes its own
#: entry as ``CUDA_VISIBLE_DEVICES`` (``%%torchrun --plan p`` with a plan across nodes;
#: the kernel sets it in ``nbgpu.launch.slurm``).
_NODE_GPUS_ENV = "NBGPU_NODE_GPUS"


def _scontrol(*args: str) -> list[str]:
    """``scontrol show ...``'s words (none when it cannot answer)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(
            ["scontrol", "show", *args], capture_output=True, text=True, timeout=20, check=False
        ).stdout.split()
    return []


def _node_address(name: str) -> str:
    """The address SLURM reaches *name* at (``NodeAddr``), else its hostname."""
    fields = _scontrol("node", name, "-o")
    addresses = (f.removeprefix("NodeAddr=") for f in fields if f.startswith("NodeAddr="))
    return next(addresses, socket.gethostname())


def _publish(run_dir: Path, name: str) -> dict[str, object]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # free on every address
        sock.bind(("", 0))  # so on the host's too (the agent listens on that one only)
        port = int(sock.getsockname()[1])
    nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
    rdzv = {
        "host": _node_address(name),
        "port": port,
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "step_id": os.environ.get("SLURM_STEP_ID"),
        # SLURM's own expansion of "n[1-2]" (none: the kernel counts the nodes instead)
        "node_names": _scontrol("hostnames", nodes or name),
    }
    tmp = run_dir / ".rdzv.json.tmp"
    tmp.write_text(json.dumps(rdzv), encoding="utf-8")
    tmp.replace(run_dir / "rdzv.json")  # atomic: the other nodes never read half a file
    return rdzv


def _await(run_dir: Path) -> dict[str, object]:
    path = run_dir / "rdzv.json"
    deadline = time.monotonic() + _WAIT_FOR_FIRST_NODE_S
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            data: dict[str, object] = json.loads(path.read_text(encoding="utf-8"))
            return data
        time.sleep(0.05)
    raise SystemExit(
        f"nbgpu: the first node never wrote {path} within {_WAIT_FOR_FIRST_NODE_S:g} s: is "
        "the run directory on a filesystem every node sees? (set NBGPU_RUNS_DIR to one)"
    )


def _take_planned_gpus(name: str) -> None:
    planned = os.environ.pop(_NODE_GPUS_ENV, None)
    if planned is None:
        return
    try:
        devices = json.loads(planned)[name]
    except (ValueError, KeyError, TypeError):
        raise SystemExit(
            f"nbgpu: the plan names no GPUs for node {name!r} ({_NODE_GPUS_ENV}={planned}); "
            "plan again with %gpu_plan --slurm"
        ) from None
    os.environ["CUDA_VISIBLE_DEVICES"] = str(devices)
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # the plan's numbers are nvidia-smi's


_RELAY: list[subprocess.Popen[bytes]] = []  # held: a running child is not collected (a warning)


def _start_cell_relay(run_dir: Path, node: int, name: str, nproc: str) -> None:
    """A warm job: this node's relay carries its ranks' cells to and from the kernel (by
    module name: the kernel's side of the channel, ``nbgpu.launch.relay``). It dies with
    this process; the ranks find its socket in ``NBGPU_CELLS``."""
    spec = json.loads((run_dir / "bootstrap.json").read_text(encoding="utf-8"))
    if not spec.get("keep"):
        return
    argv = [sys.executable, "-m", "nbgpu.launch.relay", str(run_dir), str(node), name, nproc]
    relay = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    _RELAY.append(relay)
    path = ""
    if relay.stdout is not None:  # (always: a pipe)
        with relay.stdout:
            path = relay.stdout.readline().decode().strip()  # once its socket listens
    if not path:
        raise SystemExit(f"nbgpu: the cell relay on node {name} did not start (agent.log)")
    os.environ["NBGPU_CELLS"] = path  # the ranks inherit it


def _import_torchrun() -> None:
    import torch.distributed.run  # noqa: F401, PLC0415  (the agent's slow part, started early)


def main(argv: list[str]) -> NoReturn:
    if len(argv) != 5:
        raise SystemExit(
            "usage: python -m nbgpu.rank.slurm_node RUN_DIR NNODES NPROC RUN_ID JOIN_S"
        )
    run_dir, nnodes, nproc, run_id, join_s = Path(argv[0]), argv[1], argv[2], argv[3], argv[4]
    importing = threading.Thread(target=_import_torchrun, name="nbgpu-import", daemon=True)
    importing.start()
    node = int(os.environ.get("SLURM_NODEID", "0"))
    name = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    rdzv = _publish(run_dir, name) if node == 0 else _await(run_dir)
    os.environ["NBGPU_NODE"] = name  # each rank writes it next to its log (node/rank labels)
    _take_planned_gpus(name)
    _start_cell_relay(run_dir, node, name, nproc)
    # Which nodes got as far as their agent: a rendezvous that times out names the others.
    (run_dir / f"node{node}.started").write_text(name, encoding="utf-8")
    # The agent dies with this step's slurmstepd (our parent), as it would with a kernel.
    os.environ["NBGPU_LAUNCHER_PID"] = str(os.getppid())
    os.environ["TORCHELASTIC_ERROR_FILE"] = str(run_dir / f"agent-error-node{node}.json")
    agent = [str(run_dir / f"result-node{node}.json"), "--"]
    agent += ["--nnodes", nnodes, "--nproc-per-node", nproc, "--rdzv-backend", "c10d"]
    agent += ["--rdzv-endpoint", f"{rdzv['host']}:{rdzv['port']}", "--rdzv-id", run_id]
    agent += ["--rdzv-conf", f"join_timeout={join_s}", "--max-restarts", "0"]
    agent += ["--log-dir", str(run_dir / "torchelastic" / f"node{node}")]
    agent += ["--module", "nbgpu.rank.worker"]
    importing.join()
    from nbgpu.rank.agent import main_and_exit  # noqa: PLC0415

    main_and_exit(agent)


if __name__ == "__main__":
    main(sys.argv[1:])
