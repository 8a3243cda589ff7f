"""One live view in a cell, and the one saved form every live view leaves.

What front ends do with a saved output (measured with JupyterLab 4.6, ipywidgets 8.1 and
Chromium; ``tests/browser/test_saved_form.py`` keeps it true):

- An output holding the widget-view mimetype shows "Error displaying widget: model not
  found" once its model is gone (a new kernel, the widget closed), even beside
  ``text/html``: a trusted notebook's widget renderer always wins (VS Code's too,
  vscode-jupyter#8635). Untrusted notebooks, nbconvert and GitHub show the ``text/html``.
- Updating an output that holds a widget re-renders it (a text field loses the cursor),
  so a static copy cannot ride along in the widget's own output.
- Display updates reach the page that saw the display, even while the kernel shuts down;
  a page opened later shows the output as saved.
- Untrusted notebooks keep inline ``style`` but strip inline ``<svg>`` (its labels left as
  a jumble of text); an ``<img>`` with an SVG data URI stays (:func:`svg_img`).

So a live view is two outputs. The *face*, ``text/html`` and ``text/plain`` behind a
display handle, is redrawn at most every ``interval_s`` (the last change always lands), so
a saved notebook holds the state as it was, readable everywhere. The optional *controls*
(ipywidgets) sit in their own output, emptied when the view ends and when the kernel
exits; their models stay open until then, so a page reopened meanwhile finds them.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import functools
import html
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Bundle", "LiveView", "svg_img"]

Bundle = dict[str, str]
#: What controls leave behind: nothing to read, nothing that can fail to render.
EMPTY: Bundle = {"text/plain": ""}

_VIEWS: list[LiveView] = []  # views not ended yet
_CONTROLS: list[Any] = []  # every controls widget, closed when the kernel exits


class LiveView:
    """A face kept current through a display handle, and controls above it. *face* is
    called from whichever thread refreshes; *on_exit* runs at the kernel's exit."""

    #: False once a process without a front end exits: its views end without a word.
    publish = True

    def __init__(
        self,
        face: Callable[[], Bundle],
        *,
        controls: Any = None,
        interval_s: float = 0.25,
        on_exit: Callable[[], None] | None = None,
    ) -> None:
        from IPython.display import display as _display  # noqa: PLC0415

        display: Callable[..., Any] = _display  # IPython carries no type hints
        self._face = face
        self.interval_s = interval_s
        self.on_exit = on_exit or self.end
        self._lock = threading.RLock()
        self._timer: threading.Timer | None = None
        self.ended = False
        self.updates = 0
        self._controls_handle = None
        if controls is not None:
            _CONTROLS.append(controls)
            bundle = {**controls._repr_mimebundle_(), **EMPTY}  # no "VBox(...)" repr
            self._controls_handle = display(bundle, raw=True, display_id=True)
        self.shown: Bundle = face()
        self._face_handle = display(self.shown, raw=True, display_id=True)
        self._last = time.monotonic()
        _VIEWS.append(self)
        _end_at_exit_once()

    def refresh(self, *, force: bool = False) -> None:
        """Redraw the face now, or at the end of the interval if one was just sent."""
        with self._lock:
            if self.ended:
                return
            wait = self._last + self.interval_s - time.monotonic()
            if wait > 0 and not force:
                if self._timer is None:
                    self._timer = threading.Timer(wait, self._trailing)
                    self._timer.daemon = True
                    self._timer.start()
                return
            self._send(self._face())

    def _trailing(self) -> None:
        with self._lock:
            self._timer = None
            self.refresh(force=True)

    def _send(self, bundle: Bundle) -> None:
        self._last = time.monotonic()
        if bundle != self.shown and self.publish:  # an idle view sends nothing
            self.shown = bundle
            self._face_handle.update(bundle, raw=True)
            self.updates += 1

    def end(self, final: Bundle | None = None) -> None:
        """Show *final* (default: the face as it is now) and empty the controls' output."""
        with self._lock:
            if self.ended:
                return
            self.ended = True
            if self._timer is not None:
                self._timer.cancel()
            if self._controls_handle is not None and self.publish:
                self._controls_handle.update(EMPTY, raw=True)
            self._send(final if final is not None else self._face())
        with contextlib.suppress(ValueError):
            _VIEWS.remove(self)


def svg_img(svg: str, alt: str) -> str:
    """*svg* as an image in HTML that every front end keeps (see the module docstring)."""
    data = base64.b64encode(svg.encode()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/svg+xml;base64,{data}">'


def _end_all() -> None:
    """At the kernel's exit views end and controls close (an open page still gets the
    updates); outside a kernel nothing is shown."""
    from IPython import get_ipython  # noqa: PLC0415

    LiveView.publish = getattr(get_ipython(), "kernel", None) is not None
    for view in _VIEWS.copy():  # each end() takes its view off the list
        with contextlib.suppress(Exception):  # one broken view must not keep the rest live
            view.on_exit()
    for widget in _CONTROLS if LiveView.publish else ():
        with contextlib.suppress(Exception):
            widget.close()


@functools.cache  # one hook per process
def _end_at_exit_once() -> None:
    atexit.register(_end_all)
