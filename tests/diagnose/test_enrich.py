"""With an inventory (here a simulated fleet), findings name the physical GPU and the exact fix."""

from __future__ import annotations

from pathlib import Path

from nbgpu.devices.inventory import take_inventory
from nbgpu.diagnose import diagnose

from .helpers import write_run

BUSY = "RuntimeError: CUDA error: CUDA-capable device(s) is/are busy or unavailable\n"


def _rank(rank: int, exit_code: int, ended: float) -> dict[str, object]:
    return {
        "rank": rank,
        "local_rank": rank,
        "exit_code": exit_code,
        "signal": None,
        "pid": 10 + rank,
        "ended_at": ended,
    }


def test_busy_gpu_names_the_dead_holder_and_the_gpus_to_use(
    tmp_path: Path, sim_env: dict[str, str]
) -> None:
    inventory = take_inventory({**sim_env, "NBGPU_SIMULATE": "busy-gpu0"}, scan_device_files=False)
    run = write_run(tmp_path / "run", ranks=[_rank(0, 1, 1.0), _rank(1, -15, 2.0)], logs={0: BUSY})
    result = diagnose(run, inventory=inventory)
    root = result.root
    assert (root.cause, root.first_rank) == ("cuda_busy", 0)
    line = next(d for d in root.details if d.startswith("rank 0"))
    assert "physical GPU 0 (exclusive-process)" in line
    assert "held by dead pid" in line
    assert root.fixes[0].startswith("free GPU 0: `nbgpu clean`")
    assert "`%%torchrun --gpus 1,2,3`" in root.fixes[1]
    assert result.inventory == "simulated fleet 'busy-gpu0'"


def test_run_json_gpus_map_ranks_to_physical_gpus(tmp_path: Path, sim_env: dict[str, str]) -> None:
    inventory = take_inventory({**sim_env, "NBGPU_SIMULATE": "busy-gpu0"}, scan_device_files=False)
    run = write_run(
        tmp_path / "run", ranks=[_rank(0, -15, 2.0), _rank(1, 1, 1.0)], logs={1: BUSY}, gpus="3,0"
    )
    root = diagnose(run, inventory=inventory).root
    assert any(d.startswith("rank 1 -> cuda:1 -> physical GPU 0") for d in root.details)
    # Without an inventory, run.json alone still names the physical GPU.
    plain = diagnose(run).root
    assert "rank 1 ran on cuda:1 = physical GPU 0 (run.json)" in plain.details


def test_invalid_ordinal_names_the_visible_gpu_count(
    tmp_path: Path, sim_env: dict[str, str]
) -> None:
    inventory = take_inventory({**sim_env, "NBGPU_SIMULATE": "4xA40"}, scan_device_files=False)
    ranks = [_rank(r, 1 if r >= 4 else -15, 1.0 if r >= 4 else 2.0) for r in range(7)]
    logs = dict.fromkeys(range(4, 7), "RuntimeError: CUDA error: invalid device ordinal\n")
    result = diagnose(write_run(tmp_path / "run", ranks=ranks, logs=logs), inventory=inventory)
    root = result.root
    assert root.cause == "invalid_ordinal"
    assert (
        "CUDA sees 4 GPUs here (CUDA_VISIBLE_DEVICES unset), but the run started 7 ranks per node"
        in root.details
    )
    assert root.fixes[0].startswith("start at most 4 ranks per node: `%%torchrun 4`")
    assert any("the job sees 4 GPUs" in d for d in root.details)


def test_lost_gpu_and_missing_driver(sim_env: dict[str, str]) -> None:
    lost = take_inventory({**sim_env, "NBGPU_SIMULATE": "gpu-lost"}, scan_device_files=False)
    root = diagnose("RuntimeError: CUDA error: unknown error\n", inventory=lost).root
    assert root.cause == "gpu_lost"
    assert "NVML reports GPU 2 lost on this machine" in root.details
    assert "`%%torchrun --gpus 0,1,3`" in root.fixes[0]
    nodriver = take_inventory({**sim_env, "NBGPU_SIMULATE": "no-driver"}, scan_device_files=False)
    root = diagnose(
        "RuntimeError: Found no NVIDIA driver on your system.\n", inventory=nodriver
    ).root
    assert root.cause == "driver"
    assert any(d.startswith("NVML on this machine:") for d in root.details)
