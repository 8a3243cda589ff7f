"""Hard edges of a launch: user data at exit, torchrun's failure reports, lost guarantees.

Real 2-rank torchrun jobs (gloo on CPU); faults are injected only where the
operating system would produce them (a libc that refuses prctl).
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nbgpu.launch.launcher import prepare
from nbgpu.launch.run import Run
from nbgpu.launch.streams import ScreenWriter

pytestmark = pytest.mark.slow


def run_to_end(code, environ, **options):
    prepared = prepare(code=code, nproc=options.pop("nproc", 2), environ=environ, **options)
    run = Run(prepared.config, environ=environ).start()
    shown = []
    run.follow(ScreenWriter(shown.append))
    return run, "".join(shown)


WRITER_IN_A_CYCLE = textwrap.dedent(
    """
    import os

    class Writer:
        # Buffers, and flushes in __del__; holds itself, so only the cycle
        # collector ever frees it (at interpreter shutdown).
        def __init__(self, path):
            self.path, self.buffer, self.me = path, [], None
            self.me = self

        def write(self, text):
            self.buffer.append(text)

        def __del__(self):
            with open(self.path, "w") as f:
                f.write("".join(self.buffer))

    w = Writer(os.path.join(os.environ["OUT_DIR"], f"out{os.environ['RANK']}.txt"))
    w.write("x" * 30)
    """
)


def test_finalizers_of_reference_cycles_run_at_rank_exit(env, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run, _ = run_to_end(WRITER_IN_A_CYCLE, env, env={"OUT_DIR": str(out)})
    assert run.state == "succeeded"
    for rank in (0, 1):
        assert (out / f"out{rank}.txt").read_text() == "x" * 30


def test_failed_rank_leaves_torchruns_banner_and_agent_error_file(env):
    run, _ = run_to_end(
        "import os\nif os.environ['RANK'] == '1':\n    raise ValueError('bad shard 7')\n", env
    )
    assert run.state == "failed"
    agent_log = (run.dir / "agent.log").read_text()
    assert "ChildFailedError" in agent_log
    assert "Root Cause (first observed failure)" in agent_log
    assert "bad shard 7" in agent_log
    error = json.loads((run.dir / "agent-error.json").read_text())
    assert "ValueError: bad shard 7" in error["message"]["message"]


REFUSING_PRCTL = textwrap.dedent(
    """
    # Injected into the run's processes: a libc whose prctl refuses, as under a
    # seccomp profile that denies it.
    import ctypes
    import errno

    _RealCDLL = ctypes.CDLL


    class _RefusingCDLL(_RealCDLL):
        def __getattr__(self, name):
            if name == "prctl":
                def prctl(*_args):
                    ctypes.set_errno(errno.EPERM)
                    return -1
                return prctl
            return super().__getattr__(name)


    ctypes.CDLL = _RefusingCDLL
    """
)


def test_refused_parent_death_signal_is_said_once_and_recorded(env, tmp_path):
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(REFUSING_PRCTL)
    env = {**env, "PYTHONPATH": str(inject)}
    run, shown = run_to_end("print('hello', flush=True)\n", env)
    assert run.state == "succeeded"
    notices = [line for line in shown.splitlines() if "no parent-death signal" in line]
    assert len(notices) == 1, shown
    assert "Operation not permitted" in notices[0]
    record = json.loads((run.dir / "run.json").read_text())["parent_death_signal"]
    assert record["ok"] is False
    assert set(record["lost"]) == {"agent", "rank0", "rank1"}


def test_parent_death_signal_in_place_is_recorded_quietly(env):
    run, shown = run_to_end("print('hello', flush=True)\n", env)
    assert "parent-death" not in shown
    record = json.loads((run.dir / "run.json").read_text())["parent_death_signal"]
    assert record == {"ok": True, "lost": {}}


def test_ranks_get_keyboardinterrupt_even_when_the_launcher_ignores_sigint(env):
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as under nohup or `make test &`
    try:
        run, shown = run_to_end(
            "import signal\nprint('handler', signal.getsignal(signal.SIGINT).__name__, flush=True)\n",
            env,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    assert run.state == "succeeded"
    assert shown.count("handler default_int_handler") == 2, shown


INTERRUPT_TESTS = (
    "tests/launch/test_run.py::test_interrupt_stops_the_whole_tree",
    "tests/devices/test_health.py::test_interrupt_while_probing_kills_the_probe_and_propagates",
)


def test_interrupt_tests_pass_under_a_parent_that_ignores_sigint():
    # `make test &`, nohup and some CI runners start the suite with SIGINT ignored.
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *INTERRUPT_TESTS],
        cwd=root,
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert "2 passed" in done.stdout
