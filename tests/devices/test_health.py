"""The active CUDA probe: real probe subprocesses against simulated fleets, no GPU.

Most tests run ``probe_devices`` end to end (a real ``python -m nbgpu.devices.health`` child
loading the simulated libcuda); a few drive the fake library in-process to check what the
probe did call, and the process tests prove no child survives a timeout or an interrupt.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace

import psutil
import pytest

from nbgpu.devices import health as health_probe
from nbgpu.devices.cuda_driver import CudaDriver
from nbgpu.devices.health import OUTCOMES, ProbeReport, outcome_for, probe_devices
from nbgpu.devices.sim.cuda import SimulatedCudaLibrary
from nbgpu.devices.sim.fleet import load_fleet, parse_spec
from nbgpu.errors import FleetSpecError, UserInputError

BUSY = "CUDA-capable device(s) is/are busy or unavailable"


def probe(spec: str, **env: str) -> ProbeReport:
    # A minimal environment on purpose: the probe must not depend on the caller's.
    return probe_devices(environ={"NBGPU_SIMULATE": spec, **env})


def gone(pid: int) -> bool:
    """Not running: no such pid, or only a zombie left for init to reap."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def cmdline(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return ""


def probe_children() -> list[psutil.Process]:
    children = psutil.Process().children(recursive=True)
    return [c for c in children if "nbgpu.devices.health" in cmdline(c)]


# ------------------------------------------------------------------ simulated fleets


def test_busy_gpu_gets_cudas_own_message_and_the_others_are_ok():
    report = probe("4xA40,busy=0")
    fleet = load_fleet("4xA40,busy=0")

    assert report.simulated
    assert not report.timed_out
    assert report.init_error is None
    assert report.driver_version == 12040
    assert [r.outcome for r in report.results] == ["busy", "ok", "ok", "ok"]
    busy = report.results[0]
    assert (busy.cuda_error, busy.error_name, busy.message) == (
        46,
        "CUDA_ERROR_DEVICE_UNAVAILABLE",
        BUSY,
    )
    assert [r.nvml_index for r in report.results] == [0, 1, 2, 3]
    assert [r.uuid for r in report.results] == [g.uuid for g in fleet.gpus]
    assert [r.pci_bus_id for r in report.results][:2] == ["0000:18:00.0", "0000:28:00.0"]
    assert all(r.cuda_error == 0 and r.error_name is None for r in report.results[1:])
    assert not report.ok
    assert report.for_nvml_index(0) is busy
    text = report.text()
    assert "SIMULATED" in text
    assert "cuda:0 (GPU 0): CUDA_ERROR_DEVICE_UNAVAILABLE (46): CUDA-capable device(s)" in text


def test_cuda_visible_devices_limits_and_renumbers_the_probe(monkeypatch):
    # The caller's environ decides, not the kernel's own environment.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    report = probe("4xA40,busy=0", CUDA_VISIBLE_DEVICES="2,3")

    assert [(r.cuda_index, r.nvml_index, r.outcome) for r in report.results] == [
        (0, 2, "ok"),
        (1, 3, "ok"),
    ]


def test_busy_outcome_follows_the_physical_gpu_through_reordering():
    report = probe("4xA40,busy=0", CUDA_VISIBLE_DEVICES="3,0")

    assert [(r.cuda_index, r.nvml_index, r.outcome) for r in report.results] == [
        (0, 3, "ok"),
        (1, 0, "busy"),
    ]
    assert "cuda:1 (GPU 0)" in report.text()


def test_lost_gpu():
    report = probe("4xA40,lost=2")

    assert [r.outcome for r in report.results] == ["ok", "ok", "lost", "ok"]
    lost = report.results[2]
    assert (lost.cuda_error, lost.error_name, lost.message) == (
        999,
        "CUDA_ERROR_UNKNOWN",
        "unknown error",
    )
    assert "Xid 79" in report.text()


