import os
from dataclasses import replace

from nbgpu.devices.health import ProbeReport, ProbeResult
from nbgpu.plan.placement import candidates_from_inventory


def _by_index(inv):
    return {c.nvml_index: c for c in candidates_from_inventory(inv)}


def test_busy_gpu0_busy_gpu_is_unusable_and_recoverable(inventory):
    cands = _by_index(inventory("busy-gpu0"))
    busy = cands[0]
    assert not busy.usable
    assert busy.recoverable
    assert "busy or unavailable" in busy.problems[0].message
    assert any("gpu-reset" in f for p in busy.problems for f in p.fixes)
    assert all(cands[i].usable and cands[i].grade == 0 for i in (1, 2, 3))


def test_lost_and_no_permission_gpus_are_unusable_for_good(inventory):
    lost = _by_index(inventory("gpu-lost"))[2]
    assert not lost.usable
    assert not lost.recoverable
    noperm = _by_index(inventory("no-permission"))
    assert [i for i, c in noperm.items() if c.usable] == [0]


def test_warnings_leave_a_gpu_usable_with_caveats(inventory):
    cands = _by_index(inventory("other-namespace"))
    assert cands[0].usable
    assert cands[0].grade == 1
    assert "not in this PID namespace" in cands[0].problems[0].message


def test_exclusive_gpu_held_by_a_live_process_is_unusable(inventory):
    # This test process stands in as the live holder of GPU 1.
    cands = _by_index(inventory(f"4xA40,exclusive=1,holder=1:{os.getpid()}"))
    assert not cands[1].usable
    assert cands[1].health == "busy (exclusive)"


def test_mig_mode_gpu_is_not_given_out_whole(inventory):
    (mig,) = candidates_from_inventory(inventory("mig"))
    assert not mig.usable
    assert "MIG" in mig.health


def test_a_failed_probe_makes_a_gpu_unusable(inventory):
    inv = inventory("healthy")
    failed = ProbeResult(
        cuda_index=2,
        nvml_index=2,
        uuid=inv.gpus[2].uuid,
        name="NVIDIA A40",
        outcome="busy",
        cuda_error=46,
        error_name="CUDA_ERROR_DEVICES_UNAVAILABLE",
        message="CUDA-capable device(s) is/are busy or unavailable",
        elapsed_ms=1.0,
    )
    probe = ProbeReport((failed,), 12040, None, None, simulated=True, timed_out=False, elapsed_ms=1)
    cands = _by_index(replace(inv, probe=probe))
    assert not cands[2].usable
    assert cands[2].health == "probe: busy"
    assert cands[2].recoverable
