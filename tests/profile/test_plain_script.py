"""nbgpu.phase in a plain Python script (no nbgpu launch): in memory, or to NBGPU_MEM_DIR."""

import subprocess
import sys

SCRIPT = """
import nbgpu
with nbgpu.phase("load"):
    data = bytearray(80 << 20)
nbgpu.phase.mark("POST-LOAD")
print(nbgpu.phase.report().text())
"""


def run(env):
    return subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=60,
        check=True,
    )  # fmt: skip


def test_a_plain_script_reports_its_phases(sim_env):
    out = run(sim_env)
    assert "memory of this process" in out.stdout
    assert "load" in out.stdout


def test_a_plain_script_writes_records_where_told(sim_env, tmp_path):
    run({**sim_env, "NBGPU_MEM_DIR": str(tmp_path)})
    files = list(tmp_path.glob("mem-pid*.jsonl"))
    assert len(files) == 1
    text = files[0].read_text()
    assert '"phase":"load"' in text
    assert '"name":"POST-LOAD"' in text
