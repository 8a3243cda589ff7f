"""The disk under the run directory fills up mid-run: ranks keep running, the user is told once.

Uses a small tmpfs made for the test (needs root to mount; skipped with the reason
otherwise).
"""

import os
import shutil
import subprocess

import pytest

from nbgpu.launch.launcher import prepare
from nbgpu.launch.run import Run
from nbgpu.launch.streams import ScreenWriter

pytestmark = pytest.mark.slow

FLOOD_THEN_FINISH = """
import os
line = "x" * 1000
for i in range(4000):  # about 4 MB per rank: far more than the disk holds
    print(i, line)
import sys
print("still alive", file=sys.stderr)
with open(os.path.join(os.environ["OUT_DIR"], f"finished{os.environ['RANK']}"), "w") as f:
    f.write("ok")
"""


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root and mount(8)")
    where = tmp_path / "small"
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_full_disk_never_kills_a_rank_and_is_said_once(sim_env, tmp_path, small_disk):
    out = tmp_path / "out"
    out.mkdir()
    env = {**sim_env, "NBGPU_RUNS_DIR": str(small_disk / "runs")}
    prepared = prepare(code=FLOOD_THEN_FINISH, nproc=2, environ=env, env={"OUT_DIR": str(out)})
    run = Run(prepared.config, environ=env).start()
    shown = []
    run.follow(ScreenWriter(shown.append))
    text = "".join(shown)
    assert sorted(p.name for p in out.iterdir()) == ["finished0", "finished1"]
    assert run.state == "succeeded", text[-2000:]
    notices = [line for line in text.splitlines() if "is full" in line]
    assert len(notices) == 1, notices
    assert "rank0..rank1.log" in notices[0]
    assert "incomplete from" in notices[0]
