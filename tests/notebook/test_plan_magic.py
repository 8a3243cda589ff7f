"""%gpu_plan in a real IPython InteractiveShell: sweeps on a shared box, launch scripts."""

from pathlib import Path

import pytest

from nbgpu.plan import ScalePlan, SweepPlan

VAGEN = Path(__file__).parents[1] / "plan" / "configs" / "vagen_2gpu.sh"


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
