"""LiveView, the one saved form of every live view: a static face kept current, controls
that never outlive the view in the notebook, and the kernel's exit ending what is left."""

from __future__ import annotations

import time
from types import SimpleNamespace

import ipywidgets as w
from IPython.utils.capture import capture_output

from nbgpu.notebook import live
from nbgpu.notebook.live import LiveView
from nbgpu.notebook.plan_widget import PlanWidget

WIDGET = "application/vnd.jupyter.widget-view+json"


def test_the_face_is_static_and_its_last_change_always_lands(ip):  # noqa: ARG001  (a shell to display in)
    state = {"n": 0}

    def face() -> dict[str, str]:
        return {"text/plain": f"n={state['n']}", "text/html": f"<b>n={state['n']}</b>"}

    with capture_output() as shown:
        view = LiveView(face, controls=w.Button(description="Stop"), interval_s=0.2)
        for n in range(1, 6):  # five changes within one interval...
            state["n"] = n
            view.refresh()
        time.sleep(0.5)  # ...reach the front end as one update, the last
        view.refresh()  # nothing changed since: nothing is sent
    controls, *faces = (o.data for o in shown.outputs)
    assert WIDGET in controls
    assert controls["text/plain"] == ""  # no "Button(...)" repr where widgets do not render
    assert [f["text/plain"] for f in faces] == ["n=0", "n=5"]
    assert all(WIDGET not in f for f in faces)
    assert view.updates == 1

    with capture_output() as shown:
        view.end({"text/plain": "final", "text/html": "<b>final</b>"})
        view.refresh()
        view.end()
    # The face shows the final state; the controls' output is emptied: a notebook saved
    # now holds nothing that needs the widget's model.
    assert [o.data for o in shown.outputs] == [
        {"text/plain": ""},
        {"text/plain": "final", "text/html": "<b>final</b>"},
    ]
    assert view not in live._VIEWS


def test_the_kernels_exit_ends_every_live_view(ip, monkeypatch):  # noqa: ARG001
    monkeypatch.setattr(LiveView, "publish", True)
    monkeypatch.setattr("IPython.get_ipython", lambda: SimpleNamespace(kernel=object()))
    calls = []
    button = w.Button(description="Stop")
    with capture_output() as shown:
        plain = LiveView(lambda: {"text/plain": "a"}, controls=button)
        owned = LiveView(lambda: {"text/plain": "b"}, on_exit=lambda: calls.append("b"))
        live._end_all()
    assert plain.ended
    assert calls == ["b"]  # the owner decides (a dashboard stops its sampling first)
    assert {"text/plain": ""} in [o.data for o in shown.outputs]
    assert button.comm is None  # closed: an open page hides it
    owned.end()


def test_plan_widget_face_follows_the_controls(ip):  # noqa: ARG001  (busy-gpu0)
    with capture_output() as shown:
        widget = PlanWidget({}, {"allocation": "sglang.d1t1p1+d3t1p1"}).show()
        widget.controls["allocation"].value = "sglang.d1t1p1+d2t1p1"
        time.sleep(0.3)
    face = shown.outputs[-1].data
    assert WIDGET not in face
    assert "d2t1p1" in face["text/plain"]
    assert face == widget.record()
