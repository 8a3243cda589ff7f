"""The agent started before its run is prepared (nbgpu/launch/spare.py): a run takes it, a
run whose environment changes what the agent loaded gets it started again, and one no run
takes is gone when the block ends. Real agents and ranks."""

import contextlib
import json
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from nbgpu.errors import UserInputError
from nbgpu.launch.launcher import prepare
from nbgpu.launch.run import Run
from nbgpu.launch.spare import Spare, agent_started_early, base_agent_env
from nbgpu.launch.streams import ScreenWriter

pytestmark = pytest.mark.slow

CODE = """\
import os, sys, psutil
print('path', os.environ.get('EXTRA_MARK'), sys.path[:3])
print('agent argv:', psutil.Process(os.getppid()).cmdline()[:4])
"""


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.05)
    return False


def _run(environ, **options):
    lines: list[str] = []
    with agent_started_early(environ):
        prepared = prepare(code=CODE, nproc=2, environ=environ, **options)
        run = Run(prepared.config, environ=environ).start()
    run.follow(ScreenWriter(lines.append))
    return run, "".join(lines)


def test_a_run_takes_the_agent_started_early(env):
    run, text = _run(env)
    assert run.state == "succeeded", run.text()
    assert run.agent.args[-1] == "--wait"
    assert f"agent argv: {[sys.executable, '-m', 'nbgpu.rank.agent', '--wait']}" in text
    assert text.count("path None") == 2
    # Its processes carry the run's id from the start: the agent's own environment too.
    assert json.loads((run.dir / "run.json").read_text())["run_id"] == run.run_id


def test_an_environment_that_changes_what_the_agent_loaded_starts_it_again(env, tmp_path):
    extra = tmp_path / "extra"
    extra.mkdir()
    run, text = _run(env, env={"PYTHONPATH": str(extra), "EXTRA_MARK": "seen"})
    assert run.state == "succeeded", run.text()
    assert "path seen" in text
    assert str(extra) in text  # the ranks' sys.path
    # The agent itself started again with the run's PYTHONPATH: its command line is the run's.
    result = run.dir / "result.json"
    assert f"agent argv: {[sys.executable, '-m', 'nbgpu.rank.agent', str(result)]}" in text


@pytest.mark.parametrize("ending", ["no run", "bad input"])
def test_an_agent_no_run_takes_is_gone_when_the_block_ends(env, ending):
    pids = []
    refused = pytest.raises(UserInputError) if ending == "bad input" else contextlib.nullcontext()
    with refused, agent_started_early(env):
        pids = [p.pid for p in psutil.Process().children() if "--wait" in p.cmdline()]
        if ending == "bad input":
            prepare(code=CODE, nproc=0, environ=env)
    assert len(pids) == 1
    assert _gone(pids[0])


def test_what_the_agent_printed_before_its_run_goes_first_into_its_log(env, tmp_path):
    with tempfile.TemporaryFile() as early:
        early.write(b"a warning while importing\n")
        early.flush()
        proc = subprocess.Popen(
            [sys.executable, "-m", "nbgpu.rank.agent", "--wait"],
            env=base_agent_env(env, "test"),
            stdin=subprocess.PIPE,
            stdout=early,
            stderr=subprocess.STDOUT,
        )
    log = tmp_path / "agent.log"
    job = {"argv": ["not-a-run"], "env": base_agent_env(env, "test"), "cwd": str(tmp_path)}
    proc.communicate(json.dumps({**job, "log": str(log)}).encode() + b"\n", timeout=120)
    assert proc.returncode != 0
    lines = log.read_text().splitlines()
    assert lines[0] == "a warning while importing"
    assert "usage: python -m nbgpu.rank.agent" in lines[-1]


def test_an_agent_that_died_early_is_not_handed_a_run(env, tmp_path):
    spare = Spare(env)
    spare.proc.kill()
    spare.proc.wait()
    assert spare.start(["x", "--"], env, tmp_path / "agent.log") is None  # start_agent: a new one


def test_an_agent_carrying_another_runs_id_is_stopped_not_used(env, tmp_path):
    from nbgpu.launch.procs import start_agent, stop_processes  # noqa: PLC0415

    with agent_started_early(env):
        spare_pid = next(p.pid for p in psutil.Process().children() if "--wait" in p.cmdline())
        config = prepare(code=CODE, nproc=1, environ=env).config
        agent = start_agent(config, tmp_path, "another-run", 0, base_agent_env(env, "x"))
    try:
        assert agent.pid != spare_pid
        assert _gone(spare_pid)
    finally:
        stop_processes("x", agent.pid, grace_s=1.0)
        agent.wait(timeout=10)
