"""%gpu_plan --widget in a real JupyterLab (headless Chromium): changing a control redraws
the plan (the static face under the controls), and the launch line follows."""

from __future__ import annotations

import pytest

from tests.browser.helpers import wait_until, write_notebook

pytestmark = [pytest.mark.slow, pytest.mark.browser]


def test_plan_widget_reacts_to_a_control_change(lab, lab_page, shots_dir):
    write_notebook(
        lab.root / "plan.ipynb",
        [
            "import os\nos.environ['NBGPU_SIMULATE'] = 'busy-gpu0'\n%load_ext nbgpu",
            "%gpu_plan sglang.d1t1p1+d3t1p1 --batch 8 --widget",
        ],
    )
    lab_page.open("plan.ipynb")
    lab_page.run_all()
    lab_page.wait_for_cells(timeout_s=60)
    page = lab_page.page
    output = page.locator(".jp-OutputArea-output").last
    wait_until(lambda: "NOT READY" in (output.text_content() or ""), 30, "the first plan")
    allocation = page.locator(".widget-text input").first
    allocation.fill("sglang.d1t1p1+d2t1p1")
    allocation.press("Enter")

    def face() -> str:
        return page.locator(".jp-OutputArea-output").last.text_content() or ""

    wait_until(
        lambda: "sglang.d1t1p1+d2t1p1" in face() and "NOT READY" not in face(),
        30,
        "the plan to follow the new allocation",
    )
    assert "ready · kept as p" in lab_page.outputs_text()
    values = page.eval_on_selector_all(".widget-text input", "els => els.map(e => e.value)")
    assert "%%torchrun --plan p --role train" in values, values
    text = lab_page.outputs_text()
    assert "Error displaying widget" not in text
    print(f"screenshot: {lab_page.screenshot(shots_dir / 'plan-widget.png')}")
