"""Memory records of real torchrun jobs (2 ranks, gloo on CPU): every standard phase on
every rank, the user's phase with its allocation in its peak, a SIGKILLed rank's phase
left on disk, scripts' imports serialised like cells'."""

import json
import subprocess
import sys

import pytest

import nbgpu
from nbgpu.launch.launcher import prepare
from nbgpu.launch.run import Run, RunFailed
from nbgpu.launch.streams import ScreenWriter
from nbgpu.profile.records import read_run_dir

pytestmark = pytest.mark.slow
MIB = 1024 * 1024


@pytest.fixture
def env(sim_env, tmp_path):
    # A simulated fleet: on a GPU machine too, ranks run on CPU with gloo.
    return {**sim_env, "NBGPU_RUNS_DIR": str(tmp_path / "runs"), "NBGPU_SIMULATE": "4xA40"}


CELL = """
import os
import nbgpu
import nbgpu.rank as nr
nr.init()
with nbgpu.phase("model"):
    weights = bytearray(300 << 20)
    for i in range(0, len(weights), 4096):
        weights[i] = 1
nbgpu.phase.mark("POST-MODEL")
del weights
nr.barrier()
print("rank", nr.rank(), "done")
"""


def test_every_standard_phase_on_every_rank_and_the_users_phase_holds_its_allocation(env):
    run = nbgpu.torchrun(CELL, 2, environ=env, write=lambda _t: None)
    ranks = read_run_dir(run.dir)
    assert [r.label for r in ranks] == ["rank0", "rank1"]
    for rank in ranks:
        assert rank.closed
        paths = [p.path for p in rank.phases]
        assert paths == ["start", "imports", "run", "run > init", "run > model", "exit"], paths
        assert all(p.status == "done" for p in rank.phases)
        assert [m["name"] for m in rank.marks] == ["POST-MODEL"]
        assert len(rank.samples) >= 1  # the sampler ran (0.1 s default)
    frame = run.memory.to_frame()
    for label in ("rank0", "rank1"):
        model = frame.loc[("run > model", label)]
        assert model["peak_rss_bytes"] - model["rss_start_bytes"] >= 280 * MIB
        init = frame.loc[("run > init", label)]
        assert init["peak_rss_bytes"] < model["peak_rss_bytes"] - 200 * MIB
    # The terminal face reads the same directory.
    out = subprocess.run(
        [sys.executable, "-m", "nbgpu", "memory", str(run.dir), "--json"],
        capture_output=True, text=True, env=env, timeout=120, check=True,
    )  # fmt: skip
    data = json.loads(out.stdout)
    assert {row["phase"] for row in data["phases"]} >= {"start", "imports", "run > model", "exit"}
    assert data["died_in"] == {}


def test_a_rank_killed_inside_a_phase_leaves_that_phase_on_disk(env):
    cell = CELL.replace(
        'nbgpu.phase.mark("POST-MODEL")',
        'nbgpu.phase.mark("POST-MODEL")\n'
        "if nr.rank() == 1:\n"
        '    with nbgpu.phase("doomed"):\n'
        "        import signal; os.kill(os.getpid(), signal.SIGKILL)",
    )
    with pytest.raises(RunFailed) as failed:
        nbgpu.torchrun(cell, 2, environ=env, write=lambda _t: None, timeout_s=120)
    run = failed.value.run
    ranks = {r.label: r for r in read_run_dir(run.dir)}
    assert not ranks["rank1"].closed
    assert ranks["rank1"].died_in is not None
    assert ranks["rank1"].died_in.path == "run > doomed"
    text = run.memory.text()
    assert "rank1 died in 'run > doomed'" in text
    # A SIGKILL reads as the host's OOM killer; the diagnosis names the phase it hit.
    root = run.diagnosis.root
    assert root.cause == "host_oom"
    assert any("rank1 died in phase 'run > doomed'" in d for d in root.details)
    assert any("MemAvailable at the last sample" in d for d in root.details)


def test_scripts_leading_imports_are_serialised_and_recorded_like_a_cells(env, tmp_path):
    (tmp_path / "slowmod.py").write_text("import time\ntime.sleep(0.6)\n")
    script = tmp_path / "train.py"
    script.write_text("import slowmod\nimport os\nprint('rank', os.environ['RANK'], 'ran')\n")
    run = nbgpu.torchrun(str(script), 2, environ=env, write=lambda _t: None, serial_imports=True)
    ranks = read_run_dir(run.dir)
    spans = [next(p for p in r.phases if p.name == "imports") for r in ranks]
    first, second = sorted(spans, key=lambda p: p.start_t)
    # One rank at a time: the second import began after the first one ended.
    assert second.start_t >= first.end_t - 0.01
    assert all(p.end_t - p.start_t >= 0.5 for p in spans)
    logs = "".join(p.read_text() for p in run.dir.glob("rank*.log"))
    assert logs.count("LOCK: acquired 'imports'") == 2
    assert "ran" in logs


def _as_terminal_shows(text):
    """What a terminal shows of each line: '\\r' moves the cursor to the line's start, a
    backspace one place left, and a character overwrites the one under the cursor."""
    shown = []
    for line in text.split("\n"):
        cells: list[str] = []
        cursor = 0
        for char in line:
            if char in "\r\b":
                cursor = 0 if char == "\r" else max(0, cursor - 1)
                continue
            cells[cursor : cursor + 1] = [char]
            cursor += 1
        shown.append("".join(cells).rstrip())
    return shown


def test_live_memory_line_is_refreshed_in_place_and_erased_at_the_end(env):
    chunks = []
    code = "import time\nprint('up', flush=True)\ntime.sleep(4)\nprint('bye', flush=True)\n"
    prepared = prepare(code=code, nproc=2, environ=env)
    run = Run(prepared.config, environ=env).start()
    writer = ScreenWriter(chunks.append, live_status=True)
    run.follow(writer)
    assert run.state == "succeeded"
    text = "".join(chunks)
    assert "mem: node " in text
    assert "(Σ PSS of 2 ranks) · max rank" in text
    shown = [line for line in _as_terminal_shows(text) if line.strip()]
    # Every rank line survives; the status line is gone once the run is over.
    assert sum(line.startswith("[rank") and line.endswith("bye") for line in shown) == 2
    assert not any(line.startswith("mem:") for line in shown)
