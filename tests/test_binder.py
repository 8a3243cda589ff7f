"""Binder builds from binder/ alone, as repo2docker does, and every notebook runs in it.

repo2docker (a ``binder/`` folder present) uses only that folder: a Python
environment (``runtime.txt``) that already holds Jupyter (its base environment:
jupyterlab, notebook, ipywidgets), then ``pip install -r binder/requirements.txt``
from the repository root, then ``binder/postBuild``; at every start ``binder/start``
wraps the server command. This test does the same in a fresh virtual environment
with a copy of the repository, and runs every ``notebooks/*.ipynb`` in a kernel
started through ``binder/start``.

One substitution, said here and checked: PyTorch's CPU wheel index, which
requirements.txt points pip at, cannot be reached from CI machines, so torch comes the
way ``make test`` takes it (the same version, from PyPI or pip's local cache). Every
other line of requirements.txt is installed as written.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BINDER = ROOT / "binder"
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
# What repo2docker's base environment brings before requirements.txt (its
# conda/environment.yml pins these series).
BASE_ENVIRONMENT = ["jupyterlab>=4,<5", "notebook>=7,<8", "ipywidgets>=8,<9"]

pytestmark = pytest.mark.slow


def _makefile_torch_spec() -> str:
    match = re.search(r"^TORCH_SPEC \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert match, "Makefile: no TORCH_SPEC"
    return match.group(1)


def _requirements() -> tuple[list[str], str]:
    """(requirement lines other than torch and index options, the torch line)."""
    lines = [
        line.strip()
        for line in (BINDER / "requirements.txt").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    torch = [line for line in lines if re.match(r"torch\b", line)]
    assert len(torch) == 1, lines
    rest = [line for line in lines if line not in torch and not line.startswith("--")]
    options = [line for line in lines if line.startswith("--")]
    assert options == [f"--extra-index-url {TORCH_INDEX}"], options
    return rest, torch[0]


def test_binder_folder_says_what_repo2docker_reads():
    assert (BINDER / "runtime.txt").read_text().strip() == "python-3.11"
    for script in ("postBuild", "start"):
        path = BINDER / script
        assert os.access(path, os.X_OK), f"binder/{script} is not executable"
        text = path.read_text()
        assert text.startswith("#!/bin/bash\n"), script
    assert "set -euo pipefail" in (BINDER / "postBuild").read_text()
    assert (BINDER / "start").read_text().rstrip().endswith('exec "$@"')
    # The CPU build of the version `make test` uses; +cpu exists only on PyTorch's index,
    # so pip can never fall back to a multi-GB CUDA build from PyPI.
    _, torch = _requirements()
    assert torch == _makefile_torch_spec() + "+cpu"
    # No internal document names in what users of Binder read.
    for path in BINDER.iterdir():
        assert not re.search(r"seed ?0", path.read_text(), re.I), path


def _copy_repository(dest: Path) -> None:
    # What repo2docker copies: the repository's files (tracked and new, not ignored).
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        source = ROOT / name.decode()
        if source.is_file():
            target = dest / name.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def _clean_env(venv: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("NBGPU_", "CUDA_", "PYTEST_", "OMP_", "VIRTUAL_ENV", "PYTHONPATH"))
        and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")
    }
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    # repo2docker tells postBuild where the kernel's environment is.
    env["KERNEL_PYTHON_PREFIX"] = str(venv)
    return env


def _run(argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float = 900) -> str:
    result = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert result.returncode == 0, (
        f"{' '.join(argv)} exited {result.returncode}\n"
        f"--- stdout (tail)\n{result.stdout[-4000:]}\n--- stderr (tail)\n{result.stderr[-4000:]}"
    )
    return result.stdout


ENV_PROBE = """{
 "cells": [{"cell_type": "code", "execution_count": null, "id": "probe", "metadata": {},
            "outputs": [],
            "source": ["import os\\n", "print('kernel sees', os.environ.get('NBGPU_SIMULATE'),",
                       " os.environ.get('OMP_NUM_THREADS'))"]}],
 "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
 "nbformat": 4, "nbformat_minor": 5
}
"""


def test_binder_environment_builds_and_runs_every_notebook(tmp_path):
    assert sys.version_info[:2] == (3, 11), "binder/runtime.txt asks for Python 3.11"
    repo = tmp_path / "repo"
    _copy_repository(repo)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = _clean_env(venv)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]

    # repo2docker's base environment, then torch the way `make test` takes it.
    _run([*pip, *BASE_ENVIRONMENT], cwd=repo, env=env)
    rest, torch = _requirements()
    _run([*pip, torch.split("+", 1)[0]], cwd=repo, env=env)
    # Everything else binder/requirements.txt says, as written, from the repo root.
    if rest:
        (tmp_path / "rest.txt").write_text("\n".join(rest) + "\n")
        _run([*pip, "-r", str(tmp_path / "rest.txt")], cwd=repo, env=env)
    # postBuild, as repo2docker runs it.
    _run(["./binder/postBuild"], cwd=repo, env=env)
    shown = _run(
        [str(venv / "bin" / "python"), "-c", "import nbgpu, torch; print(nbgpu.__file__)"],
        cwd=tmp_path,
        env=env,
    )
    assert shown.strip().startswith(str(repo / "nbgpu")), shown  # the repo's own code

    # start wraps the server: what it exports must reach a kernel.
    runner = [str(repo / "binder" / "start"), str(venv / "bin" / "python")]
    probe = tmp_path / "probe.ipynb"
    probe.write_text(ENV_PROBE)
    out = _run(
        [*runner, str(repo / "notebooks" / "run_headless.py"), str(probe)], cwd=repo, env=env
    )
    assert "kernel sees busy-gpu0 1" in out, out

    notebooks = sorted((repo / "notebooks").glob("*.ipynb"))
    assert notebooks
    for notebook in notebooks:
        out = _run(
            [*runner, str(repo / "notebooks" / "run_headless.py"), str(notebook)],
            cwd=repo,
            env=env,
            timeout=600,
        )
        assert "ran without error" in out, out[-3000:]
        # No GPU on Binder: every tutorial shows a simulated fleet, and says so.
        assert "SIMULATED fleet '" in out, f"{notebook.name}: {out[-3000:]}"
