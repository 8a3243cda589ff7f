"""What a two-node SLURM run listens on, read from the kernel (psutil) on both test nodes.

The first node's agent holds c10d's rendezvous store (the port in ``rdzv.json``) and the
store it shares with the ranks (their MASTER_PORT); each rank holds gloo's one listener. All
of them on the rendezvous host's address, none on another interface or on every one; srun
(SLURM's, not the job's) is the one process of the run that listens anywhere else.
"""

import ipaddress
import json
import socket
import threading
import time
from pathlib import Path

import psutil
import pytest

from nbgpu.launch.config import SlurmOptions
from nbgpu.launch.launcher import torchrun
from tests.slurm.test_slurm_runs import Screen, nothing_left

pytestmark = pytest.mark.slow

READY = (
    "import os, time, nbgpu.rank as R\n"
    "R.init()\n"
    "R.all_reduce_sum(1)\n"
    "print('ready', os.environ['RANK'], flush=True)\n"
    "time.sleep(6)\n"
)


def named(name):
    """Every live process on the machine whose environment says it belongs to run *name*."""
    return [
        proc for proc in psutil.process_iter(["cmdline", "environ", "name"])
        if (proc.info["environ"] or {}).get("NBGPU_RUN_NAME") == name
    ]  # fmt: skip


def test_two_nodes_listen_only_on_the_rendezvous_host(env, slurm_cluster):
    runs_dir = Path(env["NBGPU_RUNS_DIR"])
    box = {}

    def start():
        box["run"] = torchrun(READY, 2, nnodes=2, slurm=SlurmOptions(), environ=env,
                              write=Screen(), name="listens")  # fmt: skip

    thread = threading.Thread(target=start)
    thread.start()
    deadline = time.monotonic() + 120
    logs = []
    while time.monotonic() < deadline:
        logs = [p for p in runs_dir.glob("listens-*/rank*.log") if "ready" in p.read_text()]
        if len(logs) == 4:
            break
        time.sleep(0.2)
    assert len(logs) == 4
    rdzv = json.loads((logs[0].parent / "rdzv.json").read_text())
    host = socket.gethostbyname(rdzv["host"])
    agents, ranks, others = {}, {}, {}
    for proc in named("listens"):
        try:
            sockets = [
                c.laddr for c in proc.net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN
            ]  # fmt: skip
        except psutil.Error:
            continue
        command = " ".join(proc.info["cmdline"] or [])
        # (a node runs its agent in the process srun started)
        kind = ranks if "-m nbgpu.rank.worker" in command else others
        node_process = (proc.info["cmdline"] or [])[1:3] == ["-m", "nbgpu.rank.slurm_node"]
        kind = agents if node_process else kind  # (srun's own command line names it too)
        kind[proc.pid] = (sockets, proc.info["environ"], proc.info["name"])
    thread.join(timeout=120)
    assert box["run"].state == "succeeded"
    everyone = {pid: s for kind in (agents, ranks) for pid, (s, *_) in kind.items()}
    assert len(agents) == 2, agents
    assert len(ranks) == 4, ranks
    for pid, sockets in everyone.items():
        assert all(ipaddress.ip_address(ip) == ipaddress.ip_address(host) for ip, _ in sockets), (
            pid, sockets, host,
        )  # fmt: skip
    # The ranks' store port, as the agent told them.
    master_ports = {int(environ["MASTER_PORT"]) for _, environ, _ in ranks.values()}
    agent_ports = sorted(port for sockets, *_ in agents.values() for _, port in sockets)
    assert agent_ports == sorted({rdzv["port"], *master_ports}), (agent_ports, rdzv, master_ports)
    assert all(len(sockets) == 1 for sockets, *_ in ranks.values()), ranks  # gloo's own
    # SLURM's srun, on the machine that submits, listens on every interface for its steps'
    # daemons to call back (I/O, signals); SLURM offers a port range for it, no address.
    listening_others = {name for sockets, _, name in others.values() if sockets}
    assert listening_others <= {"srun"}, others
    assert nothing_left(box["run"], slurm_cluster)
