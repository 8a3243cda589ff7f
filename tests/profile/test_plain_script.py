"""nbgpu.phase in a plain Python script (no nbgpu launch): in memory, or to NBGPU_MEM_DIR."""

import json
import subprocess
import sys

SCRIPT = """
import json
import nbgpu
with nbgpu.phase("load"):
    data = bytearray(80 << 20)
nbgpu.phase.mark("POST-LOAD")
report = nbgpu.phase.report()
print(report.text())
print("JSON", json.dumps(report.to_dict()))
"""


def run(env):
    return subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=60,
        check=True,
    )  # fmt: skip


def test_a_plain_script_reports_its_phases(sim_env):
    out = run(sim_env)
    assert "memory of this process" in out.stdout
    (line,) = (x for x in out.stdout.splitlines() if x.startswith("JSON "))
    (load,) = json.loads(line[5:])["phases"]
    assert (load["phase"], load["status"]) == ("load", "done")
    # The phase holds the 80 MiB it allocates (bytearray writes its zeros: the pages are
    # touched), and not much more.
    grown = load["rss_end_bytes"] - load["rss_start_bytes"]
    assert 80 << 20 <= grown < 96 << 20, grown
    assert load["peak_rss_bytes"] >= load["rss_end_bytes"]


def test_a_plain_script_writes_records_where_told(sim_env, tmp_path):
    run({**sim_env, "NBGPU_MEM_DIR": str(tmp_path)})
    files = list(tmp_path.glob("mem-pid*.jsonl"))
    assert len(files) == 1
    text = files[0].read_text()
    assert '"phase":"load"' in text
    assert '"name":"POST-LOAD"' in text
