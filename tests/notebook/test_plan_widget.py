"""%gpu_plan --widget: the plan follows the controls; an impossible combination is a visible
invalid state, never a traceback; the launch line launches what is on screen."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from nbgpu.notebook.plan_widget import PlanWidget, plan_inputs


def test_inputs_map_unset_values_to_none():
    assert plan_inputs({"allocation": " ", "global_batch": 0, "micro_batch": 2}) == {
        "allocation": None,
        "exclude": None,
        "global_batch": None,
        "micro_batch": 2,
        "grad_accum": None,
        "seq_len": None,
        "strategy": "ddp",
        "model": None,
    }


def test_widget_replans_on_every_change(monkeypatch):
    monkeypatch.setenv("NBGPU_SIMULATE", "busy-gpu0")
    ns: dict = {}
    w = PlanWidget(ns, {"allocation": "sglang.d1t1p1+d3t1p1", "global_batch": 8})
    assert w.plan is not None
    assert not w.plan.ok  # 4 GPUs asked, 3 usable; batch 8 on 3 trainers
    assert ns["p"] is w.plan
    assert "NOT READY" in w.status.value
    w.controls["allocation"].value = "sglang.d1t1p1+d2t1p1"
    assert w.plan.ok
    assert ns["p"] is w.plan  # the launch line launches what is on screen
    assert w.launch.value == "%%torchrun --plan p --role train"
    assert "ready" in w.status.value
    w.controls["model"].value = "1B"  # now the memory table is part of the plan
    ddp = w.plan.text()
    before = w.updates
    w.controls["strategy"].value = "zero2"
    assert w.updates == before + 1
    assert "zero2" in w.plan.text()
    assert w.plan.text() != ddp
    record = w.record()
    assert "launch: %%torchrun --plan p --role train" in record["text/plain"]
    assert "<table" in record["text/html"]


def test_impossible_combination_is_an_invalid_state_not_a_traceback(monkeypatch):
    monkeypatch.setenv("NBGPU_SIMULATE", "busy-gpu0")
    ns: dict = {}
    w = PlanWidget(ns, {"allocation": "d2"})
    good = w.plan
    w.controls["allocation"].value = "banana"
    assert w.plan is None
    assert w.error is not None
    assert "banana" in w.error
    assert "invalid" in w.status.value
    assert w.launch.value == ""
    assert ns["p"] is good  # the last valid plan is not replaced by nothing
    w.controls["allocation"].value = "d2"
    assert w.plan is not None
    assert w.error is None


def test_magic_opens_the_widget_with_the_flags_as_first_values(ip):
    with capture_output() as shown:
        assert ip.run_line_magic("gpu_plan", "d3 --batch 6 --widget") is None
    plan = ip.user_ns["p"]
    assert plan.ok
    assert plan.roles[0].nproc_per_node == 3
    # The controls, then the plan as static HTML: what a saved notebook keeps.
    controls, face = (o.data for o in shown.outputs)
    assert "application/vnd.jupyter.widget-view+json" in controls
    assert "application/vnd.jupyter.widget-view+json" not in face
    assert "launch: %%torchrun --plan p --role train" in face["text/plain"]
    assert "<style" not in face["text/html"]


def test_every_flag_reaches_the_widget_or_is_refused(ip):
    # Issue 23: --seq-len, --max-micro and --exclude were dropped (activations "? needs
    # seq_len" for a model and a sequence length that were given).
    line = "d2 --model Qwen/Qwen2.5-7B-Instruct --seq-len 2048 --batch 64 --max-micro 4"
    with capture_output():
        ip.run_line_magic("gpu_plan", f"{line} --exclude 3 --fleet 4xA40 --widget")
    shown = ip.user_ns["p"]
    with capture_output():
        flags = ip.run_line_magic("gpu_plan", f"{line} --exclude 3 --fleet 4xA40")
    assert shown.text() == flags.text()  # the widget's first plan is the flags' plan
    assert "needs seq_len" not in shown.text()
    assert "GPU 3" not in shown.text().split("left out")[0]
    for other in ("--scale run.sh --to 4", "--sweep 2", "--json", "--slurm", "-o x.yaml"):
        with pytest.raises(
            UsageError, match=r"^%gpu_plan --widget plans one box: drop --widget to use -[-\w, ]+$"
        ):
            ip.run_line_magic("gpu_plan", f"d2 {other} --widget")


def test_the_sequence_length_is_a_control(monkeypatch):
    monkeypatch.setenv("NBGPU_SIMULATE", "busy-gpu0")
    w = PlanWidget({}, {"allocation": "d2", "model": "Qwen/Qwen2.5-7B-Instruct", "micro_batch": 1})
    assert "needs seq_len" in w.plan.text()
    w.controls["seq_len"].value = 2048
    assert "needs seq_len" not in w.plan.text()
    assert "seq 2048" in w.plan.text()
