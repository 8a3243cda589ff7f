"""2 nodes x 2 ranks through a real SLURM cluster: srun, torchrun's c10d rendezvous, gloo.

What is left behind is looked for in every process on the machine (both test nodes run
here) by the run's id in their environment, and in SLURM's queue.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from nbgpu.errors import UserInputError
from nbgpu.launch.config import SlurmOptions
from nbgpu.launch.launcher import torchrun
from nbgpu.launch.run import RunFailed

pytestmark = pytest.mark.slow

HELLO = (
    "import os, time, nbgpu.rank as R\n"
    "R.init()\n"
    "print('hello from', os.environ['RANK'], 'sum', R.all_reduce_sum(1), flush=True)\n"
    "time.sleep(1.5)\n"
    "print('bye from', os.environ['RANK'], flush=True)\n"
)


class Screen:
    def __init__(self):
        self.writes = []

    def __call__(self, text):
        self.writes.append((time.monotonic(), text))

    @property
    def text(self):
        return "".join(t for _, t in self.writes)


def processes_of(run_id):
    found = []
    for proc in psutil.process_iter():
        try:
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
            if f"NBGPU_RUN_ID={run_id}".encode() in environ and (
                proc.status() != psutil.STATUS_ZOMBIE
            ):
                found.append(proc.pid)
        except (OSError, psutil.Error):  # noqa: PERF203  (a process may vanish while read)
            continue
    return found


def nothing_left(run, cluster, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not processes_of(run.run_id) and not cluster.squeue():
            return True
        time.sleep(0.2)
    return False


def test_two_nodes_stream_live_labelled_by_node_and_rank(env, slurm_cluster):
    screen = Screen()
    run = torchrun(HELLO, 2, nnodes=2, slurm=SlurmOptions(), environ=env, write=screen)
    assert run.state == "succeeded"
    text = screen.text
    nodes = {Path(p).read_text() for p in run.dir.glob("rank*.node")}
    assert nodes == {"n1", "n2"}
    for rank in range(4):
        node = (run.dir / f"rank{rank}.node").read_text()
        assert f"[{node}/rank{rank}] hello from {rank} sum 4" in text.replace("\x1b[0m", "")
        assert f"bye from {rank}" in text
    # Live: the hellos reached the screen well before the run's last line did.
    first = next(t for t, chunk in screen.writes if "hello from" in chunk)
    last = next(t for t, chunk in reversed(screen.writes) if "bye from" in chunk)
    assert last - first > 1.0
    assert "4 ranks on 2 nodes" in run.text()
    ranks = json.loads((run.dir / "run.json").read_text())["ranks"]
    assert sorted((r["rank"], r["local_rank"]) for r in ranks) == [(0, 0), (1, 1), (2, 0), (3, 1)]
    assert nothing_left(run, slurm_cluster)


def test_a_rank_failing_on_one_node_names_node_and_rank(env, slurm_cluster):
    code = (
        "import os, time, nbgpu.rank as R\nR.init()\n"
        "if os.environ['RANK'] == '3':\n    raise ValueError('batch 8 is not divisible by 3')\n"
        "time.sleep(30)\n"
    )
    with pytest.raises(RunFailed) as failure:
        torchrun(code, 2, nnodes=2, slurm=SlurmOptions(), environ=env, write=Screen())
    run = failure.value.run
    node = (run.dir / "rank3.node").read_text()
    assert run.root_cause is not None
    assert run.root_cause.rank == 3
    assert f"rank 3 on node {node} failed first" in run.failure_summary()
    root = run.diagnosis.causes[0]
    assert (root.first_rank, root.first_node) == (3, node)
    assert f"rank 3 on node {node} failed first" in run.diagnosis.text()
    assert nothing_left(run, slurm_cluster)


@pytest.mark.usefixtures("sigint_raises")
def test_interrupt_cancels_the_job_on_every_node(env, slurm_cluster):
    code = "import time\nprint('up', flush=True)\ntime.sleep(120)\n"
    screen = Screen()
    timer = threading.Timer(6.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    began = time.monotonic()
    with pytest.raises(RunFailed) as failure:
        torchrun(code, 2, nnodes=2, slurm=SlurmOptions(), environ=env, write=screen,
                 name="interrupted")  # fmt: skip
    timer.join()
    run = failure.value.run
    assert run.state == "interrupted"
    assert time.monotonic() - began < 40
    assert screen.text.count("up") >= 1
    assert nothing_left(run, slurm_cluster)


def test_nbgpu_run_slurm_from_a_terminal(env, slurm_cluster, tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(HELLO)
    done = subprocess.run(
        [sys.executable, "-m", "nbgpu.cli", "run", "--slurm", "--nodes", "2",
         "--nproc-per-node", "2", "--name", "cli2x2", str(script)],
        env=env, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for rank in range(4):
        assert f"/rank{rank}] hello from {rank} sum 4" in done.stdout
    assert "SLURM: requesting 2 node(s)" in done.stderr
    assert not slurm_cluster.squeue()


@pytest.mark.parametrize(
    ("options", "nnodes", "message"),
    [
        ({"partition": "nosuch"}, 2, r"--partition 'nosuch': SLURM knows no such partition"),
        ({}, 3, r"--nodes 3: the cluster has 2 node\(s\) \(sinfo\)"),
        ({"partition": "debug"}, 3, r"--nodes 3: partition 'debug' has 2 node\(s\)"),
    ],
)
def test_requests_slurm_would_refuse_or_queue_forever_are_one_line(
    env, slurm_cluster, options, nnodes, message
):
    with pytest.raises(UserInputError, match=message):
        torchrun("print(1)", 2, nnodes=nnodes, slurm=SlurmOptions(**options), environ=env)
    assert not slurm_cluster.squeue()


def test_slurm_missing_is_one_line(env):
    env = {**env, "PATH": "/nonexistent"}
    with pytest.raises(UserInputError, match=r"--slurm: SLURM is not installed here \(no srun"):
        torchrun("print(1)", 2, nnodes=2, slurm=SlurmOptions(), environ=env)


def test_a_lost_node_ends_the_job_everywhere(env, slurm_cluster):
    # The agent of one node is SIGKILLed (the node dies with it): SLURM ends the step on
    # the other node, the run fails, and nothing survives on either node.
    code = "import time\nprint('up', flush=True)\ntime.sleep(120)\n"
    box = {}

    def kill_one_node():
        deadline = time.time() + 60
        while time.time() < deadline:
            agents = [
                p for p in psutil.process_iter(["cmdline", "environ"])
                if (p.info["cmdline"] or [])[1:3] == ["-m", "nbgpu.rank.slurm_node"]  # an agent
                and (p.info["environ"] or {}).get("SLURM_NODEID") == "1"
                and (p.info["environ"] or {}).get("NBGPU_RUN_NAME") == "lost"
            ]  # fmt: skip
            if agents and len(list((Path(env["NBGPU_RUNS_DIR"])).glob("lost-*/rank*.node"))) == 4:
                box["pid"] = agents[0].pid
                os.kill(agents[0].pid, signal.SIGKILL)
                return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_one_node)
    killer.start()
    with pytest.raises(RunFailed) as failure:
        torchrun(code, 2, nnodes=2, slurm=SlurmOptions(), environ=env, write=Screen(),
                 name="lost", timeout_s=90)  # fmt: skip
    killer.join()
    assert "pid" in box
    run = failure.value.run
    assert run.state == "failed"
    assert nothing_left(run, slurm_cluster)


def test_timeout_cancels_the_job(env, slurm_cluster):
    began = time.monotonic()
    with pytest.raises(RunFailed) as failure:
        torchrun("import time\ntime.sleep(120)\n", 2, nnodes=2, slurm=SlurmOptions(),
                 environ=env, write=Screen(), timeout_s=8)  # fmt: skip
    run = failure.value.run
    assert run.state == "timed_out"
    assert time.monotonic() - began < 40
    assert nothing_left(run, slurm_cluster)


def test_inside_an_allocation_a_run_is_a_step_and_the_allocation_stays(env, slurm_cluster):
    granted = subprocess.run(
        ["salloc", "--no-shell", "--nodes", "2", "--job-name", "users-own"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    job = next(w for w in granted.stderr.split() if w.isdigit())
    inside = {**env, "SLURM_JOB_ID": job, "SLURM_JOB_NUM_NODES": "2"}
    try:
        with pytest.raises(UserInputError, match=rf"--nodes 3: the allocation {job} holds 2"):
            torchrun("print(1)", 2, nnodes=3, slurm=SlurmOptions(), environ=inside)
        screen = Screen()
        run = torchrun(HELLO, 2, nnodes=2, slurm=SlurmOptions(), environ=inside, write=screen)
        assert run.state == "succeeded"
        assert f"a step of allocation {job}" in screen.text
        assert screen.text.count("hello from") == 4
        # The user's allocation is theirs: still there after the run.
        assert any(line.startswith(f"{job} users-own") for line in slurm_cluster.squeue())
        assert not processes_of(run.run_id)
    finally:
        subprocess.run(["scancel", job], env=env, timeout=30, check=False)


def test_what_slurm_refuses_at_submission_is_said_in_its_words(env, slurm_cluster):
    with pytest.raises(RunFailed) as failure:
        torchrun("print(1)", 2, nnodes=2, slurm=SlurmOptions(extra=("--mem=99999999",)),
                 environ=env, write=Screen())  # fmt: skip
    summary = failure.value.run.failure_summary()
    assert "SLURM says Unable to allocate resources: Requested node configuration" in summary
    assert not slurm_cluster.squeue()


def test_a_node_that_is_down_is_named_before_anything_queues(env, slurm_cluster):
    def scontrol(*args):
        subprocess.run(["scontrol", "update", "NodeName=n2", *args], env=env, timeout=30,
                       check=True)  # fmt: skip

    scontrol("State=DOWN", "Reason=nbgpu-test")
    try:
        with pytest.raises(UserInputError, match=r"has 1 node\(s\) up and 1 down or drained"):
            torchrun("print(1)", 2, nnodes=2, slurm=SlurmOptions(), environ=env)
        assert not slurm_cluster.squeue()
    finally:
        scontrol("State=RESUME")
        deadline = time.time() + 30
        while not slurm_cluster._nodes_idle() and time.time() < deadline:
            time.sleep(0.2)
    assert slurm_cluster._nodes_idle()


def test_a_controller_that_does_not_answer_is_one_line_in_slurms_words(
    env, slurm_cluster, tmp_path
):
    # The same cluster's config with the controller's port moved where nothing listens.
    conf = Path(env["SLURM_CONF"]).read_text()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    moved = tmp_path / "slurm.conf"
    moved.write_text(re.sub(r"(?m)^SlurmctldPort=\d+$", f"SlurmctldPort={closed}", conf))
    began = time.monotonic()
    with pytest.raises(UserInputError, match=r"^SLURM is not reachable here: sinfo says '.+'$"):
        torchrun("print(1)", 1, nnodes=2, slurm=SlurmOptions(),
                 environ={**env, "SLURM_CONF": str(moved)})  # fmt: skip
    assert time.monotonic() - began < 60
    assert not slurm_cluster.squeue()


# A module that takes a second to import and says when, on which node, for which rank.
SLOW_IMPORT = (
    "import os, time\n"
    "start = time.time()\n"
    "time.sleep(1.0)\n"
    "with open(os.environ['IMPORT_LOG'], 'a') as f:\n"
    "    f.write(f\"{os.environ['NBGPU_NODE']} {os.environ['RANK']} {start} {time.time()}\\n\")\n"
)


def test_memory_and_serial_imports_are_per_node(env, slurm_cluster, tmp_path):
    (tmp_path / "slowimport.py").write_text(SLOW_IMPORT)
    log = tmp_path / "imports.log"
    env = {**env, "PYTHONPATH": str(tmp_path), "IMPORT_LOG": str(log)}
    code = "import slowimport\nblob = bytearray(64 << 20)\nprint('held', len(blob))\n"
    run = torchrun(code, 2, nnodes=2, slurm=SlurmOptions(), environ=env, write=Screen(),
                   serial_imports=True, mem_sample=0.05)  # fmt: skip
    assert run.state == "succeeded"
    spans: dict[str, list[tuple[float, float]]] = {}
    for line in log.read_text().splitlines():
        node, _, start, end = line.split()
        spans.setdefault(node, []).append((float(start), float(end)))
    assert sorted((n, len(s)) for n, s in spans.items()) == [("n1", 2), ("n2", 2)]
    # Within a node the ranks import in turn; across nodes at the same time.
    for first, second in (sorted(s) for s in spans.values()):
        assert first[1] <= second[0], spans
    together = [min(e1, e2) - max(s1, s2) for s1, e1 in spans["n1"] for s2, e2 in spans["n2"]]
    assert max(together) > 0.5, spans  # one lock for all nodes: no two imports overlap
    report = run.memory
    assert sorted(report.node_names) == ["n1", "n2"]
    peak = report.node_peak()
    assert peak.node in ("n1", "n2")
    assert len(peak.phases) <= 2  # a node's own ranks, never all four
    assert nothing_left(run, slurm_cluster)
