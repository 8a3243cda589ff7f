"""A real IPython InteractiveShell with nbgpu loaded, on a simulated fleet.

Modules choose the fleet by overriding the ``fleet`` fixture; the kernel's environment
is ``os.environ``, so the launching shell's GPU and torchrun variables are removed.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from IPython.core.interactiveshell import InteractiveShell

from tests.kernel_env import SCRUBBED


@pytest.fixture
def fleet() -> str:
    return "busy-gpu0"


@pytest.fixture
def ip(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fleet: str) -> Iterator[InteractiveShell]:
    for key in (*SCRUBBED, "NBGPU_RUN_DIR"):
        if key != "PYTEST_CURRENT_TEST":  # pytest's own; the shell runs in this process
            monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NBGPU_SIMULATE", fleet)
    monkeypatch.setenv("NBGPU_RUNS_DIR", str(tmp_path / "runs"))
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbgpu")
    yield shell
    shell.run_line_magic("gpu_stop", "--all")
    shell.run_line_magic("unload_ext", "nbgpu")


def svg_images(page: str) -> str:
    """The SVG of every ``<img>`` data URI in *page* (faces draw their charts so)."""
    found = re.findall(r"data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)", page)
    return "".join(base64.b64decode(data).decode() for data in found)
