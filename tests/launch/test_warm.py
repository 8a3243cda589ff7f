"""Warm jobs from Python: real torchrun ranks (gloo on CPU) that stay up between cells.

Every test ends by proving, from every process on the machine (by the run's id in
their environment, not nbgpu's bookkeeping), that nothing of the job is left.
"""

import contextlib
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from nbgpu.errors import UserInputError
from nbgpu.launch import warm
from nbgpu.launch.launcher import torchrun
from nbgpu.launch.run import RunFailed
from nbgpu.launch.warm import CellFailed

pytestmark = pytest.mark.slow


class Screen:
    def __init__(self):
        self.chunks = []

    def __call__(self, text):
        self.chunks.append(text)

    @property
    def text(self):
        return "".join(self.chunks)

    def take(self):
        text, self.chunks = self.text, []
        return text


def processes_of(run_id):
    """Every live process on the machine carrying the run's id, read from /proc."""
    found = []
    for proc in psutil.process_iter():
        try:
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
            if f"NBGPU_RUN_ID={run_id}".encode() in environ.split(b"\0") and (
                proc.status() != psutil.STATUS_ZOMBIE
            ):
                found.append(proc.pid)
        except (OSError, psutil.Error):  # noqa: PERF203  (a process may vanish while read)
            continue
    return found