@pytest.mark.parametrize(
    ("scenario", "outcome", "words", "driver_version"),
    [
        ("no-driver", "no_device", "CUDA_ERROR_NO_DEVICE (100)", 12040),
        ("lib-mismatch", "driver_mismatch", "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH (803)", 12040),
        ("no-library", "no_driver", "cannot load libcuda.so.1: cannot open shared object", None),
        ("4xA40,init=unknown", "unknown", "CUDA_ERROR_UNKNOWN (999): unknown error", 12040),
    ],
)
def test_init_failures_are_outcomes_not_crashes(scenario, outcome, words, driver_version):
    report = probe(scenario)

    assert report.results == ()
    assert report.init_outcome == outcome
    assert report.init_error is not None
    assert words in report.init_error
    assert "\n" not in report.init_error
    assert "Traceback" not in report.init_error
    assert report.driver_version == driver_version
    assert not report.timed_out
    assert not report.ok
    assert report.text().startswith("CUDA probe · SIMULATED")


def test_empty_cuda_visible_devices_means_no_device_at_cuinit():
    report = probe("4xA40", CUDA_VISIBLE_DEVICES="")

    assert report.init_outcome == "no_device"
    assert report.init_error is not None
    assert "no CUDA-capable device is detected" in report.init_error


def test_cgroup_restricted_gpus_are_not_enumerated():
    # NVML counts four GPUs, but CUDA lists only the one this process may open.
    report = probe("no-permission")

    assert [(r.cuda_index, r.nvml_index, r.outcome) for r in report.results] == [(0, 0, "ok")]


def test_mig_instance_is_probed_by_its_own_uuid():
    report = probe("mig")
    fleet = load_fleet("mig")

    (result,) = report.results
    assert result.nvml_index == 0
    assert result.uuid == fleet.gpus[0].mig_devices[0].uuid
    assert result.name == "NVIDIA A100-SXM4-40GB MIG 1g.5gb"


def test_fleet_json_cuda_error_becomes_the_outcome(tmp_path):
    fleet = parse_spec("3xA40")
    gpus = (
        fleet.gpus[0],
        replace(fleet.gpus[1], cuda_error=214),
        replace(fleet.gpus[2], cuda_error=2),
    )
    path = tmp_path / "pod.json"
    path.write_text(replace(fleet, gpus=gpus).to_json(), encoding="utf-8")

    report = probe_devices(environ={"NBGPU_SIMULATE": str(path)})

    assert [(r.outcome, r.error_name) for r in report.results] == [
        ("ok", None),
        ("ecc", "CUDA_ERROR_ECC_UNCORRECTABLE"),
        ("busy", "CUDA_ERROR_OUT_OF_MEMORY"),
    ]
    assert report.results[1].message == "uncorrectable ECC error encountered"


@pytest.mark.parametrize(
    ("code", "outcome"),
    [
        (0, "ok"),
        (46, "busy"),
        (2, "busy"),
        (100, "no_device"),
        (101, "no_device"),
        (999, "lost"),
        (803, "driver_mismatch"),
        (804, "driver_mismatch"),
        (34, "stub_library"),
        (800, "not_permitted"),
        (214, "ecc"),
        (700, "error"),
    ],
)
def test_outcome_for_cuda_codes(code, outcome):
    assert outcome_for(code) == outcome
    assert outcome in OUTCOMES


def test_report_round_trips_to_json_and_records():
    report = probe("4xA40,busy=0")

    data = report.to_dict()
    assert data["results"][0]["verdict"] == "busy"
    assert data["simulated"] is True
    assert [r["nvml_index"] for r in report.records()] == [0, 1, 2, 3]
    assert '"CUDA_ERROR_DEVICE_UNAVAILABLE"' in report.to_json()
    assert 'class="nbgpu-sim"' in report.html()


# ---------------------------------------------------------------- bad input, real path


def test_malformed_simulation_spec_is_one_line_before_any_process():
    with pytest.raises(FleetSpecError, match="unknown GPU model 'Z99'"):
        probe("4xZ99")


def test_non_positive_timeout_is_rejected():
    with pytest.raises(UserInputError, match="probe timeout 0"):
        probe_devices(environ={"NBGPU_SIMULATE": "4xA40"}, timeout_s=0)


