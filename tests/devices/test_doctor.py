"""The doctor's findings, fixes and recommendation on simulated fleets."""

import socket

import pytest

from nbgpu.devices.doctor import run_doctor


def doc(spec, base, *, probe=False, **env):
    return run_doctor({**base, "NBGPU_SIMULATE": spec, **env}, probe=probe)


def codes(report):
    return [f.code for f in report.findings]


def finding(report, code):
    return next(f for f in report.findings if f.code == code)


def test_busy_gpu0_end_to_end_with_the_probe(sim_env):
    report = doc("busy-gpu0", sim_env, probe=True)
    assert not report.ok
    dead = finding(report, "exclusive_dead_holder")
    assert "exclusive-process mode and held by pid" in dead.message
    assert "which no longer exists" in dead.message
    assert any("nvidia-smi --gpu-reset -i 0" in fix for fix in dead.fixes)
    assert any("--gpus 1,2,3" in fix for fix in dead.fixes)
    busy = finding(report, "probe_busy")
    assert "CUDA-capable device(s) is/are busy or unavailable" in busy.message
    assert busy.subject == "GPU 0"
    assert report.recommendation.startswith("launch 3 ranks on GPUs 1,2,3")
    text = report.text()
    assert "SIMULATED" in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_healthy_fleet_is_ok(sim_env):
    report = doc("healthy", sim_env, probe=True)
    assert report.ok
    assert codes(report) == ["healthy"]
    assert "launch 4 ranks" in report.recommendation


def test_nproc_mismatch_nproc_7_on_4_gpus(sim_env):
    report = doc("4xH100", sim_env, NPROC_PER_NODE="7")
    f = finding(report, "nproc_exceeds_gpus")
    assert f.message.startswith("NPROC_PER_NODE=7 but 4 GPUs are visible")
    assert "invalid device ordinal" in f.message


def test_nproc_argument_is_checked_too(sim_env):
    report = run_doctor({**sim_env, "NBGPU_SIMULATE": "2xA40"}, probe=False, nproc=3)
    assert finding(report, "nproc_exceeds_gpus").message.startswith("nproc=3 but 2 GPUs")


def test_local_rank_beyond_visible_devices(sim_env):
    report = doc("4xA40", sim_env, LOCAL_RANK="5")
    assert finding(report, "local_rank_exceeds_gpus").message.startswith(
        "local_rank 5 >= 4 visible devices"
    )


def test_visible_devices_limit_the_count(sim_env):
    report = doc("4xA40", sim_env, CUDA_VISIBLE_DEVICES="0,1", NPROC_PER_NODE="4")
    assert (
        "NPROC_PER_NODE=4 but 2 GPUs are visible" in finding(report, "nproc_exceeds_gpus").message
    )


def test_nothing_visible(sim_env):
    report = doc("4xA40", sim_env, CUDA_VISIBLE_DEVICES="")
    assert "nothing_visible" in codes(report)


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"LOCAL_RANK": "abc"}, "LOCAL_RANK='abc' is not a whole number"),
        ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK=4 but WORLD_SIZE=4"),
        ({"MASTER_PORT": "99999"}, "MASTER_PORT='99999' is not a port number"),
    ],
)
def test_bad_distributed_env(env, fragment, sim_env):
    report = doc("4xA40", sim_env, **env)
    assert any(fragment in f.message for f in report.findings), codes(report)


def test_master_port_in_use(sim_env):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        report = doc("4xA40", sim_env, MASTER_PORT=str(port), MASTER_ADDR="127.0.0.1")
    assert f"MASTER_PORT={port} is already in use" in finding(report, "port_in_use").message


@pytest.mark.parametrize(
    ("scenario", "fragment"),
    [
        ("no-driver", "kernel driver is not loaded"),
        ("no-library", "No NVIDIA driver library"),
        ("lib-mismatch", "Driver/library version mismatch"),
    ],
)
def test_driver_failures(scenario, fragment, sim_env):
    report = doc(scenario, sim_env)
    f = finding(report, "nvml_unavailable")
    assert fragment in f.message
    assert f.fixes
    assert report.recommendation is None


def test_gpu_lost_excluded_from_recommendation(sim_env):
    report = doc("gpu-lost", sim_env, probe=True)
    assert "gpu_lost" in codes(report)
    assert "GPUs 0,1,3" in report.recommendation


def test_report_converts(sim_env):
    report = doc("busy-gpu0", sim_env)
    data = report.to_dict()
    assert data["worst"] == "bad"
    assert data["inventory"]["simulated"] is True
    frame = report.to_frame()
    assert "exclusive_dead_holder" in set(frame["code"])
    assert "Recommendation" in report._repr_mimebundle_()["text/html"]
