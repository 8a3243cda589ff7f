"""%gpu_plan in a real IPython InteractiveShell: sweeps on a shared box, launch scripts."""

import json
from pathlib import Path

import pytest
from IPython.core.error import UsageError

from nbgpu.devices.inventory import take_inventory
from nbgpu.plan import NodesPlan, ScalePlan, SweepPlan

VAGEN = Path(__file__).parents[1] / "scale" / "configs" / "vagen_2gpu.sh"


@pytest.fixture
def fleet():
    return "shared-sweeps"  # an 8-GPU node whose GPUs 0-3 run two other sweeps at 97 %


def test_sweep_on_gpus_in_use_is_not_ready_and_says_how_many_fit(ip):
    result = ip.run_line_magic("gpu_plan", "--sweep 4 --per-run 2")
    assert isinstance(result, SweepPlan)
    assert not result.ok
    assert result.runs_ready == 2
    html = result._repr_mimebundle_()["text/html"]
    assert "NOT READY" in html
    assert "2 of 4 runs fit on free GPUs now" in html
    assert html.count("NO: GPUs in use") == 2


def test_sweep_that_shares_is_ready(ip):
    result = ip.run_line_magic("gpu_plan", "--sweep 4 --per-run 2 --share")
    assert result.ok
    assert result.runs_ready == 4


def test_scale_a_launch_script_and_write_it(ip, tmp_path):
    out = tmp_path / "run_8gpu.sh"
    result = ip.run_line_magic("gpu_plan", f"--scale {VAGEN} --to 8 --output {out}")
    assert isinstance(result, ScalePlan)
    assert result.written_to == str(out)
    assert "trainer.n_gpus_per_node=$N_GPUS" in out.read_text()
    assert "N_GPUS=${N_GPUS:-8}" in out.read_text()


def test_a_plan_across_a_cluster_file(ip, tmp_path):
    nodes = [
        {"node": n, **take_inventory({"NBGPU_SIMULATE": s}, scan_device_files=False).to_dict()}
        for n, s in (("n1", "2xA40,busy=0"), ("n2", "2xA40"))
    ]
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"source": "allocation 5", "nodes": nodes}))
    plan = ip.run_line_magic("gpu_plan", f"--fleet {path} --batch 4")
    assert isinstance(plan, NodesPlan)
    assert plan.node_gpus == {"n2": "0,1"}  # n1 has one usable GPU: one node of 2 ranks
    with pytest.raises(UsageError, match=r"--widget plans one box: drop --widget to use --slurm$"):
        ip.run_line_magic("gpu_plan", "--slurm --widget")
