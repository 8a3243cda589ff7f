"""Warm jobs through a real Jupyter kernel: state across cells, interrupt, death, SIGKILL.

The kernel is a real ipykernel (jupyter_client); the ranks are real torchrun
processes. What is left at the end is looked for in every process on the machine
(by the run's name in their environment), not through nbgpu's bookkeeping.
"""

import functools
import os
import re
import signal

import pytest

from tests.browser.helpers import processes_of_run
from tests.launch.test_orphans import wait_until
from tests.notebook.test_kernel_e2e import _execute as _execute_colored
from tests.notebook.test_kernel_e2e import kernel  # noqa: F401

pytestmark = pytest.mark.slow

START = "%%torchrun 2 --keep --name {name}\nimport os\nrank = int(os.environ['RANK'])\ncount = 0\n"


def _plain(text):
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def _execute(client, code):
    out, error = _execute_colored(client, code)
    return _plain(out), error and _plain(error)


def _interrupted(km, client, code, wait_for):
    """Run *code*, press the notebook's stop button once *wait_for* is printed."""
    pressed = []

    def watch(text):
        if not pressed and wait_for in text:
            km.interrupt_kernel()
            pressed.append(True)

    out, error = _execute_colored(client, code, on_output=watch)
    return _plain(out), error


def test_a_warm_job_keeps_state_across_cells_and_interrupts(kernel, tmp_path):  # noqa: F811
    runs = tmp_path / "runs"
    km, client = kernel
    assert _execute(client, "%load_ext nbgpu")[1] is None
    out, error = _execute(client, START.format(name="w"))
    assert error is None, out
    assert "'w' is warm: %%torchrun --on w runs the next cell" in out
    for expected in (1, 2, 3):
        out, error = _execute(client, "%%torchrun --on w\ncount += 1\nprint('count', count)")
        assert error is None, out
        assert f"[rank0] count {expected}" in out
        assert f"[rank1] count {expected}" in out
    # --push and --pull per cell.
    _execute(client, "offset = 10")
    out, error = _execute(client, "%%torchrun --on w --push offset --pull count\ncount += offset")
    assert error is None, out
    assert "pulled into the notebook: count" in out
    assert _execute(client, "print('notebook has', count)")[0].strip() == "notebook has 13"
    # An exception is a failed cell; the ranks and their state stay.
    out, error = _execute(client, "%%torchrun --on w\nif rank == 1:\n    raise ValueError('boom')")
    assert error is not None, out
    assert error.startswith("CellFailed"), (out, error)
    assert "[rank1] ValueError: boom" in out
    # Interrupt: every rank's cell stops; the loop's progress stays in the ranks.
    loop = (
        "%%torchrun --on w\nimport time\nfor count in range(14, 10_000):\n"
        "    print('step', count, flush=True)\n    time.sleep(0.05)\n"
    )
    out, error = _interrupted(km, client, loop, "step 20")
    assert error is not None, out
    assert error.startswith("CellFailed"), (out, error)
    assert "KeyboardInterrupt" in out
    out, error = _execute(client, "%%torchrun --on w\nprint('after', count >= 20)")
    assert error is None, out
    assert "[rank0] after True" in out, out
    # %gpu_runs shows the job warm, with its idle time and memory.
    out, error = _execute(client, "r = %gpu_runs\nprint(r.text())")
    assert error is None, out
    assert "warm, idle" in out, out
    assert "RSS" in out, out
    # Bad input: one line; the job is left as it was.
    # (IPython prints a UsageError on stderr, as one line.)
    out, _error = _execute(client, "%%torchrun --on w --gpus 0\nprint(1)")
    assert "UsageError: --gpus with --on w: --gpus only applies when a job starts" in out
    out, _error = _execute(client, "%%torchrun --on nosuch\nprint(1)")
    assert "UsageError: --on nosuch: no warm job named 'nosuch' (warm jobs: w)" in out
    out, _error = _execute(client, "%%torchrun 2 --keep --bg\nprint(1)")
    assert "UsageError: --bg with --keep" in out
    out, error = _execute(client, "%%torchrun --on w\nprint('still', count >= 20)")
    assert error is None
    assert "[rank1] still True" in out
    # %gpu_stop ends it: the ranks exit normally.
    out, error = _execute(client, "s = %gpu_stop w\nprint(s.text())")
    assert error is None, out
    assert "stopped 'w'" in out, out
    left = functools.partial(processes_of_run, runs, "w")
    assert wait_until(lambda: not left(), 20), left()
    out, _error = _execute(client, "%%torchrun --on w\nprint(1)")
    assert "UsageError: --on w: the job has ended (stopped)" in out


def test_a_dead_rank_ends_the_job_and_kernel_sigkill_leaves_nothing(kernel, tmp_path):  # noqa: F811
    runs = tmp_path / "runs"
    km, client = kernel
    assert _execute(client, "%load_ext nbgpu")[1] is None
    out, error = _execute(client, START.format(name="dies"))
    assert error is None, out
    out, error = _execute(client, "%%torchrun --on dies\nif rank == 1:\n    os._exit(7)\n"
                          "import time\ntime.sleep(30)\n")  # fmt: skip
    assert error is not None, out
    assert error.startswith("RunFailed"), (out, error)
    assert "rank 1 failed first (exit 7)" in error
    assert wait_until(lambda: not processes_of_run(runs, "dies"), 20)
    # A warm job between cells, then the kernel SIGKILLed: parent-death signals end it.
    out, error = _execute(client, START.format(name="orphan"))
    assert error is None, out
    assert len(processes_of_run(runs, "orphan")) >= 3  # agent + 2 ranks
    os.kill(km.provisioner.process.pid, signal.SIGKILL)
    left = functools.partial(processes_of_run, runs, "orphan")
    assert wait_until(lambda: not left(), 20), left()


def test_a_kernel_restart_ends_a_warm_job(kernel, tmp_path):  # noqa: F811
    runs = tmp_path / "runs"
    km, client = kernel
    assert _execute(client, "%load_ext nbgpu")[1] is None
    out, error = _execute(client, START.format(name="restarted"))
    assert error is None, out
    assert len(processes_of_run(runs, "restarted")) >= 3
    km.restart_kernel(now=False)  # what the notebook's "Restart kernel" does
    left = functools.partial(processes_of_run, runs, "restarted")
    assert wait_until(lambda: not left(), 20), left()
