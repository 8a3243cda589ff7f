"""Run directories stay bounded: last N runs, a size budget, never a run in use."""

import json
import os
import subprocess
import sys
import time

import pytest

from nbgpu.errors import UserInputError
from nbgpu.launch import rundirs
from nbgpu.launch.launcher import prepare
from nbgpu.launch.run import Run
from nbgpu.launch.rundirs import RetentionPolicy, prune
from nbgpu.launch.streams import ScreenWriter


def make_run(root, name, *, age_s, size=1000, state="succeeded", run_id=None):
    path = root / name
    path.mkdir(parents=True)
    meta = {"name": name, "run_id": run_id or name, "state": state}
    meta["started_at"] = time.time() - age_s
    (path / "run.json").write_text(json.dumps(meta))
    (path / "rank0.log").write_bytes(b"x" * size)
    return path


def test_keeps_the_newest_runs_and_the_budget(env, tmp_path):
    root = tmp_path / "runs"
    for i in range(6):  # run-0 newest
        make_run(root, f"run-{i}", age_s=100 * i, size=1000)
    report = prune(env, policy=RetentionPolicy(keep_runs=4, budget_bytes=0))
    assert sorted(n for n, _ in report.removed) == ["run-4", "run-5"]
    assert sorted(p.name for p in root.iterdir()) == ["run-0", "run-1", "run-2", "run-3"]
    report = prune(env, policy=RetentionPolicy(keep_runs=0, budget_bytes=2500))
    assert sorted(n for n, _ in report.removed) == ["run-2", "run-3"]
    assert report.freed_bytes >= 2000
    assert "removed 2" in report.text()
    assert report.to_dict()["kept_runs"] == 2


def test_never_touches_a_running_or_kept_run(env, tmp_path):
    root = tmp_path / "runs"
    make_run(root, "new", age_s=0)
    # A run whose processes live (even an orphan): found by its id in /proc/*/environ.
    live = make_run(root, "live", age_s=500, state="running", run_id="feedc0de")
    holder = subprocess.Popen(["sleep", "60"], env={**os.environ, "NBGPU_RUN_ID": "feedc0de"})
    kept = make_run(root, "warm", age_s=600)
    (kept / "KEEP").touch()
    # The only one the policy may remove.
    make_run(root, "old", age_s=700)
    try:
        report = prune(env, policy=RetentionPolicy(keep_runs=1, budget_bytes=0))
    finally:
        holder.kill()
        holder.wait()
    assert [n for n, _ in report.removed] == ["old"]
    assert dict(report.protected) == {"live": "running", "warm": "kept (KEEP file)"}
    assert live.exists()
    assert kept.exists()


def test_stale_running_state_without_processes_is_pruned_after_a_while(env, tmp_path):
    root = tmp_path / "runs"
    make_run(root, "new", age_s=0)
    stale = make_run(root, "crashed", age_s=5000, state="running")
    os.utime(stale, (time.time() - 5000, time.time() - 5000))
    report = prune(env, policy=RetentionPolicy(keep_runs=1, budget_bytes=0))
    assert [n for n, _ in report.removed] == ["crashed"]


def test_bad_policy_values_are_one_line(env):
    with pytest.raises(UserInputError, match="NBGPU_KEEP_RUNS='many': expected a whole number"):
        RetentionPolicy.from_env({**env, "NBGPU_KEEP_RUNS": "many"})
    with pytest.raises(UserInputError, match="NBGPU_RUNS_BUDGET='lots': expected a size"):
        RetentionPolicy.from_env({**env, "NBGPU_RUNS_BUDGET": "lots"})
    assert RetentionPolicy.from_env(env) == RetentionPolicy(
        rundirs.DEFAULT_KEEP, rundirs.DEFAULT_BUDGET
    )


def test_cli_runs_lists_and_prunes(env, tmp_path):
    root = tmp_path / "runs"
    for i in range(3):
        make_run(root, f"run-{i}", age_s=100 * i)
    cli_env = {**os.environ, **env}
    listing = subprocess.run(
        [sys.executable, "-m", "nbgpu", "runs"],
        env=cli_env,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert listing.returncode == 0
    assert "3 run directories" in listing.stdout
    pruned = subprocess.run(
        [sys.executable, "-m", "nbgpu", "runs", "--prune", "--keep", "1", "--json"],
        env=cli_env,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert pruned.returncode == 0, pruned.stderr
    assert {r["run_dir"] for r in json.loads(pruned.stdout)["removed"]} == {"run-1", "run-2"}
    bad = subprocess.run(
        [sys.executable, "-m", "nbgpu", "runs", "--prune", "--budget", "huge"],
        env=cli_env,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "nbgpu: error: --budget 'huge': expected a size such as 5G, 500M or 0 (no limit)"
    ]


@pytest.mark.slow
def test_new_runs_prune_and_say_so_once(env, tmp_path, monkeypatch):
    root = tmp_path / "runs"
    for i in range(4):
        make_run(root, f"old-{i}", age_s=1000 + i)
    monkeypatch.setattr("nbgpu.launch.rundirs._RETENTION_ANNOUNCED", [])
    env = {**env, "NBGPU_KEEP_RUNS": "2"}
    shown = []
    for _ in range(2):
        prepared = prepare(code="print('hi')\n", nproc=1, environ=env)
        run = Run(prepared.config, environ=env).start()
        run.follow(ScreenWriter(shown.append))
        assert run.state == "succeeded"
    text = "".join(shown)
    assert text.count("old run directories") == 1, text
    assert "keeping the last 2 runs" in text
    assert len(list(root.iterdir())) == 2
