"""Real torchrun jobs (gloo on CPU): streaming, results and no process left behind.

Each test starts a real 2-rank job (a few seconds on 2 cores), proves with psutil
that its processes were running when the test acted, and that none survive.
"""

import os
import re
import signal
import stat
import statistics
import threading
import time

import psutil
import pytest
import torch.distributed as dist

import nbgpu.diagnose
from nbgpu.diagnose import diagnose
from nbgpu.launch import run as run_module
from nbgpu.launch.config import LaunchConfig
from nbgpu.launch.launcher import prepare
from nbgpu.launch.procs import run_processes
from nbgpu.launch.run import Run, leftover_processes
from nbgpu.launch.streams import ScreenWriter

pytestmark = pytest.mark.slow


class Screen:
    def __init__(self):
        self.chunks = []

    def write(self, text):
        self.chunks.append(text)

    @property
    def text(self):
        return "".join(self.chunks)


def start(code, env, **options):
    prepared = prepare(code=code, nproc=options.pop("nproc", 2), environ=env, **options)
    return Run(prepared.config, environ=env).start()


def wait_for_lines(run, needle, count, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        logs = [p.read_text(errors="replace") if p.exists() else "" for p in run.logs.values()]
        if sum(needle in text for text in logs) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"ranks never printed {needle!r}: {logs}")


