"""The SLURM tests' cluster: started once per session, stopped by its daemons' pids.

Without root and without Debian's ``slurm-wlm`` and ``munge`` the tests are skipped with
the reason (``make test`` installs them when it runs as root, as CI does).
"""

import os

import pytest

from tests.slurm.cluster import Cluster, missing_binaries


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    missing = missing_binaries()
    if missing:
        pytest.skip(f"SLURM tests need {', '.join(missing)} (apt-get install slurm-wlm munge)")
    if os.getuid() != 0:
        pytest.skip("the SLURM test cluster runs its daemons as root (SlurmUser=root)")
    # A short path: slurmd's spool paths and munge's socket have length limits.
    cluster = Cluster(tmp_path_factory.mktemp("slurm", numbered=True)).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def env(slurm_cluster, tmp_path):
    """The cluster's client environment with a private runs directory, no simulated GPUs."""
    out = {**slurm_cluster.env, "NBGPU_RUNS_DIR": str(tmp_path / "runs")}
    out.pop("NBGPU_SIMULATE", None)
    out.pop("CUDA_VISIBLE_DEVICES", None)
    return out
