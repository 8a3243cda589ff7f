"""The saved form of live views in a real JupyterLab (headless Chromium): a notebook saved
while ``%gpu_watch`` samples and after ``%gpu_plan --widget`` was changed shows both
last states when reopened, never "Error displaying widget".

Each live view is a static face (HTML and text) plus an output of controls
(:mod:`nbgpu.notebook.live`). What each way of reopening shows, as measured here:
a new page while the kernel lives (a reload, a second window) finds the controls'
models and renders them; a kernel shut down from the page that ran the cells sends its
last updates there (the faces' final state, the controls emptied), so that page saves
static outputs only; nbconvert and an untrusted copy show the faces. The one case no
kernel can reach is a file saved mid-life whose kernel then ended with no page open: the
faces still show the last state, and JupyterLab's own widget renderer reports the
controls' missing model (unless its "save widget state" setting is on).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import nbformat
import pytest

from tests.browser.helpers import LabPage, wait_until, write_notebook

pytestmark = [pytest.mark.slow, pytest.mark.browser]

WIDGET = "application/vnd.jupyter.widget-view+json"
ERROR = "Error displaying widget"
CELLS = [
    "import os\nos.environ['NBGPU_SIMULATE'] = 'busy-gpu0'\n%load_ext nbgpu",
    "%gpu_watch --interval 0.5",
    "%gpu_plan sglang.d1t1p1+d3t1p1 --batch 8 --widget",
]
WATCH, PLAN = 1, 2  # code cell numbers
NEW_ALLOCATION = "sglang.d1t1p1+d2t1p1"

# The rendered text of each output (text nodes joined by spaces, so an SVG's labels stay
# apart) of each code cell: of the notebook at *path* in Lab, or of an nbconvert page.
_TEXT_JS = """const text = (node) => {
  const walk = document.createTreeWalker(node, NodeFilter.SHOW_TEXT);
  const parts = [];
  while (walk.nextNode()) parts.push(walk.currentNode.nodeValue);
  return parts.join(' ');
};
const outputs = (cell) => Array.from(cell.querySelectorAll('.jp-OutputArea-output')).map(text);
"""
_OUTPUTS_JS = f"""(path) => {{ {_TEXT_JS}
  const panel = Array.from(window.jupyterapp.shell.widgets('main'))
    .find(w => w.context && w.context.path === path);
  return panel.content.widgets.filter(c => c.model.type === 'code').map(c => outputs(c.node));
}}"""
_EXPORTED_JS = f"""() => {{ {_TEXT_JS}
  return Array.from(document.querySelectorAll('.jp-CodeCell')).map(outputs);
}}"""


def _outputs(page: LabPage) -> list[list[str]]:
    return list(page.page.evaluate(_OUTPUTS_JS, page.path))


def _samples(text: str) -> int:
    # The headline counts the samples (the charts are images).
    found = re.search(r"(\d+) samples", text)
    return int(found.group(1)) if found else 0


def _reopen(browser, lab, path: str) -> tuple[object, LabPage]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = LabPage(context.new_page(), lab)
    page.open(path)
    # Widget outputs say "Loading widget..." until the widget manager has asked the
    # kernel for its models; only then does a missing one turn into the error.
    wait_until(
        lambda: "Loading widget" not in json.dumps(_outputs(page)), 30, "the widgets to settle"
    )
    return context, page


def _faces_show_the_last_state(outputs: list[list[str]], samples: int, state: str) -> None:
    watch, plan = outputs[WATCH][-1], outputs[PLAN][-1]
    assert f"nbgpu watch · {state}" in watch, watch[:300]
    assert _samples(watch) == samples, watch[:300]
    assert "(dead)" in watch  # the table of GPUs, not only a title
    assert f"nbgpu plan — {NEW_ALLOCATION}" in plan, plan[:300]
    assert "NOT READY" not in plan


def test_saved_while_live_reopens_with_both_last_states(lab, lab_page, browser, shots_dir):
    samples = _run_change_and_save(lab, lab_page)
    shutil.copy(lab.root / "live.ipynb", lab.root / "mid-life.ipynb")
    _reopen_while_the_kernel_lives(browser, lab, samples, shots_dir)
    _shut_down_save_and_reopen(browser, lab, lab_page, shots_dir)
    _mid_life_exported(browser, lab, samples)
    _mid_life_reopened(browser, lab, samples, shots_dir)


def _run_change_and_save(lab, lab_page: LabPage) -> int:
    """Run the cells, change the plan through its controls, save while the watch samples."""
    write_notebook(lab.root / "live.ipynb", CELLS)
    lab_page.open("live.ipynb")
    lab_page.run_all()
    lab_page.wait_for_cells(timeout_s=60)
    page = lab_page.page
    wait_until(lambda: _samples(_outputs(lab_page)[WATCH][-1]) >= 3, 30, "three samples drawn")
    allocation = page.locator(".widget-text input").first
    allocation.fill(NEW_ALLOCATION)
    allocation.press("Enter")
    wait_until(
        lambda: f"nbgpu plan — {NEW_ALLOCATION}" in _outputs(lab_page)[PLAN][-1],
        30,
        "the plan's face to follow the control",
    )
    lab_page.save()  # the dashboard is still sampling
    saved = nbformat.read(lab.root / "live.ipynb", as_version=4)
    code = [cell for cell in saved.cells if cell.cell_type == "code"]
    for number in (WATCH, PLAN):
        controls, face = code[number].outputs
        assert WIDGET in controls.data  # the controls: live only with their kernel
        assert WIDGET not in face.data  # the face: static, readable anywhere
    assert code[WATCH].outputs[-1].data["text/plain"].startswith("nbgpu watch · live")
    samples = _samples(code[WATCH].outputs[-1].data["text/plain"])
    assert samples >= 3
    return samples


def _reopen_while_the_kernel_lives(browser, lab, samples: int, shots_dir) -> None:
    """A new page while the kernel lives (a reload, a second window): the saved faces,
    and the controls live again (their models are still in the kernel)."""
    context, reopened = _reopen(browser, lab, "live.ipynb")
    try:
        outputs = _outputs(reopened)
        _faces_show_the_last_state(outputs, samples, "live")
        assert ERROR not in json.dumps(outputs)
        assert reopened.page.get_by_role("button", name="Stop").is_visible()
        values = reopened.page.eval_on_selector_all(
            ".widget-text input", "els => els.map(e => e.value)"
        )
        assert NEW_ALLOCATION in values
        print(f"screenshot: {reopened.screenshot(shots_dir / 'saved-form-kernel-alive.png')}")
    finally:
        context.close()


def _shut_down_save_and_reopen(browser, lab, lab_page: LabPage, shots_dir) -> None:
    """Kernel ▸ Shut Down in the page that ran the cells: the kernel's last updates end
    both views there (final faces, controls emptied); saved, reopened with a new kernel."""
    page = lab_page.page
    page.evaluate(
        "async () => { await window.jupyterapp.commands.execute('kernelmenu:shutdown'); }"
    )
    wait_until(
        lambda: "nbgpu watch · stopped" in _outputs(lab_page)[WATCH][-1],
        30,
        "the dashboard's final face after the kernel's exit",
    )
    wait_until(
        lambda: page.locator(".jp-OutputArea-output .jupyter-widgets").count() == 0,
        30,
        "the controls to be emptied",
    )
    final_samples = _samples(_outputs(lab_page)[WATCH][-1])
    lab_page.save()
    assert WIDGET not in (lab.root / "live.ipynb").read_text(encoding="utf-8")
    context, reopened = _reopen(browser, lab, "live.ipynb")
    try:
        outputs = _outputs(reopened)
        _faces_show_the_last_state(outputs, final_samples, "stopped")
        assert ERROR not in json.dumps(outputs)
        print(f"screenshot: {reopened.screenshot(shots_dir / 'saved-form-kernel-gone.png')}")
        reopened.shutdown_kernels()
    finally:
        context.close()


def _mid_life_exported(browser, lab, samples: int) -> None:
    """The file saved mid-life, as nbconvert exports it: both last states, not a title."""
    subprocess.run(
        [sys.executable, "-m", "nbconvert", "--to", "html", "mid-life.ipynb"],
        cwd=lab.root,
        check=True,
        capture_output=True,
        timeout=120,
    )
    # A context of its own: with Lab pages beside it, closing it hung (its CDN scripts
    # never load here).
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    try:
        static = context.new_page()
        static.goto((lab.root / "mid-life.html").as_uri())
        exported = static.evaluate(_EXPORTED_JS)
        _faces_show_the_last_state(exported, samples, "live")
        assert static.locator(".jp-OutputArea-output img[alt='utilisation %']").count() == 1
        assert ERROR not in json.dumps(exported)
    finally:
        context.close()


def _mid_life_reopened(browser, lab, samples: int, shots_dir) -> None:
    """The file saved mid-life, copied (untrusted), and itself reopened with a new kernel
    and no page that saw it live."""
    data = json.loads((lab.root / "mid-life.ipynb").read_text(encoding="utf-8"))
    data["metadata"]["copied"] = True  # another file: its signature is unknown here
    (lab.root / "copy.ipynb").write_text(json.dumps(data), encoding="utf-8")
    context, copy = _reopen(browser, lab, "copy.ipynb")
    try:
        outputs = _outputs(copy)
        _faces_show_the_last_state(outputs, samples, "live")
        assert ERROR not in json.dumps(outputs)
        copy.shutdown_kernels()
    finally:
        context.close()

    # The limit: trusted, a new kernel, no page that saw it live. The faces still show
    # the last state; only the controls' own output carries JupyterLab's error (nothing
    # in the kernel can reach a page that was closed).
    context, trusted = _reopen(browser, lab, "mid-life.ipynb")
    try:
        outputs = _outputs(trusted)
        _faces_show_the_last_state(outputs, samples, "live")
        for number in (WATCH, PLAN):
            assert ERROR not in outputs[number][-1]
        print(f"screenshot: {trusted.screenshot(shots_dir / 'saved-form-limit.png')}")
        trusted.shutdown_kernels()
    finally:
        context.close()


def test_the_live_memory_line_leaves_nothing_in_the_saved_stream(lab, lab_page):
    # A foreground run keeps the node's memory on one line under its output, rewritten in
    # place; JupyterLab applies the rewrites to the text it saves, so whatever erases the
    # line must leave no padding spaces and no blank line behind (issue 23).
    cells = [
        CELLS[0],
        "%%torchrun 2\nimport time\nfor i in range(6):\n    print('step', i, flush=True)\n    time.sleep(0.7)",
    ]
    write_notebook(lab.root / "stream.ipynb", cells)
    lab_page.open("stream.ipynb")
    lab_page.run_all()
    wait_until(lambda: "mem: node" in lab_page.outputs_text(), 60, "the live memory line")
    lab_page.wait_for_cells(timeout_s=120)
    lab_page.save()
    saved = nbformat.read(lab.root / "stream.ipynb", as_version=4)
    text = "".join(o.text for o in saved.cells[1].outputs if o.output_type == "stream")
    lines = text.split("\n")
    assert "step 5" in text
    assert "mem:" not in text
    assert [line for line in lines if line != line.rstrip()] == []
    assert [n for n, line in enumerate(lines[:-1]) if not line.strip()] == []
