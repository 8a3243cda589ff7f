"""%gpu_watch in a real JupyterLab (headless Chromium): the dashboard draws, updates,
stops its sampling on the Stop button, and leaves a readable record."""

from __future__ import annotations

import re
import time

import pytest

from tests.browser.helpers import wait_until, write_notebook

pytestmark = [pytest.mark.slow, pytest.mark.browser]


def test_dashboard_updates_and_stop_ends_sampling(lab, lab_page, shots_dir):
    write_notebook(
        lab.root / "watch.ipynb",
        [
            "import os\nos.environ['NBGPU_SIMULATE'] = '4xA40,load=4'\n%load_ext nbgpu",
            "%gpu_watch --interval 0.5 --history 50",
        ],
    )
    lab_page.open("watch.ipynb")
    lab_page.run_all()
    lab_page.wait_for_cells(timeout_s=60)
    page = lab_page.page
    chart = page.locator(".jp-OutputArea-output img[alt='utilisation %']").first
    chart.wait_for(state="visible", timeout=30_000)

    def samples_drawn() -> int:
        text = page.locator(".jp-OutputArea-output").last.text_content() or ""
        found = re.search(r"(\d+) samples", text)
        return int(found.group(1)) if found else 0

    first = wait_until(lambda: samples_drawn() or None, 30, "a first sample on screen")
    utils_before = page.locator(".jp-OutputArea-output table.nbgpu-table").last.text_content()
    wait_until(lambda: samples_drawn() >= first + 3, 30, "the dashboard to update")
    utils_after = page.locator(".jp-OutputArea-output table.nbgpu-table").last.text_content()
    assert utils_before != utils_after  # two samples differ on screen (the load moves)
    print(f"screenshot: {lab_page.screenshot(shots_dir / 'watch-live.png')}")

    page.get_by_role("button", name="Stop").click()
    # The widget is replaced by the static record, which says it stopped...
    wait_until(
        lambda: (
            "nbgpu watch · stopped"
            in (page.locator(".jp-OutputArea-output").last.text_content() or "")
        ),
        30,
        "the stopped record",
    )
    stopped_at = samples_drawn()
    # ...and the sampler itself has stopped: its thread is gone and it takes no sample.
    ask = (
        "import threading, time\n"
        "from nbgpu.notebook.watch import DASHBOARDS\n"
        "w = DASHBOARDS[-1].watcher\n"
        "n = len(w.samples)\n"
        "time.sleep(2)\n"
        "alive = [t.name for t in threading.enumerate() if t.name == 'nbgpu-watch']\n"
        "print(w.stopped, alive, len(w.samples) - n)\n"
    )
    assert lab_page.kernel_print(ask).split() == ["True", "[]", "0"]
    assert samples_drawn() == stopped_at
    text = lab_page.outputs_text()
    assert "Error displaying widget" not in text
    assert "SIMULATED fleet '4xA40,load=4'" in text
    print(f"screenshot: {lab_page.screenshot(shots_dir / 'watch-stopped.png')}")


def test_clearing_the_output_stops_the_dashboard(lab, lab_page):
    write_notebook(
        lab.root / "watch-clear.ipynb",
        [
            "import os\nos.environ['NBGPU_SIMULATE'] = '4xA40,load=4'\n%load_ext nbgpu",
            "%gpu_watch --interval 0.5",
            (
                "from nbgpu.notebook import watch\n"
                "print('alive:', [d.watcher.alive for d in watch.DASHBOARDS], "
                "'cleared:', [d.cleared for d in watch.DASHBOARDS])"
            ),
        ],
    )
    lab_page.open("watch-clear.ipynb")
    lab_page.run_all()
    lab_page.wait_for_cells(timeout_s=60)
    page = lab_page.page
    page.locator(".jp-OutputArea-output img[alt='utilisation %']").first.wait_for(state="visible")
    # Edit > Clear Outputs of All Cells, as a user would.
    page.get_by_role("menuitem", name="Edit").click()
    page.get_by_text("Clear Outputs of All Cells").click()
    time.sleep(5)  # longer than the dashboard's grace for a re-render
    cells = page.locator(".jp-Notebook .jp-Cell")
    cells.last.click()
    page.keyboard.press("Shift+Enter")
    wait_until(
        lambda: "alive:" in (page.locator(".jp-OutputArea-output").last.text_content() or ""),
        30,
        "the check cell",
    )
    text = page.locator(".jp-OutputArea-output").last.text_content() or ""
    assert "alive: [False]" in text, text
    assert "cleared: [True]" in text, text
