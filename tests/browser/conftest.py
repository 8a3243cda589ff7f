"""Fixtures for the real-browser tests: one private JupyterLab and one Chromium per module.

Every process the tests start carries one environment marker (``NBGPU_BROWSER_TEST``):
the Lab server, its kernels, their torchrun agents and ranks inherit it, and Chromium
gets it explicitly. Teardown closes the browser, stops the server, then fails if anything
with the marker is still alive, and kills it so it cannot leak into later tests.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.browser.helpers import (
    CHROMIUM,
    CHROMIUM_ARGS,
    LabPage,
    LabServer,
    describe,
    kill_all,
    live_children,
    processes_with_env,
    wait_until,
)

MARKER_VAR = "NBGPU_BROWSER_TEST"
_REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "browser: drives JupyterLab in headless Chromium (needs /usr/bin/chromium)"
    )


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:  # noqa: ARG001
    # Keep each phase's report on the item, so the page fixture knows whether the test
    # failed and a screenshot is worth taking.
    report = yield
    item.stash.setdefault(_REPORTS, {})[report.when] = report
    return report


@pytest.fixture(scope="module")
def marker() -> str:
    return f"{MARKER_VAR}={secrets.token_hex(6)}"


@pytest.fixture(scope="module")
def shots_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where screenshots go: $NBGPU_BROWSER_SHOTS, else a pytest temp dir (kept 3 runs)."""
    chosen = os.environ.get("NBGPU_BROWSER_SHOTS")
    path = Path(chosen) if chosen else tmp_path_factory.mktemp("browser-shots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, marker: str) -> Iterator[LabServer]:
    base = tmp_path_factory.mktemp("lab")
    key, value = marker.split("=", 1)
    server = LabServer(
        base,
        {
            "NBGPU_SIMULATE": "4xA40",  # four simulated A40s; ranks run on CPU with gloo
            "NBGPU_RUNS_DIR": str(base / "runs"),
            key: value,
        },
    )
    try:
        server.start()
        yield server
    finally:
        server.stop()
        _assert_nothing_left(marker)


def _assert_nothing_left(marker: str) -> None:
    """No process of ours survives: the browser (closed before) and the server tree."""
    # Kernels stop their runs as they shut down, with a short grace period: allow for it.
    deadline = time.monotonic() + 15
    while processes_with_env(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = processes_with_env(marker)
    kill_all(left)  # so a leak fails this module only, not the tests after it
    assert not left, f"processes left behind by the browser tests:\n{describe(left)}"


@pytest.fixture(scope="module")
def browser(marker: str, lab: LabServer) -> Iterator[Any]:  # noqa: ARG001
    # Depends on lab so the browser closes before the server's leak check runs.
    try:
        from playwright.sync_api import sync_playwright  # noqa: PLC0415
    except ImportError:
        pytest.fail("playwright is not installed: `make test` installs it (pyproject [test])")
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make browser-deps` installs Debian's chromium")
    key, value = marker.split("=", 1)
    before = live_children()
    playwright = sync_playwright().start()
    try:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_ARGS,
            env={**os.environ, key: value},  # so the leak check finds every browser process
        )
        try:
            yield chromium
        finally:
            chromium.close()
    finally:
        playwright.stop()
        # The Playwright driver (node) is our child and does not carry the marker.
        wait_until(lambda: not live_children() - before, 10, "the Playwright driver to exit")


@pytest.fixture
def lab_page(
    browser: Any, lab: LabServer, shots_dir: Path, request: pytest.FixtureRequest
) -> Iterator[LabPage]:
    """A fresh browser context and page; a screenshot and the server log if the test fails."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(30_000)
    page = LabPage(context.new_page(), lab)
    try:
        yield page
    finally:
        reports = request.node.stash.get(_REPORTS, {})
        if any(r.failed for r in reports.values()) or "call" not in reports:
            # Printed output of a teardown shows in pytest's failure report.
            shot = shots_dir / f"{request.node.name}-failure.png"
            with contextlib.suppress(Exception):  # a crashed page must not hide the failure
                print(f"screenshot of the failure: {page.screenshot(shot)}")
            print(f"JupyterLab log (last lines):\n{lab.log_tail()}")
        # Frees the kernel before the next test's page; if the page cannot, stopping the
        # server does it, and the leak check after that has the last word.
        with contextlib.suppress(Exception):
            page.shutdown_kernels()
        context.close()
