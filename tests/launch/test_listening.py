"""What a single-node run listens on, read from the kernel (psutil), not from nbgpu's records.

Every process of the run (the launcher's descendants, or every process carrying the run's id)
is scanned while its ranks hold a gloo process group: each listening socket must be on a
loopback address, and there must be some (the agent's store at least), so the scan can fail.
The environment names a non-loopback interface in GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME,
as a cluster's login profile may: a single-node run must not follow it.
"""

import ipaddress
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from nbgpu.launch.execute import execute, stop_runs, to_screen
from nbgpu.launch.launcher import prepare, torchrun

pytestmark = pytest.mark.slow

READY = (
    "import os, sys, time, nbgpu.rank as R\n"
    "R.init()\n"
    "R.all_reduce_sum(1)\n"
    "print('ready', os.environ['RANK'], flush=True)\n"
    "time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 60)\n"
)


def outward_interface():
    """An up interface with a non-loopback IPv4 address (None on a machine without one)."""
    stats = psutil.net_if_stats()
    for name, addresses in psutil.net_if_addrs().items():
        up = name in stats and stats[name].isup
        for a in addresses:
            if (
                up
                and a.family.name == "AF_INET"
                and not ipaddress.ip_address(a.address).is_loopback
            ):
                return name
    return None


@pytest.fixture
def run_env(env):
    out = dict(env)
    outward = outward_interface()
    if outward is not None:
        out["GLOO_SOCKET_IFNAME"] = out["NCCL_SOCKET_IFNAME"] = outward
    return out


def carrying(run_id):
    """Every live process on the machine with the run's id in its environment."""
    found = []
    for proc in psutil.process_iter():
        try:
            if f"NBGPU_RUN_ID={run_id}".encode() in Path(
                f"/proc/{proc.pid}/environ"
            ).read_bytes().split(b"\0"):
                found.append(proc)
        except (OSError, psutil.Error):  # noqa: PERF203  (a process may vanish while read)
            continue
    return found


def listening(procs):
    """(pid, ip, port) of every LISTEN socket of *procs*, IPv4 and IPv6."""
    found = []
    for proc in procs:
        try:
            conns = proc.net_connections(kind="inet")
        except psutil.Error:
            continue
        found += [(proc.pid, *c.laddr) for c in conns if c.status == psutil.CONN_LISTEN]
    return found


def assert_loopback_only(sockets, agent_pid):
    assert sockets, "no listening socket found: the scan sees nothing"
    outside = [s for s in sockets if not ipaddress.ip_address(s[1]).is_loopback]
    assert not outside, f"listening beyond loopback: {outside}"
    assert any(pid == agent_pid for pid, _, _ in sockets), "the agent's store was not seen"


def wait_for(predicate, timeout=90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_a_cold_run_from_the_terminal_listens_on_loopback_only(run_env, tmp_path):
    script = tmp_path / "ready.py"
    script.write_text(READY)
    cli = subprocess.Popen(
        [sys.executable, "-m", "nbgpu.cli", "run", "-n", "2", "--name", "cold", str(script), "60"],
        env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert cli.stdout is not None
        seen = ""
        while seen.count("ready") < 2:
            line = cli.stdout.readline()
            assert line, f"the run ended before both ranks were ready:\n{seen}"
            seen += line
        agent = psutil.Process(cli.pid).children()[0]
        sockets = listening([agent, *agent.children(recursive=True)])
        assert len({pid for pid, _, _ in sockets}) >= 2  # the agent's store and gloo's
        assert_loopback_only(sockets, agent.pid)
    finally:
        cli.terminate()
        cli.communicate(timeout=60)


def test_a_warm_job_listens_on_loopback_only(run_env):
    code = READY.replace("time.sleep", "0 and time.sleep")
    job = torchrun(code, 2, keep=True, name="warmscan", environ=run_env, write=lambda _t: None)
    try:
        # Between cells the ranks wait, their process group and its sockets alive.
        assert_loopback_only(listening(carrying(job.run.run_id)), job.run.agent.pid)
    finally:
        stop_runs("warmscan")


def test_a_background_run_listens_on_loopback_only(run_env):
    prepared = prepare(code=READY, nproc=2, environ=run_env, name="bgscan")
    run = execute(
        prepared, to_screen(lambda _t: None), announce=lambda _l: None, background=True,
        environ=run_env,
    )  # fmt: skip
    try:
        logs = [run.logs["rank0"], run.logs["rank1"]]
        assert wait_for(lambda: all(p.exists() and "ready" in p.read_text() for p in logs))
        assert_loopback_only(listening(carrying(run.run_id)), run.agent.pid)
    finally:
        stop_runs("bgscan")
