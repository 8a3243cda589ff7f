"""End to end through a real Jupyter kernel (jupyter_client): stream, then SIGKILL the kernel.

The hardest lifecycle case: the kernel itself dies with SIGKILL while a background
run is active. Its torchrun agent and ranks live in their own sessions, so only
nbgpu's parent-death signals can end them.
"""

import json
import os
import signal
import sys
import time

import pytest
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager

from tests.browser.helpers import processes_of_run

pytestmark = pytest.mark.slow


def _execute(client, code, timeout=120, on_output=None):
    """Run code; return (stdout text, error-or-None). *on_output* sees the text so far."""
    msg_id = client.execute(code)
    out, error = [], None
    deadline = time.time() + timeout
    while time.time() < deadline:
        msg = client.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out.append(content["text"])
            if on_output is not None:
                on_output("".join(out))
        elif kind == "error":
            error = f"{content['ename']}: {content['evalue']}"
        elif kind == "status" and content["execution_state"] == "idle":
            break
    return "".join(out), error


@pytest.fixture
def kernel(sim_env, tmp_path):
    env = {**sim_env, "NBGPU_SIMULATE": "4xA40", "NBGPU_RUNS_DIR": str(tmp_path / "runs")}
    yield from started_kernel(env, tmp_path)


def started_kernel(env, tmp_path):
    """A real kernel with *env*, as a fixture's body: yields (manager, client), then stops it."""
    # A kernelspec for this very interpreter, so the kernel imports this checkout.
    spec_dir = tmp_path / "kernels" / "nbgpu-test"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "nbgpu test",
                "language": "python",
            }
        )
    )
    specs = KernelSpecManager()
    specs.kernel_dirs = [str(tmp_path / "kernels")]
    km = KernelManager(kernel_name="nbgpu-test", kernel_spec_manager=specs)
    km.start_kernel(env=env, cwd=str(tmp_path))
    client = km.client()
    client.start_channels()
    client.wait_for_ready(timeout=60)
    yield km, client
    client.stop_channels()
    if km.is_alive():
        km.shutdown_kernel(now=True)
    km.cleanup_resources()
    km.context.term()  # otherwise zmq's Context.__del__ warns at interpreter exit


def test_stream_then_sigkill_kernel_leaves_nothing(kernel, tmp_path):
    km, client = kernel
    runs = tmp_path / "runs"
    out, error = _execute(client, "%load_ext nbgpu")
    assert error is None, out
    out, error = _execute(
        client, "%%torchrun 2 --name e2e-fg\nimport os\nprint('hello from', os.environ['RANK'])\n"
    )
    assert error is None, out
    assert "[rank0]" in out
    assert "hello from 0" in out
    assert "hello from 1" in out
    out, error = _execute(
        client,
        "%%torchrun 2 --bg --name e2e-bg\nimport time\nprint('ready', flush=True)\ntime.sleep(300)\n",
    )
    assert error is None, out
    deadline = time.time() + 60
    procs = []
    while time.time() < deadline:
        procs = processes_of_run(runs, "e2e-bg")
        if len(procs) >= 3:  # the agent and both ranks are up
            break
        time.sleep(0.1)
    assert len(procs) >= 3, procs
    kernel_pid = km.provisioner.process.pid
    os.kill(kernel_pid, signal.SIGKILL)
    deadline = time.time() + 15
    while time.time() < deadline and processes_of_run(runs, "e2e-bg"):
        time.sleep(0.1)
    assert processes_of_run(runs, "e2e-bg") == []
