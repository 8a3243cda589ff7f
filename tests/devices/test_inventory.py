"""take_inventory() on simulated fleets: findings, mapping, rendering, JSON round trip."""

import dataclasses
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

import nbgpu
from nbgpu._serial import to_data
from nbgpu.devices import holders as holders_mod
from nbgpu.devices.inventory import Inventory, take_inventory
from nbgpu.devices.model import Gpu, gpu_health
from nbgpu.devices.sim.box import SimGpu
from nbgpu.devices.sim.fleet import load_fleet
from nbgpu.errors import UserInputError


def inv(spec, base, **kw):
    return take_inventory({**base, "NBGPU_SIMULATE": spec}, **kw)


def codes(inventory, index):
    return [f.code for f in inventory.findings[index]]


def test_busy_gpu0_flags_the_dead_exclusive_holder(sim_env):
    inventory = inv("busy-gpu0", sim_env)
    assert inventory.simulated
    assert inventory.fleet_name == "busy-gpu0"
    assert codes(inventory, 0)[0] == "exclusive_dead_holder"
    assert inventory.healthy_indices == (1, 2, 3)
    holder = inventory.gpus[0].processes[0].holder
    assert holder.state == "dead"
    assert holder.recorded
    assert gpu_health(inventory.gpus[0], inventory.findings[0]) == ("BUSY: dead holder", "bad")


@pytest.mark.parametrize(
    ("scenario", "index", "code"),
    [
        ("zombie-holder", 1, "zombie_holder"),
        ("other-namespace", 0, "other_namespace_holder"),
        ("gpu-lost", 2, "gpu_lost"),
        ("no-permission", 1, "no_permission"),
        ("pending-remap", 3, "reset_required"),
        ("wedged", 1, "wedged"),
        ("mig", 0, "mig"),
    ],
)
def test_scenarios_give_their_findings(scenario, index, code, sim_env):
    assert code in codes(inv(scenario, sim_env), index)


def test_live_holder_is_looked_up_on_this_machine(sim_env):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        inventory = inv(f"4xA40,exclusive=2,holder=2:{proc.pid}", sim_env)
        gproc = inventory.gpus[2].processes[0]
        assert gproc.holder.state == "alive"
        assert not gproc.holder.recorded
        assert "time.sleep" in gproc.holder.command
        assert "exclusive_busy" in codes(inventory, 2)
    finally:
        proc.kill()
        proc.wait()


def test_ghost_memory_is_flagged(sim_env):
    inventory = inv("4xA40,used=1:20GiB", sim_env)
    assert "ghost_memory" in codes(inventory, 1)
    assert inventory.gpus[1].ghost_bytes == 20 * 1024**3


def test_visible_mapping_for_env_override(sim_env):
    inventory = inv("4xA40", sim_env, visible_devices="2,3")
    assert [(d.cuda_index, d.nvml_index) for d in inventory.visible.devices] == [(0, 2), (1, 3)]
    assert inventory.visible_is_override
    text = inventory.text()
    assert "CUDA_VISIBLE_DEVICES='2,3' (--env)" in text
    assert "cuda:1 -> GPU 3" in text


def test_visible_mapping_from_environment(sim_env):
    inventory = inv("4xA40", {**sim_env, "CUDA_VISIBLE_DEVICES": "0,0"})
    assert inventory.visible.devices == ()
    assert inventory.visible.problems


def test_nvml_unavailable_is_reported_not_raised(sim_env):
    inventory = inv("no-driver", sim_env)
    assert inventory.nvml_error
    assert inventory.gpus == ()
    assert "NVML unavailable" in inventory.text()
    assert "SIMULATED fleet 'no-driver'" in inventory.text()


def test_text_fits_80_columns_and_says_simulated(sim_env):
    text = inv("8xH100,procs=40,busy=3", sim_env).text()
    assert "SIMULATED" in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_html_and_frame(sim_env):
    inventory = inv("busy-gpu0", sim_env)
    bundle = inventory._repr_mimebundle_()
    assert "SIMULATED" in bundle["text/html"]
    assert "<table" in bundle["text/html"]
    frame = inventory.to_frame()
    assert list(frame["nvml_index"]) == [0, 1, 2, 3]
    assert frame.loc[0, "health"] == "BUSY: dead holder"


