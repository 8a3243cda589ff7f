"""Helpers for the real-browser tests: a private JupyterLab server, a page driver, /proc scans.

Facts these rely on (measured on this kind of machine, see shared/reference/jupyter.md §3):
Debian's Chromium driven by the Playwright wheel through ``executable_path`` (never
``playwright install``: it downloads a browser build, which cannot be fetched here);
Lab state isolated in temp dirs so no earlier workspace reopens old tabs; cells run through
``window.jupyterapp.commands.execute`` because a key press right after the kernel turns
idle is sometimes lost.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import nbformat
import psutil
from nbformat.v4 import new_code_cell, new_notebook

from tests.kernel_env import kernel_environ

CHROMIUM = Path("/usr/bin/chromium")
# Headless Chromium as root in a container: no sandbox (needs user namespaces), no GPU,
# nothing that phones home, and /tmp instead of a small /dev/shm.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--no-first-run",
]
KERNEL_NAME = "nbgpu-browser"


T = TypeVar("T")


# -- processes -------------------------------------------------------------------------


def processes_with_env(entry: str) -> list[psutil.Process]:
    """Live processes whose initial environment holds ``KEY=VALUE`` exactly.

    Children inherit the environment, so one marker finds a whole tree even after
    its members moved to their own sessions (kernels, torchrun agents, ranks).
    """
    wanted = entry.encode()
    return [proc for proc in psutil.process_iter() if _has_env(proc, wanted)]


def processes_of_run(runs: Path, name: str) -> list[psutil.Process]:
    """Live processes of the runs called *name* under *runs*, by the run id each carries
    from its start (an agent started early gets the run's name only after it starts)."""
    ids = set()
    for meta in runs.glob(f"{name}-*/run.json"):
        with contextlib.suppress(OSError, ValueError):  # being rewritten: the next look
            ids.add(json.loads(meta.read_text(encoding="utf-8"))["run_id"])
    return [proc for run_id in ids for proc in processes_with_env(f"NBGPU_RUN_ID={run_id}")]


def _has_env(proc: psutil.Process, wanted: bytes) -> bool:
    try:
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        return wanted in environ and proc.status() != psutil.STATUS_ZOMBIE
    except (OSError, psutil.Error):
        return False  # gone meanwhile, or not ours to read


def _describe_one(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {' '.join(proc.cmdline())[:160]}"
    except psutil.Error:
        return f"{proc.pid} (gone)"


def describe(procs: list[psutil.Process]) -> str:
    return "\n".join(_describe_one(proc) for proc in procs) or "(none)"


def wait_until(check: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.2) -> T:
    """Poll *check* until it returns something truthy; fail naming *what* otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def live_children() -> set[int]:
    """Pids of this process's live direct children (the Playwright driver, the Lab server)."""
    return {
        proc.pid
        for proc in psutil.Process().children()
        if _status(proc) not in (None, psutil.STATUS_ZOMBIE)
    }


def _status(proc: psutil.Process) -> str | None:
    try:
        return str(proc.status())
    except psutil.Error:
        return None


def kill_all(procs: list[psutil.Process]) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()


# -- notebooks -------------------------------------------------------------------------


def write_notebook(path: Path, sources: list[str]) -> None:
    """A notebook of never-run code cells, bound to the test's kernelspec (no dialog)."""
    nb = new_notebook(
        cells=[new_code_cell(source) for source in sources],
        metadata={
            "kernelspec": {
                "name": KERNEL_NAME,
                "display_name": "nbgpu (test)",
                "language": "python",
            }
        },
    )
    nbformat.write(nb, path)


# -- the server ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), encoding="utf-8")


class LabServer:
    """``jupyter lab`` with nothing shared with the user's own Jupyter, and default rate limits.

    Everything Lab would read or write (settings, workspaces, config, runtime, data,
    IPython profile) lives under *base*; the notebooks live in ``base / "root"``.
    """

    def __init__(self, base: Path, env: Mapping[str, str]) -> None:
        self.base = base
        self.root = base / "root"
        self.log_path = base / "lab.log"
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = self._environment(env)
        self.proc: subprocess.Popen[bytes] | None = None

    def _environment(self, extra: Mapping[str, str]) -> dict[str, str]:
        env = kernel_environ("NBGPU_RUNS_DIR")
        dirs = {
            "JUPYTERLAB_SETTINGS_DIR": "settings",
            "JUPYTERLAB_WORKSPACES_DIR": "workspaces",
            "JUPYTER_CONFIG_DIR": "config",
            "JUPYTER_RUNTIME_DIR": "runtime",
            "JUPYTER_DATA_DIR": "data",
            "IPYTHONDIR": "ipython",
        }
        for var, name in dirs.items():
            (self.base / name).mkdir(parents=True, exist_ok=True)
            env[var] = str(self.base / name)
        env.update(extra)
        return env

    def _prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        settings = self.base / "settings"
        # The news toast would cover the page; windowing off so off-screen outputs are
        # in the DOM with their text (the default "contentVisibility" can hide them).
        _write_json(
            settings / "@jupyterlab/apputils-extension/notification.jupyterlab-settings",
            {"fetchNews": "false", "checkForUpdates": False},
        )
        _write_json(
            settings / "@jupyterlab/notebook-extension/tracker.jupyterlab-settings",
            {"windowingMode": "none"},
        )
        # A kernelspec for this very interpreter, so the kernel imports this checkout.
        _write_json(
            self.base / "data/kernels" / KERNEL_NAME / "kernel.json",
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "nbgpu (test)",
                "language": "python",
            },
        )

    def start(self, timeout_s: float = 60.0) -> None:
        self._prepare()
        argv = [
            sys.executable, "-m", "jupyter", "lab",
            "--no-browser", "--allow-root",  # CI runs as root
            "--ip=127.0.0.1", f"--port={self.port}", "--ServerApp.port_retries=0",
            "--IdentityProvider.token=",
            f"--ServerApp.root_dir={self.root}",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.expose_app_in_browser=True",  # window.jupyterapp, as Galata uses
            # No iopub_* limit here on purpose: the test is about the defaults.
        ]  # fmt: skip
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                argv,
                env=self.env,
                cwd=self.root,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # so a last-resort killpg reaches only the server
            )
        wait_until(self._ready, timeout_s, f"JupyterLab at {self.url} (log: {self.log_path})")

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"jupyter lab exited ({self.proc.returncode}):\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"{self.url}/api/status", timeout=2) as reply:  # noqa: S310
                return bool(reply.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM: the server shuts its kernels down (they stop their runs), then exits."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


# -- the page --------------------------------------------------------------------------

# The notebook panel of *path*, its kernel and, per code cell, what a person would look
# at: the prompt number, error outputs, and the rendered text of the output area.
_STATE_JS = """
(args) => {
  const app = window.jupyterapp;
  if (!app) return null;
  const panel = Array.from(app.shell.widgets('main'))
    .find(w => w.context && w.context.path === args.path);
  if (!panel || !panel.content || !panel.sessionContext) return null;
  const kernel = panel.sessionContext.session ? panel.sessionContext.session.kernel : null;
  const cells = panel.content.widgets.filter(c => c.model.type === 'code').map(c => {
    const errors = [];
    for (let i = 0; i < c.model.outputs.length; i++) {
      const out = c.model.outputs.get(i);
      if (out.type === 'error') errors.push(out.toJSON().ename + ': ' + out.toJSON().evalue);
    }
    const area = c.node.querySelector('.jp-OutputArea');
    const text = area ? area.textContent : '';
    return {
      count: c.model.executionCount,
      errors: errors,
      text: args.full ? text : text.slice(-400),
    };
  });
  return {
    id: panel.id,
    connected: !!kernel && kernel.connectionStatus === 'connected',
    status: kernel ? kernel.status : null,
    cells: cells,
  };
}
"""


class LabPage:
    """One notebook open in JupyterLab in a Playwright page."""

    def __init__(self, page: Any, server: LabServer) -> None:
        self.page = page
        self.server = server
        self.path = ""

    def state(self, *, full: bool = False) -> dict[str, Any] | None:
        result: dict[str, Any] | None = self.page.evaluate(
            _STATE_JS, {"path": self.path, "full": full}
        )
        return result

    def open(self, path: str, timeout_s: float = 60.0) -> None:
        """Open *path* (``?reset``: a fresh workspace) and wait for an idle, connected kernel."""
        self.path = path
        self.page.goto(f"{self.server.url}/lab/tree/{path}?reset", timeout=timeout_s * 1000)

        def kernel_ready() -> bool:
            state = self.state()
            return bool(state and state["connected"] and state["status"] == "idle")

        wait_until(kernel_ready, timeout_s, f"an idle kernel for {path} in the page")

    def run_all(self) -> None:
        """Run every cell of this notebook; returns at once (cells run in the kernel)."""
        self.page.evaluate(
            """(id) => {
                 const app = window.jupyterapp;
                 app.shell.activateById(id);
                 if (app.shell.currentWidget.id !== id) throw new Error('notebook not active');
                 void app.commands.execute('notebook:run-all-cells');
               }""",
            self._state_or_fail()["id"],
        )

    def _state_or_fail(self) -> dict[str, Any]:
        state = self.state()
        assert state is not None, f"{self.path} is not open in the page"
        return state

    def wait_for_cells(self, timeout_s: float, interval_s: float = 0.1) -> tuple[dict, float]:
        """Wait until every code cell ran (a prompt number) and the kernel is idle.

        Returns the final state and the slowest page round trip seen meanwhile: each
        poll runs JavaScript on the page's main thread, so a tab frozen by rendering
        shows up as a slow poll.
        """
        deadline = time.monotonic() + timeout_s
        slowest = 0.0
        state: dict[str, Any] = {}
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            state = self._state_or_fail()
            slowest = max(slowest, time.monotonic() - t0)
            errors = [e for cell in state["cells"] for e in cell["errors"]]
            assert not errors, f"a cell raised: {errors}"
            counts = [cell["count"] for cell in state["cells"]]
            if all(c is not None for c in counts) and state["status"] == "idle":
                return self.state(full=True) or state, slowest
            time.sleep(interval_s)
        raise AssertionError(f"cells of {self.path} did not finish in {timeout_s:g} s: {state}")

    def save(self, timeout_s: float = 30.0) -> None:
        """Save this notebook through Lab (as Ctrl+S would) and wait until it is on disk."""
        state = self._state_or_fail()
        path = self.server.root / self.path
        before = path.stat().st_mtime_ns
        self.page.evaluate(
            """async (id) => {
                 const app = window.jupyterapp;
                 app.shell.activateById(id);
                 await app.commands.execute('docmanager:save');
               }""",
            state["id"],
        )
        wait_until(lambda: path.stat().st_mtime_ns != before, timeout_s, f"{path} to be saved")

    def kernel_print(self, code: str) -> str:
        """What *code* prints when this notebook's kernel runs it (as a cell would, but
        without adding one): for asking the kernel what the page cannot show."""
        return str(
            self.page.evaluate(
                """async (args) => {
                     const panel = Array.from(window.jupyterapp.shell.widgets('main'))
                       .find(w => w.context && w.context.path === args.path);
                     const future = panel.sessionContext.session.kernel.requestExecute(
                       {code: args.code, store_history: false});
                     let text = '';
                     future.onIOPub = (msg) => {
                       if (msg.header.msg_type === 'stream') text += msg.content.text;
                       if (msg.header.msg_type === 'error') text += msg.content.ename;
                     };
                     await future.done;
                     return text;
                   }""",
                {"path": self.path, "code": code},
            )
        )

    def outputs_text(self) -> str:
        """The rendered text of every output area of the page (not the cell sources)."""
        return str(
            self.page.evaluate(
                """() => Array.from(document.querySelectorAll('.jp-OutputArea-output'))
                     .map(n => n.textContent).join('\\n')"""
            )
        )

    def page_text(self) -> str:
        return str(self.page.evaluate("() => document.body.textContent"))

    def screenshot(self, path: Path, *, full: bool = False) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(path), full_page=full)
        return path

    def shutdown_kernels(self) -> None:
        """Shut this page's kernels down through Lab itself (it holds the XSRF cookie)."""
        self.page.evaluate(
            "async () => { await window.jupyterapp.serviceManager.sessions.shutdownAll(); }"
        )
