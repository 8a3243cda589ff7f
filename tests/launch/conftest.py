"""Shared fixtures for the launch tests."""

import pytest


@pytest.fixture
def env(sim_env, tmp_path):
    """The test environment with a private runs directory."""
    return {**sim_env, "NBGPU_RUNS_DIR": str(tmp_path / "runs")}
