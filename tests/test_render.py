"""nbgpu._render: one renderer for fix text, tables that stay left-aligned, SIMULATED frames."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import nbformat
import pytest
from nbconvert import HTMLExporter

import nbgpu
from nbgpu._render import (
    COLOURS,
    ROW_BACKGROUNDS,
    Bullets,
    Cell,
    Line,
    Problems,
    Table,
    Title,
    fix_html,
    memory_bar_html,
    to_html,
    to_text,
)
from nbgpu.problems import Problem


def test_fix_html_shows_backticks_as_code_and_escapes_the_rest():
    assert fix_html("run `nbgpu clean` <now>") == "run <code>nbgpu clean</code> &lt;now&gt;"
    # An unpaired backtick is text, never an unclosed <code>.
    assert fix_html("it's `odd") == "it's `odd"
    assert fix_html("`a` and `b<c>`") == "<code>a</code> and <code>b&lt;c&gt;</code>"


class _Cells(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.cells: list[dict[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("td", "th"):
            self.cells.append(dict(attrs))


def test_every_table_cell_is_left_aligned_inline():
    # Inline: beats JupyterLab's `:not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon td`
    # (specificity 0,2,1) and any other stylesheet (VS Code, nbviewer) without !important.
    table = Table(["name", "state"])
    table.add("rank0", "ok")
    parser = _Cells()
    parser.feed(table.html())
    assert len(parser.cells) == 4
    assert all("text-align:left" in (cell.get("style") or "") for cell in parser.cells)


@pytest.fixture(autouse=True)
def busy_gpu0(monkeypatch):
    monkeypatch.setenv("NBGPU_SIMULATE", "busy-gpu0")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_plan_alternatives_numbered_once_with_their_steps_nested():
    plan = nbgpu.plan("sglang.d1t1p1+d3t1p1", global_batch=8)
    body = plan.html_body()
    alternatives = body[body.index("<div>alternatives:</div>") :]
    # One section per alternative, its number written once; its fix steps are a list
    # inside that section, not alternatives of their own.
    sections = alternatives.split('<div style="border-left')[1:]
    assert len(sections) == len(plan.alternatives) == 2
    for n, section in enumerate(sections, 1):
        assert re.search(rf">{n}\. ", section)
    assert not re.search(r"<li[^>]*>\s*\d+\.", alternatives), "numbered twice"
    steps = sections[1][sections[1].index("<ul") :]
    assert "<code>sudo nvidia-smi --gpu-reset -i 0</code>" in steps
    assert "`" not in body
    # The batch fix of the problems list renders the same way.
    assert "global_batch=6" in body


def test_doctor_plan_and_run_summaries_share_the_renderer():
    doctor = nbgpu.doctor()
    assert "<code>" in doctor.html_body()
    assert "`" not in doctor.html_body()


def test_frames_of_a_simulated_fleet_say_so():
    frame = nbgpu.status().to_frame()
    assert frame.attrs["nbgpu_simulated"] == "busy-gpu0"
    for shown in (frame, frame.filter(items=["nvml_index", "name"]), frame[["name"]]):
        assert "SIMULATED fleet 'busy-gpu0'" in repr(shown)
        assert "SIMULATED fleet 'busy-gpu0'" in shown._repr_html_()
    plan_frame = nbgpu.plan("d2t1p1").to_frame()
    assert "SIMULATED" in repr(plan_frame)


def test_frames_of_real_results_carry_no_marker():
    inventory = nbgpu.status()
    real = type(inventory)(**{**inventory.__dict__, "simulated": False})
    frame = real.to_frame()
    assert "nbgpu_simulated" not in frame.attrs
    assert "SIMULATED" not in repr(frame)


def test_marker_survives_row_filters():
    frame = nbgpu.status().to_frame()
    assert "SIMULATED" in repr(frame[frame["nvml_index"] > 0])


def test_memory_bar_is_text_that_survives_any_renderer():
    gib = 1024**3
    bar = memory_bar_html(28 * gib, 80 * gib)
    assert bar is not None
    assert bar.count("█") == 4  # 35 % of ten cells, rounded
    assert bar.count("░") == 6
    assert bar.endswith("28.0/80.0 GiB")
    assert memory_bar_html(1, 80 * gib).count("█") == 1  # anything on it shows
    assert memory_bar_html(79 * gib, 80 * gib).count("░") == 0
    assert memory_bar_html(None, 80 * gib) is None
    assert memory_bar_html(5, 0) is None


def test_status_and_doctor_html_show_memory_bars_that_nbconvert_keeps(sim_env):
    env = {**sim_env, "NBGPU_SIMULATE": "nproc-mismatch"}
    status = nbgpu.status(environ=env)
    doctor = nbgpu.doctor(environ=env)
    for result in (status, doctor):
        html = result._repr_mimebundle_()["text/html"]
        assert html.count("████") >= 2  # GPUs 0 and 1 hold 28 of 80 GiB
        assert "█" not in result.text()  # terminals keep their 80 columns
    notebook = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("%gpu_status")
    cell.outputs = [nbformat.v4.new_output("display_data", data=status._repr_mimebundle_())]
    notebook.cells.append(cell)
    exported, _ = HTMLExporter().from_notebook_node(notebook)
    assert "████</span>" in exported
    assert "░░░░░░</span> 28.3/79.6 GiB" in exported


# -- one content, inline styles ------------------------------------------------------


class _Styled(HTMLParser):
    """Every element's tag, attributes and text, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, dict(attrs)))


