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


@pytest.fixture
def sim_env() -> dict[str, str]:
    """os.environ without NBGPU_SIMULATE / CUDA_VISIBLE_DEVICES, ready to extend."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("NBGPU_SIMULATE", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
    }
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
