"""Shared fixtures. Tests pass environments as dicts; none patches os.environ."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from nbgpu.devices import nvml


@pytest.fixture(autouse=True)
def _fresh_nvml() -> Iterator[None]:
    # The NVML module keeps one initialised library per process; every test starts
    # from nothing so a fleet from one test never answers in the next.
    nvml.reset()
    yield
    nvml.reset()


# A machine without the NVIDIA driver, made explicit: tests that assume "no GPU"
# then hold on a GPU machine too (ranks compute on CPU with gloo either way).
NO_DRIVER = "1xA40,init=library_not_found"


def real_nvml_present() -> bool:
    """Whether this machine has a loadable NVIDIA driver library (a GPU machine)."""
    import ctypes  # noqa: PLC0415

    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


@pytest.fixture
def sim_env() -> dict[str, str]:
    """os.environ with no GPU simulated explicitly (NO_DRIVER), ready to extend.

    Tests that need a fleet set their own NBGPU_SIMULATE; none sees this machine's
    real GPUs, so the suite passes on GPU machines too.
    """
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("NBGPU_SIMULATE", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
    }
    env["NBGPU_SIMULATE"] = NO_DRIVER
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE"):
        env.pop(key, None)
    return env


@pytest.fixture
def sigint_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt here, even under a parent that ignores it.

    Python keeps an inherited ignored SIGINT (`make test &`, nohup, CI runners), so a
    test that sends SIGINT installs the handler it relies on.
    """
    import signal  # noqa: PLC0415

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


# -- the checkout stays clean ------------------------------------------------------
# A test that writes into the repository (a job's output file, a run directory, a
# notebook's checkpoint) leaves litter a later `git add -A` commits. The session lists
# the untracked, not ignored files before and after, and fails on any new one.


def _untracked() -> set[str] | None:
    import subprocess  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    root = str(Path(__file__).resolve().parent.parent)
    try:
        out = subprocess.run(
            ["git", "-C", root, "ls-files", "--others", "--exclude-standard"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None  # not a git checkout (an sdist): nothing to compare
    return set(out.splitlines())


_UNTRACKED_BEFORE: set[str] | None = None


def pytest_sessionstart(session: pytest.Session) -> None:  # noqa: ARG001
    global _UNTRACKED_BEFORE  # noqa: PLW0603  (one value per session, set once)
    _UNTRACKED_BEFORE = _untracked()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:  # noqa: ARG001
    after = _untracked()
    if _UNTRACKED_BEFORE is None or after is None:
        return
    left = sorted(after - _UNTRACKED_BEFORE)
    if left:
        print(f"\ntests left files in the checkout: {', '.join(left)}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
