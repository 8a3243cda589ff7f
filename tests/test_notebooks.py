"""The tutorials in notebooks/ run in a real kernel without an error.

``make notebooks`` checks them with nbval, which misses one failure: a magic's
``UsageError`` reaches a kernel's client only as a stderr line and an error
*reply*, never as an ``error`` output, so nbval passes the cell. These tests run
every notebook through ``notebooks/run_headless.py`` (nbclient, the venv's own
ipykernel), which fails on the error reply and on a ``UsageError`` line.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from tests.kernel_env import kernel_environ

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
RUNNER = NOTEBOOKS / "run_headless.py"
TUTORIALS = sorted(NOTEBOOKS.glob("*.ipynb"))


def _env(fleet: str | None) -> dict[str, str]:
    env = kernel_environ()
    if fleet is not None:
        env["NBGPU_SIMULATE"] = fleet
    return env


def _run(notebook: Path, fleet: str | None, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(RUNNER), str(notebook), *extra],
        env=_env(fleet),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def _explain(result: subprocess.CompletedProcess[str]) -> str:
    return f"exit {result.returncode}\n--- stdout (tail)\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr}"


def nbgpu_status_without_simulation():
    import nbgpu  # noqa: PLC0415

    return nbgpu.status(environ=_env(None))


def test_there_are_tutorials():
    assert any(p.name == "quickstart.ipynb" for p in TUTORIALS)


@pytest.mark.slow
@pytest.mark.parametrize("notebook", TUTORIALS, ids=lambda p: p.name)
def test_notebook_runs_without_error(notebook):
    # No fleet given: the notebook picks its own default, as for a new user.
    before = notebook.read_bytes()
    result = _run(notebook, None)
    assert result.returncode == 0, _explain(result)
    assert "UsageError" not in result.stdout, _explain(result)
    assert "ran without error" in result.stdout
    assert notebook.read_bytes() == before, "run_headless wrote without --write"
    # Without a GPU a tutorial simulates one, and says so.
    no_gpu = not nbgpu_status_without_simulation().gpus
    if no_gpu:
        assert "SIMULATED" in result.stdout, _explain(result)
    if notebook.name in ("quickstart.ipynb", "launch.ipynb"):
        # ... and switches the simulation on only then.
        said = "No GPU found: this notebook shows the SIMULATED fleet 'busy-gpu0'."
        assert (said in result.stdout) == no_gpu, _explain(result)


@pytest.mark.slow
@pytest.mark.parametrize("fleet", ["healthy", "no-driver"])
def test_quickstart_runs_on_another_fleet(fleet):
    # `make demo` lets NBGPU_SIMULATE choose the fleet: the tutorial must not
    # depend on the busy-gpu0 scenario (nor on there being any GPU NVML can read).
    result = _run(NOTEBOOKS / "quickstart.ipynb", fleet)
    assert result.returncode == 0, _explain(result)
    assert f"SIMULATED fleet '{fleet}'" in result.stdout


@pytest.mark.slow
def test_usage_error_in_a_cell_fails_the_run(tmp_path):
    # The case nbval lets through: only a stderr line and an error reply.
    path = tmp_path / "bad.ipynb"
    cells = [
        new_code_cell("%load_ext nbgpu"),
        new_code_cell("%gpu_doctor --nproc 0"),
        new_code_cell("print('after the bad cell')"),
    ]
    nbformat.write(new_notebook(cells=cells), path)
    result = _run(path, "busy-gpu0")
    assert result.returncode == 1, _explain(result)
    assert "FAILED: In [2]: UsageError: --nproc 0" in result.stderr
    assert "after the bad cell" not in result.stdout


@pytest.mark.slow
def test_declared_errors_pass_and_write_stores_outputs(tmp_path):
    path = tmp_path / "ok.ipynb"
    cells = [
        new_markdown_cell("# Title"),
        new_code_cell("# NBVAL_RAISES_EXCEPTION\n1 / 0"),
        new_code_cell("# NBVAL_SKIP\nimport module_that_does_not_exist"),
        new_code_cell("print('done')"),
    ]
    nbformat.write(new_notebook(cells=cells), path)
    result = _run(path, "busy-gpu0", "--write")
    assert result.returncode == 0, _explain(result)
    assert "ZeroDivisionError" in result.stdout
    assert "[skipped]" in result.stdout
    written = nbformat.read(path, as_version=4)
    code = [c for c in written.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == [1, None, 2]
    assert code[2].outputs[0]["text"] == "done\n"


# -- nbval sanitizers (notebooks/sanitize.cfg) -------------------------------------------


def _sanitize(text: str) -> str:
    from nbval.plugin import get_sanitize_patterns  # noqa: PLC0415

    patterns = get_sanitize_patterns((NOTEBOOKS / "sanitize.cfg").read_text(encoding="utf-8"))
    assert len(patterns) >= 10, patterns
    for regex, replace in patterns:
        text = re.sub(regex, replace, text)
    return text


def _stored_output(notebook: str, needle: str, mime: str) -> str:
    nb = nbformat.read(NOTEBOOKS / notebook, as_version=4)
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if needle in cell.source and mime in data:
                return str(data[mime])
    raise AssertionError(f"no {mime} output of a cell with {needle!r} in {notebook}")


@pytest.mark.parametrize("mime", ["text/plain", "text/html"])
def test_sanitizers_absorb_what_another_run_changes_and_nothing_else(mime):
    stored = _stored_output("launch.ipynb", "%gpu_runs", mime)
    ports = re.findall(r"\b\d{5}\b", stored)
    assert ports, stored
    # Another run: other ports, ages, run directories (and so column widths).
    other = stored
    for port in set(ports):
        other = other.replace(port, str(int(port) % 9000 + 1024))
    other = re.sub(r"(\d+) s\b", lambda m: f"{int(m.group(1)) + 97} s", other)
    other = re.sub(r"-\d{8}-\d{6}-[0-9a-f]{4}", "-20300101-000000-beef", other)
    other = other.replace("/root/.cache/nbgpu/runs", "/home/someone/elsewhere/runs")
    assert other != stored
    assert _sanitize(other) == _sanitize(stored)
    # What matters still fails the cell: a state that changed.
    assert _sanitize(stored.replace("succeeded", "failed", 1)) != _sanitize(stored)


def test_sanitizers_let_ranks_interleave_but_count_their_lines():
    a = "[nbgpu] start\n\x1b[36m[rank0]\x1b[0m hi 0\n\x1b[33m[rank1]\x1b[0m hi 1\n"
    b = "[nbgpu] start\n\x1b[36m[rank1]\x1b[0m hi 1\n\x1b[33m[rank0]\x1b[0m hi 0\n"
    assert _sanitize(a) == _sanitize(b)
    assert _sanitize(a + "\x1b[36m[rank0]\x1b[0m extra\n") != _sanitize(a)


def test_make_notebooks_checks_every_notebook_with_the_sanitizers():
    # nbval collects the folder (so new notebooks are picked up without a list) and
    # compares the marked cells after sanitizing.
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    recipe = makefile[makefile.index("\nnotebooks:") :].split("\n\n")[0]
    assert "--nbval-sanitize-with sanitize.cfg" in recipe
    assert "--nbval-lax" in recipe
    assert recipe.rstrip().endswith(".")  # the whole folder, not named files
    for notebook in TUTORIALS:
        nb = nbformat.read(notebook, as_version=4)
        assert nb.cells, notebook


def test_a_saved_stream_keeps_what_jupyterlab_keeps_of_the_live_memory_line():
    # nbgpu erases its live line with backspaces (tests/browser/test_saved_form.py checks
    # JupyterLab itself); run_headless --write must store the same clean text, not the
    # control characters nbclient received.
    sys.path.insert(0, str(NOTEBOOKS))
    try:
        from run_headless import _as_a_front_end_saves  # noqa: PLC0415
    finally:
        sys.path.remove(str(NOTEBOOKS))
    line = "mem: node 11.1 MiB of 23.5 GiB"
    erase = "\b" * len(line) + " " * len(line) + "\b" * len(line)
    chunks = ["[rank0] a\n", line, erase + "[rank0] b\n" + line, erase + "\r50%\r100%\n"]
    outputs = [{"output_type": "stream", "name": "stdout", "text": t} for t in chunks]
    assert _as_a_front_end_saves(outputs) == [
        {"output_type": "stream", "name": "stdout", "text": "[rank0] a\n[rank0] b\n100%\n"}
    ]
