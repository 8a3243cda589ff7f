"""Warm jobs across nodes: 2 nodes x 2 ranks through the real SLURM cluster, their cells
carried by each node's relay over an authenticated TCP channel to the kernel.

What is left behind is looked for in every process on the machine (both test nodes run
here) by the run's id in their environment, and in SLURM's queue.
"""

import builtins
import os
import re
import signal
import socket
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client
from pathlib import Path

import psutil
import pytest

from nbgpu.errors import UserInputError
from nbgpu.launch.config import SlurmOptions
from nbgpu.launch.debug import post_mortem
from nbgpu.launch.held import held_names
from nbgpu.launch.launcher import torchrun
from nbgpu.launch.relay import RELAY_FILE, NodeChannel
from nbgpu.launch.run import RunFailed
from nbgpu.launch.streams import ScreenWriter
from nbgpu.launch.warm import CellFailed
from tests.notebook.test_kernel_e2e import _execute, started_kernel
from tests.slurm.test_slurm_runs import Screen, nothing_left, processes_of

pytestmark = pytest.mark.slow

START = (
    "import os, time, nbgpu.rank as R\nR.init()\n"
    "rank, node = int(os.environ['RANK']), os.environ['NBGPU_NODE']\ncount = 0\n"
)
STEP = "count += 1\nprint('count', count, 'sum', R.all_reduce_sum(count), flush=True)\n"
LOOP = "for step in range(100_000):\n    print('step', step, flush=True)\n    time.sleep(0.05)\n"


def start_warm(env, name, **options):
    screen = Screen()
    job = torchrun(START, 2, nnodes=2, slurm=SlurmOptions(), keep=True, name=name,
                   environ=env, write=screen, **options)  # fmt: skip
    return job, screen


def plain(screen):
    return re.sub(r"\x1b\[[0-9;]*m", "", screen.text)


def every_rank_printed(screen, word, ranks=range(4)):
    return all(re.search(rf"\[n[12]/rank{rank}\] {word}", plain(screen)) for rank in ranks)


def test_a_debugger_on_ranks_of_both_nodes(env, slurm_cluster, monkeypatch):
    # pdb's prompts and answers cross the relays as any other message: post-mortem on
    # rank 3, then breakpoint() on rank 0. Which node gets which pair of ranks is the
    # rendezvous's choice: the labels must agree with where each rank says it runs.
    job, screen = start_warm(env, "dbg2")
    try:
        with pytest.raises(CellFailed):
            job("if rank == 3:\n    x = 42\n    raise ValueError('on one node')\n")
        out = Screen()
        post_mortem(job.run, 3, ScreenWriter(out), commands=["p x", "p node"])
        found = re.search(r"\[(n[12])/rank3\] 42\n", plain(out))
        assert found, plain(out)
        node3 = found.group(1)
        assert f"[{node3}/rank3] '{node3}'" in plain(out), plain(out)
        answers = ["p rank * 10 + 7", "p node", "c"]
        monkeypatch.setattr(builtins, "input", lambda _prompt: answers.pop(0))
        result = job("if rank == 0:\n    breakpoint()\n    y = 1\nprint('on', rank, flush=True)\n")
        assert result.ok, plain(screen)
        found = re.search(r"\[(n[12])/rank0\] 7\n", plain(screen))
        assert found, plain(screen)
        node0 = found.group(1)
        assert f"[{node0}/rank0] '{node0}'" in plain(screen), plain(screen)
        assert node0 != node3  # one session through each node's relay
        assert every_rank_printed(screen, "on")
        assert answers == []
    finally:
        stopped = job.stop()
    assert stopped.state == "stopped"
    assert nothing_left(stopped, slurm_cluster)


