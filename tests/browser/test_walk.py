"""A new user's path through JupyterLab (headless Chromium), one notebook: status, doctor,
the live dashboard, a streaming run, a background run's panel, warm ranks, a failure and
the memory figure. Each step's cell is saved as a screenshot in the test's output folder
for a reviewer to look at; what each step must show is checked where the page shows it."""

from __future__ import annotations

import pytest

from tests.browser.helpers import wait_until, write_notebook

pytestmark = [pytest.mark.slow, pytest.mark.browser]

STREAM = "import time\nfor i in range(3):\n    print('step', i, flush=True)\n    time.sleep(0.3)"
STEPS = {
    "setup": 'import nbgpu\n\nnbgpu.simulate("busy-gpu0")\n%load_ext nbgpu',
    "status": "%gpu_status",
    "doctor": "%gpu_doctor",
    "dashboard": "%gpu_watch --interval 0.5",
    # rank0 prints first here, rank1 first in "warm-cell": a colour by order would differ.
    "stream": f"%%torchrun 2\nimport os, time\ntime.sleep(0.3 * (os.environ['RANK'] == '1'))\n{STREAM}",
    "background": f"%%torchrun 2 --bg --name walk-bg\n{STREAM}",
    "warm": "%%torchrun 2 --keep --name walk-w\nx = 41",
    "warm-cell": "%%torchrun --on walk-w\nimport os, time\n"
    "time.sleep(0.3 * (os.environ['RANK'] == '0'))\nprint('x is', x + 1, flush=True)",
    "failure": "try:\n    nbgpu.torchrun(\"raise ValueError('boom')\", 2, name='walk-fail')\n"
    "except nbgpu.errors.NbgpuError as failed:\n    print(failed)",
    "stop": "nbgpu.runs()['walk-bg'].wait()\n%gpu_stop walk-w",
    "memory": "%gpu_memory walk-bg",
}

# The computed colour of each "[rankN]" prefix in one code cell's outputs.
_PREFIX_COLOURS_JS = """(index) => {
  const cell = document.querySelectorAll('.jp-Notebook .jp-CodeCell')[index];
  const out = {};
  for (const el of cell.querySelectorAll('.jp-OutputArea-output span')) {
    const m = /^\\[(rank\\d+)\\]$/.exec(el.textContent.trim());
    if (m) out[m[1]] = getComputedStyle(el).color;
  }
  return out;
}"""


def test_a_new_users_path_step_by_step(lab, lab_page, shots_dir):
    write_notebook(lab.root / "walk.ipynb", list(STEPS.values()))
    lab_page.open("walk.ipynb")
    lab_page.run_all()
    lab_page.wait_for_cells(timeout_s=150)
    page = lab_page.page
    cells = page.locator(".jp-Notebook .jp-CodeCell")
    index = {name: i for i, name in enumerate(STEPS)}
    wait_until(lambda: "walk-bg" in (cells.nth(index["background"]).text_content() or ""), 30, "bg")
    for name, i in index.items():
        cell = cells.nth(i)
        cell.scroll_into_view_if_needed()
        cell.screenshot(path=str(shots_dir / f"walk-{i:02d}-{name}.png"))
    print(f"screenshots: {shots_dir}/walk-*.png")
    text = {name: cells.nth(i).text_content() or "" for name, i in index.items()}
    assert "SIMULATED" in text["status"]
    assert "GPU 0" in text["doctor"]
    assert "step 2" in text["stream"]
    assert "ok on 2 ranks" in text["warm-cell"]
    assert "x is 42" in text["warm-cell"]
    assert "ValueError" in text["failure"]
    assert "Error displaying widget" not in page.content()
    # A rank keeps its colour from cell to cell, whoever printed first (issue 23).
    first = page.evaluate(_PREFIX_COLOURS_JS, index["stream"])
    second = page.evaluate(_PREFIX_COLOURS_JS, index["warm-cell"])
    assert set(first) == set(second) == {"rank0", "rank1"}, (first, second)
    assert first == second
    assert first["rank0"] != first["rank1"]
