"""`nbgpu memory` and the memory flags of `nbgpu run` in a real subprocess: one line for
bad input, the report and its figure for good input."""

import json
import subprocess
import sys

import pytest

from nbgpu.profile.phases import Phase
from nbgpu.profile.recorder import Recorder


def nbgpu(*args, env):
    return subprocess.run(
        [sys.executable, "-m", "nbgpu", *args],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip


@pytest.fixture
def env(sim_env, tmp_path):
    return {**sim_env, "NBGPU_RUNS_DIR": str(tmp_path / "runs")}


@pytest.mark.parametrize("value", ["-1", "abc"])
def test_run_refuses_a_bad_sample_interval_in_one_line(env, tmp_path, value):
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    out = nbgpu("run", "-n", "1", "--mem-sample", value, str(script), env=env)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0, out.stderr
    assert f"--mem-sample {value!r}" in out.stderr
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


def test_run_help_shows_serial_imports_and_mem_sample(env):
    out = nbgpu("run", "-h", env=env)
    assert "--serial-imports" in out.stdout
    assert "--mem-sample" in out.stdout


def test_memory_of_unknown_name_is_one_line(env):
    out = nbgpu("memory", "no-such-run", env=env)
    assert out.returncode == 2
    assert "no run named 'no-such-run'" in out.stderr
    assert "Traceback" not in out.stderr


def test_memory_of_a_directory_writes_png_and_json(env, tmp_path):
    run_dir = tmp_path / "some-run"
    run_dir.mkdir()
    rec = Recorder(run_dir / "mem-rank0.jsonl", {"rank": 0}, sample_s=0)
    with Phase("imports", rec):
        pass
    rec.close()
    with (run_dir / "mem-rank1.jsonl").open("w") as handle:
        handle.write('{"k":"proc","t":1.0,"rank":1}\n{"k":"begin","id":0,"phase":"imp')
    png = tmp_path / "fig.png"
    out = nbgpu("memory", str(run_dir), "--png", str(png), "--json", env=env)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert [row["phase"] for row in data["phases"]] == ["imports"]
    assert any("cut off mid-write" in note for note in data["notes"])
    assert png.read_bytes().startswith(b"\x89PNG")
    text = nbgpu("memory", str(run_dir), env=env)
    assert "imports" in text.stdout
    assert "cut off mid-write" in text.stdout
