"""The process ties every child of nbgpu relies on: parent death and importing this nbgpu."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nbgpu import _children
from nbgpu._children import package_root, with_package_importable


def test_a_checkout_goes_in_front_of_pythonpath_once():
    env = with_package_importable({"PYTHONPATH": os.pathsep.join(["/x", "/y"])})
    expected = ["/x", "/y"] if _installed() else [package_root(), "/x", "/y"]
    assert env["PYTHONPATH"].split(os.pathsep) == expected
    again = with_package_importable(env)
    assert again["PYTHONPATH"] == env["PYTHONPATH"]  # not added twice


def test_the_child_imports_this_same_nbgpu():
    env = with_package_importable({k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    out = subprocess.run(
        [sys.executable, "-c", "import nbgpu, os; print(os.path.dirname(nbgpu.__file__))"],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == str(Path(package_root()) / "nbgpu")


def _installed() -> bool:
    import site  # noqa: PLC0415

    return package_root() in {str(Path(p).resolve()) for p in site.getsitepackages()}


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux-only")
@pytest.mark.parametrize("through_wrapper", [False, True])
def test_a_child_whose_launcher_already_died_exits_at_once(through_wrapper):
    # The launcher died before prctl took effect: the kernel will never signal the child,
    # so the child must notice by itself, also when a wrapper process sits in between.
    child = textwrap.dedent("""
        import signal, sys
        from nbgpu._children import die_with_parent
        die_with_parent(signal.SIGTERM, int(sys.argv[1]))
        print("still here")
    """)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    cmd = [sys.executable, "-c", child, str(dead.pid)]
    if through_wrapper:
        cmd = ["/bin/sh", "-c", '"$@"', "sh", *cmd]
    env = with_package_importable(os.environ)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert out.stdout == ""
    assert out.returncode == 128 + 15


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux-only")
def test_a_live_launcher_behind_a_wrapper_counts_as_alive():
    child = textwrap.dedent("""
        import os, signal
        from nbgpu._children import die_with_parent
        print(die_with_parent(signal.SIGTERM, int(os.environ["LAUNCHER"])))
    """)
    env = {**with_package_importable(os.environ), "LAUNCHER": str(os.getpid())}
    cmd = ["/bin/sh", "-c", '"$@"', "sh", sys.executable, "-c", child]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "None"  # set up, and not mistaken for an orphan


def test_the_module_is_standard_library_only():
    source = Path(_children.__file__).read_text(encoding="utf-8")
    imports = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert all(" nbgpu" not in line and "torch" not in line for line in imports), imports
