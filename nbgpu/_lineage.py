"""Ties between nbgpu's processes and the children they start: standard library only.

Every process nbgpu starts (the device probe, torchrun's agent, each rank) must die with
the process that started it, and must import the same nbgpu as its parent, also from a
checkout that is not installed. Both rules live here once, importable by every layer and
by rank processes before anything heavy is loaded.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import site
import sys
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "die_with_parent",
    "package_root",
    "set_parent_death_signal",
    "with_package_importable",
]

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def set_parent_death_signal(sig: int) -> str | None:
    """Ask the kernel to send *sig* when our parent dies; the reason if it refused.

    prctl reports failure through its return value, not an exception: checking it is
    what turns a silently lost guarantee into a line the user sees.
    """
    if sys.platform != "linux":
        return f"no parent-death signal on {sys.platform}"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            return f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(errno) if errno else 'error'}"
    except (OSError, AttributeError) as exc:
        return f"prctl(PR_SET_PDEATHSIG) unavailable: {exc}"
    return None


def die_with_parent(sig: int, expected_parent: int | None) -> str | None:
    """Arrange to receive *sig* when the parent dies, and exit now if it already has.

    The parent may have died while this interpreter started, before prctl took effect:
    then the kernel will never signal us. *expected_parent* is the launcher's pid (passed
    in the environment); it must still be one of our ancestors, since an interpreter
    wrapper (``sudo``, a venv shim) may sit in between. Returns why the signal could not
    be set up, for the caller to record; None when it was.
    """
    problem = set_parent_death_signal(sig)
    if expected_parent and not _is_ancestor(expected_parent):
        os._exit(128 + int(sig))
    return problem


def _is_ancestor(pid: int) -> bool:
    current = os.getppid()
    # Walking /proc is exact (a reused pid elsewhere does not count); without /proc,
    # whether the pid exists at all is the best answer there is.
    for _ in range(64):
        if current == pid:
            return True
        if current <= 1:
            return False
        try:
            stat = Path(f"/proc/{current}/stat").read_text(encoding="utf-8")
        except OSError:
            return _exists(pid)
        # The command name (field 2) may contain spaces and parentheses: split after it.
        current = int(stat.rsplit(")", 1)[1].split()[1])
    return False


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, under another user
    return True


def package_root() -> str:
    """The directory that holds this ``nbgpu`` package."""
    return str(Path(__file__).resolve().parent.parent)


def with_package_importable(environ: Mapping[str, str]) -> dict[str, str]:
    """A copy of *environ* in which a child Python imports this same nbgpu.

    A checkout that is not installed goes in front of PYTHONPATH. An installed copy is
    already importable, and putting site-packages on PYTHONPATH would move it in front
    of the standard library, so it is left alone.
    """
    env = dict(environ)
    root = package_root()
    site_dirs: set[str] = set()
    with contextlib.suppress(AttributeError):  # site helpers are missing in some venvs
        site_dirs = {
            str(Path(p).resolve()) for p in [*site.getsitepackages(), site.getusersitepackages()]
        }
    if root in site_dirs:
        return env
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([root, *paths])
    return env
