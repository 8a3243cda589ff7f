"""A real Jupyter kernel SIGKILLed while its run's ranks have children of their own.

Survivors are looked for in every process on the machine by the run's id (read from
the run's run.json), not through nbgpu's own process lookup.
"""

import json
import os
import signal

import pytest

from tests.launch.test_orphans import RANK_WITH_CHILDREN, tagged, wait_until
from tests.notebook.test_kernel_e2e import _execute, kernel  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow


def test_kernel_sigkill_leaves_no_child_of_any_rank(kernel, tmp_path):  # noqa: F811
    km, client = kernel
    out, error = _execute(client, "%load_ext nbgpu")
    assert error is None, out
    out, error = _execute(client, "%%torchrun 2 --bg --name orphans\n" + RANK_WITH_CHILDREN)
    assert error is None, out
    run_json = []
    assert wait_until(
        lambda: run_json.extend((tmp_path / "runs").glob("orphans-*/run.json")) or run_json, 60
    )
    run_id = json.loads(run_json[0].read_text())["run_id"]
    # agent + 2 x (rank, loader worker, sh, sleep)
    assert wait_until(lambda: len(tagged(run_id)) >= 9, 120), tagged(run_id)
    os.kill(km.provisioner.process.pid, signal.SIGKILL)
    assert wait_until(lambda: not tagged(run_id), 20), tagged(run_id)
