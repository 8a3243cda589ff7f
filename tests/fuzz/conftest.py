"""The fuzz sandbox: HOME, the working directory and the runs directory are fresh temporary
directories, the fleet is simulated (two T4s, nothing holding them); after every test HOME
is unchanged and no child process is left. The working directory takes what a user names
(``--png FILE``, ``--output FILE``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from IPython.core.interactiveshell import InteractiveShell

from tests.fuzz.harness import tree, write_tally
from tests.kernel_env import SCRUBBED

FLEET = "2xT4"


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    root = tmp_path_factory.mktemp("fuzz")
    dirs = {name: root / name for name in ("home", "work", "runs", "inputs", "tools")}
    for path in dirs.values():
        path.mkdir()
    (dirs["home"] / ".bashrc").write_text("# a user's file\n")
    (dirs["home"] / ".cache").mkdir()
    with pytest.MonkeyPatch.context() as mp:
        for key in (*SCRUBBED, "NBGPU_RUN_DIR", "XDG_CACHE_HOME", "SLURM_JOB_ID"):
            if key != "PYTEST_CURRENT_TEST":
                mp.delenv(key, raising=False)
        mp.setenv("HOME", str(dirs["home"]))
        # IPython's profile and matplotlib's font cache are theirs, not nbgpu's: kept apart,
        # so HOME shows what nbgpu writes (matplotlib caches under ~/.cache on first use).
        mp.setenv("IPYTHONDIR", str(dirs["tools"] / "ipython"))
        mp.setenv("MPLCONFIGDIR", str(dirs["tools"] / "matplotlib"))
        mp.setenv("NBGPU_SIMULATE", FLEET)
        mp.setenv("NBGPU_RUNS_DIR", str(dirs["runs"]))
        mp.chdir(dirs["work"])
        yield dirs
    write_tally()


@pytest.fixture(autouse=True)
def _nothing_outside(sandbox: dict[str, Path]) -> Iterator[None]:
    home = tree(sandbox["home"])
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    assert tree(sandbox["home"]) == home, "a file under HOME was written"
    left = {p.pid for p in psutil.Process().children(recursive=True)} - children
    assert not left, f"processes left behind: {left}"


@pytest.fixture(scope="module")
def shell(sandbox: dict[str, Path]) -> Iterator[InteractiveShell]:  # noqa: ARG001
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "nbgpu")
    yield ip
    ip.run_line_magic("gpu_watch", "--stop")
    ip.run_line_magic("gpu_stop", "--all")
    ip.run_line_magic("unload_ext", "nbgpu")
