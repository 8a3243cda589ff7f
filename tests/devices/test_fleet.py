import json
from typing import get_args

import pytest

from nbgpu.devices import model
from nbgpu.devices.inventory import take_inventory
from nbgpu.devices.sim.box import COMPUTE_MODES, ComputeMode, Fleet
from nbgpu.devices.sim.fleet import (
    FICTIONAL_PID_BASE,
    MODELS,
    SCENARIOS,
    fleet_from_dict,
    load_fleet,
    parse_spec,
)
from nbgpu.errors import FleetSpecError

MIB = 1024 * 1024


def test_spec_count_and_model_facts():
    fleet = parse_spec("4xA40")
    assert len(fleet.gpus) == 4
    assert {g.name for g in fleet.gpus} == {"NVIDIA A40"}
    assert fleet.gpus[0].memory_total_bytes == 48305799168  # 46068 MiB, a real capture
    assert len({g.uuid for g in fleet.gpus}) == 4
    assert parse_spec("4xA40").gpus[2].uuid == fleet.gpus[2].uuid  # deterministic


def test_single_gpu_without_count_and_case_insensitive_model():
    fleet = parse_spec("h100")
    assert len(fleet.gpus) == 1
    assert fleet.gpus[0].name == MODELS["H100"].name


def test_busy_is_exclusive_with_dead_recorded_holder():
    gpu = parse_spec("4xA40,busy=0").gpus[0]
    assert gpu.compute_mode == "exclusive_process"
    (holder,) = gpu.processes
    assert holder.pid >= FICTIONAL_PID_BASE  # above PID_MAX_LIMIT: cannot exist anywhere
    assert holder.observed is not None
    assert holder.observed.state == "dead"
    assert gpu.effective_cuda_error == 46


@pytest.mark.parametrize(
    ("spec", "index", "check"),
    [
        ("4xA40,lost=2", 2, lambda g: g.fault == "lost"),
        ("4xA40,noperm=1+3", 3, lambda g: g.fault == "no_permission"),
        ("4xA40,zombie=1", 1, lambda g: g.processes[0].observed.state == "zombie"),
        ("4xA40,otherns=0", 0, lambda g: g.processes[0].observed.state == "other_namespace"),
        ("1xA100,mig=0", 0, lambda g: g.mig_enabled and len(g.mig_devices) == 7),
        ("4xA100-80GB,remap=3", 3, lambda g: g.remapped_rows.pending),
        ("4xA40,wedged=1", 1, lambda g: g.utilization_gpu_pct == 100),
        ("4xA40,prohibited=1", 1, lambda g: g.effective_cuda_error == 46),
        ("4xA40,holder=2:1234", 2, lambda g: g.processes[0].pid == 1234),
        ("4xA40,used=1:20GiB", 1, lambda g: g.effective_used_bytes == 20 * 1024 * MIB),
    ],
)
def test_spec_options(spec, index, check):
    assert check(parse_spec(spec).gpus[index])


def test_procs_spread_round_robin():
    fleet = parse_spec("8xH100,procs=40")
    assert [len(g.processes) for g in fleet.gpus] == [5] * 8


def test_driver_options_and_old_driver():
    fleet = parse_spec("2xV100,old,cuda=11.0,driver=450.80.02")
    assert "nvmlDeviceGetComputeRunningProcesses_v3" in fleet.missing_functions
    assert fleet.cuda_driver_version == 11000
    assert fleet.driver_version == "450.80.02"
    assert parse_spec("4xA40,init=driver_not_loaded").init_error == "driver_not_loaded"


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("", "empty"),
        ("4xB200", "unknown GPU model 'B200'"),
        ("4xA40,busy=7", "busy=7 but the fleet has 4 GPUs"),
        ("4xA40,busy=x", "busy='x' is not a GPU index"),
        ("4xA40,frobnicate=1", "unknown option 'frobnicate'"),
        ("4xA40,busy", "needs key=value"),
        ("0xA40", "expected 1 to 64"),
        ("4xA40,mig=0", "does not support MIG"),
        ("4xA40,init=boom", "init='boom'"),
        ("4xA40,holder=0", "expected holder=GPU:PID"),
        ("4xA40,used=0:lots", "used=0:'lots': expected a size"),
        ("4xA40,cuda=twelve", "cuda='twelve'"),
    ],
)
def test_bad_specs_name_the_value(spec, fragment):
    with pytest.raises(FleetSpecError) as info:
        parse_spec(spec)
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message


def test_every_scenario_loads():
    for name in SCENARIOS:
        fleet = load_fleet(name)
        assert fleet.name == name
        assert fleet.description