def test_content_renders_text_and_inline_styled_html_from_the_same_blocks():
    table = Table(["GPU", "health"])
    table.add(0, Cell("BUSY", level="bad"), level="bad")
    table.add(1, "ok")
    blocks = [
        Title("nbgpu x — SIMULATED fleet 'f'", simulated=True),
        table,
        Line("use `nbgpu clean`", label="Fix"),
        Problems([Problem("bad", "busy", "GPU 0", "held by a dead pid", ("`nbgpu clean`",))]),
        Bullets(["one", "two"], ordered=True),
    ]
    text = to_text(blocks)
    assert text.splitlines()[0] == "nbgpu x — SIMULATED fleet 'f'"
    assert "0    BUSY" in text
    assert "Fix: use `nbgpu clean`" in text
    assert "[FIX]  GPU 0: held by a dead pid\n    -> `nbgpu clean`" in text
    assert "  1. one\n  2. two" in text
    page = to_html(blocks)
    assert "<style" not in page
    parser = _Styled()
    parser.feed(page)
    styles = [(tag, attrs.get("style") or "") for tag, attrs in parser.elements]
    sim = [s for tag, s in styles if tag == "span" and "font-weight:bold" in s]
    assert sim, "SIMULATED is marked with an inline style"
    bad_cells = [s for tag, s in styles if tag == "td" and ROW_BACKGROUNDS["bad"] in s]
    assert len(bad_cells) == 2  # the busy row, each of its cells
    assert any(COLOURS["bad"] in s for tag, s in styles if tag == "li")
    assert "<code>nbgpu clean</code>" in page


def test_doctor_html_on_an_untrusted_page_keeps_its_colours():
    # Untrusted output loses every <style> block: the colours must live on the elements.
    report = nbgpu.doctor(probe=True)
    page = report.html()
    assert "<style" not in page
    parser = _Styled()
    parser.feed(page)
    busy_rows = [
        attrs for tag, attrs in parser.elements
        if tag == "td" and ROW_BACKGROUNDS["bad"] in (attrs.get("style") or "")
    ]  # fmt: skip
    assert busy_rows, "GPU 0's row is marked bad inline"
    assert report.text() in str(report)


def test_a_number_and_its_unit_never_wrap_apart():
    # Issue 23: an estimate's "154.8 GiB" wrapped into "154.8 / GiB" beside a long formula.
    table = Table(["term", "per GPU", "formula"])
    table.add("activations", "154.8 GiB", "L·[10·sbh + (2·sbh + 4·sb·kv·hd + 2·sbh + 8·s·b·I)]")
    cells = re.findall(r"<td style=\"([^\"]*)\">([^<]*)</td>", table.html())
    nowrap = {text for style, text in cells if "white-space:nowrap" in style}
    assert nowrap == {"154.8 GiB"}
