"""Named fleets: the situations nbgpu was built to explain, and one per failure mode.

``NBGPU_SIMULATE=busy-gpu0`` (or ``busy-gpu0,procs=8`` to add options). Each is a spec
and a description; ``shared-sweeps`` adds the two sweep runs' ranks. Pure; never
touches NVML or processes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from nbgpu.devices.fleet import MIB, Fleet, ObservedProcess, SimProcess
from nbgpu.devices.fleetspec import FICTIONAL_PID_BASE, parse_spec
from nbgpu.errors import FleetSpecError

__all__ = ["SCENARIOS", "scenario", "scenario_key"]

# ------------------------------------------------------------------------ scenarios

#: Named fleets: the situations nbgpu was built to explain, and one per failure mode.
SCENARIOS: Mapping[str, tuple[str, str]] = {
    "healthy": ("4xA40", "4x A40, all idle and healthy"),
    "busy-gpu0": (
        "4xA40,busy=0",
        "4x A40, GPU 0 in exclusive-process mode held by a process that is gone",
    ),
    "nproc-mismatch": (
        "4xH100,zombie=0+1",
        (
            "a 4-GPU box where the script hard-codes 7 ranks, and GPUs 0-1 are still "
            "held by defunct ranks of a previous run"
        ),
    ),
    "shared-sweeps": (
        "8xH100",
        (
            "an 8x H100 node shared by concurrent sweep runs (run1 on GPUs 0-1, "
            "run2 on 2-3, each rank with its own CUDA_VISIBLE_DEVICES); GPUs 4-7 free"
        ),
    ),
    "import-storm": ("8xH100", "an 8x H100 node where 8 ranks import heavy libraries at once"),
    "rescale-2-to-4": ("4xA40", "a 4x A40 pod to which a 2-GPU training config is rescaled"),
    "exclusive-dead": ("4xA40,busy=0", "exclusive-process GPU 0 held by a dead process"),
    "zombie-holder": ("4xA40,exclusive=1,zombie=1", "GPU 1 held by a zombie (defunct) process"),
    "other-namespace": (
        "4xA40,otherns=0",
        "GPU 0 held by a process in another PID namespace (a container sees host pids)",
    ),
    "gpu-lost": ("4xA40,lost=2", "GPU 2 has fallen off the bus (Xid 79)"),
    "no-driver": ("4xA40,init=driver_not_loaded", "the NVIDIA kernel driver is not loaded"),
    "no-library": ("4xA40,init=library_not_found", "libnvidia-ml.so.1 is not installed"),
    "lib-mismatch": (
        "4xA40,init=lib_rm_version_mismatch",
        "driver/library version mismatch (userspace upgraded, kernel module not reloaded)",
    ),
    "no-permission": (
        "4xA40,noperm=1+2+3",
        "cgroup-restricted: 4 GPUs counted, only GPU 0 accessible",
    ),
    "mig": ("1xA100,mig=0", "an A100 split into seven 1g.5gb MIG instances"),
    "old-driver": ("2xV100,old", "an old driver without the _v2/_v3 NVML symbols"),
    "pending-remap": ("4xA100-80GB,remap=3", "GPU 3 has a pending row remap: reset required"),
    "wedged": ("4xA40,wedged=1", "GPU 1 reports 100 % utilisation with nothing running"),
}


def scenario_key(name: str) -> str | None:
    """The scenario a name means, or None."""
    return name if name in SCENARIOS else None


def scenario(name: str) -> Fleet:
    """The named scenario's fleet."""
    key = scenario_key(name)
    if key is None:
        raise FleetSpecError(f"{name!r} is not a scenario; scenarios: {', '.join(SCENARIOS)}")
    spec, description = SCENARIOS[key]
    fleet = replace(parse_spec(spec), name=name, description=description)
    if key == "shared-sweeps":
        fleet = _with_sweep_runs(fleet)
    return fleet


def _with_sweep_runs(fleet: Fleet) -> Fleet:
    """A box shared by two sweep runs, each rank seeing its own CUDA_VISIBLE_DEVICES."""
    gpus = list(fleet.gpus)
    runs = (("my_sweep.run1", "0,1", (0, 1)), ("my_sweep.run2", "2,3", (2, 3)))
    pid = FICTIONAL_PID_BASE + 100
    for run_name, cvd, indices in runs:
        for local_rank, index in enumerate(indices):
            observed = ObservedProcess(
                state="running",
                user="sweep",
                command=f"python tools/train.py run={run_name} local_rank={local_rank}",
                visible_devices=cvd,
            )
            proc = SimProcess(pid=pid, used_bytes=31 * 1024 * MIB, observed=observed)
            gpus[index] = replace(
                gpus[index],
                processes=(proc,),
                utilization_gpu_pct=97,
                power_w=610.0,
                temperature_c=71,
            )
            pid += 1
    return replace(fleet, gpus=tuple(gpus))