def test_real_driver_path_without_a_driver_is_a_clean_outcome():
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        pass
    else:
        pytest.skip("a CUDA driver library is installed on this machine")
    environ = {k: v for k, v in os.environ.items() if k != "NBGPU_SIMULATE"}

    report = probe_devices(environ=environ)

    assert not report.simulated
    assert not report.timed_out
    assert report.results == ()
    assert report.init_outcome == "no_driver"
    assert report.init_error == (
        "cannot load libcuda.so.1: cannot open shared object file: No such file or directory"
    )
    assert "Traceback" not in report.text()
    assert "SIMULATED" not in report.text()


def test_probe_module_imports_nothing_heavy():
    code = (
        "import sys, nbgpu.devices.health, nbgpu.devices.sim.cuda\n"
        "print(sorted({'torch', 'pynvml', 'psutil', 'IPython'} & set(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------- processes: no leftovers

SLOW_CHILD = textwrap.dedent(
    """
    import os, subprocess, sys, time
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {grandchild.pid}")
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    sys.stderr.write("nbgpu-probe: cuInit\\nnbgpu-probe: cuda:2 context\\n")
    sys.stderr.flush()
    time.sleep(120)
    """
)


def test_timeout_kills_the_whole_probe_group_and_names_the_stuck_step(tmp_path):
    pids = tmp_path / "pids"
    started = time.monotonic()

    run = health_probe._run_child(
        [sys.executable, "-c", SLOW_CHILD, str(pids)], os.environ, timeout_s=3.0
    )
    report = health_probe._report(run, 3.0, simulated=False, uuids={})

    assert time.monotonic() - started < 20
    assert run.timed_out
    child, grandchild = map(int, pids.read_text().split())  # both were running
    assert child == run.pid
    assert gone(child)
    assert gone(grandchild)
    assert report.timed_out
    assert report.init_outcome == "timeout"
    assert report.results == ()
    assert report.init_error == (
        "the CUDA probe did not finish within 3 s (stuck in cuda:2 context); "
        "its process group was killed"
    )
    assert "reset the GPU or reboot" in report.text()


def test_tiny_timeout_on_the_real_probe_leaves_no_process():
    report = probe_devices(environ={"NBGPU_SIMULATE": "4xA40"}, timeout_s=0.001)

    assert report.timed_out
    assert report.init_outcome == "timeout"
    assert report.init_error is not None
    assert report.init_error.startswith("the CUDA probe did not finish within 0.001 s")
    assert probe_children() == []


@pytest.mark.usefixtures("sigint_raises")
def test_interrupt_while_probing_kills_the_probe_and_propagates(tmp_path):
    pids = tmp_path / "pids"

    def interrupt_when_running() -> None:
        deadline = time.monotonic() + 30
        while not pids.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)  # what Jupyter's "interrupt kernel" sends

    thread = threading.Thread(target=interrupt_when_running)
    thread.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            health_probe._run_child(
                [sys.executable, "-c", SLOW_CHILD, str(pids)], os.environ, timeout_s=60
            )
    finally:
        thread.join()

    child, grandchild = map(int, pids.read_text().split())
    assert gone(child)
    assert gone(grandchild)


def wait_for(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux-only")
def test_probe_process_dies_with_a_sigkilled_parent(tmp_path):
    # The kernel killed with -9 while a probe hangs in the driver: the probe must not linger.
    pidfile = tmp_path / "pid"
    child = (
        "import os, time\n"
        "from nbgpu.devices.health import _die_with_parent\n"
        "_die_with_parent()\n"
        f"open({str(pidfile)!r} + '.tmp', 'w').write(str(os.getpid()))\n"
        f"os.replace({str(pidfile)!r} + '.tmp', {str(pidfile)!r})\n"
        "time.sleep(120)\n"
    )
    kernel = (
        f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); "
        "time.sleep(120)"
    )
    parent = subprocess.Popen([sys.executable, "-c", kernel], start_new_session=True)
    try:
        assert wait_for(pidfile.exists, 30)
        probe_pid = int(pidfile.read_text())
        assert not gone(probe_pid)

        parent.kill()
        parent.wait(timeout=10)

        assert wait_for(lambda: gone(probe_pid), 5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        (
            "import sys; sys.stderr.write('boom: libcuda exploded\\n'); sys.exit(3)",
            "the CUDA probe process exited with code 3 without a report: boom: libcuda exploded",
        ),
        (
            "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)",
            "the CUDA probe process was killed by SIGSEGV: no output",
        ),
    ],
)
def test_a_crashing_probe_process_is_reported_in_one_line(script, expected):
    run = health_probe._run_child([sys.executable, "-c", script], os.environ, timeout_s=30)

    report = health_probe._report(run, 30, simulated=False, uuids={})

    assert report.init_outcome == "error"
    assert report.init_error == expected


