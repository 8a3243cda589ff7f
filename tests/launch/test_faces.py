"""Hints name the face the user is in: terminal, notebook or Python."""

import os
import subprocess
import sys

import pytest

import nbgpu
from nbgpu.errors import UserInputError
from nbgpu.faces import launch_hint
from nbgpu.launch.launcher import prepare


def test_terminal_user_is_told_the_terminal_command(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    env = {**os.environ, "NBGPU_SIMULATE": "4xH100", "NBGPU_RUNS_DIR": str(tmp_path / "runs")}
    done = subprocess.run(
        [sys.executable, "-m", "nbgpu", "run", "-n", "7", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert "use nbgpu run -n 4 script.py" in done.stderr
    assert "%%torchrun" not in done.stderr
    assert "%gpu_" not in done.stderr


@pytest.mark.parametrize(
    ("face", "expected"),
    [
        ("notebook", "use %%torchrun 4,"),
        ("terminal", "use nbgpu run -n 4 script.py,"),
        ("python", "use nbgpu.torchrun(code, 4),"),
    ],
)
def test_each_face_gets_its_own_command(sim_env, face, expected):
    env = {**sim_env, "NBGPU_SIMULATE": "4xH100"}
    with pytest.raises(UserInputError, match="nproc 7") as info:
        prepare(code="pass", nproc=7, environ=env, face=face)
    assert expected in str(info.value)


def test_python_api_hints_in_python(sim_env):
    with pytest.raises(UserInputError) as info:
        nbgpu.torchrun("pass", 7, environ={**sim_env, "NBGPU_SIMULATE": "4xH100"})
    assert "nbgpu.torchrun(code, 4)" in str(info.value)


def test_no_gpu_hint_per_face(sim_env):
    with pytest.raises(UserInputError, match=r"e\.g\. nbgpu run -n 2 script\.py"):
        prepare(code="pass", environ=sim_env, face="terminal")
    assert launch_hint("notebook", 2, gpus="0,1", force=True) == "%%torchrun 2 --gpus 0,1 --force"


def test_doctor_in_a_terminal_names_the_terminal_command():
    env = {**os.environ, "NBGPU_SIMULATE": "4xH100", "NPROC_PER_NODE": "7"}
    done = subprocess.run(
        [sys.executable, "-m", "nbgpu", "doctor", "--no-probe"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "nbgpu run" in done.stdout
    assert "%%torchrun" not in done.stdout


def test_doctor_in_a_notebook_names_the_magic(sim_env):
    report = nbgpu.doctor(
        probe=False, environ={**sim_env, "NBGPU_SIMULATE": "4xH100"}, face="notebook"
    )
    assert "`%%torchrun 4`" in report.text()
    report = nbgpu.doctor(
        probe=False, environ={**sim_env, "NBGPU_SIMULATE": "4xH100"}, face="terminal"
    )
    assert report.recommendation is not None
    assert "`nbgpu run -n 4 script.py`" in report.recommendation
