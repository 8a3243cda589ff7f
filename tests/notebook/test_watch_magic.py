"""%gpu_watch in a real InteractiveShell: bad input, a live text view, widgets, stop."""

from __future__ import annotations

import time

import pytest
from IPython.core.error import UsageError

from nbgpu.devices.watch import Watcher
from nbgpu.notebook import watch
from nbgpu.notebook.watch import chart_svg, dashboard_html, dashboard_text
from tests.notebook.conftest import svg_images


@pytest.fixture
def fleet():
    return "8xH100,load=2,busy=0"


@pytest.fixture
def ip(ip):
    yield ip
    ip.run_line_magic("gpu_watch", "--stop")


def _wait(predicate, timeout=20.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("--interval 0", "--interval '0': expected seconds"),
        ("--interval -1", "--interval '-1'"),
        ("--interval abc", "--interval 'abc' is not a number"),
        ("--history 1000000000", "expected 2 to 86400"),
    ],
)
def test_bad_input_is_one_line_and_starts_nothing(ip, line, message):
    before = len(watch.DASHBOARDS)
    with pytest.raises(UsageError, match=message):
        ip.run_line_magic("gpu_watch", line)
    assert len(watch.DASHBOARDS) == before


def test_help(ip, capsys):
    ip.run_line_magic("gpu_watch", "-h")
    assert "%gpu_watch" in capsys.readouterr().out


@pytest.mark.parametrize("view", ["text", "widgets"])
def test_live_view_updates_and_stop_ends_the_thread(ip, view):
    ip.run_line_magic("gpu_watch", f"--view {view} --interval 0.2 --history 20")
    dashboard = watch.DASHBOARDS[-1]
    assert dashboard.widgets == (view == "widgets")
    _wait(lambda: dashboard.view.updates >= 3)
    samples = list(dashboard.watcher.samples)
    assert len({tuple(g.utilization_pct for g in s.gpus) for s in samples}) > 1
    if view == "widgets":
        assert "<polyline" in svg_images(dashboard.view.shown["text/html"])  # drawn live
        dashboard.pause_button.value = True
        assert dashboard.watcher.paused
        dashboard.pause_button.value = False
        dashboard.stop_button.click()
    else:
        ip.run_line_magic("gpu_watch", "--stop")
    assert not dashboard.watcher.alive
    count = len(dashboard.watcher.samples)
    time.sleep(0.6)
    assert len(dashboard.watcher.samples) == count  # no sampling once stopped


def test_static_record_shows_the_dead_holder_in_red(sim_env):
    w = Watcher(interval_s=1, history=5, environ={**sim_env, "NBGPU_SIMULATE": "busy-gpu0"})
    w.sample_now()
    samples = list(w.samples)
    page = dashboard_html(samples, "stopped")
    assert 'class="nbgpu-sim" style="color:#6c71c4;font-weight:bold">SIMULATED</span>' in page
    assert "fleet &#x27;busy-gpu0&#x27;" in page
    assert "<style" not in page
    assert "color:#c62828;font-weight:bold" in page  # GPU 0's dead holder
    assert "(dead)" in page
    assert "█" in page  # memory bars
    text = dashboard_text(samples, "stopped")
    assert text.splitlines()[0].startswith("nbgpu watch · stopped")
    assert "(dead)" in text
    assert chart_svg([], "util", "x").startswith("<svg")


def test_a_dashboard_nobody_sees_stops_sampling(ip, monkeypatch):
    monkeypatch.setattr(watch, "ORPHAN_GRACE_S", 0.2)
    ip.run_line_magic("gpu_watch", "--view widgets --interval 0.2 --history 20")
    dashboard = watch.DASHBOARDS[-1]
    # The front end reports its views: one shown, then a re-render (0 and back)...
    dashboard.controls._view_count = 1
    dashboard.controls._view_count = 0
    dashboard.controls._view_count = 1
    time.sleep(0.5)
    assert dashboard.watcher.alive  # a re-render is not a cleared output
    # ...then the output is cleared: no view comes back.
    dashboard.controls._view_count = 0
    _wait(lambda: not dashboard.watcher.alive)
    assert dashboard.cleared
