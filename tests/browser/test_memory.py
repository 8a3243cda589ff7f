"""The %gpu_memory figure in a real JupyterLab (headless Chromium): a 2-rank run's memory
drawn as a PNG in the cell, next to its phase x rank table."""

from __future__ import annotations

import base64
import secrets

import pytest

from tests.browser.helpers import write_notebook

pytestmark = [pytest.mark.slow, pytest.mark.browser]

CELL = """%%torchrun 2 --name {name}
import nbgpu
with nbgpu.phase("model"):
    weights = bytearray(200 << 20)
print("loaded", flush=True)
"""


def test_gpu_memory_figure_renders(lab, lab_page, shots_dir):
    name = f"mem-{secrets.token_hex(3)}"
    write_notebook(
        lab.root / "memory.ipynb",
        ["%load_ext nbgpu", CELL.format(name=name), f"%gpu_memory {name}"],
    )
    lab_page.open("memory.ipynb")
    lab_page.run_all()
    lab_page.wait_for_cells(timeout_s=120)
    page = lab_page.page
    image = page.locator(".jp-OutputArea-output img").first
    image.wait_for(state="visible")
    box = image.bounding_box()
    assert box is not None
    assert box["width"] > 500, box
    assert box["height"] > 250, box
    # Really drawn: the browser decoded a PNG of the figure's size.
    size = page.evaluate(
        "(img) => [img.naturalWidth, img.naturalHeight, img.complete]", image.element_handle()
    )
    assert size[0] >= 900, size
    assert size[2], size
    src = image.get_attribute("src") or ""
    assert src.startswith("data:image/png;base64,")
    assert base64.b64decode(src.split(",", 1)[1])[:4] == b"\x89PNG"
    table = page.locator(".jp-OutputArea-output table.nbgpu-table").last
    text = table.text_content() or ""
    for phase in ("start", "imports", "run", "run > model", "exit"):
        assert phase in text, text
    image.scroll_into_view_if_needed()
    print(f"screenshot: {lab_page.screenshot(shots_dir / 'memory-figure.png')}")
