"""The simulated NVML library driven through the real pynvml wrappers and nvml.py."""

import pynvml  # noqa: TID251  (the test proves pynvml's own wrappers run on the fake)
import pytest

from nbgpu.devices import nvml
from nbgpu.devices.sim.fleet import SCENARIOS
from nbgpu.devices.sim.nvml import FakeNvmlLibrary
from nbgpu.errors import NvmlUnavailable
from tests.conftest import real_nvml_present

GIB = 1024**3


def sim(spec, base):
    return {**base, "NBGPU_SIMULATE": spec}


def test_real_pynvml_wrappers_run_on_the_fake(sim_env):
    backend = nvml.activate(sim("4xA40,busy=0", sim_env))
    assert backend.simulated
    assert isinstance(pynvml.nvmlLib, FakeNvmlLibrary)
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetName(handle) == "NVIDIA A40"
    assert pynvml.nvmlDeviceGetComputeMode(handle) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    assert [p.pid for p in procs] == [4_200_000]
    assert pynvml.nvmlDeviceGetUUID(handle).startswith("GPU-")
    # An unmodelled capability answers NotSupported, like a real driver would.
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetFanSpeed(handle)


def test_snapshot_of_busy_gpu0(sim_env):
    snap = nvml.read_system(sim("busy-gpu0", sim_env))
    assert snap.device_count == 4
    assert snap.driver_version == "550.163.01"
    assert snap.cuda_driver_version == 12040
    gpu0 = snap.gpus[0]
    assert gpu0.compute_mode == "exclusive_process"
    assert gpu0.memory_total_bytes == 48305799168
    assert gpu0.processes[0].used_bytes == gpu0.memory_used_bytes
    assert gpu0.power_limit_w == 300.0
    assert gpu0.mig_enabled is None  # A40 has no MIG
    assert "MIG" in gpu0.unsupported
    assert snap.gpus[1].processes == ()


@pytest.mark.parametrize(
    "name", [n for n in SCENARIOS if not n.startswith("no-") and n != "lib-mismatch"]
)
def test_every_working_scenario_reads(name, sim_env):
    snap = nvml.read_system(sim(name, sim_env))
    assert snap.backend.fleet.name == name
    assert len(snap.gpus) == snap.device_count > 0


@pytest.mark.parametrize(
    ("name", "code", "words"),
    [
        ("no-driver", 9, "kernel driver is not loaded"),
        ("no-library", 12, "libnvidia-ml.so.1 was not found"),
        ("lib-mismatch", 18, "version mismatch"),
    ],
)
def test_init_failures_map_to_nvml_unavailable(name, code, words, sim_env):
    with pytest.raises(NvmlUnavailable) as info:
        nvml.read_system(sim(name, sim_env))
    assert info.value.code == code
    assert words in str(info.value)


@pytest.mark.skipif(
    real_nvml_present(),
    reason="this machine has an NVIDIA driver: the no-driver path needs one without",
)
def test_no_gpu_machine_without_simulation(sim_env):
    # A machine without the NVIDIA driver: the real library is simply not there.
    env = {k: v for k, v in sim_env.items() if k != "NBGPU_SIMULATE"}
    with pytest.raises(NvmlUnavailable) as info:
        nvml.read_system(env)
    assert info.value.code == 12


def test_no_driver_simulated_answers_like_the_real_absence(sim_env):
    with pytest.raises(NvmlUnavailable) as info:
        nvml.read_system(sim_env)  # NO_DRIVER: runs the same on GPU machines
    assert info.value.code == 12


def test_lost_and_forbidden_gpus_do_not_spoil_the_snapshot(sim_env):
    snap = nvml.read_system(sim("4xA40,lost=2,noperm=3", sim_env))
    assert [g.error for g in snap.gpus] == [None, None, "lost", "no_permission"]
    assert snap.gpus[0].name == "NVIDIA A40"


def test_mig_children_and_unattributed_memory(sim_env):
    snap = nvml.read_system(sim("1xA100,mig=0,holder=0:4321", sim_env))
    gpu = snap.gpus[0]
    assert gpu.mig_enabled is True
    assert len(gpu.mig_devices) == 7
    assert all(m.uuid.startswith("MIG-") for m in gpu.mig_devices)
    assert gpu.mig_devices[0].memory_total_bytes == 4864 * 1024 * 1024
    assert gpu.processes[0].used_bytes is None  # NVML cannot attribute it under MIG
    assert "utilisation" in gpu.unsupported


def test_old_driver_falls_back_to_v1_structs(sim_env):
    snap = nvml.read_system(sim("2xV100,old,holder=1:777", sim_env))
    gpu = snap.gpus[1]
    assert [(p.pid, p.used_bytes) for p in gpu.processes] == [(777, GIB)]
    assert gpu.memory_reserved_bytes is None  # v1 memory struct has no reserved field
    assert any("v1 struct" in f for f in gpu.fallbacks)
    assert any("nvmlDeviceGetMemoryInfo" in f for f in gpu.fallbacks)
    assert snap.cuda_driver_version == 11000


def test_switching_fleets_switches_library(sim_env):
    assert len(nvml.read_system(sim("2xT4", sim_env)).gpus) == 2
    assert len(nvml.read_system(sim("8xH100", sim_env)).gpus) == 8


def test_fake_counts_calls_and_enforces_init(sim_env):
    nvml.activate(sim("1xT4", sim_env))
    lib = pynvml.nvmlLib
    before = lib.calls
    pynvml.nvmlDeviceGetCount()
    assert lib.calls == before + 1
    nvml.reset()
    fresh = FakeNvmlLibrary(lib.fleet)
    count = pynvml.c_uint()
    assert fresh.nvmlDeviceGetCount_v2(pynvml.byref(count)) == pynvml.NVML_ERROR_UNINITIALIZED


def test_forty_processes_on_eight_gpus(sim_env):
    snap = nvml.read_system(sim("8xH100,procs=40", sim_env))
    assert sum(len(g.processes) for g in snap.gpus) == 40
    assert len({p.pid for g in snap.gpus for p in g.processes}) == 40


def test_the_backend_answers_what_nvml_cannot_without_being_asked_which_it_is():
    # A captured fleet knows its holders and its UUIDs; real hardware answers nothing
    # here (the process table and the inventory do), and the callers need not know which.
    simulated = nvml.backend_for({"NBGPU_SIMULATE": "busy-gpu0"})
    held = simulated.fleet.gpus[0].processes[0]
    assert simulated.recorded_process(held.pid) == held.observed
    assert simulated.recorded_process(1) is None
    assert simulated.nvml_index_by_uuid()[simulated.fleet.gpus[2].uuid] == 2
    assert simulated.fleet.name == "busy-gpu0"
    hardware = nvml.Backend(simulated=False, fleet=None)
    assert hardware.recorded_process(held.pid) is None
    assert hardware.nvml_index_by_uuid() == {}
    assert hardware.fleet is None
    nvml.reset()