# ------------------------------------------------------ the fake library, in-process


def new_doc() -> dict[str, object]:
    return {"format": 1, "simulated": True, "driver_version": None, "init": None, "devices": []}


def test_probe_releases_every_context_it_creates():
    library = SimulatedCudaLibrary(parse_spec("4xA40,busy=0,lost=3"), {})

    doc = health_probe._probe_library(CudaDriver(library), new_doc())

    assert [d["cuda_error"] for d in doc["devices"]] == [46, 0, 0, 999]
    assert library.calls["cuDevicePrimaryCtxRetain"] == 4  # one context per device
    assert library.calls["cuDevicePrimaryCtxRelease_v2"] == 2  # each success, released
    assert not library.retained


def test_fake_library_has_the_c_calling_shape():
    library = SimulatedCudaLibrary(parse_spec("2xA40"), {"CUDA_VISIBLE_DEVICES": "1"})
    count = ctypes.c_int(-1)

    assert library.cuDeviceGetCount(ctypes.byref(count)) == 3  # NOT_INITIALIZED before cuInit
    version = ctypes.c_int(0)
    assert library.cuDriverGetVersion(ctypes.pointer(version)) == 0  # works before cuInit
    assert version.value == 12040
    assert library.cuInit(ctypes.c_uint(0)) == 0
    assert library.cuDeviceGetCount(ctypes.byref(count)) == 0
    assert count.value == 1
    device = ctypes.c_int(-1)
    assert library.cuDeviceGet(ctypes.byref(device), 1) == 101  # CUDA_ERROR_INVALID_DEVICE
    name = ctypes.create_string_buffer(5)
    assert library.cuDeviceGetName(name, ctypes.c_int(5), ctypes.c_int(0)) == 0
    assert name.value == b"NVID"  # truncated and NUL-terminated, as the driver does
    text = ctypes.c_char_p()
    assert library.cuGetErrorName(ctypes.c_int(46), ctypes.byref(text)) == 0
    assert text.value == b"CUDA_ERROR_DEVICE_UNAVAILABLE"
    assert library.cuGetErrorString(12345, ctypes.byref(text)) == 1
    assert text.value is None
    assert library.cuDevicePrimaryCtxRelease_v2(0) == 201  # nothing retained


def test_old_driver_lacks_v2_symbols_and_the_probe_falls_back():
    library = SimulatedCudaLibrary(parse_spec("2xV100,old"), {})

    assert not hasattr(library, "cuDeviceGetUuid_v2")
    with pytest.raises(AttributeError, match="undefined symbol: cuDeviceGetUuid_v2"):
        _ = library.cuDeviceGetUuid_v2
    doc = health_probe._probe_library(CudaDriver(library), new_doc())

    assert doc["driver_version"] == 11000
    assert all(d["uuid"] and d["cuda_error"] == 0 for d in doc["devices"])
    assert library.calls["cuDeviceGetUuid"] == 2


def test_missing_context_symbol_is_an_error_outcome_not_a_crash():
    fleet = replace(parse_spec("1xA40"), missing_functions=frozenset({"cuDevicePrimaryCtxRetain"}))
    library = SimulatedCudaLibrary(fleet, {})

    doc = health_probe._probe_library(CudaDriver(library), new_doc())

    (device,) = doc["devices"]
    assert (device["cuda_error"], device["error_name"]) == (500, "CUDA_ERROR_NOT_FOUND")
    assert outcome_for(device["cuda_error"]) == "error"
