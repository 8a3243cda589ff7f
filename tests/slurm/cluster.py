"""A real two-node SLURM cluster on loopback, for the scale-out tests.

Debian's ``slurm-wlm`` and ``munge``: a private munge key and socket, ``slurmctld``, and
two ``slurmd`` daemons (nodes ``n1`` and ``n2``, both ``NodeAddr=127.0.0.1`` on their own
ports, per-node spool, pid and log paths), every daemon in the foreground as our child,
stopped by its pid. Clients find it through ``SLURM_CONF``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sinfo", "squeue", "scancel")


def missing_binaries() -> list[str]:
    found = {name: shutil.which(name) or _sbin(name) for name in DAEMONS}
    return [name for name, path in found.items() if path is None]


def _sbin(name: str) -> str | None:
    path = Path("/usr/sbin") / name
    return str(path) if path.exists() else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Cluster:
    """The daemons, the config, and the environment clients need."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for key in list(self.env):
            if key.startswith("SLURM_") and key != "SLURM_CONF":
                del self.env[key]  # never inherit an allocation of the machine running us

    def _write_config(self) -> None:
        r = self.root
        for sub in ("state", "spool/n1", "spool/n2", "log"):
            (r / sub).mkdir(parents=True, exist_ok=True)
        host = socket.gethostname().split(".")[0]
        ctld, n1, n2 = _free_port(), _free_port(), _free_port()
        self.conf.write_text(
            f"""ClusterName=nbgputest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={r}/munge.socket
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmctldLogFile={r}/log/slurmctld.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
KillWait=5
NodeName=n1 NodeAddr=127.0.0.1 Port={n1} CPUs=2 RealMemory=2000 State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 Port={n2} CPUs=2 RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
PartitionName=grant Nodes=n1,n2 AllowAccounts=physics State=UP OverSubscribe=YES
""",
            encoding="utf-8",
        )

    def _start(self, *argv: str) -> None:
        log = self.root / "log" / f"{Path(argv[0]).name}-{len(self.procs)}.out"
        with log.open("wb") as out:  # the child keeps its own descriptor
            self.procs.append(
                subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT)
            )

    def start(self, timeout_s: float = 30.0) -> Cluster:
        self._write_config()
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        r = str(self.root)
        self._start(
            _sbin("munged") or "munged", "--foreground", "--force", f"--key-file={key}",
            f"--socket={r}/munge.socket", f"--pid-file={r}/munged.pid",
            f"--log-file={r}/log/munged.log", f"--seed-file={r}/munge.seed",
        )  # fmt: skip
        self._wait((self.root / "munge.socket").exists, timeout_s, "munged")
        self._start(_sbin("slurmctld") or "slurmctld", "-D", "-i")
        for node in ("n1", "n2"):
            self._start(_sbin("slurmd") or "slurmd", "-D", "-N", node)
        self._wait(self._nodes_idle, timeout_s, "both nodes idle in sinfo")
        return self

    def _nodes_idle(self) -> bool:
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%n %t"], env=self.env, capture_output=True, text=True,
            timeout=10, check=False,
        )  # fmt: skip
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        return states.get("n1") == "idle" and states.get("n2") == "idle"

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if any(p.poll() is not None for p in self.procs):
                break
            if ready():
                return
            time.sleep(0.2)
        logs = "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
            for p in sorted((self.root / "log").glob("*"))
        )
        self.stop()
        raise RuntimeError(f"SLURM test cluster: {what} did not come up\n{logs}")

    def slurmd(self, node: str) -> subprocess.Popen[bytes]:
        """The slurmd daemon of *node* (started after munged and slurmctld, n1 then n2)."""
        return self.procs[2 + ("n1", "n2").index(node)]

    def squeue(self) -> list[str]:
        out = subprocess.run(
            ["squeue", "-h", "-o", "%i %j %T"], env=self.env, capture_output=True, text=True,
            timeout=10, check=False,
        )  # fmt: skip
        return [line for line in out.stdout.splitlines() if line.strip()]

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            subprocess.run(
                ["scancel", "--user", str(os.getuid())], env=self.env, timeout=10, check=False
            )
        for proc in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # noqa: PERF203  (one daemon at a time)
                proc.kill()
                proc.wait(timeout=5)
        self.procs.clear()