def test_json_is_a_fleet_the_simulator_replays(sim_env, tmp_path):
    first = inv("busy-gpu0,procs=3", sim_env)
    path = tmp_path / "pod.json"
    path.write_text(first.to_json())
    fleet = load_fleet(str(path))
    assert len(fleet.gpus) == 4
    assert fleet.gpus[0].compute_mode == "exclusive_process"
    replay = inv(str(path), sim_env)
    assert [g.memory_used_bytes for g in replay.gpus] == [g.memory_used_bytes for g in first.gpus]
    assert codes(replay, 0)[0] == "exclusive_dead_holder"
    data = json.loads(path.read_text())
    assert data["gpus"][0]["processes"][0]["observed"]["state"] == "dead"


def test_json_of_lost_gpu_replays(sim_env, tmp_path):
    path = tmp_path / "lost.json"
    path.write_text(inv("4xA40,lost=2", sim_env).to_json())
    replay = inv(str(path), sim_env)
    assert replay.gpus[2].error == "lost"


def test_warm_status_is_fast(sim_env):
    env = {**sim_env, "NBGPU_SIMULATE": "8xH100"}
    take_inventory(env)
    best = min(take_inventory(env).elapsed_ms for _ in range(5))
    # A generous bound for a loaded CI machine; bench/ measures the real figure.
    assert best < 100


def test_device_file_holders_appear_in_status(sim_env, tmp_path, monkeypatch):
    # A real process holding a "device" open; only the path prefix differs from /dev/nvidia*.
    fake_dev = tmp_path / "nvidia0"
    fake_dev.write_text("")
    holder = subprocess.Popen(
        [sys.executable, "-c", f"f = open({str(fake_dev)!r}); import time; time.sleep(30)"]
    )
    try:
        real_scan = holders_mod.device_file_holders
        monkeypatch.setattr(
            holders_mod,
            "device_file_holders",
            lambda: real_scan(pattern=str(tmp_path / "nvidia")),
        )
        deadline = time.time() + 10
        inventory = inv("4xA40", sim_env)
        while holder.pid not in inventory.device_files and time.time() < deadline:
            time.sleep(0.05)
            inventory = inv("4xA40", sim_env)
        assert inventory.device_files[holder.pid] == (str(fake_dev),)
        assert inventory.device_file_holders[holder.pid].state == "alive"
        row = next(line for line in inventory.text().splitlines() if str(holder.pid) in line)
        assert row.startswith("fd")
        assert "open nvidia0" in row
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize(
    "spec", ["busy-gpu0,procs=3", "4xA40,lost=2", "mig", "pending-remap", "zombie-holder", "8xH100"]
)
def test_a_capture_of_a_replayed_capture_is_the_same_file(sim_env, tmp_path, spec):
    # capture -> replay -> capture is a fixed point: the converter forgets no field of the
    # model, and the file says nothing the replay would not say again.
    first = json.loads(inv(spec, sim_env).to_json())
    path = tmp_path / "pod.json"
    path.write_text(json.dumps(first))
    second = json.loads(inv(str(path), sim_env).to_json())
    for volatile in ("taken_at", "name", "description", "simulated"):
        first.pop(volatile, None)
        second.pop(volatile, None)
    assert second == first


@pytest.mark.parametrize("spec", ["busy-gpu0,procs=3", "mig", "pending-remap", "4xA40,lost=2"])
def test_a_capture_says_what_the_inventory_read_for_every_shared_field(sim_env, spec):
    inventory = inv(spec, sim_env)
    data = json.loads(inventory.to_json())
    model_fields = {f.name for f in dataclasses.fields(SimGpu)}
    shared = model_fields & {f.name for f in dataclasses.fields(Gpu)}
    assert len(shared) > 15  # the test compares what the two models have in common
    for gpu, written in zip(inventory.gpus, data["gpus"], strict=True):
        assert written["index"] == gpu.nvml_index
        for name in shared - {"processes", "name", "memory_total_bytes"}:
            assert written[name] == to_data(getattr(gpu, name)), (gpu.nvml_index, name)
        assert [p["pid"] for p in written["processes"]] == [p.pid for p in gpu.processes]