def gone(run_id, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not processes_of(run_id):
            return True
        time.sleep(0.1)
    return False


def start(env, name, code="import os\nrank = int(os.environ['RANK'])\n", **options):
    screen = Screen()
    job = torchrun(code, 2, keep=True, name=name, environ=env, write=screen, **options)
    return job, screen


def test_state_persists_across_cells_and_push_pull_work_per_cell(env):
    job, screen = start(env, "persist")
    run_id = job.run.run_id
    try:
        ranks = job.run.warm.pids()
        assert len(ranks) == 2
        torchrun("total = rank * 100", on="persist", write=screen)
        torchrun(
            "total += offset\nprint('total', total)", on="persist", write=screen, push={"offset": 7}
        )
        result = torchrun(
            "total += 1", on="persist", write=screen, pull=["total"], pull_all_ranks=True
        )
        assert result.ok
        assert result.number == 4
        assert result.pulled == {"total": 8}
        assert [v["total"] for v in result.pulled_all] == [8, 108]
        assert "[rank1] total 107" in screen.text
        assert "[rank0] total 7" in screen.text
        # The same processes ran every cell: state lived in them, not in a file.
        assert job.run.warm.pids() == ranks
        assert all(psutil.pid_exists(p) for p in ranks.values())
        # Cell boundaries are marked in the logs (not on screen), one per cell.
        log = (job.run.dir / "rank1.log").read_text()
        assert [line for line in log.splitlines() if line.startswith("#### nbgpu cell")] == [
            f"#### nbgpu cell {n} ####" for n in range(1, 5)
        ]
        assert "#### nbgpu" not in screen.text
        # ...and each cell is a memory phase of its own.
        records = (job.run.dir / "mem-rank0.jsonl").read_text()
        assert '"cell 3"' in records
        assert '"cell 4"' in records
    finally:
        job.stop()
    assert job.run.state == "stopped"
    assert gone(run_id)


def test_an_exception_is_a_failed_cell_and_the_ranks_stay(env):
    job, screen = start(env, "raises")
    try:
        pids = job.run.warm.pids()
        with pytest.raises(CellFailed) as failure:
            torchrun(
                "kept = 41\nif rank == 1:\n    raise ValueError('bad batch')\n",
                on="raises",
                write=screen,
            )
        result = failure.value.result
        assert result.statuses == {0: "ok", 1: "error"}
        assert result.errors[1] == "ValueError: bad batch"
        assert "[rank1] ValueError: bad batch" in screen.text
        assert "the ranks and their state are kept" in " ".join(failure.value._render_traceback_())
        again = torchrun("kept += 1", on="raises", write=screen, pull=["kept"])
        assert again.pulled == {"kept": 42}
        assert job.run.warm.pids() == pids
    finally:
        job.stop()
    assert gone(job.run.run_id)


def test_a_rank_that_dies_ends_the_job_with_a_diagnosis(env):
    _job, screen = start(env, "dies")
    with pytest.raises(RunFailed) as failure:
        torchrun(
            "if rank == 1:\n    os._exit(3)\nimport time\ntime.sleep(30)\n", on="dies", write=screen
        )
    run = failure.value.run
    assert run.state == "failed"
    assert run.done
    assert run.root_cause is not None
    assert run.root_cause.rank == 1
    assert run.diagnosis is not None
    assert gone(run.run_id)
    with pytest.raises(UserInputError, match=r"--on dies: the job has ended \(failed: rank 1 fai"):
        torchrun("print(1)", on="dies", write=screen)


@pytest.mark.usefixtures("sigint_raises")
def test_interrupt_keeps_the_ranks_and_their_state(env):
    job, screen = start(env, "interrupt")
    try:
        torchrun("step = 5", on="interrupt", write=screen)
        timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        with pytest.raises(CellFailed) as failure:
            torchrun(
                "import time\nfor step in range(6, 1000):\n    time.sleep(0.05)\n",
                on="interrupt",
                write=screen,
            )
        timer.join()
        assert set(failure.value.result.statuses.values()) == {"interrupted"}
        assert "KeyboardInterrupt" in screen.text
        # Each rank's traceback shows the user's cell, not nbgpu's interrupt handler.
        assert screen.text.count("time.sleep(0.05)") == 2
        assert "nbgpu/rank" not in screen.text
        assert screen.text.count('File "cell3.py", line 3, in <module>') == 2  # not the full path
        after = torchrun("pass", on="interrupt", write=screen, pull=["step"])
        assert after.pulled["step"] > 6  # the loop's progress survived the interrupt
    finally:
        job.stop()
    assert gone(job.run.run_id)


@pytest.mark.usefixtures("sigint_raises")
def test_a_rank_stuck_in_a_collective_is_reported_not_waited_for(env, monkeypatch):
    monkeypatch.setattr(warm, "INTERRUPT_WAIT_S", 2.0)
    job, screen = start(
        env,
        "stuck",
        "import os\nimport nbgpu.rank\nnbgpu.rank.init(timeout_s=6)\n"
        "rank = int(os.environ['RANK'])\n",
    )
    try:
        timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        began = time.monotonic()
        with pytest.raises(CellFailed) as failure:
            # rank 0 sleeps in Python (interruptible); rank 1 waits in gloo's C++ barrier.
            torchrun(
                "import time, torch.distributed as dist\nif rank == 0:\n"
                "    time.sleep(60)\ndist.barrier()\n",
                on="stuck",
                write=screen,
            )
        timer.join()
        assert time.monotonic() - began < 15
        result = failure.value.result
        assert result.statuses[0] == "interrupted"
        assert result.unanswered == [1]
        assert "did not answer the interrupt" in " ".join(failure.value._render_traceback_())
        with pytest.raises(UserInputError, match="rank 1 is still in cell 2"):
            torchrun("print(1)", on="stuck", write=screen)
        # Once the collective gives up (the group's 6 s timeout), rank 1 answers late; the
        # job is usable again.
        deadline = time.monotonic() + 30
        while job.run.warm.busy and time.monotonic() < deadline:
            job.run.warm.catch_up()
            time.sleep(0.2)
        assert torchrun("after = 1", on="stuck", write=screen, pull=["after"]).pulled == {
            "after": 1
        }
    finally:
        job.stop()
    assert job.run.done
    assert gone(job.run.run_id)


def test_idle_timeout_ends_the_job(env):
    job, _screen = start(env, "idle", idle_timeout_s=1.0)
    assert "stops after 1 s idle" in job.run.warm.describe()
    job.run.wait(20)
    assert job.run.state == "stopped"
    assert job.run.stop_reason == "idle_timeout"
    assert gone(job.run.run_id)


def test_stop_lets_the_ranks_finalizers_run(env, tmp_path):
    marker = tmp_path / "flushed"
    job, screen = start(env, "finalizers")
    torchrun(
        "class Writer:\n"
        "    def __del__(self):\n"
        f"        open({str(marker)!r} + str(rank), 'w').write('done')\n"
        "w = Writer()\nw.self = w  # a reference cycle: only a normal exit collects it\n",
        on="finalizers",
        write=screen,
    )
    job.stop()
    assert job.run.state == "stopped"
    assert sorted(p.name for p in tmp_path.glob("flushed*")) == ["flushed0", "flushed1"]
    assert gone(job.run.run_id)


def test_the_channel_is_private(env):
    job, _screen = start(env, "private")
    try:
        path = job.run.warm.server.path
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0
        # Connecting without the job's token gets a random challenge, the refusal and
        # the hang-up: nothing of the job.
        intruder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        intruder.connect(str(path))
        intruder.sendall(b"\0" * 8)
        intruder.settimeout(5)
        torchrun("pass", on="private", write=Screen())  # the server reads meanwhile
        received = b""
        with contextlib.suppress(ConnectionResetError):  # hung up on, its bytes unread
            while chunk := intruder.recv(4096):
                received += chunk
        intruder.close()
        frames = []
        while len(received) >= 4 and len(received) >= 4 + int.from_bytes(received[:4], "big"):
            size = int.from_bytes(received[:4], "big")
            frames.append(received[4 : 4 + size])
            received = received[4 + size :]
        assert all(f.startswith(b"#CHALLENGE#") or f == b"#FAILURE#" for f in frames), frames
        # Nothing of the job listens on a network interface but torchrun's own store.
        pids = set(job.run.warm.pids().values())
        for conn in psutil.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN and conn.pid in pids:
                raise AssertionError(f"a rank listens on {conn.laddr}")
    finally:
        job.stop()
    assert not path.exists()


def test_bad_requests_leave_the_job_as_it_was(env):
    job, screen = start(env, "asis")
    try:
        torchrun("value = 1", on="asis", write=screen)
        cases = [
            ({"code": "print(1)", "on": "nosuch"}, r"--on nosuch: no warm job named 'nosuch'"),
            ({"code": "print(1)", "on": "asis", "gpus": "0"}, r"gpus= with --on asis: gpus= only"),
            (
                {"code": "print(1)", "on": "asis", "nproc": 3},
                r"nproc 3 with --on asis: the job has 2",
            ),
            ({"code": "print(1)", "on": "asis", "push": {"f": lambda: 1}}, r"--push f: function"),
            ({"code": "print(1)", "on": "asis", "keep": True}, r"keep= with --on asis"),
            (
                {"code": "print(1)", "nproc": 2, "keep": True, "name": "asis"},
                r"'asis': a run with this",
            ),
            ({"code": "print(1)", "nproc": 2, "idle_timeout_s": 5}, r"--idle-timeout ends a warm"),
            ({"code": "   ", "on": "asis"}, r"the cell is empty"),
        ]
        for kwargs, message in cases:
            code = kwargs.pop("code")
            nproc = kwargs.pop("nproc", None)
            with pytest.raises(UserInputError, match=message):
                torchrun(code, nproc, environ=env, write=screen, **kwargs)
        assert torchrun("value += 1", on="asis", write=screen, pull=["value"]).pulled == {
            "value": 2
        }
        assert job.cells == 3
        assert job.state == "warm"
    finally:
        job.stop()
    assert gone(job.run.run_id)


def test_the_diagnosis_reads_the_cell_the_job_died_in(env):
    _job, screen = start(env, "percell")
    # An earlier cell's error that the diagnosis would otherwise blame (port_in_use).
    earlier = (
        "raise RuntimeError('an earlier cell: The server socket has failed to listen on any "
        "local network address. The server socket has failed to bind to [::]:29500 (errno: 98 "
        "- Address already in use).')"
    )
    with pytest.raises(CellFailed):
        torchrun(earlier, on="percell", write=screen)
    with pytest.raises(RunFailed) as failure:
        torchrun(
            "import sys\nif rank == 1:\n"
            "    print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB',"
            " file=sys.stderr, flush=True)\n    os._exit(1)\nimport time\ntime.sleep(30)\n",
            on="percell",
            write=screen,
        )
    diagnosis = failure.value.run.diagnosis
    assert diagnosis is not None
    assert [c.cause for c in diagnosis.causes] == ["cuda_oom"]
    evidence = [e for cause in diagnosis.causes for e in cause.evidence]
    assert not any("an earlier cell" in e.text for e in evidence)
    assert any("start of cell 3" in note for note in diagnosis.notes)
    # Evidence keeps the line numbers of the whole log file.
    log = (failure.value.run.dir / "rank1.log").read_text().splitlines()
    oom = next(e for e in evidence if "out of memory" in e.text)
    assert "out of memory" in log[oom.lineno - 1]
    assert gone(failure.value.run.run_id)


def test_timeout_interrupts_the_cell_and_keeps_the_job(env):
    job, screen = start(env, "cell-timeout")
    try:
        began = time.monotonic()
        with pytest.raises(CellFailed) as failure:
            torchrun(
                "import time\nfor tick in range(600):\n    time.sleep(0.05)\n",
                on="cell-timeout",
                write=screen,
                timeout_s=1.0,
            )
        assert time.monotonic() - began < 10
        assert set(failure.value.result.statuses.values()) == {"interrupted"}
        after = torchrun("pass", on="cell-timeout", write=screen, pull=["tick"])
        assert 5 < after.pulled["tick"] < 600
        assert "no idle timeout" in job.run.warm.describe()
    finally:
        job.stop()
    assert gone(job.run.run_id)


def test_interpreter_exit_ends_a_warm_job(env, tmp_path):
    # A script that starts a warm job and simply ends: the exit hook stops the job.
    script = tmp_path / "leave.py"
    script.write_text(
        "import nbgpu\n"
        "job = nbgpu.torchrun('import os\\nx = 1', 2, keep=True, name='leaver')\n"
        "print('RUN_ID', job.run.run_id, flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    run_id = next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("RUN_ID"))
    assert gone(run_id, timeout=10)


def test_a_rank_killed_between_cells_ends_the_job_and_the_next_cell_says_how(env):
    job, _screen = start(env, "killed-idle")
    os.kill(job.run.warm.pids()[1], signal.SIGKILL)  # the OOM killer, say
    job.run.wait(20)
    assert job.run.state == "failed"
    assert job.run.root_cause is not None
    assert job.run.root_cause.rank == 1
    assert gone(job.run.run_id)
    with pytest.raises(
        UserInputError, match=r"--on killed-idle: the job has ended \(failed: rank 1"
    ):
        torchrun("print(1)", on="killed-idle", write=Screen())


@pytest.mark.usefixtures("sigint_raises")
def test_a_second_interrupt_while_waiting_ends_the_job(env, monkeypatch):
    monkeypatch.setattr(warm, "INTERRUPT_WAIT_S", 60.0)
    job, screen = start(
        env,
        "twice",
        "import os\nimport nbgpu.rank\nnbgpu.rank.init()\nrank = int(os.environ['RANK'])\n",
    )
    timers = [threading.Timer(t, os.kill, (os.getpid(), signal.SIGINT)) for t in (1.5, 3.0)]
    for timer in timers:
        timer.start()
    began = time.monotonic()
    with pytest.raises(RunFailed) as failure:
        torchrun(
            "import time, torch.distributed as dist\nif rank == 0:\n"
            "    time.sleep(60)\ndist.barrier()\n",
            on="twice",
            write=screen,
        )
    for timer in timers:
        timer.join()
    assert time.monotonic() - began < 20
    assert failure.value.run.state == "interrupted"
    assert gone(job.run.run_id)
