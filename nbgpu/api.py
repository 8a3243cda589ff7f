"""The Python API behind every face: ``nbgpu.status()``, ``nbgpu.doctor()``, ``nbgpu.clean()``.

Magics and the CLI only parse arguments and call these; never imports IPython. Each takes
the environment as a mapping (default ``os.environ``): tests and scripts never patch the
process environment.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from nbgpu.devices.inventory import Inventory, take_inventory
from nbgpu.errors import UserInputError, user_path

if TYPE_CHECKING:  # clean and doctor load only when used: `nbgpu status` stays quick
    from nbgpu.devices.clean import CleanPlan, CleanReport
    from nbgpu.devices.doctor import DoctorReport
    from nbgpu.profile.report import MemoryReport

__all__ = ["clean", "doctor", "memory", "simulate", "status"]

#: The pod every tutorial shares unless it tells its own story (``make demo`` and nbval set it).
SHARED_FLEET = "busy-gpu0"


def status(
    *,
    probe: bool = False,
    visible_devices: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Inventory:
    """Snapshot every GPU: health, memory, holders and the cuda:N → GPU mapping (for the
    ``CUDA_VISIBLE_DEVICES`` value ``visible_devices`` instead of this environment's, if
    given). ``probe=True`` also creates a CUDA context on each GPU in a short-lived
    subprocess (the only way to see "busy or unavailable")."""
    return take_inventory(environ, visible_devices=visible_devices, probe=probe)


def doctor(
    *,
    probe: bool = True,
    nproc: int | None = None,
    environ: Mapping[str, str] | None = None,
    face: str = "python",
) -> DoctorReport:
    """One report: each GPU's health, the launch environment checked, and fixes. ``nproc``
    checks a planned number of ranks per node against the visible GPUs (``NPROC_PER_NODE``
    from the environment is checked either way)."""
    if nproc is not None and nproc < 1:
        raise UserInputError(f"nproc={nproc}: expected a whole number >= 1")
    from nbgpu.devices.doctor import run_doctor  # noqa: PLC0415

    return run_doctor(environ, probe=probe, nproc=nproc, face=face)


def clean(
    *,
    yes: bool = False,
    dry_run: bool = False,
    grace_s: float = 3.0,
    confirm: Callable[[CleanPlan], bool] | None = None,
    environ: Mapping[str, str] | None = None,
) -> CleanReport:
    """List this user's stale GPU holders, then stop them by pid after confirmation: never
    another user's process, never a match by name. ``dry_run`` only lists. Without ``yes``
    the ``confirm`` callback is asked (the CLI and the magic ask on the terminal / in the
    cell); with neither, nothing is signalled."""
    from nbgpu.devices.clean import execute_clean, plan_clean  # noqa: PLC0415

    inventory = take_inventory(environ)
    holders = {
        gpu.nvml_index: [p.holder for p in gpu.processes if p.holder is not None]
        for gpu in inventory.gpus
    }
    plan = plan_clean(holders, inventory.device_files)
    asker = None if yes else confirm or (lambda _plan: False)
    return execute_clean(plan, confirm=asker, dry_run=dry_run, grace_s=grace_s)


def memory(run_or_dir: object = None, *, environ: Mapping[str, str] | None = None) -> MemoryReport:
    """Memory by phase and rank: ``nbgpu.memory(run)``, a run name (this process's runs first, then
    the newest directory of that name under ``NBGPU_RUNS_DIR``) or a run directory. No argument:
    this process's last run, else this process's own phases (``nbgpu.phase``, ``%%gpu_phase``)."""
    from nbgpu.launch.execute import runs  # noqa: PLC0415
    from nbgpu.launch.rundirs import runs_root  # noqa: PLC0415
    from nbgpu.profile.phases import recorder  # noqa: PLC0415
    from nbgpu.profile.report import memory_report, report_from_recorder  # noqa: PLC0415

    known = runs()
    if run_or_dir is None:
        if known:
            last = list(known.values())[-1]
            return memory_report(last.dir, label=f"run '{last.name}'")
        return report_from_recorder(recorder(), label="this process")
    if hasattr(run_or_dir, "dir") and hasattr(run_or_dir, "name"):
        return memory_report(run_or_dir.dir, label=f"run '{run_or_dir.name}'")
    if not isinstance(run_or_dir, str | Path):
        raise UserInputError(f"{run_or_dir!r}: expected a run, a run name or a run directory")
    text = str(run_or_dir)
    if text in known:
        return memory_report(known[text].dir, label=f"run '{text}'")
    path = user_path(text)
    if path.is_dir():
        return memory_report(path)
    root = runs_root(environ)
    pattern = re.compile(re.escape(text) + r"-\d{8}-\d{6}-[0-9a-f]{4}$")
    try:
        named = [p for p in root.iterdir() if p.is_dir() and pattern.match(p.name)]
    except OSError:
        named = []
    if named:
        newest = max(named, key=lambda p: p.name[len(text) :])
        return memory_report(newest, label=f"run '{text}'")
    here = ", ".join(known) or "none in this process"
    raise UserInputError(
        f"no run named {text!r} (runs: {here}) and no run directory {str(path)!r}; give a "
        f"run name or a directory under {root}"
    )


def simulate(fleet: str) -> str:
    """What a notebook runs on, said in one line: this machine's GPUs when it has any, else
    the simulated *fleet* (``NBGPU_SIMULATE``, set for this process and its runs). A fleet
    chosen beforehand wins (``NBGPU_SIMULATE=`` empty: real GPUs, none if there are none),
    except the shared tutorial pod, which a notebook's own *fleet* replaces. Returns the
    simulated fleet's name, "" for real GPUs."""
    chosen = os.environ.get("NBGPU_SIMULATE")
    if chosen is None and status(environ={**os.environ, "NBGPU_SIMULATE": ""}).gpus:
        chosen = ""
    if chosen is None:
        said = "No GPU found: this notebook shows"
    elif chosen == SHARED_FLEET and fleet != chosen:
        said = "This notebook uses"
    elif chosen:
        said, fleet = "NBGPU_SIMULATE is set: this notebook shows", chosen
    else:
        print("Real GPUs: nothing in this notebook is simulated.")
        return ""
    os.environ["NBGPU_SIMULATE"] = fleet
    print(f"{said} the SIMULATED fleet {fleet!r}.")
    return fleet