@pytest.mark.parametrize(
    "spec", ["busy-gpu0,procs=3", "4xA40,lost=2", "mig", "zombie-holder", "no-driver"]
)
def test_an_inventory_reads_back_what_it_wrote(sim_env, spec):
    first = inv(spec, sim_env, visible_devices="1,0")
    again = Inventory.from_dict(json.loads(first.to_json()))
    assert again.to_dict() == first.to_dict()
    assert again.text() == first.text()
    assert again.findings == first.findings
    assert again.visible == first.visible
    assert again.visible_is_override == first.visible_is_override == (first.visible is not None)


def test_a_capture_from_before_the_cuda_order_was_written_still_reads(sim_env):
    data = json.loads(inv("busy-gpu0", sim_env).to_json())
    for key in ("order", "stopped_at", "override"):
        del data["visible_devices"][key]
    del data["device_files"]
    for gpu in data["gpus"]:
        del gpu["findings"]  # derived: found again by the same rules
    again = Inventory.from_dict(data)
    assert again.visible.order == "FASTEST_FIRST"
    assert codes(again, 0)[0] == "exclusive_dead_holder"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("taken_at"), "inventory JSON: not a capture"),
        (lambda d: d.update(hostname=3), "hostname = 3 is not a string"),
        (
            lambda d: d["gpus"][1].update(memory_total_bytes="big"),
            "gpus[1].memory_total_bytes = 'big' is not a whole number",
        ),
        (lambda d: d["gpus"][0]["processes"][0].update(pid=-3), "gpus[0].processes[0].pid = -3"),
        (
            lambda d: d["gpus"][0]["processes"][0]["observed"].update(state="sleepy"),
            "gpus[0].processes[0].observed.state = 'sleepy'",
        ),
        (lambda d: d["gpus"][2]["findings"].append({"severity": "dire"}), "gpus[2].findings[0]"),
        (lambda d: d["visible_devices"].update(devices=7), "visible_devices.devices = 7"),
    ],
)
def test_a_wrong_capture_names_the_field(sim_env, change, message):
    data = json.loads(inv("busy-gpu0", sim_env).to_json())
    change(data)
    with pytest.raises(UserInputError) as info:
        Inventory.from_dict(data)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_a_saved_inventory_is_read_not_replayed_through_the_fake_library(sim_env, tmp_path):
    # A plan from `nbgpu status --json`'s file reads the file: no simulated NVML library.
    path = tmp_path / "pod.json"
    path.write_text(inv("busy-gpu0", sim_env).to_json())
    script = (
        "import sys, nbgpu\n"
        f"p = nbgpu.plan('d2', inventory={str(path)!r})\n"
        "print(p.roles[0].cuda_visible_devices, 'nbgpu.devices.sim.nvml' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=sim_env,
        check=True,
    )  # fmt: skip
    assert out.stdout.split() == ["1,2", "False"]


@pytest.mark.parametrize(
    "case",
    [
        (None, False, "import-storm", "No GPU found: this notebook shows the SIMULATED fleet"),
        (None, True, "", "Real GPUs: nothing in this notebook is simulated."),
        ("busy-gpu0", False, "import-storm", "This notebook uses the SIMULATED fleet"),
        ("4xA40", False, "4xA40", "NBGPU_SIMULATE is set: this notebook shows the SIMULATED"),
        ("", False, "", "Real GPUs: nothing in this notebook is simulated."),
    ],
)
def test_a_notebook_says_in_one_call_what_it_runs_on(monkeypatch, capsys, case):
    from nbgpu import api  # noqa: PLC0415

    before, gpus_here, after, said = case
    if before is None:
        monkeypatch.delenv("NBGPU_SIMULATE", raising=False)
    else:
        monkeypatch.setenv("NBGPU_SIMULATE", before)
    monkeypatch.setattr(api, "status", lambda **_: SimpleNamespace(gpus=[0] * gpus_here))
    assert nbgpu.simulate("import-storm") == after
    assert os.environ.get("NBGPU_SIMULATE", "") == after
    printed = capsys.readouterr().out
    assert printed.startswith(said)
    assert printed.count("\n") == 1