def test_json_round_trip(tmp_path):
    fleet = load_fleet("busy-gpu0")
    path = tmp_path / "pod.json"
    path.write_text(fleet.to_json())
    again = load_fleet(str(path))
    assert again.gpus == fleet.gpus
    assert again.driver_version == fleet.driver_version


def test_unknown_name_lists_scenarios():
    with pytest.raises(FleetSpecError, match="scenarios: busy-gpu0, exclusive-dead, gpu-lost"):
        load_fleet("sed000")


@pytest.mark.parametrize(
    ("document", "fragment"),
    [
        ([], "top level is not an object"),
        ({"nbgpu_fleet": 9, "gpus": []}, "nbgpu_fleet = 9"),
        ({"nbgpu_fleet": 1}, "has no 'gpus'"),
        ({"nbgpu_fleet": 1, "gpus": [{"memory_total_bytes": 1}]}, "gpus[0] has no 'name'"),
        (
            {"nbgpu_fleet": 1, "gpus": [{"name": "x", "memory_total_bytes": "big"}]},
            "gpus[0].memory_total_bytes = 'big' is not a whole number",
        ),
        (
            {
                "nbgpu_fleet": 1,
                "gpus": [{"name": "x", "memory_total_bytes": 1, "compute_mode": "solo"}],
            },
            "compute_mode = 'solo'",
        ),
        (
            {
                "nbgpu_fleet": 1,
                "gpus": [{"name": "x", "memory_total_bytes": 1, "processes": [{"pid": -3}]}],
            },
            "processes[0].pid = -3",
        ),
        (
            {
                "nbgpu_fleet": 1,
                "gpus": [
                    {
                        "name": "x",
                        "memory_total_bytes": 1,
                        "processes": [{"pid": 3, "observed": {"state": "sleepy"}}],
                    }
                ],
            },
            "observed.state = 'sleepy'",
        ),
    ],
)
def test_bad_fleet_json_names_the_field(document, fragment):
    with pytest.raises(FleetSpecError) as info:
        fleet_from_dict(document)
    assert fragment in str(info.value)


def test_bad_fleet_files(tmp_path):
    with pytest.raises(FleetSpecError, match="does not exist"):
        load_fleet(str(tmp_path / "missing.json"))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(FleetSpecError, match=r"not valid JSON \(line 1"):
        load_fleet(str(broken))


def test_to_dict_is_json():
    data = json.loads(Fleet(gpus=parse_spec("2xT4").gpus).to_json())
    assert data["nbgpu_fleet"] == 1
    assert len(data["gpus"]) == 2


def test_scenario_with_extra_options():
    fleet = load_fleet("busy-gpu0,lost=3")
    assert fleet.gpus[0].compute_mode == "exclusive_process"
    assert fleet.gpus[3].fault == "lost"
    assert fleet.description == load_fleet("busy-gpu0").description


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_scenario_survives_the_fleet_file_round_trip(name):
    # The fleet file is the model's own serialization: written and read back, equal.
    fleet = load_fleet(name)
    assert fleet_from_dict(json.loads(fleet.to_json())) == fleet


def test_the_fleet_words_are_the_simulators_words():
    assert set(get_args(ComputeMode)) == set(COMPUTE_MODES)
    assert set(get_args(model.InitError)) == set(model.INIT_ERRORS)


def _cluster_file(tmp_path):
    nodes = [
        {"node": n, **take_inventory({"NBGPU_SIMULATE": s}, scan_device_files=False).to_dict()}
        for n, s in (("n1", "2xA40,busy=0"), ("n2", "4xH100"))
    ]
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"source": "allocation 9", "nodes": nodes}))
    return path


def test_a_cluster_file_gives_each_node_its_own_fleet(tmp_path):
    path = _cluster_file(tmp_path)
    seen = {}
    for node in ("n1", "n2"):
        inv = take_inventory(
            {"NBGPU_SIMULATE": str(path), "SLURMD_NODENAME": node}, scan_device_files=False
        )
        seen[node] = [g.name for g in inv.gpus]
    assert seen == {"n1": ["NVIDIA A40"] * 2, "n2": ["NVIDIA H100 80GB HBM3"] * 4}
    # A rank started by nbgpu on a node knows its node from NBGPU_NODE.
    inv = take_inventory({"NBGPU_SIMULATE": str(path), "NBGPU_NODE": "n2"}, scan_device_files=False)
    assert len(inv.gpus) == 4


def test_a_cluster_file_on_a_node_it_does_not_describe_is_one_line(tmp_path):
    path = _cluster_file(tmp_path)
    with pytest.raises(FleetSpecError, match=r"describes nodes n1, n2; this process is on 'n7'"):
        load_fleet(str(path), node="n7")
