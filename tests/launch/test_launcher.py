"""prepare(): nproc and GPUs from the inventory, checked before anything starts."""

import json

import pytest

from nbgpu.devices.sim.fleet import load_fleet
from nbgpu.errors import UserInputError
from nbgpu.launch.launcher import prepare

CELL = "print('hi')\n"


def sim(spec, base, **extra):
    return {**base, "NBGPU_SIMULATE": spec, **extra}


def test_default_nproc_is_the_healthy_gpus_and_busy_ones_are_left_out(sim_env):
    prepared = prepare(code=CELL, environ=sim("busy-gpu0", sim_env))
    assert prepared.config.nproc == 3
    assert prepared.config.cuda_visible_devices == "1,2,3"
    assert any(n.startswith("GPU 0 left out: BUSY: dead holder") for n in prepared.notes)
    assert any("SIMULATED" in n for n in prepared.notes)


def test_healthy_box_uses_every_gpu_without_touching_cvd(sim_env):
    prepared = prepare(code=CELL, environ=sim("4xA40", sim_env))
    assert prepared.config.nproc == 4
    assert prepared.config.cuda_visible_devices is None


def test_nproc_mismatch_seven_ranks_on_four_gpus_is_refused(sim_env):
    with pytest.raises(UserInputError, match="nproc 7 but 4 GPUs are visible"):
        prepare(code=CELL, nproc=7, environ=sim("4xH100", sim_env))
    forced = prepare(code=CELL, nproc=7, force=True, environ=sim("4xH100", sim_env))
    assert forced.config.nproc == 7


def test_gpus_flag_checks_the_inventory(sim_env):
    env = sim("busy-gpu0", sim_env)
    assert prepare(code=CELL, gpus="1,3", environ=env).config.cuda_visible_devices == "1,3"
    assert prepare(code=CELL, gpus="1,3", environ=env).config.nproc == 2
    with pytest.raises(UserInputError, match="GPU 0 is not usable: GPU 0 is in exclusive-process"):
        prepare(code=CELL, gpus="0,1", environ=env)
    assert prepare(code=CELL, gpus="0,1", force=True, environ=env).config.gpus == (0, 1)
    with pytest.raises(UserInputError, match="GPU 9 does not exist"):
        prepare(code=CELL, gpus="9", environ=env)
    with pytest.raises(UserInputError, match="nproc 3 but --gpus 1,2 names 2 GPUs"):
        prepare(code=CELL, nproc=3, gpus="1,2", environ=env)


def test_environment_cvd_is_respected(sim_env):
    prepared = prepare(code=CELL, environ=sim("4xA40", sim_env, CUDA_VISIBLE_DEVICES="2,3"))
    assert prepared.config.nproc == 2


def test_no_gpu_needs_an_explicit_number(sim_env):
    with pytest.raises(UserInputError, match=r"no GPU here .*give the number of CPU processes"):
        prepare(code=CELL, environ=sim_env)
    assert prepare(code=CELL, nproc=2, environ=sim_env).config.nproc == 2
    with pytest.raises(UserInputError, match="there is no GPU here"):
        prepare(code=CELL, nproc=2, gpus="0", environ=sim_env)


def test_bad_values(sim_env, tmp_path):
    with pytest.raises(UserInputError, match="nproc 0"):
        prepare(code=CELL, nproc=0, environ=sim_env)
    with pytest.raises(UserInputError, match="--mem-limit 'big'"):
        prepare(code=CELL, nproc=1, mem_limit="big", environ=sim_env)
    with pytest.raises(UserInputError, match="run name 'bad name'"):
        prepare(code=CELL, nproc=1, name="bad name", environ=sim_env)
    with pytest.raises(UserInputError, match="does not exist"):
        prepare(script=tmp_path / "missing.py", nproc=1, environ=sim_env)


def test_gpus_flag_runs_the_cuda_probe(sim_env, tmp_path):
    # NVML sees nothing wrong with GPU 1, but creating a context there fails (a holder
    # in another container): only the probe can tell, and the launch is refused.
    fleet = json.loads(load_fleet("4xA40").to_json())
    fleet["gpus"][1]["cuda_error"] = 46
    path = tmp_path / "pod.json"
    path.write_text(json.dumps(fleet))
    env = sim(str(path), sim_env)
    with pytest.raises(UserInputError, match=r"GPU 1 fails the CUDA probe: CUDA-capable device"):
        prepare(code=CELL, gpus="0,1", environ=env)
    assert prepare(code=CELL, gpus="0,2", environ=env).config.gpus == (0, 2)
    assert prepare(code=CELL, gpus="0,1", force=True, environ=env).config.gpus == (0, 1)
