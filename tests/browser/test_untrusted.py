"""Every shipped tutorial opened untrusted in a real JupyterLab (headless Chromium): the
colours nbgpu's results carry survive the sanitizer.

An untrusted notebook (every tutorial on a fresh checkout, any notebook a colleague
sends) has its HTML sanitized: ``<style>`` blocks go, inline ``style`` attributes with
hex colours stay. The test reads the *computed* style of what a reader looks at: the
background of a problem row's cells and the SIMULATED marking, and compares it with the
same colours applied to a probe element outside the notebook's outputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nbgpu._render import ROW_BACKGROUNDS, SIMULATED_COLOUR

pytestmark = [pytest.mark.slow, pytest.mark.browser]

TUTORIALS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
# What a problem row of each tutorial says (words of its cells), or None where the stored
# outputs have none. Each tutorial is named, so one that loses its problem row fails here.
PROBLEM_ROWS: dict[str, str | None] = {
    "busy-gpu.ipynb": "probe: busy",  # %gpu_doctor: GPU 0, its dead exclusive holder
    "import-storm.ipynb": "SIGKILL",  # %gpu_diagnose: the rank the host's OOM killer took
    "launch.ipynb": "broken failed",  # %gpu_runs: the run that failed
    "nproc-mismatch.ipynb": "zombie",  # %gpu_doctor: the zombie holder
    "quickstart.ipynb": "BUSY: dead holder",  # %gpu_status: GPU 0
    # Its outputs are the rescaled script and the table of changes (warnings, no problem).
    "rescale-verl-script.ipynb": None,
    "shared-sweeps.ipynb": "NO: GPUs in use",  # %gpu_plan --sweep: the run left without GPUs
}
# Tutorials whose HTML outputs have no SIMULATED marking (their stream lines say it). The
# test fails once one gets a marking, so the entry goes when it is no longer true.
UNMARKED = {
    "rescale-verl-script.ipynb": "its HTML outputs never name the fleet",
}

_STYLES_JS = """([path, background, simulated]) => {
  const panel = Array.from(window.jupyterapp.shell.widgets('main'))
    .find(w => w.context && w.context.path === path);
  const trusted = panel.content.widgets
    .filter(c => c.model.type === 'code' && c.model.outputs.length > 0)
    .map(c => c.model.trusted);
  // The colours as Chromium computes them, on probes outside the outputs.
  const probe = (tag, style) => {
    const node = document.createElement(tag);
    node.setAttribute('style', style);
    document.body.appendChild(node);
    const computed = getComputedStyle(node);
    const out = {background: computed.backgroundColor, color: computed.color};
    node.remove();
    return out;
  };
  const bad = probe('div', 'background-color:' + background).background;
  const sim = probe('span', 'color:' + simulated).color;
  const outputs = Array.from(panel.node.querySelectorAll('.jp-OutputArea-output'));
  const rows = outputs.flatMap(o => Array.from(o.querySelectorAll('td')))
    .filter(td => getComputedStyle(td).backgroundColor === bad)
    .map(td => Array.from(td.closest('tr').cells).map(c => c.textContent).join(' '));
  const marks = outputs.flatMap(o => Array.from(o.querySelectorAll('*')))
    .filter(n => n.children.length === 0 && n.textContent === 'SIMULATED')
    .map(n => [getComputedStyle(n).color === sim, getComputedStyle(n).fontWeight]);
  return {trusted, bad, sim, rows, marks};
}"""


@pytest.mark.parametrize("tutorial", TUTORIALS, ids=lambda p: p.name)
def test_tutorial_untrusted_keeps_problem_rows_and_simulated_marking(lab, lab_page, tutorial):
    # A fresh copy in a fresh Jupyter data dir: its signature is unknown, so untrusted.
    (lab.root / tutorial.name).write_bytes(tutorial.read_bytes())
    lab_page.open(tutorial.name)
    found = lab_page.page.evaluate(
        _STYLES_JS, [tutorial.name, ROW_BACKGROUNDS["bad"], SIMULATED_COLOUR]
    )
    assert found["trusted"], f"{tutorial.name} has no stored outputs"
    assert not any(found["trusted"]), "the tutorial opened trusted: this test needs untrusted"
    assert found["bad"] not in ("", "rgba(0, 0, 0, 0)"), found["bad"]  # the probe is coloured
    # The SIMULATED marking: every one drawn in its colour, bold.
    assert bool(found["marks"]) != (tutorial.name in UNMARKED), (
        f"{tutorial.name}: SIMULATED markings {found['marks']}"
    )
    for same_colour, weight in found["marks"]:
        assert same_colour, f"{tutorial.name}: a SIMULATED marking lost its colour {found['sim']}"
        assert int(weight) >= 700, f"{tutorial.name}: a SIMULATED marking is not bold"
    expected = PROBLEM_ROWS[tutorial.name]
    if expected is None:
        assert not found["rows"], found["rows"]
    else:
        assert any(expected in row for row in found["rows"]), (
            f"{tutorial.name}: no row with a problem background ({found['bad']}) "
            f"says {expected!r}: {found['rows']}"
        )