@pytest.mark.usefixtures("sigint_raises")
def test_two_nodes_keep_state_across_cells_and_an_interrupt_reaches_both(env, slurm_cluster):
    job, screen = start_warm(env, "w2")
    try:
        assert job.state == "warm"
        # The kernel listened for the nodes only until both were in: the port now refuses.
        address = job.run.warm.server.address
        assert address is not None
        assert len(job.run.warm.server.nodes) == 2
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(address, timeout=5).close()
        assert not (job.run.dir / RELAY_FILE).exists()
        # State across three cells, on both nodes (and a collective over both).
        for expected in (1, 2, 3):
            result = job(STEP, pull=["count", "node"], pull_all_ranks=True)
            assert result.ok, result.summary()
            assert [r["count"] for r in result.pulled_all] == [expected] * 4
            assert every_rank_printed(screen, f"count {expected} sum {expected * 4}")
        assert sorted({r["node"] for r in result.pulled_all}) == ["n1", "n2"]
        # The names every rank of both nodes holds: one row each, held by "all" four.
        held = held_names("w2")
        assert {r["name"]: r["ranks"] for r in held.records()}["count"] == [0, 1, 2, 3]
        rows = [line.split() for line in held.text().splitlines()]
        assert any(row[:2] == ["count", "int"] and row[-1] == "all" for row in rows), held.text()
        # The stop button while a cell runs on both nodes: every rank is interrupted, and the
        # job stays warm with its state.
        ranks_up = threading.Event()

        def press_stop():
            deadline = time.time() + 60
            while time.time() < deadline and not every_rank_printed(screen, "step 5"):
                time.sleep(0.05)
            ranks_up.set()
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=press_stop).start()
        began = time.monotonic()
        with pytest.raises(CellFailed) as failure:
            job(LOOP)
        assert ranks_up.is_set()
        assert failure.value.result.statuses == dict.fromkeys(range(4), "interrupted")
        assert time.monotonic() - began < 60
        after = job("print('after', count, step >= 5, flush=True)", pull=["step"],
                    pull_all_ranks=True)  # fmt: skip
        assert after.ok, after.summary()
        assert all(r["step"] >= 5 for r in after.pulled_all)
        assert every_rank_printed(screen, "after 3 True")
        assert job.state == "warm"
    finally:
        stopped = job.stop()
    assert stopped.state == "stopped"
    # The ranks left their loop when asked (through the relays) and exited normally:
    # not ended by scancel, the backstop.
    assert [rank.exit_code for rank in stopped.ranks] == [0] * 4, stopped.ranks
    assert nothing_left(stopped, slurm_cluster)


def test_a_rank_dying_on_the_second_node_ends_the_job_with_its_diagnosis(env, slurm_cluster):
    job, _screen = start_warm(env, "wdie")
    assert job("x = 1").ok
    # Node n2's second rank dies (c10d numbers the nodes in the order they join, so which
    # global rank that is is read afterwards); the others wait in a collective for it.
    dies = (
        "if node == 'n2' and os.environ['LOCAL_RANK'] == '1':\n"
        "    os._exit(7)\n"
        "R.all_reduce_sum(1)\n"
    )
    with pytest.raises(RunFailed) as failure:
        job(dies)
    run = failure.value.run
    assert run.state == "failed"
    on_n2 = [r for r in range(4) if (run.dir / f"rank{r}.node").read_text() == "n2"]
    died = max(on_n2)  # its local rank 1
    assert f"rank {died} on node n2" in run.failure_summary(), run.failure_summary()
    assert nothing_left(run, slurm_cluster)
    # The next cell says the job ended, and why, in one line.
    with pytest.raises(UserInputError, match=r"--on wdie: the job has ended \(failed"):
        job("x = 2")


def test_the_idle_timeout_ends_a_job_on_both_nodes(env, slurm_cluster):
    job, _screen = start_warm(env, "widle", idle_timeout_s=3)
    assert job("x = 1").ok
    deadline = time.time() + 60
    while job.state == "warm" and time.time() < deadline:
        time.sleep(0.2)
    assert job.run.wait(30).state == "stopped"
    assert "idle" in (job.run.warm.ended_reason or "")
    assert [rank.exit_code for rank in job.run.ranks] == [0] * 4, job.run.ranks
    assert nothing_left(job.run, slurm_cluster)


def test_several_nodes_without_slurm_stay_refused_in_one_line():
    with pytest.raises(UserInputError, match=r"^--keep with several nodes needs --slurm"):
        torchrun("x = 1", 2, nnodes=2, rdzv_endpoint="node1:29400", keep=True)


@pytest.fixture
def slurm_kernel(env, tmp_path):
    yield from started_kernel(env, tmp_path)


