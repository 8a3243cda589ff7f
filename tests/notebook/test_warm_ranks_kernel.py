"""``%%torchrun --on w --ranks ...``, ``%gpu_runs w`` and ``--on``/``--pull`` completion
through a real Jupyter kernel (jupyter_client) and real torchrun ranks.
"""

import functools

import pytest

from tests.browser.helpers import processes_of_run
from tests.launch.test_orphans import wait_until
from tests.notebook.test_kernel_e2e import kernel  # noqa: F401
from tests.notebook.test_warm_kernel import _execute

pytestmark = pytest.mark.slow

START = (
    "%%torchrun 2 --keep --name w\nimport os\nimport nbgpu.rank\nnbgpu.rank.init()\n"
    "rank = int(os.environ['RANK'])\ncount = 0\n"
)


def _complete(client, code):
    """What the kernel offers with the cursor at the end of *code* (a real complete_request)."""
    msg_id = client.complete(code, len(code))
    reply = client.get_shell_msg(timeout=30)
    while reply["parent_header"].get("msg_id") != msg_id:  # earlier cells' replies first
        reply = client.get_shell_msg(timeout=30)
    return reply["content"]["matches"]


def test_ranks_names_and_completion_in_a_kernel(kernel, tmp_path):  # noqa: F811
    _km, client = kernel
    assert _execute(client, "%load_ext nbgpu")[1] is None
    assert "w" not in _complete(client, "%%torchrun --on ")  # no warm job yet
    out, error = _execute(client, START)
    assert error is None, out
    # Only rank 1 runs the cell; rank 0's count stays as it was.
    out, error = _execute(client, "%%torchrun --on w --ranks 1\ncount = 5\nprint('set', rank)")
    assert error is None, out
    assert "[rank1] set 1" in out
    assert "[rank0] set" not in out
    out, error = _execute(client, "%%torchrun --on w\nprint('count', count)")
    assert error is None, out
    assert "[rank0] count 0" in out
    assert "[rank1] count 5" in out
    # Bad --ranks: one line each; the job is left as it was.
    for line, message in (
        ("--on w --ranks 2", "UsageError: --ranks 2: the job has ranks 0-1, not 2"),
        ("--on w --ranks x", "UsageError: --ranks 'x': 'x' is not a rank or range; expected"),
        ("2 --ranks 0", "UsageError: --ranks 0: a new job runs on every rank; --ranks picks"),
    ):
        out, _error = _execute(client, f"%%torchrun {line}\ncount = -1")
        said = [text for text in out.splitlines() if text.strip()]
        assert len(said) == 1, out
        assert said[0].startswith(message), out
    # A collective that needs an idle rank: one line, at once; the job stays usable.
    out, error = _execute(
        client, "%%torchrun --on w --ranks 0\nimport torch.distributed as dist\ndist.barrier()"
    )
    assert error is not None, out
    assert error.startswith("CellFailed: cell 4 on 'w': rank 0 error (IdleRanksError: barrier"), (
        error
    )
    # %gpu_runs w: the names the ranks hold, grouped, in text (and HTML without <style>).
    out, error = _execute(
        client,
        "%%torchrun --on w --ranks 0\nimport torch\nw0 = torch.ones(2, 2)\n",
    )
    assert error is None, out
    out, error = _execute(client, "r = %gpu_runs w\nprint(r.text())\nprint('<style' in r.html())")
    assert error is None, out
    rows = {line.split()[0]: line for line in out.splitlines()[2:-1]}
    assert rows["count"].split()[-1] == "all"  # an int on each: one row, whatever the value
    assert rows["w0"].split()[-1] == "0"
    assert "2x2 float32, 16 B" in rows["w0"]
    assert rows["rank"].split()[-1] == "all"
    assert out.splitlines()[-1] == "False"
    # Completion: --on offers the warm jobs, --pull the names a rank holds.
    assert "w" in _complete(client, "%%torchrun --on ")
    assert _complete(client, "%%torchrun --on w --pull co") == ["count"]
    assert {"count", "rank", "w0"} <= set(_complete(client, "%%torchrun --on w --pull "))
    assert "torch" not in _complete(client, "%%torchrun --on w --pull ")
    out, error = _execute(client, "%gpu_stop w")
    assert error is None, out
    left = functools.partial(processes_of_run, tmp_path / "runs", "w")
    assert wait_until(lambda: not left(), 20), left()
