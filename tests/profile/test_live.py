"""The live memory line of a running job, from its records as they are written."""

import re

from nbgpu.profile.live import MemoryFollower
from tests.profile.test_figure import write_rank


def test_a_small_run_reads_in_mib_not_zero_gib(tmp_path):
    for rank in range(2):
        write_rank(tmp_path, rank, mib=25, died_in="run")  # not closed: running
    line = MemoryFollower(tmp_path, 2).summary()
    assert re.fullmatch(
        r"mem: node \d+\.\d MiB of [\d.]+ GiB \(Σ PSS of 2 ranks\) · max rank0: \d+\.\d MiB"
        r" in 'run'",
        line,
    ), line
