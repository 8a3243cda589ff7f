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


# Every control of the widget, its right edge, and whether its box or the Copy button
# overflow: what a reader sees cut off.
_LAYOUT_JS = """() => {
  const box = document.querySelector('.widget-vbox');
  const right = box.getBoundingClientRect().right;
  // A field is cut when it reaches past the box; a button when its label does not fit.
  const cut = Array.from(box.querySelectorAll('input, select, button'))
    .filter(e => e.getBoundingClientRect().right > right + 1 ||
                 (e.tagName === 'BUTTON' && e.scrollWidth > e.clientWidth + 1))
    .map(e => e.outerHTML.slice(0, 80));
  const area = box.closest('.jp-OutputArea-output');
  return {cut, boxOverflow: box.scrollWidth - box.clientWidth,
          areaOverflow: area.scrollWidth - area.clientWidth,
          copy: box.querySelector('button').innerText};
}"""


@pytest.mark.parametrize("width", [1000, 1600])
def test_plan_widget_layout_holds_with_a_wide_plan(lab, lab_page, shots_dir, width):
    # Issue 23: with a wide plan the controls got a horizontal scrollbar, fields were cut
    # off and Copy shrank to "…". Every flag's value reaches its control.
    line = "d2 --model Qwen/Qwen2.5-7B-Instruct --seq-len 2048 --batch 64 --max-micro 4 --widget"
    write_notebook(
        lab.root / f"wide{width}.ipynb",
        [
            "import os\nos.environ['NBGPU_SIMULATE'] = 'busy-gpu0'\n%load_ext nbgpu",
            f"%gpu_plan {line}",
        ],
    )
    lab_page.page.set_viewport_size({"width": width, "height": 1000})
    lab_page.open(f"wide{width}.ipynb")
    lab_page.run_all()
    lab_page.wait_for_cells(timeout_s=60)
    page = lab_page.page
    wait_until(lambda: "kept as p" in lab_page.outputs_text(), 30, "the first plan")
    print(f"screenshot: {lab_page.screenshot(shots_dir / f'plan-widget-{width}.png', full=True)}")
    _layout_holds(page)
    values = page.eval_on_selector_all(".widget-vbox input", "els => els.map(e => e.value)")
    assert "Qwen/Qwen2.5-7B-Instruct" in values, values
    assert "2048" in values, values
    assert "needs seq_len" not in lab_page.outputs_text()
    # An invalid allocation's long message stays inside the box too.
    allocation = page.locator(".widget-text input").first
    allocation.fill("sglang.d1t1p1+" * 12 + "banana")
    allocation.press("Enter")
    wait_until(lambda: "invalid" in lab_page.outputs_text(), 30, "the invalid state")
    print(f"screenshot: {lab_page.screenshot(shots_dir / f'plan-invalid-{width}.png', full=True)}")
    _layout_holds(page)


def _layout_holds(page) -> None:
    layout = page.evaluate(_LAYOUT_JS)
    assert layout["cut"] == [], layout
    assert layout["boxOverflow"] <= 0, layout
    assert layout["areaOverflow"] <= 0, layout
    assert layout["copy"].strip() == "Copy", layout