def assert_all_gone(run, pids, timeout=5.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        if not alive and not leftover_processes(run):
            return
        time.sleep(0.05)
    raise AssertionError(f"processes survived: {alive} {leftover_processes(run)}")


def test_success_streams_logs_and_pulls(env):
    code = (
        "import os, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "rank = dist.get_rank()\n"
        "t = torch.tensor([float(rank + 1)]); dist.all_reduce(t)\n"
        "print(f'rank {rank} of {dist.get_world_size()} sum {t.item():.0f} {cfg[\"tag\"]}')\n"
        "for i in range(50): print(f'\\r{i * 2}%|', end='', flush=True)\n"
        "print()\n"
        "result = {'rank': rank, 'sum': t.item()}\n"
    )
    run = start(code, env, push={"cfg": {"tag": "pushed-ok"}}, pull=["result"])
    screen = Screen()
    run.follow(ScreenWriter(screen.write))
    assert run.state == "succeeded", run.text()
    assert "[rank0] rank 0 of 2 sum 3 pushed-ok" in screen.text
    assert "[rank1] rank 1 of 2 sum 3 pushed-ok" in screen.text
    # The progress bar is one final line, not fifty.
    assert screen.text.count("98%|") == 2
    assert "\r" not in screen.text
    assert run.pulled == {"result": {"rank": 0, "sum": 3.0}}
    assert [r.exit_code for r in run.ranks] == [0, 0]
    assert stat.S_IMODE(run.dir.stat().st_mode) == 0o700
    assert "rank 1 of 2" in run.logs["rank1"].read_text()
    assert run.first_output_at is not None
    assert leftover_processes(run) == []


def test_a_line_after_a_quiet_spell_is_shown_at_once(env, monkeypatch):
    # Lines go out at most once per FLUSH_S; one after a quiet spell must not wait for the
    # next tick. A long FLUSH_S makes the difference plain: a tick-bound line waits 0.5 s
    # on average, a prompt one about a poll (50 ms).
    monkeypatch.setattr(run_module, "FLUSH_S", 1.0)
    code = (
        "import time\n"
        "for i in range(6):\n"
        "    time.sleep(1.3)\n"
        "    print(f'stamp {time.time()!r}', flush=True)\n"
    )
    run = start(code, env, nproc=1)
    delays = []

    def write(text):
        now = time.time()
        delays.extend(now - float(w) for w in re.findall(r"stamp ([\d.]+)", text))

    run.follow(ScreenWriter(write))
    assert run.state == "succeeded", run.text()
    assert len(delays) == 6
    assert statistics.median(delays) < 0.3, delays


def test_crash_names_first_rank_and_keeps_its_last_words(env):
    code = (
        "import os, sys, time\n"
        "rank = int(os.environ['RANK'])\n"
        "print(f'rank {rank} ready', flush=True)\n"
        "if rank == 1:\n"
        "    time.sleep(1)\n"
        "    sys.stdout.write('last words: ünïcode ✓')\n"  # no newline, then sudden death
        "    sys.stdout.flush()\n"
        "    os.kill(os.getpid(), 9)\n"
        "time.sleep(60)\n"
    )
    run = start(code, env)
    screen = Screen()
    run.follow(ScreenWriter(screen.write))
    assert run.state == "failed"
    assert run.root_cause is not None
    assert run.root_cause.rank == 1
    assert run.root_cause.signal == "SIGKILL"
    assert "[rank1] last words: ünïcode ✓" in screen.text
    assert run.logs["rank1"].read_text().endswith("last words: ünïcode ✓")
    assert "rank 1 failed first (killed (SIGKILL))" in run.failure_summary()
    assert leftover_processes(run) == []


def test_exception_root_cause_beats_ranks_stopped_after_it(env):
    code = (
        "import os, time\n"
        "if os.environ['RANK'] == '0':\n"
        "    time.sleep(0.5)\n"
        "    raise ValueError('bad batch on rank 0')\n"
        "time.sleep(60)\n"
    )
    run = start(code, env)
    run.follow(ScreenWriter(lambda _t: None))
    assert run.root_cause.rank == 0
    assert run.root_cause.error == "ValueError: bad batch on rank 0"
    assert "cell.py" in run.root_cause.traceback
    assert "worker.py" not in run.root_cause.traceback  # nbgpu's frames are hidden
    assert (run.dir / "error-rank0.json").exists()
    other = run.ranks[1]
    assert other.signal in ("SIGTERM", "SIGKILL")


def test_timeout_stops_everything(env):
    run = start("import time\nprint('ready', flush=True)\ntime.sleep(120)\n", env, timeout_s=6)
    started = time.time()
    run.follow(ScreenWriter(lambda _t: None))
    assert run.state == "timed_out"
    assert time.time() - started < 6 + 8
    assert run.stop_report is not None
    assert run.stop_report.survivors == ()
    assert leftover_processes(run) == []


@pytest.mark.usefixtures("sigint_raises")
def test_interrupt_stops_the_whole_tree(env):
    run = start("import time\nprint('ready', flush=True)\ntime.sleep(120)\n", env)
    wait_for_lines(run, "ready", 2)
    pids = [p.pid for p in run_processes(run.run_id, run.agent.pid)]
    assert len(pids) >= 3  # the agent and both ranks were running when interrupted
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    run.follow(ScreenWriter(lambda _t: None))
    assert run.state == "interrupted"
    assert_all_gone(run, pids)


def test_agent_killed_with_sigkill_takes_its_workers(env):
    run = start("import time\nprint('ready', flush=True)\ntime.sleep(120)\n", env)
    wait_for_lines(run, "ready", 2)
    workers = [p.pid for p in run_processes(run.run_id, None) if p.pid != run.agent.pid]
    assert len(workers) == 2
    os.kill(run.agent.pid, signal.SIGKILL)
    # No help from nbgpu's stop ladder: the parent-death signal alone must end them.
    run.agent.wait(timeout=10)
    deadline = time.time() + 5
    while time.time() < deadline and any(psutil.pid_exists(p) for p in workers):
        time.sleep(0.05)
    survivors = [
        p for p in workers if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
    ]
    assert survivors == []
    run.follow(ScreenWriter(lambda _t: None))
    assert run.state == "failed"


def test_failed_run_is_diagnosed_with_the_inventory(env):
    # busy-gpu0 forced onto its busy GPU 0: rank 0 fails with CUDA's own busy error.
    env = {**env, "NBGPU_SIMULATE": "busy-gpu0"}
    run = start("import nbgpu.rank as R\nR.init()\n", env, gpus="0,1", force=True)
    run.follow(ScreenWriter(lambda _t: None))
    assert run.state == "failed"
    assert run.root_cause.rank == 0
    assert run.diagnosis.cause == "cuda_busy"
    lines = run.failure_lines()
    assert lines[1].startswith("cause: GPU busy or unavailable on rank 0 [cuda_busy]")
    assert "physical GPU 0 (exclusive-process), held by dead pid" in lines[1]
    assert any("--gpus 1,2,3" in line for line in lines)


@pytest.mark.parametrize(
    ("nproc", "cvd", "expected"),
    [
        (2, "1,2,3", "rank0→GPU 1, rank1→GPU 2 (GPU 3 unused)"),
        (3, "1,2,3", "rank0→GPU 1, rank1→GPU 2, rank2→GPU 3"),
        (8, "0,1,2,3,4,5,6,7", "rank0→GPU 0, rank1→GPU 1, …, rank7→GPU 7"),
        (2, "0", "rank0→GPU 0, rank1→GPU none"),  # --force: more ranks than GPUs
    ],
)
def test_headline_says_which_gpu_each_rank_got(nproc, cvd, expected):
    run = Run(
        LaunchConfig(nproc=nproc, code="pass\n", cuda_visible_devices=cvd),
        environ={"NBGPU_SIMULATE": "busy-gpu0"},
    )
    assert run.gpu_assignment() == expected
    assert f" · {expected} · " in run._headline()
    assert run._headline().endswith("SIMULATED fleet 'busy-gpu0'")
    assert run.rank_gpu(0) == cvd.split(",")[0]


DDP_TUTORIAL = """\
import os
import torch.distributed as dist


def setup(rank, world_size):
    dist.init_process_group("nccl", rank=rank, world_size=world_size)


setup(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
"""


def test_one_root_cause_rank_everywhere_for_a_backend_torch_lacks(env, tmp_path):
    if dist.is_nccl_available():
        pytest.skip("this torch has NCCL built in: the tutorial's init would not fail here")
    script = tmp_path / "ddp_tutorial.py"
    script.write_text(DDP_TUTORIAL)
    run = start(None, env, script=script)
    run.follow(ScreenWriter(lambda _t: None))
    assert run.state == "failed"
    assert run.diagnosis.cause == "backend_unavailable"
    again = diagnose(run.dir)
    assert run.root_cause is not None
    # The run summary, the run's own diagnosis and a fresh `nbgpu diagnose` agree.
    assert run.root_cause.rank == run.diagnosis.failed_rank == again.failed_rank
    assert f"rank {run.root_cause.rank} failed first" in run.failure_summary()
    assert again.cause == "backend_unavailable"


def test_a_failing_diagnosis_is_said_with_the_runs_own_root_cause(env, monkeypatch):
    def broken(*_args, **_kwargs):
        raise RuntimeError("catalog exploded\nsecond line")

    monkeypatch.setattr(nbgpu.diagnose, "diagnose", broken)
    code = "import os, time\nif os.environ['RANK'] == '1':\n    raise ValueError('bad rank 1')\ntime.sleep(60)\n"
    run = start(code, env)
    run.follow(ScreenWriter(lambda _t: None))
    assert run.state == "failed"
    assert run.diagnosis is None
    assert run.diagnosis_error == "RuntimeError: catalog exploded"
    assert run.root_cause is not None
    assert run.root_cause.rank == 1
    lines = run.failure_lines()
    assert lines[0].startswith("RunFailed: run ")
    assert "rank 1 failed first" in lines[0]
    assert lines[1].startswith("diagnosis failed: RuntimeError: catalog exploded")
    assert "diagnosis failed: RuntimeError: catalog exploded" in run.text()
    assert "diagnosis failed" in run.html_body()


def test_failure_report_says_each_thing_once(env):
    env = {**env, "NBGPU_SIMULATE": "busy-gpu0"}
    run = start("import nbgpu.rank as R\nR.init()\n", env, gpus="0,1", force=True)
    run.follow(ScreenWriter(lambda _t: None))
    assert run.diagnosis.cause == "cuda_busy"
    for shown in (False, True):
        lines = run.failure_lines(output_shown=shown)
        text = "\n".join(lines)
        for fix in run.diagnosis.root.fixes:
            assert text.count(fix) <= 1, fix
        traceback_lines = [line for line in lines if "Traceback" in line or "File " in line]
        if shown:
            # The streamed output already holds the traceback: it is pointed to, not repeated.
            assert traceback_lines == []
            assert any("traceback: above, and in" in line for line in lines)
        # Never hard-wrapped: the summary and the cause are each one whole line.
        assert lines[0] == f"RunFailed: {run.failure_summary()}"
        assert f"cause: {run.diagnosis.headline}" in lines