def test_a_kernel_killed_with_sigkill_leaves_nothing_on_either_node(slurm_kernel, slurm_cluster):
    km, client = slurm_kernel
    assert _execute(client, "%load_ext nbgpu")[1] is None
    out, _ = _execute(client, "%%torchrun --nodes 2 --nproc-per-node 2 --keep\nx = 1")
    assert "UsageError: --keep with several nodes needs --slurm" in out
    out, error = _execute(
        client,
        f"%%torchrun --slurm --nodes 2 --nproc-per-node 2 --keep --name kw\n{START}",
        timeout=180,
    )
    assert error is None, out
    out, error = _execute(client, f"%%torchrun --on kw\n{STEP}", timeout=60)
    assert error is None, out
    assert len(re.findall(r"/rank\d\S* count 1 sum 4", out)) == 4, out
    out, _ = _execute(client, "import nbgpu\nprint(nbgpu.runs()['kw'].run_id)")
    run_id = out.strip()
    ranks = [
        p for p in map(psutil.Process, processes_of(run_id))
        if "nbgpu.rank.worker" in " ".join(p.cmdline())
    ]  # fmt: skip
    assert len(ranks) == 4
    sockets = {Path(p.environ()["NBGPU_CELLS"]).parent for p in ranks}
    assert len(sockets) == 2  # one relay per node, each its own directory...
    assert not any(path.exists() for path in sockets)  # ...removed once its ranks were in
    os.kill(km.provisioner.process.pid, signal.SIGKILL)
    deadline = time.time() + 60
    while (processes_of(run_id) or slurm_cluster.squeue()) and time.time() < deadline:
        time.sleep(0.2)
    assert not processes_of(run_id)
    assert not slurm_cluster.squeue()


def _node_joins(address, authkey, hello, box):
    try:
        conn = Client(address, family="AF_INET", authkey=authkey)
        conn.send(hello)
        box["conn"] = conn
    except (AuthenticationError, OSError, EOFError) as exc:
        box["error"] = exc


def _read_to_the_end(sock):
    while sock.recv(512):
        pass


def _poll_while(channel, thread, timeout=10):
    deadline = time.time() + timeout
    while thread.is_alive() and time.time() < deadline:
        channel.poll(0.05)
    thread.join(timeout=1)


def test_the_kernels_listener_takes_the_tokens_nodes_only_then_closes(tmp_path):
    (tmp_path / "rdzv.json").write_text('{"host": "127.0.0.1", "port": 1}')
    channel = NodeChannel(tmp_path, "a" * 32, nnodes=2)
    try:
        channel.poll(0)
        assert channel.address is not None
        assert channel.address[0] == "127.0.0.1"  # the address towards the nodes, no other
        assert (tmp_path / RELAY_FILE).exists()

        def join(authkey, hello):
            box = {}
            thread = threading.Thread(target=_node_joins,
                                      args=(channel.address, authkey, hello, box))  # fmt: skip
            thread.start()
            _poll_while(channel, thread)
            return box

        # Without the token: refused during the challenge, before anything is unpickled.
        stranger = join(b"b" * 32, {"op": "node", "node": 0})
        assert isinstance(stranger.get("error"), AuthenticationError)
        # A connection that answers nothing is hung up on (after the handshake's time).
        with socket.create_connection(channel.address, timeout=10) as silent:
            thread = threading.Thread(target=lambda: _read_to_the_end(silent))
            thread.start()
            _poll_while(channel, thread)
            assert not thread.is_alive()  # the kernel closed it
        assert not channel.nodes
        # The token but no node of this job: hung up on.
        outsider = join(b"a" * 32, {"op": "node", "node": 5})
        assert outsider["conn"].poll(5)
        with pytest.raises(EOFError):
            outsider["conn"].recv()
        # The two nodes: in; then the listener is closed and the port refuses.
        first, second = (join(b"a" * 32, {"op": "node", "node": n}) for n in (0, 1))
        assert "conn" in first
        assert "conn" in second
        assert sorted(channel.nodes) == [0, 1]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(channel.address, timeout=5).close()
        assert not (tmp_path / RELAY_FILE).exists()
    finally:
        channel.close()


def test_one_slurm_node_keeps_its_ranks_through_its_relay_too(env, slurm_cluster):
    # The run directory's socket would not reach a compute node: one node goes through
    # its relay like any number of them.
    job = torchrun(START, 2, slurm=SlurmOptions(), keep=True, name="w1", environ=env,
                   write=Screen())  # fmt: skip
    assert isinstance(job.run.warm.server, NodeChannel)
    assert job(STEP, pull=["count"]).pulled["count"] == 1
    assert job(STEP, pull=["count"]).pulled["count"] == 2
    stopped = job.stop()
    assert [rank.exit_code for rank in stopped.ranks] == [0, 0]
    assert nothing_left(stopped, slurm_cluster)
