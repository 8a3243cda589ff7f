"""The dashboard's sampler: a bounded history on a thread that pauses, stops and says why."""

from __future__ import annotations

import time

import pytest

from nbgpu.devices import watch
from nbgpu.devices.sim.fleet import FleetSpecError, parse_spec
from nbgpu.devices.sim.nvml import FakeNvmlLibrary
from nbgpu.devices.watch import Watcher, parse_watch_options
from nbgpu.errors import UserInputError


@pytest.mark.parametrize(
    ("interval", "history", "message"),
    [
        ("0", "300", "--interval '0': expected seconds, at least 0.2"),
        ("-1", "300", "--interval '-1'"),
        ("abc", "300", "--interval 'abc' is not a number"),
        ("nan", "300", "--interval 'nan'"),
        ("1", "1", "--history '1': expected 2 to 86400"),
        ("1", str(10**9), "expected 2 to 86400"),
        ("1", "lots", "--history 'lots' is not a whole number"),
    ],
)
def test_bad_options_get_one_line(interval, history, message):
    with pytest.raises(UserInputError, match=message.replace("(", r"\(")):
        parse_watch_options(interval, history)


def test_load_profile_moves_utilisation_and_memory(monkeypatch):
    fleet = parse_spec("2xA40,load=60")
    assert fleet.load_period_s == 60
    lib = FakeNvmlLibrary(fleet)
    clock = [lib._born]
    monkeypatch.setattr("nbgpu.devices.sim.nvml.time.monotonic", lambda: clock[0])
    first = lib._load(fleet.gpus[0])
    clock[0] += 15  # a quarter cycle later
    second = lib._load(fleet.gpus[0])
    assert first != second
    assert 0.0 <= first <= 1.0
    assert 0.0 <= second <= 1.0
    assert lib._load(fleet.gpus[1]) != second  # GPUs are offset, not in lockstep
    assert FakeNvmlLibrary(parse_spec("2xA40"))._load(fleet.gpus[0]) == 0.0


@pytest.mark.parametrize("value", ["0", "abc", "-5", "1e9"])
def test_bad_load_period(value):
    with pytest.raises(FleetSpecError, match=f"load={value!r}"):
        parse_spec(f"2xA40,load={value}")


def _wait(predicate, timeout=20.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_watcher_samples_pauses_resumes_and_stops(sim_env):
    env = {**sim_env, "NBGPU_SIMULATE": "8xH100,load=2"}
    w = Watcher(interval_s=0.2, history=5, environ=env).start()
    _wait(lambda: len(w.samples) >= 3)
    assert len(w.samples[-1].gpus) == 8
    assert w.samples[-1].simulated == "8xH100,load=2"
    utils = {tuple(g.utilization_pct for g in s.gpus) for s in w.samples}
    assert len(utils) > 1  # the load profile moves between samples
    _wait(lambda: len(w.samples) == 5)  # bounded history
    w.pause()
    time.sleep(0.3)
    paused_at = w.samples[-1].at
    time.sleep(0.8)
    assert w.samples[-1].at == paused_at
    assert w.paused
    w.resume()
    _wait(lambda: w.samples[-1].at > paused_at)
    w.stop()
    assert not w.alive
    assert w.stopped
    stopped_at = w.samples[-1].at
    time.sleep(0.5)
    assert w.samples[-1].at == stopped_at
    assert w.sampling_s > 0


def test_a_failing_sample_ends_the_thread_and_says_why(sim_env, monkeypatch):
    def broken(*_args, **_kwargs):
        raise RuntimeError("NVML went away")

    monkeypatch.setattr(watch, "take_sample", broken)
    w = Watcher(interval_s=0.2, history=5, environ=sim_env).start()
    _wait(lambda: not w.alive)
    assert w.error == "RuntimeError: NVML went away"
    assert w.stopped
